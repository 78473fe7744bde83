"""``make airflow`` (``python -m demo airflow``): a real local Airflow 3 starts, serves this
project's DAGs through its REST API to the printed login, and stops completely."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.helpers import free_port

#: ``make airflow``'s command, run from the checkout
AIRFLOW = (sys.executable, "-m", "demo", "airflow")
CHECKOUT = Path(__file__).resolve().parent.parent


def _wait_for(what: str, check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def _api(url: str, token: str | None = None, body: dict[str, Any] | None = None) -> Any:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=30) as r:
        return json.loads(r.read())


def _cmdline(proc: psutil.Process) -> str:
    """A process's command line; empty for one that has just exited (a zombie until reaped)."""
    try:
        return " ".join(proc.cmdline())
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return ""


@pytest.mark.timeout(400)  # ~1 min on an idle 2-core machine
def test_make_airflow_serves_the_dags_to_the_printed_login_and_stops_cleanly(
    tmp_path: Path,
) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "CKPT_"))}
    env["CKPT_HOME"] = str(tmp_path / "home")
    # the user's own settings reach Airflow, except those the launcher owns
    env.update({"AIRFLOW__CORE__PARALLELISM": "3", "AIRFLOW__API__PORT": "1"})
    # a user's DAG folder whose DAG imports a module next to it
    user_dags = tmp_path / "my-dags"
    user_dags.mkdir()
    (user_dags / "my_helpers.py").write_text('DAG_ID = "user_dag"\n')
    (user_dags / "user_dag.py").write_text(
        "from airflow.sdk import DAG\nfrom my_helpers import DAG_ID\n\n"
        "with DAG(DAG_ID, schedule=None):\n    pass\n"
    )
    output = tmp_path / "out.txt"
    with output.open("w") as sink:
        proc = subprocess.Popen(
            [*AIRFLOW, "--port", str(port), "--dags", str(user_dags)],
            env=env,
            cwd=CHECKOUT,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        _wait_for("Airflow is up", lambda: "Airflow is up" in output.read_text(), 240)
        text = output.read_text()
        url = f"http://127.0.0.1:{port}"
        assert url in text
        password = json.loads((tmp_path / "home" / "airflow" / "passwords.json").read_text())
        assert f"login: user admin, password {password['admin']}" in text

        token = _api(
            f"{url}/auth/token", body={"username": "admin", "password": password["admin"]}
        )["access_token"]
        assert "from your environment: AIRFLOW__CORE__PARALLELISM" in text
        assert "ignored: AIRFLOW__API__PORT (set by the launcher)" in text
        wanted = {"nycflights13_routes", "checkpoint_savepoint", "checkpoint_deploy", "user_dag"}

        def dags() -> set[str] | None:
            found = {d["dag_id"] for d in _api(f"{url}/api/v2/dags?limit=100", token)["dags"]}
            return found if wanted <= found else None

        _wait_for(f"the DAGs {sorted(wanted)}", dags, 180)
        assert _api(f"{url}/api/v2/importErrors", token)["total_entries"] == 0
        with pytest.raises(urllib.error.HTTPError):  # the API needs the login
            _api(f"{url}/api/v2/dags")

        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(_cmdline(c) for c in children)
        for component in ("api", "scheduler", "dag-processor", "triggerer"):
            assert component in names, names
        scheduler = next(c for c in children if "scheduler" in _cmdline(c))
        assert scheduler.environ()["AIRFLOW__CORE__PARALLELISM"] == "3"
        assert scheduler.environ()["AIRFLOW__API__PORT"] == str(port)
        proc.send_signal(signal.SIGTERM)  # what Ctrl-C or a service manager does
        assert proc.wait(timeout=90) == 0, output.read_text()[-3000:]
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [_cmdline(p) for p in alive]
        assert output.read_text().rstrip().endswith("stopped")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_make_airflow_on_a_port_in_use_says_so_and_starts_nothing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "CKPT_"))}
    env["CKPT_HOME"] = str(tmp_path / "home")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [*AIRFLOW, "--port", str(port)],
            env=env,
            cwd=CHECKOUT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert result.returncode == 1
    assert f"port {port} on 127.0.0.1 is in use" in result.stderr
    assert not (tmp_path / "home" / "airflow" / "airflow.db").exists()


def test_user_dag_folders_are_served_through_one_folder_of_symlinks(tmp_path: Path) -> None:
    """Airflow has one DAGs folder: this project's ``dags/`` and each ``--dags`` folder are
    symlinks in it (names made unique), rebuilt at every start."""
    from demo import DAGS
    from demo.local_airflow import dags_folder

    home = tmp_path / "airflow"
    assert dags_folder(home, []) == DAGS  # no user folders: the project's, as before
    first, second = tmp_path / "a" / "dags", tmp_path / "b" / "dags"
    first.mkdir(parents=True)
    second.mkdir(parents=True)
    folder = dags_folder(home, [first, second])
    assert {p.name: p.readlink() for p in folder.iterdir()} == {
        "project": DAGS,
        "dags": first,
        "dags-2": second,
    }
    assert {p.name for p in dags_folder(home, [second]).iterdir()} == {"project", "dags"}
    (folder / "stray.py").write_text("")
    with pytest.raises(RuntimeError, match=r"stray\.py"):
        dags_folder(home, [first])


def test_the_callers_airflow_settings_pass_except_those_the_launcher_owns() -> None:
    from demo.local_airflow import passed_through

    passed, ignored = passed_through(
        {
            "AIRFLOW__CORE__PARALLELISM": "8",
            "AIRFLOW_CONN_AWS_DEFAULT": "aws://",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_CMD": "cat /secret",
            "AIRFLOW__CORE__DAGS_FOLDER": "/elsewhere",
            "AIRFLOW_HOME": "/home/me/airflow",
            "PATH": "/usr/bin",
        }
    )
    assert passed == {"AIRFLOW__CORE__PARALLELISM": "8", "AIRFLOW_CONN_AWS_DEFAULT": "aws://"}
    assert ignored == ["AIRFLOW__CORE__DAGS_FOLDER", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_CMD"]
