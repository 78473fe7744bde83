"""Under ``make test`` (``CKPT_TEST_REQUIRE_ALL=1``) a skip fails the run unless reviewed
(``conftest.ALLOWED_SKIPS``): a scenario whose dependency is missing must not pass by skipping.
Runs a real pytest on two small files, one skipping a test and one skipping its whole module."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _pytest(tmp_path: Path, require_all: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_one_skip.py").write_text(
        "import pytest\n\ndef test_skipped():\n    pytest.skip('no broker here')\n\n"
        "def test_runs():\n    assert True\n"
    )
    (tmp_path / "test_module_skip.py").write_text(
        "import pytest\n\npytest.importorskip('no_such_module_here')\n\n"
        "def test_never():\n    assert True\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CKPT_TEST_REQUIRE_ALL"}
    env["PYTHONPATH"] = str(REPO)
    # no Spark here: without it, the conftest would make a class-data-sharing archive of Spark's
    # classes in this new root (a JVM's warm-up run, most of this test's time)
    env["CKPT_TEST_SPARK_CDS"] = "0"
    if require_all:  # (what the run checks first is there; here the browser is not needed)
        env["CKPT_TEST_REQUIRE_ALL"] = "1"
        env["CKPT_TEST_CHROMIUM"] = sys.executable
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_skip_fails_make_test_and_is_named(tmp_path: Path) -> None:
    run = _pytest(tmp_path, require_all=True)
    assert run.returncode == 1, run.stdout[-2000:]
    assert "2 unexpected skip(s) fail the run" in run.stdout, run.stdout[-2000:]
    assert "test_one_skip.py::test_skipped" in run.stdout
    assert "no broker here" in run.stdout
    assert "test_module_skip.py" in run.stdout and "no_such_module_here" in run.stdout
