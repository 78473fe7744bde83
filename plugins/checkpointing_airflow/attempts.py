"""Attempt ids: one try of one DAG run of a pipeline, ``<run>-<hash>-t<try>``.

The operator builds the id of its try (it is the coordinator id of the job while the try runs,
and part of task and file names); the failure callbacks build the failed try's id and read a
later try's id back. Both do it here."""

from __future__ import annotations

import hashlib
import re
import signal
from typing import Any

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def attempt_id(dag_id: str, run_id: str, try_number: int) -> str:
    """A safe, unique id for one try of one DAG run (it becomes part of task and file names)."""
    digest = hashlib.sha256(f"{dag_id}\0{run_id}".encode()).hexdigest()[:8]
    readable = _UNSAFE.sub("-", run_id).strip("-._")[:48] or "run"
    return f"{readable}-{digest}-t{try_number}"


def refresh_token(context: Any) -> str:
    """A full refresh's token: the DAG run and how often it was cleared. Every try of one run
    carries the same, so a retry resumes the refresh; a run cleared again with the switch on
    (a refresh backfill of an interval refreshed before) is a new refresh, reset again."""
    ti = context["ti"]
    clears = getattr(context.get("dag_run"), "clear_number", None) or 0
    return f"{attempt_id(ti.dag_id, ti.run_id, 0).removesuffix('-t0')}-c{clears}"


def later_try(coordinator_id: str | None, failed: str, try_number: int) -> str | None:
    """``coordinator_id`` when it is the attempt id of a later try of the same DAG run as
    ``failed`` (the attempt id of try ``try_number``), else None."""
    run = failed.removesuffix(f"-t{try_number}")
    if coordinator_id is None or not coordinator_id.startswith(f"{run}-t"):
        return None
    later = coordinator_id.removeprefix(f"{run}-t")
    return coordinator_id if later.isdigit() and int(later) > try_number else None


def run_started(context: Any) -> Any:
    """When the try's DAG run started (restores pick checkpoints completed since), or None."""
    dag_run = context.get("dag_run")
    return getattr(dag_run, "start_date", None) if dag_run is not None else None


#: the Spark provider's failure message carries spark-submit's exit code
_EXIT_CODE = re.compile(r"Error code is: (-?\d+)")


#: Spark's ``SparkExitCode.OOM``: a JVM whose uncaught-exception handler met an OutOfMemoryError
SPARK_OOM_EXIT_CODE = 52


def driver_ending(returncode: int | None, exc: BaseException) -> str:
    """How spark-submit (the driver, in client mode) ended, from its exit code (else the
    provider's message): a signal by name, else the exit code, else the exception's type."""
    if returncode is None and (found := _EXIT_CODE.search(str(exc))):
        returncode = int(found[1])
    if returncode is None:
        return f"failed ({type(exc).__name__})"
    signum = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    try:
        name = signal.Signals(signum).name if signum > 0 else None
    except ValueError:
        name = None
    if name is not None:
        return f"died of {name} (spark-submit exit code {returncode})"
    if returncode == SPARK_OOM_EXIT_CODE:
        return (
            f"ran out of memory (exit code {returncode}: an OutOfMemoryError reached Spark's "
            "uncaught-exception handler); raise spark.driver.memory (in local mode the executors' "
            "memory too) or lower the input per epoch"
        )
    return f"failed (exit code {returncode})"


def describe_failed_try(
    job_id: str,
    try_number: int,
    returncode: int | None,
    exc: BaseException,
    latest: Any,
    *,
    retries_left: bool,
    retry_parallelism: int,
) -> str:
    """The one line a failed try logs: how its driver ended, the job's last completed
    checkpoint (a :class:`checkpointing.metastore.outcome.CheckpointPoint`, None, or why it is
    unknown), and what the retry restores; epochs are counted as in the XCom (``epochs done``)."""
    if isinstance(latest, str):  # the metastore could not say
        last = latest
    elif latest is None:
        last = "no completed checkpoint"
    else:
        last = f"last completed {latest.describe()}"
    if not retries_left:
        then = "no retry left"
    elif isinstance(latest, str):
        then = f"the retry (try {try_number + 1}) restores the latest valid checkpoint"
    elif latest is None:
        then = f"the retry (try {try_number + 1}) starts empty with parallelism {retry_parallelism}"
    else:
        then = (
            f"the retry (try {try_number + 1}) restores checkpoint {latest.checkpoint_id} (or the "
            f"newest valid one before it), parallelism {retry_parallelism}"
        )
    ending = driver_ending(returncode, exc)
    return f"job {job_id}: try {try_number}: the Spark driver {ending}; {last}; {then}"


def failed_try_line(
    operator: Any, spec: Any, metastore: Any, try_number: int, exc: BaseException
) -> str:
    """One line for ``operator``'s failed try: how the driver ended, the last completed
    checkpoint, and what the retry restores (the lines above it are Spark's)."""
    from checkpointing.metastore.outcome import latest_completed
    from checkpointing_airflow.spark_submit_internals import submit_returncode

    try:
        latest = latest_completed(metastore, spec.job)
    except Exception as error:  # the metastore may be what failed: the line says so
        latest = f"last completed checkpoint unknown ({type(error).__name__})"
    return describe_failed_try(
        spec.job,
        try_number,
        submit_returncode(getattr(operator, "_hook", None)),
        exc,
        latest,
        retries_left=(operator.retries or 0) >= try_number,
        retry_parallelism=operator.parallelism_for(spec, try_number + 1),
    )
