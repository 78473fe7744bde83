"""Which checkpoint to restore from (Flink's ``restoreLatestCheckpointedState`` lookup).

Unlike Flink, a missing or corrupt latest checkpoint does not fail recovery: the lookup walks back
to the newest checkpoint whose ``_metadata`` and state files verify, and the restore event in the
metastore records what was skipped and why. No valid checkpoint means "start empty", or an error
in strict mode.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Any

from checkpointing.clock import Clock, SystemClock
from checkpointing.coordination import store
from checkpointing.errors import (
    CheckpointingError,
    CorruptSnapshotError,
    NoCheckpointError,
    StorageError,
    UnknownCheckpointError,
)
from checkpointing.ids import validate_checkpoint_id, validate_id
from checkpointing.metastore import jobs
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint, RestoreEvent
from checkpointing.restore.assignment import StateAssignment, plan_restore, snapshots_from_metadata
from checkpointing.state.metadata import CheckpointMetadata, read_metadata, verify_handles
from checkpointing.state.storage import METADATA_FILE, CheckpointStorage
from checkpointing.state.storage_roots import DisallowedStorageError, require_allowed
from checkpointing.status import CheckpointStatus, CheckpointType, RestoreStatus

log = logging.getLogger(__name__)


class ForeignSnapshotError(CheckpointingError):
    """A restore from another job's checkpoint or savepoint that was not asked for explicitly."""


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
    def from_job_id(self) -> str | None:
        """The job whose checkpoint or savepoint this is, when it is not ``job_id``: a restore
        from another job's state (which :func:`load_external` refuses unless allowed)."""
        if self.metadata is None or self.metadata.job_id == self.job_id:
            return None
        return self.metadata.job_id

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
            if self.from_job_id is not None:
                base += f" of another job, {self.from_job_id}"
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
    completed_after: datetime | None = None,
) -> RestoreDecision:
    """The newest completed checkpoint or savepoint that verifies; falls back past broken ones.

    :param prefer_checkpoint: prefer the latest checkpoint over a newer savepoint (default: the
        job's ``prefer_checkpoint_for_recovery``).
    :param deep: verify state file checksums, not just sizes.
    :param strict: raise :class:`NoCheckpointError` instead of answering "start empty".
    :param completed_after: only checkpoints completed at or after this time (a retry of a
        deployment from a savepoint must not jump to an older lineage's newer checkpoints).
    """
    validate_id(job_id, "job id")
    with metastore.transaction() as s:
        job = jobs.job_row(s, job_id)
        prefer = (
            job.prefer_checkpoint_for_recovery if prefer_checkpoint is None else prefer_checkpoint
        )
        floor = job.refresh_checkpoint_id or 0  # a full refresh: older ones are gone
        candidates = [
            (c.checkpoint_id, c.checkpoint_type, c.metadata_path, c.metadata_checksum)
            for c in store.restore_candidates(s, job_id, prefer)
            if c.checkpoint_id >= floor
            and (
                completed_after is None
                or (c.completed_at is not None and c.completed_at >= completed_after)
            )
        ]
    skipped: list[SkippedCheckpoint] = []
    #: state files found unusable: an older checkpoint sharing one (incremental checkpoints
    #: share their unchanged files) is refused at once, not read again
    bad: dict[str, str] = {}
    for checkpoint_id, ctype, path, checksum in candidates:
        try:
            metadata = _verified(storage, job_id, checkpoint_id, ctype, path, checksum, deep, bad)
        except (StorageError, ValueError) as exc:
            reason = exc.reason if isinstance(exc, CorruptSnapshotError) else str(exc)
            where = exc.path if isinstance(exc, CorruptSnapshotError) else path
            if isinstance(exc, CorruptSnapshotError) and where != path and where not in bad:
                bad[where] = f"{reason} (found verifying checkpoint {checkpoint_id})"
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
    metadata = _verified(storage, job_id, checkpoint_id, ctype, path, checksum, deep)
    return RestoreDecision(job_id, checkpoint_id, ctype, path, metadata)


def load_external(
    storage: CheckpointStorage,
    path: str,
    *,
    deep: bool = True,
    job_id: str | None = None,
    allow_other_job: bool = False,
) -> RestoreDecision:
    """A savepoint or retained checkpoint by path (its directory or its ``_metadata``), e.g. of
    an older deployment.

    Given ``job_id`` (the job that restores), the decision is that job's, and a checkpoint or
    savepoint of another job is refused with :class:`ForeignSnapshotError` unless
    ``allow_other_job``; when allowed, the decision names the other job (``from_job_id``, also
    in :meth:`RestoreDecision.describe`, which the restore event keeps as its message)."""
    path = path.rstrip("/")
    url = path if path.endswith("/" + METADATA_FILE) else f"{path}/{METADATA_FILE}"
    url = storage.check_target(url)  # a plain absolute path becomes a file:// URL
    # nothing vouches for a file given by path: a lower read limit than the job's own
    limit = min(storage.max_external_metadata_bytes, storage.max_metadata_bytes)
    metadata = read_metadata(storage, url, max_size=limit)
    foreign = job_id is not None and metadata.job_id != validate_id(job_id, "job id")
    if foreign and not allow_other_job:
        raise ForeignSnapshotError(
            f"{url} is {(metadata.checkpoint_type or 'checkpoint').lower()} "
            f"{metadata.checkpoint_id} of job {metadata.job_id}, not of job {job_id}: a "
            "restore from another job's state must be asked for explicitly (allow another "
            "job, e.g. --allow-other-job)"
        )
    directory = url.rsplit("/", 1)[0]
    roots = [directory]
    parent, _, name = directory.rpartition("/")
    if re.fullmatch(r"chk-[0-9]+", name):  # a retained incremental checkpoint: its job's shared/
        roots.append(f"{parent}/shared")
    verify_handles(storage, metadata, deep=deep, roots=tuple(roots))
    return RestoreDecision(
        job_id or metadata.job_id,
        metadata.checkpoint_id,
        metadata.checkpoint_type,
        url,
        metadata,
    )


def _verified(
    storage: CheckpointStorage,
    job_id: str,
    checkpoint_id: int,
    checkpoint_type: str | None,
    path: str | None,
    checksum: str | None,
    deep: bool,
    known_bad: Mapping[str, str] = MappingProxyType({}),
) -> CheckpointMetadata:
    """The row's ``_metadata``, read only where the ids say it lives (a row is anyone's to
    write): a checkpoint's under ``chk-<id>/``, a savepoint's under the job's
    ``savepoints/savepoint-<id>/`` or a target's ``savepoint-<id>/``; with the checksum
    completion recorded (none: not a completion's row)."""
    if not path:
        raise CorruptSnapshotError(f"checkpoint {checkpoint_id}", "no metadata path recorded")
    derived = {
        f"{storage.checkpoint_url(job_id, checkpoint_id)}/{METADATA_FILE}",
        f"{storage.savepoint_url(job_id, checkpoint_id)}/{METADATA_FILE}",
    }
    targeted = checkpoint_type == CheckpointType.SAVEPOINT and path.endswith(
        f"/savepoint-{checkpoint_id}/{METADATA_FILE}"
    )
    if path not in derived and not targeted:
        raise CorruptSnapshotError(
            path, f"not where checkpoint {checkpoint_id} of job {job_id} lives: not read"
        )
    if path not in derived and not storage.contains(path):
        try:  # a target's savepoint: only inside an allowed storage root (a row chose it)
            require_allowed(path, job_id=job_id, field=f"savepoint {checkpoint_id}'s _metadata")
        except DisallowedStorageError as exc:
            raise CorruptSnapshotError(path, f"{exc}: not read") from None
    if not checksum:
        raise CorruptSnapshotError(path, "no metadata checksum recorded: not read")
    metadata = read_metadata(storage, path, checksum)
    if metadata.job_id != job_id or metadata.checkpoint_id != checkpoint_id:
        raise CorruptSnapshotError(
            path,
            f"belongs to {metadata.job_id}/{metadata.checkpoint_id}, not {job_id}/{checkpoint_id}",
        )
    directory = path.rsplit("/", 1)[0]
    roots = (directory, storage.shared_url(job_id))
    verify_handles(storage, metadata, deep=deep, roots=roots, known_bad=known_bad)
    return metadata


def record_restore(
    metastore: Metastore,
    decision: RestoreDecision,
    *,
    attempt: str,
    parallelism: int | None = None,
    assignment: dict[str, Any] | None = None,
    status: RestoreStatus = RestoreStatus.PLANNED,
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
            status=RestoreStatus.EMPTY if decision.start_empty else status,
            message=decision.describe(),
            created_at=clock.now(),
        )
        s.add(event)
        s.flush()
        return event.restore_id


# ------------------------------------------------------------------------------- dry run


@dataclass(frozen=True)
class RestorePreview:
    """What a restore at ``parallelism`` would do, without doing it: the checkpoint the lookup
    picks (and what it skipped), and the state each new subtask would read.

    Nothing is recorded: the CLI's ``restore-plan`` and the UI show it before a rescale."""

    decision: RestoreDecision
    parallelism: int
    plan: StateAssignment

    @property
    def metadata(self) -> CheckpointMetadata:
        assert self.decision.metadata is not None
        return self.decision.metadata

    def subtasks(self) -> list[dict[str, Any]]:
        """Per new subtask, across operators: key groups, the old files (and groups) it reads,
        the bytes, and its operator list state items by operator."""
        keyed = {
            op.operator_id
            for op in self.metadata.operators
            if any(s.key_groups is not None for s in op.subtasks)
        }
        out = []
        for i in range(self.parallelism):
            key_groups = None
            reads: list[dict[str, Any]] = []
            lists: dict[str, list[dict[str, Any]]] = {}
            for op in self.plan.operators:
                sub = op.subtasks[i]
                if op.operator_id in keyed:
                    if key_groups is None:
                        key_groups = {"start": sub.key_groups.start, "end": sub.key_groups.end}
                    reads += [{"operator": op.operator_id, **r.to_dict()} for r in sub.reads]
                if op.list_mode is not None:
                    lists[op.operator_id] = [dict(item) for item in sub.list_state]
            out.append(
                {
                    "subtask": i,
                    "key_groups": key_groups,
                    "files": reads,
                    "bytes": sum(r["size"] for r in reads),
                    "list_state": lists,
                }
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly; ``plan`` is what the restore would record as its assignment."""
        d, m = self.decision, self.metadata
        return {
            "job_id": d.job_id,
            "dry_run": True,
            "checkpoint_id": d.checkpoint_id,
            "checkpoint_type": d.checkpoint_type,
            "metadata_path": d.metadata_path,
            "from_job_id": d.from_job_id,
            "completed_at": m.completed_at.isoformat(),
            "skipped": [{"checkpoint_id": s.checkpoint_id, "reason": s.reason} for s in d.skipped],
            "parallelism": self.parallelism,
            "operators": [
                {
                    "operator_id": op.operator_id,
                    "old_parallelism": op.old_parallelism,
                    "parallelism": op.parallelism,
                    "max_parallelism": op.max_parallelism,
                    "list_mode": op.list_mode,
                    "bytes": op.size,
                    "files": len(op.handle_urls),
                    "list_items": sum(len(s.list_state) for s in op.subtasks),
                }
                for op in self.plan.operators
            ],
            "bytes": self.plan.size,
            "subtasks": self.subtasks(),
            "plan": self.plan.to_dict(),
        }


def preview_restore(
    metastore: Metastore,
    storage: CheckpointStorage,
    job_id: str,
    *,
    parallelism: int,
    source: str = "latest",
    deep: bool = True,
    allow_other_job: bool = False,
) -> RestorePreview:
    """Dry run of a restore at ``parallelism``: the same lookup as the runtime's (``latest``
    falls back past corrupt checkpoints; an id or a path is taken as chosen) and the same state
    assignment, but no restore event is written and no state is loaded.

    The operators, their max parallelism and the new parallelism of every operator come from the
    checkpoint (the runtime runs every operator at one parallelism and keeps max parallelism).
    Raises :class:`UnknownJobError`, :class:`UnknownCheckpointError`, :class:`NoCheckpointError`
    or :class:`~checkpointing.restore.assignment.StateAssignmentError` (e.g. parallelism above max);
    a path to another job's checkpoint or savepoint raises :class:`ForeignSnapshotError` unless
    ``allow_other_job``.
    """
    source = source.strip()
    if source == "latest":
        decision = find_latest_valid(metastore, storage, job_id, deep=deep, strict=True)
    elif source.isdigit():
        jobs.require_job(metastore, job_id)  # the job named before its checkpoint
        decision = load_checkpoint(metastore, storage, job_id, int(source), deep=deep)
    elif "/" in source:
        decision = load_external(
            storage, source, deep=deep, job_id=job_id, allow_other_job=allow_other_job
        )
    else:
        raise UnknownCheckpointError(
            f"cannot restore job {job_id} from {source!r}: expected 'latest', a checkpoint id "
            "or a checkpoint/savepoint path"
        )
    assert decision.metadata is not None
    plan = plan_restore(
        snapshots_from_metadata(decision.metadata),
        [op.operator_id for op in decision.metadata.operators],
        new_parallelism=parallelism,
        max_parallelism={},  # every operator keeps its checkpointed max parallelism
    )
    return RestorePreview(decision, parallelism, plan)
