"""Automatic failover reruns under a real Airflow (``airflow dags test``, real Spark via
spark-submit): a try that crashes after k epochs is retried, and the retry resumes from the latest
checkpoint at another parallelism (``parallelism_on_retry``), on Airflow's PostgreSQL metadata
database, and the output is exactly-once.

The pipeline is a Python one (issue 24): its spec names ``pipeline: ckpt_example.jobs:build``
(``tests/entry_points``), shipped as a zip in ``py_files``; the DAG is the DAG factory's, the
operator imports the code to plan the try and passes the zip to spark-submit as ``--py-files``,
and the driver builds the same Pipeline from it. A YAML spec's DAG runs the same operator and
driver: only the import of the code differs, and ``make demo`` and the DAG factory tests run
those.

The same failover with the same parallelism on Airflow's SQLite database is ``make demo``'s
(``test_demo.test_demo_runs_the_pipeline_as_an_airflow_dag_crashes_resumes_and_verifies``, which
asserts all that this test asserts, on the example pipeline). One scenario covers both the other
parallelism and the other database: what the retry restores does not depend on Airflow's
database, and each further scenario would pay a whole ``airflow dags test`` of two Spark
tries."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
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
)
from tests.entry_points import package_zip
from tests.spark_cluster import RecordingMotoServer

FILES = 4

#: the pipelines DAG of one spec, as the DAG factory builds it; the first try crashes. Every
#: checkpoint alert goes to a notifier that raises and to one that writes it to a file (issue 26)
DAG = """
from airflow.sdk import BaseNotifier

from checkpointing.pipeline.spec import load_spec
from checkpointing_airflow.dag_factory import build_pipeline_dag


class FileNotifier(BaseNotifier):
    template_fields = ("text",)

    def __init__(self, path, text):
        super().__init__()
        self.path, self.text = path, text

    def notify(self, context):
        with open(self.path, "a") as out:
            out.write(self.text + "\\n")


class BrokenNotifier(BaseNotifier):
    def notify(self, context):
        raise ConnectionError("the chat service is down")


dag = build_pipeline_dag(
    load_spec({spec!r}),
    operator_args={{
        "fail_first_try_after_epochs": 2,
        "alerts": [
            BrokenNotifier(),
            FileNotifier({alerts!r}, "{{{{ checkpoint_alert.kind }}}}|{{{{ checkpoint_alert }}}}"),
        ],
    }},
)
"""
#: a DAG scheduled on the pipeline's sink (its task's Asset outlet)
DOWNSTREAM = """
from datetime import datetime

from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, Asset

with DAG("after_py_events", schedule=[Asset({uri!r})], start_date=datetime(2026, 1, 1)):
    EmptyOperator(task_id="read")
"""
#: the job ``ckpt_example.jobs:build`` returns: events/*.parquet → per-user AGGS → out
JOB = "py_events"


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


def write_python_pipeline(
    directory: Path, events: Path, *, entry: str = "build", **fields: object
) -> Path:
    """A spec naming the Python pipeline ``ckpt_example.jobs:<entry>``, with ``fields``
    (deployment fields) on top, in a folder with the events (``events/``) and the package's zip
    beside it."""
    (directory / "events").symlink_to(events)
    package_zip(directory)
    extra = "".join(f"{k}: {v}\n" for k, v in fields.items())
    path = directory / f"{JOB}.yaml"
    path.write_text(
        f"job: {JOB}\npipeline: ckpt_example.jobs:{entry}\npy_files: [ckpt_example.zip]\n{extra}"
    )
    return path


def metastore_of(airflow: AirflowHome) -> Metastore:
    return Metastore(f"sqlite:///{Path(airflow.env['CKPT_HOME']) / 'metastore.db'}")


def run_lines(result: subprocess.CompletedProcess) -> list[str]:
    return re.findall(r"job \S+ finished: .*", result.stdout + result.stderr)


class StatsD:
    """A StatsD server on loopback: a thread keeps every line received."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.received: list[str] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        while not self.stopped.is_set():
            try:
                data, _ = self.sock.recvfrom(65536)
            except TimeoutError:
                continue
            self.received += data.decode(errors="replace").splitlines()

    def lines(self) -> list[str]:
        return list(self.received)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.sock.close()


@pytest.fixture
def statsd() -> Iterator[StatsD]:
    server = StatsD()
    yield server
    server.close()


#: temporary credentials of the ``aws_default`` connection (an assumed role's, say)
KEY_ID, SECRET, TOKEN = "ASIAFAILOVER0EXAMPLE", "tmp-secret-failover-7c1d", "IQoJTokenFailover-9a2"


@pytest.fixture
def s3_connection(airflow: AirflowHome, tmp_path: Path) -> Iterator[RecordingMotoServer]:
    """Checkpoint storage on a recording S3 server, reached only through a session-token
    ``aws_default`` connection: no AWS_* variable in Airflow's environment (restored after)."""
    import boto3

    moto = RecordingMotoServer(tmp_path)
    moto.start()
    saved = dict(airflow.env)
    try:
        boto3.client(
            "s3",
            endpoint_url=moto.url,
            aws_access_key_id=KEY_ID,
            aws_secret_access_key=SECRET,
            aws_session_token=TOKEN,
            region_name="us-east-1",
        ).create_bucket(Bucket="ckpt")
        airflow.env = {k: v for k, v in airflow.env.items() if not k.startswith("AWS_")}
        extra = {"aws_session_token": TOKEN, "endpoint_url": moto.url, "region_name": "us-east-1"}
        airflow.env["AIRFLOW_CONN_AWS_DEFAULT"] = json.dumps(
            {"conn_type": "aws", "login": KEY_ID, "password": SECRET, "extra": extra}
        )
        yield moto
    finally:
        airflow.env = saved
        moto.stop()


def test_a_crashed_try_is_retried_from_the_latest_checkpoint_at_another_parallelism(
    airflow: AirflowHome,
    events: Path,
    tmp_path: Path,
    statsd: StatsD,
    s3_connection: RecordingMotoServer,
) -> None:
    """A Python pipeline's try crashes; the retry restores its latest checkpoint (on S3, through
    a session-token connection) at another parallelism, exactly once; alerts, metrics, lineage
    and the sink's Asset follow; no credential reaches a log."""
    parallelism_on_retry = 3  # the Pipeline's parallelism is 2
    job = JOB
    spec = write_python_pipeline(
        tmp_path,
        events,
        retries=2,
        retry_delay="1s",
        parallelism_on_retry=parallelism_on_retry,
        entry="build_on_s3",
    )
    alerts, lineage = tmp_path / "alerts.txt", tmp_path / "lineage.jsonl"
    sink_uri = (tmp_path / "out").as_uri()
    airflow.write_dag(job, DAG.format(spec=str(spec), alerts=str(alerts)))
    airflow.write_dag("after_py_events", DOWNSTREAM.format(uri=sink_uri))
    # issue 26: metrics to a StatsD listener, lineage to OpenLineage's file transport
    airflow.env.update(
        {
            "AIRFLOW__METRICS__STATSD_ON": "True",
            "AIRFLOW__METRICS__STATSD_HOST": "127.0.0.1",
            "AIRFLOW__METRICS__STATSD_PORT": str(statsd.port),
            "AIRFLOW__OPENLINEAGE__TRANSPORT": json.dumps(
                {"type": "file", "log_file_path": str(lineage), "append": True}
            ),
        }
    )
    started = time.monotonic()
    reserialized = airflow.run("dags", "reserialize")  # the downstream DAG's asset schedule
    print(f"airflow dags reserialize took {time.monotonic() - started:.1f} s")
    assert reserialized.returncode == 0, reserialized.stderr[-3000:]
    unpaused = airflow.run("dags", "unpause", "after_py_events")  # new DAGs start paused
    assert unpaused.returncode == 0, unpaused.stderr[-3000:]
    result = airflow.dags_test(job)
    logs = result.stdout + result.stderr
    assert result.returncode == 0, logs[-4000:]
    # the operator shipped the code to spark-submit
    assert re.search(r"--py-files \S*ckpt_example\.zip", logs), logs[-4000:]
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
    # the checkpoints went to S3 with the connection's session token, by the driver's and the
    # executors' environment only: every request carried it, and no log holds a credential
    for value in (SECRET, TOKEN):
        assert value not in logs
    requests = s3_connection.requests()
    snapshots = [r for r in requests if r["method"] == "PUT" and "/aggregate-" in r["url"]]
    assert len(snapshots) >= 2 * 2 + 2 * 3, [r["url"] for r in requests]  # both tries'
    assert {r["headers"].get("X-Amz-Security-Token") for r in requests} == {TOKEN}
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

    # issue 26: the rescaled restore was an alert (the notifier that raised changed nothing)
    (rescaled,) = alerts.read_text().splitlines()
    assert rescaled.startswith(
        f"restore_rescaled|pipeline {job}: attempt {by_status['RESTORED']['attempt']} restored "
        f"checkpoint 2 at parallelism {parallelism_on_retry} (taken at 2). Checkpoints: "
    ), rescaled
    assert f"/checkpoints/ui/?pipeline={job}" in rescaled
    assert "the chat service is down" in logs
    # the tries' checkpoint metrics reached StatsD, by pipeline
    lines = statsd.lines()
    for line in (
        f"airflow.ckpt.checkpoints.completed.{job}:1|c",
        f"airflow.ckpt.restores.{job}:1|c",
        f"airflow.ckpt.restore.epochs_redone.{job}:0|g",
    ):
        assert line in lines, sorted(x for x in lines if ".ckpt." in x)
    assert any(x.startswith(f"airflow.ckpt.checkpoint.duration.{job}:") for x in lines)
    assert any(x.startswith(f"airflow.ckpt.restore.duration.{job}:") for x in lines)
    # OpenLineage: START and FAIL of try 1, START and COMPLETE of try 2, with the datasets and
    # the checkpointing facet of what try 2 restored
    # one event a line (not splitlines(): the DAG's documentation holds other line breaks)
    emitted = [json.loads(line) for line in lineage.read_text().split("\n") if line]
    runs = [e for e in emitted if e["job"]["name"] == f"{job}.run"]
    assert [e["eventType"] for e in runs] == ["START", "FAIL", "START", "COMPLETE"], runs
    complete = runs[-1]
    assert [(d["namespace"], d["name"]) for d in complete["outputs"]] == [
        ("file", str(tmp_path / "out"))
    ]
    assert [(d["namespace"], d["name"]) for d in complete["inputs"]] == [
        ("file", str(events))  # the spec's events/ is a link to them
    ]
    facet = complete["run"]["facets"]["checkpointing"]
    assert (facet["restoredCheckpointId"], facet["parallelism"], facet["rescaledFrom"]) == (
        2,
        parallelism_on_retry,
        2,
    )
    assert facet["epochsRedone"] == 0 and facet["epochsDone"] == 4 and facet["checkpoints"]
    # the sink's Asset was updated: the scheduler runs the DAG scheduled on it
    started = time.monotonic()
    scheduled = airflow.run("scheduler", "--num-runs", "3", timeout=300)
    print(f"the scheduler's 3 loops took {time.monotonic() - started:.1f} s")
    assert scheduled.returncode == 0, scheduled.stderr[-3000:]
    airflow_db = create_engine(airflow.env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
    try:
        with airflow_db.connect() as conn:
            run_types = conn.execute(
                text("SELECT run_type FROM dag_run WHERE dag_id = 'after_py_events'")
            ).scalars()
            assert list(run_types) == ["asset_triggered"], scheduled.stdout[-3000:]
    finally:
        airflow_db.dispose()
