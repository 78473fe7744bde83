"""The Spark runtime under failures, on real local Spark: a corrupt newest snapshot (fallback to
the previous checkpoint), bad inputs (no files, a malformed CSV row, an unusable key column),
refused and explicit restore choices, and a savepoint requested by another coordinator while the
job runs, then restored by path into a fresh job. Every recovered run's output must equal that of
a run that never failed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import select

from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.metastore import views
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint, CheckpointRequest
from checkpointing.pipeline.spec import SpecError
from checkpointing.restore import lookup as restore
from checkpointing.state.storage import FileSystemCheckpointStorage
from checkpointing.status import CheckpointType
from tests.spark_pipeline import (
    EPOCHS,
    assert_equals_reference,
    assert_matches_pandas,
    completed_ids,
    events_spec,
    make_spec,
    run,
    sink_of,
    tables,
)

sqlite_only = pytest.mark.parametrize("metastore_url", ["sqlite"], indirect=True)


@pytest.fixture(scope="module")
def events(runtime_events: Path) -> Path:
    return runtime_events


@pytest.fixture(scope="module")
def reference(runtime_reference: Any) -> Any:
    return runtime_reference


# ---------------------------------------------------------------- 1. corrupt newest snapshot


@pytest.mark.parametrize("metastore_url", ["sqlite"], indirect=True)  # Spark: one backend
def test_corrupt_newest_snapshot_falls_back_to_the_previous_checkpoint(
    spark: Any, events: Path, tmp_path: Path, metastore_url: str, reference: Any
) -> None:
    from checkpointing.spark.runtime import SimulatedCrash

    # full snapshots: the newest checkpoint's own file is corrupted (a corrupt shared file of
    # incremental ones: tests/test_incremental_checkpoints.py)
    spec = events_spec(
        tmp_path,
        events,
        "corrupt",
        checkpoint={"every_epochs": 1, "retained": 2, "incremental": False},
    )
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=3)
    retained = completed_ids(metastore, "corrupt")
    assert len(retained) == 2  # retained: 2 of the three completed checkpoints
    previous, newest = retained
    assert sink_of(spec).committed_epochs() == [0, 1, 2]

    newest_dir = storage.path_of(storage.checkpoint_url("corrupt", newest))
    victim = next(p for p in sorted(newest_dir.glob("aggregate-*.arrow")) if p.stat().st_size > 100)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the checksum can tell
    victim.write_bytes(bytes(data))

    resumed = run(spark, spec, metastore, storage, restore="latest")
    assert resumed.restored_from == previous
    assert resumed.epochs_run == [2, 3, 4, 5]  # the previous checkpoint covers epochs 0 and 1
    assert_equals_reference(spark, spec, reference)

    event = views.list_restores(metastore, "corrupt")[0]  # newest first
    assert event["checkpoint_id"] == previous
    assert event["attempt"] != views.list_restores(metastore, "corrupt")[1]["attempt"]
    assert [s["checkpoint_id"] for s in event["fallbacks"]] == [newest]
    assert victim.name in event["fallbacks"][0]["reason"]
    assert "checksum" in event["fallbacks"][0]["reason"].lower()


# ---------------------------------------------------------------- 2. bad inputs


def test_source_glob_matching_no_files_is_a_spec_error(
    spark: Any, tmp_path: Path, metastore_url: str
) -> None:
    (tmp_path / "empty").mkdir()
    source = f'{{format: parquet, path: "{tmp_path}/empty/*.parquet"}}'
    spec = make_spec(tmp_path, "noinput", source)
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SpecError, match=r"source\.path: .*empty/\*\.parquet.* matches no files"):
        run(spark, spec, metastore, storage)
    assert not sink_of(spec).path.exists()
    assert views.list_jobs(metastore) == []  # refused before the job was registered
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    ("key", "column", "problem"),
    [
        ("account", "account", "is not in the input"),
        ("amount", "amount", "has type double"),
        ("[user, amount]", "amount", "has type double"),
    ],
)
def test_unusable_key_column_fails_before_anything_is_written(
    spark: Any,
    events: Path,
    tmp_path: Path,
    metastore_url: str,
    key: str,
    column: str,
    problem: str,
) -> None:
    import yaml

    spec = events_spec(tmp_path, events, "badkey", key=yaml.safe_load(key))
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(ValueError, match=rf"key: column '{column}' {problem}"):
        run(spark, spec, metastore, storage)
    sink = sink_of(spec)
    assert sink.staged_epochs() == [] and sink.committed_epochs() == []
    assert not sink.final_link.exists()
    assert views.list_checkpoints(metastore, "badkey") == []
    ckpt_dir = tmp_path / "ckpt"
    assert not ckpt_dir.exists() or not [p for p in ckpt_dir.rglob("*") if p.is_file()]


def _csv_frames(seed: int = 7) -> list[pd.DataFrame]:
    rng = np.random.default_rng(seed)
    frames = []
    for _ in range(4):
        n = 120
        frames.append(
            pd.DataFrame(
                {
                    "user": [f"u{k}" for k in rng.integers(0, 25, size=n)],
                    "amount": np.round(rng.gamma(2.0, 20.0, size=n), 2) + 0.25,
                    "quantity": rng.integers(1, 10, size=n),
                }
            )
        )
    return frames


@sqlite_only
@pytest.mark.parametrize(
    "bad_row", ["u3,12.50,lots", "u3,12.50,4,surplus"], ids=["non-numeric", "too-many-fields"]
)
def test_malformed_csv_row_fails_the_run_and_loses_nothing(
    spark: Any, tmp_path: Path, metastore_url: str, bad_row: str
) -> None:
    from checkpointing.spark.state import through_epoch

    data = tmp_path / "csv"
    data.mkdir()
    frames = _csv_frames()
    paths = [data / f"part-{i}.csv" for i in range(len(frames))]
    for frame, path in zip(frames, paths, strict=True):
        frame.to_csv(path, index=False)
    good = paths[2].read_text()
    lines = good.splitlines(keepends=True)
    paths[2].write_text("".join([*lines[:50], bad_row + "\n", *lines[50:]]))

    source = f'{{format: csv, path: "{data}/*.csv", splits_per_epoch: 1, header: true}}'
    spec = make_spec(tmp_path, "csvjob", source)
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    from checkpointing.spark.runtime import InputError

    with pytest.raises(InputError, match="Malformed records are detected") as failure:
        run(spark, spec, metastore, storage)
    message = str(failure.value)
    assert message.startswith("job csvjob: epoch 2 failed reading part-2.csv: ")
    assert "\tat org.apache" not in message  # no JVM stack
    assert len(message.splitlines()) == 1
    assert bad_row.rsplit(",", 1)[1] in message  # the offending value or record

    sink = sink_of(spec)
    last = completed_ids(metastore, "csvjob")[-1]
    decision = restore.load_checkpoint(metastore, storage, "csvjob", last)
    assert decision.metadata is not None
    covered = through_epoch(decision.metadata, len(paths))
    assert covered == 1  # epochs 0 and 1 were checkpointed; epoch 2 failed
    assert sink.committed_epochs() == [0, 1]
    assert sink.staged_epochs() == []
    assert not sink.final_link.exists() and not list(sink.path.glob("final-*"))
    assert not [r for r in views.list_checkpoints(metastore, "csvjob") if r["status"] == "PENDING"]

    paths[2].write_text(good)  # fix the file, then resume
    resumed = run(spark, spec, metastore, storage)
    assert resumed.restored_from == last
    assert resumed.epochs_run == [2, 3]
    final, changelog = tables(spark, spec)
    assert_matches_pandas(final, frames)
    assert sorted(changelog.epoch.unique()) == [0, 1, 2, 3]
    # every epoch's changelog rows are exactly the keys that epoch touched
    for epoch, frame in enumerate(frames):
        touched = sorted(changelog[changelog.epoch == epoch].user)
        assert touched == sorted(frame.user.unique())


# ---------------------------------------------------------------- 3. restore choices


@sqlite_only
def test_restore_none_is_refused_on_committed_output_and_an_older_checkpoint_id_resumes(
    spark: Any, events: Path, tmp_path: Path, metastore_url: str, reference: Any
) -> None:
    from checkpointing.spark.runtime import SimulatedCrash

    spec = events_spec(tmp_path, events, "choices")
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=2)
    older, newest = completed_ids(metastore, "choices")
    sink = sink_of(spec)
    assert sink.committed_epochs() == [0, 1]

    with pytest.raises(SpecError, match=r"sink\.path: .*choices-out holds committed epochs 0 to 1"):
        run(spark, spec, metastore, storage, restore="none")
    assert sink.committed_epochs() == [0, 1]  # untouched
    assert completed_ids(metastore, "choices") == [older, newest]

    resumed = run(spark, spec, metastore, storage, restore=str(older))
    assert resumed.restored_from == older
    assert resumed.epochs_run == [1, 2, 3, 4, 5]  # epoch 1 (after the older checkpoint) redone
    assert_equals_reference(spark, spec, reference)
    event = views.list_restores(metastore, "choices")[0]
    assert event["checkpoint_id"] == older and event["fallbacks"] == []


@sqlite_only
def test_incremental_runs_process_only_new_files_and_equal_one_run(
    spark: Any, events: Path, tmp_path: Path, metastore_url: str, reference: Any
) -> None:
    """A finished job keeps its final checkpoint (the input it consumed): a rerun with
    ``--restore latest`` restores it and processes only the files that landed since, so runs
    over growing input equal one run over all of it (final table and changelog); a rerun with
    nothing new does nothing; a consumed file that changed is refused by name before anything is
    written; with the checkpoint gone, starting empty over the committed output is refused."""
    import shutil

    from checkpointing.spark.preflight import RunOptions, check_run

    inbox = tmp_path / "inbox"
    inbox.mkdir()
    files = sorted(events.glob("*.parquet"))
    for f in files[:2]:
        shutil.copy(f, inbox / f.name)
    spec = events_spec(tmp_path, inbox, "daily")
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    first = run(spark, spec, metastore, storage)
    assert first.epochs_run == [0, 1]
    live = completed_ids(metastore, "daily")
    assert live == [first.checkpoints[-1]]  # kept on FINISHED: the job's live state

    idle = run(spark, spec, metastore, storage)  # nothing new: restores, runs nothing
    assert (idle.restored_from, idle.epochs_run) == (live[0], [])
    assert completed_ids(metastore, "daily") == live

    for f in files[2:4]:
        shutil.copy(f, inbox / f.name)
    second = run(spark, spec, metastore, storage)
    assert (second.restored_from, second.epochs_run) == (live[0], [2, 3])
    for f in files[4:]:
        shutil.copy(f, inbox / f.name)
    third = run(spark, spec, metastore, storage, parallelism=3)  # rescaled, too
    assert third.epochs_run == list(range(4, EPOCHS))
    assert_equals_reference(spark, spec, reference)  # = one run over every file

    # a consumed file replaced: refused by name, before anything is written
    sink = sink_of(spec)
    committed = sink.committed_epochs()
    restores = views.list_restores(metastore, "daily")
    victim = inbox / files[1].name
    victim.write_bytes(victim.read_bytes())  # same bytes, a new mtime: another version
    refused = rf"source: {victim} was read by checkpoint \d+ and has changed since"
    with pytest.raises(SpecError, match=refused):
        check_run(spec, RunOptions(restore="latest"), storage, metastore)
    with pytest.raises(SpecError, match=refused):
        run(spark, spec, metastore, storage)
    assert views.list_restores(metastore, "daily") == restores
    shutil.copy(files[1], victim)

    # the checkpoint gone: starting empty over the committed changelog is refused
    shutil.rmtree(tmp_path / "ckpt")
    refused = (
        rf"sink\.path: .*daily-out holds committed epochs 0 to {committed[-1]} .*"
        "job daily has no checkpoint to resume from"
    )
    with pytest.raises(SpecError, match=refused):
        check_run(spec, RunOptions(restore="latest"), storage, metastore)
    with pytest.raises(SpecError, match=refused):
        run(spark, spec, metastore, storage)
    assert sink.committed_epochs() == committed
    assert_equals_reference(spark, spec, reference)  # the output, intact


# ---------------------------------------------------------------- 4. savepoint from outside


# PostgreSQL: two coordinators of one job, as in production (the protocol's unit tests run on both)
@pytest.mark.parametrize("metastore_url", ["postgresql"], indirect=True)
def test_savepoint_requested_by_another_coordinator_restores_into_a_fresh_job(
    spark: Any,
    events: Path,
    tmp_path: Path,
    metastore_url: str,
    reference: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = events_spec(tmp_path, events, "origin")
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    monkeypatch.setenv("CKPT_STORAGE_ROOTS", storage.base_url)  # the other coordinator joins
    requests: list[int] = []

    def after_epoch(epoch: int, _elapsed_ms: int) -> None:
        if epoch == 1:  # another process asks, through the metastore only
            other = CheckpointCoordinator("origin", Metastore(metastore_url))
            requests.append(other.request(CheckpointType.SAVEPOINT, requested_by="test"))

    result = run(spark, spec, metastore, storage, on_epoch=after_epoch)
    assert result.epochs_run == list(range(EPOCHS))
    assert_equals_reference(spark, spec, reference)

    savepoints = completed_ids(metastore, "origin", "SAVEPOINT")
    assert len(savepoints) == 1
    savepoint = savepoints[0]
    assert savepoint in result.checkpoints
    with metastore.transaction() as s:
        row = s.get(Checkpoint, ("origin", savepoint))
        assert row is not None
        metadata_path = row.metadata_path
        request = s.scalars(
            select(CheckpointRequest).where(CheckpointRequest.request_id == requests[0])
        ).one()
        assert request.checkpoint_id == savepoint
        assert request.requested_by == "test"
    directory = storage.savepoint_url("origin", savepoint)
    assert metadata_path == f"{directory}/_metadata"
    decision = restore.load_external(storage, directory)
    assert decision.metadata is not None
    # triggered at the next epoch boundary after the request: it covers epochs 0..2
    from checkpointing.spark.state import through_epoch

    assert through_epoch(decision.metadata, EPOCHS) == 2

    fresh = events_spec(tmp_path, events, "fromsavepoint")
    # another job's savepoint: refused unless asked for (issue 10), then recorded as such
    with pytest.raises(restore.ForeignSnapshotError, match="of job origin, not of job fromsav"):
        run(spark, fresh, metastore, storage, restore=directory)
    restored = run(spark, fresh, metastore, storage, restore=directory, allow_other_job=True)
    assert restored.restored_from == savepoint
    assert restored.epochs_run == [3, 4, 5]
    final, changelog = tables(spark, fresh)
    pd.testing.assert_frame_equal(final, reference[0])
    later = reference[1][reference[1].epoch >= 3].reset_index(drop=True)
    pd.testing.assert_frame_equal(changelog, later)

    events_of_fresh = views.list_restores(metastore, "fromsavepoint")
    assert len(events_of_fresh) == 1, "the restore is recorded under the job that restored"
    assert events_of_fresh[0]["attempt"] != views.list_restores(metastore, "origin")[0]["attempt"]
    assert events_of_fresh[0]["checkpoint_id"] == savepoint
    assert events_of_fresh[0]["external_path"] == metadata_path
    assert events_of_fresh[0]["checkpoint_type"] == "SAVEPOINT"
    assert len(views.list_restores(metastore, "origin")) == 1  # only its own (empty) start

    # a metastore that has never heard of the savepoint's job (another deployment)
    other_url = f"sqlite:///{tmp_path / 'other-metastore.db'}"
    Metastore(other_url, check_schema=False).upgrade()
    other = Metastore(other_url)
    elsewhere = events_spec(tmp_path, events, "elsewhere")
    moved = run(spark, elsewhere, other, storage, restore=directory, allow_other_job=True)
    assert moved.restored_from == savepoint
    assert moved.epochs_run == [3, 4, 5]
    final, _changelog = tables(spark, elsewhere)
    pd.testing.assert_frame_equal(final, reference[0])
    assert [e["checkpoint_id"] for e in views.list_restores(other, "elsewhere")] == [savepoint]
