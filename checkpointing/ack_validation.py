"""Ack validation: what a task's acknowledgement may carry before it counts, and the clean-up of
the state files of acks that did not count.

An ack comes from an executor over the network; whatever is accepted here is written into the
``_metadata`` at completion (Flink checks the same at ``receiveAcknowledgeMessage``). A refused
ack declines its checkpoint; the files of refused, unknown or late acks are deleted, but only
where nothing recorded can reference them.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence

from pydantic import ValidationError
from sqlalchemy import select

from checkpointing.failure import CheckpointFailureReason
from checkpointing.metadata import subtask_handle
from checkpointing.metastore import Metastore
from checkpointing.models import Checkpoint, CheckpointAck
from checkpointing.pending import TaskAck
from checkpointing.status import CheckpointStatus
from checkpointing.storage import CheckpointStorage, StorageLocation

log = logging.getLogger(__name__)

#: bounds of what an ack may carry: the columns' limits (BIGINT, INTEGER, VARCHAR) and sanity; a
#: state file of a petabyte is a bug, and the bound keeps a checkpoint's total within BIGINT
MAX_STATE_SIZE = 1 << 50
MAX_MS = (1 << 31) - 1
MAX_HANDLE_LENGTH = 2048
_CHECKSUM = re.compile(r"sha256:[0-9a-f]{64}")


def ack_problem(
    ack: TaskAck, location: StorageLocation, roots: Sequence[str], storage: CheckpointStorage
) -> str | None:
    """Why ``ack`` must not count, or None. The restore lookup's rule applied at ack time: a
    handle lies inside its checkpoint's directory (or the job's shared state) and is not the
    ``_metadata``; sizes, times and the checksum are sane; the state descriptor is well formed.
    Anything accepted here can be written into ``_metadata`` at completion."""
    handle, size = ack.state_handle, ack.state_size
    if type(size) is not int or not 0 <= size <= MAX_STATE_SIZE:
        return f"state_size {size!r} is not a size in bytes (0 to {MAX_STATE_SIZE})"
    for name in ("sync_ms", "async_ms"):
        value = getattr(ack, name)
        if type(value) is not int or not 0 <= value <= MAX_MS:
            return f"{name} {value!r} is not a duration in ms (0 to {MAX_MS})"
    if ack.checksum is not None and (
        not isinstance(ack.checksum, str) or not _CHECKSUM.fullmatch(ack.checksum)
    ):
        return f"checksum {str(ack.checksum)[:80]!r} is not 'sha256:<64 hex digits>'"
    if handle is not None:
        if not isinstance(handle, str) or len(handle) > MAX_HANDLE_LENGTH:
            return f"state handle {str(handle)[:100]!r} is not a URL of at most 2048 characters"
        if not any(storage.contains(handle, root) for root in roots):
            return f"state handle {handle!r} is outside the checkpoint's directory {location.url}"
        if handle in (location.url, location.metadata_url):
            return f"state handle {handle!r} is the checkpoint's own directory or _metadata"
    elif size or ack.checksum is not None:
        return "state_size or checksum without a state handle"
    try:
        subtask_handle(0, ack.attempt_id, handle, size, ack.checksum, ack.state_meta)
        if "\\u0000" in json.dumps(ack.state_meta, allow_nan=False):  # PostgreSQL's JSON refuses
            raise ValueError("a NUL character")
    except (ValidationError, ValueError, TypeError, RecursionError) as exc:
        first = exc.errors()[0] if isinstance(exc, ValidationError) else None
        detail = f"{'.'.join(map(str, first['loc']))}: {first['msg']}" if first else str(exc)
        return f"state_meta is malformed ({detail})"
    return None


def discard_rejected_state(
    metastore: Metastore,
    storage: CheckpointStorage,
    job_id: str,
    checkpoint_id: int,
    acks: Sequence[TaskAck],
) -> list[str]:
    """Delete state files of UNKNOWN/DISCARDED acks — only inside the location of a checkpoint
    that is pending or was aborted (never completed, never after a metadata write of unknown
    outcome), never its ``_metadata``, and never a file a recorded ack references."""
    with metastore.transaction() as s:
        row = s.get(Checkpoint, (job_id, checkpoint_id))
        handles = [a.state_handle for a in acks if a.state_handle]
        # exclusive state lives in its own checkpoint's directory (shared state under
        # shared/ is never deleted here), so only this checkpoint's acks can reference it
        referenced = (
            set(
                s.scalars(
                    select(CheckpointAck.state_handle).where(
                        CheckpointAck.job_id == job_id,
                        CheckpointAck.checkpoint_id == checkpoint_id,
                        CheckpointAck.state_handle.in_(handles),
                    )
                )
            )
            if handles
            else set()
        )
    if row is None or row.status not in (CheckpointStatus.PENDING, CheckpointStatus.ABORTED):
        return []
    if row.failure_reason == CheckpointFailureReason.FINALIZE_CHECKPOINT_FAILURE:
        return []  # the metadata may exist: delete nothing (see complete_checkpoint)
    location = storage.location_for(row.storage_location)
    deleted = []
    for handle in handles:
        if handle in referenced or handle == location.metadata_url or not location.owns(handle):
            log.warning(
                "job %s: not deleting %s (referenced or outside %s)", job_id, handle, location.url
            )
            continue
        try:
            storage.delete(handle)
            deleted.append(handle)
        except Exception:
            log.exception("job %s: could not delete rejected state %s", job_id, handle)
    return deleted
