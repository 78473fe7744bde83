"""The failure callbacks run in-process against a real metastore: a callback that Airflow runs late
(after a killed worker, the dag-processor runs it when the retry may already coordinate the job)
leaves the running try alone; the callback of the current try does its work."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint, Job
from checkpointing.metastore.views import list_restores
from checkpointing.pipeline.spec import load_spec
from checkpointing.restore.recovery import pipeline_plan
from checkpointing.state.storage import CheckpointStorage
from checkpointing.status import JobStatus
from checkpointing_airflow.attempts import attempt_id
from checkpointing_airflow.callbacks import newer_coordinator, restore_from_latest
from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator

DAG, RUN, JOB = "late_callback", "manual__2026-01-01T00:00:00+00:00", "late_callback"


@dataclass
class TaskInstance:
    """What the callbacks read of Airflow's task instance."""

    dag_id: str
    run_id: str
    try_number: int


@pytest.fixture
def task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CheckpointedSparkSubmitOperator:
    url = f"sqlite:///{tmp_path / 'metastore.db'}"
    Metastore(url, check_schema=False).upgrade()
    monkeypatch.setenv("CKPT_METASTORE_URL", url)  # no checkpoint_metastore connection
    spec = tmp_path / f"{JOB}.yaml"
    spec.write_text(
        f"""
job: {JOB}
source: {{format: parquet, path: "{tmp_path}/in/*.parquet"}}
key: user
aggregations: {{n: count()}}
sink: {{path: {tmp_path / "out"}}}
parallelism: 1
max_parallelism: 16
"""
    )
    return CheckpointedSparkSubmitOperator(
        task_id="run", pipeline=str(spec), storage_url=(tmp_path / "checkpoints").as_uri()
    )


def running_try(task: CheckpointedSparkSubmitOperator, try_number: int) -> tuple[Metastore, int]:
    """Try ``try_number`` coordinates the job, which runs, with one checkpoint pending."""
    spec = load_spec(task.pipeline)
    metastore = Metastore(task.metastore_url())
    attempt = attempt_id(DAG, RUN, try_number)
    coordinator = CheckpointCoordinator(
        JOB,
        metastore,
        CheckpointStorage.from_url(task.storage_for(spec)),
        spec.checkpoint.config(),
        coordinator_id=attempt,
    )
    coordinator.activate()
    coordinator.job_status_changed(JobStatus.RUNNING)
    pending = coordinator.trigger_checkpoint(tasks=pipeline_plan(attempt, 1, 16))
    return metastore, pending.checkpoint_id


def test_newer_coordinator_is_a_later_try_of_the_same_run(
    task: CheckpointedSparkSubmitOperator,
) -> None:
    metastore, _ = running_try(task, 2)
    t1, t2, t3 = (attempt_id(DAG, RUN, n) for n in (1, 2, 3))
    assert newer_coordinator(metastore, JOB, t1, 1) == t2
    assert newer_coordinator(metastore, JOB, t2, 2) is None  # itself
    assert newer_coordinator(metastore, JOB, t3, 3) is None  # an older try
    other = attempt_id(DAG, "another-run", 1)
    assert newer_coordinator(metastore, JOB, other, 1) is None  # another run's
    assert newer_coordinator(metastore, "no_such_job", t1, 1) is None


def test_a_late_retry_callback_leaves_the_try_that_took_over_alone(
    task: CheckpointedSparkSubmitOperator,
) -> None:
    metastore, checkpoint_id = running_try(task, 2)

    restore_from_latest({"task": task, "ti": TaskInstance(DAG, RUN, 1)})  # try 1's, late
    with metastore.transaction() as s:
        job, pending = s.get(Job, JOB), s.get(Checkpoint, (JOB, checkpoint_id))
        assert job is not None and pending is not None
        assert (job.status, job.coordinator_id) == ("RUNNING", attempt_id(DAG, RUN, 2))
        assert pending.status == "PENDING"
    assert list_restores(metastore, JOB) == []

    restore_from_latest({"task": task, "ti": TaskInstance(DAG, RUN, 2)})  # try 2's own
    with metastore.transaction() as s:
        job, pending = s.get(Job, JOB), s.get(Checkpoint, (JOB, checkpoint_id))
        assert job is not None and pending is not None
        assert job.status == "FAILED"
        assert (pending.status, pending.failure_reason) == ("ABORTED", "JOB_FAILOVER")
    assert [r["attempt"] for r in list_restores(metastore, JOB)] == [attempt_id(DAG, RUN, 3)]


def test_a_callback_reads_the_runs_rendered_fields_not_the_dag_files_templates(
    task: CheckpointedSparkSubmitOperator,
) -> None:
    """Issue 38: the dag-processor hands the callback the task as the DAG file built it
    (``parallelism="{{ params.parallelism }}"``, as the pipeline DAGs pass the trigger form's
    value); the callback plans the retry at the run's value, and leaves the parsed task as is."""
    task.parallelism, task.restore = "{{ params.parallelism }}", "{{ params.restore }}"
    metastore, _ = running_try(task, 1)
    params = {"parallelism": 3, "restore": "latest"}
    restore_from_latest({"task": task, "ti": TaskInstance(DAG, RUN, 1), "params": params})
    (planned,) = list_restores(metastore, JOB)
    assert (planned["attempt"], planned["parallelism"]) == (attempt_id(DAG, RUN, 2), 3)
    assert task.parallelism == "{{ params.parallelism }}"  # another run's callback renders anew


def test_a_callbacks_failover_discards_in_the_tasks_storage_not_the_rows(
    task: CheckpointedSparkSubmitOperator, tmp_path: Path
) -> None:
    """Issue 38: any driver can write its job row's ``storage_url``; the failover of a failed
    try aborts its pending checkpoint and discards its directory in the storage the *task* is
    configured with, never under a base the row names."""
    from sqlalchemy import update

    metastore, pending = running_try(task, 1)
    mine = tmp_path / "checkpoints" / JOB / f"chk-{pending}"
    theirs = tmp_path / "elsewhere" / JOB / f"chk-{pending}"
    for directory in (mine, theirs):
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "state").write_bytes(b"x")
    with metastore.transaction() as s:  # what a driver could write
        s.execute(
            update(Job)
            .where(Job.job_id == JOB)
            .values(storage_url=(tmp_path / "elsewhere").as_uri())
        )
    restore_from_latest({"task": task, "ti": TaskInstance(DAG, RUN, 1)})
    with metastore.transaction() as s:
        row = s.get(Checkpoint, (JOB, pending))
        assert row is not None and (row.status, row.failure_reason) == ("ABORTED", "JOB_FAILOVER")
    assert not mine.exists()  # the aborted checkpoint's own directory, in the task's storage
    assert (theirs / "state").read_bytes() == b"x"  # the row's base: untouched


def test_the_last_try_that_had_re_attached_fails_the_job_under_its_drivers_id(
    task: CheckpointedSparkSubmitOperator,
) -> None:
    """Review of issue 38: try 2 re-attached to try 1's detached driver (the job row still names
    try 1 as coordinator, try 2 as watcher), then the driver died and try 2, the last, failed.
    Its failure callback acts under the driver's id, as the retry callback does: the job is
    FAILED and its pending checkpoint aborted, instead of a fenced no-op leaving it RUNNING."""
    import subprocess
    import sys
    from datetime import UTC, datetime

    from sqlalchemy import update

    from checkpointing.coordination.drivers import DriverIdentity, record_driver, this_host
    from checkpointing_airflow.callbacks import job_failed

    task.deferrable = True
    metastore, pending = running_try(task, 1)
    first, second = attempt_id(DAG, RUN, 1), attempt_id(DAG, RUN, 2)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a driver that has exited: not live
    driver = DriverIdentity(first, this_host(), dead.pid, None, datetime.now(UTC), 1)
    assert record_driver(metastore, JOB, driver)
    with metastore.transaction() as s:  # the driver ran, then try 2 re-attached as its watcher
        s.execute(
            update(Job).where(Job.job_id == JOB).values(status="RUNNING", driver_watcher=second)
        )

    job_failed({"task": task, "ti": TaskInstance(DAG, RUN, 2)})
    with metastore.transaction() as s:
        job, row = s.get(Job, JOB), s.get(Checkpoint, (JOB, pending))
        assert job is not None and row is not None
        assert job.status == "FAILED"
        assert row.status == "ABORTED"
