"""Acknowledgements, declines and expiry (Flink's ``receiveAcknowledgeMessage``,
``PendingCheckpoint.acknowledgeTask``, ``receiveDeclineMessage`` and the canceller)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from checkpointing.clock import ManualClock
from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.failure import CheckpointFailureReason, TolerableFailuresExceeded
from checkpointing.coordination.gateway import AckOutcome
from checkpointing.coordination.pending import AckResult, TaskAck
from checkpointing.coordination.store import CompletedCheckpoint
from checkpointing.metastore.engine import Metastore
from checkpointing.restore.lookup import find_latest_valid
from checkpointing.state.metadata import read_metadata
from checkpointing.state.storage import FileSystemCheckpointStorage
from checkpointing.status import CheckpointStatus
from tests.helpers import (
    JOB,
    ack_all,
    ack_rows,
    checkpoint_row,
    complete,
    failures_count,
    job_row,
    location_exists,
    make_plan,
    new_coordinator,
    snapshot,
)

R = CheckpointFailureReason
OLD_ATTEMPTS = make_plan(attempt="old")


def _exists(storage: FileSystemCheckpointStorage, url: str) -> bool:
    return storage.path_of(url).is_file()


def _race_acks(
    ackers: list[CheckpointCoordinator], checkpoint_id: int, slices: list[list[TaskAck]]
) -> tuple[list[AckOutcome], list[BaseException]]:
    """Each acker acks its slice in its own thread, all released at once."""
    outcomes: list[AckOutcome] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    barrier = threading.Barrier(len(ackers))

    def run(coord: CheckpointCoordinator, mine: list[TaskAck]) -> None:
        barrier.wait()
        try:
            result = coord.receive_acknowledge(checkpoint_id, mine)
        except BaseException as exc:  # pragma: no cover - reported by the caller
            with lock:
                errors.append(exc)
            return
        with lock:
            outcomes.append(result)

    threads = [
        threading.Thread(target=run, args=(c, s)) for c, s in zip(ackers, slices, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes, errors


# ================================================================ ack results


def test_ack_results_success_duplicate_and_unknown(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock)
    pending = coord.trigger_checkpoint()
    task = pending.tasks[0]
    ack = snapshot(storage, pending, task)

    assert coord.acknowledge_task(pending.checkpoint_id, ack) is AckResult.SUCCESS
    assert coord.acknowledge_task(pending.checkpoint_id, ack) is AckResult.DUPLICATE
    assert _exists(storage, ack.state_handle or "")  # a duplicate never deletes the state

    # an attempt that is not in the plan (an attempt from before a failover)
    old = snapshot(storage, pending, OLD_ATTEMPTS[0])
    outcome = coord.receive_acknowledge(pending.checkpoint_id, [old])
    assert outcome.results == {old.attempt_id: AckResult.UNKNOWN}
    assert outcome.deleted_handles == [old.state_handle]
    assert not _exists(storage, old.state_handle or "")

    [recorded] = ack_rows(metastore, pending.checkpoint_id)
    assert (recorded.attempt_id, recorded.state_handle, recorded.state_size, recorded.checksum) == (
        task.attempt_id,
        ack.state_handle,
        ack.state_size,
        ack.checksum,
    )
    assert recorded.acked_at == clock.now()
    assert checkpoint_row(metastore, pending.checkpoint_id).status == CheckpointStatus.PENDING


def test_ack_for_an_unknown_checkpoint_is_unknown(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock)
    outcome = coord.receive_acknowledge(99, [TaskAck("source-0-a0")])
    assert outcome.results == {"source-0-a0": AckResult.UNKNOWN}
    assert outcome.completed is None and outcome.deleted_handles == []


def test_ack_after_abort_is_discarded_and_its_state_deleted(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, tolerable_failures=5)
    pending = coord.trigger_checkpoint()
    first, second = pending.tasks[0], pending.tasks[1]
    assert coord.receive_decline(pending.checkpoint_id, first.attempt_id, "out of memory")

    # the slower task finishes writing after the abort and acks
    late = snapshot(storage, pending, second)
    outcome = coord.receive_acknowledge(pending.checkpoint_id, [late])
    assert outcome.results == {second.attempt_id: AckResult.DISCARDED}
    assert outcome.deleted_handles == [late.state_handle]
    assert not _exists(storage, late.state_handle or "")
    assert ack_rows(metastore, pending.checkpoint_id) == []
    assert failures_count(metastore) == 1  # the decline only


def test_rejected_acks_never_delete_files_outside_the_location_or_referenced_by_an_ack(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, tolerable_failures=5)
    done = complete(coord)
    done_files = [h.handle for h in done.metadata.handles()]
    pending = coord.trigger_checkpoint()
    recorded = snapshot(storage, pending, pending.tasks[0])
    assert coord.acknowledge_task(pending.checkpoint_id, recorded) is AckResult.SUCCESS
    shared = storage.write_bytes(f"{storage.shared_url(JOB)}/blob-1", b"shared state")
    old = OLD_ATTEMPTS[0].attempt_id

    rogue = [
        TaskAck(old, done_files[0], 1),  # a completed checkpoint's state (another location)
        TaskAck(OLD_ATTEMPTS[1].attempt_id, recorded.state_handle, recorded.state_size),
        TaskAck(OLD_ATTEMPTS[2].attempt_id, shared.url, shared.size),
    ]
    outcome = coord.receive_acknowledge(pending.checkpoint_id, rogue)
    assert set(outcome.results.values()) == {AckResult.UNKNOWN}
    assert outcome.deleted_handles == []
    for a in rogue:
        assert _exists(storage, a.state_handle or "")

    # the same after the checkpoint expired (DISCARDED acks)
    clock.advance(timedelta(minutes=11))
    outcome = coord.receive_acknowledge(
        pending.checkpoint_id,
        [TaskAck(pending.tasks[1].attempt_id, done_files[1], 1)],
    )
    assert outcome.results == {pending.tasks[1].attempt_id: AckResult.DISCARDED}
    assert outcome.deleted_handles == []
    assert all(_exists(storage, f or "") for f in done_files)
    assert _exists(storage, shared.url)
    assert read_metadata(storage, done.metadata_path).checkpoint_id == done.checkpoint_id


def test_a_rejected_ack_never_deletes_a_completed_checkpoints_metadata(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock)
    done = complete(coord)

    # a stale or buggy task names the checkpoint's own _metadata as its state
    outcome = coord.receive_acknowledge(
        done.checkpoint_id, [TaskAck(OLD_ATTEMPTS[0].attempt_id, done.metadata_path, 1)]
    )

    assert outcome.results == {OLD_ATTEMPTS[0].attempt_id: AckResult.UNKNOWN}
    assert outcome.deleted_handles == []
    assert _exists(storage, done.metadata_path)
    assert find_latest_valid(metastore, storage, JOB).checkpoint_id == done.checkpoint_id


def test_a_batch_of_acks_is_classified_per_task_and_completes(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock)
    pending = coord.trigger_checkpoint()
    acks = [snapshot(storage, pending, t) for t in pending.tasks]
    assert coord.acknowledge_task(pending.checkpoint_id, acks[0]) is AckResult.SUCCESS
    old = snapshot(storage, pending, OLD_ATTEMPTS[0])

    outcome = coord.receive_acknowledge(pending.checkpoint_id, [*acks, old])

    assert outcome.results == {
        acks[0].attempt_id: AckResult.DUPLICATE,
        acks[1].attempt_id: AckResult.SUCCESS,
        acks[2].attempt_id: AckResult.SUCCESS,
        old.attempt_id: AckResult.UNKNOWN,
    }
    assert outcome.deleted_handles == [old.state_handle]
    assert outcome.completed is not None
    assert len(ack_rows(metastore, pending.checkpoint_id)) == 3
    assert checkpoint_row(metastore, pending.checkpoint_id).status == CheckpointStatus.COMPLETED

    # acks for a completed checkpoint: planned ones are duplicates, others unknown
    again = coord.receive_acknowledge(pending.checkpoint_id, [acks[1], old])
    assert again.results == {
        acks[1].attempt_id: AckResult.DUPLICATE,
        old.attempt_id: AckResult.UNKNOWN,
    }
    assert again.completed is None


def test_a_batch_repeating_the_last_ack_still_completes(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock)
    pending = coord.trigger_checkpoint()
    acks = [snapshot(storage, pending, t) for t in pending.tasks]
    coord.receive_acknowledge(pending.checkpoint_id, acks[:-1])

    outcome = coord.receive_acknowledge(pending.checkpoint_id, [acks[-1], acks[-1]])

    assert len(ack_rows(metastore, pending.checkpoint_id)) == 3
    assert outcome.completed is not None, outcome
    assert checkpoint_row(metastore, pending.checkpoint_id).status == CheckpointStatus.COMPLETED


def test_exactly_one_of_many_concurrent_ackers_completes(
    metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the ackers take the storage the job row names, which must be a configured root
    monkeypatch.setenv("CKPT_STORAGE_ROOTS", storage.base_url)
    plan = make_plan({"source": 8, "window": 4, "sink": 4})
    owner = new_coordinator(metastore, storage, clock, plan=plan)
    notified: list[int] = []
    lock = threading.Lock()

    def listener(c: CompletedCheckpoint) -> None:
        with lock:
            notified.append(c.checkpoint_id)

    # the ackers are other processes: each has its own coordinator object for the job
    ackers = [
        CheckpointCoordinator(JOB, metastore, clock=clock, completion_listeners=[listener])
        for _ in range(8)
    ]
    for _round in range(3):
        pending = owner.trigger_checkpoint()
        acks = [snapshot(storage, pending, t) for t in pending.tasks]
        slices = [acks[i::8] for i in range(8)]
        outcomes, errors = _race_acks(ackers, pending.checkpoint_id, slices)

        assert errors == []
        assert all(set(o.results.values()) == {AckResult.SUCCESS} for o in outcomes)
        completed = [o.completed for o in outcomes if o.completed is not None]
        assert len(completed) == 1
        assert completed[0].checkpoint_id == pending.checkpoint_id
        assert len(completed[0].metadata.handles()) == 16
        assert checkpoint_row(metastore, pending.checkpoint_id).status == (
            CheckpointStatus.COMPLETED
        )
    assert notified == [1, 2, 3]


# ================================================================ declines


def test_decline_aborts_with_the_tasks_reason_disposes_and_counts(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    failures: list[TolerableFailuresExceeded] = []
    coord = new_coordinator(metastore, storage, clock, tolerable_failures=1, failures=failures)
    pending = coord.trigger_checkpoint()
    written = snapshot(storage, pending, pending.tasks[0])
    coord.acknowledge_task(pending.checkpoint_id, written)
    task = pending.tasks[1]
    clock.advance(3)

    assert coord.receive_decline(pending.checkpoint_id, task.attempt_id, "disk quota exceeded")

    row = checkpoint_row(metastore, pending.checkpoint_id)
    assert row.status == CheckpointStatus.ABORTED
    assert row.failure_reason == R.CHECKPOINT_DECLINED
    assert row.failure_message is not None and "disk quota exceeded" in row.failure_message
    assert task.attempt_id in row.failure_message
    assert row.ended_at == clock.now()
    assert not location_exists(storage, pending.location)
    assert not _exists(storage, written.state_handle or "")
    assert failures_count(metastore) == 1
    assert failures == []  # 1 failure is tolerated

    # a second decline of the same checkpoint changes nothing
    assert not coord.receive_decline(pending.checkpoint_id, pending.tasks[2].attempt_id, "late")
    assert failures_count(metastore) == 1


def test_decline_from_an_unknown_attempt_is_ignored(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock)
    pending = coord.trigger_checkpoint()

    assert not coord.receive_decline(pending.checkpoint_id, OLD_ATTEMPTS[0].attempt_id, "old")
    assert not coord.receive_decline(42, pending.tasks[0].attempt_id, "no such checkpoint")

    row = checkpoint_row(metastore, pending.checkpoint_id)
    assert (row.status, row.failure_reason) == (CheckpointStatus.PENDING, None)
    assert location_exists(storage, pending.location)
    assert failures_count(metastore) == 0
    assert ack_all(coord, pending).completed is not None


# ================================================================ expiry


def test_overdue_checkpoint_expires_and_late_acks_are_discarded(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    failures: list[TolerableFailuresExceeded] = []
    coord = new_coordinator(
        metastore, storage, clock, timeout="30s", tolerable_failures=1, failures=failures
    )
    pending = coord.trigger_checkpoint()
    early = snapshot(storage, pending, pending.tasks[0])
    coord.acknowledge_task(pending.checkpoint_id, early)

    clock.advance(timedelta(seconds=30) - timedelta(milliseconds=1))
    assert coord.expire_overdue() == []
    clock.advance(timedelta(milliseconds=1))
    assert coord.expire_overdue() == [pending.checkpoint_id]
    assert coord.expire_overdue() == []

    row = checkpoint_row(metastore, pending.checkpoint_id)
    assert (row.status, row.failure_reason) == (CheckpointStatus.ABORTED, R.CHECKPOINT_EXPIRED)
    assert row.ended_at == pending.deadline_at
    assert not location_exists(storage, pending.location)
    assert failures_count(metastore) == 1

    late = snapshot(storage, pending, pending.tasks[1])
    outcome = coord.receive_acknowledge(pending.checkpoint_id, [late])
    assert outcome.results == {late.attempt_id: AckResult.DISCARDED}
    assert not _exists(storage, late.state_handle or "")
    assert failures_count(metastore) == 1
    assert failures == []


def test_run_once_expires_and_an_ack_past_the_deadline_is_discarded(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, timeout="30s", tolerable_failures=5)
    first = coord.trigger_checkpoint(forced=True)
    second = coord.trigger_checkpoint(forced=True)
    clock.advance(31)

    # an ack past the deadline, before any expiry ran: discarded, and the expiry happens
    late = snapshot(storage, second, second.tasks[0])
    outcome = coord.receive_acknowledge(second.checkpoint_id, [late])
    assert outcome.results == {late.attempt_id: AckResult.DISCARDED}
    assert not _exists(storage, late.state_handle or "")
    assert checkpoint_row(metastore, second.checkpoint_id).failure_reason == R.CHECKPOINT_EXPIRED

    third = coord.trigger_checkpoint(forced=True)
    clock.advance(31)
    coord.run_once()
    for p in (first, second, third):
        row = checkpoint_row(metastore, p.checkpoint_id)
        assert (row.status, row.failure_reason) == (
            CheckpointStatus.ABORTED,
            R.CHECKPOINT_EXPIRED,
        )
        assert not location_exists(storage, p.location)
    assert job_row(metastore).consecutive_failures == 3


def _last_acker_dies_before_completing(
    metastore: Metastore, coord: CheckpointCoordinator, clock: ManualClock
) -> tuple[int, list[TaskAck]]:
    """Every ack committed, as by a process that died right after its commit."""
    from checkpointing.coordination import acknowledge as pending_rows

    pending = coord.trigger_checkpoint()
    acks = [snapshot(coord.storage, pending, t) for t in pending.tasks]
    with metastore.transaction() as s:
        results = pending_rows.acknowledge(s, JOB, pending.checkpoint_id, acks, clock.now())
    assert set(results.values()) == {AckResult.SUCCESS}
    assert checkpoint_row(metastore, pending.checkpoint_id).status == CheckpointStatus.PENDING
    return pending.checkpoint_id, acks


def test_a_retried_last_ack_completes_a_checkpoint_whose_acker_died(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock)
    checkpoint_id, acks = _last_acker_dies_before_completing(metastore, coord, clock)

    outcome = coord.receive_acknowledge(checkpoint_id, acks[-1:])  # the task retries its ack

    assert outcome.results == {acks[-1].attempt_id: AckResult.DUPLICATE}
    assert outcome.completed is not None and outcome.completed.checkpoint_id == checkpoint_id
    assert checkpoint_row(metastore, checkpoint_id).status == CheckpointStatus.COMPLETED


def test_the_coordinator_loop_completes_fully_acknowledged_checkpoints(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock)
    checkpoint_id, _ = _last_acker_dies_before_completing(metastore, coord, clock)
    partial = coord.trigger_checkpoint(forced=True)  # not fully acked: must stay pending
    coord.receive_acknowledge(partial.checkpoint_id, [snapshot(storage, partial, partial.tasks[0])])

    coord.run_once()

    assert checkpoint_row(metastore, checkpoint_id).status == CheckpointStatus.COMPLETED
    assert read_metadata(storage, checkpoint_row(metastore, checkpoint_id).metadata_path or "")
    assert checkpoint_row(metastore, partial.checkpoint_id).status == CheckpointStatus.PENDING
