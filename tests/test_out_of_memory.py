"""A run whose Spark JVM runs out of memory says so in one line — which JVM, where the run was,
what to raise — instead of the ``Connection refused`` of the next Py4J call; the attempt is
still recorded as failed.

The driver's case is real: ``ckpt run`` as a process, a 512m driver heap (about Spark's
minimum), and a transform that makes every row of the second epoch's file a million rows of 2 MB
strings collected in one list. An executor's failure on a cluster is read from the job's abort
message: those cases are the messages Spark writes (one captured on the standalone cluster of
``tests/spark_cluster.py``: its executors exit with Spark's code 52)."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest

from checkpointing.errors import SparkMemoryError
from checkpointing.pipeline.spec import load_spec
from checkpointing.spark.jvm_failure import JvmWatch, MemorySettings, with_exit_on_oom
from tests.ckpt_process import CKPT, ckpt_env

JOB = "oom"
SPEC = f"""
job: {JOB}
source: {{format: parquet, path: "DATA/*.parquet"}}
transform: |
  SELECT user, size(collect_list(repeat(user, 1000000))) AS n
  FROM input LATERAL VIEW explode(sequence(1, reps)) copies AS i
  GROUP BY user
key: user
aggregations: {{n: sum(n)}}
sink: {{path: out}}
checkpoint: {{every_epochs: 1}}
"""


def _write_pipeline(workdir: Path) -> Path:
    """Epoch 0: one copy of each row (fits); epoch 1: a million copies (does not)."""
    data = workdir / "data"
    data.mkdir(parents=True)
    for epoch, reps in enumerate((1, 1_000_000)):
        rows = pd.DataFrame({"user": ["u0", "u1"], "reps": [reps, reps]})
        rows.to_parquet(data / f"part-{epoch}.parquet")
    spec = workdir / "pipeline.yaml"
    spec.write_text(SPEC.replace("DATA", str(data)))
    return spec


def test_a_driver_out_of_memory_is_one_line_naming_the_jvm_epoch_and_setting(
    tmp_path: Path,
) -> None:
    env = ckpt_env(tmp_path / "home")
    # the user's own driver JVM options stay: ours go to spark.driver.defaultJavaOptions
    env["PYSPARK_SUBMIT_ARGS"] = (
        "--driver-memory 512m --driver-java-options -XX:TieredStopAtLevel=1 pyspark-shell"
    )
    spec = _write_pipeline(tmp_path)
    started = time.monotonic()
    run = subprocess.run(
        [CKPT, "run", str(spec)], env=env, capture_output=True, text=True, timeout=300
    )
    took = time.monotonic() - started
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1, run.stderr[-3000:]
    assert "epoch 1/2 done" in run.stdout  # epoch 0 fit
    assert "Terminating due to java.lang.OutOfMemoryError" in run.stdout  # the JVM's own line
    assert last.startswith(f"error: job {JOB}: the Spark driver JVM ran out of memory ("), last
    assert "java.lang.OutOfMemoryError" in last
    # epoch 1's job died (epoch 0's may have been written at the same time: both are named)
    assert re.search(r"in epochs? (0 and )?1 .*while merging the state of stage 'aggregate'", last)
    assert "raise spark.driver.memory (now 512m)" in last
    assert "Connection refused" not in last
    assert took < 120, f"{took:.0f} s"

    jobs = subprocess.run(
        [CKPT, "jobs", "--json"], env=env, capture_output=True, text=True, check=True
    )
    (job,) = json.loads(jobs.stdout)
    assert job["status"] == "FAILED"  # the coordinator's failover ran
    listed = subprocess.run(
        [CKPT, "list", JOB, "--json"], env=env, capture_output=True, text=True, check=True
    )
    # the checkpoint after epoch 0 completed, or was aborted with the attempt: none is left open
    assert {c["status"] for c in json.loads(listed.stdout)} <= {"COMPLETED", "ABORTED"}


@pytest.fixture
def watch(tmp_path: Path) -> JvmWatch:
    """A cluster run's watch: no driver process of this one's (spark-submit's), 2g executors."""
    spec = load_spec(_write_pipeline(tmp_path))
    return JvmWatch(spec, MemorySettings(local=False, driver="1g", executor="2g", overhead="512m"))


def _abort(failure: str) -> Exception:
    """The error the driver's action raises when the stage failed with ``failure``."""
    return RuntimeError(
        "An error occurred while calling o412.localCheckpoint.\n"
        ": org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage "
        f"2.0 failed 4 times, most recent failure: {failure}\n"
        "Driver stacktrace:\n\tat org.apache.spark.scheduler.DAGScheduler.handleTaskSetFailed"
    )


WHERE = "in epoch 3 while merging the state of stage 'aggregate'"


def test_an_executor_task_out_of_memory_names_the_executor_and_its_memory(
    watch: JvmWatch,
) -> None:
    exc = _abort(
        "Lost task 0.3 in stage 2.0 (TID 5) (10.0.0.7 executor 1): "
        "java.lang.OutOfMemoryError: Java heap space"
    )
    error = watch.failure(exc, WHERE, in_epoch=True)
    assert isinstance(error, SparkMemoryError)
    assert str(error) == (
        f"job {JOB}: Spark executor 1 on 10.0.0.7 ran out of memory (java.lang.OutOfMemoryError:"
        f" Java heap space) {WHERE}; raise spark.executor.memory (now 2g) or split the input "
        "files by row groups (source.max_split_bytes, now whole files)"
    )


@pytest.mark.parametrize(
    ("reason", "setting"),
    [
        ("Command exited with code 52", "raise spark.executor.memory (now 2g)"),
        (
            "The executor with id 4 exited with exit code 137(SIGKILL, possible container OOM).",
            "raise spark.executor.memoryOverhead (now 512m) or spark.executor.memory (now 2g)",
        ),
        (
            "Container killed by YARN for exceeding physical memory limits. 2.6 GB of 2.5 GB "
            "physical memory used. Consider boosting spark.executor.memoryOverhead.",
            "raise spark.executor.memoryOverhead (now 512m)",
        ),
    ],
)
def test_an_executor_lost_for_memory_names_the_setting_to_raise(
    watch: JvmWatch, reason: str, setting: str
) -> None:
    exc = _abort(
        "Lost task 0.3 in stage 2.0 (TID 5) (10.0.0.7 executor 4): ExecutorLostFailure "
        f"(executor 4 exited caused by one of the running tasks) Reason: {reason}"
    )
    error = watch.failure(exc, WHERE, in_epoch=False)
    assert isinstance(error, SparkMemoryError)
    assert str(error).startswith(f"job {JOB}: Spark executor 4 "), error
    assert WHERE in str(error) and setting in str(error) and "source." not in str(error)


def test_other_failures_are_left_as_they_are(watch: JvmWatch) -> None:
    exc = _abort(
        "Lost task 0.0 in stage 2.0 (TID 5) (10.0.0.7 executor 1): ExecutorLostFailure "
        "(executor 1 exited unrelated to the running tasks) Reason: worker decommissioned"
    )
    assert watch.failure(exc, WHERE, in_epoch=True) is None
    assert watch.failure(ValueError("malformed record"), WHERE, in_epoch=True) is None


def test_the_exit_option_is_added_to_the_administrators_options_once() -> None:
    assert with_exit_on_oom(None) == "-XX:+ExitOnOutOfMemoryError"
    assert with_exit_on_oom("-Dx=1") == "-Dx=1 -XX:+ExitOnOutOfMemoryError"
    assert with_exit_on_oom("-Dx=1 -XX:+ExitOnOutOfMemoryError") == (
        "-Dx=1 -XX:+ExitOnOutOfMemoryError"
    )
