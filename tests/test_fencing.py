"""Fencing: once coordinator B took over a job (``B.activate()``), the superseded coordinator A
changes nothing of B's on any path (Flink fences a JobMaster that lost leadership). The Spark
runtime calls exactly these when an orphaned attempt dies, and Airflow runs a killed try's
callbacks late."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest

from checkpointing.clock import ManualClock
from checkpointing.coordination.acknowledge import acknowledge
from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.failure import CoordinatorSuperseded
from checkpointing.coordination.pending import PendingCheckpoint
from checkpointing.coordination.store import CompletedCheckpoint
from checkpointing.metastore.engine import Metastore
from checkpointing.restore.recovery import fail_attempt
from checkpointing.state.storage import FileSystemCheckpointStorage
from checkpointing.status import CheckpointStatus, CheckpointType, JobStatus, RequestStatus
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
    request_rows,
    snapshot,
    statuses,
)


@dataclass
class Takeover:
    old: CheckpointCoordinator
    new: CheckpointCoordinator
    done: CompletedCheckpoint  # B's completed checkpoint
    pending: PendingCheckpoint  # B's pending checkpoint


@pytest.fixture
def takeover(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> Takeover:
    """A coordinated the job; B took over and has a completed and a pending checkpoint."""
    config = {"retention": "never_retain", "max_concurrent": 5, "timeout": "1m"}
    old = new_coordinator(metastore, storage, clock, **config)
    old.activate()
    complete(old)
    new = new_coordinator(metastore, storage, clock, plan=make_plan(attempt="b"), **config)
    new.activate()
    new.job_status_changed(JobStatus.RUNNING)
    done = complete(new)
    return Takeover(old, new, done, new.trigger_checkpoint())


def _untouched(metastore: Metastore, t: Takeover) -> None:
    """B's job, checkpoints and files are exactly as B left them."""
    job = job_row(metastore)
    assert (job.coordinator_id, job.status) == (t.new.coordinator_id, JobStatus.RUNNING)
    assert job.periodic_scheduling is False and job.consecutive_failures == 0
    assert checkpoint_row(metastore, t.done.checkpoint_id).status == CheckpointStatus.COMPLETED
    assert checkpoint_row(metastore, t.pending.checkpoint_id).status == CheckpointStatus.PENDING
    assert Path(t.done.metadata_path.removeprefix("file://")).exists()
    assert all(
        Path((h.handle or "").removeprefix("file://")).exists() for h in t.done.metadata.handles()
    )


def test_a_superseded_coordinators_failover_status_change_and_shutdown_touch_nothing(
    metastore: Metastore, storage: FileSystemCheckpointStorage, takeover: Takeover
) -> None:
    t = takeover
    assert t.old.failover("orphaned attempt died") == []
    assert t.old.job_status_changed(JobStatus.FAILED) is False
    t.old.stop_scheduler()
    # never_retain: before fencing this discarded B's completed checkpoint and deleted its files
    assert t.old.shutdown(JobStatus.CANCELED) == []
    _untouched(metastore, t)

    # B still works: its pending checkpoint completes, and so does its own shutdown
    assert ack_all(t.new, t.pending).completed is not None
    assert t.new.shutdown(JobStatus.CANCELED) == [t.pending.checkpoint_id]
    assert not location_exists(storage, t.pending.location)


def test_a_superseded_coordinator_neither_expires_nor_handles_requests_nor_completes(
    metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
    takeover: Takeover,
) -> None:
    t = takeover
    request_id = t.new.request(CheckpointType.SAVEPOINT, requested_by="ui")
    clock.advance(timedelta(minutes=2))  # B's pending checkpoint is overdue

    assert t.old.expire_overdue() == []
    assert t.old.process_requests() == []
    assert t.old.complete_fully_acknowledged() == []
    assert t.old.run_once() is None
    assert checkpoint_row(metastore, t.pending.checkpoint_id).status == CheckpointStatus.PENDING
    assert failures_count(metastore) == 0
    assert [(r.request_id, r.status) for r in request_rows(metastore)] == [
        (request_id, RequestStatus.QUEUED)
    ]
    with pytest.raises(CoordinatorSuperseded, match="superseded by"):
        t.old.trigger_checkpoint(checkpoint_type=CheckpointType.SAVEPOINT, forced=True)

    assert t.new.expire_overdue() == [t.pending.checkpoint_id]  # the coordinator itself does
    assert [p.checkpoint_type for p in t.new.process_requests()] == [CheckpointType.SAVEPOINT]


def test_a_superseded_coordinator_can_neither_ack_nor_decline_nor_complete_its_successors_work(
    metastore: Metastore, storage: FileSystemCheckpointStorage, takeover: Takeover
) -> None:
    t = takeover
    task = t.pending.tasks[0]
    ack = snapshot(storage, t.pending, task)
    with pytest.raises(CoordinatorSuperseded):
        t.old.receive_acknowledge(t.pending.checkpoint_id, [ack])
    with pytest.raises(CoordinatorSuperseded):
        t.old.receive_decline(t.pending.checkpoint_id, task.attempt_id, "CHECKPOINT_DECLINED")
    assert ack_rows(metastore, t.pending.checkpoint_id) == []
    assert Path((ack.state_handle or "").removeprefix("file://")).exists()

    # every ack in through a process that only acks (an executor): A may not complete it
    rest = [snapshot(storage, t.pending, x) for x in t.pending.tasks]
    acker = CheckpointCoordinator(t.new.job_id, metastore, clock=t.new.clock)
    outcome = acker.receive_acknowledge(t.pending.checkpoint_id, rest[:-1])
    assert outcome.completed is None
    with metastore.transaction() as s:  # the last ack is recorded, its acker died before
        acknowledge(s, t.new.job_id, t.pending.checkpoint_id, rest[-1:], t.new.clock.now())
    assert t.old.complete_checkpoint(t.pending.checkpoint_id) is None
    row = checkpoint_row(metastore, t.pending.checkpoint_id)
    assert (row.status, row.completing_by) == (CheckpointStatus.PENDING, None)
    assert t.new.complete_fully_acknowledged() == [t.pending.checkpoint_id]


def test_a_late_failure_callback_is_fenced_in_the_transaction_of_each_change(
    metastore: Metastore, storage: FileSystemCheckpointStorage, takeover: Takeover
) -> None:
    """``fail_attempt`` acts for the failed attempt's coordinator: whatever checked before, the
    change itself is refused once another coordinator leads (here: no check before at all)."""
    t = takeover
    for final in (False, True):
        info = fail_attempt(
            metastore,
            t.new.job_id,
            "try 1 failed",
            final=final,
            coordinator_id=t.old.coordinator_id,
        )
        assert (info["aborted"], info["superseded"]) == ([], t.new.coordinator_id)
        assert info["resume_from"] == t.done.checkpoint_id
    _untouched(metastore, t)

    info = fail_attempt(
        metastore, t.new.job_id, "try 2 failed", final=True, coordinator_id=t.new.coordinator_id
    )
    assert info["aborted"] == [t.pending.checkpoint_id] and info["superseded"] is None
    assert job_row(metastore).status == JobStatus.FAILED
    assert statuses(metastore)[t.done.checkpoint_id] == CheckpointStatus.DISCARDED  # never_retain


def test_a_driver_joining_under_a_superseded_id_never_takes_over(
    metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
    takeover: Takeover,
) -> None:
    """The Spark driver joins the operator's coordination; one that starts after a newer try took
    over (a slow spark-submit of a killed try) is refused instead of aborting the newer try's
    checkpoints, as ``activate`` would."""
    t = takeover
    late = CheckpointCoordinator(JOB, metastore, clock=clock, coordinator_id=t.old.coordinator_id)
    with pytest.raises(CoordinatorSuperseded, match=t.new.coordinator_id):
        late.join()
    _untouched(metastore, t)

    driver = CheckpointCoordinator(JOB, metastore, clock=clock, coordinator_id=t.new.coordinator_id)
    driver.join()  # the current try's driver acts as the same coordinator
    assert ack_all(driver, t.pending).completed is not None


def test_a_stale_triggers_coordinator_is_fenced_in_its_transactions_once_another_try_re_attached(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    """Review of issue 38: the trigger's coordinator of a detached driver (try 1, watching its
    own driver) was built without its watcher, so once try 2 re-attached it was stopped only by
    the check before each pass: a pass already under way still aborted the driver's pending
    checkpoint. Its coordinator is now fenced by the row's watcher in every transaction."""
    import os
    from datetime import UTC, datetime

    from sqlalchemy import update

    from checkpointing.coordination.detached import DetachedAttempt
    from checkpointing.coordination.drivers import DriverIdentity, record_driver, this_host
    from checkpointing.metastore.models import Job

    first = "run-1-t1"
    coordinator = CheckpointCoordinator(
        JOB,
        metastore,
        storage,
        new_coordinator(metastore, storage, clock).config,
        coordinator_id=first,
        clock=clock,
        plan_provider=lambda: make_plan(attempt=first),
    )
    coordinator.activate()
    coordinator.job_status_changed(JobStatus.RUNNING)
    pending = coordinator.trigger_checkpoint()
    driver = DriverIdentity(first, this_host(), os.getpid(), None, datetime.now(UTC), 1)
    assert record_driver(metastore, JOB, driver)
    with metastore.transaction() as s:
        s.execute(update(Job).where(Job.job_id == JOB).values(status="RUNNING"))

    stale = DetachedAttempt(
        JOB, metastore, storage, attempt=first, tasks=make_plan(attempt=first), poll=1, clock=clock
    )
    stale._join()  # try 1's trigger joined its driver's coordination …
    with metastore.transaction() as s:  # … then try 2 re-attached to the driver
        s.execute(update(Job).where(Job.job_id == JOB).values(driver_watcher="run-1-t2"))
    assert stale.coordinator is not None
    assert stale.coordinator.failover("a pass under way when try 2 re-attached") == []
    assert checkpoint_row(metastore, pending.checkpoint_id).status == CheckpointStatus.PENDING


def test_a_trigger_watching_a_scripts_driver_takes_no_request_and_aborts_no_step(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    """Issue 39, ``deferrable=True`` for a script: its driver's ``checkpointed`` coordinates its
    own steps, so the trigger (``coordinates=False``) must neither take a savepoint request the
    driver takes at its next step boundary nor, once the driver is lost, abort the pending step
    whose acknowledged files the retry salvages. A coordinating trigger (a spec's) does both:
    the contrast shows what the flag changes."""
    from sqlalchemy import update

    from checkpointing.coordination.detached import DetachedAttempt
    from checkpointing.coordination.drivers import DriverIdentity, Outcome, record_driver
    from checkpointing.coordination.events import CheckpointCompleted
    from checkpointing.coordination.savepoints import request_savepoint, request_status
    from checkpointing.coordination.stats_tracker import CheckpointStatsTracker
    from checkpointing.metastore.models import Job

    first = "run-1-t1"
    script_driver = CheckpointCoordinator(
        JOB,
        metastore,
        storage,
        new_coordinator(metastore, storage, clock).config,
        coordinator_id=first,
        clock=clock,
        plan_provider=lambda: make_plan(attempt=first),
    )
    script_driver.activate()
    done = complete(script_driver)  # a step completed before the trigger's first pass
    step = script_driver.trigger_checkpoint()  # a step under way
    # a driver on another host (not signalled or probed here): judged by its heartbeat
    submitted = clock.now() - timedelta(seconds=1)
    assert record_driver(metastore, JOB, DriverIdentity(first, "elsewhere", 4242, None, submitted))
    script_driver.job_status_changed(JobStatus.RUNNING)
    with metastore.transaction() as s:
        s.execute(update(Job).where(Job.job_id == JOB).values(heartbeat_at=clock.now()))
    request = request_savepoint(metastore, JOB, requested_by="ui:admin", clock=clock)

    reported: list[object] = []

    class Recorder:
        def on_event(self, event: object) -> None:
            reported.append(event)

    def attempt(coordinates: bool) -> DetachedAttempt:
        tasks = make_plan(attempt=first) if coordinates else []
        tracker = CheckpointStatsTracker(JOB, metastore, first, [Recorder()], clock=clock)
        return DetachedAttempt(
            JOB, metastore, storage, attempt=first, tasks=tasks, poll=1, clock=clock,
            heartbeat_timeout=timedelta(seconds=30), coordinates=coordinates,
            stats_tracker=tracker,
        )  # fmt: skip

    watching = attempt(False)
    assert watching.poll() is None  # the driver runs
    assert request_status(metastore, JOB, request).status == RequestStatus.QUEUED
    assert statuses(metastore) == {
        done.checkpoint_id: CheckpointStatus.COMPLETED,
        step.checkpoint_id: CheckpointStatus.PENDING,
    }
    # its metrics: the step the driver completed before this first pass too
    completed = [e for e in reported if isinstance(e, CheckpointCompleted)]
    assert [e.checkpoint_id for e in completed] == [done.checkpoint_id]
    # a coordinating trigger takes it: a savepoint that a script's driver would never ack
    coordinating = attempt(True)
    assert coordinating.poll() is None
    assert request_status(metastore, JOB, request).status != RequestStatus.QUEUED
    assert len(statuses(metastore)) == 3

    clock.advance(timedelta(seconds=60))  # the driver went silent: lost
    before = statuses(metastore)
    lost = watching.poll()
    assert lost is not None and lost.outcome is Outcome.DRIVER_LOST
    assert statuses(metastore) == before  # the step stays pending, for the retry to salvage
    lost = coordinating.poll()
    assert lost is not None and lost.outcome is Outcome.DRIVER_LOST
    aborted = {i: s for i, s in statuses(metastore).items() if i != done.checkpoint_id}
    assert set(aborted.values()) == {CheckpointStatus.ABORTED}
