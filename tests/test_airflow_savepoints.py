"""Savepoints and deploys under a real Airflow (``airflow dags test`` of the project's
``checkpoint_savepoint`` and ``checkpoint_deploy`` DAG files) and real Spark:

(c) the savepoint DAG against a pipeline running in another process (``ckpt run``): the savepoint
    completes and the job runs on;
(d) the savepoint DAG with ``stop`` ends the job at its savepoint, and ``checkpoint_deploy`` from
    that savepoint at a new parallelism finishes it: the output equals an uninterrupted run's.

A savepoint DAG that targets a job that is not running fails at once, saying so: that is
``test_dag_factory.test_a_savepoint_of_a_stopped_job_and_a_deploy_from_no_savepoint_fail_…``.

The running ``ckpt run`` is paused (SIGSTOP) while each ``airflow dags test`` starts and queues its
request, so that a fast machine cannot finish the job first; it is only ever paused while it holds
no metastore write lock (the savepoint DAG must be able to write its request).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from checkpointing.metastore import views
from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline import datasets
from checkpointing_airflow.dag_factory import sync_dag_files
from tests.airflow_harness import (
    AGGS,
    AIRFLOW,
    CKPT,
    REPO,
    AirflowHome,
    assert_exactly_once,
    make_airflow_home,
    write_events_spec,
)

JOB = "served"
#: epochs of the job: it runs only a few before it stops (it is paused whenever a request is
#: being queued), and the deploy runs the rest, so more would only make the deploy longer
FILES = 12
DEADLINE_S = 600  # JVM and Airflow start-ups are slow when other jobs share the 2 cores


@pytest.fixture(scope="module")
def airflow(tmp_path_factory: pytest.TempPathFactory) -> AirflowHome:
    """Airflow (SQLite) whose DAGs folder holds the project's savepoint and deploy DAG files and
    one pipeline spec with its DAG file, as ``dags/`` does."""
    root = tmp_path_factory.mktemp("airflow-savepoints")
    home = make_airflow_home(root, f"sqlite:///{root / 'airflow.db'}", root / "ckpt")
    for name in ("checkpoint_savepoint.py", "checkpoint_deploy.py"):
        shutil.copy(REPO / "dags" / name, home.dags / name)
    (home.dags / "pipelines").mkdir()
    return home


def write_spec(airflow: AirflowHome, events: Path, out: Path) -> Path:
    spec = write_events_spec(
        airflow.dags / "pipelines" / f"{JOB}.yaml",
        JOB,
        events,
        out,
        checkpoint="{every_epochs: 4, retained: 2}",
        retry_delay="1s",
    )
    sync_dag_files(spec.parent)
    return spec


def wait_for(what: str, found: Callable[[], Any], job: subprocess.Popen[str] | None = None) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while not (value := found()):
        if job is not None and job.poll() is not None:
            pytest.fail(f"ckpt run exited while waiting for {what}: {job.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


@contextmanager
def paused(pid: int, metastore_db: Path) -> Iterator[None]:
    """SIGSTOP ``pid`` at a moment it holds no write lock on the SQLite metastore (a reader
    does not block writers in WAL mode); SIGCONT on exit."""
    for _ in range(200):
        os.kill(pid, signal.SIGSTOP)
        probe = sqlite3.connect(metastore_db, timeout=0)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.rollback()
            break
        except sqlite3.OperationalError:  # mid-transaction: let it finish
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.02)
        finally:
            probe.close()
    else:
        pytest.fail("the job never left its metastore transactions")
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def trigger(airflow: AirflowHome, dag_id: str, conf: dict[str, Any]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [AIRFLOW, "dags", "test", dag_id, "--conf", json.dumps(conf)],
        env=airflow.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finished(proc: subprocess.Popen[str]) -> str:
    logs = proc.communicate(timeout=DEADLINE_S)[0]
    assert proc.returncode == 0, logs[-5000:]
    return logs


def completed_savepoint(logs: str) -> tuple[int, str]:
    found = re.search(rf"job {JOB}: savepoint (\d+) completed: (\S+)", logs)
    assert found, logs[-5000:]
    return int(found.group(1)), found.group(2)


@pytest.mark.timeout(1500)  # ~2 min on an idle 2-core machine
def test_c_d_savepoint_dag_against_a_running_job_then_stop_and_deploy_at_a_new_parallelism(
    airflow: AirflowHome, tmp_path: Path
) -> None:
    events = tmp_path / "events"
    datasets.generate_events(events, events=6_000, keys=200, files=FILES, seed=5)
    out = tmp_path / "out"
    spec = write_spec(airflow, events, out)
    metastore_db = Path(airflow.env["CKPT_HOME"]) / "metastore.db"
    upgraded = subprocess.run([CKPT, "db", "upgrade"], env=airflow.env, check=False)
    assert upgraded.returncode == 0
    metastore = Metastore(f"sqlite:///{metastore_db}")

    def requests() -> list[dict[str, Any]]:
        return views.list_requests(metastore, JOB)

    def status() -> str | None:
        return next((j["status"] for j in views.list_jobs(metastore) if j["job_id"] == JOB), None)

    job = subprocess.Popen(
        [CKPT, "run", str(spec)],
        env=airflow.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for("the job to run", lambda: status() == "RUNNING", job)

        # (c) a savepoint of the running job, from the trigger form's Params
        with paused(job.pid, metastore_db):
            asked = trigger(airflow, "checkpoint_savepoint", {"pipeline": JOB, "timeout": 300})
            wait_for("the savepoint request", lambda: len(requests()) == 1)
        first = wait_for(
            "the savepoint",
            lambda: requests()[0]["status"] not in ("QUEUED", "TRIGGERED") and requests()[0],
            job,
        )
        with paused(job.pid, metastore_db):  # keep it running for (d)
            first_id, first_path = completed_savepoint(finished(asked))
            assert status() == "RUNNING"  # a plain savepoint does not stop the job
        assert first["checkpoint_id"] == first_id
        assert first["status"] == "COMPLETED" and first["type"] == "SAVEPOINT"
        assert first["requested_by"].startswith("airflow:checkpoint_savepoint/")
        (savepoint,) = views.list_checkpoints(metastore, JOB, checkpoint_type="SAVEPOINT")
        assert (savepoint["checkpoint_id"], savepoint["status"]) == (first_id, "COMPLETED")
        assert savepoint["metadata_path"] == f"{first_path}/_metadata"

        # (d) stop-with-savepoint: the job ends at its savepoint
        with paused(job.pid, metastore_db):
            stop = trigger(airflow, "checkpoint_savepoint", {"pipeline": JOB, "stop": True})
            wait_for("the stop-with-savepoint request", lambda: len(requests()) == 2)
        stop_id, stop_path = completed_savepoint(finished(stop))
        stdout, stderr = job.communicate(timeout=DEADLINE_S)
    finally:
        if job.poll() is None:
            os.kill(job.pid, signal.SIGCONT)
            job.kill()
            job.wait()
    assert job.returncode == 0, stderr[-3000:]
    stopped = re.search(
        rf"job {JOB} stopped with savepoint {stop_id} after (\d+) of {FILES}", stdout
    )
    assert stopped, stdout
    assert stop_id > first_id and requests()[0]["status"] == "COMPLETED"
    assert not (out / "final").exists()  # the job did not finish

    # ... then deployed from that savepoint at a new parallelism: the rest of the epochs, and
    # the same output as a run that was never stopped
    deployed = airflow.dags_test(
        "checkpoint_deploy", {"pipeline": JOB, "from": stop_path, "parallelism": 3}
    )
    logs = deployed.stdout + deployed.stderr
    assert deployed.returncode == 0, logs[-5000:]
    done_epochs = int(stopped.group(1))
    assert re.search(
        rf"job {JOB} finished: {FILES - done_epochs} of {FILES} epochs run \(restored from "
        rf"checkpoint {stop_id}\)",
        logs,
    ), logs[-5000:]
    restored = views.list_restores(metastore, JOB)[0]
    assert restored["status"] == "RESTORED" and restored["checkpoint_id"] == stop_id
    assert restored["checkpoint_type"] == "SAVEPOINT_THEN_STOP" and restored["parallelism"] == 3
    assert_exactly_once(out, events, AGGS)
    metastore.dispose()
