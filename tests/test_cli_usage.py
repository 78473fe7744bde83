"""The ``ckpt`` command line as one consistent tool (issue 40): the root options on every
command, a usage error in one line where no one reads a box, one name per thing (the old
spellings still work), one ``--limit`` default and one ``--json`` wording, help that reads
well. What users see is checked on the real console script in a subprocess (stderr a pipe, as
in CI and logs; a pseudo-terminal for the box)."""

from __future__ import annotations

import json
import logging
import os
import pty
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from checkpointing.cli import app
from checkpointing.cli.common import DEFAULT_LIMIT
from checkpointing.config import CheckpointConfig
from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.pending import TaskSpec
from checkpointing.metastore.engine import Metastore
from checkpointing.state.storage import FileSystemCheckpointStorage
from tests.test_cli import CKPT, make_history, run_ckpt

BOX = re.compile("[╭╮╰╯│─]")


@pytest.fixture
def history(sqlite_metastore: Metastore, tmp_path: Path) -> str:
    """Job ``etl`` with checkpoints 1-3 in a SQLite metastore; its URL."""
    make_history(sqlite_metastore, FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}"))
    return sqlite_metastore.url.render_as_string(hide_password=False)


def _commands() -> dict[str, Any]:
    """Every visible command of ``ckpt``, by its words (``db upgrade``)."""
    found: dict[str, Any] = {}

    def walk(words: list[str], command: Any) -> None:
        for name, sub in getattr(command, "commands", {}).items():
            if getattr(sub, "hidden", False):
                continue
            if hasattr(sub, "commands"):
                walk([*words, name], sub)
            else:
                found[" ".join([*words, name])] = sub

    walk([], get_command(app))
    return found


# ------------------------------------------------------------------- 1. root options anywhere


def test_the_root_options_are_accepted_after_the_command_too(history: str, tmp_path: Path) -> None:
    """``ckpt list J --metastore-url …`` as ``kubectl get pods -n …``: the flag after the command
    wins over one before it, and either over the environment."""
    bad = f"sqlite:///{tmp_path / 'nothing-here.db'}"  # no metastore: exit 3 if it were used
    after = run_ckpt("list", "etl", "--metastore-url", history, "--json")
    assert after.returncode == 0, after.stderr
    assert [r["checkpoint_id"] for r in json.loads(after.stdout)] == [3, 2, 1]

    both = run_ckpt(
        "--metastore-url", bad, "list", "etl", "--metastore-url", history, "--json",
        env={"CKPT_METASTORE_URL": bad},
    )  # fmt: skip
    assert both.returncode == 0, both.stderr
    assert json.loads(both.stdout) == json.loads(after.stdout)
    before_only = run_ckpt(
        "--metastore-url", bad, "list", "etl", env={"CKPT_METASTORE_URL": history}
    )
    assert before_only.returncode == 3, before_only.stderr  # the flag before beat the environment


def test_every_command_takes_the_root_options() -> None:
    for words, command in _commands().items():
        names = {opt for param in command.params for opt in param.opts}
        assert {"--metastore-url", "--storage-url", "--verbose", "-v"} <= names, words


def test_the_storage_url_after_the_command_is_the_one_used(tmp_path: Path) -> None:
    """``--storage-url`` given after ``validate``: the sink inside that storage is refused."""
    from tests.test_cli_validate import write_spec

    spec = write_spec(tmp_path)
    home = {"CKPT_HOME": str(tmp_path / "home")}
    inside = (tmp_path / "out").parent.as_uri()  # the sink's parent: the sink inside it
    plain = CliRunner(env=home).invoke(app, ["validate", str(spec)])
    assert plain.exit_code == 0, plain.output
    refused = CliRunner(env=home).invoke(app, ["validate", str(spec), "--storage-url", inside])
    assert refused.exit_code == 1, refused.output
    assert "sink.path" in refused.stderr and "storage" in refused.stderr, refused.stderr


def test_verbose_after_the_command_turns_logging_on(history: str) -> None:
    root = logging.getLogger()
    level = root.level
    try:
        for args, want in (([], logging.WARNING), (["-v"], logging.INFO)):
            result = CliRunner().invoke(app, ["--metastore-url", history, "jobs", *args])
            assert result.exit_code == 0, result.output
            assert root.level == want, args
    finally:
        root.setLevel(level)


# ------------------------------------------------------------- 4. usage errors: one line


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["list", "etl", "--limt", "3"], "--limt"),
        (["list"], "JOB"),
        (["list", "etl", "--limit", "many"], "--limit"),
        (["restore-plan", "etl", "--parallelism", "0"], "--parallelism"),
        (["nosuch"], "nosuch"),
    ],
    ids=["unknown-option", "missing-argument", "bad-value", "out-of-range", "unknown-command"],
)
def test_a_usage_error_is_one_line_on_stderr_off_a_terminal(
    args: list[str], named: str, tmp_path: Path
) -> None:
    done = run_ckpt(*args, env={"CKPT_HOME": str(tmp_path / "home")})
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ") and named in lines[0], lines
    assert not BOX.search(done.stderr), done.stderr
    assert not (tmp_path / "home").exists()

    as_json = run_ckpt(*args, "--json", env={"CKPT_HOME": str(tmp_path / "home")})
    assert as_json.returncode == 2 and as_json.stdout == ""
    error = json.loads(as_json.stderr)
    assert error["exit_code"] == 2 and named in error["error"], error


def test_on_a_terminal_the_usage_error_keeps_its_box(tmp_path: Path) -> None:
    """A person at a terminal gets typer's box with the usage line."""
    primary, secondary = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.update(CKPT_HOME=str(tmp_path / "home"), COLUMNS="100", TERM="xterm")
    try:
        done = subprocess.run(
            [CKPT, "list", "etl", "--limt", "3"],
            stdout=subprocess.PIPE, stderr=secondary, env=env, timeout=120, check=False,
        )  # fmt: skip
        os.close(secondary)
        shown = b""
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:  # the terminal's other end is closed: all read
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(primary)
    text = re.sub(r"\x1b\[[0-9;]*m", "", shown.decode())  # the terminal's colours
    assert done.returncode == 2
    assert "Usage: ckpt list" in text and "No such option" in text and BOX.search(text), text


# ----------------------------------------------------------------- 2. one name per thing


def test_restore_plan_takes_restore_as_run_does_and_from_still_works(
    history: str, tmp_path: Path
) -> None:
    base = ["--metastore-url", history, "--storage-url", f"file://{tmp_path / 'ckpt'}"]
    base += ["restore-plan", "etl", "--parallelism", "2"]
    new = CliRunner().invoke(app, [*base, "--restore", "999"])
    old = CliRunner().invoke(app, [*base, "--from", "999"])
    for result in (new, old):
        assert result.exit_code == 1, result.output
        assert "job etl has no checkpoint 999" in result.stderr, result.stderr
    assert "--from is deprecated: use --restore" in old.stderr
    assert "deprecated" not in new.stderr
    clash = CliRunner().invoke(app, [*base, "--restore", "1", "--from", "2"])
    assert clash.exit_code == 2 and "--restore" in clash.stderr, clash.output
    help_text = CliRunner().invoke(app, ["restore-plan", "--help"], terminal_width=200).output
    assert "--restore" in help_text and "--from" not in help_text


def test_listing_savepoints_is_list_savepoints_and_savepoints_still_works(history: str) -> None:
    new = CliRunner().invoke(app, ["--metastore-url", history, "list-savepoints", "etl", "--json"])
    old = CliRunner().invoke(app, ["--metastore-url", history, "savepoints", "etl", "--json"])
    assert new.exit_code == old.exit_code == 0, (new.output, old.output)
    assert json.loads(new.stdout) == json.loads(old.stdout) == []
    assert "Use 'ckpt list-savepoints'" in old.stderr and new.stderr == ""
    names = set(_commands())
    assert {"savepoint", "list-savepoints"} <= names and "savepoints" not in names


# ------------------------------------------------------------ 3. --limit and --json, alike


def test_every_limit_has_the_same_default_help_and_zero_for_all() -> None:
    limits = {
        words: param
        for words, command in _commands().items()
        for param in command.params
        if "--limit" in param.opts
    }
    assert set(limits) == {"list", "requests", "inspect"}
    assert {p.default for p in limits.values()} == {DEFAULT_LIMIT}
    assert len({p.help for p in limits.values()}) == 1
    for words in limits:
        shown = CliRunner().invoke(app, [*words.split(), "--help"], terminal_width=200).output
        assert f"[default: {DEFAULT_LIMIT}]" in shown and "(0: all)" in shown, shown


def test_every_json_option_is_worded_alike() -> None:
    helps = {
        param.help
        for command in _commands().values()
        for param in command.params
        if "--json" in param.opts
    }
    assert len(helps) == 1, helps


def test_list_shows_the_newest_limit_by_default_and_all_with_zero(
    sqlite_metastore: Metastore, tmp_path: Path
) -> None:
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    plan = [TaskSpec("agg", 0, "att-0", 1)]
    coord = CheckpointCoordinator(
        "etl",
        sqlite_metastore,
        storage,
        CheckpointConfig(tolerable_failures=1000),
        plan_provider=lambda: plan,
    )
    total = DEFAULT_LIMIT + 3
    for _ in range(total):  # declined at once: a cheap row each
        coord.receive_decline(coord.trigger_checkpoint().checkpoint_id, "att-0", "no")
    base = ["--metastore-url", sqlite_metastore.url.render_as_string(), "list", "etl", "--json"]
    shown = [r["checkpoint_id"] for r in json.loads(CliRunner().invoke(app, base).stdout)]
    assert shown == list(range(total, total - DEFAULT_LIMIT, -1))
    every = json.loads(CliRunner().invoke(app, [*base, "--limit", "0"]).stdout)
    assert len(every) == total
    table = CliRunner().invoke(app, base[:-1]).stdout  # a person is told the rest exists
    assert f"the newest {DEFAULT_LIMIT} shown; --limit N shows more, --limit 0 all" in table
    assert "--limit 0 all" not in CliRunner().invoke(app, [*base[:-1], "--limit", "0"]).stdout


# ------------------------------------------------------------------------------- 5. help


def test_no_flag_shows_a_bool_placeholder() -> None:
    for words in ["", *_commands()]:
        shown = CliRunner().invoke(app, [*words.split(), "--help"], terminal_width=120).output
        assert "<bool>" not in shown, (words, shown)


def test_a_docstring_paragraph_is_one_paragraph_in_the_help() -> None:
    """The docstrings' hard line breaks (at ~96 columns) are not the terminal's: at 250 columns
    each paragraph of a command's help is one line."""
    import inspect as pyinspect

    for words, command in _commands().items():
        shown = (
            CliRunner()
            .invoke(app, [*words.split(), "--help"], env={"COLUMNS": "250"}, terminal_width=250)
            .output
        )
        lines = [line.strip() for line in shown.splitlines()]
        for paragraph in pyinspect.cleandoc(command.help or "").split("\n\n"):
            flat = " ".join(paragraph.split())
            if len(flat) < 240:
                assert flat in lines, (words, flat, shown)


def test_run_is_the_first_command_listed() -> None:
    shown = CliRunner().invoke(app, ["--help"], terminal_width=100).output
    listed = re.findall(r"^│ ([a-z][a-z-]+) ", shown, flags=re.MULTILINE)
    assert listed[:2] == ["run", "validate"], listed
    assert "savepoints" not in listed and "list-savepoints" in listed
