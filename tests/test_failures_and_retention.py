"""The failure manager (Flink's ``CheckpointFailureManager``) and the retention policy applied on
job termination (``CompletedCheckpointStore.shutdown`` with ``CheckpointProperties``)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from checkpointing.clock import ManualClock
from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.failure import (
    CheckpointException,
    CheckpointFailureReason,
    TolerableFailuresExceeded,
)
from checkpointing.errors import StorageError
from checkpointing.metastore.engine import Metastore
from checkpointing.restore.lookup import find_latest_valid
from checkpointing.state.storage import FileSystemCheckpointStorage, StorageLocation
from checkpointing.status import CheckpointStatus, CheckpointType, JobStatus
from tests.helpers import (
    JOB,
    Plan,
    ack_all,
    checkpoint_row,
    complete,
    failures_count,
    job_row,
    location_exists,
    make_plan,
    new_coordinator,
    statuses,
)

R = CheckpointFailureReason


def _decline(coord: CheckpointCoordinator, **trigger: bool) -> int:
    pending = coord.trigger_savepoint() if trigger.get("savepoint") else coord.trigger_checkpoint()
    assert coord.receive_decline(pending.checkpoint_id, pending.tasks[0].attempt_id, "boom")
    return pending.checkpoint_id


# ================================================================ counting


def test_job_fails_when_consecutive_failures_exceed_the_tolerable_number(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    failures: list[TolerableFailuresExceeded] = []
    coord = new_coordinator(metastore, storage, clock, tolerable_failures=2, failures=failures)

    _decline(coord)
    _decline(coord)
    assert failures_count(metastore) == 2
    assert failures == [] and coord.job_failure is None
    assert job_row(metastore).failure_cause is None

    _decline(coord)
    assert failures_count(metastore) == 3
    assert len(failures) == 1
    assert coord.job_failure is failures[0]
    cause = job_row(metastore).failure_cause
    assert cause is not None and "tolerable" in cause and "CHECKPOINT_DECLINED" in cause


def test_each_counted_reason_counts(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    plan = Plan(make_plan())
    coord = new_coordinator(
        metastore, storage, clock, plan=plan, tolerable_failures=10, timeout="10s"
    )
    _decline(coord)  # CHECKPOINT_DECLINED
    assert failures_count(metastore) == 1
    coord.trigger_checkpoint()
    clock.advance(11)
    coord.expire_overdue()  # CHECKPOINT_EXPIRED
    assert failures_count(metastore) == 2
    plan.tasks = [*make_plan(), make_plan()[0]]
    with pytest.raises(CheckpointException):
        coord.trigger_checkpoint()  # TRIGGER_CHECKPOINT_FAILURE
    assert failures_count(metastore) == 3


def test_a_completion_resets_the_count(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, tolerable_failures=5)
    _decline(coord)
    _decline(coord)
    assert failures_count(metastore) == 2
    complete(coord)
    assert failures_count(metastore) == 0
    _decline(coord)
    assert failures_count(metastore) == 1


def test_job_failover_aborts_pending_without_counting(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    failures: list[TolerableFailuresExceeded] = []
    coord = new_coordinator(metastore, storage, clock, max_concurrent=3, failures=failures)
    pendings = [coord.trigger_checkpoint() for _ in range(2)] + [coord.trigger_savepoint()]

    assert coord.failover("task source-0 failed") == [1, 2, 3]

    for p in pendings:
        row = checkpoint_row(metastore, p.checkpoint_id)
        assert (row.status, row.failure_reason) == (CheckpointStatus.ABORTED, R.JOB_FAILOVER)
        assert row.failure_message == "task source-0 failed"
        assert not location_exists(storage, p.location)
    assert failures_count(metastore) == 0 and failures == []
    assert ack_all(coord, coord.trigger_checkpoint()).completed is not None


def test_coordinator_suspend_does_not_count(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    failures: list[TolerableFailuresExceeded] = []
    coord = new_coordinator(
        metastore, storage, clock, interval="10s", tolerable_failures=1, failures=failures
    )
    coord.start_scheduler()
    _decline(coord)
    assert failures_count(metastore) == 1
    pending = coord.trigger_checkpoint()
    coord.stop_scheduler()
    assert checkpoint_row(metastore, pending.checkpoint_id).failure_reason == (
        R.CHECKPOINT_COORDINATOR_SUSPEND
    )
    # not counted, and the count restarts (Flink's stopCheckpointScheduler resets it)
    assert failures_count(metastore) == 0 and failures == []


def test_coordinator_failover_aborts_the_previous_coordinators_pending_without_counting(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    failures: list[TolerableFailuresExceeded] = []
    first = new_coordinator(metastore, storage, clock, max_concurrent=2, failures=failures)
    first.activate()
    old = [first.trigger_checkpoint(), first.trigger_savepoint()]
    ack_all(first, first.trigger_checkpoint(forced=True), batch=False)  # one completes: id 3

    second = CheckpointCoordinator(JOB, metastore, clock=clock, plan_provider=Plan(old[0].tasks))
    assert second.activate() == [old[1].checkpoint_id]  # checkpoint 1 was subsumed by 3

    row = checkpoint_row(metastore, old[1].checkpoint_id)
    assert (row.status, row.failure_reason) == (
        CheckpointStatus.ABORTED,
        R.CHECKPOINT_COORDINATOR_FAILOVER,
    )
    assert not location_exists(storage, old[1].location)
    assert checkpoint_row(metastore, 3).status == CheckpointStatus.COMPLETED
    job = job_row(metastore)
    assert (job.coordinator_id, job.consecutive_failures) == (second.coordinator_id, 0)
    assert failures == []
    assert ack_all(second, second.trigger_checkpoint()).completed is not None


def test_coordinator_failover_aborts_every_pending_checkpoint_of_the_previous_one(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    first = new_coordinator(metastore, storage, clock, max_concurrent=3)
    first.activate()
    old = [first.trigger_checkpoint() for _ in range(3)]
    second = CheckpointCoordinator(JOB, metastore, storage, clock=clock)
    assert second.activate() == [p.checkpoint_id for p in old]
    assert set(statuses(metastore).values()) == {CheckpointStatus.ABORTED}
    assert failures_count(metastore) == 0


def test_scheduling_refusals_never_count(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    failures: list[TolerableFailuresExceeded] = []
    plan = Plan(None)
    coord = new_coordinator(
        metastore,
        storage,
        clock,
        plan=plan,
        interval="1h",
        max_concurrent=1,
        min_pause="1m",
        failures=failures,
    )
    assert coord.scheduler is not None
    with pytest.raises(CheckpointException) as exc:
        coord.trigger_checkpoint()
    assert exc.value.reason is R.NOT_ALL_REQUIRED_TASKS_RUNNING
    plan.tasks = make_plan()
    complete(coord)
    coord.start_scheduler()
    with pytest.raises(CheckpointException) as exc:
        coord.trigger_checkpoint(periodic=True)  # the min pause holds back periodic ones only
    assert exc.value.reason is R.MINIMUM_TIME_BETWEEN_CHECKPOINTS
    clock.advance(timedelta(minutes=1))
    coord.trigger_checkpoint()
    with pytest.raises(CheckpointException) as exc:
        coord.trigger_checkpoint()
    assert exc.value.reason is R.TOO_MANY_CONCURRENT_CHECKPOINTS
    coord.scheduler.stop()
    with pytest.raises(CheckpointException) as exc:
        coord.trigger_checkpoint(periodic=True)
    assert exc.value.reason is R.PERIODIC_SCHEDULER_SHUTDOWN
    with pytest.raises(CheckpointException) as exc:
        coord.request(CheckpointType.CHECKPOINT, requested_by="cli")  # one is queued already
    assert exc.value.reason is R.ALREADY_QUEUED
    with pytest.raises(CheckpointException) as exc:
        coord.trigger_checkpoint()
    assert exc.value.reason is R.ALREADY_QUEUED

    assert failures_count(metastore) == 0 and failures == []


class _SavepointLocationFails(FileSystemCheckpointStorage):
    def initialize_location_for_savepoint(
        self, job_id: str, checkpoint_id: int, target: str | None = None
    ) -> StorageLocation:
        raise StorageError("savepoint target not writable")


def test_savepoint_failures_do_not_count(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    failures: list[TolerableFailuresExceeded] = []
    coord = new_coordinator(
        metastore, storage, clock, timeout="10s", max_concurrent=5, failures=failures
    )
    _decline(coord, savepoint=True)
    coord.trigger_savepoint()
    clock.advance(11)
    assert len(coord.expire_overdue()) == 1

    failing = new_coordinator(
        metastore,
        _SavepointLocationFails(storage.base_url),
        clock,
        failures=failures,
    )
    with pytest.raises(CheckpointException) as exc:
        failing.trigger_savepoint()
    assert exc.value.reason is R.TRIGGER_CHECKPOINT_FAILURE

    assert list(statuses(metastore).values()) == [CheckpointStatus.ABORTED] * 2
    assert failures_count(metastore) == 0 and failures == []


# ================================================================ retention on shutdown

DISCARDED_ON = {
    "never_retain": {JobStatus.FINISHED, JobStatus.CANCELED, JobStatus.FAILED},
    "retain_on_failure": {JobStatus.FINISHED, JobStatus.CANCELED},
    "retain_on_cancellation": {JobStatus.FINISHED},
}


@pytest.mark.parametrize("policy", sorted(DISCARDED_ON))
@pytest.mark.parametrize(
    "job_status",
    [JobStatus.FINISHED, JobStatus.CANCELED, JobStatus.FAILED, JobStatus.SUSPENDED],
)
def test_retention_policy_on_shutdown(
    metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
    policy: str,
    job_status: JobStatus,
) -> None:
    failures: list[TolerableFailuresExceeded] = []
    coord = new_coordinator(
        metastore,
        storage,
        clock,
        retention=policy,
        retained=2,
        max_concurrent=2,
        failures=failures,
    )
    complete(coord)  # 1, subsumed later
    kept = [complete(coord)]  # 2
    savepoint = complete(coord, savepoint=True)  # 3
    kept.append(complete(coord))  # 4
    pending = coord.trigger_checkpoint()  # 5
    clock.advance(1)

    discarded = coord.shutdown(job_status)

    discard = job_status in DISCARDED_ON[policy]
    # a finished job keeps its newest checkpoint, whatever the policy: its next run resumes there
    live = 4 if job_status is JobStatus.FINISHED else None
    assert sorted(discarded) == ([c for c in (2, 4) if c != live] if discard else [])
    for c in kept:
        row = checkpoint_row(metastore, c.checkpoint_id)
        if discard and c.checkpoint_id != live:
            assert row.status == CheckpointStatus.DISCARDED
            assert row.ended_at == clock.now()
            assert not location_exists(storage, c.location)
        else:
            assert row.status == CheckpointStatus.COMPLETED
            assert storage.exists(c.metadata_path)
            assert all(storage.exists(h.handle or "") for h in c.metadata.handles())
    # savepoints are always kept
    assert checkpoint_row(metastore, savepoint.checkpoint_id).status == CheckpointStatus.COMPLETED
    assert storage.exists(savepoint.metadata_path)
    assert all(storage.exists(h.handle or "") for h in savepoint.metadata.handles())
    # pending ones end, without counting
    row = checkpoint_row(metastore, pending.checkpoint_id)
    assert (row.status, row.failure_reason) == (CheckpointStatus.ABORTED, R.JOB_TERMINATED)
    assert not location_exists(storage, pending.location)
    job = job_row(metastore)
    assert (job.status, job.periodic_scheduling, job.consecutive_failures) == (
        job_status,
        False,
        0,
    )
    assert failures == []
    # what is left is restorable: the latest retained checkpoint, else the savepoint
    latest = find_latest_valid(metastore, storage, JOB, prefer_checkpoint=True)
    assert latest.checkpoint_id == (savepoint.checkpoint_id if discard and not live else 4)
