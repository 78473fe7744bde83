"""Completion: ``_metadata``, the COMPLETED row, subsumption, dropping older pending checkpoints,
notifications, and metadata write failures (Flink's ``completePendingCheckpoint``)."""

from __future__ import annotations

from datetime import timedelta

from checkpointing.clock import ManualClock
from checkpointing.coordination.failure import CheckpointFailureReason
from checkpointing.coordination.pending import AckResult, TaskAck
from checkpointing.coordination.store import CompletedCheckpoint
from checkpointing.errors import OutcomeUnknownError, StorageError
from checkpointing.metastore.engine import Metastore
from checkpointing.restore.lookup import find_latest_valid
from checkpointing.state.metadata import read_metadata
from checkpointing.state.storage import (
    METADATA_FILE,
    FileInfo,
    FileSystemCheckpointStorage,
    checksum_of,
)
from checkpointing.status import CheckpointStatus, CheckpointType
from tests.helpers import (
    JOB,
    ack_all,
    checkpoint_row,
    complete,
    failures_count,
    job_row,
    location_exists,
    make_plan,
    new_coordinator,
    snapshot,
    statuses,
)

R = CheckpointFailureReason
C, S = CheckpointType.CHECKPOINT, CheckpointType.SAVEPOINT


def test_completion_writes_metadata_listing_every_handle(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    plan = make_plan({"source": 2, "sink": 1})
    coord = new_coordinator(metastore, storage, clock, plan=plan)
    pending = coord.trigger_checkpoint()
    acks = {
        t.attempt_id: snapshot(storage, pending, t, b"x" * (10 * (i + 1)))
        for i, t in enumerate(pending.tasks)
        if t.operator_id == "source"
    }
    acks["sink-0-a0"] = TaskAck("sink-0-a0")  # a stateless task reports no state
    clock.advance(4)

    outcome = coord.receive_acknowledge(pending.checkpoint_id, list(acks.values()))

    completed = outcome.completed
    assert completed is not None
    location = storage.location_for(pending.location)
    assert completed.metadata_path == location.metadata_url
    assert completed.location == pending.location
    assert completed.state_size == 30
    raw = storage.read_bytes(location.metadata_url)

    row = checkpoint_row(metastore, pending.checkpoint_id)
    assert row.status == CheckpointStatus.COMPLETED
    assert row.completed_at == clock.now()
    assert row.metadata_path == location.metadata_url
    assert row.metadata_checksum == checksum_of(raw)
    assert row.state_size == 30
    job = job_row(metastore)
    assert (job.last_completed_id, job.last_completion_at) == (pending.checkpoint_id, clock.now())

    meta = read_metadata(storage, row.metadata_path, row.metadata_checksum)
    assert meta == completed.metadata
    assert (meta.job_id, meta.checkpoint_id, meta.checkpoint_type) == (JOB, 1, "CHECKPOINT")
    assert (meta.trigger_at, meta.completed_at) == (pending.trigger_at, clock.now())
    ops = {op.operator_id: op for op in meta.operators}
    assert set(ops) == {"source", "sink"}
    assert (ops["source"].parallelism, ops["source"].max_parallelism) == (2, 16)
    assert (ops["sink"].parallelism, ops["sink"].max_parallelism) == (1, 16)
    for op in ops.values():
        assert [s.subtask_index for s in op.subtasks] == list(range(op.parallelism))
        for sub in op.subtasks:
            ack = acks[sub.attempt_id]
            assert (sub.handle, sub.size, sub.checksum) == (
                ack.state_handle,
                ack.state_size,
                ack.checksum,
            )
    assert {h.handle for h in meta.handles()} == {
        a.state_handle for a in acks.values() if a.state_handle
    }
    assert meta.state_size == 30


def test_subsumption_keeps_the_newest_retained_checkpoints(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, retained=2)
    done = []
    for _ in range(4):
        done.append(complete(coord))
        clock.advance(1)

    assert statuses(metastore) == {
        1: CheckpointStatus.SUBSUMED,
        2: CheckpointStatus.SUBSUMED,
        3: CheckpointStatus.COMPLETED,
        4: CheckpointStatus.COMPLETED,
    }
    for c in done[:2]:
        assert not location_exists(storage, c.location)
        assert checkpoint_row(metastore, c.checkpoint_id).ended_at is not None
    for c in done[2:]:
        assert storage.exists(c.metadata_path)
        assert all(storage.exists(h.handle or "") for h in c.metadata.handles())


def test_savepoints_are_never_subsumed_or_deleted(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, retained=1)
    savepoints = [complete(coord, savepoint=True)]
    for i in range(6):
        complete(coord)
        if i == 2:
            savepoints.append(complete(coord, savepoint=True))
        clock.advance(1)

    rows = statuses(metastore)
    assert rows == {
        1: CheckpointStatus.COMPLETED,  # savepoint
        2: CheckpointStatus.SUBSUMED,
        3: CheckpointStatus.SUBSUMED,
        4: CheckpointStatus.SUBSUMED,
        5: CheckpointStatus.COMPLETED,  # savepoint
        6: CheckpointStatus.SUBSUMED,
        7: CheckpointStatus.SUBSUMED,
        8: CheckpointStatus.COMPLETED,  # the one retained checkpoint
    }
    for sp in savepoints:
        assert sp.checkpoint_type is S
        meta = read_metadata(storage, sp.metadata_path)
        assert all(storage.exists(h.handle or "") for h in meta.handles())


def test_completion_aborts_older_pending_checkpoints_but_not_savepoints(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, max_concurrent=10)
    older = coord.trigger_checkpoint()
    savepoint = coord.trigger_savepoint()
    older_forced = coord.trigger_checkpoint(forced=True)
    completing = coord.trigger_checkpoint()
    newer = coord.trigger_checkpoint()

    assert ack_all(coord, completing).completed is not None

    for p in (older, older_forced):
        row = checkpoint_row(metastore, p.checkpoint_id)
        assert (row.status, row.failure_reason) == (
            CheckpointStatus.ABORTED,
            R.CHECKPOINT_SUBSUMED,
        )
        assert not location_exists(storage, p.location)
    assert checkpoint_row(metastore, savepoint.checkpoint_id).status == CheckpointStatus.PENDING
    assert checkpoint_row(metastore, newer.checkpoint_id).status == CheckpointStatus.PENDING
    assert failures_count(metastore) == 0

    late = snapshot(storage, older, older.tasks[0])
    assert coord.acknowledge_task(older.checkpoint_id, late) is AckResult.DISCARDED
    assert ack_all(coord, savepoint).completed is not None
    assert ack_all(coord, newer).completed is not None
    assert checkpoint_row(metastore, savepoint.checkpoint_id).status == CheckpointStatus.COMPLETED


def test_a_completed_savepoint_keeps_older_pending_checkpoints_a_stop_with_savepoint_not(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    """Flink 1.15+ (``testSavepointsAreNotSubsumed``): a savepoint subsumes nothing; only a
    completed checkpoint or stop-with-savepoint aborts the pending checkpoints before it."""
    coord = new_coordinator(metastore, storage, clock, max_concurrent=10)
    older = coord.trigger_checkpoint()
    savepoint = coord.trigger_savepoint()
    assert ack_all(coord, savepoint).completed is not None
    assert checkpoint_row(metastore, older.checkpoint_id).status == CheckpointStatus.PENDING
    assert location_exists(storage, older.location)

    stop = coord.trigger_savepoint(stop=True)
    assert ack_all(coord, stop).completed is not None
    row = checkpoint_row(metastore, older.checkpoint_id)
    assert (row.status, row.failure_reason) == (CheckpointStatus.ABORTED, R.CHECKPOINT_SUBSUMED)
    assert not location_exists(storage, older.location)


# ================================================================ notifications


def test_completion_listeners_run_and_are_recorded(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    seen: list[tuple[int, CheckpointType, int]] = []
    coord = new_coordinator(
        metastore,
        storage,
        clock,
        listeners=[lambda c: seen.append((c.checkpoint_id, c.checkpoint_type, c.state_size))],
    )
    done = complete(coord)
    savepoint = complete(coord, savepoint=True)

    assert seen == [(1, C, done.state_size), (2, S, savepoint.state_size)]
    for cid in (1, 2):
        row = checkpoint_row(metastore, cid)
        assert (row.notified_at, row.notify_error) == (clock.now(), None)
    assert coord.notify_pending_completions() == []
    assert len(seen) == 2


def test_failing_listener_is_retried_reported_and_rerun_later(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    calls: list[int] = []
    broken = [True]

    def commit_sink(c: CompletedCheckpoint) -> None:
        calls.append(c.checkpoint_id)
        if broken[0]:
            raise RuntimeError("sink unavailable")

    coord = new_coordinator(metastore, storage, clock, listeners=[commit_sink])
    pending = coord.trigger_checkpoint()
    outcome = ack_all(coord, pending)

    assert outcome.completed is not None  # a failing notification never un-completes
    assert len(calls) >= 2  # retried
    row = checkpoint_row(metastore, pending.checkpoint_id)
    assert row.status == CheckpointStatus.COMPLETED
    assert row.notified_at is None
    assert row.notify_error is not None and "sink unavailable" in row.notify_error
    assert find_latest_valid(metastore, storage, JOB).checkpoint_id == pending.checkpoint_id
    assert job_row(metastore).consecutive_failures == 0

    broken[0] = False
    calls.clear()
    clock.advance(5)
    assert coord.notify_pending_completions() == [pending.checkpoint_id]
    assert calls == [pending.checkpoint_id]
    row = checkpoint_row(metastore, pending.checkpoint_id)
    assert (row.notified_at, row.notify_error) == (clock.now(), None)
    assert coord.notify_pending_completions() == []


def test_a_listener_failing_once_succeeds_on_retry(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    calls: list[int] = []

    def flaky(c: CompletedCheckpoint) -> None:
        calls.append(c.checkpoint_id)
        if len(calls) == 1:
            raise ConnectionError("transient")

    coord = new_coordinator(metastore, storage, clock, listeners=[flaky])
    done = complete(coord)
    assert calls == [done.checkpoint_id, done.checkpoint_id]
    row = checkpoint_row(metastore, done.checkpoint_id)
    assert (row.notified_at, row.notify_error) == (clock.now(), None)


def test_run_once_retries_unfinished_notifications(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    healthy = [False]

    def commit_sink(c: CompletedCheckpoint) -> None:
        if not healthy[0]:
            raise RuntimeError("down")

    coord = new_coordinator(metastore, storage, clock, listeners=[commit_sink])
    done = complete(coord)
    assert checkpoint_row(metastore, done.checkpoint_id).notified_at is None
    healthy[0] = True
    clock.advance(1)
    coord.run_once()
    assert checkpoint_row(metastore, done.checkpoint_id).notified_at == clock.now()


# ================================================================ metadata write failures


class _MetadataWriteFails(FileSystemCheckpointStorage):
    """Writes ``_metadata`` (or not), then raises ``error``; other files are written normally."""

    def __init__(self, base_url: str, error: StorageError, *, write_first: bool) -> None:
        super().__init__(base_url)
        self.error = error
        self.write_first = write_first

    def write_bytes(self, url: str, data: bytes, *, overwrite: bool = True) -> FileInfo:
        if url.endswith("/" + METADATA_FILE):
            if self.write_first:
                super().write_bytes(url, data, overwrite=overwrite)
            raise self.error
        return super().write_bytes(url, data, overwrite=overwrite)


def test_unknown_outcome_of_the_metadata_write_aborts_but_deletes_nothing(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    failing = _MetadataWriteFails(
        storage.base_url, OutcomeUnknownError("timeout after the PUT was sent"), write_first=True
    )
    coord = new_coordinator(metastore, failing, clock, tolerable_failures=5)
    pending = coord.trigger_checkpoint()
    acks = [snapshot(failing, pending, t) for t in pending.tasks]

    outcome = coord.receive_acknowledge(pending.checkpoint_id, acks)

    assert outcome.completed is None
    row = checkpoint_row(metastore, pending.checkpoint_id)
    assert row.status == CheckpointStatus.ABORTED
    assert row.failure_reason == R.FINALIZE_CHECKPOINT_FAILURE
    assert row.metadata_path is None
    # the metadata may exist: nothing may be deleted
    assert location_exists(storage, pending.location)
    assert storage.exists(storage.location_for(pending.location).metadata_url)
    assert all(storage.exists(a.state_handle or "") for a in acks)
    job = job_row(metastore)
    assert (job.last_completed_id, job.consecutive_failures) == (None, 1)


def test_failed_metadata_write_disposes_the_location(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    failing = _MetadataWriteFails(storage.base_url, StorageError("disk full"), write_first=False)
    coord = new_coordinator(metastore, failing, clock, tolerable_failures=5)
    pending = coord.trigger_checkpoint()

    outcome = ack_all(coord, pending)

    assert outcome.completed is None
    row = checkpoint_row(metastore, pending.checkpoint_id)
    assert (row.status, row.failure_reason) == (
        CheckpointStatus.ABORTED,
        R.FINALIZE_CHECKPOINT_FAILURE,
    )
    assert row.failure_message is not None and "disk full" in row.failure_message
    assert not location_exists(storage, pending.location)
    assert failures_count(metastore) == 1


def test_a_checkpoint_completes_after_a_slow_ack_within_the_timeout(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, timeout="1m")
    pending = coord.trigger_checkpoint()
    clock.advance(timedelta(seconds=59, milliseconds=999))
    assert ack_all(coord, pending).completed is not None


def test_a_notification_in_flight_is_not_run_again_by_the_loop(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    """The completing thread runs the hooks while the coordinator loop looks for unnotified
    checkpoints: the loop must not commit the same checkpoint a second time."""
    calls: list[int] = []
    retried: list[list[int]] = []

    def sink_commit(c: CompletedCheckpoint) -> None:
        calls.append(c.checkpoint_id)
        if len(calls) == 1:  # while this hook runs, notified_at is still NULL
            assert checkpoint_row(metastore, c.checkpoint_id).notified_at is None
            retried.append(coord.notify_pending_completions())

    coord = new_coordinator(metastore, storage, clock, listeners=[sink_commit])
    complete(coord)

    assert calls == [1]
    assert retried == [[]]
    assert checkpoint_row(metastore, 1).notified_at == clock.now()
    assert coord.notify_pending_completions() == []
    assert calls == [1]
