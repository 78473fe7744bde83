"""The ``ckpt`` command: real console script in a subprocess for exit codes and configuration,
typer's runner for the rest. Every command runs against SQLite and PostgreSQL."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from checkpointing.cli import app
from checkpointing.config import CheckpointConfig
from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.pending import TaskAck, TaskSpec
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import CheckpointRequest
from checkpointing.state.storage import FileSystemCheckpointStorage

CKPT = str(Path(sys.executable).with_name("ckpt"))
#: the demos (``make demo``) run from the checkout: ``python -m demo``
DEMO = (sys.executable, "-m", "demo")
CHECKOUT = Path(__file__).resolve().parent.parent


def run_ckpt(
    *args: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    command: tuple[str, ...] = (CKPT,),
) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    full_env.update(env or {})
    return subprocess.run(
        [*command, *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=120,
        check=False,
    )


def make_history(metastore: Metastore, storage: FileSystemCheckpointStorage) -> None:
    """Job 'etl' with two completed checkpoints (one subsumed) and an aborted one."""
    plan = [TaskSpec("agg", i, f"att-{i}", 2) for i in range(2)]
    coord = CheckpointCoordinator(
        "etl", metastore, storage, CheckpointConfig(retained=1), plan_provider=lambda: plan
    )
    for _ in range(2):
        pending = coord.trigger_checkpoint()
        loc = storage.location_for(pending.location)
        acks = []
        for t in plan:
            info = storage.write_bytes(loc.file_url(f"agg-{t.subtask_index}"), b"x" * 10)
            acks.append(TaskAck(t.attempt_id, info.url, info.size, info.checksum, 1, 2))
        assert coord.receive_acknowledge(pending.checkpoint_id, acks).completed is not None
    pending = coord.trigger_checkpoint()
    coord.receive_decline(pending.checkpoint_id, "att-1", "out of disk")


def test_list_show_jobs_tables_and_json(metastore: Metastore, tmp_path: Path) -> None:
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    make_history(metastore, storage)
    url = metastore.url.render_as_string(hide_password=False)
    runner = CliRunner()

    result = runner.invoke(app, ["--metastore-url", url, "list", "etl", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(r["checkpoint_id"], r["status"]) for r in rows] == [
        (3, "ABORTED"),
        (2, "COMPLETED"),
        (1, "SUBSUMED"),
    ]
    assert rows[0]["failure_reason"] == "CHECKPOINT_DECLINED"
    assert "out of disk" in rows[0]["failure_message"]
    assert rows[1]["acked_tasks"] == rows[1]["num_tasks"] == 2
    assert rows[1]["state_size"] == 20

    result = runner.invoke(
        app, ["--metastore-url", url, "list", "etl", "--status", "completed", "--json"]
    )
    assert [r["checkpoint_id"] for r in json.loads(result.stdout)] == [2]

    result = runner.invoke(app, ["--metastore-url", url, "list", "etl"])
    assert result.exit_code == 0
    assert "COMPLETED" in result.stdout and "CHECKPOINT_DECLINED" in result.stdout

    result = runner.invoke(app, ["--metastore-url", url, "show", "etl", "2", "--json"])
    detail = json.loads(result.stdout)
    assert detail["metadata_path"].endswith("/etl/chk-2/_metadata")
    assert [
        (t["operator_id"], t["subtask_index"], t["state_size"], t["async_ms"])
        for t in detail["tasks"]
    ] == [
        ("agg", 0, 10, 2),
        ("agg", 1, 10, 2),
    ]
    assert [
        (o["operator_id"], o["acked"], o["subtasks"], o["state_size"]) for o in detail["operators"]
    ] == [("agg", 2, 2, 20)]
    result = runner.invoke(app, ["--metastore-url", url, "show", "etl", "2"], terminal_width=200)
    assert result.exit_code == 0 and "att-1" in result.stdout
    assert re.search(r"agg\s*│\s*2/2\s*│\s*20 B", result.stdout), result.stdout  # Operators

    result = runner.invoke(app, ["--metastore-url", url, "jobs", "--json"])
    jobs = json.loads(result.stdout)
    assert jobs[0]["job_id"] == "etl"
    assert jobs[0]["checkpoints"] == {"COMPLETED": 1, "SUBSUMED": 1, "ABORTED": 1}


def test_show_says_which_input_each_run_consumed(metastore: Metastore, tmp_path: Path) -> None:
    from tests.helpers import JOB
    from tests.test_input_views import BIG, NEW, checkpoint_with_source_state

    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    cid = checkpoint_with_source_state(metastore, storage)
    base = ["--metastore-url", metastore.url.render_as_string(hide_password=False)]
    runner = CliRunner()

    result = runner.invoke(app, [*base, "show", JOB, str(cid), "--json"])
    assert result.exit_code == 0, result.output
    section = json.loads(result.stdout)["input"]
    assert [(r["attempt"], r["first_epoch"], r["last_epoch"]) for r in section["runs"]] == [
        ("run-1", 0, 1),
        ("run-2", 2, 2),
    ]
    assert [f["path"] for f in section["files"]] == ["/data/in/a.csv", BIG.path, NEW.path]

    table = runner.invoke(app, [*base, "show", JOB, str(cid)])
    assert table.exit_code == 0, table.output
    rows = [line for line in table.stdout.splitlines() if "run-" in line and "│" in line]
    assert [[c.strip() for c in r.split("│")[1:-1]] for r in rows] == [
        ["run-1", "0-1", "2", "2", "5.0 KiB"],
        ["run-2", "2", "1", "1", "4.9 KiB"],
    ]
    assert (
        "input: 2 files read (5.0 KiB), 1 split still to read; the next run starts at epoch 3"
        in table.stdout
    )
    assert NEW.path not in table.stdout  # the files only with --files
    files = runner.invoke(app, [*base, "show", JOB, str(cid), "--files"])
    assert files.exit_code == 0, files.output
    assert "Input files" in files.stdout and NEW.path in files.stdout
    assert "2023-11-14 22:13:20" in files.stdout and "run-1, run-2" in files.stdout

    # a job whose tasks are no source: no input recorded, said in one line
    make_history(metastore, storage)
    plain = runner.invoke(app, [*base, "show", "etl", "2"])
    assert "input: not recorded" in plain.stdout
    assert (
        json.loads(runner.invoke(app, [*base, "show", "etl", "2", "--json"]).stdout)["input"]
        is None
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["list", "nope"], "unknown job 'nope'"),
        (["show", "etl", "99"], "job etl has no checkpoint 99"),
        (["show", "etl", "abc"], "invalid checkpoint id 'abc'"),
        (["show", "../etc", "1"], "invalid job id '../etc'"),
    ],
)
def test_unknown_ids_exit_non_zero(
    metastore: Metastore, tmp_path: Path, args: list[str], message: str
) -> None:
    make_history(metastore, FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}"))
    result = run_ckpt("--metastore-url", metastore.url.render_as_string(hide_password=False), *args)
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_unmigrated_metastore_tells_to_upgrade_and_writes_nothing(tmp_path: Path) -> None:
    db = tmp_path / "fresh.db"
    result = run_ckpt("--metastore-url", f"sqlite:///{db}", "jobs")
    assert result.returncode == 3
    assert "run `ckpt db upgrade`" in result.stderr
    tables = sqlite3.connect(db).execute("select name from sqlite_master").fetchall()
    assert tables == []

    result = run_ckpt("--metastore-url", f"sqlite:///{db}", "db", "upgrade")
    assert result.returncode == 0, result.stderr
    assert f"empty -> {Metastore.head_revision()}" in result.stdout
    result = run_ckpt("--metastore-url", f"sqlite:///{db}", "db", "upgrade")
    assert "up to date" in result.stdout
    assert run_ckpt("--metastore-url", f"sqlite:///{db}", "jobs").returncode == 0


def test_unreachable_metastore_is_a_clear_error_without_secrets() -> None:
    result = run_ckpt("--metastore-url", "postgresql://ckpt:s3cret@127.0.0.1:1/nowhere", "jobs")
    assert result.returncode == 1
    assert (
        "cannot reach the metastore at postgresql+psycopg://ckpt:***@127.0.0.1:1/nowhere"
        in result.stderr
    )
    assert "s3cret" not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr


def test_unsupported_metastore_url() -> None:
    result = run_ckpt("--metastore-url", "mysql://127.0.0.1/x", "jobs")
    assert result.returncode == 1
    assert "only sqlite:// and postgresql:// are supported" in result.stderr


def test_configuration_precedence_flag_env_default(tmp_path: Path) -> None:
    home, env_db, flag_db = tmp_path / "home", tmp_path / "env.db", tmp_path / "flag.db"
    env = {"CKPT_HOME": str(home)}
    result = run_ckpt("db", "upgrade", env=env)
    assert result.returncode == 0, result.stderr
    assert (home / "metastore.db").exists()  # default: under CKPT_HOME

    env["CKPT_METASTORE_URL"] = f"sqlite:///{env_db}"
    assert run_ckpt("db", "upgrade", env=env).returncode == 0
    assert env_db.exists()

    assert (
        run_ckpt("--metastore-url", f"sqlite:///{flag_db}", "db", "upgrade", env=env).returncode
        == 0
    )
    assert flag_db.exists()


def test_default_home_is_project_local(tmp_path: Path) -> None:
    result = run_ckpt("db", "upgrade", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / ".ckpt" / "metastore.db").exists()


def test_demo_runs_a_full_cycle_on_embedded_defaults(tmp_path: Path) -> None:
    result = run_ckpt(
        "--core", env={"CKPT_HOME": str(tmp_path / "home")}, cwd=CHECKOUT, command=DEMO
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok: restored from CHECKPOINT" in result.stdout
    assert "SUBSUMED" in result.stdout and "SAVEPOINT" not in result.stderr
    listing = run_ckpt("list", "demo-core", "--json", env={"CKPT_HOME": str(tmp_path / "home")})
    rows = json.loads(listing.stdout)
    statuses = {r["status"] for r in rows}
    assert {"COMPLETED", "SUBSUMED", "ABORTED"} <= statuses
    assert any(r["type"] == "SAVEPOINT" and r["status"] == "COMPLETED" for r in rows)
    restores = json.loads(
        run_ckpt(
            "restores", "demo-core", "--json", env={"CKPT_HOME": str(tmp_path / "home")}
        ).stdout
    )
    assert (
        restores[0]["fallbacks"]
        and restores[0]["checkpoint_id"] < restores[0]["fallbacks"][0]["checkpoint_id"]
    )


def test_summary_and_discard_savepoint(metastore: Metastore, tmp_path: Path) -> None:
    """CLI parity with the Checkpoints page: its summary, and discarding a savepoint."""
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    make_history(metastore, storage)
    url = metastore.url.render_as_string(hide_password=False)
    runner = CliRunner()
    base = ["--metastore-url", url, "--storage-url", f"file://{tmp_path / 'ckpt'}"]

    result = runner.invoke(app, [*base, "summary", "etl", "--json"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)
    assert stats["counts"] == {"COMPLETED": 1, "SUBSUMED": 1, "ABORTED": 1}
    assert stats["state_size"] == {"min": 20, "avg": 20.0, "max": 20}
    assert stats["latest_completed"]["checkpoint_id"] == 2
    assert stats["latest_failed"]["checkpoint_id"] == 3
    assert stats["latest_savepoint"] is None
    table = runner.invoke(app, [*base, "summary", "etl"])
    assert table.exit_code == 0, table.output
    assert "Latest completed" in table.stdout and "checkpoint 2 (COMPLETED" in table.stdout

    # a checkpoint is not a savepoint: refused, nothing deleted
    refused = run_ckpt(*base, "discard", "etl", "2", "--yes")
    assert refused.returncode == 1 and "savepoint" in refused.stderr + refused.stdout
    assert (tmp_path / "ckpt" / "etl" / "chk-2" / "_metadata").exists()

    plan = [TaskSpec("agg", 0, "att-0", 1)]
    coord = CheckpointCoordinator(
        "etl", metastore, storage, CheckpointConfig(), plan_provider=lambda: plan
    )
    pending = coord.trigger_savepoint()
    loc = storage.location_for(pending.location)
    info = storage.write_bytes(loc.file_url("agg-0"), b"y" * 5)
    done = coord.receive_acknowledge(
        pending.checkpoint_id, [TaskAck("att-0", info.url, info.size, info.checksum)]
    ).completed
    assert done is not None
    savepoint_dir = Path(done.location.removeprefix("file://"))
    assert savepoint_dir.exists()
    result = runner.invoke(app, [*base, "discard", "etl", str(done.checkpoint_id), "--yes"])
    assert result.exit_code == 0, result.output
    assert not savepoint_dir.exists()
    rows = json.loads(runner.invoke(app, [*base, "list", "etl", "--json"]).stdout)
    assert {r["checkpoint_id"]: r["status"] for r in rows}[done.checkpoint_id] == "DISCARDED"


# ------------------------------------------------------------------ user text, bad input


def test_user_text_is_printed_as_text_not_markup(metastore: Metastore, tmp_path: Path) -> None:
    """Ids, file names and stored messages are never read as Rich markup: ``[/x]`` used to crash
    every ``ckpt list``/``show`` of the job (MarkupError), ``[bold]`` silently vanished."""
    from sqlalchemy import update

    from checkpointing.metastore.models import Checkpoint

    make_history(metastore, FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}"))
    with metastore.transaction() as s:
        s.execute(
            update(Checkpoint)
            .where(Checkpoint.checkpoint_id == 3)
            .values(failure_message="disk [/x] full, [bold]really[/bold]")
        )
    url = metastore.url.render_as_string(hide_password=False)
    runner = CliRunner()
    for args in (["list", "etl"], ["show", "etl", "3"]):
        result = runner.invoke(app, ["--metastore-url", url, *args])
        assert result.exit_code == 0, result.output
        assert "disk [/x] full, [bold]really[/bold]" in result.stdout.replace("\n", "")

    result = runner.invoke(app, ["--metastore-url", url, "list", "x[/y]"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert "'x[/y]'" in result.stderr

    spec = tmp_path / "[bold]spec.yaml"
    result = runner.invoke(app, ["--metastore-url", url, "run", str(spec)])
    assert result.exit_code == 1
    assert f"error: {spec}: no such pipeline spec" in result.stderr


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["list", "etl", "--limit", "99999999999999999999"], "--limit"),
        (["list", "etl", "--status", "bogus"], "--status"),
        (["list", "etl", "--type", "bogus"], "--type"),
        (["requests", "etl", "--limit", "99999999999999999999"], "--limit"),
        (["savepoint", "etl", "--wait", "--timeout", "9999999999d"], "--timeout"),
        (["savepoint", "etl", "--timeout", "100000000000000000000"], "--timeout"),
    ],
)
def test_bad_options_are_refused_naming_the_option(
    metastore: Metastore, tmp_path: Path, args: list[str], option: str
) -> None:
    make_history(metastore, FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}"))
    url = metastore.url.render_as_string(hide_password=False)
    result = CliRunner().invoke(app, ["--metastore-url", url, *args])
    assert result.exit_code == 2, result.output
    assert option in result.output
    assert not isinstance(result.exception, OverflowError)
    with metastore.transaction() as s:  # no savepoint was requested
        assert s.query(CheckpointRequest).count() == 0


def test_a_listing_by_status_or_type_is_case_insensitive(
    metastore: Metastore, tmp_path: Path
) -> None:
    make_history(metastore, FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}"))
    url = metastore.url.render_as_string(hide_password=False)
    base = ["--metastore-url", url, "list", "etl", "--json"]
    result = CliRunner().invoke(app, [*base, "--status", "Aborted", "--type", "checkpoint"])
    assert [r["checkpoint_id"] for r in json.loads(result.stdout)] == [3]
    result = CliRunner().invoke(app, [*base, "--status", "COMPLETED", "--type", "CHECKPOINT"])
    assert [r["checkpoint_id"] for r in json.loads(result.stdout)] == [2]  # as printed


def test_savepoint_wait_says_what_it_waits_for(tmp_path: Path) -> None:
    """Not silent: off a terminal, one line per state of the request (a spinner on one)."""
    from checkpointing.metastore.models import Job

    url = f"sqlite:///{tmp_path / 'm.db'}"
    Metastore(url, check_schema=False).upgrade()
    metastore = Metastore(url)
    make_history(metastore, FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}"))
    with metastore.transaction() as s:  # as if it ran: nothing takes the request
        s.get(Job, "etl").status = "RUNNING"
    base = ["--metastore-url", url, "savepoint", "etl", "--wait", "--timeout", "1s"]
    result = CliRunner().invoke(app, base)
    assert result.exit_code == 1
    assert result.stderr.count("waiting for savepoint of job etl (request 1): QUEUED…") == 1
    assert "request 1 of job 'etl' is still QUEUED after 1 s" in result.stderr
    quiet = CliRunner().invoke(app, [*base, "--json"])
    assert quiet.exit_code == 1 and "waiting" not in quiet.stderr  # --json: the error only


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://ckpt:s3cret@127.0.0.1:notaport/db",  # unparseable: never quoted back
        "post gres://ckpt:s3cret@127.0.0.1/db",
        "postgresql://ckpt:s3c@ret@127.0.0.1:1/db",  # an unescaped '@' in the password
    ],
)
def test_a_bad_metastore_url_never_shows_its_password(url: str) -> None:
    from checkpointing.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        Metastore(url)
    assert "s3c" not in str(exc.value) and "ret@" not in str(exc.value)
    result = CliRunner().invoke(app, ["--metastore-url", url, "jobs"])
    assert result.exit_code == 1
    assert "metastore URL" in result.stderr and "s3c" not in result.output


def test_a_password_in_the_url_query_is_masked_too() -> None:
    result = run_ckpt("--metastore-url", "postgresql://127.0.0.1:1/db?password=s3cret", "jobs")
    assert result.returncode == 1
    assert "cannot reach the metastore at" in result.stderr and "password=***" in result.stderr
    assert "s3cret" not in result.stderr + result.stdout


def test_reads_with_a_mistyped_home_create_nothing(tmp_path: Path) -> None:
    home = tmp_path / "typo" / ".ckpt"
    runner = CliRunner(env={"CKPT_HOME": str(home), "CKPT_METASTORE_URL": None})
    for args in (["jobs"], ["list", "etl"], ["summary", "etl"], ["db", "current"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 3, (args, result.output)
        assert not (tmp_path / "typo").exists(), args
    assert "there is no metastore at" in runner.invoke(app, ["jobs"]).stderr
