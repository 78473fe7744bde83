"""Failure callbacks of :class:`~checkpointing_airflow.operators.CheckpointedSparkSubmitOperator`:
restore-from-latest with state reassignment, so that Airflow's retries resume.

``on_retry_callback``: the failed try's pending checkpoints are aborted (job failover, not
counted as checkpoint failures); the latest valid completed checkpoint of this run is found
(falling back past a corrupt one); its state is assigned to the next try's parallelism; the plan
is recorded in the metastore for the next try, which submits the job with it. Airflow runs
callbacks best-effort, so the retry recomputes the same plan when none was recorded.

``on_failure_callback`` (no retry left): the job is FAILED, its checkpoints are kept or
discarded per the retention policy, and the log names the checkpoint to resume from.

Callbacks may run late: after a killed worker, Airflow's dag-processor runs them some time after
the scheduler found the task without heartbeats, possibly when the retry is already running. A
callback of a try that a later try of the same run has superseded as coordinator does nothing: it
must not abort the running try's checkpoints or mark its job FAILED, and the retry has planned its
restore itself (its activation aborted the dead try's pending checkpoints as coordinator failover).
The callbacks act as the failed try's coordinator, so the metastore fences them in the very
transaction of each change: a try that takes over between the check here and the change still
wins (and a try that never coordinated the job changes nothing of another coordinator's).
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any

log = logging.getLogger(__name__)


def restore_from_latest(context: Any) -> None:
    """``on_retry_callback``: plan the next try's restore."""
    from checkpointing.restore.recovery import fail_attempt, plan_recovery
    from checkpointing_airflow.attempts import attempt_id, run_started

    task, ti = _rendered_task(context), context["ti"]
    if getattr(task, "pipeline", "") is None:  # a script: its retry's checkpointed takes over
        from checkpointing_airflow.script_submit import script_retry_callback

        return script_retry_callback(context, task)
    spec = task.load_spec()
    metastore = _metastore(task)
    failed = attempt_id(ti.dag_id, ti.run_id, ti.try_number)
    if _superseded(metastore, spec.job, failed, ti.try_number):
        return
    if _driver_lives(task, metastore, spec.job, failed):
        return
    acting = _acting_as(task, metastore, spec.job, failed)
    with _storage_access(task, spec):  # the failover discards aborted checkpoints' files
        fail_attempt(
            metastore,
            spec.job,
            f"try {ti.try_number} ({failed}) failed",
            final=False,
            coordinator_id=acting,
            # fenced, in the transaction, once a later try re-attached to this try's driver
            watcher=failed if getattr(task, "deferrable", False) else None,
            storage=_storage(task, spec),  # the task's, never the row's
        )
    if _superseded(metastore, spec.job, failed, ti.try_number):  # took over meanwhile
        return
    next_try = ti.try_number + 1
    with _storage_access(task, spec):
        plan = plan_recovery(
            metastore,
            _storage(task, spec),
            spec.job,
            attempt=attempt_id(ti.dag_id, ti.run_id, next_try),
            parallelism=task.parallelism_for(spec, next_try),
            max_parallelism=spec.max_parallelism,
            completed_after=run_started(context),
            otherwise=str(task.restore),
        )
    log.warning("failover: %s", plan.describe())


def job_failed(context: Any) -> None:
    """``on_failure_callback``: the last try failed; say where to resume from."""
    from checkpointing.restore.recovery import fail_attempt
    from checkpointing_airflow.attempts import attempt_id

    task, ti = _rendered_task(context), context["ti"]
    if getattr(task, "pipeline", "") is None:  # a script: its checkpoints stay for a rerun
        from checkpointing_airflow.script_submit import script_failed_callback

        return script_failed_callback(context, task)
    spec = task.load_spec()
    metastore = _metastore(task)
    failed = attempt_id(ti.dag_id, ti.run_id, ti.try_number)
    if _superseded(metastore, spec.job, failed, ti.try_number):
        return
    if _driver_lives(task, metastore, spec.job, failed):  # its own outcome is the job's: no
        return  # shutdown (retention) under it; a clear of the task re-attaches to it
    # a last try that had re-attached acts under the driver's id, as the retry callback does:
    # with its own id the fencing would refuse the shutdown and leave the job RUNNING
    acting = _acting_as(task, metastore, spec.job, failed)
    with _storage_access(task, spec):  # retention discards checkpoints in the storage
        info = fail_attempt(
            metastore,
            spec.job,
            f"try {ti.try_number} ({failed}) failed",
            final=True,
            coordinator_id=acting,
            watcher=failed if getattr(task, "deferrable", False) else None,
            storage=_storage(task, spec),
        )
    if info["resume_from"] is not None:
        log.error(
            "job %s failed after %d tries; resume it from checkpoint %s (%s): trigger the "
            "checkpoint_deploy DAG with from=%s, or `ckpt run %s --restore %s`",
            spec.job,
            ti.try_number,
            info["resume_from"],
            info["resume_path"],
            info["resume_path"],
            spec.spec_path,
            info["resume_from"],
        )
    else:
        log.error(
            "job %s failed after %d tries and has no retained checkpoint to resume from "
            "(retention policy discarded %s)",
            spec.job,
            ti.try_number,
            info["discarded"] or "none",
        )


def newer_coordinator(metastore: Any, job_id: str, failed: str, try_number: int) -> str | None:
    """The attempt id of a later try of the same DAG run that already coordinates the job, or
    watches its detached driver (re-attached: it acts under the driver's coordinator id),
    else None (``failed`` is the failed try's attempt id, ``<run>-<hash>-t<try>``)."""
    from checkpointing.coordination.drivers import read_state
    from checkpointing_airflow.attempts import later_try

    state = read_state(metastore, job_id)
    return later_try(state.coordinator_id, failed, try_number) or later_try(
        state.watcher, failed, try_number
    )


def _superseded(metastore: Any, job_id: str, failed: str, try_number: int) -> bool:
    newer = newer_coordinator(metastore, job_id, failed, try_number)
    if newer is not None:
        log.warning(
            "job %s: the callback of failed try %d (%s) ran after %s took over coordination; "
            "nothing to do (the running try planned its own restore)",
            job_id,
            try_number,
            failed,
            newer,
        )
    return newer is not None


def _storage(task: Any, spec: Any) -> Any:
    """The job's checkpoint storage as the task is configured (never the job row's URL, which
    any driver can write): what the callbacks discard in and restore from."""
    from checkpointing.state.storage import CheckpointStorage

    return CheckpointStorage.from_url(task.storage_for(spec))


def _storage_access(task: Any, spec: Any) -> AbstractContextManager[None]:
    """The checkpoint storage's credentials (the task's AWS, Google or Azure connection) in this
    process's environment while the callback reads or discards checkpoints there, as the try
    had them."""
    from checkpointing_airflow.aws_credentials import storage_environment
    from checkpointing_airflow.driver_secrets import process_environment

    url = task.storage_for(spec)
    credentials = getattr(task, "storage_credentials", None)
    env = credentials(url) if credentials else storage_environment(task.aws_conn_id, url)
    return process_environment(env)


def _driver_lives(task: Any, metastore: Any, job_id: str, failed: str) -> bool:
    """A deferrable try whose detached driver still runs: a retry (or a clear of the last try)
    re-attaches to it (:mod:`checkpointing_airflow.deferred`), so nothing is failed, shut down
    or restored under it."""
    if not getattr(task, "deferrable", False):
        return False
    from checkpointing_airflow.detached_driver import live_driver

    if not live_driver(metastore, job_id, failed, task.driver_heartbeat_timeout):
        return False
    log.warning(
        "job %s: try %s failed but its Spark driver is still running (or has finished): "
        "nothing is failed or restored under it (a retry, or a clear of the task, re-attaches "
        "to it)",
        job_id,
        failed,
    )
    return True


def _acting_as(task: Any, metastore: Any, job_id: str, failed: str) -> str:
    """The coordinator id the failed try acted under (a re-attached try: its driver's)."""
    if not getattr(task, "deferrable", False):
        return failed
    from checkpointing_airflow.detached_driver import acting_coordinator

    return acting_coordinator(metastore, job_id, failed)


def _rendered_task(context: Any) -> Any:
    """The task with its templated fields rendered for this run: the dag-processor hands a
    callback the task as the DAG file built it (``parallelism="{{ params.parallelism }}"``).
    Rendered on a copy, so the DAG bag's task stays as parsed for other runs' callbacks."""
    task = context["task"].prepare_for_execution()
    task.render_template_fields(context)
    return task


def _metastore(task: Any) -> Any:
    from checkpointing_airflow.hooks import open_metastore

    return open_metastore(task.metastore_url())
