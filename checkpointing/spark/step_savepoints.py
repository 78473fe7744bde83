"""Savepoints of a step job (:mod:`checkpointing.spark.steps`), taken at step boundaries, and
restores from them.

A savepoint is requested from outside the running job as for a spec pipeline (the UI's
"Savepoint" button, the API's ``request_savepoint``, ``ckpt savepoint JOB``): a request row is
queued in the metastore (:mod:`checkpointing.coordination.savepoints`). A step job has no epoch
loop: its coordinator (:class:`StepCoordinator`) leaves the queue alone on each completion, and
the job takes the queue at each step boundary (:func:`take_requests`). Each savepoint request
becomes a checkpoint of kind SAVEPOINT (or SAVEPOINT_THEN_STOP) whose subtasks are the steps
the job holds at that boundary, each step's files **hard-linked** (else copied) into the
savepoint's own directory (``<job>/savepoints/savepoint-<id>/<step>/``), so that it is
self-contained as Flink's are: no
reference to the job's shared state, never subsumed, never discarded by retention, restorable
by path after the job's checkpoints are gone. Its ``_metadata`` has the shape of a step
checkpoint's (:func:`checkpointing.steps.plan.restored_steps` reads it). A stop-with-savepoint
ends the run with :class:`StoppedWithSavepoint`, which ``with checkpointed(...)`` turns into a
FINISHED job.

A restore from a savepoint (``restore=<path>``) reads and verifies it (:func:`load_savepoint`),
then, once the coordinator is active, adopts its steps (:func:`adopt`): a first checkpoint whose
files are the savepoint's linked into the job's shared state (Flink's NO_CLAIM restore mode: the
savepoint is never touched or referred to again), so that later step checkpoints can carry them.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Mapping, Sequence
from dataclasses import replace

from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.failure import (
    CheckpointException,
    CheckpointFailureReason,
    CoordinatorSuperseded,
)
from checkpointing.coordination.pending import PendingCheckpoint, TaskAck, TaskSpec
from checkpointing.coordination.request_queue import trigger_queued
from checkpointing.coordination.store import CompletedCheckpoint
from checkpointing.errors import (
    CheckpointingError,
    ConfigError,
    CorruptSnapshotError,
    InvalidIdError,
)
from checkpointing.restore.lookup import RestoreDecision, load_external
from checkpointing.spark.step_writer import file_checksum
from checkpointing.state.metadata import read_metadata
from checkpointing.state.storage import (
    METADATA_FILE,
    CheckpointStorage,
    FileSystemCheckpointStorage,
)
from checkpointing.status import CheckpointType
from checkpointing.steps.identity import operator_id
from checkpointing.steps.plan import StepFile, StepRecord, carried

log = logging.getLogger(__name__)


class StoppedWithSavepoint(CheckpointingError):
    """A stop-with-savepoint completed at a step boundary: the run ends here (``with
    checkpointed(...)`` ends the job FINISHED and swallows this); a later run resumes from
    ``location`` (``restore=location``)."""

    def __init__(self, checkpoint_id: int, location: str) -> None:
        super().__init__(f"stopped with savepoint {checkpoint_id}: {location}")
        self.checkpoint_id = checkpoint_id
        self.location = location


class StepCoordinator(CheckpointCoordinator):
    """A step job's coordinator. A spec pipeline's coordinator triggers queued requests after
    each completion, with its plan provider's tasks; a step job has none (a savepoint's tasks
    are the steps' files, known at a step boundary), so the queue waits for
    :func:`take_requests` instead of being failed there."""

    def process_requests(self) -> list[PendingCheckpoint]:
        return []


def take_requests(
    coordinator: CheckpointCoordinator, records: Sequence[StepRecord], run: str
) -> CompletedCheckpoint | None:
    """At a step boundary: take the job's queued requests (Flink's ``triggerQueuedRequests``,
    by priority), each savepoint one holding ``records`` (the steps the job holds now) with
    their files copied into it; the request follows it to COMPLETED or FAILED. Returns the
    stop-with-savepoint that completed, if one did (the run must end)."""

    def trigger(
        *,
        checkpoint_type: CheckpointType,
        forced: bool,
        target: str | None,
        request_id: int,
        periodic: bool,
    ) -> PendingCheckpoint:
        if not checkpoint_type.is_savepoint:
            raise CheckpointException(
                CheckpointFailureReason.TRIGGER_CHECKPOINT_FAILURE,
                "a step job checkpoints at every step; only savepoints are taken on request",
            )
        return _savepoint(
            coordinator, records, f"{run}-r{request_id}", checkpoint_type, target, request_id
        )

    trigger_queued(
        coordinator.metastore, coordinator.job_id, coordinator.fencing, coordinator.clock, trigger
    )
    return coordinator.stop_savepoint


def _savepoint(
    coordinator: CheckpointCoordinator,
    records: Sequence[StepRecord],
    prefix: str,
    checkpoint_type: CheckpointType,
    target: str | None,
    request_id: int,
) -> PendingCheckpoint:
    """Trigger one savepoint of ``records``, copy their files into it, acknowledge them all;
    a failure declines it (its directory is deleted, its request FAILED) and is raised as a
    :class:`CheckpointException` naming it."""
    subtasks = _subtasks(records, prefix)
    if not subtasks:
        raise CheckpointException(
            CheckpointFailureReason.NOT_ALL_REQUIRED_TASKS_RUNNING, "no completed step to save"
        )
    pending = coordinator.trigger_checkpoint(
        checkpoint_type=checkpoint_type,
        forced=True,
        target=target,
        tasks=[spec for spec, _, _ in subtasks],
        request_id=request_id,
    )
    storage, shared = coordinator.storage, coordinator.storage.shared_url(coordinator.job_id)
    try:
        acks = []
        for spec, record, f in subtasks:
            handle = None
            if f.handle is not None:
                # only the job's own step files (a record is this run's or a verified restore's)
                if not storage.contains(f.handle, shared):
                    raise CheckpointingError(f"{f.handle} is not in the job's shared state")
                handle = f"{pending.location}/{record.name}/{f.handle.rsplit('/', 1)[-1]}"
                _copy(storage, f, handle, link=True)
            acks.append(_ack(spec.attempt_id, record, f, handle))
        outcome = coordinator.receive_acknowledge(pending.checkpoint_id, acks)
        if outcome.completed is None:
            refused = next(iter(outcome.refused.values()), "it did not complete")
            raise CheckpointingError(f"the savepoint's acknowledgements: {refused}")
    except CoordinatorSuperseded:
        raise  # the job, and its requests, are another coordinator's
    except Exception as exc:  # a failed savepoint fails its request, never the job
        why = f"savepoint {pending.checkpoint_id} of the steps' files: {exc}"
        log.error("job %s: %s", coordinator.job_id, why)
        try:  # aborted: its directory deleted, its request FAILED
            coordinator.receive_decline(
                pending.checkpoint_id,
                subtasks[0][0].attempt_id,
                CheckpointFailureReason.IO_EXCEPTION,
                why,
            )
        except Exception:
            log.exception(
                "job %s: declining savepoint %d", coordinator.job_id, pending.checkpoint_id
            )
        raise CheckpointException(CheckpointFailureReason.IO_EXCEPTION, why) from exc
    log.info(
        "job %s: savepoint %d at the step boundary after %s: %s (steps %s)",
        coordinator.job_id,
        pending.checkpoint_id,
        [r.name for r in records][-1],
        pending.location,
        [r.name for r in records],
    )
    return pending


def _subtasks(
    records: Sequence[StepRecord], prefix: str
) -> list[tuple[TaskSpec, StepRecord, StepFile]]:
    """A subtask per step file, as a step checkpoint has them (its operator is its step)."""
    return [
        (
            TaskSpec(
                operator_id(record.name),
                f.partition,
                f"{prefix}-t{n}",
                record.parallelism,
                max(128, record.parallelism),
            ),
            record,
            f,
        )
        for n, (record, f) in enumerate(carried(records))
    ]


def _ack(attempt: str, record: StepRecord, f: StepFile, handle: str | None) -> TaskAck:
    return TaskAck(
        attempt,
        handle,
        f.size if handle else 0,
        f.checksum if handle else None,
        state_meta={"list_state": [record.item(f.partition)]},
    )


#: what a linked step file's mode loses: its write permissions, its read ones kept as they were
WRITE_BITS = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH


def _copy(storage: CheckpointStorage, f: StepFile, target: str, *, link: bool) -> None:
    """``f``'s bytes at ``target``: a hard link where the file system has one (``link``; a
    step file is never written again, and a link outlives the deletion of the job's own entry,
    so it is as self-contained as a copy), else a copy, checked against the recorded size and
    checksum."""
    assert f.handle is not None
    if isinstance(storage, FileSystemCheckpointStorage):
        source, path = storage.path_of(f.handle), storage.path_of(target)
        path.parent.mkdir(parents=True, exist_ok=True)
        if link:
            try:
                os.link(source, path)
                # one inode, two names: no longer writable, so that a write through the
                # savepoint's name cannot change the job's own step file (or the reverse)
                os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) & ~WRITE_BITS)
                return
            except OSError:
                pass
        shutil.copyfile(source, path)
        if file_checksum(storage, target) != (f.size, f.checksum):
            raise CheckpointingError(f"{target}: the copy differs from {f.handle}")
        return
    # an object store: its own copy, no byte through the driver
    storage.copy_file(f.handle, target, size=f.size, checksum=f.checksum)


# ---------------------------------------------------------------------------- restore


def load_savepoint(
    storage: CheckpointStorage, path: str, job: str, *, deep: bool = True
) -> RestoreDecision:
    """The savepoint (or retained checkpoint) at ``path`` (its directory or ``_metadata``, a
    path or a URL of the job's storage), verified; one line when it is another job's, before
    anything is written."""
    url = path.rstrip("/")
    url = url if url.endswith("/" + METADATA_FILE) else f"{url}/{METADATA_FILE}"
    try:
        url = storage.check_target(url)
        limit = min(storage.max_external_metadata_bytes, storage.max_metadata_bytes)
        owner = read_metadata(storage, url, max_size=limit).job_id
    except (ConfigError, InvalidIdError, CorruptSnapshotError, FileNotFoundError) as exc:
        # the path's fault (a retry reads the same): a storage error that may pass is raised
        # as it is
        raise ConfigError(f"restore {path}: not a savepoint of this storage ({exc})") from None
    if owner != job:
        raise ConfigError(
            f"restore {path}: a savepoint of job {owner}, not of job {job}: nothing restored, "
            "nothing written"
        )
    return load_external(storage, url, deep=deep, job_id=job)


def needs_adoption(
    decision: RestoreDecision, storage: CheckpointStorage, job: str, *, by_path: bool
) -> bool:
    """Whether the restored steps' files must become the job's own first: a savepoint's (never
    referred to by a checkpoint), or anything given by path (a retained checkpoint's files may
    no longer be registered by a completed checkpoint of the job)."""
    if decision.metadata is None:
        return False
    shared = storage.shared_url(job)
    return (
        by_path
        or decision.checkpoint_type != CheckpointType.CHECKPOINT
        or any(not storage.contains(f.handle, shared) for f in decision.metadata.files())
    )


def adopt(
    coordinator: CheckpointCoordinator, restored: Mapping[str, StepRecord], run: str
) -> dict[str, StepRecord]:
    """Make the restored steps the job's own: one checkpoint whose subtasks are their files,
    linked (else copied) into its ``shared/chk-<id>/<step>/``, registered as shared state when
    it completes; returns the records with their new files. The savepoint is left as it was."""
    records = list(restored.values())
    subtasks = _subtasks(records, f"{run}-adopt")
    if not subtasks:
        return dict(restored)
    pending = coordinator.trigger_checkpoint(tasks=[s for s, _, _ in subtasks], forced=True)
    storage = coordinator.storage
    own = storage.shared_checkpoint_url(coordinator.job_id, pending.checkpoint_id)
    acks, files = [], {}
    for spec, record, f in subtasks:
        handle = None
        if f.handle is not None:
            handle = f"{own}/{record.name}/{f.handle.rsplit('/', 1)[-1]}"
            _copy(storage, f, handle, link=True)
        acks.append(_ack(spec.attempt_id, record, f, handle))
        files.setdefault(record.name, []).append(replace(f, handle=handle))
    outcome = coordinator.receive_acknowledge(pending.checkpoint_id, acks)
    if outcome.completed is None:
        why = next(iter(outcome.refused.values()), "it did not complete")
        raise CheckpointingError(
            f"job {coordinator.job_id}: adopting the restored steps (checkpoint "
            f"{pending.checkpoint_id}): {why}"
        )
    log.info(
        "job %s: the restored steps %s are the job's checkpoint %d",
        coordinator.job_id,
        sorted(restored),
        pending.checkpoint_id,
    )
    return {r.name: replace(r, files=tuple(files.get(r.name, ()))) for r in records}
