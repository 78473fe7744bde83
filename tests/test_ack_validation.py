"""An ack is validated before it counts: the restore lookup's rule (every handle inside its
checkpoint's directory) and sane sizes, checksums and state descriptors, checked when the ack
arrives. A bad ack is never recorded and declines its checkpoint, so it can neither subsume the
last good checkpoint nor make completion fail after the completion claim."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from checkpointing.clock import ManualClock
from checkpointing.coordination.acknowledge import acknowledge
from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.failure import CheckpointFailureReason
from checkpointing.coordination.pending import AckResult, PendingCheckpoint, TaskAck
from checkpointing.coordination.store import CompletedCheckpoint
from checkpointing.metastore.engine import Metastore
from checkpointing.restore.lookup import find_latest_valid
from checkpointing.state.storage import FileSystemCheckpointStorage
from checkpointing.status import CheckpointStatus
from tests.helpers import (
    JOB,
    ack_rows,
    checkpoint_row,
    complete,
    location_exists,
    new_coordinator,
    snapshot,
)

R = CheckpointFailureReason


def _path(url: str) -> Path:
    return Path(url.removeprefix("file://"))


def _bad_handle(
    kind: str,
    storage: FileSystemCheckpointStorage,
    pending: PendingCheckpoint,
    good: CompletedCheckpoint,
    tmp_path: Path,
) -> str:
    """A file that exists, at a place no ack of ``pending`` may name as its state."""
    if kind == "dot-dot":  # the last good checkpoint's file, reached from this one's directory
        name = (good.metadata.handles()[0].handle or "").rsplit("/", 1)[1]
        return f"{pending.location}/../chk-{good.checkpoint_id}/{name}"
    if kind == "metadata":
        return f"{pending.location}/_metadata"
    if kind == "outside storage":
        path = tmp_path / "elsewhere" / "source-0.state"
        path.parent.mkdir()
        path.write_bytes(b"somebody's file")
        return path.as_uri()
    url = {
        "last good checkpoint": f"{good.location}/stolen.state",
        "another job": f"{storage.job_url('job-b')}/chk-7/source-0.state",
    }[kind]
    storage.write_bytes(url, b"not this checkpoint's state")
    return url


@pytest.mark.parametrize(
    "kind", ["dot-dot", "last good checkpoint", "another job", "outside storage", "metadata"]
)
def test_an_ack_naming_state_outside_its_checkpoint_is_refused_and_never_counted(
    kind: str,
    metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
    tmp_path: Path,
) -> None:
    coord = new_coordinator(metastore, storage, clock, retained=1, tolerable_failures=5)
    good = complete(coord)
    pending = coord.trigger_checkpoint()
    acks = [snapshot(storage, pending, t) for t in pending.tasks]
    handle = _bad_handle(kind, storage, pending, good, tmp_path)
    bad = dataclasses.replace(acks[-1], state_handle=handle)

    outcome = coord.receive_acknowledge(pending.checkpoint_id, [*acks[:-1], bad])

    assert outcome.completed is None
    assert bad.attempt_id in outcome.refused
    assert "checkpoint's" in outcome.refused[bad.attempt_id]
    assert outcome.results[bad.attempt_id] is AckResult.DISCARDED
    row = checkpoint_row(metastore, pending.checkpoint_id)
    assert (row.status, row.failure_reason) == (CheckpointStatus.ABORTED, R.CHECKPOINT_DECLINED)
    assert row.failure_message is not None and "ack refused: state handle" in row.failure_message
    assert bad.attempt_id not in {a.attempt_id for a in ack_rows(metastore, pending.checkpoint_id)}
    # the last good checkpoint is intact, on disk, and still what a restore finds
    assert checkpoint_row(metastore, good.checkpoint_id).status == CheckpointStatus.COMPLETED
    assert all(_path(h.handle or "").exists() for h in good.metadata.handles())
    assert find_latest_valid(metastore, storage, JOB).checkpoint_id == good.checkpoint_id
    if kind != "metadata":
        assert Path(os.path.normpath(_path(handle))).exists()  # nothing outside is deleted
    assert not location_exists(storage, pending.location)


def _raw(ack: TaskAck, **fields: Any) -> TaskAck:
    """``ack`` with ``fields`` set as a deserialised ack could carry them (no ``__post_init__``:
    what the coordinator receives is checked by the coordinator)."""
    raw = dataclasses.replace(ack)
    for name, value in fields.items():
        object.__setattr__(raw, name, value)
    return raw


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"state_size": -1}, "state_size -1 is not a size"),
        ({"state_size": 1 << 63}, "is not a size"),
        ({"state_size": "12"}, "is not a size"),
        ({"sync_ms": -5}, "sync_ms -5"),
        ({"checksum": "md5:abc"}, "checksum 'md5:abc' is not"),
        ({"checksum": "sha256:" + "0" * 200}, "is not 'sha256:<64 hex digits>'"),
        ({"state_meta": {"handle": "file:///etc/passwd"}}, "state_meta is malformed"),
        ({"state_meta": {"key_groups": [5, 1]}}, "state_meta is malformed"),
        ({"state_meta": ["key_groups"]}, "state_meta is malformed"),
        ({"state_meta": {"list_state": [{"offset": float("nan")}]}}, "state_meta is malformed"),
        ({"state_meta": {"list_state": [{"path": "a\x00b"}]}}, "state_meta is malformed"),
        ({"state_handle": None, "state_size": 10}, "without a state handle"),
    ],
)
def test_an_ack_with_a_bad_size_checksum_or_state_meta_is_refused_and_never_wedges(
    fields: dict[str, Any],
    why: str,
    metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
) -> None:
    coord = new_coordinator(metastore, storage, clock, tolerable_failures=5)
    good = complete(coord)
    pending = coord.trigger_checkpoint()
    acks = [snapshot(storage, pending, t) for t in pending.tasks]
    bad = _raw(acks[-1], **fields)

    outcome = coord.receive_acknowledge(pending.checkpoint_id, [*acks[:-1], bad])

    assert why in outcome.refused[bad.attempt_id]
    row = checkpoint_row(metastore, pending.checkpoint_id)
    assert (row.status, row.failure_reason) == (CheckpointStatus.ABORTED, R.CHECKPOINT_DECLINED)
    assert row.completing_by is None
    assert bad.attempt_id not in {a.attempt_id for a in ack_rows(metastore, pending.checkpoint_id)}
    # the task's retry with a good ack no longer counts either (DISCARDED, not a hang)
    assert coord.acknowledge_task(pending.checkpoint_id, acks[-1]) is AckResult.DISCARDED
    assert find_latest_valid(metastore, storage, JOB).checkpoint_id == good.checkpoint_id
    assert complete(coord).checkpoint_id == pending.checkpoint_id + 1


def test_a_completion_that_fails_after_its_claim_aborts_the_checkpoint(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    """An ack recorded without the coordinator's checks (an older version, a direct insert)
    cannot go into ``_metadata``: the completer aborts the checkpoint with a reason instead of
    leaving it PENDING and claimed until it expires."""
    coord = new_coordinator(metastore, storage, clock, tolerable_failures=5)
    pending = coord.trigger_checkpoint()
    acks = [snapshot(storage, pending, t) for t in pending.tasks]
    with metastore.transaction() as s:
        acknowledge(s, JOB, pending.checkpoint_id, [_raw(acks[0], state_size=-7)], clock.now())

    outcome = coord.receive_acknowledge(pending.checkpoint_id, acks[1:])

    assert outcome.completed is None
    row = checkpoint_row(metastore, pending.checkpoint_id)
    assert (row.status, row.failure_reason) == (
        CheckpointStatus.ABORTED,
        R.FINALIZE_CHECKPOINT_FAILURE,
    )
    assert row.failure_message is not None and "could not build the metadata" in row.failure_message
    assert not location_exists(storage, pending.location)
    acker = CheckpointCoordinator(JOB, metastore, clock=clock)
    assert acker.acknowledge_task(pending.checkpoint_id, acks[-1]) is AckResult.DISCARDED
