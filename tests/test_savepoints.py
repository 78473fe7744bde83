"""Savepoints requested from outside the job (``ckpt savepoint``, later the UI and DAGs): refused
for a job that is not running, followed to COMPLETED or FAILED, and stop-with-savepoint ending a
real Spark job, which then resumes from the savepoint with the output of an uninterrupted run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from typer.testing import CliRunner

from checkpointing.cli import app
from checkpointing.coordination import savepoints
from checkpointing.errors import UnknownJobError
from checkpointing.metastore import views
from checkpointing.metastore.engine import Metastore
from checkpointing.state.storage import FileSystemCheckpointStorage
from checkpointing.status import CheckpointType, JobStatus
from tests.helpers import ack_all, new_coordinator
from tests.spark_pipeline import (
    EPOCHS,
    assert_equals_reference,
    events_spec,
    run,
    write_events,
)

# ---------------------------------------------------------------- requests, without Spark


def test_a_job_that_is_not_running_refuses_a_savepoint(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: Any
) -> None:
    with pytest.raises(UnknownJobError, match="'nope'"):
        savepoints.request_savepoint(metastore, "nope", requested_by="test")
    coordinator = new_coordinator(metastore, storage, clock, job_id="idle")
    coordinator.activate()
    with pytest.raises(savepoints.JobNotRunningError, match="'idle' is not running"):
        savepoints.request_savepoint(metastore, "idle", requested_by="test")
    coordinator.job_status_changed(JobStatus.FINISHED)
    with pytest.raises(savepoints.JobNotRunningError, match="status FINISHED"):
        savepoints.request_savepoint(metastore, "idle", stop=True, requested_by="test")
    assert views.list_requests(metastore, "idle") == []


def test_a_request_is_followed_to_its_completed_savepoint(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: Any
) -> None:
    coordinator = new_coordinator(metastore, storage, clock, job_id="live")
    coordinator.activate()
    coordinator.job_status_changed(JobStatus.RUNNING)
    request_id = savepoints.request_savepoint(metastore, "live", requested_by="cli:alice")
    queued = savepoints.request_status(metastore, "live", request_id)
    assert (queued.status, queued.done, queued.savepoint_path) == ("QUEUED", False, None)
    with pytest.raises(savepoints.RequestTimeoutError, match=r"still QUEUED after 0\.2 s"):
        savepoints.wait_for_request(metastore, "live", request_id, timeout=0.2, poll=0.05)

    (pending,) = coordinator.process_requests()  # the job's next epoch boundary
    assert pending.checkpoint_type is CheckpointType.SAVEPOINT
    assert savepoints.request_status(metastore, "live", request_id).status == "TRIGGERED"
    ack_all(coordinator, pending)
    done = savepoints.wait_for_request(metastore, "live", request_id, timeout=5)
    assert done.succeeded and done.checkpoint_id == pending.checkpoint_id
    assert done.savepoint_path == storage.savepoint_url("live", pending.checkpoint_id)
    assert done.to_dict()["requested_by"] == "cli:alice"
    with pytest.raises(savepoints.UnknownRequestError):
        savepoints.request_status(metastore, "other", request_id)


def test_a_request_dropped_when_the_job_fails_ends_the_wait_with_the_reason(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: Any
) -> None:
    coordinator = new_coordinator(metastore, storage, clock, job_id="dying")
    coordinator.activate()
    coordinator.job_status_changed(JobStatus.RUNNING)
    request_id = savepoints.request_savepoint(metastore, "dying", stop=True, requested_by="t")
    coordinator.job_status_changed(JobStatus.FAILED)
    with pytest.raises(savepoints.RequestFailedError, match=r"dropped: .*suspending"):
        savepoints.wait_for_request(metastore, "dying", request_id, timeout=5)


def test_cli_savepoint_errors_are_one_line_and_exit_1(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'm.db'}"
    Metastore(url, check_schema=False).upgrade()
    runner = CliRunner()
    result = runner.invoke(app, ["--metastore-url", url, "savepoint", "ghost", "--wait"])
    assert result.exit_code == 1
    assert "unknown job 'ghost'" in result.stderr
    result = runner.invoke(app, ["--metastore-url", url, "savepoint", "x", "--timeout", "soon"])
    assert result.exit_code == 2 and "--timeout" in result.stderr


# ---------------------------------------------------------------- stop-with-savepoint on Spark


@pytest.fixture(scope="module")
def events(runtime_events: Path) -> Path:
    return runtime_events


@pytest.fixture(scope="module")
def reference(runtime_reference: Any) -> Any:
    return runtime_reference


@pytest.mark.parametrize("metastore_url", ["sqlite", "postgresql"], indirect=True)
def test_stop_with_savepoint_ends_the_job_and_the_savepoint_resumes_it(
    spark: Any, events: Path, tmp_path: Path, metastore_url: str, reference: Any
) -> None:
    spec = events_spec(tmp_path, events, "stopped")
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    requests: list[int] = []

    def after_epoch(epoch: int, _ms: int) -> None:
        if epoch == 1:  # from "outside": through the metastore only
            requests.append(
                savepoints.request_savepoint(
                    Metastore(metastore_url), "stopped", stop=True, requested_by="test"
                )
            )

    result = run(spark, spec, metastore, storage, on_epoch=after_epoch)
    # taken at the next boundary (after epoch 2); the job ends there
    assert result.epochs_run == [0, 1, 2]
    assert result.final_path is None
    done = savepoints.request_status(metastore, "stopped", requests[0])
    assert done.status == "COMPLETED" and done.checkpoint_type == "SAVEPOINT_THEN_STOP"
    assert result.stopped_with_savepoint == done.savepoint_path
    job = next(j for j in views.list_jobs(metastore) if j["job_id"] == "stopped")
    assert job["status"] == "FINISHED"
    with pytest.raises(savepoints.JobNotRunningError):
        savepoints.request_savepoint(metastore, "stopped", requested_by="test")

    resumed = run(spark, spec, metastore, storage)  # --restore latest finds the savepoint
    assert resumed.restored_from == done.checkpoint_id
    assert resumed.epochs_run == list(range(3, EPOCHS))
    assert_equals_reference(spark, spec, reference)


def test_ckpt_savepoint_stop_wait_against_a_running_ckpt_run(tmp_path: Path) -> None:
    """Two real processes, as users run them: ``ckpt run`` and ``ckpt savepoint --stop --wait``."""
    ckpt = str(Path(sys.executable).with_name("ckpt"))
    data = write_events(tmp_path / "data")
    spec = tmp_path / "p.yaml"
    spec.write_text(
        f"""
job: served
source: {{format: parquet, path: "{data}/*.parquet", splits_per_epoch: 1}}
key: user
aggregations: {{n: count(), total: sum(amount)}}
sink: {{path: out, changelog: true}}
parallelism: 2
max_parallelism: 8
checkpoint: {{every_epochs: 2}}
"""
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env["CKPT_HOME"] = str(tmp_path / "home")
    assert subprocess.run([ckpt, "db", "upgrade"], env=env, check=False).returncode == 0
    job = subprocess.Popen(
        [ckpt, "run", str(spec)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        store = Metastore(f"sqlite:///{tmp_path / 'home' / 'metastore.db'}")
        deadline = time.monotonic() + 240
        while not any(j["status"] == "RUNNING" for j in views.list_jobs(store)):
            assert job.poll() is None, job.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.2)
        asked = subprocess.run(
            [ckpt, "savepoint", "served", "--stop", "--wait", "--timeout", "4m"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert asked.returncode == 0, asked.stderr
        found = re.search(
            r"savepoint (\d+) of job served completed: (\S+) \(the job stops\)", asked.stdout
        )
        assert found, asked.stdout
        stdout, stderr = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stderr[-2000:]
    assert f"stopped with savepoint {found.group(1)}" in stdout
    assert found.group(2) in stdout  # the path to resume from is printed
    assert not (tmp_path / "out" / "final").exists()

    resumed = subprocess.run(
        [ckpt, "run", str(spec), "--restore", found.group(2)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"restored from checkpoint {found.group(1)}" in resumed.stdout
    final = pd.read_parquet(tmp_path / "out" / "final").sort_values("user")
    frames = pd.concat(pd.read_parquet(p) for p in sorted(data.glob("*.parquet")))
    want = frames.groupby("user").agg(n=("amount", "size"), total=("amount", "sum"))
    assert final.n.tolist() == want.n.tolist()
    assert final.total.tolist() == pytest.approx(want.total.tolist())
    committed = sorted(
        int(p.name.split("=")[1]) for p in (tmp_path / "out" / "changelog").glob("epoch=*")
    )
    assert committed == list(range(EPOCHS))
