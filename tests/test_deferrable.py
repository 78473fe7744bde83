"""The deferrable pipeline task (issue 27), in-process and without Spark: a stand-in
``spark-submit`` first on ``PATH`` plays the driver (it joins the coordination under the try's
attempt id, reports RUNNING, heart-beats, then finishes or dies), the task defers to the
trigger, the trigger's coroutine runs here, and ``execute_complete`` maps its event.

What the real scheduler and triggerer add (the TI deferred with no worker holding the slot, a
SIGKILLed triggerer resuming the coordination, real Spark, exactly-once output) is
``test_airflow_deferrable.py``'s."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.drivers import (
    AttemptState,
    AttemptVerdict,
    DriverIdentity,
    Outcome,
    judge,
    process_alive,
    read_state,
)
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Job
from checkpointing.status import JobStatus

pytest.importorskip("airflow")

JOB, DAG, RUN = "deferred_job", "deferred_job", "manual__2026-01-01T00:00:00+00:00"
T0 = datetime(2026, 1, 1, tzinfo=UTC)
ATTEMPT = "a-t1"


# ============================================================================ the verdict


def state(**fields: Any) -> AttemptState:
    values: dict[str, Any] = {
        "job_id": JOB,
        "coordinator_id": ATTEMPT,
        "status": "RUNNING",
        "updated_at": T0 + timedelta(seconds=5),
        "heartbeat_at": T0 + timedelta(seconds=5),
        "failure_cause": None,
        "driver": DriverIdentity(ATTEMPT, "other-host", 4242, "/logs/a.log", T0),
        "status_by": f"run:{ATTEMPT}",  # the driver's own run wrote it
    }
    return AttemptState(**{**values, **fields})


def outcome(s: AttemptState, *, at: float = 10, alive: bool | None = None) -> Outcome | None:
    verdict = judge(
        s, ATTEMPT, T0 + timedelta(seconds=at), alive=alive, heartbeat_timeout=timedelta(seconds=30)
    )
    return None if verdict is None else verdict.outcome


def test_the_job_row_judges_the_deferred_attempt() -> None:
    """The outcome is the job row's status written by the driver's own run; a driver whose
    process is gone, or silent past the timeout, is lost; a newer coordinator supersedes."""
    assert outcome(state()) is None  # running, beating
    assert outcome(state(status="FINISHED")) is Outcome.FINISHED
    assert outcome(state(status="FAILED")) is Outcome.FAILED
    assert outcome(state(status="CANCELED")) is Outcome.FAILED
    # a failure callback's FAILED (the previous try's, or a late one of the driver's own try,
    # under the driver's coordinator id; issue 38) is not the driver's: it runs on
    for callback in (f"failover:{ATTEMPT}", "failover:a-t0", None):
        failed = state(status="FAILED", status_by=callback)
        assert outcome(failed) is None, callback
        assert outcome(state(status="FINISHED", status_by=callback)) is None, callback
        assert outcome(failed, alive=False) is Outcome.DRIVER_LOST  # … until it is gone
    # the previous driver's FAILED (its own run's, of another attempt) is not this one's
    unbeaten = state(status="FAILED", status_by="run:a-t0", heartbeat_at=None)
    assert outcome(unbeaten) is None
    assert outcome(unbeaten, at=31) is Outcome.DRIVER_LOST  # never beat: lost after the timeout
    assert outcome(state(coordinator_id="a-t2")) is Outcome.SUPERSEDED
    assert outcome(state(status="FINISHED", coordinator_id="a-t2")) is Outcome.SUPERSEDED
    assert outcome(state(), alive=False) is Outcome.DRIVER_LOST  # its process is gone here
    assert outcome(state(status="FINISHED"), alive=False) is Outcome.FINISHED  # wrote, then exited
    assert outcome(state(), at=35) is None  # 30 s since the last beat
    assert outcome(state(), at=36) is Outcome.DRIVER_LOST
    old_beat = state(heartbeat_at=T0 - timedelta(seconds=1))  # a previous driver's beat
    assert outcome(old_beat, at=20) is None and outcome(old_beat, at=31) is Outcome.DRIVER_LOST
    assert outcome(state(status=None)) is Outcome.ERROR
    assert outcome(state(driver=None)) is None  # not recorded yet: nothing to watch
    lost = judge(state(), ATTEMPT, T0 + timedelta(seconds=40), alive=None)
    assert lost is None  # the default timeout is the heartbeat's (5 min)
    verdict = judge(state(status="FAILED", failure_cause="too many"), ATTEMPT, T0, alive=None)
    assert verdict is not None and "FAILED: too many" in verdict.message
    assert AttemptVerdict.from_event(verdict.to_event()) == verdict
    assert json.loads(json.dumps(verdict.to_event())) == verdict.to_event()


# ============================================================================ the trigger


def test_a_reused_pid_is_not_taken_for_the_driver() -> None:
    """A driver's pid is alive only while its process names the attempt (spark-submit's
    ``--attempt``): a reused pid is neither watched as the driver nor stopped as it."""
    import socket as _socket
    import subprocess

    now = datetime.now(UTC)
    host = _socket.gethostname()
    stranger = DriverIdentity(ATTEMPT, host, os.getpid(), None, now)
    assert process_alive(stranger) is False  # this test process: not the driver
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "--attempt", ATTEMPT],
        start_new_session=True,  # a driver leads its own session (test_driver_signals.py)
    )
    try:
        mine = DriverIdentity(ATTEMPT, host, sleeper.pid, None, now)
        # Popen returns at the fork: the child names the attempt once it has exec'd
        wait_until("the child's exec", lambda: process_alive(mine), timeout=30)
        assert process_alive(mine) is True
        assert process_alive(DriverIdentity(ATTEMPT, "elsewhere", sleeper.pid, None, now)) is None
    finally:
        sleeper.kill()
        sleeper.wait()


def test_the_trigger_serializes_ids_and_plain_values_only() -> None:
    from checkpointing_airflow.triggers import CheckpointCoordinatorTrigger

    trigger = CheckpointCoordinatorTrigger(
        job_id=JOB,
        attempt=ATTEMPT,
        parallelism=2,
        max_parallelism=16,
        metastore_conn_id="checkpoint_metastore",
        storage_url="s3://bucket/checkpoints",
        poll_seconds=0.5,
        heartbeat_timeout_seconds=20,
    )
    classpath, kwargs = trigger.serialize()
    module, name = classpath.rsplit(".", 1)
    again = getattr(importlib.import_module(module), name)(**json.loads(json.dumps(kwargs)))
    assert again.serialize() == (classpath, kwargs)
    assert set(kwargs) == {
        "job_id",
        "attempt",
        "parallelism",
        "max_parallelism",
        "metastore_conn_id",
        "storage_url",
        "poll_seconds",
        "heartbeat_timeout_seconds",
        "watcher",
        "aws_conn_id",
        "coordinates",
    }
    assert kwargs["watcher"] == ATTEMPT  # its own driver's
    assert kwargs["coordinates"] is True  # a spec's driver: the trigger coordinates it
    assert kwargs["aws_conn_id"] is None  # boto3's chain in the triggerer
    assert all(isinstance(v, str | int | float) for k, v in kwargs.items() if k != "aws_conn_id")


def test_the_trigger_reaches_s3_storage_with_the_tasks_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The triggerer serves many tasks: it cannot hold one task's credentials in its
    environment. The trigger's coordination writes to S3 with a client of the task's AWS
    connection (session token, endpoint) though the triggerer's environment has no AWS_*; and
    never with the triggerer's own credentials when the task's connection is missing."""
    import boto3

    from checkpointing_airflow.triggers import CheckpointCoordinatorTrigger
    from tests.spark_cluster import RecordingMotoServer

    key_id, secret, token = "ASIATRIGGER0EXAMPLE1", "trigger-secret-x", "IQoJTriggerToken-5"
    moto = RecordingMotoServer(tmp_path)
    moto.start()
    try:
        boto3.client(
            "s3", endpoint_url=moto.url, aws_access_key_id=key_id,
            aws_secret_access_key=secret, region_name="us-east-1",
        ).create_bucket(Bucket="ckpt")  # fmt: skip
        for name in [n for n in os.environ if n.startswith("AWS_")]:
            monkeypatch.delenv(name)
        extra = {"aws_session_token": token, "endpoint_url": moto.url, "region_name": "us-east-1"}
        monkeypatch.setenv(
            "AIRFLOW_CONN_TASK_AWS",
            json.dumps({"conn_type": "aws", "login": key_id, "password": secret, "extra": extra}),
        )
        url = f"sqlite:///{tmp_path / 'metastore.db'}"
        Metastore(url, check_schema=False).upgrade()
        metastore = Metastore(url)
        trigger = CheckpointCoordinatorTrigger(
            job_id=JOB,
            attempt=ATTEMPT,
            parallelism=2,
            max_parallelism=16,
            metastore_conn_id="checkpoint_metastore",
            storage_url="s3://ckpt/checkpoints",
            aws_conn_id="task_aws",
        )
        storage = trigger.coordination(metastore).storage
        storage.write_bytes(storage.job_url(JOB) + "/probe", b"x")
        # issue 38: a task whose connection the triggerer lacks is not served with the
        # triggerer's own credentials (here in its environment): the trigger ends in an error
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
        monkeypatch.setenv("AWS_ENDPOINT_URL", moto.url)
        monkeypatch.setenv("CKPT_METASTORE_URL", url)  # no checkpoint_metastore connection
        for missing in ("no_such_conn", None):
            lost = CheckpointCoordinatorTrigger(
                **{**trigger.serialize()[1], "aws_conn_id": missing}
            )
            event = asyncio.run(first_event(lost))
            assert event["outcome"] == "error", event
            assert f"AWS connection {missing or '(none)'!r} not found here" in event["message"]
        metastore.dispose()
        puts = [r for r in moto.requests() if r["method"] == "PUT" and "/probe" in r["url"]]
        assert puts and {r["headers"].get("X-Amz-Security-Token") for r in puts} == {token}
    finally:
        moto.stop()


# ============================================================================ the task and driver

FAKE_DRIVER = """#!{python}
import json, os, sys, time
from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.heartbeat import Heartbeat
from checkpointing.metastore.engine import Metastore
from checkpointing.status import JobStatus

args = sys.argv[1:]
attempt = args[args.index("--coordinator-id") + 1]
with open(os.environ["FAKE_SPARK_SUBMIT_OUT"], "w") as f:
    json.dump({{"argv": args, "env": dict(os.environ), "sid": os.getsid(0)}}, f)
job, mode = os.environ["FAKE_JOB"], os.environ["FAKE_DRIVER_MODE"]
if mode == "fail_at_start":
    print("Error: no module named 'pipeline_code'", flush=True)
    sys.exit(1)
while not os.path.exists(os.environ.get("FAKE_DRIVER_UP", "/")):  # a slow start
    time.sleep(0.05)
metastore = Metastore(os.environ["CKPT_METASTORE_URL"])
coordinator = CheckpointCoordinator(job, metastore, coordinator_id=attempt)
coordinator.join()
coordinator.job_status_changed(JobStatus.RUNNING)
print("driver running", flush=True)
with Heartbeat(metastore, job, attempt):
    while not os.path.exists(os.environ["FAKE_DRIVER_GO"]):
        time.sleep(0.05)
if mode == "finish":
    coordinator.shutdown(JobStatus.FINISHED)
    print("driver finished", flush=True)
else:
    print("driver dies", flush=True)
    os._exit(3)
"""


@dataclass
class TaskInstance:
    dag_id: str
    run_id: str
    try_number: int


@dataclass
class Deferred:
    """A task deferred: its operator, context, trigger, and the stand-in driver's files."""

    op: Any
    context: dict[str, Any]
    trigger: Any
    submitted: Path
    go: Path
    metastore: Metastore


@pytest.fixture
def airflow_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Airflow configured in this process (its home, the Spark connection), the metastore by
    ``CKPT_METASTORE_URL`` (no connection), the stand-in spark-submit first on ``PATH``."""
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "airflow"))
    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"})
    )
    url = f"sqlite:///{tmp_path / 'metastore.db'}"
    Metastore(url, check_schema=False).upgrade()
    monkeypatch.setenv("CKPT_METASTORE_URL", url)
    monkeypatch.setenv("CKPT_HOME", str(tmp_path / "ckpt"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "spark-submit"
    fake.write_text(FAKE_DRIVER.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SPARK_SUBMIT_OUT", str(tmp_path / "submitted.json"))
    monkeypatch.setenv("FAKE_JOB", JOB)
    monkeypatch.setenv("FAKE_DRIVER_GO", str(tmp_path / "go"))
    spec = tmp_path / f"{JOB}.yaml"
    spec.write_text(
        f"""
job: {JOB}
source: {{format: parquet, path: "{tmp_path}/in/*.parquet"}}
key: user
aggregations: {{n: count()}}
sink: {{path: {tmp_path / "out"}}}
parallelism: 2
max_parallelism: 16
checkpoint: {{interval: 1s}}
"""
    )
    return spec


def deferrable_operator(spec: Path, tmp_path: Path, **kwargs: Any) -> Any:
    """The deferrable task of ``spec``, its driver the stand-in (first on its ``PATH``)."""
    from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator

    return CheckpointedSparkSubmitOperator(
        task_id="run",
        pipeline=str(spec),
        storage_url=(tmp_path / "checkpoints").as_uri(),
        deferrable=True,
        coordinator_poll=0.1,
        driver_heartbeat_timeout=20,
        env_vars={"PATH": os.environ["PATH"]},  # the driver's PATH: the stand-in first
        **kwargs,
    )


def defer_try(
    spec: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    try_number: int = 1,
    dag_run: Any = None,
) -> Deferred:
    """Run the deferrable task's ``execute`` until it defers; the stand-in driver then runs
    until the test creates its ``go`` file."""
    from airflow.sdk.exceptions import TaskDeferred

    monkeypatch.setenv("FAKE_DRIVER_MODE", mode)
    op = deferrable_operator(spec, tmp_path, retries=1)
    context = {"ti": TaskInstance(DAG, RUN, try_number), "dag_run": dag_run}
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context)
    assert deferred.value.method_name == "execute_complete"
    metastore = Metastore(os.environ["CKPT_METASTORE_URL"])
    return Deferred(
        op,
        context,
        deferred.value.trigger,
        tmp_path / "submitted.json",
        tmp_path / "go",
        metastore,
    )


async def first_event(trigger: Any, timeout: float = 60) -> dict[str, Any]:
    events: AsyncIterator[Any] = trigger.run()
    event = await asyncio.wait_for(anext(events), timeout)
    await events.aclose()
    return dict(event.payload)


async def run_for(trigger: Any, seconds: float) -> None:
    """Run the trigger for ``seconds`` and cancel it, as a triggerer that dies would."""
    task = asyncio.ensure_future(first_event(trigger))
    await asyncio.sleep(seconds)
    assert not task.done(), task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def wait_until(what: str, found: Any, timeout: float = 60) -> Any:
    import time

    deadline = time.monotonic() + timeout
    while not (value := found()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def job_row(metastore: Metastore) -> Job:
    with metastore.transaction() as s:
        job = s.get(Job, JOB)
        assert job is not None
        s.expunge(job)
        return job


def test_a_deferred_try_detaches_its_driver_and_the_trigger_coordinates_it_to_the_end(
    airflow_in_process: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver runs in its own session with its credentials by environment only; its
    identity is on the job row; the trigger (serialised, then rebuilt, then "restarted")
    coordinates (periodic checkpoints of the try's tasks) until the driver finishes, and
    ``execute_complete`` returns the try's outcome."""
    from checkpointing_airflow.attempts import attempt_id

    d = defer_try(airflow_in_process, tmp_path, monkeypatch, "finish")
    attempt = attempt_id(DAG, RUN, 1)
    wait_until("the driver to start", d.submitted.exists, 30)
    submitted = json.loads(wait_until("its record", d.submitted.read_text))
    assert submitted["sid"] != os.getsid(0)  # its own session: the task's end does not stop it
    url = os.environ["CKPT_METASTORE_URL"]
    assert url not in " ".join(submitted["argv"]) and submitted["env"]["CKPT_METASTORE_URL"] == url
    job = job_row(d.metastore)
    assert (job.coordinator_id, job.driver_attempt) == (attempt, attempt)
    assert job.driver_pid and job.driver_host and job.driver_log
    wait_until("RUNNING", lambda: job_row(d.metastore).status == "RUNNING")

    _, kwargs = d.trigger.serialize()
    assert url not in json.dumps(kwargs)
    trigger = type(d.trigger)(**kwargs)
    asyncio.run(run_for(trigger, 3))  # a triggerer that dies mid-run …
    with d.metastore.transaction() as s:
        from checkpointing.metastore.models import Checkpoint

        triggered = [c.coordinator_id for c in s.query(Checkpoint).filter_by(job_id=JOB)]
    assert triggered and set(triggered) == {attempt}  # periodic, by the trigger, for this try

    resumed = type(d.trigger)(**kwargs)  # … and the restarted one carries on
    d.go.touch()
    event = asyncio.run(first_event(resumed))
    assert event["outcome"] == "finished", event
    outcome = d.op.execute_complete(d.context, event)
    assert outcome["status"] == "FINISHED" and outcome["attempt"] == attempt
    log = Path(job_row(d.metastore).driver_log or "")
    assert "driver finished" in log.read_text()
    d.metastore.dispose()


@pytest.mark.usefixtures("storage")  # its storage a root: a coordinator joins without one
def test_a_lost_driver_fails_the_try_and_a_superseded_trigger_stops(
    airflow_in_process: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A driver that dies without recording an outcome: the trigger fires ``driver_lost`` (its
    pending checkpoints aborted as job failover) and ``execute_complete`` raises what the
    retry callback restores from. A trigger whose try a newer one superseded fires
    ``superseded``, and the task fails without a retry of its own; its driver is left alone,
    until the user kills the task (the trigger's ``on_kill``)."""
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    d = defer_try(airflow_in_process, tmp_path, monkeypatch, "die")
    wait_until("RUNNING", lambda: job_row(d.metastore).status == "RUNNING")
    d.go.touch()
    event = asyncio.run(first_event(d.trigger))
    assert event["outcome"] == "driver_lost", event
    assert "exited without recording an outcome" in event["message"]
    with pytest.raises(AirflowException, match="exited without recording") as failed:
        d.op.execute_complete(d.context, event)
    assert not isinstance(failed.value, AirflowFailException)  # retried, from the checkpoints

    d.go.unlink()
    second = defer_try(airflow_in_process, tmp_path, monkeypatch, "finish", try_number=2)
    wait_until("try 2's driver", lambda: job_row(second.metastore).heartbeat_at)
    newer = CheckpointCoordinator(JOB, second.metastore, coordinator_id="someone-else")
    newer.activate()
    event = asyncio.run(first_event(second.trigger))
    assert event["outcome"] == "superseded", event
    with pytest.raises(AirflowFailException, match="superseded by someone-else"):
        second.op.execute_complete(second.context, event)
    # the superseded try's driver was left alone (the attempt that leads decides about it); its
    # end changes nothing of the job's
    driver = read_state(second.metastore, JOB).driver
    assert driver is not None and process_alive(driver)
    # a user marking the deferred task failed (the trigger's on_kill) stops its driver here
    asyncio.run(second.trigger.on_kill())
    assert not process_alive(driver)
    assert job_row(second.metastore).status == JobStatus.RUNNING  # it recorded nothing
    d.metastore.dispose()
    second.metastore.dispose()


@pytest.mark.usefixtures("storage")  # its storage a root: a coordinator joins without one
def test_a_retry_re_attaches_to_the_live_driver_of_the_try_before_it(
    airflow_in_process: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Try 1 failed (say its trigger was lost) while its detached driver runs on: the failure
    callback leaves the job alone, and try 2 re-attaches instead of submitting a driver and
    restoring; it coordinates under the driver's attempt id as the new watcher, which
    supersedes try 1's trigger; the outcome is the driver's, nothing restored."""
    from checkpointing.metastore.views import list_restores
    from checkpointing.restore.recovery import fail_attempt
    from checkpointing_airflow.attempts import attempt_id
    from checkpointing_airflow.callbacks import job_failed, restore_from_latest

    first, second = attempt_id(DAG, RUN, 1), attempt_id(DAG, RUN, 2)
    one = defer_try(airflow_in_process, tmp_path, monkeypatch, "finish")
    wait_until("try 1's driver", lambda: job_row(one.metastore).heartbeat_at)
    driver = read_state(one.metastore, JOB).driver
    assert driver is not None
    restore_from_latest({**one.context, "task": one.op})  # Airflow retries try 1
    assert job_row(one.metastore).status == "RUNNING"  # not failed: its driver lives
    assert list_restores(one.metastore, JOB) == []  # and no restore planned
    job_failed({**one.context, "task": one.op})  # were it the last try (issue 38): no
    assert job_row(one.metastore).status == "RUNNING"  # shutdown under the live driver

    one.submitted.unlink()
    two = defer_try(airflow_in_process, tmp_path, monkeypatch, "finish", try_number=2)
    assert not one.submitted.exists()  # no new spark-submit
    _, kwargs = two.trigger.serialize()
    assert (kwargs["attempt"], kwargs["watcher"], kwargs["parallelism"]) == (first, second, 2)
    job = job_row(two.metastore)
    assert (job.coordinator_id, job.driver_attempt, job.driver_watcher) == (first, first, second)

    event = asyncio.run(first_event(one.trigger))  # try 1's trigger, if it still ran: fenced
    assert event["outcome"] == "superseded" and f"re-attached to by {second}" in event["message"]

    # issue 38: try 1's retry callback runs again, late (after the re-attach, as the
    # dag-processor did under a real scheduler): it leaves the watched driver's job alone …
    restore_from_latest({**one.context, "task": one.op})
    assert job_row(one.metastore).status == "RUNNING" and list_restores(one.metastore, JOB) == []
    # … also when its check raced the re-attach: its failover, under the driver's coordinator
    # id for try 1, is fenced by the row's watcher in the transaction that would fail the job
    fenced = fail_attempt(
        one.metastore, JOB, "late", final=False, coordinator_id=first, watcher=first
    )
    assert fenced["superseded"] == second and fenced["aborted"] == []
    assert job_row(one.metastore).status == "RUNNING"
    # … and a FAILED a failover did write is not the driver's: try 2's watcher runs on
    fail_attempt(one.metastore, JOB, "a failover's", final=False, coordinator_id=first)
    assert (job_row(one.metastore).status, job_row(one.metastore).status_by) == (
        "FAILED",
        f"failover:{first}",
    )
    asyncio.run(run_for(two.trigger, 2.0))  # no event: the driver still beats
    two.go.touch()
    event = asyncio.run(first_event(two.trigger))
    assert event["outcome"] == "finished", event
    outcome = two.op.execute_complete(two.context, event)
    assert outcome["status"] == "FINISHED" and outcome["attempt"] == first, outcome
    assert outcome["restored_from"] is None
    wait_until("the driver to exit", lambda: process_alive(driver) is False)
    one.metastore.dispose()
    two.metastore.dispose()


def test_a_driver_that_fails_to_start_fails_the_try_before_it_defers(
    airflow_in_process: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: Any
) -> None:
    """The task keeps its slot until the driver's first heartbeat: a driver that exits before
    it (here: an import error) fails the try in the task, its log's end in the task's log, with
    the exception the retry callback restores from; nothing deferred."""
    from airflow.sdk.exceptions import AirflowException, AirflowFailException, TaskDeferred

    monkeypatch.setenv("FAKE_DRIVER_MODE", "fail_at_start")
    op = deferrable_operator(airflow_in_process, tmp_path)
    context = {"ti": TaskInstance(DAG, RUN, 1), "dag_run": None}
    with pytest.raises(AirflowException, match="exited without recording") as failed:
        op.execute(context)
    assert not isinstance(failed.value, (AirflowFailException, TaskDeferred))
    task_log = "".join(capfd.readouterr())
    assert "no module named 'pipeline_code'" in task_log  # the driver's log, in the task's


def test_a_retry_waits_for_a_starting_driver_and_re_attaches_to_it(
    airflow_in_process: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Try 1 dies while its driver is still starting (the task keeps its slot until the first
    heartbeat: a worker killed then): the retry callback leaves the starting driver alone, and
    try 2 waits for its first heartbeat and re-attaches rather than stopping it and restoring."""
    import threading

    from airflow.sdk.exceptions import TaskDeferred

    from checkpointing.metastore.views import list_restores
    from checkpointing_airflow.attempts import attempt_id
    from checkpointing_airflow.callbacks import restore_from_latest

    first, second = attempt_id(DAG, RUN, 1), attempt_id(DAG, RUN, 2)
    up = tmp_path / "up"
    monkeypatch.setenv("FAKE_DRIVER_UP", str(up))
    monkeypatch.setenv("FAKE_DRIVER_MODE", "finish")
    metastore = Metastore(os.environ["CKPT_METASTORE_URL"])
    outcomes: dict[int, BaseException] = {}

    def run_try(number: int) -> threading.Thread:
        op = deferrable_operator(airflow_in_process, tmp_path, retries=2)
        context = {"ti": TaskInstance(DAG, RUN, number), "dag_run": None}

        def execute() -> None:
            try:
                op.execute(context)
            except BaseException as exc:  # TaskDeferred, expected
                outcomes[number] = exc

        thread = threading.Thread(target=execute, daemon=True)
        thread.start()
        return thread

    try:
        one = run_try(1)  # try 1 waits in its slot for the driver's first heartbeat …
        wait_until("try 1's driver", lambda: read_state(metastore, JOB).driver)
        driver = read_state(metastore, JOB).driver
        assert driver is not None and driver.attempt == first
        restore_from_latest(  # … and dies there: Airflow retries it
            {"ti": TaskInstance(DAG, RUN, 1), "dag_run": None,
             "task": deferrable_operator(airflow_in_process, tmp_path, retries=2)}
        )  # fmt: skip
        assert list_restores(metastore, JOB) == []  # nothing planned: its driver is starting
        wait_until("the driver's start", (tmp_path / "submitted.json").exists)
        (tmp_path / "submitted.json").unlink()
        two = run_try(2)
        two.join(1.0)
        assert two.is_alive()  # waiting for the first heartbeat, not stopping the driver
        assert process_alive(driver)
        up.touch()
        two.join(60)
        one.join(60)
        deferred = outcomes[2]
        assert isinstance(deferred, TaskDeferred), deferred
        _, kwargs = deferred.trigger.serialize()
        assert (kwargs["attempt"], kwargs["watcher"]) == (first, second)
        assert not (tmp_path / "submitted.json").exists()  # no second spark-submit
        assert process_alive(driver) and list_restores(metastore, JOB) == []
        (tmp_path / "go").touch()
        event = asyncio.run(first_event(deferred.trigger))
        assert event["outcome"] == "finished", event
    finally:
        (tmp_path / "go").touch()  # the stand-in driver ends (a failed test leaves none)
        up.touch()
        metastore.dispose()


def test_a_retry_takes_the_outcome_of_a_driver_that_finished_after_its_try_died(
    airflow_in_process: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Try 1 died and its driver finished before the retry came: the callback leaves the
    FINISHED job alone, and try 2 re-attaches to the finished driver (no submit, no restore);
    its trigger reports the driver's outcome at once. A later clear of the run runs anew."""
    from checkpointing.metastore.views import list_restores
    from checkpointing_airflow.attempts import attempt_id
    from checkpointing_airflow.callbacks import restore_from_latest

    first, second = attempt_id(DAG, RUN, 1), attempt_id(DAG, RUN, 2)
    one = defer_try(airflow_in_process, tmp_path, monkeypatch, "finish")
    driver = read_state(one.metastore, JOB).driver
    assert driver is not None
    one.go.touch()
    wait_until("the driver to finish", lambda: process_alive(driver) is False)
    assert job_row(one.metastore).status == "FINISHED"
    restore_from_latest({**one.context, "task": one.op})  # Airflow retries try 1
    assert job_row(one.metastore).status == "FINISHED" and list_restores(one.metastore, JOB) == []
    one.submitted.unlink()
    two = defer_try(airflow_in_process, tmp_path, monkeypatch, "finish", try_number=2)
    assert not one.submitted.exists()  # no new spark-submit
    _, kwargs = two.trigger.serialize()
    assert (kwargs["attempt"], kwargs["watcher"]) == (first, second)
    event = asyncio.run(first_event(two.trigger))
    assert event["outcome"] == "finished", event
    outcome = two.op.execute_complete(two.context, event)
    assert outcome["attempt"] == first and outcome["restored_from"] is None, outcome

    # the DAG run cleared afterwards (say a refresh backfill): it started after that driver, so
    # its try runs anew with a driver of its own
    from types import SimpleNamespace

    cleared = SimpleNamespace(start_date=datetime.now(UTC), clear_number=1, conf={})
    three = defer_try(airflow_in_process, tmp_path, monkeypatch, "finish", 3, dag_run=cleared)
    assert one.submitted.exists()  # a new spark-submit
    _, kwargs = three.trigger.serialize()
    third = attempt_id(DAG, RUN, 3)
    assert (kwargs["attempt"], kwargs["watcher"]) == (third, third)
    three.go.touch()
    assert asyncio.run(first_event(three.trigger))["outcome"] == "finished"
    one.metastore.dispose()
    two.metastore.dispose()
    three.metastore.dispose()


def test_a_recorded_driver_is_not_judged_by_the_failure_before_it(tmp_path: Path) -> None:
    """The previous try's FAILED stays on the row until the new driver reports RUNNING, and the
    driver's registration moves ``updated_at`` before that: recording the driver resets the
    status, so the new try is not failed by its predecessor's failure (seen in CI)."""
    from checkpointing.coordination.drivers import record_driver

    url = f"sqlite:///{tmp_path / 'metastore.db'}"
    Metastore(url, check_schema=False).upgrade()
    metastore = Metastore(url)
    from checkpointing.config import CheckpointConfig
    from checkpointing.state.storage import CheckpointStorage

    storage = CheckpointStorage.from_url((tmp_path / "ckpt").as_uri())
    config = CheckpointConfig()
    retry = CheckpointCoordinator(JOB, metastore, storage, config, coordinator_id="a-t2")
    retry.activate()
    retry.job_status_changed(JobStatus.FAILED)  # what the failed try left on the row
    driver = DriverIdentity("a-t2", "elsewhere", 4242, None, datetime.now(UTC))
    assert record_driver(metastore, JOB, driver)
    # the driver registers
    CheckpointCoordinator(JOB, metastore, storage, config, coordinator_id="a-t2").join()
    now = datetime.now(UTC)
    assert judge(read_state(metastore, JOB), "a-t2", now, alive=None) is None
    metastore.dispose()
