"""The restore lookup: latest valid checkpoint, preference for checkpoints, fallback past corrupt
ones, and the restore record (``checkpointing.restore.lookup``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from checkpointing.clock import ManualClock
from checkpointing.coordination.store import CompletedCheckpoint
from checkpointing.errors import (
    CorruptSnapshotError,
    NoCheckpointError,
    UnknownCheckpointError,
    UnknownJobError,
)
from checkpointing.metastore.engine import Metastore
from checkpointing.restore.lookup import (
    SkippedCheckpoint,
    find_latest_valid,
    load_checkpoint,
    load_external,
    record_restore,
)
from checkpointing.state.storage import FileSystemCheckpointStorage
from checkpointing.status import CheckpointType, RestoreStatus
from tests.helpers import JOB, complete, new_coordinator, restore_rows

Corruption = Callable[[FileSystemCheckpointStorage, CompletedCheckpoint], tuple[str, str]]


def _flip_state_byte(
    storage: FileSystemCheckpointStorage, c: CompletedCheckpoint
) -> tuple[str, str]:
    handle = c.metadata.handles()[0].handle
    assert handle is not None
    p = storage.path_of(handle)
    data = bytearray(p.read_bytes())
    data[0] ^= 0x01
    p.write_bytes(bytes(data))
    return handle, "checksum mismatch"


def _delete_metadata(
    storage: FileSystemCheckpointStorage, c: CompletedCheckpoint
) -> tuple[str, str]:
    storage.path_of(c.metadata_path).unlink()
    return c.metadata_path, "file is missing"


def _truncate_metadata(
    storage: FileSystemCheckpointStorage, c: CompletedCheckpoint
) -> tuple[str, str]:
    p = storage.path_of(c.metadata_path)
    p.write_bytes(p.read_bytes()[:40])
    return c.metadata_path, "checksum mismatch"


CORRUPTIONS = {
    "flipped-state-byte": _flip_state_byte,
    "deleted-metadata": _delete_metadata,
    "truncated-metadata": _truncate_metadata,
}


def test_latest_completed_checkpoint_or_savepoint_is_chosen(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, retained=3)
    complete(coord)
    complete(coord)
    savepoint = complete(coord, savepoint=True)

    decision = find_latest_valid(metastore, storage, JOB)
    assert (decision.checkpoint_id, decision.checkpoint_type) == (3, CheckpointType.SAVEPOINT)
    assert decision.metadata_path == savepoint.metadata_path
    assert decision.metadata == savepoint.metadata
    assert decision.skipped == [] and not decision.start_empty

    latest = complete(coord)
    decision = find_latest_valid(metastore, storage, JOB)
    assert (decision.checkpoint_id, decision.checkpoint_type) == (4, CheckpointType.CHECKPOINT)
    assert decision.metadata == latest.metadata


def test_prefer_checkpoint_picks_the_latest_checkpoint_over_a_newer_savepoint(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, retained=3)
    complete(coord)
    complete(coord)
    complete(coord, savepoint=True)

    assert find_latest_valid(metastore, storage, JOB, prefer_checkpoint=True).checkpoint_id == 2
    assert find_latest_valid(metastore, storage, JOB, prefer_checkpoint=False).checkpoint_id == 3

    # the job's prefer_checkpoint_for_recovery is the default
    new_coordinator(metastore, storage, clock, retained=3, prefer_checkpoint_for_recovery=True)
    assert find_latest_valid(metastore, storage, JOB).checkpoint_id == 2


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_latest_falls_back_to_the_newest_valid_one_and_records_it(
    metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
    corruption: str,
) -> None:
    coord = new_coordinator(metastore, storage, clock, retained=3)
    done = [complete(coord) for _ in range(3)]
    where, why = CORRUPTIONS[corruption](storage, done[2])

    decision = find_latest_valid(metastore, storage, JOB)

    assert decision.checkpoint_id == 2
    assert decision.metadata == done[1].metadata
    assert decision.metadata_path == done[1].metadata_path
    [skipped] = decision.skipped
    assert skipped.checkpoint_id == 3
    assert where in skipped.reason and why in skipped.reason
    assert "skipped 3" in decision.describe()

    clock.advance(60)
    restore_id = record_restore(metastore, decision, attempt="try-2", parallelism=4, clock=clock)
    [event] = restore_rows(metastore)
    assert event.restore_id == restore_id
    assert (event.attempt, event.checkpoint_id, event.checkpoint_type) == (
        "try-2",
        2,
        CheckpointType.CHECKPOINT,
    )
    assert event.external_path == done[1].metadata_path
    assert event.status == RestoreStatus.PLANNED
    assert event.parallelism == 4
    assert event.created_at == clock.now()
    assert event.fallbacks == {"skipped": [{"checkpoint_id": 3, "reason": skipped.reason}]}


def test_fallback_walks_back_past_several_broken_checkpoints(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, retained=3)
    done = [complete(coord) for _ in range(3)]
    _delete_metadata(storage, done[2])
    _flip_state_byte(storage, done[1])

    decision = find_latest_valid(metastore, storage, JOB)
    assert decision.checkpoint_id == 1
    assert [s.checkpoint_id for s in decision.skipped] == [3, 2]


def test_shallow_verification_checks_sizes_but_not_checksums(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, retained=2)
    done = [complete(coord) for _ in range(2)]
    _flip_state_byte(storage, done[1])
    assert find_latest_valid(metastore, storage, JOB, deep=False).checkpoint_id == 2
    assert find_latest_valid(metastore, storage, JOB, deep=True).checkpoint_id == 1

    handle = done[1].metadata.handles()[1].handle
    assert handle is not None
    storage.path_of(handle).write_bytes(b"short")
    decision = find_latest_valid(metastore, storage, JOB, deep=False)
    assert decision.checkpoint_id == 1
    assert handle in decision.skipped[0].reason and "size" in decision.skipped[0].reason


def test_no_valid_checkpoint_starts_empty_or_fails_when_strict(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, retained=2)

    decision = find_latest_valid(metastore, storage, JOB)
    assert decision.start_empty and decision.checkpoint_id is None and decision.skipped == []
    with pytest.raises(NoCheckpointError):
        find_latest_valid(metastore, storage, JOB, strict=True)
    record_restore(metastore, decision, attempt="try-1", clock=clock)
    [event] = restore_rows(metastore)
    assert (event.status, event.checkpoint_id, event.fallbacks) == (RestoreStatus.EMPTY, None, None)

    # only broken checkpoints: the same, with the reasons
    for c in (complete(coord), complete(coord)):
        _delete_metadata(storage, c)
    decision = find_latest_valid(metastore, storage, JOB)
    assert decision.start_empty
    assert decision.skipped == [
        SkippedCheckpoint(2, f"{storage.checkpoint_url(JOB, 2)}/_metadata: file is missing"),
        SkippedCheckpoint(1, f"{storage.checkpoint_url(JOB, 1)}/_metadata: file is missing"),
    ]
    with pytest.raises(NoCheckpointError, match="file is missing"):
        find_latest_valid(metastore, storage, JOB, strict=True)


def test_unknown_job(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    new_coordinator(metastore, storage, clock)
    with pytest.raises(UnknownJobError):
        find_latest_valid(metastore, storage, "job-b")
    with pytest.raises(UnknownJobError):
        find_latest_valid(metastore, storage, "job-b", strict=True)


def test_load_a_specific_checkpoint(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, retained=2)
    done = [complete(coord) for _ in range(3)]  # 1 is subsumed

    decision = load_checkpoint(metastore, storage, JOB, 2)
    assert (decision.checkpoint_id, decision.metadata) == (2, done[1].metadata)
    assert decision.skipped == []
    with pytest.raises(UnknownCheckpointError, match="SUBSUMED"):
        load_checkpoint(metastore, storage, JOB, 1)
    with pytest.raises(UnknownCheckpointError):
        load_checkpoint(metastore, storage, JOB, 9)

    _flip_state_byte(storage, done[2])  # the user chose it: no fallback
    with pytest.raises(CorruptSnapshotError, match="checksum mismatch"):
        load_checkpoint(metastore, storage, JOB, 3)


def test_load_an_external_savepoint_by_path(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock)
    savepoint = complete(coord, savepoint=True)

    plain = savepoint.location.removeprefix("file://")  # a plain absolute path, as users type
    given_forms = (savepoint.location, savepoint.location + "/", savepoint.metadata_path, plain)
    for given in given_forms:
        decision = load_external(storage, given)
        assert (decision.job_id, decision.checkpoint_id) == (JOB, savepoint.checkpoint_id)
        assert decision.checkpoint_type == CheckpointType.SAVEPOINT
        assert decision.metadata_path == savepoint.metadata_path
        assert decision.metadata == savepoint.metadata

    _flip_state_byte(storage, savepoint)
    with pytest.raises(CorruptSnapshotError):
        load_external(storage, savepoint.location)
    assert load_external(storage, savepoint.location, deep=False).checkpoint_id == 1


def _forge_handle_outside(
    storage: FileSystemCheckpointStorage, c: CompletedCheckpoint, outside: str
) -> str:
    """Rewrite ``_metadata`` (with a valid embedded checksum) so one handle names ``outside``,
    a file with the right size and checksum: only the directory check can refuse it."""
    from checkpointing.state.metadata import OperatorState, SubtaskStateHandle

    data = b"not this checkpoint's state"
    info = storage.write_bytes(outside, data)
    op = c.metadata.operators[0]
    first = op.subtasks[0]
    forged_sub = SubtaskStateHandle(
        subtask_index=first.subtask_index,
        attempt_id=first.attempt_id,
        handle=info.url,
        size=info.size,
        checksum=info.checksum,
    )
    forged_op = OperatorState(
        operator_id=op.operator_id,
        parallelism=op.parallelism,
        max_parallelism=op.max_parallelism,
        subtasks=[forged_sub, *op.subtasks[1:]],
    )
    forged = c.metadata.model_copy(update={"operators": [forged_op, *c.metadata.operators[1:]]})
    return storage.write_bytes(c.metadata_path, forged.to_bytes()).checksum


def test_a_metadata_handle_outside_its_checkpoint_is_refused(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    from sqlalchemy import update

    from checkpointing.metastore.models import Checkpoint

    coord = new_coordinator(metastore, storage, clock, retained=3)
    first, second = complete(coord), complete(coord)
    outside = f"{storage.job_url('other-job')}/chk-1/stolen"
    checksum = _forge_handle_outside(storage, second, outside)
    with metastore.transaction() as s:  # even with the metastore agreeing with the file
        s.execute(
            update(Checkpoint)
            .where(Checkpoint.job_id == JOB, Checkpoint.checkpoint_id == second.checkpoint_id)
            .values(metadata_checksum=checksum)
        )

    decision = find_latest_valid(metastore, storage, JOB)
    assert decision.checkpoint_id == first.checkpoint_id
    [skipped] = decision.skipped
    assert outside in skipped.reason and "outside the checkpoint's directory" in skipped.reason

    with pytest.raises(CorruptSnapshotError, match="outside the checkpoint's directory"):
        load_external(storage, second.location)


def test_a_rows_metadata_path_is_read_only_where_the_ids_say_it_lives(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    """Issue 38: a row is anyone's to write (any driver has the metastore URL). A checkpoint
    row pointed at a copy of its own, valid ``_metadata`` elsewhere (checksum and all) is not
    restored from that place; nor is a row without the checksum completion records."""
    from sqlalchemy import update

    from checkpointing.metastore.models import Checkpoint

    coord = new_coordinator(metastore, storage, clock, retained=3)
    first, second, third = complete(coord), complete(coord), complete(coord)
    elsewhere = f"{storage.base_url}/planted/chk-{second.checkpoint_id}/_metadata"
    copied = storage.write_bytes(elsewhere, storage.read_bytes(second.metadata_path))
    with metastore.transaction() as s:
        for c, values in (
            (third, {"metadata_checksum": None}),
            (second, {"metadata_path": elsewhere, "metadata_checksum": copied.checksum}),
        ):
            s.execute(
                update(Checkpoint)
                .where(Checkpoint.job_id == JOB, Checkpoint.checkpoint_id == c.checkpoint_id)
                .values(**values)
            )
    decision = find_latest_valid(metastore, storage, JOB)
    assert decision.checkpoint_id == first.checkpoint_id
    no_checksum, moved = decision.skipped
    assert "no metadata checksum recorded" in no_checksum.reason
    assert elsewhere in moved.reason and "not where checkpoint 2 of job" in moved.reason
    with pytest.raises(CorruptSnapshotError, match="not where checkpoint 2"):
        load_checkpoint(metastore, storage, JOB, second.checkpoint_id)


def test_a_savepoint_rows_target_path_is_read_only_inside_an_allowed_root(
    metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 38: a COMPLETED savepoint row pointed at ``/anywhere/savepoint-<id>/_metadata``
    (a copy of its own, checksum and all) is not read there: a target's path counts only
    inside an allowed storage root, and is refused before any read."""
    from sqlalchemy import update

    from checkpointing.metastore.models import Checkpoint

    monkeypatch.setenv("CKPT_STORAGE_URL", storage.base_url)
    monkeypatch.delenv("CKPT_STORAGE_ROOTS", raising=False)
    savepoint = complete(new_coordinator(metastore, storage, clock), savepoint=True)
    anywhere = f"file://{tmp_path}/anywhere/savepoint-{savepoint.checkpoint_id}/_metadata"
    copied = storage.write_bytes(anywhere, storage.read_bytes(savepoint.metadata_path))
    with metastore.transaction() as s:
        s.execute(
            update(Checkpoint)
            .where(Checkpoint.job_id == JOB, Checkpoint.checkpoint_id == savepoint.checkpoint_id)
            .values(metadata_path=anywhere, metadata_checksum=copied.checksum)
        )
    refusal = f"job {JOB!r}: savepoint {savepoint.checkpoint_id}'s _metadata .* is not under an"
    with pytest.raises(CorruptSnapshotError, match=refusal):
        load_checkpoint(metastore, storage, JOB, savepoint.checkpoint_id)
    decision = find_latest_valid(metastore, storage, JOB)
    assert decision.checkpoint_id is None
    [skipped] = decision.skipped
    assert "not under an allowed checkpoint storage root" in skipped.reason
