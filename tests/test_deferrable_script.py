"""``deferrable=True`` for a step-checkpointed script (issue 39), in-process with a real
``spark-submit`` of a real script: the task launches the script's driver detached and defers;
the trigger's coroutine runs here and only *watches* the driver (the script's ``checkpointed``
coordinates its own steps); ``execute_complete`` maps its event.

The scenario: try 1 defers while its driver runs; its worker "dies" and try 2 re-attaches to
the live driver (no second driver, try 1's trigger superseded); the driver is then SIGKILLed, so
try 2's trigger reports it lost and try 2 fails into a retry; try 3 launches a new driver at
another parallelism, reuses the step completed before the kill, and publishes exactly DuckDB's
answer. A script refused for its configuration as it starts (exit code 78) fails its try for
good.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from sqlalchemy import func, select

from checkpointing.coordination.drivers import read_state
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint
from tests.airflow_harness import wait_for
from tests.test_airflow_steps import _completed as completed  # the same job, daily_revenue
from tests.test_steps import acked_files, expected, published, write_inputs

pytest.importorskip("airflow")

JOB = "daily_revenue"
RUN = "manual__2026-11-29T00:00:00+00:00"

#: the 4-step job of examples/steps, its join written whole (not chained: its checkpoint is the
#: one the test reads back), waiting after that first step until the gate file exists (the
#: test kills the driver there)
GATED_SCRIPT = """
import os, sys, time
from pyspark.sql import Window
from pyspark.sql import functions as F
from checkpointing.spark.session import spark_session
from checkpointing.spark.steps import checkpointed

orders_path, customers_path, out, gate = sys.argv[1:5]
spark = spark_session("daily_revenue")
orders = spark.read.parquet(orders_path)
customers = spark.read.parquet(customers_path)
by_revenue = Window.partitionBy("day").orderBy(F.desc("rev"), "region")
with checkpointed(spark, job={job!r}) as ck:
    enriched = ck.step("enriched", lambda: orders.join(customers, "cid"))
    while not os.path.exists(gate):
        time.sleep(0.1)
    daily = ck.step(
        "daily",
        lambda: enriched.groupBy("day", "region").agg(
            F.sum("amount").alias("rev"), F.count(F.lit(1)).alias("n")
        ),
    )
    ranked = ck.step("ranked", lambda: daily.withColumn("rank", F.rank().over(by_revenue)))
    ck.write(ranked, out)
spark.stop()
"""


@dataclass
class TaskInstance:
    dag_id: str
    run_id: str
    try_number: int


@pytest.fixture
def airflow_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Airflow configured in this process (its home, the Spark connection: local[2]), the
    metastore by ``CKPT_METASTORE_URL``; returns that URL."""
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "airflow"))
    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[2]"})
    )
    url = f"sqlite:///{tmp_path / 'metastore.db'}"
    Metastore(url, check_schema=False).upgrade()
    monkeypatch.setenv("CKPT_METASTORE_URL", url)
    monkeypatch.setenv("CKPT_HOME", str(tmp_path / "ckpt"))
    return url


def script_operator(tmp_path: Path, script: Path, args: list[str], **kwargs: Any) -> Any:
    """A fresh deferrable script task of the DAG ``daily_revenue`` (each try gets its own, as
    under Airflow)."""
    from airflow.sdk import DAG

    from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator

    with DAG(JOB, schedule=None):
        return CheckpointedSparkSubmitOperator(
            task_id="run",
            application=str(script),
            application_args=args,
            storage_url=(tmp_path / "checkpoints").as_uri(),
            deferrable=True,
            coordinator_poll=0.2,
            conf={"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false"},
            **kwargs,
        )


def defer(op: Any, try_number: int) -> tuple[dict[str, Any], Any]:
    """Run a try's ``execute`` up to its deferral: its context and trigger."""
    from airflow.sdk.exceptions import TaskDeferred

    context = {"ti": TaskInstance(JOB, RUN, try_number), "dag_run": None}
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context)
    assert deferred.value.method_name == "execute_complete"
    return context, deferred.value.trigger


async def first_event(trigger: Any, timeout: float = 180) -> dict[str, Any]:
    events: AsyncIterator[Any] = trigger.run()
    event = await asyncio.wait_for(anext(events), timeout)
    await events.aclose()
    return dict(event.payload)


def all_checkpoints(metastore: Metastore) -> int:
    with metastore.reading() as s:
        count = select(func.count()).select_from(Checkpoint).where(Checkpoint.job_id == JOB)
        return int(s.scalar(count) or 0)


@pytest.mark.timeout(600)
def test_a_deferred_script_re_attaches_then_resumes_from_its_steps_exactly(
    airflow_in_process: str, tmp_path: Path
) -> None:
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    from checkpointing_airflow.attempts import attempt_id

    orders, customers = write_inputs(tmp_path / "in")
    out, gate = tmp_path / "out", tmp_path / "gate"
    script = tmp_path / "daily.py"
    script.write_text(GATED_SCRIPT.format(job=JOB))
    args = [str(orders), str(customers), str(out), str(gate)]
    first, second, third = (attempt_id(JOB, RUN, n) for n in (1, 2, 3))

    def operator() -> Any:
        return script_operator(
            tmp_path, script, args, parallelism=1, parallelism_on_retry=2, retries=2
        )

    metastore = Metastore(airflow_in_process)
    try:
        # try 1: the driver is launched detached; the trigger only watches it
        _, trigger1 = defer(operator(), 1)
        kwargs = trigger1.serialize()[1]
        assert kwargs["coordinates"] is False and kwargs["attempt"] == first
        driver = read_state(metastore, JOB).driver
        assert driver is not None and driver.attempt == first
        wait_for("the first step", lambda: completed(metastore) >= 1, every=0.2)

        # try 1's worker dies; try 2 re-attaches to the live driver: no second driver
        context2, trigger2 = defer(operator(), 2)
        assert (trigger2.attempt, trigger2.watcher) == (first, second)
        assert read_state(metastore, JOB).driver == driver
        superseded = asyncio.run(first_event(trigger1, 60))
        assert superseded["outcome"] == "superseded", superseded

        # the driver is SIGKILLed (its whole session): try 2's trigger reports it lost
        os.killpg(driver.pid, signal.SIGKILL)
        lost = asyncio.run(first_event(trigger2, 60))
        assert lost["outcome"] == "driver_lost", lost
        with pytest.raises(AirflowException) as failed:
            operator().execute_complete(context2, lost)
        assert not isinstance(failed.value, AirflowFailException)  # retried
        assert completed(metastore) == all_checkpoints(metastore) == 1  # the step before the gate

        # try 3: a new driver at parallelism 2 reuses the step, computes the rest
        gate.touch()
        context3, trigger3 = defer(operator(), 3)
        assert trigger3.attempt == third
        finished = asyncio.run(first_event(trigger3))
        assert finished["outcome"] == "finished", finished
        outcome = operator().execute_complete(context3, finished)
    finally:
        metastore.dispose()
    assert outcome["status"] == "FINISHED" and outcome["attempt"] == third, outcome
    assert outcome["parallelism"] == 2 and len(outcome["checkpoints"]) == 3, outcome
    log = (tmp_path / "ckpt" / "logs" / "drivers" / JOB / f"{third}.log").read_text()
    assert f"job {JOB}: step enriched unchanged: reusing its checkpoint" in log
    # the wide step the new driver computed: its directory holds exactly the files its subtasks
    # acknowledged (as many as adaptive execution left its last stage tasks) and nothing else
    shared = tmp_path / "checkpoints" / JOB / "shared"
    newest = max(shared.glob("chk-*/daily"), key=lambda p: int(p.parent.name[4:]))
    files = {p.name for p in newest.iterdir()}
    metastore = Metastore(airflow_in_process)
    try:
        assert files and files == acked_files(metastore, int(newest.parent.name[4:]), "daily")
    finally:
        metastore.dispose()

    got = published(out)
    want = expected(orders, customers)
    assert not got.duplicated(["day", "region"]).any() and len(got) == len(want)
    pd.testing.assert_frame_equal(
        got[list(want.columns)], want.astype(got[list(want.columns)].dtypes.to_dict())
    )


#: refused as it starts (before its first heartbeat): its checkpointed names another job
ANOTHER_JOB = """
from pyspark.sql import SparkSession
from checkpointing.spark.steps import checkpointed
spark = SparkSession.builder.getOrCreate()
with checkpointed(spark, job='another_job') as ck:
    ck.step('one', lambda: spark.range(3))
"""


@pytest.mark.parametrize("refused", ["as it starts", "at a step"])
def test_a_deferred_script_refused_for_its_configuration_fails_without_a_retry(
    airflow_in_process: str, tmp_path: Path, capfd: pytest.CaptureFixture[str], refused: str
) -> None:
    """As it starts, its ``checkpointed`` naming another job than the task's: the driver exits
    78 before its first heartbeat. At a step (a chained step that shuffles), after it beat: the
    trigger sees the job row FAILED with the refusal as its cause. Either way the try fails for
    good, the driver's error in the task log."""
    from airflow.sdk.exceptions import AirflowFailException, TaskDeferred

    from tests.test_step_chain import REFUSED_SCRIPT

    script = tmp_path / "refused.py"
    script.write_text(ANOTHER_JOB if refused == "as it starts" else REFUSED_SCRIPT.format(job=JOB))
    op = script_operator(tmp_path, script, [], retries=2)
    context = {"ti": TaskInstance(JOB, RUN, 1), "dag_run": None}
    with pytest.raises(AirflowFailException) as failed:
        try:
            op.execute(context)
        except TaskDeferred as deferred:
            assert refused == "at a step"
            event = asyncio.run(first_event(deferred.trigger))
            assert event["outcome"] == "failed", event
            script_operator(tmp_path, script, [], retries=2).execute_complete(context, event)
    line = str(failed.value)
    assert line.startswith(f"job {JOB}: try 1: the script was refused for its configuration")
    error = "'another_job'" if refused == "as it starts" else "needs a plan without a shuffle"
    assert error in "".join(capfd.readouterr())  # the driver's error, in the task log
    metastore = Metastore(airflow_in_process)
    try:
        assert completed(metastore) == 0
        driver = read_state(metastore, JOB).driver
        assert driver is not None and not _running(driver.pid)
    finally:
        metastore.dispose()


@pytest.mark.parametrize(("deferrable", "spec"), [(True, "periodic"), (False, "epochs")])
def test_a_script_task_is_refused_a_spec_pipelines_job_before_it_takes_it_over(
    airflow_in_process: str, tmp_path: Path, deferrable: bool, spec: str
) -> None:
    """The DAG ``daily_revenue`` runs a script while a spec pipeline already checkpoints the job
    ``daily_revenue``: the task fails for good, in one line, before it names its coordinator
    (which would fence the spec's running one) or launches anything."""
    from airflow.sdk.exceptions import AirflowFailException

    from checkpointing.clock import ManualClock
    from checkpointing.state.storage import FileSystemCheckpointStorage
    from tests.helpers import complete, new_coordinator

    metastore = Metastore(airflow_in_process)
    try:
        # the spec's own storage: elsewhere than the script task's (the check needs none)
        storage = FileSystemCheckpointStorage((tmp_path / "spec-storage").as_uri())
        config = {"interval": "10s"} if spec == "periodic" else {}
        coordinator = new_coordinator(metastore, storage, ManualClock(), job_id=JOB, **config)
        coordinator.activate()
        if spec == "epochs":  # checkpoints at epoch boundaries only: one completed
            complete(coordinator)
        before = read_state(metastore, JOB)
        script = tmp_path / "job.py"
        script.write_text("raise SystemExit('never run')\n")
        op = script_operator(tmp_path, script, [], retries=2)
        op.deferrable = deferrable
        context = {"ti": TaskInstance(JOB, RUN, 1), "dag_run": None}
        with pytest.raises(AirflowFailException) as refused:
            op.execute(context)
        line = str(refused.value)
        why = "it checkpoints periodically" if spec == "periodic" else "its checkpoints hold"
        assert f"job {JOB!r} is a pipeline spec's ({why}" in line, line
        assert read_state(metastore, JOB) == before  # still the spec's coordinator, no driver
        assert not (tmp_path / "ckpt" / "logs" / "drivers").exists()
    finally:
        metastore.dispose()


def test_a_deferred_script_in_cluster_mode_is_refused_before_it_takes_the_job_over(
    airflow_in_process: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deploy mode cluster: the detached driver could not be watched from the worker's host.
    One line, no retry, and nothing written: the job is neither registered nor taken over."""
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_DEFAULT",
        json.dumps(
            {"conn_type": "spark", "host": "spark://127.0.0.1", "port": 7077,
             "extra": {"deploy-mode": "cluster"}}
        ),
    )  # fmt: skip
    script = tmp_path / "job.py"
    script.write_text("raise SystemExit('never run')\n")
    op = script_operator(tmp_path, script, [], retries=2)
    with pytest.raises(
        AirflowFailException, match=r"deploy mode cluster .* use deploy mode client"
    ):
        op.execute({"ti": TaskInstance(JOB, RUN, 1), "dag_run": None})
    metastore = Metastore(airflow_in_process)
    try:
        assert read_state(metastore, JOB).status is None  # not registered, nobody fenced
    finally:
        metastore.dispose()
    assert not (tmp_path / "ckpt" / "logs" / "drivers").exists()


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
