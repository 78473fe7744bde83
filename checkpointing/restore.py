"""Which checkpoint to restore from (Flink's ``restoreLatestCheckpointedState`` lookup).

Unlike Flink, a missing or corrupt latest checkpoint does not fail recovery: the lookup walks back
to the newest checkpoint whose ``_metadata`` and state files verify, and the restore event in the
metastore records what was skipped and why. No valid checkpoint means "start empty", or an error
in strict mode.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from checkpointing import store
from checkpointing.clock import Clock, SystemClock
from checkpointing.errors import (
    CorruptSnapshotError,
    NoCheckpointError,
    StorageError,
    UnknownCheckpointError,
    UnknownJobError,
)
from checkpointing.ids import validate_checkpoint_id, validate_id
from checkpointing.metadata import CheckpointMetadata, read_metadata, verify_handles
from checkpointing.metastore import Metastore
from checkpointing.models import Checkpoint, Job, RestoreEvent
from checkpointing.properties import CheckpointStatus, RestoreStatus
from checkpointing.storage import METADATA_FILE, CheckpointStorage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SkippedCheckpoint:
    checkpoint_id: int
    reason: str


@dataclass(frozen=True)
class RestoreDecision:
    """The checkpoint (or savepoint) to restore from, or None to start empty."""

    job_id: str
    checkpoint_id: int | None
    checkpoint_type: str | None
    metadata_path: str | None
    metadata: CheckpointMetadata | None
    skipped: list[SkippedCheckpoint] = field(default_factory=list)

    @property
    def start_empty(self) -> bool:
        return self.metadata is None

    def describe(self) -> str:
        if self.metadata is None:
            base = f"job {self.job_id}: no valid checkpoint, starting with empty state"
        else:
            kind = (self.checkpoint_type or "checkpoint").lower()
            base = (
                f"job {self.job_id}: restoring from {kind} {self.checkpoint_id} "
                f"({self.metadata_path})"
            )
        if self.skipped:
            base += "; skipped " + ", ".join(
                f"{s.checkpoint_id} ({s.reason})" for s in self.skipped
            )
        return base


def find_latest_valid(
    metastore: Metastore,
    storage: CheckpointStorage,
    job_id: str,
    *,
    prefer_checkpoint: bool | None = None,
    deep: bool = True,
    strict: bool = False,
) -> RestoreDecision:
    """The newest completed checkpoint or savepoint that verifies; falls back past broken ones.

    :param prefer_checkpoint: prefer the latest checkpoint over a newer savepoint (default: the
        job's ``prefer_checkpoint_for_recovery``).
    :param deep: verify state file checksums, not just sizes.
    :param strict: raise :class:`NoCheckpointError` instead of answering "start empty".
    """
    validate_id(job_id, "job id")
    with metastore.transaction() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise UnknownJobError(f"unknown job {job_id!r}")
        prefer = (
            job.prefer_checkpoint_for_recovery if prefer_checkpoint is None else prefer_checkpoint
        )
        candidates = [
            (c.checkpoint_id, c.checkpoint_type, c.metadata_path, c.metadata_checksum)
            for c in store.restore_candidates(s, job_id, prefer)
        ]
    skipped: list[SkippedCheckpoint] = []
    for checkpoint_id, ctype, path, checksum in candidates:
        try:
            metadata = _verified(storage, job_id, checkpoint_id, path, checksum, deep)
        except (StorageError, ValueError) as exc:
            reason = exc.reason if isinstance(exc, CorruptSnapshotError) else str(exc)
            where = exc.path if isinstance(exc, CorruptSnapshotError) else path
            log.warning(
                "job %s: checkpoint %d is not restorable (%s: %s)",
                job_id,
                checkpoint_id,
                where,
                reason,
            )
            skipped.append(SkippedCheckpoint(checkpoint_id, f"{where}: {reason}"))
            continue
        return RestoreDecision(job_id, checkpoint_id, ctype, path, metadata, skipped)
    if strict:
        detail = f" ({len(skipped)} unusable: {skipped[0].reason})" if skipped else ""
        raise NoCheckpointError(f"job {job_id} has no valid completed checkpoint{detail}")
    return RestoreDecision(job_id, None, None, None, None, skipped)


def load_checkpoint(
    metastore: Metastore,
    storage: CheckpointStorage,
    job_id: str,
    checkpoint_id: int,
    *,
    deep: bool = True,
) -> RestoreDecision:
    """A specific completed checkpoint or savepoint, verified; no fallback (the user chose it)."""
    checkpoint_id = validate_checkpoint_id(checkpoint_id)
    with metastore.transaction() as s:
        row = s.get(Checkpoint, (validate_id(job_id, "job id"), checkpoint_id))
        if row is None:
            raise UnknownCheckpointError(f"job {job_id} has no checkpoint {checkpoint_id}")
        if row.status != CheckpointStatus.COMPLETED:
            raise UnknownCheckpointError(
                f"checkpoint {checkpoint_id} of job {job_id} is {row.status}, not COMPLETED"
            )
        ctype, path, checksum = row.checkpoint_type, row.metadata_path, row.metadata_checksum
    metadata = _verified(storage, job_id, checkpoint_id, path, checksum, deep)
    return RestoreDecision(job_id, checkpoint_id, ctype, path, metadata)


def load_external(storage: CheckpointStorage, path: str, *, deep: bool = True) -> RestoreDecision:
    """A savepoint or retained checkpoint by path (its directory or its ``_metadata``), e.g. from
    another job or an older deployment."""
    path = path.rstrip("/")
    url = path if path.endswith("/" + METADATA_FILE) else f"{path}/{METADATA_FILE}"
    storage.check_target(url)
    metadata = read_metadata(storage, url)
    verify_handles(storage, metadata, deep=deep, roots=(url.rsplit("/", 1)[0],))
    return RestoreDecision(
        metadata.job_id, metadata.checkpoint_id, metadata.checkpoint_type, url, metadata
    )


def _verified(
    storage: CheckpointStorage,
    job_id: str,
    checkpoint_id: int,
    path: str | None,
    checksum: str | None,
    deep: bool,
) -> CheckpointMetadata:
    if not path:
        raise CorruptSnapshotError(f"checkpoint {checkpoint_id}", "no metadata path recorded")
    metadata = read_metadata(storage, path, checksum)
    if metadata.job_id != job_id or metadata.checkpoint_id != checkpoint_id:
        raise CorruptSnapshotError(
            path,
            f"belongs to {metadata.job_id}/{metadata.checkpoint_id}, not {job_id}/{checkpoint_id}",
        )
    directory = path.rsplit("/", 1)[0]
    roots = (directory, storage.shared_url(job_id))
    verify_handles(storage, metadata, deep=deep, roots=roots)
    return metadata


def record_restore(
    metastore: Metastore,
    decision: RestoreDecision,
    *,
    attempt: str,
    parallelism: int | None = None,
    assignment: dict[str, Any] | None = None,
    clock: Clock | None = None,
) -> int:
    """Write the restore event (which checkpoint, for which attempt, the assignment, fallbacks)."""
    clock = clock or SystemClock()
    with metastore.transaction() as s:
        event = RestoreEvent(
            job_id=decision.job_id,
            attempt=attempt,
            checkpoint_id=decision.checkpoint_id,
            checkpoint_type=decision.checkpoint_type,
            external_path=decision.metadata_path,
            parallelism=parallelism,
            assignment=assignment,
            fallbacks={
                "skipped": [
                    {"checkpoint_id": k.checkpoint_id, "reason": k.reason} for k in decision.skipped
                ]
            }
            if decision.skipped
            else None,
            status=RestoreStatus.EMPTY if decision.start_empty else RestoreStatus.PLANNED,
            message=decision.describe(),
            created_at=clock.now(),
        )
        s.add(event)
        s.flush()
        return event.restore_id
