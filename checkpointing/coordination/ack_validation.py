"""Ack validation: what a task's acknowledgement may carry before it counts.

An ack comes from an executor over the network; whatever is accepted here is written into the
``_metadata`` at completion (Flink checks the same at ``receiveAcknowledgeMessage``). A refused
ack declines its checkpoint and its files are left alone (its handle is not trusted); the files
of unknown or late acks are deleted by
:meth:`~checkpointing.coordination.cleaner.CheckpointsCleaner.discard_subtask_state`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from checkpointing.coordination.pending import TaskAck
from checkpointing.state.metadata import ChainedFile, subtask_handle
from checkpointing.state.storage import CheckpointStorage, StorageLocation

#: bounds of what an ack may carry: the columns' limits (BIGINT, INTEGER, VARCHAR) and sanity; a
#: state file of a petabyte is a bug, and the bound keeps a checkpoint's total within BIGINT
MAX_STATE_SIZE = 1 << 50
MAX_MS = (1 << 31) - 1
MAX_HANDLE_LENGTH = 2048
_CHECKSUM = re.compile(r"sha256:[0-9a-f]{64}")


def ack_problem(
    ack: TaskAck, location: StorageLocation, shared: str, storage: CheckpointStorage
) -> str | None:
    """Why ``ack`` must not count, or None. The restore lookup's rule applied at ack time: a
    handle lies inside its checkpoint's directory (or ``shared``, the job's shared state) and is
    not the ``_metadata``; sizes, times and the checksum are sane; the state descriptor is well
    formed, and each file of its incremental ``chain`` lies under ``shared`` (an earlier
    checkpoint's shared file, never this checkpoint's private directory) with a sane size and
    checksum. Anything accepted here can be written into ``_metadata`` at completion."""
    roots = (location.url, shared)
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
    chain = ack.state_meta.get("chain") if isinstance(ack.state_meta, Mapping) else None
    for i, entry in enumerate(chain or []):
        problem = _chain_problem(entry, shared, storage)
        if problem is not None:
            return f"state_meta.chain[{i}] {problem}"
    return None


def _chain_problem(entry: Any, shared: str, storage: CheckpointStorage) -> str | None:
    """Why one chain entry (an earlier file the state builds on) must not count, or None; the
    entry's structure was validated with the descriptor already."""
    raw = entry.model_dump() if isinstance(entry, ChainedFile) else entry
    if not isinstance(raw, Mapping):
        return "is not an object"
    handle, size, checksum = raw.get("handle"), raw.get("size"), raw.get("checksum")
    if not isinstance(handle, str) or len(handle) > MAX_HANDLE_LENGTH:
        return f"handle {str(handle)[:100]!r} is not a URL of at most 2048 characters"
    if handle == shared or not storage.contains(handle, shared):
        return f"handle {handle[:200]!r} is outside the job's shared state {shared}"
    if type(size) is not int or not 0 <= size <= MAX_STATE_SIZE:
        return f"size {size!r} of {handle[:200]!r} is not a size in bytes (0 to {MAX_STATE_SIZE})"
    if checksum is not None and (
        not isinstance(checksum, str) or not _CHECKSUM.fullmatch(checksum)
    ):
        return (
            f"checksum {str(checksum)[:80]!r} of {handle[:200]!r} is not 'sha256:<64 hex digits>'"
        )
    return None
