"""Automatic failover reruns under a real Airflow (``airflow dags test``, real Spark via
spark-submit): a try that crashes after k epochs is retried, and the retry resumes from the latest
checkpoint at another parallelism (``parallelism_on_retry``), on Airflow's PostgreSQL metadata
database, and the output is exactly-once.

The same failover with the same parallelism on Airflow's SQLite database is ``make demo``'s
(``test_demo.test_demo_runs_the_pipeline_as_an_airflow_dag_crashes_resumes_and_verifies``, which
asserts all that this test asserts, on the example pipeline). One scenario covers both the other
parallelism and the other database: what the retry restores does not depend on Airflow's
database, and each further scenario would pay a whole ``airflow dags test`` of two Spark
tries."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from checkpointing.metastore import views
from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline import datasets
from tests.airflow_harness import (
    AGGS,
    AirflowHome,
    assert_exactly_once,
    make_airflow_home,
    write_events_spec,
)

FILES = 4

DAG = """
from datetime import timedelta

import pendulum
from airflow.sdk import DAG

from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator

with DAG({dag_id!r}, schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False):
    CheckpointedSparkSubmitOperator(
        task_id="run",
        pipeline={spec!r},
        retries={retries},
        retry_delay=timedelta(seconds=1),
        {extra}
    )
"""


@pytest.fixture(scope="module")
def events(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("events")
    datasets.generate_events(path, events=4_000, keys=150, files=FILES, seed=11)
    return path


@pytest.fixture(scope="module")
def airflow(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AirflowHome]:
    """Airflow with its metadata database on PostgreSQL (a fresh database)."""
    root = tmp_path_factory.mktemp("airflow-postgresql")
    pg_url = request.getfixturevalue("pg_url")  # the session's checkpoint test database
    name = f"airflow_{os.getpid()}"
    admin = create_engine(pg_url.rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = pg_url.rsplit("/", 1)[0] + f"/{name}"
    try:
        yield make_airflow_home(root, url, root / "ckpt")
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def write_pipeline(
    airflow: AirflowHome, tmp_path: Path, events: Path, job: str, **fields: object
) -> Path:
    return write_events_spec(
        tmp_path / f"{job}.yaml",
        job,
        events,
        tmp_path / "out",
        checkpoint="{every_epochs: 1, retained: 2}",
        **fields,
    )


def metastore_of(airflow: AirflowHome) -> Metastore:
    return Metastore(f"sqlite:///{Path(airflow.env['CKPT_HOME']) / 'metastore.db'}")


def run_lines(result: subprocess.CompletedProcess) -> list[str]:
    return re.findall(r"job \S+ finished: .*", result.stdout + result.stderr)


def test_a_crashed_try_is_retried_from_the_latest_checkpoint_at_another_parallelism(
    airflow: AirflowHome, events: Path, tmp_path: Path
) -> None:
    parallelism_on_retry = 3  # the spec's parallelism is 2
    job = "crash_rescaled_postgresql"
    spec = write_pipeline(airflow, tmp_path, events, job, parallelism_on_retry=parallelism_on_retry)
    airflow.write_dag(
        job,
        DAG.format(dag_id=job, spec=str(spec), retries=2, extra="fail_first_try_after_epochs=2,"),
    )
    result = airflow.dags_test(job)
    logs = result.stdout + result.stderr
    assert result.returncode == 0, logs[-4000:]
    assert "crash injected after epoch 1" in logs  # try 1 really failed after 2 epochs
    # the callback planned the retry's restore, and the retry used that plan
    assert re.search(rf"failover: job {job}: attempt \S+-t2 restores checkpoint 2", logs), logs
    assert "restore plan recorded by the failure callback" in logs
    # try 1 said in one line how its driver ended and what the retry restores, epochs counted
    # as in the XCom; no Alembic lines in the task log
    assert re.search(
        rf"job {job}: try 1: the Spark driver failed \(exit code \d+\); last completed "
        rf"checkpoint 2 \(\S+, 2 epochs done\); the retry \(try 2\) restores checkpoint 2",
        logs,
    ), logs[-4000:]
    assert "try ran 2 epochs, 4 epochs done" in logs
    assert "alembic" not in logs.lower()
    # the retry redid only the epochs after checkpoint 2
    assert any(
        "2 of 4 epochs run (restored from checkpoint 2)" in line for line in run_lines(result)
    )

    metastore = metastore_of(airflow)
    restores = views.list_restores(metastore, job)
    by_status = {r["status"]: r for r in restores}
    assert by_status["PLANNED"]["checkpoint_id"] == by_status["RESTORED"]["checkpoint_id"] == 2
    assert by_status["RESTORED"]["parallelism"] == parallelism_on_retry
    assignment = by_status["PLANNED"]["assignment"]
    (aggregate,) = [op for op in assignment["operators"] if op["operator_id"] == "aggregate"]
    assert aggregate["parallelism"] == parallelism_on_retry
    groups = sorted(
        g
        for subtask in aggregate["subtasks"]
        for g in range(subtask["key_groups"]["start"], subtask["key_groups"]["end"] + 1)
    )
    assert groups == list(range(16))  # every key group assigned exactly once
    aborted = views.list_checkpoints(metastore, job, status="ABORTED")
    assert all(c["failure_reason"] != "CHECKPOINT_EXPIRED" for c in aborted)
    assert_exactly_once(tmp_path / "out", events, AGGS)
