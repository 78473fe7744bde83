"""A real Airflow 3 api-server on loopback, loaded from this project's ``plugins/`` like in
production, with Airflow's SimpleAuthManager and three users: ``admin``, the read-only
``viewer`` and ``outsider``, who has no role (no access to any DAG); shared by the REST API
tests (``test_checkpoint_api.py``) and the browser test (``test_checkpoints_ui.py``).

The metastore is seeded through the core library (coordinators completing real checkpoints
without Spark); the api-server finds it as the operators do (``CKPT_METASTORE_URL``).
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import signal
import sqlite3
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import closing, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from checkpointing.clock import ManualClock
from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.metastore.engine import Metastore
from checkpointing.restore.lookup import find_latest_valid, preview_restore, record_restore
from checkpointing.state.storage import FileSystemCheckpointStorage
from checkpointing.status import JobStatus
from demo.airflow_env import airflow_command, airflow_env, migrate
from tests.helpers import ack_all, complete, free_port, new_coordinator, snapshot

SIMPLE_AUTH_MANAGER = (
    "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
)
FINISHED = "routes-finished"  # 7 checkpoints and a savepoint, then FINISHED
LIVE = "routes-live"  # RUNNING: takes savepoints
#: the project's deploy DAG, served (and serialized into Airflow's database) for "Restore from here"
DEPLOY_DAG = Path(__file__).resolve().parent.parent / "dags" / "checkpoint_deploy.py"
IDLE = "routes-idle"  # registered, never ran: no checkpoints
#: the running pipeline's DAG in Airflow (its task "run", as the DAG factory names it), with one
#: run, so that the page can link to the task's log
LIVE_DAG = f"""
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG

with DAG({LIVE!r}, schedule=None):
    EmptyOperator(task_id="run")
"""


#: the source's list state in the FINISHED job's savepoint 7, per subtask: two runs read three
#: files (one of them in two row-group splits), a fourth is still to read
SOURCE_STATE = (
    [
        {"path": "/data/in/a.csv", "epoch": 0, "size": 100, "mtime": 1_700_000_000_000_000_000,
         "processed": True, "attempt": "try-1"},
        {"path": "s3://in/big.parquet", "epoch": 1, "row_groups": [0, 2], "size": 5000,
         "etag": "e-big", "processed": True, "attempt": "try-1"},
    ],
    [
        {"path": "s3://in/big.parquet", "epoch": 2, "row_groups": [2, 4], "size": 5000,
         "etag": "e-big", "processed": True, "attempt": "try-2"},
        {"path": "s3://in/new.parquet", "epoch": 3, "size": 70, "etag": "e-new"},
    ],
)  # fmt: skip


@dataclass
class Response:
    status: int
    body: Any
    headers: dict[str, str]


@dataclass
class Server:
    url: str
    tokens: dict[str, str]
    metastore: Metastore
    storage: FileSystemCheckpointStorage
    live: CheckpointCoordinator
    log: Path
    passwords: dict[str, str]
    live_run: str = ""  # the run of the LIVE pipeline's DAG in Airflow

    def call(
        self,
        method: str,
        path: str,
        *,
        user: str | None = None,
        token: str | None = None,
        body: Any = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        """``path`` under the plugin's prefix; ``user`` sends that user's bearer token."""
        sent = {"Accept": "application/json", **(headers or {})}
        if user is not None:
            token = self.tokens[user]
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            sent["Content-Type"] = "application/json"
        request = urllib.request.Request(
            f"{self.url}/checkpoints{path}", data=data, headers=sent, method=method
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return Response(r.status, _json(r.read()), dict(r.headers))
        except urllib.error.HTTPError as e:
            return Response(e.code, _json(e.read()), dict(e.headers))


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def api_token(url: str, user: str, password: str) -> str:
    """A JWT for ``user`` from Airflow's SimpleAuthManager token endpoint."""
    request = urllib.request.Request(
        f"{url}/auth/token",
        json.dumps({"username": user, "password": password}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        return str(json.loads(r.read())["access_token"])


def _trigger_run(url: str, token: str, dag_id: str) -> str:
    """A queued manual run of ``dag_id`` (nothing runs it: no scheduler), through Airflow's API."""
    request = urllib.request.Request(
        f"{url}/api/v2/dags/{dag_id}/dagRuns",
        json.dumps({"logical_date": None}).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        return str(json.loads(r.read())["dag_run_id"])


def _seed(metastore: Metastore, storage: FileSystemCheckpointStorage) -> CheckpointCoordinator:
    """Three jobs through the core API: FINISHED with a history (completed, subsumed, a
    savepoint, an aborted one) and a restore; RUNNING with one checkpoint; CREATED with none."""
    clock = ManualClock()
    done = new_coordinator(metastore, storage, clock, job_id=FINISHED, retained=2)
    done.activate()
    done.job_status_changed(JobStatus.RUNNING)
    # end-to-end durations a chart can show: 0 ms for the first, about a second for the next
    # five, and a savepoint that took far longer (an outlier that must not flatten the rest)
    for took in (0, 1.2, 0.8, 1.5, 1.1, 0.9):
        clock.advance(60)
        pending = done.trigger_checkpoint()
        clock.advance(took)
        assert ack_all(done, pending).completed is not None
    clock.advance(60)
    pending = done.trigger_savepoint()  # checkpoint 7, with the input its two runs read
    clock.advance(35)
    acks = [snapshot(storage, pending, t) for t in pending.tasks]
    lists = iter(SOURCE_STATE)
    acks = [
        replace(a, state_meta={"list_state": next(lists)}) if t.operator_id == "source" else a
        for t, a in zip(pending.tasks, acks, strict=True)
    ]
    assert done.receive_acknowledge(pending.checkpoint_id, acks).completed is not None
    clock.advance(60)
    done.trigger_checkpoint()  # 8: still pending when the job ends, so aborted
    decision = find_latest_valid(metastore, storage, FINISHED)
    plan = preview_restore(metastore, storage, FINISHED, parallelism=3, deep=False).plan
    record_restore(metastore, decision, attempt="try-2", parallelism=3, assignment=plan.to_dict())
    done.job_status_changed(JobStatus.FINISHED)

    live = new_coordinator(metastore, storage, clock, job_id=LIVE)
    live.activate()
    live.job_status_changed(JobStatus.RUNNING)
    complete(live)

    new_coordinator(metastore, storage, clock, job_id=IDLE).activate()
    return live


#: what every api-server of this test process serves, made once: the DAGs folder, and an
#: Airflow database migrated with those DAGs in it (see :func:`_migrated_and_serialized`)
_PREPARED: dict[str, Path] = {}
_PREPARING = threading.Lock()  # servers may be started from threads, to overlap their start-ups


def _served_dags() -> Path:
    """The DAGs folder of every api-server here (its files never change): the project's deploy
    DAG (no pipeline specs next to it: its pipeline param takes any job id) and the live
    pipeline's DAG."""
    with _PREPARING:
        if "dags" not in _PREPARED:
            root = Path(tempfile.mkdtemp(prefix="ckpt-tests-api-server-"))
            atexit.register(shutil.rmtree, root, ignore_errors=True)
            (root / "dags").mkdir()
            shutil.copy(DEPLOY_DAG, root / "dags" / DEPLOY_DAG.name)
            (root / "dags" / "routes_live.py").write_text(LIVE_DAG)
            _PREPARED["root"], _PREPARED["dags"] = root, root / "dags"
        return _PREPARED["dags"]


def _migrated_and_serialized(env: Mapping[str, str]) -> None:
    """Airflow's SQLite database of ``env`` migrated, with the DAGs of :func:`_served_dags` in
    it as the dag-processor would put them (so that the API can trigger them): ``airflow db
    migrate`` and ``airflow dags reserialize`` run once per test process, into a database that
    each server then gets a copy of (the DAGs folder is the same for all)."""
    with _PREPARING:
        template = _PREPARED.get("db")
        if template is None:
            template = _PREPARED["root"] / "airflow.db"
            prepared = {
                **env,
                "AIRFLOW_HOME": str(_PREPARED["root"] / "airflow"),
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{template}",
            }
            migrate(prepared)
            serialized = subprocess.run(
                [airflow_command(), "dags", "reserialize"],
                env=prepared,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            if serialized.returncode != 0:
                pytest.fail(f"airflow dags reserialize failed:\n{serialized.stderr[-3000:]}")
            _PREPARED["db"] = template
    target = Path(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].removeprefix("sqlite:///"))
    with closing(sqlite3.connect(template)) as src, closing(sqlite3.connect(target)) as dst:
        src.backup(dst)


def take_requests(server: Server) -> list[int]:
    """The live job's next epoch boundary: it triggers the queued savepoints and acks them."""
    taken = []
    for pending in server.live.process_requests():
        assert ack_all(server.live, pending).completed is not None
        taken.append(pending.checkpoint_id)
    return taken


@contextmanager
def running_api_server(root: Path, *, prefix: str = "") -> Iterator[Server]:
    """An api-server on a free loopback port, its files under ``root``, with the seeded
    metastore; stopped (its whole process group) on exit. ``prefix`` (e.g. ``/airflow``) serves
    Airflow under that path (``[api] base_url``), as behind a reverse proxy; ``Server.url``
    includes it."""
    url_metastore = f"sqlite:///{root / 'metastore.db'}"
    with _PREPARING:  # Alembic's migration context is process-wide: one upgrade at a time
        Metastore(url_metastore, check_schema=False).upgrade()
    metastore = Metastore(url_metastore)
    storage = FileSystemCheckpointStorage(f"file://{root / 'checkpoints'}")
    live = _seed(metastore, storage)

    port = free_port()
    url = f"http://127.0.0.1:{port}{prefix}"
    env = airflow_env(root / "airflow", _served_dags(), ckpt_home=root / "ckpt")
    passwords = {u: secrets.token_urlsafe(12) for u in ("admin", "viewer", "outsider")}
    (root / "passwords.json").write_text(json.dumps(passwords))
    env.update(
        {
            "CKPT_METASTORE_URL": url_metastore,
            "CKPT_STORAGE_URL": storage.base_url,
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(port),
            "AIRFLOW__API__BASE_URL": url,
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(48),
            "AIRFLOW__CORE__AUTH_MANAGER": SIMPLE_AUTH_MANAGER,
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,viewer:viewer,outsider:",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(root / "passwords.json"),
        }
    )
    _migrated_and_serialized(env)
    log = root / "api-server.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [airflow_command(), "api-server"],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"the api-server exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(f"{url}/api/v2/monitor/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the api-server did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        tokens = {user: api_token(url, user, password) for user, password in passwords.items()}
        server = Server(url, tokens, metastore, storage, live, log, passwords)
        server.live_run = _trigger_run(url, tokens["admin"], LIVE)
        yield server
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        metastore.dispose()
