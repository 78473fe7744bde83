"""The shared state registry (Flink's ``SharedStateRegistry``): incremental checkpoints write their
new files under ``<job>/shared/chk-N/`` and build on earlier ones; a shared file is deleted only
when no retained checkpoint refers to it. Driven through a real coordinator, real storage under
``tmp_path`` and the metastore on SQLite and PostgreSQL."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from checkpointing.clock import ManualClock
from checkpointing.coordination import shared_state, store
from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.failure import CheckpointFailureReason
from checkpointing.coordination.pending import AckResult, PendingCheckpoint, TaskAck
from checkpointing.coordination.store import CompletedCheckpoint
from checkpointing.errors import OutcomeUnknownError, SharedStateError, StorageError
from checkpointing.metastore.engine import Metastore
from checkpointing.state.storage import METADATA_FILE, FileInfo, FileSystemCheckpointStorage
from checkpointing.status import CheckpointStatus, JobStatus
from tests.helpers import JOB, checkpoint_row, location_exists, make_plan, new_coordinator

R = CheckpointFailureReason
#: one keyed operator of two subtasks (key groups 0-7 and 8-15) and a stateless sink
PLAN = {"agg": 2, "sink": 1}
File = dict[str, Any]


def _coordinator(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock, **config: Any
) -> CheckpointCoordinator:
    config.setdefault("tolerable_failures", 10)
    return new_coordinator(metastore, storage, clock, plan=make_plan(PLAN), **config)


def _write(storage: FileSystemCheckpointStorage, url: str, size: int) -> File:
    info = storage.write_bytes(url, bytes(size))
    return {"handle": info.url, "size": info.size, "checksum": info.checksum}


def _acks(
    coord: CheckpointCoordinator,
    pending: PendingCheckpoint,
    sizes: tuple[int, int],
    chains: tuple[list[File], list[File]] = ([], []),
) -> tuple[list[TaskAck], list[File]]:
    """Each keyed subtask writes a new file of ``sizes[i]`` bytes under the checkpoint's
    ``shared/chk-<id>/`` on top of ``chains[i]``; the sink acks without state. Returns the acks
    and the new files."""
    storage = coord.storage
    assert isinstance(storage, FileSystemCheckpointStorage)
    own = storage.shared_checkpoint_url(JOB, pending.checkpoint_id)
    acks, new = [], []
    for t in pending.tasks:
        if t.operator_id != "agg":
            acks.append(TaskAck(t.attempt_id))
            continue
        i = t.subtask_index
        f = _write(storage, f"{own}/agg-{i}-{t.attempt_id}.arrow", sizes[i])
        chain = chains[i]
        meta = {
            "key_groups": [8 * i, 8 * i + 7],
            "group_bytes": {8 * i: f["size"] + sum(c["size"] for c in chain)},
            **({"chain": chain} if chain else {}),
        }
        acks.append(TaskAck(t.attempt_id, f["handle"], f["size"], f["checksum"], state_meta=meta))
        new.append(f)
    return acks, new


def _checkpoint(
    coord: CheckpointCoordinator,
    sizes: tuple[int, int],
    chains: tuple[list[File], list[File]] = ([], []),
) -> tuple[CompletedCheckpoint, list[File]]:
    pending = coord.trigger_checkpoint()
    acks, new = _acks(coord, pending, sizes, chains)
    outcome = coord.receive_acknowledge(pending.checkpoint_id, acks)
    assert outcome.completed is not None, outcome
    return outcome.completed, new


def _counts(metastore: Metastore) -> dict[str, int]:
    with metastore.transaction() as s:
        return shared_state.reference_counts(s, JOB)


def _exists(storage: FileSystemCheckpointStorage, url: str) -> bool:
    return storage.path_of(url).exists()


def _shared_dir(storage: FileSystemCheckpointStorage, checkpoint_id: int) -> Path:
    return storage.path_of(storage.shared_checkpoint_url(JOB, checkpoint_id))


# ================================================================ reference counting


def test_a_shared_file_lives_until_the_last_checkpoint_using_it_is_subsumed(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = _coordinator(metastore, storage, clock, retained=1)
    first, bases = _checkpoint(coord, (100, 200))  # full
    assert (first.state_size, first.checkpointed_size) == (300, 300)
    assert _counts(metastore) == {f["handle"]: 1 for f in bases}

    second, deltas = _checkpoint(coord, (10, 20), ([bases[0]], [bases[1]]))  # incremental
    # Flink's figures: the full state, and what this checkpoint wrote
    assert (second.state_size, second.checkpointed_size) == (330, 30)
    row = checkpoint_row(metastore, second.checkpoint_id)
    assert (row.state_size, row.checkpointed_size) == (330, 30)
    # the first is subsumed: its directory goes, the base files it wrote stay for the second
    assert checkpoint_row(metastore, first.checkpoint_id).status == CheckpointStatus.SUBSUMED
    assert not location_exists(storage, first.location)
    assert all(_exists(storage, f["handle"]) for f in bases + deltas)
    assert _counts(metastore) == {f["handle"]: 1 for f in bases + deltas}

    third, fresh = _checkpoint(coord, (50, 60))  # full again: nothing of the second is used
    assert (third.state_size, third.checkpointed_size) == (110, 110)
    assert not any(_exists(storage, f["handle"]) for f in bases + deltas)
    # the emptied shared/chk-1 and shared/chk-2 directories go too, the shared root stays
    assert not _shared_dir(storage, first.checkpoint_id).exists()
    assert not _shared_dir(storage, second.checkpoint_id).exists()
    assert storage.path_of(storage.shared_url(JOB)).is_dir()
    assert all(_exists(storage, f["handle"]) for f in fresh)
    assert _counts(metastore) == {f["handle"]: 1 for f in fresh}


def test_a_file_shared_by_two_retained_checkpoints_counts_twice(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = _coordinator(metastore, storage, clock, retained=2)
    _, bases = _checkpoint(coord, (100, 200))
    _, deltas2 = _checkpoint(coord, (1, 2), ([bases[0]], [bases[1]]))
    assert _counts(metastore)[bases[0]["handle"]] == 2
    # the third builds on the first's bases and the second's deltas; the first is subsumed
    _, deltas3 = _checkpoint(coord, (3, 4), ([bases[0], deltas2[0]], [bases[1], deltas2[1]]))
    counts = _counts(metastore)
    assert [counts[f["handle"]] for f in bases + deltas2 + deltas3] == [2, 2, 2, 2, 1, 1]
    assert all(_exists(storage, f["handle"]) for f in bases + deltas2 + deltas3)
    assert _shared_dir(storage, 1).is_dir()


# ================================================================ what a completion may refer to


def test_a_completion_reusing_an_unregistered_shared_file_is_aborted_naming_it(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = _coordinator(metastore, storage, clock, retained=1)
    good, bases = _checkpoint(coord, (100, 200))
    ghost = _write(storage, f"{storage.shared_checkpoint_url(JOB, 9)}/ghost.arrow", 7)
    pending = coord.trigger_checkpoint()
    acks, new = _acks(coord, pending, (1, 2), ([bases[0]], [ghost]))

    with pytest.raises(SharedStateError, match=f"checkpoint 2 refers to .*{ghost['handle']}"):
        coord.receive_acknowledge(pending.checkpoint_id, acks)

    row = checkpoint_row(metastore, pending.checkpoint_id)
    assert (row.status, row.failure_reason) == (
        CheckpointStatus.ABORTED,
        R.FINALIZE_CHECKPOINT_FAILURE,
    )
    assert ghost["handle"] in (row.failure_message or "")
    # disposed: its directory (with the _metadata written) and its own shared files; nothing else
    assert not location_exists(storage, pending.location)
    assert not _shared_dir(storage, pending.checkpoint_id).exists()
    assert not any(_exists(storage, f["handle"]) for f in new)
    assert _exists(storage, ghost["handle"])
    # the registration rolled back; the last good checkpoint is untouched
    assert checkpoint_row(metastore, good.checkpoint_id).status == CheckpointStatus.COMPLETED
    assert _counts(metastore) == {f["handle"]: 1 for f in bases}
    assert all(_exists(storage, f["handle"]) for f in bases)


def test_a_checkpoint_whose_base_was_subsumed_while_it_was_pending_fails(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = _coordinator(metastore, storage, clock, retained=1, max_concurrent=2)
    _, bases = _checkpoint(coord, (100, 200))
    full = coord.trigger_checkpoint()  # 2: full
    incremental = coord.trigger_checkpoint()  # 3: builds on 1's bases
    acks3, _ = _acks(coord, incremental, (1, 2), ([bases[0]], [bases[1]]))
    acks2, _ = _acks(coord, full, (50, 60))
    assert coord.receive_acknowledge(full.checkpoint_id, acks2).completed is not None
    assert not any(_exists(storage, f["handle"]) for f in bases)  # 1 subsumed, nobody uses them

    with pytest.raises(SharedStateError, match=bases[0]["handle"]):
        coord.receive_acknowledge(incremental.checkpoint_id, acks3)
    assert checkpoint_row(metastore, 3).failure_reason == R.FINALIZE_CHECKPOINT_FAILURE
    assert checkpoint_row(metastore, 2).status == CheckpointStatus.COMPLETED


def test_a_savepoint_must_not_refer_to_shared_state(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = _coordinator(metastore, storage, clock)
    _, bases = _checkpoint(coord, (100, 200))
    pending = coord.trigger_savepoint()
    acks, _ = _acks(coord, pending, (1, 2), ([bases[0]], [bases[1]]))
    with pytest.raises(SharedStateError, match="self-contained"):
        coord.receive_acknowledge(pending.checkpoint_id, acks)
    assert checkpoint_row(metastore, pending.checkpoint_id).status == CheckpointStatus.ABORTED
    assert _counts(metastore) == {f["handle"]: 1 for f in bases}


# ================================================================ aborted checkpoints


@pytest.mark.parametrize("how", ["decline", "expiry", "failover", "metadata write"])
def test_an_aborted_incremental_checkpoint_removes_its_shared_dir_and_nothing_else(
    how: str, metastore: Metastore, tmp_path: Path, clock: ManualClock
) -> None:
    error = StorageError("disk full")
    storage = _MetadataWriteFails(f"file://{tmp_path / 'checkpoints'}", error)
    coord = _coordinator(metastore, storage, clock, timeout="10s")
    good, bases = _checkpoint(coord, (100, 200))
    storage.failing = how == "metadata write"
    pending = coord.trigger_checkpoint()
    acks, new = _acks(coord, pending, (1, 2), ([bases[0]], [bases[1]]))
    if how == "metadata write":
        assert coord.receive_acknowledge(pending.checkpoint_id, acks).completed is None
    else:
        assert coord.receive_acknowledge(pending.checkpoint_id, acks[:2]).completed is None
        if how == "decline":
            assert coord.receive_decline(pending.checkpoint_id, acks[2].attempt_id, "boom")
        elif how == "expiry":
            clock.advance(11)
            assert coord.expire_overdue() == [pending.checkpoint_id]
        else:
            assert coord.failover() == [pending.checkpoint_id]

    assert checkpoint_row(metastore, pending.checkpoint_id).status == CheckpointStatus.ABORTED
    assert not _shared_dir(storage, pending.checkpoint_id).exists()
    assert not location_exists(storage, pending.location)
    assert not any(_exists(storage, f["handle"]) for f in new)
    assert all(_exists(storage, f["handle"]) for f in bases)
    assert _exists(storage, good.metadata_path)
    assert _counts(metastore) == {f["handle"]: 1 for f in bases}


def test_an_unknown_metadata_write_outcome_deletes_no_shared_file(
    metastore: Metastore, tmp_path: Path, clock: ManualClock
) -> None:
    storage = _MetadataWriteFails(f"file://{tmp_path / 'checkpoints'}", OutcomeUnknownError("?"))
    coord = _coordinator(metastore, storage, clock)
    _, bases = _checkpoint(coord, (100, 200))
    storage.failing = True
    pending = coord.trigger_checkpoint()
    acks, new = _acks(coord, pending, (1, 2), ([bases[0]], [bases[1]]))
    assert coord.receive_acknowledge(pending.checkpoint_id, acks).completed is None
    assert checkpoint_row(metastore, 2).failure_reason == R.FINALIZE_CHECKPOINT_FAILURE
    assert all(_exists(storage, f["handle"]) for f in bases + new)


class _MetadataWriteFails(FileSystemCheckpointStorage):
    def __init__(self, base_url: str, error: StorageError) -> None:
        super().__init__(base_url)
        self.error = error
        self.failing = False

    def write_bytes(self, url: str, data: bytes, *, overwrite: bool = True) -> FileInfo:
        if self.failing and url.endswith("/" + METADATA_FILE):
            raise self.error
        return super().write_bytes(url, data, overwrite=overwrite)


# ================================================================ acks


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        ("this checkpoint's directory", "outside the job's shared state"),
        ("the previous checkpoint's directory", "outside the job's shared state"),
        ("another job's shared state", "outside the job's shared state"),
        ("dot-dot out of shared", "outside the job's shared state"),
        ("the shared root", "outside the job's shared state"),
        ("a huge size", "is not a size in bytes"),
        ("a bad checksum", "is not 'sha256:<64 hex digits>'"),
        ("a too long URL", "at most 2048 characters"),  # the descriptor refuses it
    ],
)
def test_a_bad_chain_entry_refuses_the_ack_and_is_never_deleted(
    entry: str,
    says: str,
    metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
) -> None:
    coord = _coordinator(metastore, storage, clock)
    good, bases = _checkpoint(coord, (100, 200))
    pending = coord.trigger_checkpoint()
    prior = (good.metadata.handles()[0].handle or "").rsplit("/", 1)[0]
    bad = dict(bases[0])
    if entry == "this checkpoint's directory":
        bad = _write(storage, f"{pending.location}/old.arrow", 5)
    elif entry == "the previous checkpoint's directory":
        bad = _write(storage, f"{good.location}/old.arrow", 5)
    elif entry == "another job's shared state":
        bad = _write(storage, f"{storage.shared_checkpoint_url('job-b', 1)}/old.arrow", 5)
    elif entry == "dot-dot out of shared":
        bad["handle"] = f"{storage.shared_url(JOB)}/../chk-1/old.arrow"
    elif entry == "the shared root":
        bad["handle"] = storage.shared_url(JOB)
    elif entry == "a huge size":
        bad["size"] = 1 << 60
    elif entry == "a bad checksum":
        bad["checksum"] = "md5:abc"
    else:
        bad["handle"] = f"{prior}/{'x' * 2100}"
    acks, _ = _acks(coord, pending, (1, 2), ([bases[0]], [bases[1]]))
    raw = dataclasses.replace(acks[0])  # as it comes over the wire: not checked on the way
    meta = {**(raw.state_meta or {}), "chain": [bases[0], bad]}
    object.__setattr__(raw, "state_meta", meta)

    outcome = coord.receive_acknowledge(pending.checkpoint_id, [raw, *acks[1:]])

    refusal = outcome.refused[raw.attempt_id]
    assert says in refusal, refusal
    assert "state_meta.chain[1] " in refusal or "(chain.1.handle: " in refusal, refusal
    assert "\n" not in refusal
    row = checkpoint_row(metastore, pending.checkpoint_id)
    assert (row.status, row.failure_reason) == (CheckpointStatus.ABORTED, R.CHECKPOINT_DECLINED)
    assert all(_exists(storage, f["handle"]) for f in bases)
    if entry in ("the previous checkpoint's directory", "another job's shared state"):
        assert _exists(storage, bad["handle"])


def test_rejected_acks_lose_their_own_new_file_never_a_chain_entry(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = _coordinator(metastore, storage, clock)
    _, bases = _checkpoint(coord, (100, 200))
    pending = coord.trigger_checkpoint()
    own = storage.shared_checkpoint_url(JOB, pending.checkpoint_id)
    stray = _write(storage, f"{own}/stray.arrow", 3)
    meta = {"key_groups": [0, 7], "chain": [bases[0]]}
    unknown = [  # attempts not in the plan: UNKNOWN, their files are deleted where safe
        TaskAck("ghost-1", stray["handle"], 3, stray["checksum"], state_meta=meta),
        TaskAck("ghost-2", bases[1]["handle"], bases[1]["size"], bases[1]["checksum"]),
    ]
    outcome = coord.receive_acknowledge(pending.checkpoint_id, unknown)
    assert set(outcome.results.values()) == {AckResult.UNKNOWN}
    assert outcome.deleted_handles == [stray["handle"]]
    assert all(_exists(storage, f["handle"]) for f in bases)


# ================================================================ job end


@pytest.mark.parametrize("job_status", [JobStatus.FINISHED, JobStatus.CANCELED])
def test_job_end_keeps_exactly_the_files_of_the_checkpoints_it_keeps(
    job_status: JobStatus,
    metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
) -> None:
    coord = _coordinator(metastore, storage, clock, retained=2, retention="never_retain")
    _, bases = _checkpoint(coord, (100, 200))
    _, deltas2 = _checkpoint(coord, (1, 2), ([bases[0]], [bases[1]]))
    live, deltas3 = _checkpoint(coord, (3, 4), ([bases[0], deltas2[0]], [bases[1], deltas2[1]]))
    everything = bases + deltas2 + deltas3

    discarded = coord.shutdown(job_status)

    if job_status is JobStatus.FINISHED:  # the newest is the next run's state: all of it stays
        assert discarded == [2]
        assert checkpoint_row(metastore, 3).status == CheckpointStatus.COMPLETED
        assert all(_exists(storage, f["handle"]) for f in everything)
        assert _counts(metastore) == {f["handle"]: 1 for f in everything}
    else:  # never_retain: every checkpoint and every shared file goes
        assert sorted(discarded) == [2, 3]
        assert not any(_exists(storage, f["handle"]) for f in everything)
        assert not any(_shared_dir(storage, c).exists() for c in (1, 2, 3))
        assert not location_exists(storage, live.location)
        assert _counts(metastore) == {}


def test_disposal_never_deletes_a_released_file_outside_the_shared_dir(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = _coordinator(metastore, storage, clock)
    good, _ = _checkpoint(coord, (100, 200))
    private = good.metadata_path
    other = _write(storage, f"{storage.shared_checkpoint_url('job-b', 1)}/x.arrow", 1)["handle"]
    climbing = f"{storage.shared_url(JOB)}/../chk-{good.checkpoint_id}/{METADATA_FILE}"
    coord.cleaner.dispose(
        [store.Disposal(99, f"{storage.job_url(JOB)}/chk-99", (private, other, climbing))]
    )
    assert _exists(storage, private) and _exists(storage, other)


# ================================================================ schema


def test_the_upgrade_from_0002_keeps_the_checkpoints_and_their_sizes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    old = Metastore(url, check_schema=False)
    old.upgrade("0002")
    with old.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO ckpt_jobs (job_id, status, storage_url, timeout_ms, min_pause_ms,"
                " max_concurrent, tolerable_failures, retained, retention,"
                " prefer_checkpoint_for_recovery, next_checkpoint_id, periodic_scheduling,"
                " consecutive_failures, created_at, updated_at) VALUES ('old-job', 'RUNNING',"
                " 'file:///tmp/x', 600000, 0, 1, 0, 1, 'retain_on_failure', 0, 2, 0, 0,"
                " '2026-01-01 00:00:00', '2026-01-01 00:00:00')"
            )
        )
        conn.execute(
            text(
                "INSERT INTO ckpt_checkpoints (job_id, checkpoint_id, checkpoint_type, status,"
                " periodic, forced, discard_on_subsumed, discard_on_finished,"
                " discard_on_cancelled, discard_on_failed, discard_on_suspended, trigger_at,"
                " deadline_at, num_tasks, storage_location, state_size) VALUES ('old-job', 1,"
                " 'CHECKPOINT', 'COMPLETED', 0, 0, 1, 1, 1, 0, 1, '2026-01-01 00:00:00',"
                " '2026-01-01 00:10:00', 1, 'file:///tmp/x/old-job/chk-1', 123)"
            )
        )
    assert old.upgrade() == ("0002", Metastore.head_revision())
    old.dispose()
    engine = create_engine(url)
    with engine.connect() as conn:
        sizes = conn.execute(
            text("SELECT state_size, checkpointed_size FROM ckpt_checkpoints")
        ).all()
        assert [tuple(r) for r in sizes] == [(123, 123)]  # written in full before 0003
        assert conn.execute(text("SELECT count(*) FROM ckpt_shared_state")).scalar() == 0
    engine.dispose()
    from tests.test_schema import _diff

    assert _diff(url) == []
