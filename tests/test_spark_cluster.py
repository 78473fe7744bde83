"""The Spark runtime on a real standalone cluster: a master and two 1-core workers started from
the installed pyspark on loopback, checkpoints in S3 (moto's server). Executors, not the driver,
must write the snapshots (and read them on restore); the output of a crash-free run (a Parquet
sink on the local filesystem every process shares), and of a crash plus a rescaled restore with
everything on S3 — input, checkpoints and a Delta table, no path shared by the driver and the
executors — must equal that of a crash-free local run.

Each attempt is a driver process of its own (:func:`tests.spark_cluster.run_driver`), as an
Airflow retry would be; the test process only compares results (with the local ``spark``).

The first run's driver has temporary credentials (a session token), as the Airflow operator
resolves them from a role or session-token connection: the executors get them from the driver's
session (``spark.executorEnv.*``), and a recording moto server shows the token on every snapshot
PUT; neither the secret nor the token is in Spark's event log, any log of the cluster, or any
command line.
"""

from __future__ import annotations

import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pandas as pd
import pytest

from checkpointing.metastore import views
from checkpointing.metastore.engine import Metastore
from checkpointing.state.metadata import CheckpointMetadata
from tests.delta_helpers import read_table, txn_counts
from tests.spark_cluster import (
    CRASH_EXIT,
    DriverRun,
    RecordingMotoServer,
    StandaloneCluster,
    executor_of,
    read_records,
    run_driver,
)
from tests.spark_pipeline import (
    EPOCHS,
    completed_ids,
    make_spec,
)

pytestmark = pytest.mark.timeout(1800)  # a loaded 2-core machine; normally ~4 min

#: a snapshot file: incremental checkpoints write theirs under the job's shared/
SNAPSHOT = re.compile(r"/shared/chk-(\d+)/aggregate-(\d+)\.arrow$")


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    """Master + 2 workers (1 core, 1g each); torn down with every executor and Python worker."""
    cluster = StandaloneCluster(tmp_path_factory.mktemp("spark-cluster"), workers=2, cores=1)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
    assert cluster.processes() == [], "processes of the Spark cluster outlived its teardown"


@pytest.fixture(scope="module")
def recording_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RecordingMotoServer]:
    server = RecordingMotoServer(tmp_path_factory.mktemp("moto-recording"))
    server.start()
    yield server
    server.stop()


#: temporary credentials, as an assumed role or a session-token connection gives them
KEY_ID, SECRET = "ASIACLUSTER0EXAMPLE1", "tmp-secret-5b0e1c9d-x"
TOKEN = "IQoJb3JpZ2luX2VjToken-41f7"


@pytest.fixture
def token_bucket(recording_s3: RecordingMotoServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """The drivers' environment as the operator sets it for a session-token connection."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", recording_s3.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    name = f"ckpt-{uuid.uuid4().hex[:10]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


def _assert_no_credentials_in(paths: list[Path]) -> int:
    """Neither the secret nor the token in any of the files under ``paths``; returns how many
    files were read."""
    read = 0
    for root in paths:
        for path in [root] if root.is_file() else root.rglob("*"):
            if path.is_file() and path.stat().st_size < 20_000_000:
                text = path.read_bytes()
                read += 1
                for value in (SECRET, TOKEN):
                    assert value.encode() not in text, f"{value[:4]}… in {path}"
    return read


@pytest.fixture(scope="module")
def events(runtime_events: Path) -> Path:
    return runtime_events


@pytest.fixture(scope="module")
def reference(runtime_reference: Any) -> Any:
    return runtime_reference


@pytest.fixture
def metastore_url(tmp_path: Path) -> str:
    """SQLite: the cluster is what is under test here; the metastore backends are covered
    elsewhere (both drivers of a test share the file)."""
    url = f"sqlite:///{tmp_path / 'metastore.db'}"
    Metastore(url, check_schema=False).upgrade()
    return url


def _attempt(
    spark_cluster: StandaloneCluster, tmp_path: Path, name: str, spec: Any, **kw: Any
) -> DriverRun:
    return run_driver(
        spark_cluster, tmp_path, name, spec=spec.spec_path, record_dir=tmp_path / "records", **kw
    )


def _assert_from_executors(
    notes: list[dict[str, Any]], spark_cluster: StandaloneCluster, driver_pid: int
) -> set[str]:
    """Every note comes from a Spark task in a Python worker of an executor JVM launched by one
    of the cluster's workers, running this interpreter, outside the driver's process tree.
    Returns the executor ids."""
    assert notes
    executors = set()
    for note in notes:
        executor = executor_of(note, spark_cluster.worker_pids())
        assert executor is not None, f"not from an executor of the cluster: {note}"
        assert note["task"] is not None, note
        assert driver_pid not in {p["pid"] for p in note["ancestry"]}, note
        assert note["python"] == sys.executable
        assert note["aws_endpoint"], "the executor got no AWS_ENDPOINT_URL"
        executors.add(executor)
    return executors


def test_crash_and_rescaled_restore_on_the_cluster_all_on_s3_equals_reference(
    spark: Any,
    spark_cluster: StandaloneCluster,
    events: Path,
    reference: Any,
    token_bucket: str,
    recording_s3: RecordingMotoServer,
    metastore_url: str,
    tmp_path: Path,
) -> None:
    """Input, checkpoints and a Delta table on S3: no path is shared by the driver and the
    executors (they share only the endpoint, and session-token credentials by environment). A
    crash, then a restore at another parallelism: the snapshots are written and loaded by
    executors, every snapshot PUT carries the token and no log holds a credential; the table
    equals the reference's final table, each checkpoint committed to it once; the finished job
    keeps only its newest checkpoint and the shared files it uses."""
    s3_bucket = token_bucket
    s3 = boto3.client("s3")
    for f in sorted(events.glob("*.parquet")):
        s3.put_object(Bucket=s3_bucket, Key=f"in/{f.name}", Body=f.read_bytes())
    table = f"s3://{s3_bucket}/tables/cluster-crash"
    source = f'{{format: parquet, path: "s3://{s3_bucket}/in/*.parquet", splits_per_epoch: 1}}'
    spec = make_spec(tmp_path, "cluster-crash", source, sink=f"{{format: delta, path: {table}}}")
    (tmp_path / "records").mkdir()
    kw = {"metastore_url": metastore_url, "storage_url": f"s3://{s3_bucket}/checkpoints"}
    crashed = _attempt(spark_cluster, tmp_path, "crash", spec, crash_after_epochs=2, **kw)
    assert crashed.returncode == CRASH_EXIT, crashed.describe()
    assert crashed.report["crashed"]

    # the retained checkpoints are on S3 (checked with a client of our own), and the latest
    # one's metadata points at its snapshot objects there
    metastore = Metastore(metastore_url)
    completed = completed_ids(metastore, "cluster-crash")
    assert completed == crashed.report["result"]["checkpoints"] and len(completed) == 2
    listed = s3.list_objects_v2(Bucket=s3_bucket, Prefix="checkpoints/cluster-crash/")
    sizes = {f"s3://{s3_bucket}/{o['Key']}": o["Size"] for o in listed.get("Contents", [])}
    base = f"s3://{s3_bucket}/checkpoints/cluster-crash"
    for checkpoint_id in completed:
        assert f"{base}/chk-{checkpoint_id}/_metadata" in sizes
    latest = completed[-1]
    key = f"checkpoints/cluster-crash/chk-{latest}/_metadata"
    body = s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
    metadata = CheckpointMetadata.from_bytes(body, key)
    files = metadata.files()  # each subtask's own file, and the ones its changes build on
    assert {h.handle for h in metadata.handles()} == {
        f"{base}/shared/chk-{latest}/aggregate-{i}.arrow" for i in range(3)
    }
    assert all(sizes[f.handle] == f.size for f in files)
    assert set(txn_counts(table, "cluster-crash")) == set(completed)  # committed, once each

    # the snapshots were written by executors of the cluster, the _metadata by the driver (the
    # coordinator), and each snapshot PUT on the wire carried the session token
    notes = read_records(tmp_path / "records")
    writes = [n for n in notes if n["op"] == "write" and SNAPSHOT.search(n["url"])]
    assert {(int(m[1]), int(m[2])) for n in writes if (m := SNAPSHOT.search(n["url"]))} == {
        (c, i) for c in completed for i in range(3)
    }
    executors = _assert_from_executors(writes, spark_cluster, crashed.report["pid"])
    assert all(n["aws_session_token"] and not n["credentials_on_command_line"] for n in writes)
    metadata_writes = [n for n in notes if n["op"] == "write" and n["url"].endswith("/_metadata")]
    assert [n["url"] for n in metadata_writes] and all(
        n["pid"] == crashed.report["pid"] and n["task"] is None for n in metadata_writes
    ), "the coordinator (driver) writes _metadata"
    print(f"snapshots written by executors {sorted(executors)}")

    # restore on the cluster with parallelism 3 -> 2: executors read the old snapshots
    restored = _attempt(spark_cluster, tmp_path, "restore", spec, parallelism=2, **kw)
    assert restored.returncode == 0, restored.describe()
    result = restored.report["result"]
    assert result["restored_from"] == latest
    assert result["epochs_run"] == list(range(2, EPOCHS))

    # the state is loaded by executors (the driver's restore lookup may read the files too, to
    # verify their checksums; those reads are not the load)
    driver = restored.report["pid"]
    reads = [
        n
        for n in read_records(tmp_path / "records")
        if n["op"] == "read" and n["url"] in {f.handle for f in files}
    ]
    loads = [n for n in reads if n["pid"] != driver]
    assert {n["url"] for n in loads} == {f.handle for f in files}
    _assert_from_executors(loads, spark_cluster, driver)

    # the Delta table (read with deltalake, not Spark) is the reference's final table, and the
    # log has every checkpoint of both attempts committed exactly once
    final = read_table(table, ["user"])
    pd.testing.assert_frame_equal(
        final[reference[0].columns.tolist()], reference[0], check_dtype=False
    )
    counts = txn_counts(table, "cluster-crash")
    assert set(counts.values()) == {1}
    assert set(result["checkpoints"]) <= set(counts) and set(completed) <= set(counts)

    puts = [
        r for r in recording_s3.requests() if r["method"] == "PUT" and SNAPSHOT.search(r["url"])
    ]
    assert len(puts) >= 3 * 2 + 2 * (EPOCHS - 2), [r["url"] for r in puts]
    assert {r["headers"].get("X-Amz-Security-Token") for r in puts} == {TOKEN}
    assert all(KEY_ID in r["headers"].get("Authorization", "") for r in puts)
    # nowhere in Spark's event logs (their environment: redacted), the drivers' logs, the
    # cluster's logs (master, workers, executors' stdout/stderr)
    event_logs = [tmp_path / "crash-events", tmp_path / "restore-events"]
    logged = "".join(p.read_text() for d in event_logs for p in d.rglob("*") if p.is_file())
    assert "spark.executorEnv.AWS_SESSION_TOKEN" in logged  # the setting is there, redacted
    assert KEY_ID not in logged  # AWS_ACCESS_KEY_ID: redacted by the session's regex
    logs = [*event_logs, crashed.log, restored.log, spark_cluster.root]
    assert _assert_no_credentials_in(logs) > 3
    apps = {a["id"]: a["state"] for a in spark_cluster.state()["completedapps"]}
    assert apps[restored.report["app_id"]] == "FINISHED"  # an application of this master

    # the finished job kept its newest checkpoint (the live state its next run resumes from)
    # and discarded the others (retention) on S3, and of the shared files only those it uses
    checkpoints = result["checkpoints"]
    rows = views.list_checkpoints(metastore, "cluster-crash")
    assert set(checkpoints) <= {r["checkpoint_id"] for r in rows if r["completed_at"]}
    left = s3.list_objects_v2(Bucket=s3_bucket, Prefix="checkpoints/cluster-crash/")
    kept = {o["Key"].split("/")[2] for o in left.get("Contents", [])}
    assert kept == {f"chk-{checkpoints[-1]}", "shared"}, left.get("Contents")
    key = f"checkpoints/cluster-crash/chk-{checkpoints[-1]}/_metadata"
    body = s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
    used = {f.handle for f in CheckpointMetadata.from_bytes(body, key).files()}
    shared = {f"s3://{s3_bucket}/{o['Key']}" for o in left["Contents"] if "/shared/" in o["Key"]}
    assert shared == used
