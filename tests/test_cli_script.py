"""``ckpt run script.py`` (issue 39): the script gets its own arguments, and ``--restore``
reaches ``checkpointed``; options that only a spec has are refused in one line before the
script runs, and a spec refuses a script's arguments. The script here records what it was
given (no Spark: what is checked is the command line's hand-over): once through the real
console script, the refusals in this process (the one-line form of a usage error on the real
console script is tests/test_cli_usage.py's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from checkpointing.cli import app
from tests.test_cli import run_ckpt

SCRIPT = """
import json, os, sys
json.dump({"argv": sys.argv[1:], "restore": os.environ.get("CKPT_RESTORE"),
           "metastore": os.environ.get("CKPT_METASTORE_URL")}, open(sys.argv[0] + ".out", "w"))
sys.exit(int(os.environ.get("EXIT_WITH", "0")))
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "job.py"
    path.write_text(SCRIPT)
    return path


def _env(tmp_path: Path) -> dict[str, str]:
    return {"CKPT_HOME": str(tmp_path / "home")}


def _given(script: Path) -> dict[str, object]:
    return json.loads(Path(f"{script}.out").read_text())


def test_a_script_gets_its_arguments_and_the_restore(script: Path, tmp_path: Path) -> None:
    done = run_ckpt("run", str(script), "2026-11-01", "--", "--region", "eu", env=_env(tmp_path))
    assert done.returncode == 0, done.stderr
    given = _given(script)
    assert given["argv"] == ["2026-11-01", "--region", "eu"]
    assert given["restore"] == "latest"
    assert str(given["metastore"]).startswith("sqlite:///")

    done = run_ckpt("run", str(script), "--restore", "none", env=_env(tmp_path))
    assert done.returncode == 0, done.stderr
    assert _given(script) == {**given, "argv": [], "restore": "none"}


def _in_process(tmp_path: Path, *args: str, **env: str) -> object:
    return CliRunner().invoke(app, list(args), env={**_env(tmp_path), **env})


def test_the_scripts_exit_code_is_the_runs(script: Path, tmp_path: Path) -> None:
    done = _in_process(tmp_path, "run", str(script), EXIT_WITH="3")
    assert done.exit_code == 3, done.output  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--parallelism", "4"], "--parallelism"),
        (["--master", "local[1]"], "--master"),
        (["--full-refresh"], "--full-refresh"),
        (["--json"], "--json"),
        (["--fail-after-epochs", "2"], "--fail-after-epochs"),
        (["--restore", "7"], "--restore '7'"),
    ],
)
def test_a_spec_only_option_is_refused_before_the_script_runs(
    script: Path, tmp_path: Path, args: list[str], named: str
) -> None:
    done = _in_process(tmp_path, "run", str(script), *args)
    assert done.exit_code != 0  # type: ignore[attr-defined]
    stderr = done.stderr  # type: ignore[attr-defined]
    assert named in stderr and "Traceback" not in stderr, stderr
    assert not Path(f"{script}.out").exists()  # refused before it ran


def test_a_spec_refuses_a_scripts_arguments(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("job: j\n")
    done = _in_process(tmp_path, "run", str(spec), "extra")
    assert done.exit_code == 2  # type: ignore[attr-defined]
    stderr = done.stderr  # type: ignore[attr-defined]
    assert "'extra'" in stderr and "only a script" in stderr, stderr
