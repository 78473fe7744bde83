"""Triggering: pre-checks, the request queue, checkpoint ids, the PENDING row, failed triggers
(Flink's ``triggerCheckpoint`` / ``preCheckBeforeTriggeringCheckpoint`` /
``CheckpointRequestDecider``)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from checkpointing.clock import ManualClock
from checkpointing.coordination import request_queue as decider
from checkpointing.coordination.failure import (
    CheckpointException,
    CheckpointFailureReason,
    TolerableFailuresExceeded,
)
from checkpointing.coordination.pending import TaskSpec
from checkpointing.errors import StorageError
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint, CheckpointRequest
from checkpointing.state.storage import FileSystemCheckpointStorage, StorageLocation
from checkpointing.status import (
    CheckpointStatus,
    CheckpointType,
    JobStatus,
    RequestStatus,
)
from tests.helpers import (
    JOB,
    Plan,
    ack_all,
    checkpoint_row,
    checkpoint_rows,
    complete,
    failures_count,
    job_row,
    location_exists,
    make_plan,
    new_coordinator,
    request_rows,
    statuses,
    task_rows,
)

R = CheckpointFailureReason


def _reason(exc_info: pytest.ExceptionInfo[CheckpointException]) -> CheckpointFailureReason:
    return exc_info.value.reason


# ================================================================ pre-checks


def test_trigger_after_shutdown_fails_with_coordinator_shutdown(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock)
    coord.shutdown(JobStatus.FINISHED)

    for trigger in (coord.trigger_checkpoint, coord.trigger_savepoint):
        with pytest.raises(CheckpointException) as exc:
            trigger()
        assert _reason(exc) is R.COORDINATOR_SHUTDOWN
    with pytest.raises(CheckpointException) as exc:
        coord.trigger_checkpoint(forced=True)
    assert _reason(exc) is R.COORDINATOR_SHUTDOWN
    assert checkpoint_rows(metastore) == []
    assert job_row(metastore).next_checkpoint_id == 1
    assert failures_count(metastore) == 0


def test_periodic_trigger_while_scheduling_is_off_fails(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, interval="1s")

    with pytest.raises(CheckpointException) as exc:
        coord.trigger_checkpoint(periodic=True)
    assert _reason(exc) is R.PERIODIC_SCHEDULER_SHUTDOWN
    assert checkpoint_rows(metastore) == []

    # a manual trigger is not affected
    pending = coord.trigger_checkpoint()
    assert checkpoint_row(metastore, pending.checkpoint_id).status == CheckpointStatus.PENDING
    assert failures_count(metastore) == 0


def test_only_one_non_forced_request_may_be_queued(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, max_concurrent=5)
    first = coord.request(CheckpointType.CHECKPOINT, requested_by="ui")

    with pytest.raises(CheckpointException) as exc:
        coord.request(CheckpointType.CHECKPOINT, requested_by="cli")
    assert _reason(exc) is R.ALREADY_QUEUED
    with pytest.raises(CheckpointException) as exc:
        coord.trigger_checkpoint()
    assert _reason(exc) is R.ALREADY_QUEUED
    assert checkpoint_rows(metastore) == []
    assert [(r.request_id, r.status) for r in request_rows(metastore)] == [
        (first, RequestStatus.QUEUED)
    ]

    # forced requests and savepoints may still be queued and triggered
    coord.request(CheckpointType.CHECKPOINT, requested_by="cli", forced=True)
    coord.request(CheckpointType.SAVEPOINT, requested_by="ui")
    assert coord.trigger_checkpoint(forced=True).checkpoint_id == 1
    assert len(request_rows(metastore)) == 3
    assert failures_count(metastore) == 0


def test_too_many_concurrent_queues_the_request_until_the_pending_one_completes(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, max_concurrent=1)
    first = coord.trigger_checkpoint()

    with pytest.raises(CheckpointException) as exc:
        coord.trigger_checkpoint()
    assert _reason(exc) is R.TOO_MANY_CONCURRENT_CHECKPOINTS
    assert [r.status for r in checkpoint_rows(metastore)] == [CheckpointStatus.PENDING]
    queued = request_rows(metastore)
    assert [(r.status, r.checkpoint_type, r.forced) for r in queued] == [
        (RequestStatus.QUEUED, CheckpointType.CHECKPOINT, False)
    ], "the refused request must be queued (Flink: triggerRequestQueued = true)"

    # still pending: processing the queue does not trigger it
    assert coord.process_requests() == []

    assert ack_all(coord, first).completed is not None
    triggered = coord.process_requests()
    assert [p.checkpoint_id for p in triggered] == [2]
    request = request_rows(metastore)[0]
    assert (request.status, request.checkpoint_id) == (RequestStatus.TRIGGERED, 2)
    assert checkpoint_row(metastore, 2).request_id == request.request_id

    assert ack_all(coord, triggered[0]).completed is not None
    request = request_rows(metastore)[0]
    assert request.status == RequestStatus.COMPLETED
    assert request.finished_at == clock.now()
    assert failures_count(metastore) == 0


def test_racing_triggers_never_exceed_max_concurrent(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, max_concurrent=2)
    barrier = threading.Barrier(8)
    refused: list[CheckpointFailureReason] = []
    errors: list[BaseException] = []

    def run() -> None:
        barrier.wait()
        try:
            coord.trigger_checkpoint()
        except CheckpointException as exc:
            refused.append(exc.reason)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert errors == []
    rows = checkpoint_rows(metastore)
    assert len(rows) == 2
    assert {r.status for r in rows} == {CheckpointStatus.PENDING}
    assert len(refused) == 6
    assert set(refused) <= {R.TOO_MANY_CONCURRENT_CHECKPOINTS, R.ALREADY_QUEUED}
    # refused triggers leave no storage location behind
    on_disk = sorted(p.name for p in storage.path_of(storage.job_url(JOB)).iterdir())
    assert on_disk == sorted(f"chk-{r.checkpoint_id}" for r in rows)
    assert failures_count(metastore) == 0


def test_min_pause_is_measured_from_the_last_completion(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, interval="1h", min_pause="10s")
    coord.start_scheduler()  # the min pause holds back periodic triggers (test_flink_semantics)
    pending = coord.trigger_checkpoint(periodic=True)
    clock.advance(8)  # the checkpoint takes 8s
    ack_all(coord, pending)
    completed_at = clock.now()
    assert job_row(metastore).last_completion_at == completed_at

    clock.advance(5)  # 13s after the trigger, only 5s after the completion
    with pytest.raises(CheckpointException) as exc:
        coord.trigger_checkpoint(periodic=True)
    assert _reason(exc) is R.MINIMUM_TIME_BETWEEN_CHECKPOINTS
    assert len(checkpoint_rows(metastore)) == 1
    assert failures_count(metastore) == 0

    clock.advance(timedelta(seconds=5) - timedelta(milliseconds=1))
    with pytest.raises(CheckpointException) as exc:
        coord.trigger_checkpoint(periodic=True)
    assert _reason(exc) is R.MINIMUM_TIME_BETWEEN_CHECKPOINTS

    clock.advance(timedelta(milliseconds=1))  # exactly min_pause after the completion
    assert coord.trigger_checkpoint(periodic=True).checkpoint_id == 2


def test_forced_checkpoints_and_savepoints_bypass_every_limit(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, max_concurrent=1, min_pause="1h")
    complete(coord)  # the min pause now runs for an hour
    coord.request(CheckpointType.CHECKPOINT, requested_by="ui")  # a queued request

    with pytest.raises(CheckpointException) as exc:
        coord.trigger_checkpoint()
    assert _reason(exc) is R.ALREADY_QUEUED

    forced = coord.trigger_checkpoint(forced=True)  # queued request + min pause
    savepoint = coord.trigger_savepoint()  # + max concurrent reached
    forced_again = coord.trigger_checkpoint(forced=True)
    rows = {r.checkpoint_id: r for r in checkpoint_rows(metastore)}
    for p in (forced, savepoint, forced_again):
        assert rows[p.checkpoint_id].status == CheckpointStatus.PENDING
        assert rows[p.checkpoint_id].forced is True
    assert rows[savepoint.checkpoint_id].checkpoint_type == CheckpointType.SAVEPOINT
    assert failures_count(metastore) == 0


def test_queue_triggers_savepoint_then_forced_then_manual(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, max_concurrent=10)
    manual = coord.request(CheckpointType.CHECKPOINT, requested_by="cli")
    clock.advance(1)
    forced = coord.request(CheckpointType.CHECKPOINT, requested_by="cli", forced=True)
    clock.advance(1)
    savepoint = coord.request(CheckpointType.SAVEPOINT, requested_by="ui")

    triggered = coord.process_requests()

    assert [(p.checkpoint_id, p.checkpoint_type) for p in triggered] == [
        (1, CheckpointType.SAVEPOINT),
        (2, CheckpointType.CHECKPOINT),
        (3, CheckpointType.CHECKPOINT),
    ]
    by_id = {r.request_id: r for r in request_rows(metastore)}
    assert by_id[savepoint].checkpoint_id == 1
    assert by_id[forced].checkpoint_id == 2
    assert by_id[manual].checkpoint_id == 3
    assert {r.status for r in by_id.values()} == {RequestStatus.TRIGGERED}
    assert checkpoint_row(metastore, 2).forced is True
    assert checkpoint_row(metastore, 3).forced is False


def test_queue_triggers_savepoint_and_forced_before_a_queued_periodic_request(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, max_concurrent=10, interval="1m")
    with metastore.transaction() as s:
        periodic = decider.enqueue(
            s,
            JOB,
            CheckpointType.CHECKPOINT,
            requested_by="timer",
            now=clock.now(),
            periodic=True,
        ).request_id
    clock.advance(1)
    forced = coord.request(CheckpointType.CHECKPOINT, requested_by="cli", forced=True)
    clock.advance(1)
    savepoint = coord.request(CheckpointType.SAVEPOINT, requested_by="ui")

    coord.process_requests()

    by_id = {r.request_id: r.checkpoint_id for r in request_rows(metastore)}
    assert [by_id[savepoint], by_id[forced], by_id[periodic]] == [1, 2, 3]


def test_request_order_is_savepoint_forced_manual_periodic_then_time(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    # A manual and a periodic request cannot both be queued through the API (ALREADY_QUEUED),
    # so the order of the queue itself is checked on rows written directly.
    new_coordinator(metastore, storage, clock)
    start = clock.now()
    kinds = [  # oldest first, lowest priority first
        ("periodic", CheckpointType.CHECKPOINT, False, True),
        ("manual", CheckpointType.CHECKPOINT, False, False),
        ("forced", CheckpointType.CHECKPOINT, True, False),
        ("savepoint-late", CheckpointType.SAVEPOINT, True, False),
    ]
    with metastore.transaction() as s:
        for i, (name, ctype, forced, periodic) in enumerate(kinds):
            s.add(
                CheckpointRequest(
                    job_id=JOB,
                    checkpoint_type=ctype.value,
                    forced=forced,
                    periodic=periodic,
                    priority=decider.priority(ctype, forced=forced, periodic=periodic),
                    requested_by=name,
                    requested_at=start + timedelta(seconds=10 - i),
                    status=RequestStatus.QUEUED,
                )
            )
        s.add(
            CheckpointRequest(
                job_id=JOB,
                checkpoint_type=CheckpointType.SAVEPOINT.value,
                forced=True,
                periodic=False,
                priority=decider.priority(CheckpointType.SAVEPOINT, forced=True, periodic=False),
                requested_by="savepoint-early",
                requested_at=start,
                status=RequestStatus.QUEUED,
            )
        )
    with metastore.transaction() as s:
        order = [r.requested_by for r in decider.next_requests(s, JOB)]
    assert order == ["savepoint-early", "savepoint-late", "forced", "manual", "periodic"]


# ================================================================ ids


def test_checkpoint_ids_strictly_increase_and_are_never_reused(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    plan = Plan(make_plan())
    coord = new_coordinator(metastore, storage, clock, plan=plan, tolerable_failures=10)
    ids = [complete(coord).checkpoint_id, coord.trigger_savepoint().checkpoint_id]
    # a failed trigger consumes its id
    plan.tasks = [*make_plan(), make_plan()[0]]  # duplicate task: the insert fails
    with pytest.raises(CheckpointException):
        coord.trigger_checkpoint(forced=True)
    plan.tasks = make_plan()
    ids.append(coord.trigger_checkpoint(forced=True).checkpoint_id)
    assert ids == [1, 2, 4]
    assert job_row(metastore).next_checkpoint_id == 5


def test_checkpoint_ids_are_unique_across_racing_coordinators_and_threads(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coords = [new_coordinator(metastore, storage, clock, max_concurrent=1000) for _ in range(2)]
    per_thread: list[list[int]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)
    lock = threading.Lock()

    def run(coord_index: int) -> None:
        mine: list[int] = []
        barrier.wait()
        try:
            for _ in range(5):
                mine.append(coords[coord_index].trigger_checkpoint().checkpoint_id)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        with lock:
            per_thread.append(mine)

    threads = [threading.Thread(target=run, args=(i % 2,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert errors == []
    all_ids = [i for ids in per_thread for i in ids]
    assert sorted(all_ids) == list(range(1, 41))
    for ids in per_thread:
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
    rows = checkpoint_rows(metastore)
    assert [r.checkpoint_id for r in rows] == list(range(1, 41))
    assert {r.coordinator_id for r in rows} == {c.coordinator_id for c in coords}
    assert job_row(metastore).next_checkpoint_id == 41


# ================================================================ the PENDING row


def test_pending_row_records_every_task_the_deadline_and_the_location(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    plan = make_plan({"source": 3, "map": 2, "sink": 1})
    coord = new_coordinator(metastore, storage, clock, plan=plan, timeout="90s")
    clock.advance(42)
    pending = coord.trigger_checkpoint()

    row = checkpoint_row(metastore, pending.checkpoint_id)
    assert row.status == CheckpointStatus.PENDING
    assert row.checkpoint_type == CheckpointType.CHECKPOINT
    assert row.trigger_at == clock.now() == pending.trigger_at
    assert row.deadline_at == clock.now() + timedelta(seconds=90) == pending.deadline_at
    assert row.num_tasks == 6
    assert row.periodic is False and row.forced is False
    assert row.coordinator_id == coord.coordinator_id
    assert row.storage_location == pending.location == storage.checkpoint_url(JOB, 1)
    assert location_exists(storage, pending.location)
    recorded = {
        TaskSpec(t.operator_id, t.subtask_index, t.attempt_id, t.parallelism, t.max_parallelism)
        for t in task_rows(metastore, pending.checkpoint_id)
    }
    assert recorded == set(plan)
    assert set(pending.tasks) == set(plan)


def test_savepoint_row_and_location(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock)
    pending = coord.trigger_savepoint()

    row = checkpoint_row(metastore, pending.checkpoint_id)
    assert row.checkpoint_type == CheckpointType.SAVEPOINT
    assert row.forced is True
    assert not any(
        (
            row.discard_on_subsumed,
            row.discard_on_finished,
            row.discard_on_cancelled,
            row.discard_on_failed,
            row.discard_on_suspended,
        )
    )
    assert pending.location == storage.savepoint_url(JOB, pending.checkpoint_id)
    assert location_exists(storage, pending.location)


# ================================================================ failed triggers


class _FailingLocationStorage(FileSystemCheckpointStorage):
    def initialize_location_for_checkpoint(
        self, job_id: str, checkpoint_id: int
    ) -> StorageLocation:
        raise StorageError(f"cannot create chk-{checkpoint_id}: disk full")


def test_storage_location_failure_counts_as_a_trigger_failure(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    failing = _FailingLocationStorage(storage.base_url)
    failures: list[TolerableFailuresExceeded] = []
    coord = new_coordinator(metastore, failing, clock, failures=failures)

    with pytest.raises(CheckpointException) as exc:
        coord.trigger_checkpoint()
    assert _reason(exc) is R.TRIGGER_CHECKPOINT_FAILURE
    assert "disk full" in str(exc.value)
    assert checkpoint_rows(metastore) == []
    assert not storage.path_of(storage.checkpoint_url(JOB, 1)).exists()
    job = job_row(metastore)
    assert job.consecutive_failures == 1
    assert len(failures) == 1  # tolerable_failures=0
    assert job.failure_cause is not None and "TRIGGER_CHECKPOINT_FAILURE" in job.failure_cause


def test_failed_insert_disposes_the_location_and_counts(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    plan = Plan([*make_plan(), make_plan()[0]])  # the same attempt twice: the insert fails
    coord = new_coordinator(metastore, storage, clock, plan=plan, tolerable_failures=5)

    with pytest.raises(CheckpointException) as exc:
        coord.trigger_checkpoint()
    assert _reason(exc) is R.TRIGGER_CHECKPOINT_FAILURE
    assert checkpoint_rows(metastore) == []
    assert task_rows(metastore, 1) == []
    assert not storage.path_of(storage.checkpoint_url(JOB, 1)).exists()
    assert failures_count(metastore) == 1

    plan.tasks = make_plan()
    assert coord.trigger_checkpoint().checkpoint_id == 2


def test_not_all_tasks_running_refuses_without_side_effects(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    plan = Plan(None)
    coord = new_coordinator(metastore, storage, clock, plan=plan)

    with pytest.raises(CheckpointException) as exc:
        coord.trigger_checkpoint()
    assert _reason(exc) is R.NOT_ALL_REQUIRED_TASKS_RUNNING
    with metastore.transaction() as s:
        assert s.scalar(select(func.count()).select_from(Checkpoint)) == 0
    job = job_row(metastore)
    assert (job.next_checkpoint_id, job.consecutive_failures) == (1, 0)
    assert not storage.path_of(storage.job_url(JOB)).exists()

    plan.tasks = make_plan()
    assert coord.trigger_checkpoint().checkpoint_id == 1


def test_a_superseded_coordinator_can_no_longer_trigger(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    """Fencing: an attempt that outlived its task (a driver orphaned by a killed worker) keeps
    running; once the next attempt's coordinator activated, the old one's triggers are refused
    and the new one's pending checkpoints are untouched."""
    old = new_coordinator(metastore, storage, clock)
    old.activate()
    stale = old.trigger_checkpoint()
    new = new_coordinator(metastore, storage, clock, plan=make_plan(attempt="a1"))
    assert new.activate() == [stale.checkpoint_id]  # aborted as coordinator failover
    assert checkpoint_row(metastore, stale.checkpoint_id).failure_reason == (
        "CHECKPOINT_COORDINATOR_FAILOVER"
    )

    current = new.trigger_checkpoint()
    with pytest.raises(CheckpointException, match="superseded by") as refused:
        old.trigger_checkpoint(forced=True)
    assert refused.value.reason is CheckpointFailureReason.COORDINATOR_SHUTDOWN
    assert statuses(metastore) == {stale.checkpoint_id: "ABORTED", current.checkpoint_id: "PENDING"}
    assert failures_count(metastore) == 0  # neither the failover nor the refusal counts
    assert ack_all(new, current).completed is not None
