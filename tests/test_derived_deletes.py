"""Deletes derive their target from ids, never from a metastore row (issue 38).

Every Spark driver can write metastore rows, so a row's ``storage_location`` is only compared
with the directory the ids give (``<job>/chk-<id>``, ``<job>/savepoints/savepoint-<id>``,
``<job>/shared/chk-<id>``): a row pointing anywhere else, the storage base included, deletes
nothing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from sqlalchemy import update

from checkpointing.clock import ManualClock
from checkpointing.coordination import savepoints
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint
from checkpointing.state.storage import FileSystemCheckpointStorage, RefusedDeleteError
from checkpointing.status import CheckpointStatus
from tests.helpers import JOB, checkpoint_row, complete, new_coordinator


def _plant(metastore: Metastore, checkpoint_id: int, location: str) -> None:
    """What pipeline code with the metastore URL can do: point a row elsewhere."""
    with metastore.transaction() as s:
        s.execute(
            update(Checkpoint)
            .where(Checkpoint.job_id == JOB, Checkpoint.checkpoint_id == checkpoint_id)
            .values(storage_location=location)
        )


def _victim(tmp_path: Path) -> tuple[Path, Path]:
    victim = tmp_path / "victim"
    (victim / "deep").mkdir(parents=True)
    precious = victim / "deep" / "precious.txt"
    precious.write_text("not yours")
    return victim, precious


@pytest.mark.parametrize("where", ["outside", "base", "job"])
def test_an_expired_checkpoint_whose_row_points_elsewhere_deletes_nothing(
    sqlite_metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
    tmp_path: Path,
    where: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Scenario A: a PENDING row with ``storage_location`` outside the storage, the storage
    base itself, or the job's own directory, past its deadline: the job's coordinator expires
    it and the tree the row names survives."""
    victim, precious = _victim(tmp_path)
    older = complete(new_coordinator(sqlite_metastore, storage, clock))  # a file in the base
    base_file = storage.path_of(older.metadata_path)
    assert base_file.exists()
    target = {
        "outside": f"file://{victim}",
        "base": storage.base_url,
        "job": storage.job_url(JOB),
    }[where]

    coord = new_coordinator(sqlite_metastore, storage, clock, timeout="10s")
    pending = coord.trigger_checkpoint()
    _plant(sqlite_metastore, pending.checkpoint_id, target)
    clock.advance(11)
    with caplog.at_level(logging.ERROR):
        assert len(coord.expire_overdue()) == 1
    assert checkpoint_row(sqlite_metastore, pending.checkpoint_id).status == "ABORTED"
    assert precious.read_text() == "not yours"
    assert base_file.exists(), "nothing else in the storage was deleted"
    refusals = [r for r in caplog.records if "not deleting" in r.getMessage()]
    assert len(refusals) == 1 and target in refusals[0].getMessage()


def test_an_expired_checkpoint_with_its_own_location_is_deleted(
    sqlite_metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(sqlite_metastore, storage, clock, timeout="10s")
    pending = coord.trigger_checkpoint()
    directory = storage.path_of(storage.checkpoint_url(JOB, pending.checkpoint_id))
    assert directory.is_dir()
    clock.advance(11)
    coord.expire_overdue()
    assert not directory.exists()


def test_a_discarded_savepoint_whose_row_points_elsewhere_deletes_nothing(
    sqlite_metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
    tmp_path: Path,
) -> None:
    """Scenario B: a COMPLETED savepoint row of one's own job pointing at an outside directory
    (or the storage base): the discard is refused, nothing is deleted, the row stays
    COMPLETED; the savepoint's own directory is deleted once the row is honest again."""
    victim, precious = _victim(tmp_path)
    coord = new_coordinator(sqlite_metastore, storage, clock)
    savepoint = complete(coord, savepoint=True)
    own = storage.savepoint_url(JOB, savepoint.checkpoint_id)
    assert savepoint.location == own
    for target in (f"file://{victim}", storage.base_url, f"file://{tmp_path}"):
        _plant(sqlite_metastore, savepoint.checkpoint_id, target)
        with pytest.raises(RefusedDeleteError, match=r"not .* as the ids give it"):
            savepoints.discard_savepoint(sqlite_metastore, storage, JOB, savepoint.checkpoint_id)
        assert precious.read_text() == "not yours"
        assert storage.exists(f"{own}/_metadata")
        row = checkpoint_row(sqlite_metastore, savepoint.checkpoint_id)
        assert row.status == CheckpointStatus.COMPLETED

    _plant(sqlite_metastore, savepoint.checkpoint_id, own)
    assert savepoints.discard_savepoint(
        sqlite_metastore, storage, JOB, savepoint.checkpoint_id
    ) == (own)
    assert not storage.path_of(own).exists()
    assert checkpoint_row(sqlite_metastore, savepoint.checkpoint_id).status == "DISCARDED"


def test_a_retention_release_whose_row_points_elsewhere_deletes_nothing(
    sqlite_metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
    tmp_path: Path,
) -> None:
    """A completed checkpoint's row pointed at another tree before it is subsumed: the
    subsumption deletes neither that tree nor the checkpoint's directory."""
    victim, precious = _victim(tmp_path)
    coord = new_coordinator(sqlite_metastore, storage, clock, retained=1)
    first = complete(coord)
    _plant(sqlite_metastore, first.checkpoint_id, f"file://{victim}")
    complete(coord)  # subsumes the first
    assert checkpoint_row(sqlite_metastore, first.checkpoint_id).status == "SUBSUMED"
    assert precious.read_text() == "not yours"


def test_deletable_directories_come_from_ids_only(storage: FileSystemCheckpointStorage) -> None:
    job = storage.job_url(JOB)
    assert storage.owned_directory(JOB, 3, "checkpoint") == f"{job}/chk-3"
    assert storage.owned_directory(JOB, 3, "savepoint") == f"{job}/savepoints/savepoint-3"
    assert storage.owned_directory(JOB, 3, "shared") == f"{job}/shared/chk-3"
    for recorded in (storage.base_url, job, f"{job}/chk-4", "file:///", f"{job}/chk-3/x"):
        with pytest.raises(RefusedDeleteError):
            storage.discard_directory(JOB, 3, "checkpoint", recorded=recorded)
    for bad in ("..", "a/b", ""):
        with pytest.raises(RefusedDeleteError):
            storage.discard_directory(bad, 3, "checkpoint")
    with pytest.raises(ValueError, match="unknown directory kind"):
        storage.owned_directory(JOB, 3, "job")
    for url in (storage.base_url, "file:///", storage.base_url.rsplit("/", 1)[0]):
        with pytest.raises(Exception, match="or above it"):
            storage.location_for(url)


@pytest.mark.parametrize("where", ["outside", "other-job", "job"])
def test_a_pending_row_pointed_elsewhere_steers_no_metadata_write(
    sqlite_metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
    tmp_path: Path,
    where: str,
) -> None:
    """A driver points its own job's PENDING row at another directory (outside every storage
    root, another job's checkpoint, or the job's own directory) and acks with files there:
    the coordinator declines that checkpoint and writes no ``_metadata`` anywhere."""
    from checkpointing.coordination.pending import TaskAck

    coord = new_coordinator(sqlite_metastore, storage, clock)
    pending = coord.trigger_checkpoint()
    cid = pending.checkpoint_id
    forged = {
        "outside": f"file://{tmp_path / 'opt-airflow' / 'x'}",
        "other-job": storage.checkpoint_url("other-job", cid),
        "job": storage.job_url(JOB),
    }[where]
    _plant(sqlite_metastore, cid, forged)
    acks = []
    for t in pending.tasks:  # the driver can write files wherever its host lets it
        info = storage.write_bytes(f"{forged}/{t.operator_id}-{t.attempt_id}", b"state")
        acks.append(TaskAck(t.attempt_id, info.url, info.size, info.checksum))
    outcome = coord.receive_acknowledge(cid, acks)
    assert outcome.completed is None
    assert checkpoint_row(sqlite_metastore, cid).status == "ABORTED"
    assert not storage.path_of(f"{forged}/_metadata").exists()
    assert not list(storage.path_of(storage.base_url).rglob("_metadata"))


def test_a_rows_location_is_taken_only_where_the_ids_put_it(
    storage: FileSystemCheckpointStorage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``location_for`` with ids (the coordinator's write of ``_metadata``): the derived
    directories, or a target's ``savepoint-<id>`` inside an allowed root; else one line
    naming the job and the checkpoint."""
    from checkpointing.state.storage_roots import DisallowedStorageError

    monkeypatch.setenv("CKPT_STORAGE_URL", storage.base_url)
    monkeypatch.setenv("CKPT_STORAGE_ROOTS", f"file://{tmp_path / 'targets'}")
    ids = {"job_id": JOB, "checkpoint_id": 7}
    for ok in (
        storage.checkpoint_url(JOB, 7),
        storage.savepoint_url(JOB, 7),
        f"file://{tmp_path / 'targets' / 'release'}/savepoint-7",
    ):
        assert storage.location_for(ok, **ids).url == ok
    for bad, why in (
        (f"file://{tmp_path / 'opt'}/savepoint-7", "not under an allowed checkpoint storage"),
        (f"file://{tmp_path / 'targets' / 'x'}", "is not where its ids put it"),
        (storage.checkpoint_url(JOB, 8), "is not where its ids put it"),
        (storage.checkpoint_url("other-job", 7), "is not where its ids put it"),
    ):
        with pytest.raises(DisallowedStorageError) as info:
            storage.location_for(bad, **ids)
        message = str(info.value)
        assert message.startswith(f"job {JOB!r}: checkpoint 7's storage_location "), message
        assert why in message and "\n" not in message
