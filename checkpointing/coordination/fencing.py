"""Fencing of a superseded coordinator (the fencing token of Flink's leading ``JobMaster``).

The job row names the job's coordinator. Only it changes the job (trigger, status, stop,
failover, shutdown, requests, notifications); a coordinator superseded by a newer one changes
nothing of its successor's (acks, declines, expiry, completion), each checked in the transaction
that makes the change, with the job row locked so that a takeover waits for it. Processes that
only ack, decline or request (executors, the CLI) never activate and are not fenced: what they
touch is fenced by the checkpoint's owner instead. The coordinator that leads is never fenced:
a late ack or decline for a checkpoint of a coordinator it superseded is DISCARDED, as for any
aborted checkpoint (:meth:`CoordinatorFencing.refusal`).
"""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from checkpointing.coordination.failure import CoordinatorSuperseded
from checkpointing.metastore import jobs
from checkpointing.metastore.models import Job

log = logging.getLogger(__name__)


class CoordinatorFencing:
    """One coordinator's view of who leads its job; ``active`` once it activated (or joined)."""

    def __init__(self, job_id: str, coordinator_id: str, watcher: str | None = None) -> None:
        self.job_id = job_id
        self.coordinator_id = coordinator_id
        #: a try failing over for the detached driver recorded under ``coordinator_id`` (its
        #: own, or the one it re-attached to): superseded too once another try re-attached to
        #: that driver (the row's ``driver_watcher``)
        self.watcher = watcher
        self.active = False

    def lock_job(self, s: Session) -> Job | None:
        """The job row, locked until commit: a takeover (``activate``) waits for the caller's
        transaction, so a check made on the row holds for the change made after it."""
        return jobs.lock_job(s, self.job_id)

    def successor(self, job: Job | None) -> str | None:
        """The coordinator the job row names when it is not this one (an attempt that outlived
        its task, e.g. a Spark driver orphaned by a killed Airflow worker, was superseded by
        it), else None. A job that never had a coordinator fences nobody."""
        current = job.coordinator_id if job is not None else None
        if current is not None and current != self.coordinator_id:
            return current
        if job is None or self.watcher is None or job.driver_attempt != self.coordinator_id:
            return None  # no detached driver of this coordinator's recorded: no watcher to ask
        watcher = job.driver_watcher
        return watcher if watcher not in (None, self.watcher) else None

    def superseded(self, s: Session) -> CoordinatorSuperseded | None:
        """Lock the job row; the refusal to raise when another coordinator leads."""
        successor = self.successor(self.lock_job(s))
        if successor is None:
            return None
        return CoordinatorSuperseded(self.coordinator_id, self.job_id, successor)

    def fenced(self, s: Session, what: str, *, shared: bool = False) -> bool:
        """Lock the job row and tell whether this coordinator must leave the job alone.
        ``shared``: work any process may do for the current coordinator (expiry): refused only
        to a coordinator that activated and was superseded since."""
        successor = self.successor(self.lock_job(s))
        if successor is None or (shared and not self.active):
            return False
        log.warning(
            "job %s: %s refused: coordinator %s was superseded by %s",
            self.job_id,
            what,
            self.coordinator_id,
            successor,
        )
        return True

    def refusal(self, job: Job | None, owner: str | None) -> CoordinatorSuperseded | None:
        """The refusal to raise when this coordinator activated, was superseded since, and is
        asked to act (ack, decline) on a checkpoint that is not its own: that checkpoint is its
        successor's. None when it still leads: a checkpoint of a coordinator it superseded was
        aborted at the takeover, and an ack or decline arriving late for it is DISCARDED as for
        any aborted checkpoint (this one is not the superseded one)."""
        if not self.active or owner == self.coordinator_id:
            return None
        successor = self.successor(job)
        if successor is None:
            return None
        return CoordinatorSuperseded(self.coordinator_id, self.job_id, successor)

    def foreign(self, job: Job | None, owner: str | None) -> str | None:
        """Why this coordinator must not touch a checkpoint owned by ``owner`` (acks, declines,
        completion), else None: its owner is no longer the job's coordinator, or this one
        activated and then was superseded (its listeners and config are not the job's)."""
        current = job.coordinator_id if job is not None else None
        if current is not None and owner != current:
            return f"its coordinator {owner} was superseded by {current}"
        if self.active and owner != self.coordinator_id:
            return f"coordinator {self.coordinator_id} was superseded by {current or owner}"
        return None
