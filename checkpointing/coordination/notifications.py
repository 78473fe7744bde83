"""Completion notifications (Flink's ``notifyCheckpointComplete``): where two-phase-commit sinks
commit.

A notification runs every listener, each retried, and records its success on the checkpoint row
(``notified_at``), so that it runs once per checkpoint; a failed one (or a checkpoint completed by
a process without the listeners, e.g. an executor's last ack) is re-run by the coordinator loop.
Listeners must still be idempotent: a restore may commit again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import tenacity
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from checkpointing.clock import Clock
from checkpointing.coordination.store import CompletedCheckpoint
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint
from checkpointing.state.metadata import read_metadata
from checkpointing.state.storage import CheckpointStorage
from checkpointing.status import CheckpointStatus

log = logging.getLogger(__name__)

#: A completion notification: called with the completed checkpoint (Flink's
#: ``notifyCheckpointComplete``); this is where two-phase-commit sinks commit.
CompletionListener = Callable[[CompletedCheckpoint], None]


def unnotified(session: Session, job_id: str) -> Sequence[Checkpoint]:
    """COMPLETED checkpoints whose notification has not succeeded yet, oldest first."""
    return session.scalars(
        select(Checkpoint)
        .where(
            Checkpoint.job_id == job_id,
            Checkpoint.status == CheckpointStatus.COMPLETED,
            Checkpoint.notified_at.is_(None),
        )
        .order_by(Checkpoint.checkpoint_id)
    ).all()


class CompletionNotifier:
    """Runs a coordinator's completion listeners, at most one notification per checkpoint at a
    time in this process (the completing thread and the loop's retry must not both commit)."""

    def __init__(
        self,
        job_id: str,
        metastore: Metastore,
        storage: CheckpointStorage,
        clock: Clock,
        listeners: Sequence[CompletionListener] = (),
    ) -> None:
        self.job_id = job_id
        self.metastore = metastore
        self.storage = storage
        self.clock = clock
        self.listeners = list(listeners)
        self._lock = threading.Lock()
        self._notifying: set[int] = set()

    def notify(self, completed: CompletedCheckpoint, *, recheck: bool = False) -> bool:
        """Run every listener; whether all succeeded. ``recheck``: skip it if it succeeded
        since the caller looked."""
        with self._lock:
            if completed.checkpoint_id in self._notifying:
                return False
            self._notifying.add(completed.checkpoint_id)
        try:
            if recheck:
                with self.metastore.transaction() as s:
                    row = s.get(Checkpoint, (self.job_id, completed.checkpoint_id))
                    if row is None or row.notified_at is not None:
                        return row is not None
            return self._run_listeners(completed)
        finally:
            with self._lock:
                self._notifying.discard(completed.checkpoint_id)

    def retry(self, rows: Sequence[Checkpoint]) -> list[int]:
        """Re-run the notifications of :func:`unnotified` rows; the ids that succeeded."""
        done = []
        for row in rows:
            assert row.metadata_path is not None
            metadata = read_metadata(self.storage, row.metadata_path, row.metadata_checksum)
            if self.notify(CompletedCheckpoint.of(row, metadata), recheck=True):
                done.append(row.checkpoint_id)
        return done

    def _run_listeners(self, completed: CompletedCheckpoint) -> bool:
        errors = []
        for listener in self.listeners:
            try:
                for attempt in tenacity.Retrying(
                    stop=tenacity.stop_after_attempt(3),
                    wait=tenacity.wait_exponential(multiplier=0.05, max=1),
                    reraise=True,
                ):
                    with attempt:
                        listener(completed)
            except Exception as exc:
                log.exception(
                    "job %s: completion notification for checkpoint %d failed",
                    self.job_id,
                    completed.checkpoint_id,
                )
                errors.append(f"{getattr(listener, '__name__', listener)!s}: {exc}")
        with self.metastore.transaction() as s:
            s.execute(
                update(Checkpoint)
                .where(
                    Checkpoint.job_id == self.job_id,
                    Checkpoint.checkpoint_id == completed.checkpoint_id,
                )
                .values(
                    notified_at=None if errors else self.clock.now(),
                    notify_error="; ".join(errors) or None,
                )
            )
        return not errors
