"""``ckpt restore-plan``: the dry run of a restore, on the real checkpoints of a real Spark run
that crashed after 3 of 6 epochs (one run per metastore backend, shared by the module). The plan
must cover every key group exactly once, read exactly the snapshot bytes of each new subtask's
groups (checked against the files themselves), deal exactly the remaining epochs' files, fall
back past a corrupt checkpoint like the real restore, and record nothing."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from checkpointing.cli import app
from checkpointing.config import CheckpointConfig
from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.pending import TaskSpec
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import RestoreEvent
from checkpointing.metastore.views import list_checkpoints
from checkpointing.restore.lookup import preview_restore
from checkpointing.state.snapshot import read_snapshot_info
from checkpointing.state.storage import FileSystemCheckpointStorage
from tests.spark_pipeline import EPOCHS, completed_ids, events_spec, run, write_events

MAX_P = 16  # the helpers' spec: parallelism 3, max_parallelism 16, retained 2
CRASH_AFTER = 3


@dataclass
class Crashed:
    url: str
    metastore: Metastore
    storage: FileSystemCheckpointStorage
    job: str
    events: Path
    previous: int  # covers epochs 0-1
    newest: int  # covers epochs 0-2
    subsumed: int


@pytest.fixture(scope="module")
def events(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_events(tmp_path_factory.mktemp("events"))


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def crashed(
    request: pytest.FixtureRequest,
    spark: Any,
    events: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Crashed]:
    """A job that crashed after 3 epochs. On PostgreSQL it shares the session's database: the
    job id is unique, and no test here truncates it."""
    from checkpointing.spark.runtime import SimulatedCrash

    workdir = tmp_path_factory.mktemp(f"plan-{request.param}")
    if request.param == "sqlite":
        url = f"sqlite:///{workdir / 'metastore.db'}"
        Metastore(url, check_schema=False).upgrade()
    else:
        url = request.getfixturevalue("pg_url")
    job = f"plan-{uuid.uuid4().hex[:8]}"
    metastore = Metastore(url)
    storage = FileSystemCheckpointStorage(f"file://{workdir / 'ckpt'}")
    with pytest.raises(SimulatedCrash):
        # full snapshots: the plans name each checkpoint's own files (chains:
        # tests/test_incremental_checkpoints.py)
        spec = events_spec(
            workdir,
            events,
            job,
            checkpoint={"every_epochs": 1, "retained": 2, "incremental": False},
        )
        run(spark, spec, metastore, storage, crash_after_epochs=3)
    previous, newest = completed_ids(metastore, job)
    subsumed = min(r["checkpoint_id"] for r in list_checkpoints(metastore, job, status="SUBSUMED"))
    yield Crashed(url, metastore, storage, job, events, previous, newest, subsumed)
    metastore.dispose()


def ckpt(c: Crashed, *args: str) -> Any:
    result = CliRunner().invoke(
        app, ["--metastore-url", c.url, "--storage-url", c.storage.base_url, *args]
    )
    assert "Traceback" not in result.output, result.output
    return result


def plan(c: Crashed, *args: str) -> dict[str, Any]:
    result = ckpt(c, "restore-plan", c.job, "--json", *args)
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def restore_rows(c: Crashed) -> int:
    with c.metastore.transaction() as s:
        return s.scalar(
            select(func.count()).select_from(RestoreEvent).where(RestoreEvent.job_id == c.job)
        )


def group_bytes_on_disk(c: Crashed, checkpoint_id: int) -> dict[int, tuple[str, int]]:
    """Key group -> (file, bytes of its segment), read from the snapshot files themselves."""
    out: dict[int, tuple[str, int]] = {}
    chk = c.storage.path_of(c.storage.checkpoint_url(c.job, checkpoint_id))
    for path in sorted(chk.glob("aggregate-*.arrow")):
        for group, segment in read_snapshot_info(path).groups.items():
            assert group not in out
            out[group] = (path.as_uri(), segment.nbytes)
    return out


def remaining_splits(c: Crashed, after_epoch: int) -> list[tuple[str, int]]:
    files = sorted(c.events.glob("*.parquet"))
    return [(str(files[e]), e) for e in range(after_epoch + 1, EPOCHS)]


def source_splits(subtasks: list[dict[str, Any]], *, processed: bool) -> list[tuple[str, int]]:
    """The source's list state over the subtasks: the splits processed, or those still to read."""
    items = [i for s in subtasks for i in s["list_state"]["source"]]
    chosen = [(i["path"], i["epoch"]) for i in items if bool(i.get("processed")) == processed]
    return sorted(chosen, key=lambda x: x[1])


@pytest.mark.parametrize("parallelism", [2, 5])
def test_plan_covers_every_key_group_once_with_the_snapshot_bytes_and_remaining_splits(
    crashed: Crashed, parallelism: int
) -> None:
    before = restore_rows(crashed)
    data = plan(crashed, "--parallelism", str(parallelism))

    assert data["dry_run"] is True
    assert data["checkpoint_id"] == crashed.newest
    assert data["checkpoint_type"] == "CHECKPOINT"
    assert data["skipped"] == []
    subtasks = data["subtasks"]
    assert [s["subtask"] for s in subtasks] == list(range(parallelism))

    # every key group exactly once: in the subtasks' ranges and in the file reads
    owned = [
        g for s in subtasks for g in range(s["key_groups"]["start"], s["key_groups"]["end"] + 1)
    ]
    assert sorted(owned) == list(range(MAX_P))
    on_disk = group_bytes_on_disk(crashed, crashed.newest)
    assert sorted(on_disk) == list(range(MAX_P))  # 300 keys: no empty group
    read: list[int] = []
    for s in subtasks:
        mine = range(s["key_groups"]["start"], s["key_groups"]["end"] + 1)
        expected = sum(on_disk[g][1] for g in mine)
        assert s["bytes"] == expected > 0
        for f in s["files"]:
            groups = range(f["key_groups"]["start"], f["key_groups"]["end"] + 1)
            assert set(groups) <= set(mine)
            assert {on_disk[g][0] for g in groups} == {f["url"]}  # the file holding them
            assert f["size"] == sum(on_disk[g][1] for g in groups)
            read.extend(groups)
    assert sorted(read) == list(range(MAX_P))
    assert data["bytes"] == sum(b for _, b in on_disk.values())

    # the source's splits, each exactly once, dealt round-robin: those still to read, and those
    # processed (the input consumed: the epochs before)
    assert source_splits(subtasks, processed=False) == remaining_splits(crashed, CRASH_AFTER - 1)
    files = sorted(str(f) for f in crashed.events.glob("*.parquet"))
    assert source_splits(subtasks, processed=True) == [(files[e], e) for e in range(CRASH_AFTER)]
    counts = [len(s["list_state"]["source"]) for s in subtasks]
    assert max(counts) - min(counts) <= 1
    staged = [i["epoch"] for s in subtasks for i in s["list_state"]["sink"]]
    assert staged and all(e <= CRASH_AFTER - 1 for e in staged)

    # the same plan the runtime would record, and nothing recorded by the dry run
    assert data["plan"]["operators"][0]["operator_id"] == "aggregate"
    assert data["plan"]["size"] == data["bytes"]
    assert restore_rows(crashed) == before


def test_core_preview_matches_the_cli(crashed: Crashed) -> None:
    preview = preview_restore(crashed.metastore, crashed.storage, crashed.job, parallelism=4)
    assert preview.decision.checkpoint_id == crashed.newest
    assert preview.to_dict() == plan(crashed, "--parallelism", "4")


def test_plan_from_an_older_checkpoint(crashed: Crashed) -> None:
    data = plan(crashed, "--parallelism", "2", "--restore", str(crashed.previous))
    assert data["checkpoint_id"] == crashed.previous
    splits = source_splits(data["subtasks"], processed=False)
    assert splits == remaining_splits(crashed, CRASH_AFTER - 2)
    on_disk = group_bytes_on_disk(crashed, crashed.previous)
    assert data["bytes"] == sum(b for _, b in on_disk.values())


def test_plan_from_a_checkpoint_path(crashed: Crashed) -> None:
    path = crashed.storage.checkpoint_url(crashed.job, crashed.previous)
    data = plan(crashed, "--parallelism", "3", "--restore", path)
    assert data["checkpoint_id"] == crashed.previous
    assert data["metadata_path"] == f"{path}/_metadata"


def test_table_for_people(crashed: Crashed) -> None:
    before = restore_rows(crashed)
    result = ckpt(crashed, "restore-plan", crashed.job, "--parallelism", "5")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"checkpoint {crashed.newest}" in out
    assert "parallelism 3 -> 5 (max 16)" in out
    assert "dry run, nothing recorded" in out
    for header in ("Subtask", "Key groups", "Files", "Bytes", "source (splits)", "sink"):
        assert header in out
    lines = [line for line in out.splitlines() if line.startswith("│")]
    subtask_rows = [line.split("│")[1].strip() for line in lines if line.split("│")[1].strip()]
    assert subtask_rows == ["0", "1", "2", "3", "4"]
    assert "0-3" in out and "13-15" in out  # key groups of subtasks 0 and 4 of 5
    assert "aggregate-0.arrow [0-3]" in out
    assert "KiB" in out
    files = sorted(crashed.events.glob("*.parquet"))
    assert all(f.name in out for f in files[CRASH_AFTER:])
    assert restore_rows(crashed) == before


def test_latest_falls_back_past_a_corrupt_checkpoint_and_records_nothing(
    crashed: Crashed,
) -> None:
    chk = crashed.storage.path_of(crashed.storage.checkpoint_url(crashed.job, crashed.newest))
    victim = sorted(chk.glob("aggregate-*.arrow"))[1]
    original = victim.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0x01  # same size: only the checksum tells
    before = restore_rows(crashed)
    try:
        victim.write_bytes(bytes(data))
        planned = plan(crashed, "--parallelism", "2")
        assert planned["checkpoint_id"] == crashed.previous
        [skipped] = planned["skipped"]
        assert skipped["checkpoint_id"] == crashed.newest
        assert victim.name in skipped["reason"] and "checksum" in skipped["reason"]

        table = ckpt(crashed, "restore-plan", crashed.job, "--parallelism", "2")
        assert table.exit_code == 0
        assert f"skipped checkpoint {crashed.newest}" in table.stdout

        chosen = ckpt(
            crashed,
            "restore-plan",
            crashed.job,
            "--parallelism",
            "2",
            "--restore",
            str(crashed.newest),
        )
        assert chosen.exit_code == 1  # an explicit choice does not fall back
        assert victim.name in chosen.stderr and "checksum mismatch" in chosen.stderr
    finally:
        victim.write_bytes(original)
    assert restore_rows(crashed) == before


def test_errors_are_one_line_with_exit_1(crashed: Crashed) -> None:
    job = crashed.job
    cases = [
        (["restore-plan", "nope", "--parallelism", "2"], "unknown job 'nope'"),
        (["restore-plan", job, "--parallelism", "2", "--restore", "999"], "has no checkpoint 999"),
        (
            ["restore-plan", job, "--parallelism", "2", "--restore", str(crashed.subsumed)],
            f"checkpoint {crashed.subsumed} of job {job} is SUBSUMED, not COMPLETED",
        ),
        (
            ["restore-plan", job, "--parallelism", "17"],
            "new parallelism 17 exceeds max_parallelism 16",
        ),
        (["restore-plan", job, "--parallelism", "2", "--restore", "soon"], "expected 'latest'"),
    ]
    for args, message in cases:
        result = ckpt(crashed, *args)
        assert result.exit_code == 1, (args, result.output)
        assert message in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1


def test_job_without_a_completed_checkpoint(crashed: Crashed, tmp_path: Path) -> None:
    job = f"fresh-{uuid.uuid4().hex[:8]}"
    tasks = [TaskSpec("aggregate", 0, "att-0", 1, MAX_P)]
    coordinator = CheckpointCoordinator(
        job, crashed.metastore, crashed.storage, CheckpointConfig(), plan_provider=lambda: tasks
    )
    coordinator.trigger_checkpoint()  # pending, never acknowledged
    result = ckpt(crashed, "restore-plan", job, "--parallelism", "2")
    assert result.exit_code == 1
    assert f"job {job} has no valid completed checkpoint" in result.stderr


def test_storage_defaults_to_the_one_the_job_registered(crashed: Crashed, tmp_path: Path) -> None:
    """... once it lies in a configured storage root: any driver can write the job's row."""
    args = ["--metastore-url", crashed.url, "restore-plan", crashed.job, "--parallelism", "2"]
    env = {"CKPT_STORAGE_URL": None, "CKPT_HOME": str(tmp_path)}
    result = CliRunner().invoke(
        app, args, env={**env, "CKPT_STORAGE_ROOTS": crashed.storage.base_url}
    )
    assert result.exit_code == 0, result.output
    assert f"checkpoint {crashed.newest}" in result.stdout
    refused = CliRunner().invoke(app, args, env=env)
    assert refused.exit_code == 1
    assert f"job '{crashed.job}': storage_url '{crashed.storage.base_url}' is not" in refused.stderr
