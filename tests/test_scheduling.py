"""Periodic scheduling driven by the ManualClock (Flink's ``ScheduledTrigger``,
``startCheckpointScheduler`` / ``stopCheckpointScheduler`` and
``CheckpointCoordinatorDeActivator``)."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest

from checkpointing.clock import ManualClock
from checkpointing.config import CheckpointConfig
from checkpointing.coordination.failure import (
    CheckpointException,
    CheckpointFailureReason,
    TolerableFailuresExceeded,
)
from checkpointing.metastore.engine import Metastore
from checkpointing.state.storage import FileSystemCheckpointStorage
from checkpointing.status import CheckpointStatus, CheckpointType, JobStatus, RequestStatus
from tests.helpers import (
    ack_all,
    checkpoint_row,
    checkpoint_rows,
    failures_count,
    job_row,
    location_exists,
    new_coordinator,
    request_rows,
)

R = CheckpointFailureReason


def test_first_periodic_trigger_comes_after_a_random_delay_in_min_pause_to_interval(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, interval="60s", min_pause="20s", seed=7)
    expected = random.Random(7)
    delays = []
    for _ in range(10):
        first = coord.start_scheduler()
        delay = first - clock.now()
        assert delay == timedelta(seconds=expected.uniform(20, 60))
        assert timedelta(seconds=20) <= delay <= timedelta(seconds=60)
        delays.append(delay)
        coord.stop_scheduler()
    assert len(set(delays)) == 10  # spread, not a constant

    first = coord.start_scheduler()
    assert coord.run_once() is None
    clock.advance(first - clock.now() - timedelta(milliseconds=1))
    assert coord.run_once() is None
    assert checkpoint_rows(metastore) == []

    clock.advance(timedelta(milliseconds=1))
    pending = coord.run_once()
    assert pending is not None
    row = checkpoint_row(metastore, pending.checkpoint_id)
    assert row.periodic is True
    assert row.trigger_at == first
    assert row.status == CheckpointStatus.PENDING


def test_periodic_triggers_run_at_a_fixed_rate(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    interval = timedelta(seconds=30)
    coord = new_coordinator(metastore, storage, clock, interval="30s", seed=1)
    first = coord.start_scheduler()
    clock.advance(first - clock.now())

    for _ in range(3):
        pending = coord.run_once()
        assert pending is not None
        clock.advance(7)  # the checkpoint takes 7s; the rate does not drift
        assert ack_all(coord, pending).completed is not None
        assert coord.run_once() is None
        clock.advance(interval - timedelta(seconds=7))

    # missed periods are skipped, not fired in a burst
    clock.advance(interval * 2 + timedelta(seconds=5))
    late = coord.run_once()
    assert late is not None
    assert coord.run_once() is None
    ack_all(coord, late)
    clock.advance(interval - timedelta(seconds=5))
    last = coord.run_once()
    assert last is not None

    triggers = [r.trigger_at for r in checkpoint_rows(metastore)]
    assert triggers == [
        first,
        first + interval,
        first + 2 * interval,
        first + 5 * interval + timedelta(seconds=5),
        first + 6 * interval,
    ]
    assert all(r.periodic for r in checkpoint_rows(metastore))


@pytest.mark.parametrize("interval", ["5ms", "9ms", None])
def test_interval_below_10ms_disables_periodic_checkpoints_only(
    metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
    interval: str | None,
) -> None:
    settings = {} if interval is None else {"interval": interval}
    assert CheckpointConfig.parse(settings).periodic_interval is None
    coord = new_coordinator(metastore, storage, clock, **settings)
    assert coord.scheduler is None

    with pytest.raises(CheckpointException) as exc:
        coord.start_scheduler()
    assert exc.value.reason is R.PERIODIC_SCHEDULER_SHUTDOWN
    coord.job_status_changed(JobStatus.RUNNING)  # does not raise, starts nothing
    assert job_row(metastore).periodic_scheduling is False
    clock.advance(3600)
    assert coord.run_once() is None
    assert checkpoint_rows(metastore) == []

    manual = coord.trigger_checkpoint()
    assert ack_all(coord, manual).completed is not None
    savepoint = coord.trigger_savepoint()
    assert ack_all(coord, savepoint).completed is not None
    assert [r.status for r in checkpoint_rows(metastore)] == [CheckpointStatus.COMPLETED] * 2


def test_interval_of_10ms_is_periodic(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    assert CheckpointConfig.parse({"interval": "10ms"}).periodic_interval == timedelta(
        milliseconds=10
    )
    coord = new_coordinator(metastore, storage, clock, interval="10ms")
    assert coord.scheduler is not None
    first = coord.start_scheduler()
    clock.advance(first - clock.now())
    assert coord.run_once() is not None


def test_min_pause_larger_than_interval_raises_the_interval(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    config = CheckpointConfig.parse({"interval": "1s", "min_pause": "5s"})
    assert config.periodic_interval == timedelta(seconds=5)
    coord = new_coordinator(metastore, storage, clock, interval="1s", min_pause="5s", seed=3)
    assert coord.scheduler is not None
    assert coord.scheduler.interval == timedelta(seconds=5)

    start = clock.now()
    first = coord.start_scheduler()
    assert first == start + timedelta(seconds=5)  # random delay in [5s, 5s]
    for k in range(3):
        clock.advance(1)
        assert coord.run_once() is None  # the configured 1s is not used
        clock.advance(4)
        pending = coord.run_once()
        assert pending is not None
        assert pending.trigger_at == start + timedelta(seconds=5 * (k + 1))
        assert ack_all(coord, pending).completed is not None
    assert failures_count(metastore) == 0


def test_min_pause_refusal_moves_the_next_periodic_trigger_to_the_earliest_allowed_time(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, interval="10s", min_pause="4s", seed=5)
    assert coord.scheduler is not None
    first = coord.start_scheduler()
    clock.advance(first - clock.now())
    pending = coord.run_once()
    assert pending is not None

    clock.advance(8)  # completes 8s after its trigger
    assert ack_all(coord, pending).completed is not None
    earliest = clock.now() + timedelta(seconds=4)

    clock.advance(2)  # the regular trigger time: only 2s after the completion
    assert coord.run_once() is None
    assert len(checkpoint_rows(metastore)) == 1
    assert coord.scheduler.next_at == earliest
    assert failures_count(metastore) == 0

    clock.advance(earliest - clock.now() - timedelta(milliseconds=1))
    assert coord.run_once() is None
    clock.advance(timedelta(milliseconds=1))
    second = coord.run_once()
    assert second is not None
    assert second.trigger_at == earliest
    assert ack_all(coord, second).completed is not None
    clock.advance(10)
    third = coord.run_once()
    assert third is not None and third.trigger_at == earliest + timedelta(seconds=10)


def test_job_status_running_starts_and_any_other_status_stops_periodic_checkpoints(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, interval="10s", seed=2)
    assert coord.scheduler is not None

    for stop_status in (JobStatus.SUSPENDED, JobStatus.CREATED, JobStatus.FAILED):
        coord.job_status_changed(JobStatus.RUNNING)
        job = job_row(metastore)
        assert (job.status, job.periodic_scheduling) == (JobStatus.RUNNING, True)
        assert coord.scheduler.running
        clock.advance(10)
        pending = coord.run_once()
        assert pending is not None
        ack_all(coord, pending)

        coord.job_status_changed(stop_status)
        job = job_row(metastore)
        assert (job.status, job.periodic_scheduling) == (stop_status, False)
        assert not coord.scheduler.running
        before = len(checkpoint_rows(metastore))
        clock.advance(60)
        assert coord.run_once() is None
        assert len(checkpoint_rows(metastore)) == before
        with pytest.raises(CheckpointException) as exc:
            coord.trigger_checkpoint(periodic=True)
        assert exc.value.reason is R.PERIODIC_SCHEDULER_SHUTDOWN
    assert len(checkpoint_rows(metastore)) == 3


def test_stop_aborts_pending_drops_queued_requests_and_counts_nothing(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    failures: list[TolerableFailuresExceeded] = []
    coord = new_coordinator(
        metastore, storage, clock, interval="10s", max_concurrent=5, failures=failures, seed=4
    )
    first = coord.start_scheduler()
    clock.advance(first - clock.now())
    periodic = coord.run_once()
    assert periodic is not None
    manual = coord.trigger_checkpoint()
    savepoint = coord.trigger_savepoint()
    coord.request(CheckpointType.SAVEPOINT, requested_by="ui")
    coord.request(CheckpointType.CHECKPOINT, requested_by="cli")
    clock.advance(1)

    coord.stop_scheduler()

    for p in (periodic, manual, savepoint):
        row = checkpoint_row(metastore, p.checkpoint_id)
        assert row.status == CheckpointStatus.ABORTED
        assert row.failure_reason == R.CHECKPOINT_COORDINATOR_SUSPEND
        assert row.failure_message == "Checkpoint Coordinator is suspending."
        assert row.ended_at == clock.now()
        assert not location_exists(storage, p.location)
    requests = request_rows(metastore)
    assert [r.status for r in requests] == [RequestStatus.DROPPED] * 2
    assert all(r.finished_at == clock.now() for r in requests)
    job = job_row(metastore)
    assert (job.consecutive_failures, job.periodic_scheduling, job.failure_cause) == (
        0,
        False,
        None,
    )
    assert failures == [] and coord.job_failure is None
    assert coord.process_requests() == []


def test_starting_the_scheduler_keeps_the_coordinators_own_pending_checkpoints(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    # Flink's startCheckpointScheduler only (re)starts the timer; it never aborts anything.
    coord = new_coordinator(metastore, storage, clock, interval="10s", max_concurrent=2)
    manual = coord.trigger_checkpoint()

    coord.job_status_changed(JobStatus.RUNNING)

    row = checkpoint_row(metastore, manual.checkpoint_id)
    assert (row.status, row.failure_reason) == (CheckpointStatus.PENDING, None)
    assert ack_all(coord, manual).completed is not None
