"""One execution attempt's coordination lifetime: whoever runs an attempt of a job elsewhere (the
Airflow operator submitting a Spark application) is its checkpoint coordinator while it runs.

Flink's JobManager owns a ``CheckpointCoordinator`` per execution and its
``CheckpointCoordinatorDeActivator`` starts and stops periodic checkpointing as the job's status
changes. Here the attempt's process reports that status in the metastore, so the coordinator
follows it there: :func:`coordinate_attempt` takes over coordination (a dead predecessor's
pending checkpoints are aborted as coordinator failover), runs the coordinator loop while the
caller waits for the attempt, and on failure aborts what is pending as job failover, so that the
next attempt need not wait for it to expire.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

from checkpointing.clock import SystemClock
from checkpointing.config import CheckpointConfig
from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.coordinator_loop import CheckpointCoordinatorDeActivator
from checkpointing.coordination.pending import TaskSpec
from checkpointing.coordination.stats_tracker import CheckpointStatsTracker
from checkpointing.metastore import jobs
from checkpointing.metastore.engine import Metastore
from checkpointing.state.storage import CheckpointStorage
from checkpointing.status import JobStatus

log = logging.getLogger(__name__)


@contextmanager
def coordinate_attempt(
    job_id: str,
    metastore: Metastore,
    storage: CheckpointStorage,
    config: CheckpointConfig,
    *,
    attempt: str,
    tasks: Sequence[TaskSpec],
    poll: timedelta | float,
    failover_reason: str,
    stats_tracker: CheckpointStatsTracker | None = None,
) -> Iterator[CheckpointCoordinator]:
    """Be ``job_id``'s active coordinator, as ``attempt``, for the ``with`` block's duration.

    On entry the coordinator registers the job's ``config`` and ``storage`` and activates;
    its loop then runs every ``poll`` and follows the job's status: periodic checkpointing
    while the attempt reports RUNNING, each new checkpoint waiting for ``tasks`` (the
    attempt's subtasks, which exist only while it runs). An exception out of the block aborts
    the pending checkpoints with ``failover_reason`` (job failover, not counted as a checkpoint
    failure) and propagates; the loop is stopped in every case. A process that runs the job
    itself (``ckpt run``'s driver) reports the status directly instead and does not use this.

    :param attempt: the attempt id, used as the coordinator id: the attempt's own process acts
        under the same id (``CheckpointCoordinator.join``), so the two are one coordinator.
    :param stats_tracker: watches the attempt: started once the job is registered, polled after
        every pass of the loop and once more when the block ends (its last checkpoints, an
        exceeded ``tolerable_failures``); its failures are logged, never raised.
    """
    planned = list(tasks)

    def running_tasks() -> list[TaskSpec] | None:
        return planned if jobs.job_status(metastore, job_id) is JobStatus.RUNNING else None

    coordinator = CheckpointCoordinator(
        job_id, metastore, storage, config, coordinator_id=attempt, plan_provider=running_tasks
    )
    if stats_tracker is not None:
        _watch(stats_tracker.start)
    coordinator.activate()  # a dead predecessor's pending checkpoints: coordinator failover
    loop = CheckpointCoordinatorDeActivator(
        coordinator,
        poll,
        follow_job_status=True,
        name=f"ckpt-{job_id}",
        after_pass=None if stats_tracker is None else stats_tracker.poll,
    )
    loop.start()
    try:
        yield coordinator
    except BaseException:
        coordinator.failover(failover_reason)
        raise
    finally:
        loop.stop()
        if stats_tracker is not None:
            _watch(stats_tracker.poll)


def _watch(step: Callable[[], object]) -> None:
    """A step of the attempt's stats tracker: its failure (the metastore unreachable) is logged;
    the attempt's outcome is the job's, never the watch's."""
    try:
        step()
    except Exception:
        log.exception("checkpoint stats tracker failed")


def name_successor(
    metastore: Metastore,
    job_id: str,
    attempt: str,
    *,
    register: tuple[CheckpointConfig, str] | None = None,
) -> bool:
    """Name ``attempt`` the job's coordinator without taking over: from now on the previous
    coordinator (an earlier try's driver that may outlive its task) is fenced on every path,
    while its PENDING checkpoints stay as they are until ``attempt``'s own process activates
    (a step job salvages what they acknowledged first, :mod:`checkpointing.spark.step_salvage`).
    A job not registered yet is registered first with ``register`` (its configuration and
    storage URL), so that a first try's driver still starting when its task died is fenced
    too; without it, False (nothing to fence)."""
    with metastore.transaction() as s:
        job = jobs.lock_job(s, job_id)
        if job is None:
            if register is None:
                return False
            config, storage_url = register
            jobs.register_job(s, job_id, config, storage_url, SystemClock().now())
        jobs.update_job(s, job_id, coordinator_id=attempt)
    log.info("job %s: coordinator %s named; its predecessor is fenced", job_id, attempt)
    return True
