"""From a task's ack to a completed checkpoint, or to an aborted one: the half of Flink's
``CheckpointCoordinator`` that handles task messages — ``receiveAcknowledgeMessage``,
``receiveDeclineMessage``, ``completePendingCheckpoint``, the ``CheckpointCanceller``'s expiry and
the completion notifications — as a collaborator the coordinator holds.

Flink keeps all of it in the coordinator, in one JobManager. Here every process that acks or
declines (Spark executors, the driver, the Airflow operator) runs it against the shared metastore,
and whoever's ack is the last one completes the checkpoint, exactly once:
``PendingCheckpoint.finalize`` builds the ``_metadata``, which is written → the row is marked
COMPLETED and older checkpoints are subsumed (``store.add``) → older pending ones are aborted →
completion listeners run (``notifications``) → ``on_completed`` (the coordinator then triggers
queued requests, Flink's ``triggerQueuedRequests``). The task-facing face of this class is
:class:`~checkpointing.coordination.gateway.CheckpointCoordinatorGateway`; trigger, scheduling and
the job's lifecycle are the coordinator's; deleting files is the
:class:`~checkpointing.coordination.cleaner.CheckpointsCleaner`'s; counting failures and failing
the job the :class:`~checkpointing.coordination.failure.CheckpointFailureManager`'s.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence

from sqlalchemy import select

from checkpointing.clock import Clock
from checkpointing.config import CheckpointConfig
from checkpointing.coordination import notifications, pending, request_queue, shared_state, store
from checkpointing.coordination.ack_validation import ack_problem
from checkpointing.coordination.acknowledge import acknowledge
from checkpointing.coordination.cleaner import CheckpointsCleaner
from checkpointing.coordination.failure import (
    CheckpointFailureManager,
    CheckpointFailureReason,
    TolerableFailuresExceeded,
    decline_reason,
)
from checkpointing.coordination.fencing import CoordinatorFencing
from checkpointing.coordination.gateway import AckOutcome
from checkpointing.coordination.notifications import CompletionListener, CompletionNotifier
from checkpointing.coordination.pending import AckResult, PendingCheckpoint, TaskAck
from checkpointing.coordination.store import CompletedCheckpoint
from checkpointing.errors import InvalidIdError, OutcomeUnknownError, StorageError
from checkpointing.ids import validate_checkpoint_id, validate_id
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint, Job
from checkpointing.state.metadata import CheckpointMetadata
from checkpointing.state.storage import CheckpointStorage, FileInfo, StorageLocation
from checkpointing.status import CheckpointType, RequestStatus

log = logging.getLogger(__name__)


class CompletionHandler:
    """Receives a job's acks and declines, expires overdue checkpoints, completes fully
    acknowledged ones and retries their notifications, for one coordinator (whose ``fencing``,
    ``failure_manager`` and ``cleaner`` it shares).

    :param on_completed: called after each completion by this process, once its listeners ran.
    """

    def __init__(
        self,
        job_id: str,
        metastore: Metastore,
        storage: CheckpointStorage,
        config: CheckpointConfig,
        *,
        coordinator_id: str,
        clock: Clock,
        fencing: CoordinatorFencing,
        failure_manager: CheckpointFailureManager,
        cleaner: CheckpointsCleaner,
        completion_listeners: Sequence[CompletionListener] = (),
        on_completed: Callable[[CompletedCheckpoint], None] | None = None,
    ) -> None:
        self.job_id = job_id
        self.metastore = metastore
        self.storage = storage
        self.config = config
        self.coordinator_id = coordinator_id
        self.clock = clock
        self.fencing = fencing
        self.failure_manager = failure_manager
        self.cleaner = cleaner
        self.notifier = CompletionNotifier(job_id, metastore, storage, clock, completion_listeners)
        self.on_completed = on_completed

    # ================================================================ acks and declines

    def receive_acknowledge(self, checkpoint_id: int, acks: Sequence[TaskAck]) -> AckOutcome:
        """Record a batch of task acks in one transaction; the caller whose ack is the last one
        completes the checkpoint. An ack that fails :func:`ack_validation.ack_problem` is never
        recorded: it declines its checkpoint (``outcome.refused`` says why). An ack for a
        checkpoint of a coordinator this one superseded is DISCARDED (that checkpoint was
        aborted at the takeover); one for its successor's raises ``CoordinatorSuperseded``."""
        checkpoint_id = validate_checkpoint_id(checkpoint_id)
        for a in acks:
            validate_id(a.attempt_id, "attempt id")
        with self.metastore.session(autocommit=True) as s, s.begin():
            row = s.execute(
                select(Checkpoint.coordinator_id, Checkpoint.storage_location).where(
                    Checkpoint.job_id == self.job_id, Checkpoint.checkpoint_id == checkpoint_id
                )
            ).one_or_none()
            # the owner never changes; only an activated coordinator acking another one's
            # checkpoint needs to know who leads (see CoordinatorFencing.refusal)
            other = row is not None and self.fencing.active and row[0] != self.coordinator_id
            job = s.get(Job, self.job_id) if other else None
        if row is None:
            return AckOutcome({a.attempt_id: AckResult.UNKNOWN for a in acks})
        owner, location_url = row
        refusal = self.fencing.refusal(job, owner)
        if refusal is not None:
            raise refusal
        try:  # a forged row's location: every ack is refused, and the checkpoint declined
            location: StorageLocation | None = self.storage.location_for(
                location_url, job_id=self.job_id, checkpoint_id=checkpoint_id
            )
            misplaced = None
        except (StorageError, InvalidIdError) as exc:
            location, misplaced = None, str(exc)
        shared = self.storage.shared_url(self.job_id)
        refused: dict[str, str] = {}
        for a in acks:
            problem = (
                misplaced if location is None else ack_problem(a, location, shared, self.storage)
            )
            if problem is not None:
                refused.setdefault(a.attempt_id, problem)
        declined: dict[str, AckResult] = {}
        if refused:  # decline first: the valid acks of the batch are then DISCARDED
            log.warning(
                "job %s: checkpoint %d: acks refused: %s", self.job_id, checkpoint_id, refused
            )
            self.expire_overdue()  # an overdue checkpoint expires rather than being declined
            declined, _ = self._decline(
                checkpoint_id,
                {a: f"ack refused: {p}" for a, p in refused.items()},
                CheckpointFailureReason.CHECKPOINT_DECLINED,
            )
        acks = [a for a in acks if a.attempt_id not in refused]
        now = self.clock.now()
        remaining = None
        results: dict[str, AckResult] = {}
        # on PostgreSQL both steps are single statements: run them as their own transactions
        with self.metastore.session(autocommit=True) as s:
            if acks:
                with s.begin():
                    results = acknowledge(s, self.job_id, checkpoint_id, acks, now)
            # SUCCESS: maybe ours was the last ack. DUPLICATE: maybe the last acker died before
            # completing and this is the task's retry; either way, count after the commit.
            if {AckResult.SUCCESS, AckResult.DUPLICATE} & set(results.values()):
                with s.begin():
                    remaining = pending.remaining_tasks(s, self.job_id, checkpoint_id)
        outcome = AckOutcome({**results, **declined}, refused=refused)
        rejected = [
            a for a in acks if results.get(a.attempt_id) in (AckResult.UNKNOWN, AckResult.DISCARDED)
        ]
        if rejected:
            outcome.deleted_handles = self.cleaner.discard_subtask_state(checkpoint_id, rejected)
            if any(results[a.attempt_id] is AckResult.DISCARDED for a in rejected):
                self.expire_overdue()
        if remaining == 0:
            outcome.completed = self.complete_checkpoint(checkpoint_id)
        return outcome

    def acknowledge_task(self, checkpoint_id: int, ack: TaskAck) -> AckResult:
        """One task's ack (:meth:`receive_acknowledge` of a batch of one)."""
        return self.receive_acknowledge(checkpoint_id, [ack]).results[ack.attempt_id]

    def receive_decline(
        self,
        checkpoint_id: int,
        attempt_id: str,
        reason: CheckpointFailureReason | str = CheckpointFailureReason.CHECKPOINT_DECLINED,
        message: str | None = None,
    ) -> bool:
        """A task could not (or need not) snapshot: abort the checkpoint with the task's reason,
        one of :data:`failure.DECLINE_REASONS` (Flink's ``DeclineCheckpoint``). Only the counted
        ones (a failed snapshot) count towards ``tolerable_failures``; a task that is not ready
        or closing declines without failing the job. A ``reason`` that names no reason at all is
        the message of a ``CHECKPOINT_DECLINED`` (callers from before reasons)."""
        checkpoint_id = validate_checkpoint_id(checkpoint_id)
        validate_id(attempt_id, "attempt id")
        if reason not in CheckpointFailureReason.__members__.values() and message is None:
            reason, message = CheckpointFailureReason.CHECKPOINT_DECLINED, str(reason)
        cause = decline_reason(reason)
        results, aborted = self._decline(checkpoint_id, {attempt_id: message or cause.value}, cause)
        if results[attempt_id] is AckResult.UNKNOWN:
            log.info(
                "job %s: decline of checkpoint %d from unknown attempt %s ignored",
                self.job_id,
                checkpoint_id,
                attempt_id,
            )
        return aborted

    def _decline(
        self, checkpoint_id: int, messages: dict[str, str], reason: CheckpointFailureReason
    ) -> tuple[dict[str, AckResult], bool]:
        """Abort a PENDING checkpoint for the first planned attempt of ``messages`` (attempt →
        why); whether it did. Per attempt: DISCARDED when planned (nothing of it counts), UNKNOWN
        when not in the plan (ignored, as Flink ignores such declines)."""
        now = self.clock.now()
        with self.metastore.transaction() as s:
            job = self.fencing.lock_job(s)  # the owner check holds until commit
            row = s.get(Checkpoint, (self.job_id, checkpoint_id))
            refusal = self.fencing.refusal(job, row.coordinator_id) if row is not None else None
            if refusal is not None:
                raise refusal
            foreign = row is None or self.fencing.foreign(job, row.coordinator_id) is not None
            results, aborted = pending.decline(
                s, self.job_id, checkpoint_id, messages, reason, now, may_abort=not foreign
            )
            failure = self.failure_manager.record_aborted(s, aborted, reason)
        self._after_abort(aborted, failure)
        return results, bool(aborted)

    def expire_overdue(self) -> list[int]:
        """Abort pending checkpoints past their deadline (Flink's canceller); counted. Any
        process may (an acker finding its checkpoint overdue), but not a superseded coordinator."""
        with self.metastore.transaction() as s:
            if self.fencing.fenced(s, "expiry", shared=True):
                return []
            aborted = pending.abort(
                s,
                self.job_id,
                CheckpointFailureReason.CHECKPOINT_EXPIRED,
                f"not completed within the timeout of {self.config.timeout}",
                self.clock.now(),
                overdue=True,
            )
            failure = self.failure_manager.record_aborted(
                s, aborted, CheckpointFailureReason.CHECKPOINT_EXPIRED
            )
        self._after_abort(aborted, failure)
        return [a.checkpoint_id for a in aborted]

    # ================================================================ completion

    def complete_checkpoint(self, checkpoint_id: int) -> CompletedCheckpoint | None:
        """Complete a fully acknowledged checkpoint; returns None if another caller does it (or
        it was aborted meanwhile). Order: ``_metadata`` → COMPLETED → subsume → abort older
        pending → notifications. Whatever fails after the completion claim aborts the
        checkpoint with ``FINALIZE_CHECKPOINT_FAILURE``: none is left PENDING and claimed."""
        token = f"{self.coordinator_id}/{uuid.uuid4().hex[:8]}"
        with self.metastore.transaction() as s:
            job = self.fencing.lock_job(s)  # with a takeover: the owner check holds for the claim
            owner = s.scalar(
                select(Checkpoint.coordinator_id).where(
                    Checkpoint.job_id == self.job_id, Checkpoint.checkpoint_id == checkpoint_id
                )
            )
            foreign = self.fencing.foreign(job, owner)
            if foreign is not None:
                log.warning(
                    "job %s: not completing checkpoint %d: %s", self.job_id, checkpoint_id, foreign
                )
                return None
            if pending.remaining_tasks(s, self.job_id, checkpoint_id) != 0:
                return None
            if not pending.claim_completion(s, self.job_id, checkpoint_id, token):
                return None
        now = self.clock.now()
        try:
            with self.metastore.transaction() as s:
                checkpoint = PendingCheckpoint.load(s, self.job_id, checkpoint_id)
                metadata = checkpoint.finalize(s, now)
            ctype = checkpoint.checkpoint_type
            # the row's location is anyone's to write: only where the ids (or an allowed
            # target) put it, else this checkpoint fails here and nothing is written
            location = self.storage.location_for(
                checkpoint.location, job_id=self.job_id, checkpoint_id=checkpoint_id
            )
            data = metadata.to_bytes()
        except Exception as exc:  # e.g. a recorded ack that no _metadata can hold
            log.exception("job %s: checkpoint %d: no metadata", self.job_id, checkpoint_id)
            self._abort_finalize(
                checkpoint_id, f"could not build the metadata: {exc}", dispose=True
            )
            return None
        try:
            info = self.storage.write_bytes(location.metadata_url, data, overwrite=False)
        except OutcomeUnknownError as exc:
            # the metadata may exist: abort, but delete nothing (Flink's PossibleInconsistentState)
            self._abort_finalize(
                checkpoint_id, f"metadata write outcome unknown: {exc}", dispose=False
            )
            return None
        except (StorageError, OSError) as exc:
            self._abort_finalize(checkpoint_id, f"could not write metadata: {exc}", dispose=True)
            return None
        except Exception as exc:  # not a storage error: its outcome is unknown
            self._abort_finalize(checkpoint_id, f"metadata write failed: {exc}", dispose=False)
            return None
        dirs = shared_state.SharedDirs.of(self.storage, self.job_id, checkpoint_id)
        written = shared_state.checkpointed_size(metadata, location.url, dirs)
        try:
            marked = self._mark_completed(
                checkpoint_id, token, ctype, metadata, info, dirs, written
            )
        except Exception as exc:
            log.exception("job %s: checkpoint %d: completion failed", self.job_id, checkpoint_id)
            try:  # aborts nothing if the COMPLETED row did commit
                self._abort_finalize(
                    checkpoint_id, f"could not record completion: {exc}", dispose=True
                )
            except Exception:
                log.exception("job %s: checkpoint %d: abort failed too", self.job_id, checkpoint_id)
            raise
        if marked is None:
            log.warning(
                "job %s: checkpoint %d was aborted while completing", self.job_id, checkpoint_id
            )
            self.cleaner.discard_metadata(location)
            return None
        disposals, older = marked
        self.cleaner.dispose(disposals, older)
        completed = CompletedCheckpoint(
            self.job_id,
            checkpoint_id,
            ctype,
            info.url,
            checkpoint.location,
            metadata.state_size,
            metadata,
            written,
        )
        log.info(
            "job %s: completed %s %d (%d bytes, %d written, %d tasks)%s",
            self.job_id,
            ctype.value.lower(),
            checkpoint_id,
            metadata.state_size,
            written,
            len(checkpoint.tasks),
            f", subsumed {[d.checkpoint_id for d in disposals]}" if disposals else "",
        )
        if self.notifier.listeners:
            self.notifier.notify(completed)
        if self.on_completed is not None:
            self.on_completed(completed)
        return completed

    def _mark_completed(
        self,
        checkpoint_id: int,
        token: str,
        ctype: CheckpointType,
        metadata: CheckpointMetadata,
        info: FileInfo,
        dirs: shared_state.SharedDirs,
        written: int,
    ) -> tuple[list[store.Disposal], list[pending.AbortedCheckpoint]] | None:
        """Steps 2 to 4 of completion in one transaction: COMPLETED (None if no longer ours to
        complete) with its shared files registered, subsume, abort older pending; returns what
        to delete after the commit."""
        now = metadata.completed_at
        with self.metastore.transaction() as s:
            self.fencing.lock_job(s)  # the job row before the checkpoint rows, as a takeover does
            added = store.add(
                s,
                self.job_id,
                checkpoint_id,
                token,
                metadata,
                info,
                self.config.retained,
                dirs,
                checkpointed_size=written,
            )
            if added is None:
                return None
            request_id, disposals = added
            self.failure_manager.reset(s)
            if request_id is not None:
                request_queue.finish(
                    s, request_id, RequestStatus.COMPLETED, now, checkpoint_id=checkpoint_id
                )
            # Flink 1.15+: a savepoint subsumes nothing, a stop-with-savepoint does
            older = (
                pending.abort(
                    s,
                    self.job_id,
                    CheckpointFailureReason.CHECKPOINT_SUBSUMED,
                    f"subsumed by completed {ctype.value.lower()} {checkpoint_id}",
                    now,
                    below_id=checkpoint_id,
                    include_savepoints=False,
                )
                if ctype is not CheckpointType.SAVEPOINT
                else []
            )
        return disposals, older

    def complete_fully_acknowledged(self) -> list[int]:
        """Complete PENDING checkpoints that have every ack but were never completed (the
        process that committed the last ack died before claiming completion)."""
        with self.metastore.transaction() as s:
            ids = pending.fully_acknowledged(s, self.job_id)
        return [i for i in ids if self.complete_checkpoint(i) is not None]

    def _abort_finalize(self, checkpoint_id: int, message: str, *, dispose: bool) -> None:
        with self.metastore.transaction() as s:
            aborted = pending.abort(
                s,
                self.job_id,
                CheckpointFailureReason.FINALIZE_CHECKPOINT_FAILURE,
                message,
                self.clock.now(),
                checkpoint_ids=[checkpoint_id],
            )
            failure = self.failure_manager.record_aborted(
                s, aborted, CheckpointFailureReason.FINALIZE_CHECKPOINT_FAILURE
            )
        log.error(
            "job %s: checkpoint %d failed to finalize: %s", self.job_id, checkpoint_id, message
        )
        self._after_abort(aborted, failure, dispose=dispose)

    def _after_abort(
        self,
        aborted: Sequence[pending.AbortedCheckpoint],
        failure: TolerableFailuresExceeded | None,
        *,
        dispose: bool = True,
    ) -> None:
        """After the commit that aborted them: delete their files (unless their ``_metadata``
        may exist), and fail the job past the failure threshold."""
        if dispose:
            self.cleaner.dispose(aborted=aborted)
        for a in aborted:
            log.warning("job %s: checkpoint %d aborted", self.job_id, a.checkpoint_id)
        if failure is not None:
            self.failure_manager.fail_job(failure)

    # ================================================================ notifications

    def notify_pending_completions(self) -> list[int]:
        """Re-run notifications of completed checkpoints whose hooks have not all succeeded
        (failed earlier, or completed by a process without the hooks). Oldest first."""
        if not self.notifier.listeners:
            return []
        with self.metastore.transaction() as s:
            if self.fencing.fenced(s, "notifications"):  # the successor's listeners commit them
                return []
            rows = notifications.unnotified(s, self.job_id)
        return self.notifier.retry(rows)
