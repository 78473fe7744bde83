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
from tests.test_steps import expected, write_inputs

EXAMPLE = REPO / "examples" / "steps"
DAG_ID = JOB = "daily_revenue"
TASK = "run"
#: the steps of daily_revenue.py, in order: one checkpoint each when computed
STEPS = ("enriched", "daily", "ranked", "output")
PARALLELISM, ON_RETRY = 1, 3


# ================================================================ no Spark, no Airflow run


def test_a_script_task_refuses_what_needs_a_spec_in_one_line(tmp_path: Path) -> None:
    """Parse time: no job, no application, deferrable. Run time (rendered fields): spec-only
    options, a restore plan, an unknown script; each one line naming the field."""
    from airflow.sdk.exceptions import AirflowFailException

    from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator as Op
    from checkpointing_airflow.script_submit import script_job

    script = tmp_path / "job.py"
    script.write_text("print('hi')\n")
    with pytest.raises(ValueError, match=r"job= is required with application="):
        Op(task_id="a", application=str(script))
    with pytest.raises(ValueError, match=r"deferrable=True runs specs only"):
        Op(task_id="b", application=str(script), job="j", deferrable=True)
    ok = Op(task_id="c", application=str(script), job="j", application_args=["x", 1])
    job = script_job(ok)
    assert (job.job, job.script, job.args) == ("j", script.resolve(), ("x", "1"))
    for kwargs, field in (
        ({"full_refresh": True}, "full_refresh=True"),
        ({"interval_start": "2026-01-01"}, "interval_start='2026-01-01'"),
        ({"allow_changed_tables": "true"}, "allow_changed_tables='true'"),
        ({"restore": "7"}, "restore='7'"),
        ({"parallelism_on_retry": "zero"}, "parallelism_on_retry='zero'"),
        ({"job": "../up"}, "'../up'"),
        ({"application": str(tmp_path / "missing.py")}, "missing.py: no such file"),
    ):
        task = Op(task_id=f"t{len(field)}", **{"application": str(script), "job": "j", **kwargs})
        with pytest.raises(AirflowFailException) as refused:
            script_job(task)
        line = str(refused.value)
        assert field in line and "\n" not in line, line


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
            ScriptSubmit(op).outcome(script_job(op), metastore, None, None)
    finally:
        metastore.dispose()
    line = str(refused.value)
    assert "job declared:" in line and "checkpointed(spark, job='declared')" in line, line


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

    first, second = _task_log(airflow, run_id, 1), _task_log(airflow, run_id, 2)
    assert f"job {JOB}: try 1: the Spark driver" in first, first[-3000:]
    assert f"parallelism {PARALLELISM}" in first
    assert f"job {JOB}: try 2 runs script" in second and f"parallelism {ON_RETRY}" in second
    assert f"spark.default.parallelism={ON_RETRY}" in second
    # the driver's own lines: the steps completed before the kill were read back, the rest run
    for step in STEPS[:reused]:
        assert f"job {JOB}: step {step} unchanged: reusing its checkpoint" in second, step
    for step in STEPS[reused:]:
        assert f"job {JOB}: step {step}: computing it" in second, step
    # the steps computed by the retry ran at its parallelism: the wide ones wrote that many files
    shared = Path(airflow.env["CKPT_STORAGE_URL"].removeprefix("file://")) / JOB / "shared"
    retried = [s for s in ("daily", "ranked") if STEPS.index(s) >= reused]
    for step in retried:
        newest = max(shared.glob(f"chk-*/{step}"), key=lambda p: int(p.parent.name[4:]))
        assert len(list(newest.glob("part-*.parquet"))) == ON_RETRY, step

    # the job's checkpoints reached the metrics by its id, and the retry's lineage facet
    assert f"airflow.ckpt.checkpoints.completed.{JOB}:1|c" in statsd.lines(), sorted(
        x for x in statsd.lines() if ".ckpt." in x
    )
    events = [json.loads(x) for x in (tmp_path / "lineage.jsonl").read_text().split("\n") if x]
    runs = [e for e in events if e["job"]["name"] == f"{DAG_ID}.{TASK}"]
    assert [e["eventType"] for e in runs] == ["START", "FAIL", "START", "COMPLETE"], runs
    facet = runs[-1]["run"]["facets"]["checkpointing"]
    assert len(facet["checkpoints"]) == len(STEPS) - reused, facet

    got = ds.dataset(out / "final", format="parquet").to_table().to_pandas()
    got = got.sort_values(["day", "region"]).reset_index(drop=True)
    want = expected(orders, customers)
    assert not got.duplicated(["day", "region"]).any() and len(got) == len(want)
    pd.testing.assert_frame_equal(
        got[list(want.columns)], want.astype(got[list(want.columns)].dtypes.to_dict())
    )
