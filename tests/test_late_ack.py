"""Late acks after a takeover: coordinator B took over the job from A (``B.activate()`` aborted
A's pending checkpoint); an ack or decline for A's checkpoint that reaches B afterwards (a slow
task of A's attempt) is DISCARDED, its files deleted, as for any ack of an aborted checkpoint.
B is the job's coordinator and is not superseded: it must neither raise ``CoordinatorSuperseded``
nor stop working. A itself stays fenced (``test_fencing``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from checkpointing.clock import ManualClock
from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.failure import CheckpointFailureReason, CoordinatorSuperseded
from checkpointing.coordination.pending import AckResult, PendingCheckpoint, TaskAck
from checkpointing.metastore.engine import Metastore
from checkpointing.state.storage import FileSystemCheckpointStorage
from checkpointing.status import CheckpointStatus, JobStatus
from tests.helpers import (
    JOB,
    ack_all,
    ack_rows,
    checkpoint_row,
    complete,
    failures_count,
    job_row,
    make_plan,
    new_coordinator,
    path,
    snapshot,
)


@dataclass
class LateAck:
    old: CheckpointCoordinator
    new: CheckpointCoordinator
    orphan: PendingCheckpoint  # A's checkpoint, aborted by B's takeover


@pytest.fixture
def late(metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock) -> LateAck:
    old = new_coordinator(metastore, storage, clock)
    old.activate()
    orphan = old.trigger_checkpoint()
    new = new_coordinator(metastore, storage, clock, plan=make_plan(attempt="b"))
    assert new.activate() == [orphan.checkpoint_id]
    new.job_status_changed(JobStatus.RUNNING)
    return LateAck(old, new, orphan)


def test_a_late_ack_for_a_superseded_coordinators_checkpoint_is_discarded_by_the_active_one(
    metastore: Metastore, storage: FileSystemCheckpointStorage, late: LateAck
) -> None:
    row = checkpoint_row(metastore, late.orphan.checkpoint_id)
    assert (row.status, row.failure_reason) == (
        CheckpointStatus.ABORTED,
        CheckpointFailureReason.CHECKPOINT_COORDINATOR_FAILOVER,
    )
    # A's slow tasks write their snapshots after the takeover, then ack to B's driver
    acks = [snapshot(storage, late.orphan, t) for t in late.orphan.tasks]
    outcome = late.new.receive_acknowledge(late.orphan.checkpoint_id, acks)

    assert outcome.results == dict.fromkeys((a.attempt_id for a in acks), AckResult.DISCARDED)
    assert outcome.completed is None and outcome.refused == {}
    assert sorted(outcome.deleted_handles) == sorted(a.state_handle for a in acks)
    assert not any(path(storage, a.state_handle or "").exists() for a in acks)
    assert ack_rows(metastore, late.orphan.checkpoint_id) == []
    assert checkpoint_row(metastore, late.orphan.checkpoint_id).status == CheckpointStatus.ABORTED
    assert failures_count(metastore) == 0
    assert job_row(metastore).coordinator_id == late.new.coordinator_id

    # one at a time too (the runtime's acks arrive one by one)
    one = snapshot(storage, late.orphan, late.orphan.tasks[0])
    assert late.new.acknowledge_task(late.orphan.checkpoint_id, one) is AckResult.DISCARDED
    assert not path(storage, one.state_handle or "").exists()

    # B keeps working: its own checkpoint completes
    completed = complete(late.new)
    assert checkpoint_row(metastore, completed.checkpoint_id).status == CheckpointStatus.COMPLETED


def test_a_late_decline_or_refused_ack_for_a_superseded_coordinators_checkpoint_is_ignored(
    metastore: Metastore, storage: FileSystemCheckpointStorage, late: LateAck
) -> None:
    task = late.orphan.tasks[0]
    assert late.new.receive_decline(late.orphan.checkpoint_id, task.attempt_id, "late") is False
    refused = TaskAck(task.attempt_id, state_size=-1)
    outcome = late.new.receive_acknowledge(late.orphan.checkpoint_id, [refused])
    assert outcome.results == {task.attempt_id: AckResult.DISCARDED}
    assert task.attempt_id in outcome.refused
    row = checkpoint_row(metastore, late.orphan.checkpoint_id)
    assert row.failure_reason == CheckpointFailureReason.CHECKPOINT_COORDINATOR_FAILOVER
    assert failures_count(metastore) == 0
    assert ack_all(late.new, late.new.trigger_checkpoint()).completed is not None


def test_the_superseded_coordinator_is_still_fenced_and_named_as_such(
    metastore: Metastore, storage: FileSystemCheckpointStorage, late: LateAck
) -> None:
    pending = late.new.trigger_checkpoint()
    ack = snapshot(storage, pending, pending.tasks[0])
    superseded = f"coordinator {late.old.coordinator_id} of job {JOB} was superseded by " + (
        late.new.coordinator_id
    )
    with pytest.raises(CoordinatorSuperseded, match=superseded):
        late.old.receive_acknowledge(pending.checkpoint_id, [ack])
    with pytest.raises(CoordinatorSuperseded, match=superseded):
        late.old.receive_decline(pending.checkpoint_id, ack.attempt_id, "boom")
    assert ack_rows(metastore, pending.checkpoint_id) == []
    assert path(storage, ack.state_handle or "").exists()
    # A's own late ack: its checkpoint was aborted by the takeover, nothing counts
    own = snapshot(storage, late.orphan, late.orphan.tasks[0])
    assert late.old.acknowledge_task(late.orphan.checkpoint_id, own) is AckResult.DISCARDED
    assert ack_rows(metastore, late.orphan.checkpoint_id) == []
    assert checkpoint_row(metastore, pending.checkpoint_id).status == CheckpointStatus.PENDING
    assert ack_all(late.new, pending).completed is not None
