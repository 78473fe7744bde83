"""The command lines' help, as a new user reads it: at 80 columns every option's name is shown
whole (never ``--allow-non-rest…``), the environment variables are listed, and ``--help`` and
the ``--json`` reads import only what they use."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from checkpointing import config
from checkpointing.cli import app as ckpt_app
from checkpointing.cli import common
from checkpointing.metastore.engine import Metastore
from checkpointing.state.storage import FileSystemCheckpointStorage
from demo.cli import app as demo_app
from tests.test_cli import make_history

CHECKOUT = Path(__file__).resolve().parent.parent
#: what a metastore command never needs (the Spark, Airflow, data and AWS stacks)
HEAVY = ("pyarrow", "pandas", "numpy", "pyspark", "airflow", "boto3", "botocore", "alembic")


def _commands(app: typer.Typer) -> Iterator[tuple[list[str], object]]:
    """Every command and group of an app, as (the words that reach it, the click command)."""

    def walk(path: list[str], command: object) -> Iterator[tuple[list[str], object]]:
        yield path, command
        for name, sub in sorted(getattr(command, "commands", {}).items()):
            if not getattr(sub, "hidden", False):
                yield from walk([*path, name], sub)

    yield from walk([], get_command(app))


HELP_PAGES = [
    pytest.param(app, path, command, id=" ".join([label, *path]))
    for label, app in (("ckpt", ckpt_app), ("demo", demo_app))
    for path, command in _commands(app)
]


@pytest.mark.parametrize(("app", "path", "command"), HELP_PAGES)
def test_every_option_name_is_whole_in_the_help_at_80_columns(
    app: typer.Typer, path: list[str], command: object
) -> None:
    result = CliRunner().invoke(
        app, [*path, "--help"], env={"COLUMNS": "80", "TERM": "dumb"}, terminal_width=80
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80, result.output
    for param in getattr(command, "params", []):
        if getattr(param, "hidden", False) or param.param_type_name != "option":
            continue
        first, *others = [*param.opts, *param.secondary_opts]
        row = re.compile(rf"^│ (\*)? *{re.escape(first)}(\s|$)")
        at = next((i for i, line in enumerate(lines) if row.match(line)), None)
        assert at is not None, (first, result.output)  # its row starts with the whole name
        words = " ".join(lines[at : at + 2]).replace("│", " ").split()
        for name in others:  # e.g. -v, --no-…: whole, in the same row
            assert name in words, (name, result.output)


def test_the_root_help_lists_the_environment_variables() -> None:
    result = CliRunner().invoke(ckpt_app, ["--help"], env={"COLUMNS": "100"})
    assert result.exit_code == 0
    for var in (config.ENV_METASTORE_URL, config.ENV_STORAGE_URL):
        assert var in result.output
    assert (common.ENV_METASTORE_URL, common.ENV_STORAGE_URL) == (
        config.ENV_METASTORE_URL,
        config.ENV_STORAGE_URL,
    )


def test_version() -> None:
    from importlib.metadata import version

    result = CliRunner().invoke(ckpt_app, ["--version"])
    assert result.exit_code == 0
    assert result.output == f"ckpt {version(common.DISTRIBUTION)}\n"


def test_version_from_a_checkout_without_install_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata
    import tomllib

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    declared = tomllib.loads((CHECKOUT / "pyproject.toml").read_text())["project"]["version"]
    assert common.package_version() == f"{declared} (checkout {CHECKOUT}, not installed)"


@pytest.mark.parametrize(
    ("args", "option", "valid"),
    [
        (["list", "etl", "--status", "COMPLTED"], "--status", "COMPLETED"),
        (["list", "etl", "--type", "savepoints"], "--type", "SAVEPOINT_THEN_STOP"),
        (["db", "ddl", "--dialect", "mysql"], "--dialect", "postgresql, sqlite"),
        (["generate-data", "/nonexistent", "--dataset", "nyc"], "--dataset", "nycflights13"),
    ],
)
def test_a_value_outside_a_fixed_set_is_a_usage_error_naming_the_choices(
    args: list[str], option: str, valid: str
) -> None:
    result = CliRunner().invoke(ckpt_app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert option in result.output and valid in result.output


def _imported_after(
    *args: str, env: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``ckpt ARGS`` in a fresh interpreter; its output and the modules it imported."""
    probe = (
        "import sys, json, atexit\n"
        "atexit.register(lambda: sys.__stderr__.write("
        "'\\nMODULES ' + json.dumps(sorted(sys.modules))))\n"
        "from checkpointing.cli import main\n"
        f"sys.argv = ['ckpt', *{list(args)!r}]\n"
        "main()\n"
    )
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    full_env.update(env)
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True, text=True, env=full_env, cwd=CHECKOUT, timeout=120, check=False,
    )  # fmt: skip
    marker = done.stderr.rindex("MODULES ")
    modules = set(json.loads(done.stderr[marker + len("MODULES ") :]))
    return done, {m.split(".")[0] for m in modules}


def test_help_and_json_reads_import_neither_spark_nor_airflow_nor_data_stacks(
    tmp_path: Path,
) -> None:
    """Structural, not timed: scripts poll ``ckpt list --json``; each heavy stack would cost
    hundreds of milliseconds per call."""
    home = tmp_path / "home"
    home.mkdir()
    url = f"sqlite:///{home / 'metastore.db'}"
    Metastore(url, check_schema=False).upgrade()
    make_history(Metastore(url), FileSystemCheckpointStorage((home / "checkpoints").as_uri()))
    for args in (["--help"], ["list", "etl", "--json"], ["jobs", "--json"], ["list", "--help"]):
        done, top = _imported_after(*args, env={"CKPT_HOME": str(home)})
        assert done.returncode == 0, done.stderr
        assert not top & set(HEAVY), (args, sorted(top & set(HEAVY)))
        if "--json" in args:
            assert "rich" not in top, args  # no console is made for JSON
            assert json.loads(done.stdout)
