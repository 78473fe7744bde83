"""A try's outcome from the metastore alone (what the Airflow operator reports, wherever the driver
ran), checked against what the driver itself returned for a real crashed run on local Spark and
its restored retry; and the one line a try whose driver was SIGKILLed logs."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.outcome import attempt_outcome, latest_completed
from checkpointing.state.storage import FileSystemCheckpointStorage
from checkpointing_airflow.spark_submit_internals import submit_returncode
from tests.spark_pipeline import EPOCHS, events_spec, write_events


def _attempt(spark: Any, spec: Any, metastore: Metastore, storage: Any, attempt: str, **kw: Any):
    """One try as the operator runs it: its coordinator activated under the attempt id, the
    driver joining it."""
    from checkpointing.spark.preflight import RunOptions
    from checkpointing.spark.runtime import PipelineRun, SimulatedCrash

    run = PipelineRun(
        spec, spark, metastore, storage, RunOptions(attempt=attempt, coordinator_id=attempt, **kw)
    )
    run.coordinator.activate()
    with contextlib.suppress(SimulatedCrash):
        run.run()
    return run.result


def test_the_outcome_read_from_the_metastore_is_what_the_driver_ran(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"sqlite:///{tmp_path / 'metastore.db'}"
    with caplog.at_level(logging.INFO):
        Metastore(url, check_schema=False).upgrade()
    assert not [r for r in caplog.records if r.name.startswith("alembic")]  # kept out of logs
    metastore = Metastore(url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'checkpoints'}")
    spec = events_spec(tmp_path, write_events(tmp_path / "events"), "outcome")

    crashed = _attempt(spark, spec, metastore, storage, "run-t1", crash_after_epochs=2)
    first = attempt_outcome(metastore, spec.job, "run-t1")
    assert first.status == "FAILED"
    assert first.checkpoints == crashed.checkpoints and len(first.checkpoints) == 2
    assert first.restored_from is None
    assert first.epochs_run == len(crashed.epochs_run) == 2  # counted, as the CLI counts them
    assert first.epochs_done == 2
    assert first.latest is not None and first.latest.checkpoint_id == crashed.checkpoints[-1]
    assert latest_completed(metastore, spec.job) == first.latest

    retried = _attempt(spark, spec, metastore, storage, "run-t2", parallelism=2)
    second = attempt_outcome(metastore, spec.job, "run-t2")
    assert second.status == "FINISHED"
    assert second.restored_from == retried.restored_from == crashed.checkpoints[-1]
    assert second.checkpoints == retried.checkpoints
    assert second.epochs_run == len(retried.epochs_run) == EPOCHS - 2
    assert second.epochs_done == EPOCHS
    assert second.savepoint_path is None
    assert attempt_outcome(metastore, spec.job, "never-ran").checkpoints == []


def test_a_sigkilled_driver_is_one_line_with_the_checkpoint_the_retry_restores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Spark provider's hook really runs a spark-submit that dies of SIGKILL."""
    pytest.importorskip("airflow")
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    from checkpointing.metastore.outcome import CheckpointPoint
    from checkpointing_airflow.attempts import describe_failed_try

    fake = tmp_path / "spark-submit"
    fake.write_text(
        f"#!{sys.executable}\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    hook = SparkSubmitHook(conn_id=None)
    with pytest.raises(Exception, match="Error code is: -9") as failed:
        hook.submit("app.py")
    latest = CheckpointPoint(4, 4, "file:///ckpt/job/chk-4")
    line = describe_failed_try(
        "job",
        1,
        submit_returncode(hook),
        failed.value,
        latest,
        retries_left=True,
        retry_parallelism=2,
    )
    assert "\n" not in line
    assert "the Spark driver died of SIGKILL (spark-submit exit code -9)" in line
    assert "last completed checkpoint 4 (file:///ckpt/job/chk-4, 4 epochs done)" in line
    assert "the retry (try 2) restores checkpoint 4" in line
    # from the provider's message alone, and an ordinary failure
    assert "died of SIGKILL" in describe_failed_try(
        "job", 1, None, failed.value, None, retries_left=False, retry_parallelism=2
    )
    plain = describe_failed_try(
        "job", 3, 1, RuntimeError("x"), None, retries_left=False, retry_parallelism=2
    )
    assert "failed (exit code 1); no completed checkpoint; no retry left" in plain
    out_of_memory = describe_failed_try(
        "job", 1, 52, RuntimeError("x"), None, retries_left=True, retry_parallelism=2
    )
    assert "ran out of memory (exit code 52" in out_of_memory
    assert "raise spark.driver.memory" in out_of_memory
    assert "\n" not in out_of_memory
    # the hook's own return code is the signal's, and another signal is named by its name
    assert submit_returncode(hook) == -signal.SIGKILL
    terminated = describe_failed_try(
        "job", 1, -signal.SIGTERM, RuntimeError("x"), latest, retries_left=True, retry_parallelism=2
    )
    assert "the Spark driver died of SIGTERM (spark-submit exit code -15)" in terminated
