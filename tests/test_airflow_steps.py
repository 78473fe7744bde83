"""Issue 39 under the real Airflow scheduler (LocalExecutor, real Spark via spark-submit): the
example DAG of ``examples/steps`` deploys the step-checkpointed script ``daily_revenue.py``
with ``CheckpointedSparkSubmitOperator(application=..., job=...)``. Its driver is SIGKILLed
once a seeded number of its steps have completed; Airflow retries the task, the retry runs at
another parallelism, reuses the steps completed before the kill (the metastore counts the
checkpoints: a reused step writes none) and publishes exactly DuckDB's answer, every row once.

The operator's refusals (a script with spec-only options, a job the script does not name) are
checked in this process first: they fail before anything is submitted.
"""

from __future__ import annotations

import base64
import json
import os
import random
import secrets
import shutil
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
import psutil
import pyarrow.dataset as ds
import pytest
from sqlalchemy import func, select

from checkpointing.errors import ConfigError
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint
from demo.local_airflow import LocalAirflow, local_airflow
from tests.airflow_harness import (
    DEADLINE_S,
    REPO,
    Api,
    assert_nothing_left,
    embedded_checkpointing,
    free_port,
    migrate_airflow_db,
    wait_for,
)
from tests.test_airflow_failover import StatsD
from tests.test_steps import acked_files, expected, write_inputs

if TYPE_CHECKING:
    from checkpointing_airflow.script_submit import ScriptJob, ScriptSubmit

EXAMPLE = REPO / "examples" / "steps"
DAG_ID = JOB = "daily_revenue"
TASK = "run"
#: the steps of daily_revenue.py, in order: one checkpoint each when computed
STEPS = ("enriched", "daily", "ranked", "output")
PARALLELISM, ON_RETRY = 1, 3


# ================================================================ no Spark, no Airflow run


def test_a_script_task_refuses_what_needs_a_spec_in_one_line(tmp_path: Path) -> None:
    """Parse time: no job, no application. Run time (rendered fields): spec-only
    options, a restore plan, an unknown script; each one line naming the field."""
    from airflow.sdk.exceptions import AirflowFailException

    from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator as Op
    from checkpointing_airflow.script_submit import script_job

    script = tmp_path / "job.py"
    script.write_text("print('hi')\n")
    with pytest.raises(ValueError, match=r"job= is required with application="):
        Op(task_id="a", application=str(script))
    assert Op(task_id="b", application=str(script), job="j", deferrable=True).deferrable
    ok = Op(task_id="c", application=str(script), job="j", application_args=["x", 1])
    job = script_job(ok)
    assert (job.job, job.script, job.args) == ("j", script.resolve(), ("x", "1"))
    for kwargs, field in (
        ({"full_refresh": True}, "full_refresh=True"),
        ({"interval_start": "2026-01-01"}, "interval_start='2026-01-01'"),
        ({"allow_changed_tables": "true"}, "allow_changed_tables='true'"),
        ({"restore": "7"}, "restore='7'"),
        ({"parallelism_on_retry": "zero"}, "parallelism_on_retry='zero'"),
        ({"application": str(tmp_path / "missing.py")}, "missing.py: no such file"),
    ):
        task = Op(task_id=f"t{len(field)}", **{"application": str(script), "job": "j", **kwargs})
        with pytest.raises(AirflowFailException) as refused:
            script_job(task)
        line = str(refused.value)
        assert field in line and "\n" not in line, line
    # a job id that is no id, or shaped like an interval's job instance: refused at parse
    for bad in ("../up", "daily.20261125T000000"):
        with pytest.raises(ValueError) as refused:
            Op(task_id="bad", application=str(script), job=bad)
        assert repr(bad) in str(refused.value) and "\n" not in str(refused.value)


def test_a_script_job_is_its_dags_id(tmp_path: Path) -> None:
    """The API authorises a job's savepoints and restores by the DAG whose id is the job's: a
    script's job defaults to its DAG's id, another is refused at parse (or, templated, before
    anything is submitted)."""
    from airflow.sdk import DAG
    from airflow.sdk.exceptions import AirflowFailException

    from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator as Op
    from checkpointing_airflow.script_submit import script_job

    script = tmp_path / "job.py"
    script.write_text("print('hi')\n")
    with DAG(JOB, schedule=None):
        op = Op(task_id="run", application=str(script))
        templated = Op(task_id="templated", application=str(script), job="{{ params.job }}")
    assert op.job == JOB and script_job(op).job == JOB
    with pytest.raises(ValueError) as refused, DAG("other_dag", schedule=None):
        Op(task_id="run", application=str(script), job=JOB)
    line = str(refused.value)
    assert f"job={JOB!r}" in line and "'other_dag'" in line and "\n" not in line, line
    templated.job = "someone_elses"  # as rendered
    with pytest.raises(AirflowFailException, match=r"job='someone_elses' is not its DAG's id"):
        script_job(templated)


def test_the_failure_callback_names_the_users_script_not_spark_submits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Airflow 3 hands the callbacks the operator that ran, whose ``application`` prepare()
    made spark-submit's; the driver's environment names the job and the try's coordinator."""
    import logging
    from types import SimpleNamespace

    from airflow.sdk import DAG

    from checkpointing.steps.script import ENV_COORDINATOR, ENV_JOB
    from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator as Op
    from checkpointing_airflow.script_submit import (
        ScriptSubmit,
        script_failed_callback,
        script_job,
    )

    url = f"sqlite:///{tmp_path / 'm.db'}"
    Metastore(url, check_schema=False).upgrade()
    monkeypatch.setenv("CKPT_METASTORE_URL", url)
    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[1]"})
    )
    script = tmp_path / "my_job.py"
    script.write_text("print('hi')\n")
    with DAG(JOB, schedule=None):
        op = Op(task_id="run", application=str(script))
    job = script_job(op)
    ScriptSubmit(op).prepare(job, "r-1234-t2", "latest", None, url, "file:///tmp/ck")
    assert op.application.endswith("spark_app.py")
    assert op.env_vars[ENV_JOB] == JOB and op.env_vars[ENV_COORDINATOR] == "r-1234-t2"
    assert script_job(op).script == job.script  # the kept script, not spark-submit's
    with caplog.at_level(logging.ERROR, logger="checkpointing_airflow.callbacks"):
        script_failed_callback({"ti": SimpleNamespace(try_number=3)}, op)
    [line] = [r.getMessage() for r in caplog.records if "failed after 3 tries" in r.getMessage()]
    assert f"ckpt run {job.script} --restore latest" in line and "spark_app" not in line, line


def test_a_script_refused_for_its_configuration_fails_its_try_without_a_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real spark-submit of a script whose step is refused (a chained step that shuffles):
    the driver exits 78 (EX_CONFIG), spark-submit passes it on, and the try fails for good
    (``AirflowFailException``) instead of being retried into the same refusal."""
    from types import SimpleNamespace

    from airflow.sdk import DAG
    from airflow.sdk.exceptions import AirflowFailException

    from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator as Op
    from checkpointing_airflow.script_submit import ScriptSubmit, script_job
    from checkpointing_airflow.spark_submit_internals import submit_returncode
    from tests.test_step_chain import REFUSED_SCRIPT

    url = f"sqlite:///{tmp_path / 'm.db'}"
    Metastore(url, check_schema=False).upgrade()
    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_DEFAULT", json.dumps({"conn_type": "spark", "host": "local[1]"})
    )
    script = tmp_path / "daily.py"
    script.write_text(REFUSED_SCRIPT.format(job=JOB))
    with DAG(JOB, schedule=None):
        op = Op(task_id="run", application=str(script))
    job = script_job(op)
    submit = ScriptSubmit(op)
    metastore = Metastore(url)
    try:
        submit.prepare(job, "r-1234-t1", "latest", None, url, (tmp_path / "ck").as_uri())
        with pytest.raises(AirflowFailException) as refused:
            submit.submit({"ti": SimpleNamespace(try_number=1)}, job, metastore, None)
    finally:
        metastore.dispose()
    assert submit_returncode(op._hook) == 78
    line = str(refused.value)
    assert line.startswith(f"job {JOB}: try 1: the script was refused for its configuration")
    assert "not retried" in line


def test_the_driver_refuses_a_job_the_task_does_not_declare(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from checkpointing.steps.script import ENV_JOB, check_job, expected_job

    monkeypatch.delenv(ENV_JOB, raising=False)
    assert expected_job() is None
    check_job("anything")  # a script run on its own: any job
    monkeypatch.setenv(ENV_JOB, "daily_revenue")
    check_job("daily_revenue")
    with pytest.raises(ConfigError) as refused:
        check_job("daily_rev")
    line = str(refused.value)
    assert "'daily_rev'" in line and "'daily_revenue'" in line and "\n" not in line


def test_a_script_that_ran_no_checkpointed_job_fails_its_try(tmp_path: Path) -> None:
    """Until the driver checks the job itself, the task does after the fact: a script that
    ended without running the declared job (none, or another) fails for good, in one line."""
    from airflow.sdk.exceptions import AirflowFailException

    from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator as Op
    from checkpointing_airflow.script_submit import ScriptSubmit, script_job

    script = tmp_path / "job.py"
    script.write_text("print('no checkpointed here')\n")
    op = Op(task_id="t", application=str(script), job="declared")
    metastore = Metastore(f"sqlite:///{tmp_path / 'm.db'}", check_schema=False)
    metastore.upgrade()
    try:
        with pytest.raises(AirflowFailException) as refused:
            ScriptSubmit(op).outcome(script_job(op), metastore, "r-1234-t1", None)
    finally:
        metastore.dispose()
    line = str(refused.value)
    assert "job declared:" in line and "checkpointed(spark, job='declared')" in line, line


# ================================================================ the script path, real Spark


def _snapshot(metastore: Metastore) -> tuple[object, ...]:
    """The job row and its checkpoints, as plain values: what a fenced driver must not change
    (its ``updated_at`` too: a refused start is refused before it registers anything)."""
    from checkpointing.metastore.models import Job

    def values(row: object) -> dict[str, object]:
        columns = row.__table__.columns  # type: ignore[attr-defined]
        return {c.key: getattr(row, c.key) for c in columns}

    with metastore.reading() as s:
        job = s.get(Job, JOB)
        checkpoints = s.scalars(select(Checkpoint).where(Checkpoint.job_id == JOB)).all()
        return (values(job), [values(c) for c in checkpoints])


@pytest.fixture
def script_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[ScriptSubmit, ScriptJob]:
    """A script task of the DAG ``daily_revenue`` and its script path, the driver's environment
    naming the task's job (what prepare() gives the driver)."""
    from airflow.sdk import DAG

    from checkpointing.steps.script import ENV_JOB
    from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator as Op
    from checkpointing_airflow.script_submit import ScriptSubmit, script_job

    script = tmp_path / "job.py"
    script.write_text("print('the driver runs in this test')\n")
    with DAG(JOB, schedule=None):
        op = Op(task_id=TASK, application=str(script))
    monkeypatch.setenv(ENV_JOB, JOB)
    return ScriptSubmit(op), script_job(op)


def test_a_retry_fences_the_earlier_tries_driver_which_changes_nothing(
    spark, sqlite_metastore: Metastore, storage, script_task, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Try 1's driver outlives its task; try 2 names its coordinator before its own driver
    starts: try 1's next step, or a new start of it, is refused and changes neither the job row
    nor a checkpoint; try 2's driver then reuses the step try 1 completed."""
    from checkpointing.coordination.failure import CoordinatorSuperseded
    from checkpointing.spark.step_salvage import SALVAGE_DIR
    from checkpointing.spark.steps import checkpointed
    from checkpointing.steps.script import ENV_COORDINATOR
    from checkpointing_airflow.attempts import attempt_id

    submit, job = script_task
    first, retry = (attempt_id(JOB, "manual__r", n) for n in (1, 2))
    base = spark.range(0, 40, 1, 2)
    monkeypatch.setenv(ENV_COORDINATOR, first)
    with (
        pytest.raises(CoordinatorSuperseded),
        checkpointed(spark, JOB, metastore=sqlite_metastore, storage=storage) as ck,
    ):
        ck.step("first", lambda: base)
        submit.name_try(sqlite_metastore, job, retry, storage.base_url)  # the retry's task
        named = _snapshot(sqlite_metastore)
        assert named[0]["coordinator_id"] == retry  # type: ignore[index]
        # what the retry's driver salvaged meanwhile: try 1's end must leave it alone
        kept = storage.path_of(f"{storage.job_url(JOB)}/{SALVAGE_DIR}/second/0.parquet")
        kept.parent.mkdir(parents=True)
        kept.write_bytes(b"PAR1")
        ck.step("second", lambda: base.withColumn("twice", base.id * 2))
    assert _snapshot(sqlite_metastore) == named
    assert kept.read_bytes() == b"PAR1"
    with (
        pytest.raises(CoordinatorSuperseded),
        checkpointed(spark, JOB, metastore=sqlite_metastore, storage=storage),
    ):
        pass
    assert _snapshot(sqlite_metastore) == named

    monkeypatch.setenv(ENV_COORDINATOR, retry)
    with checkpointed(spark, JOB, metastore=sqlite_metastore, storage=storage) as ck:
        ck.step("first", lambda: base)
        ck.step("second", lambda: base.withColumn("twice", base.id * 2))
    assert (ck.stats.reused, ck.stats.computed) == (["first"], ["second"])
    outcome = submit.outcome(job, sqlite_metastore, retry, 2)
    assert outcome["status"] == "FINISHED" and outcome["savepoint_path"] is None
    assert len(outcome["checkpoints"]) == 1  # the retry's own: "second"


def test_a_driver_superseded_as_it_publishes_swaps_nothing(
    spark,  # type: ignore[no-untyped-def]
    sqlite_metastore: Metastore,
    storage,  # type: ignore[no-untyped-def]
    script_task,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """``ck.write`` swaps ``final`` under the job row's lock, with the fencing check made in
    that transaction: a driver a later try superseded after its check before the publish (the
    guard is called here as the publish calls it) leaves no ``final`` and no table behind."""
    from checkpointing.coordination.failure import CoordinatorSuperseded
    from checkpointing.spark.parquet_sink import TwoPhaseCommitSink
    from checkpointing.spark.steps import checkpointed
    from checkpointing.steps.script import ENV_COORDINATOR
    from checkpointing_airflow.attempts import attempt_id

    submit, job = script_task
    first, retry = (attempt_id(JOB, "manual__p", n) for n in (1, 2))
    out = tmp_path / "out"
    monkeypatch.setenv(ENV_COORDINATOR, first)
    with checkpointed(spark, JOB, metastore=sqlite_metastore, storage=storage) as ck:
        ids = ck.step("ids", lambda: spark.range(0, 40, 1, 2))
        files = [Path(storage.path_of(u)) for u in ck._done["ids"].urls]
        submit.name_try(sqlite_metastore, job, retry, storage.base_url)  # the retry's task
        sink = TwoPhaseCommitSink(str(out), job=JOB)
        with pytest.raises(CoordinatorSuperseded):
            sink.publish_final(ids, "a" * 32, files, guard=ck._leading)
        named = _snapshot(sqlite_metastore)
    assert not [p.name for p in out.iterdir() if "final" in p.name]
    assert _snapshot(sqlite_metastore) == named


def test_a_retry_of_a_job_its_first_try_never_registered_fences_that_tries_driver(
    spark, sqlite_metastore: Metastore, storage, script_task, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """Try 1's task died while its driver was still starting (queued on a cluster): the job has
    no row yet. Try 2 registers it as it names its coordinator, so try 1's driver, starting
    late, is refused and writes nothing."""
    from checkpointing.coordination.failure import CoordinatorSuperseded
    from checkpointing.spark.steps import checkpointed
    from checkpointing.steps.script import ENV_COORDINATOR
    from checkpointing_airflow.attempts import attempt_id

    submit, job = script_task
    first, retry = (attempt_id(JOB, "manual__n", n) for n in (1, 2))
    assert rows_of_job(sqlite_metastore) is None
    submit.name_try(sqlite_metastore, job, retry, storage.base_url)
    named = _snapshot(sqlite_metastore)
    assert named[0]["coordinator_id"] == retry and named[0]["storage_url"] == storage.base_url  # type: ignore[index]
    monkeypatch.setenv(ENV_COORDINATOR, first)
    with (
        pytest.raises(CoordinatorSuperseded),
        checkpointed(spark, JOB, metastore=sqlite_metastore, storage=storage),
    ):
        pass
    assert _snapshot(sqlite_metastore) == named
    assert not (Path(storage.path_of(storage.job_url(JOB))) / "shared").exists()


def rows_of_job(metastore: Metastore) -> object:
    from checkpointing.metastore.models import Job

    with metastore.reading() as s:
        return s.get(Job, JOB)


def test_a_try_fails_with_its_job_and_succeeds_on_a_stop_with_savepoint(
    spark, sqlite_metastore: Metastore, storage, script_task, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """The try's outcome is the job row its driver wrote: a job the script ended FAILED (its
    exception caught, the script exiting 0) fails the try, to be retried; a stop-with-savepoint
    succeeds with the savepoint's path and no final path."""
    from airflow.sdk.exceptions import AirflowException, AirflowFailException

    from checkpointing.coordination import savepoints
    from checkpointing.spark.steps import checkpointed
    from checkpointing.steps.script import ENV_COORDINATOR
    from checkpointing_airflow.attempts import attempt_id

    submit, job = script_task
    failing, stopping = (attempt_id(JOB, "manual__o", n) for n in (1, 2))
    base = spark.range(0, 40, 1, 2)
    monkeypatch.setenv(ENV_COORDINATOR, failing)
    try:
        with checkpointed(spark, JOB, metastore=sqlite_metastore, storage=storage) as ck:
            ck.step("first", lambda: base)
            raise RuntimeError("the script's own bug")
    except RuntimeError:
        pass  # the script's catch-all: its driver exits 0
    with pytest.raises(AirflowException) as failed:
        submit.outcome(job, sqlite_metastore, failing, None)
    assert not isinstance(failed.value, AirflowFailException)  # retried
    assert f"job {JOB}: the script's driver exited with the job FAILED" in str(failed.value)

    submit.name_try(sqlite_metastore, job, stopping, storage.base_url)
    monkeypatch.setenv(ENV_COORDINATOR, stopping)
    with checkpointed(spark, JOB, metastore=sqlite_metastore, storage=storage) as ck:
        savepoints.request_savepoint(sqlite_metastore, JOB, stop=True, requested_by="test")
        ck.step("first", lambda: base)
        ck.step("second", lambda: base.withColumn("twice", base.id * 2))
    assert ck.stopped_with_savepoint is not None and ck.stats.computed == []
    outcome = submit.outcome(job, sqlite_metastore, stopping, None)
    assert outcome["status"] == "FINISHED" and outcome["final_path"] is None
    assert outcome["savepoint_path"] == ck.stopped_with_savepoint


# ================================================================ the running Airflow


@pytest.fixture
def statsd() -> Iterator[StatsD]:
    server = StatsD()
    yield server
    server.close()


@pytest.fixture
def airflow(tmp_path: Path, statsd: StatsD) -> Iterator[LocalAirflow]:
    """api-server, scheduler and dag-processor on SQLite and the LocalExecutor, serving a copy
    of ``examples/steps``, metrics to ``statsd``, lineage to ``lineage.jsonl``; no process may
    be left afterwards."""
    settings = embedded_checkpointing(tmp_path)
    dags = tmp_path / "dags"
    shutil.copytree(EXAMPLE, dags, ignore=shutil.ignore_patterns("__pycache__"))
    local = local_airflow(
        settings,
        port=free_port(),
        home=tmp_path / "airflow",
        dags=dags,
        extra_env={
            "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            # the copied database comes without the airflow.cfg a migration writes: the
            # components, started at once, would each generate their own secrets
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(16),
            "AIRFLOW__API__SECRET_KEY": secrets.token_urlsafe(16),
            "AIRFLOW__CORE__FERNET_KEY": base64.urlsafe_b64encode(os.urandom(32)).decode(),
            "AIRFLOW__METRICS__STATSD_ON": "True",
            "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
            "AIRFLOW__METRICS__STATSD_PORT": str(statsd.port),
            # the script's Spark application names the try's run as its lineage parent
            "AIRFLOW__OPENLINEAGE__SPARK_INJECT_PARENT_JOB_INFO": "True",
            "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(
                {"type": "file", "log_file_path": str(tmp_path / "lineage.jsonl"), "append": True}
            ),
        },
        migrate_db=migrate_airflow_db,
    )
    local.start(components=("api-server", "scheduler", "dag-processor"))
    try:
        yield local
    finally:
        local.stop()
    assert_nothing_left(tmp_path)


def _completed(metastore: Metastore) -> int:
    with metastore.reading() as s:
        return int(
            s.scalar(
                select(func.count())
                .select_from(Checkpoint)
                .where(Checkpoint.job_id == JOB, Checkpoint.completed_at.is_not(None))
            )
            or 0
        )


def _driver(root: Path) -> psutil.Process | None:
    """The script's Python driver (spark-submit's child running ``ckpt run daily_revenue.py``)."""
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "spark_app.py" in cmdline and str(root / "dags" / "daily_revenue.py") in cmdline:
            return proc
    return None


def _task_log(airflow: LocalAirflow, run_id: str, attempt: int) -> str:
    logs = airflow.home / "logs" / f"dag_id={DAG_ID}" / f"run_id={run_id}" / f"task_id={TASK}"
    return "\n".join(p.read_text() for p in sorted(logs.glob(f"attempt={attempt}*.log")))


@pytest.mark.timeout(900)
def test_a_script_task_killed_mid_run_is_retried_at_another_parallelism_exactly(
    airflow: LocalAirflow, tmp_path: Path, statsd: StatsD
) -> None:
    seed = int(os.environ.get("CKPT_CHAOS_SEED", random.randrange(1 << 30)))
    print(f"CKPT_CHAOS_SEED={seed}")
    kill_after_steps = random.Random(seed).randint(1, 2)  # of the 4: the kill is mid-run
    orders, customers = write_inputs(tmp_path / "in")
    out = tmp_path / "out"

    assert airflow.wait_until_serving(DEADLINE_S)
    api = Api(airflow.url, airflow.user, airflow.password)
    wait_for(f"the DAG {DAG_ID}", lambda: api.get(f"/api/v2/dags/{DAG_ID}"))
    assert api.call("/api/v2/importErrors")["total_entries"] == 0
    conf = {
        "orders": str(orders),
        "customers": str(customers),
        "out": str(out),
        "parallelism": PARALLELISM,
        "parallelism_on_retry": ON_RETRY,
    }
    run = api.call(f"/api/v2/dags/{DAG_ID}/dagRuns", {"logical_date": None, "conf": conf})
    run_id = run["dag_run_id"]
    run_path = f"/api/v2/dags/{DAG_ID}/dagRuns/{urllib.parse.quote(run_id, safe='')}"

    # the first try's driver, SIGKILLed once the seeded number of steps have completed
    metastore = Metastore(airflow.env["CKPT_METASTORE_URL"])
    try:
        driver = wait_for("the script's driver", lambda: _driver(tmp_path), every=0.1)
        wait_for(
            f"{kill_after_steps} completed steps",
            lambda: _completed(metastore) >= kill_after_steps or not driver.is_running(),
            every=0.02,
        )
        assert driver.is_running(), "the first try ended before the kill"
        driver.kill()
        driver.wait(30)
        reused = _completed(metastore)  # what the kill left completed: the retry reuses it
        print(f"killed after {reused} completed steps")
        assert kill_after_steps <= reused < len(STEPS)

        def ended() -> str | None:
            state = api.call(run_path)["state"]
            return state if state in ("success", "failed") else None

        assert wait_for("the run to end", ended, every=1) == "success", _task_log(
            airflow, run_id, 2
        )[-4000:]
        ti = api.call(f"{run_path}/taskInstances/{TASK}")
        assert ti["try_number"] == 2  # the killed try, then the retry

        # the retry computed only the steps not completed before the kill: one checkpoint each
        assert _completed(metastore) == len(STEPS)
    finally:
        metastore.dispose()

    # the retry named its coordinator before its driver started (the killed try's is fenced),
    # and its XCom is the job row its driver wrote: its own checkpoints, the computed steps
    from checkpointing_airflow.attempts import attempt_id

    retry = attempt_id(DAG_ID, run_id, 2)
    xcom = api.call(f"{run_path}/taskInstances/{TASK}/xcomEntries/return_value?deserialize=true")
    outcome = xcom["value"] if isinstance(xcom["value"], dict) else json.loads(xcom["value"])
    assert outcome["status"] == "FINISHED" and outcome["attempt"] == retry, outcome
    assert len(outcome["checkpoints"]) == len(STEPS) - reused and not outcome["savepoint_path"]

    first, second = _task_log(airflow, run_id, 1), _task_log(airflow, run_id, 2)
    assert f"job {JOB}: coordinator {retry} named; earlier tries fenced" in second
    assert f"job {JOB}: try 1: the Spark driver" in first, first[-3000:]
    assert f"parallelism {PARALLELISM}" in first
    assert f"job {JOB}: try 2 runs script" in second and f"parallelism {ON_RETRY}" in second
    assert f"spark.default.parallelism={ON_RETRY}" in second
    # the driver's own lines: the steps completed before the kill were read back, the rest run
    for step in STEPS[:reused]:  # the join's step is chained: recomputed by daily, not read
        kept = "chained into its readers" if step == "enriched" else "reusing its checkpoint"
        assert f"job {JOB}: step {step} unchanged: {kept}" in second, step
    for step in STEPS[reused:]:
        assert f"job {JOB}: step {step}: computing it" in second, step
    # the steps the retry computed: their directories hold exactly the files their subtasks
    # acknowledged (their task count is adaptive execution's, coalesced as the job without
    # checkpoints would be) and nothing of Hadoop's beside them
    shared = Path(airflow.env["CKPT_STORAGE_URL"].removeprefix("file://")) / JOB / "shared"
    retried = [s for s in ("daily", "ranked") if STEPS.index(s) >= reused]
    metastore = Metastore(airflow.env["CKPT_METASTORE_URL"])
    try:
        for step in retried:
            newest = max(shared.glob(f"chk-*/{step}"), key=lambda p: int(p.parent.name[4:]))
            files = {p.name for p in newest.iterdir()}
            assert files, step
            assert files == acked_files(metastore, int(newest.parent.name[4:]), step), step
    finally:
        metastore.dispose()

    # the job's checkpoints reached the metrics by its id, and the retry's lineage facet
    assert f"airflow.ckpt.checkpoints.completed.{JOB}:1|c" in statsd.lines(), sorted(
        x for x in statsd.lines() if ".ckpt." in x
    )
    events = [json.loads(x) for x in (tmp_path / "lineage.jsonl").read_text().split("\n") if x]
    runs = [e for e in events if e["job"]["name"] == f"{DAG_ID}.{TASK}"]
    assert [e["eventType"] for e in runs] == ["START", "FAIL", "START", "COMPLETE"], runs
    facet = runs[-1]["run"]["facets"]["checkpointing"]
    assert len(facet["checkpoints"]) == len(STEPS) - reused, facet
    # the script's own lineage (OpenLineage's Spark listener on a cluster: its inputs and
    # output) is the child of each try's run: spark-submit was given that run as its parent
    for log, start in ((first, runs[0]), (second, runs[2])):
        assert f"spark.openlineage.parentRunId={start['run']['runId']}" in log
        assert f"spark.openlineage.parentJobName={DAG_ID}.{TASK}" in log

    got = ds.dataset(out / "final", format="parquet").to_table().to_pandas()
    got = got.sort_values(["day", "region"]).reset_index(drop=True)
    want = expected(orders, customers)
    assert not got.duplicated(["day", "region"]).any() and len(got) == len(want)
    pd.testing.assert_frame_equal(
        got[list(want.columns)], want.astype(got[list(want.columns)].dtypes.to_dict())
    )
