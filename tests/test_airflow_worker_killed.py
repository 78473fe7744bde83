"""(e) The coordinator's worker killed mid-run: the retry resumes coordination.

A real local Airflow 3 (``demo.local_airflow``: api-server, scheduler with the
LocalExecutor, dag-processor, triggerer) runs a small pipeline DAG, triggered through the REST
API. Once a checkpoint of the run has completed and the next one is pending, the whole process
tree of the task is SIGKILLed: the LocalExecutor's worker that supervises the task, the task
runner hosting the operator (the job's coordinator), ``spark-submit``, the Spark JVM and the
driver. No coordinator and no driver of try 1 is left, and nobody runs a failure handler in them.

Then the scheduler notices the missing heartbeats and Airflow retries the task. Try 2 becomes
the job's coordinator, the checkpoint try 1 left pending is aborted as coordinator/job failover
(not counted as a checkpoint failure), try 2 restores the latest completed checkpoint, redoes only
the epochs after it, and the output is exactly-once. Nothing is left running afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from checkpointing import datasets, views
from checkpointing.config import Settings
from checkpointing.failure import CheckpointFailureReason
from checkpointing.metastore import Metastore
from checkpointing.models import Checkpoint, Job
from demo.local_airflow import LocalAirflow, local_airflow
from tests.airflow_harness import AGGS, CKPT, assert_exactly_once, write_events_spec
from tests.helpers import checkpoint_rows

JOB = "killed_worker"
TASK = "run"
FILES = 24
#: the scheduler fails a running task whose supervisor has not heartbeat for this long
HEARTBEAT_TIMEOUT_S = 20
FAILOVER_REASONS = {"CHECKPOINT_COORDINATOR_FAILOVER", "JOB_FAILOVER"}
DEADLINE_S = 300  # per wait; the whole test takes ~3 min on an idle 2-core machine

DAG = """
from datetime import timedelta

import pendulum
from airflow.sdk import DAG

from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator

with DAG({job!r}, schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False):
    CheckpointedSparkSubmitOperator(
        task_id={task!r},
        pipeline={spec!r},
        retries=1,
        retry_delay=timedelta(seconds=2),
        conf={{
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1",
        }},
    )
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, found: Callable[[], Any], timeout: float = DEADLINE_S) -> Any:
    """Poll ``found`` until it returns something truthy; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (value := found()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)
    return value


class Api:
    """Airflow's REST API with the local Airflow's admin login (``POST /auth/token``)."""

    def __init__(self, airflow: LocalAirflow) -> None:
        self.url = airflow.url
        body = {"username": airflow.user, "password": airflow.password}
        self.token = self.call("/auth/token", body, auth=False)["access_token"]

    def call(self, path: str, body: dict[str, Any] | None = None, *, auth: bool = True) -> Any:
        headers = {"Content-Type": "application/json"}
        if auth:
            headers["Authorization"] = f"Bearer {self.token}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{self.url}{path}", data, headers)
        with urllib.request.urlopen(request, timeout=30) as r:
            return json.loads(r.read())

    def get(self, path: str) -> Any:
        """GET, or None on 404 (not there yet)."""
        try:
            return self.call(path)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise


@pytest.fixture
def airflow(tmp_path: Path) -> Iterator[LocalAirflow]:
    """A local Airflow whose DAGs folder holds the test's pipeline DAG, with short heartbeat
    timeouts; stopped afterwards, and then no process of it may be left."""
    home = tmp_path / "ckpt"
    settings = Settings(
        metastore_url=f"sqlite:///{home / 'metastore.db'}",
        storage_url=(home / "checkpoints").as_uri(),
        home=home,
    )
    Metastore(settings.metastore_url, check_schema=False).upgrade()
    events = tmp_path / "events"
    datasets.generate_events(events, events=24_000, keys=200, files=FILES, seed=5)
    spec = write_events_spec(
        tmp_path / f"{JOB}.yaml",
        JOB,
        events,
        tmp_path / "out",
        checkpoint="{every_epochs: 1, retained: 2, tolerable_failures: 0}",
    )
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / f"{JOB}.py").write_text(DAG.format(job=JOB, task=TASK, spec=str(spec)))
    local = local_airflow(
        settings,
        port=_free_port(),
        home=tmp_path / "airflow",
        dags=dags,
        extra_env={
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT_S),
            "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "2",
            "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "2",  # a live task: every 2 s
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        },
    )
    local.start()
    try:
        yield local
    finally:
        local.stop()
    deadline = time.monotonic() + 30
    while (left := leftovers(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, [" ".join(p.cmdline()) for p in left]


def leftovers(root: Path) -> list[psutil.Process]:
    """Processes of this test's Airflow: its home in their environment or the test's directory
    on their command line (Spark drivers, spark-submit, task runners, components)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid == os.getpid():
            continue
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            home = proc.environ().get("AIRFLOW_HOME", "")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if str(root) in cmdline or home.startswith(str(root)):
            found.append(proc)
    return found


def reason(checkpoint: Checkpoint) -> CheckpointFailureReason:
    return CheckpointFailureReason(checkpoint.failure_reason)


def task_tree(ti_id: str) -> list[psutil.Process]:
    """Every process of one task instance: the LocalExecutor worker supervising it and the task
    runner (both titled with the task instance's id), and all their descendants."""
    roots = []
    for proc in psutil.process_iter(["cmdline"]):
        if ti_id in " ".join(proc.info["cmdline"] or []):
            roots.append(proc)
    tree: dict[int, psutil.Process] = {}
    for root in roots:
        try:
            for p in [root, *root.children(recursive=True)]:
                tree[p.pid] = p
        except psutil.NoSuchProcess:
            continue
    return list(tree.values())


def freeze(ti_id: str) -> list[psutil.Process]:
    """SIGSTOP the task's process tree, until no new process appears in it."""
    stopped: dict[int, psutil.Process] = {}
    while new := [p for p in task_tree(ti_id) if p.pid not in stopped]:
        for p in new:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.suspend()
            stopped[p.pid] = p
    return list(stopped.values())


def described(proc: psutil.Process) -> tuple[int, str]:
    """Parent pid and command line ("" for a zombie: a child that exited, not yet reaped)."""
    try:
        return proc.ppid(), " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return -1, ""


def gone(proc: psutil.Process) -> bool:
    """Dead (a zombie counts: nothing runs in it any more)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def thaw(procs: list[psutil.Process]) -> None:
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.resume()


@pytest.mark.timeout(600)
def test_a_killed_worker_is_retried_and_the_retry_resumes_coordination(
    airflow: LocalAirflow, tmp_path: Path
) -> None:
    from checkpointing_airflow.operators import attempt_id

    assert airflow.wait_until_serving(DEADLINE_S)
    api = Api(airflow)
    metastore = Metastore(airflow.env["CKPT_METASTORE_URL"])
    wait_for(f"the DAG {JOB}", lambda: api.get(f"/api/v2/dags/{JOB}"))
    assert api.call("/api/v2/importErrors")["total_entries"] == 0
    run = api.call(f"/api/v2/dags/{JOB}/dagRuns", {"logical_date": None})
    run_id = run["dag_run_id"]
    ti_path = f"/api/v2/dags/{JOB}/dagRuns/{urllib.parse.quote(run_id, safe='')}/taskInstances"

    def running_ti() -> dict[str, Any] | None:
        ti = api.get(f"{ti_path}/{TASK}")
        assert ti is None or ti["state"] not in ("success", "failed"), ti
        return ti if ti and ti["state"] == "running" and ti["try_number"] == 1 else None

    ti_id = wait_for("try 1 to run", running_ti)["id"]
    first, second = (attempt_id(JOB, run_id, n) for n in (1, 2))

    # --- kill try 1's whole process tree while a checkpoint of it is pending, after one completed
    def try_1_pending() -> Checkpoint | None:
        rows = checkpoint_rows(metastore, JOB)
        with metastore.transaction() as s:
            job = s.get(Job, JOB)
        assert job is None or job.status != "FINISHED", "try 1 ended before it could be killed"
        assert not any(c.coordinator_id == second for c in rows)
        done = [c for c in rows if c.completed_at is not None]
        pending = [c for c in rows if c.status == "PENDING" and c.coordinator_id == first]
        return pending[0] if len(done) >= 2 and pending else None

    killed: dict[int, tuple[int, str]] = {}  # pid: (parent pid, command line)
    deadline = time.monotonic() + DEADLINE_S
    while not killed:
        assert time.monotonic() < deadline, "no checkpoint of try 1 was ever pending"
        if try_1_pending() is None:
            time.sleep(0.05)
            continue
        frozen = freeze(ti_id)
        if (pending := try_1_pending()) is None:  # it completed before the freeze: next one
            thaw(frozen)
            continue
        latest = max(c.checkpoint_id for c in checkpoint_rows(metastore, JOB) if c.completed_at)
        killed = {p.pid: described(p) for p in frozen}
        for p in frozen:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        wait_for("try 1's processes to die", lambda: all(map(gone, frozen)), 30)  # noqa: B023

    # the supervisor (a LocalExecutor worker of the scheduler), the driver: all of try 1
    scheduler = airflow.processes["scheduler"].pid
    assert any(ppid == scheduler and ti_id in cmd for ppid, cmd in killed.values()), killed
    assert any(f"--coordinator-id {first}" in cmd for _, cmd in killed.values()), killed
    assert any("SparkSubmit" in cmd for _, cmd in killed.values()), killed

    # try 1's checkpoints were 1 … latest (each after its epoch) and the pending one
    ours = [c for c in checkpoint_rows(metastore, JOB) if c.coordinator_id == first]
    assert [c.checkpoint_id for c in ours] == list(range(1, pending.checkpoint_id + 1))
    assert pending.checkpoint_id == latest + 1

    # --- Airflow notices the dead task and retries it; the DAG run succeeds
    def run_ended() -> str | None:
        state = api.call(f"/api/v2/dags/{JOB}/dagRuns/{urllib.parse.quote(run_id, safe='')}")
        return state["state"] if state["state"] in ("success", "failed") else None

    assert wait_for("the DAG run to end", run_ended) == "success"
    tries = {t["try_number"]: t for t in api.call(f"{ti_path}/{TASK}/tries")["task_instances"]}
    assert tries[2]["state"] == "success", tries
    assert tries[1]["state"] in ("failed", "up_for_retry"), tries[1]
    timeouts = api.call(f"/api/v2/eventLogs?dag_id={JOB}&event=heartbeat%20timeout")
    assert timeouts["total_entries"] >= 1  # the scheduler found try 1 without heartbeats

    # --- try 2 became the coordinator; try 1's pending checkpoint was aborted, not counted
    with metastore.transaction() as s:
        job = s.get(Job, JOB)
        assert job is not None
        assert job.coordinator_id == second
        assert job.failure_cause is None and job.consecutive_failures == 0
    rows = {c.checkpoint_id: c for c in checkpoint_rows(metastore, JOB)}
    aborted = rows[pending.checkpoint_id]
    assert aborted.status == "ABORTED"
    assert aborted.failure_reason in FAILOVER_REASONS, aborted.failure_reason
    counted = [c for c in rows.values() if c.failure_reason and reason(c).counts_as_failure]
    assert not counted, [(c.checkpoint_id, c.failure_reason) for c in counted]
    later = [c for c in rows.values() if c.coordinator_id == second]
    assert later and all(c.completed_at is not None for c in later), later

    # --- try 2 restored the latest completed checkpoint (`ckpt restores` shows it) …
    shown = subprocess.run(
        [CKPT, "restores", JOB, "--json"],
        env={**os.environ, "CKPT_METASTORE_URL": airflow.env["CKPT_METASTORE_URL"]},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    restores = json.loads(shown.stdout)
    assert restores == views.list_restores(metastore, JOB)
    restored = [r for r in restores if r["attempt"] == second and r["status"] == "RESTORED"]
    assert [r["checkpoint_id"] for r in restored] == [latest], restores

    # … and redid only the epochs after it (checkpoint k was taken after epoch k - 1)
    xcom = api.call(f"{ti_path}/{TASK}/xcomEntries/return_value?deserialize=true")["value"]
    outcome = xcom if isinstance(xcom, dict) else json.loads(xcom)
    assert outcome["restored_from"] == latest
    assert outcome["epochs_run"] == list(range(latest, FILES))
    assert_exactly_once(tmp_path / "out", tmp_path / "events", AGGS)
