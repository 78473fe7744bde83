"""Input splits: big Parquet files become runs of row groups (planned from footers alone), and on
real Spark a job over one big file split across epochs — crashed, then resumed at another
parallelism — equals an independent pandas computation; a restore whose input no longer matches
the checkpoint's remaining splits is refused, naming what differs. With ``epoch_bytes`` epochs are
sized by work (splits packed up to that many bytes) the same way on a fresh run, a restore and an
incremental run, and the run's log says how they were planned."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline import splits as planning
from checkpointing.pipeline.spec import SpecError
from checkpointing.pipeline.splits import (
    InputSplit,
    SplitError,
    describe_epochs,
    epochs_by_bytes,
    epochs_of,
    plan_splits,
    processed_item,
    resume,
)
from checkpointing.state.storage import FileSystemCheckpointStorage
from tests.spark_pipeline import assert_matches_pandas, make_spec, run, tables

ROWS, ROW_GROUP = 6_000, 500  # 12 row groups in the big file


def write_big(path: Path, seed: int = 11) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame(
        {
            "user": [f"u{k:03d}" for k in rng.integers(0, 250, ROWS)],
            "amount": np.where(rng.random(ROWS) < 0.05, np.nan, rng.normal(50, 20, ROWS)),
            "quantity": rng.integers(1, 9, ROWS),
        }
    )
    pq.write_table(
        pa.Table.from_pandas(frame, preserve_index=False), path, row_group_size=ROW_GROUP
    )
    return frame


def test_small_files_stay_whole_and_big_ones_split_by_row_groups(tmp_path: Path) -> None:
    big = tmp_path / "big.parquet"
    write_big(big)
    small = tmp_path / "small.parquet"
    pq.write_table(pa.table({"user": ["a"], "amount": [1.0], "quantity": [1]}), small)
    group_bytes = pq.ParquetFile(big).metadata.row_group(0).column(0).total_compressed_size
    limit = big.stat().st_size // 4
    splits = plan_splits([str(big), str(small)], "parquet", limit)
    ranged = [s.row_groups for s in splits if s.row_groups is not None]
    rows = sum(s.rows or 0 for s in splits if s.row_groups is not None)
    identity = {"size": small.stat().st_size, "mtime": small.stat().st_mtime_ns}
    assert splits[-1] == InputSplit(str(small), **identity)  # a local file's version: size, mtime
    # consecutive, non-overlapping runs covering all 12 row groups, every row counted once
    assert ranged[0][0] == 0 and ranged[-1][1] == 12
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranged))
    assert rows == ROWS
    assert 2 <= len(ranged) <= 12 and group_bytes < limit
    # deterministic: the same files and limit give the same splits (a checkpoint names them)
    assert plan_splits([str(big), str(small)], "parquet", limit) == splits
    # a limit below one row group still makes progress: one group per split
    assert len(plan_splits([str(big)], "parquet", 1)) == 12
    assert [s.path for s in plan_splits([str(big)], "parquet", None)] == [str(big)]


def test_split_state_round_trips_and_describes_itself() -> None:
    split = InputSplit("/data/big.parquet", (3, 5), 1000)
    item = split.to_state(7)
    assert item == {"path": "/data/big.parquet", "epoch": 7, "row_groups": [3, 5]}
    assert InputSplit.from_state(item) == InputSplit("/data/big.parquet", (3, 5))
    assert split.describe() == "big.parquet[row groups 3-4]"
    assert InputSplit.from_state({"path": "/d/x.csv", "epoch": 0}).describe() == "x.csv"
    assert [len(e) for e in epochs_of([InputSplit(str(i)) for i in range(5)], 2)] == [2, 2, 1]


def test_splitting_is_refused_for_csv_and_unreadable_footers(tmp_path: Path) -> None:
    with pytest.raises(SplitError, match=r"source.max_split_bytes: .*parquet only, not csv"):
        plan_splits([str(tmp_path / "a.csv")], "csv", 10)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all" * 100)
    with pytest.raises(SplitError, match=r"broken\.parquet: cannot read its Parquet footer"):
        plan_splits([str(broken)], "parquet", 10)


def test_max_split_bytes_is_validated_in_the_spec(tmp_path: Path) -> None:
    source = f'{{format: parquet, path: "{tmp_path}/*.parquet", max_split_bytes: 0}}'
    with pytest.raises(SpecError, match="max_split_bytes"):
        make_spec(tmp_path, "bad", source)
    # the input in a folder of its own: a sink beside the spec may not lie inside the input
    source = f'{{format: parquet, path: "{tmp_path}/data/*.parquet", max_split_bytes: 64KiB}}'
    assert make_spec(tmp_path, "ok", source).source.max_split_bytes == 64 * 1024


# ------------------------------------------------------------ epochs sized by bytes (no Spark)


def sized_files(folder: Path, sizes: list[int]) -> list[str]:
    """Files of ``sizes`` bytes, named in listing order: planning reads only their sizes."""
    folder.mkdir(exist_ok=True)
    paths = []
    for i, size in enumerate(sizes):
        path = folder / f"part-{i:03d}.csv"
        path.write_bytes(b"x" * size)
        paths.append(str(path))
    return paths


def sizes_of(epochs: list[list[InputSplit]]) -> list[list[int | None]]:
    return [[s.planned_bytes for s in e] for e in epochs]


def test_epoch_bytes_packs_consecutive_splits_up_to_the_limit(tmp_path: Path) -> None:
    files = sized_files(tmp_path / "in", [30, 30, 30, 100, 10, 10, 32, 32])
    splits = plan_splits(files, "csv", None)
    epochs = epochs_by_bytes(splits, 64)
    # up to the limit inclusive; a split bigger than it is an epoch alone; never an empty epoch
    assert sizes_of(epochs) == [[30, 30], [30], [100], [10, 10, 32], [32]]
    assert [s for e in epochs for s in e] == splits  # every split once, in listing order
    assert epochs_by_bytes(plan_splits(files, "csv", None), 64) == epochs  # deterministic
    assert epochs_by_bytes(splits, 1) == [[s] for s in splits]
    assert epochs_by_bytes(splits, 10**9) == [splits]
    # the default stays one split per epoch (splits_per_epoch 1, no epoch_bytes)
    assert planning.plan_epochs(splits, 1, None) == [[s] for s in splits]
    assert planning.plan_epochs(splits, 3, None) == epochs_of(splits, 3)
    assert planning.plan_epochs(splits, 1, 64) == epochs
    # a split whose size is unknown (an old checkpoint's) counts as a whole epoch's worth
    unknown = InputSplit("/old/a.csv")
    assert epochs_by_bytes([splits[4], unknown, splits[5]], 64) == [
        [splits[4]],
        [unknown],
        [splits[5]],
    ]


def test_row_group_runs_are_packed_by_their_bytes_from_the_footer(tmp_path: Path) -> None:
    big = tmp_path / "big.parquet"
    write_big(big)
    limit = big.stat().st_size // 6
    runs = plan_splits([str(big)], "parquet", limit)
    assert all(s.nbytes is not None and s.planned_bytes == s.nbytes for s in runs)
    assert all(s.nbytes <= limit for s in runs if s.nbytes is not None and s.row_groups)
    assert "nbytes" not in runs[0].to_state(0)  # planning's measure, not in the state
    epochs = epochs_by_bytes(runs, 2 * limit)
    assert len(runs) // 2 <= len(epochs) < len(runs)  # about two runs per epoch
    assert [s for e in epochs for s in e] == runs
    for epoch in epochs:
        assert len(epoch) == 1 or sum(s.nbytes or 0 for s in epoch) <= 2 * limit


def items(epochs: list[list[InputSplit]]) -> list[dict[str, Any]]:
    """What a checkpoint records of epochs' splits (a split from the state has no rows)."""
    return [s.to_state(e) for e, epoch in enumerate(epochs) for s in epoch]


def _state(epochs: list[list[InputSplit]], done: int) -> list[dict[str, Any]]:
    """A checkpoint's source state after ``done`` epochs: processed splits, then the rest."""
    return [
        processed_item(s, e) if e < done else s.to_state(e)
        for e, epoch in enumerate(epochs)
        for s in epoch
    ]


def test_a_restore_and_an_incremental_run_plan_their_epochs_by_the_same_rule(
    tmp_path: Path,
) -> None:
    files = sized_files(tmp_path / "in", [40, 20, 20, 50, 10, 30, 30, 4])
    epochs = planning.plan_epochs(plan_splits(files, "csv", None), 1, 64)
    assert sizes_of(epochs) == [[40, 20], [20], [50, 10], [30, 30, 4]]
    # resumed at an epoch boundary with the same settings: the epochs of a run that never failed
    assert resume(_state(epochs, 2), files, "csv", None, 1, 7, 64).epochs == epochs
    # new files after a finished job: its epochs as they were, the new ones by the same rule
    more = files + sized_files(tmp_path / "in2", [60, 3, 3, 70])
    finished = resume(_state(epochs, len(epochs)), more, "csv", None, 1, 8, 64).epochs
    assert finished[:4] == epochs
    assert sizes_of(finished[4:]) == [[60, 3], [3], [70]]
    # a changed epoch_bytes, as a changed splits_per_epoch: the processed epochs come back as
    # recorded and the rest is planned anew by the new rule (the sink discards what it staged)
    changed = resume(_state(epochs, 2), files, "csv", None, 1, 7, 1000).epochs
    assert changed[:2] == epochs[:2]
    assert sizes_of(changed[2:]) == [[50, 10, 30, 30, 4]]
    by_count = resume(_state(epochs, 2), files, "csv", None, 2, 7).epochs
    assert by_count[:2] == epochs[:2] and sizes_of(by_count[2:]) == [[50, 10], [30, 30], [4]]


def test_a_partly_read_file_resumes_with_its_runs_bytes_estimated(tmp_path: Path) -> None:
    """The remaining row-group runs come from the state, whose items carry no bytes: each is
    its share of the file's size by row groups, so they are still packed (no footer read)."""
    big = tmp_path / "big.parquet"
    write_big(big)
    limit = big.stat().st_size // 6
    epochs = planning.plan_epochs(plan_splits([str(big)], "parquet", limit), 1, 2 * limit)
    assert len(epochs) >= 3
    resumed = resume(_state(epochs, 1), [str(big)], "parquet", limit, 1, 5, 2 * limit).epochs
    assert items(resumed[:1]) == items(epochs[:1])
    rest = [s for e in resumed[1:] for s in e]
    assert items([rest]) == items([[s for e in epochs[1:] for s in e]])  # each once, in order
    assert all(s.nbytes is not None for s in rest)
    assert len(resumed) < len(rest) + 1  # packed: fewer epochs than runs


def test_a_checkpoint_without_processed_splits_refuses_a_changed_epoch_bytes(
    tmp_path: Path,
) -> None:
    """Checkpoints taken before processed splits were recorded are checked by comparing the
    splits they have left with this run's plan: a changed epoch_bytes moves splits to other
    epochs and is refused, as a changed splits_per_epoch is."""
    from checkpointing.pipeline.operator_ids import SOURCE
    from checkpointing.restore.assignment import OperatorRestore, SubtaskRestore
    from checkpointing.spark.state import check_source, remaining_splits
    from checkpointing.state.keygroups import KeyGroupRange

    files = sized_files(tmp_path / "in", [40, 20, 20, 50, 10, 30, 30, 5])
    splits = plan_splits(files, "csv", None)
    taken = planning.plan_epochs(splits, 1, 64)
    left = tuple(remaining_splits(taken, 1))
    subtask = SubtaskRestore(0, KeyGroupRange(0, 127), (), left)
    restored = OperatorRestore(SOURCE, 1, 1, 128, "split", (subtask,))
    check_source(
        restored, remaining_splits(planning.plan_epochs(splits, 1, 64), 1), 3
    )  # the same: ok
    for per_epoch, epoch_bytes in ((1, 100), (1, None), (2, None)):
        planned = remaining_splits(planning.plan_epochs(splits, per_epoch, epoch_bytes), 1)
        with pytest.raises(SpecError, match=r"does not match checkpoint 3"):
            check_source(restored, planned, 3)


def test_the_run_log_says_how_epochs_were_planned(tmp_path: Path) -> None:
    files = sized_files(tmp_path / "in", [3 << 20, 1 << 20, 2 << 20, 4 << 20, 1 << 20])
    splits = plan_splits(files, "csv", None)
    by_bytes = make_spec(
        tmp_path, "b", f'{{format: csv, path: "{tmp_path}/in/*.csv", epoch_bytes: 4MiB}}'
    )
    epochs = planning.plan_epochs(splits, 1, by_bytes.source.epoch_bytes)
    assert describe_epochs(epochs, by_bytes.source) == (
        "5 splits (11 MiB) in 4 epochs of ~2.8 MiB (source.epoch_bytes 4MiB)"
    )
    default = make_spec(tmp_path, "d", f'{{format: csv, path: "{tmp_path}/in/*.csv"}}')
    one = planning.plan_epochs(splits, 1, None)
    assert describe_epochs(one, default.source) == (
        "5 splits (11 MiB) in 5 epochs of 1 split (source.splits_per_epoch 1)"
    )
    two = make_spec(
        tmp_path, "t", f'{{format: csv, path: "{tmp_path}/in/*.csv", splits_per_epoch: 2}}'
    )
    assert describe_epochs(epochs_of(splits, 2), two.source) == (
        "5 splits (11 MiB) in 3 epochs of 1-2 splits (source.splits_per_epoch 2)"
    )


def test_epoch_bytes_is_validated_in_the_spec(tmp_path: Path) -> None:
    base = f'format: parquet, path: "{tmp_path}/data/*.parquet"'
    assert make_spec(tmp_path, "ok", f"{{{base}, epoch_bytes: 256MiB}}").source.epoch_bytes == (
        256 << 20
    )
    assert make_spec(tmp_path, "none", f"{{{base}}}").source.epoch_bytes is None
    for bad in ("0", "-5", "lots", "true"):
        with pytest.raises(SpecError, match=r"source\.epoch_bytes") as err:
            make_spec(tmp_path, "bad", f"{{{base}, epoch_bytes: {bad}}}")
        assert len(str(err.value).splitlines()) == 1, str(err.value)
    with pytest.raises(SpecError, match=r"source\.splits_per_epoch and source\.epoch_bytes"):
        make_spec(tmp_path, "both", f"{{{base}, splits_per_epoch: 1, epoch_bytes: 1MiB}}")


def _split_spec(tmp_path: Path, data: Path, name: str, **overrides: Any) -> Any:
    limit = (data / "big.parquet").stat().st_size // 5
    source = (
        f'{{format: parquet, path: "{data}/*.parquet", splits_per_epoch: 1, '
        f"max_split_bytes: {limit}}}"
    )
    return make_spec(tmp_path, name, source, **overrides)


@pytest.mark.parametrize("metastore_url", ["sqlite"], indirect=True)  # Spark: one backend
def test_one_big_file_over_several_epochs_crash_and_rescaled_resume(
    spark: Any, tmp_path: Path, metastore_url: str
) -> None:
    from checkpointing.spark.runtime import SimulatedCrash

    data = tmp_path / "data"
    data.mkdir()
    frame = write_big(data / "big.parquet")
    spec = _split_spec(tmp_path, data, "bigfile")
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=2)
    stamp = (data / "big.parquet").stat().st_mtime_ns

    # the file under the checkpoint replaced: refused, naming it, nothing lost
    original = (data / "big.parquet").read_bytes()
    (data / "big.parquet").write_bytes(original[:-1])
    with pytest.raises(SpecError, match=r"big.parquet was read by checkpoint \d+"):
        run(spark, spec, metastore, storage, parallelism=2)
    os.utime(data / "big.parquet", ns=(stamp, stamp))  # its old mtime does not hide the size
    with pytest.raises(SpecError, match=r"and has changed since \(size, etag, mtime \d+"):
        run(spark, spec, metastore, storage, parallelism=2)
    (data / "big.parquet").write_bytes(original)
    os.utime(data / "big.parquet", ns=(stamp, stamp))  # the same version again

    resumed = run(spark, spec, metastore, storage, parallelism=2)
    epochs = resumed.epochs_total
    assert epochs >= 4  # one file, several epochs
    assert resumed.epochs_run == list(range(2, epochs))
    assert resumed.rows_read < ROWS  # the resumed run read only the remaining row groups
    final, changelog = tables(spark, spec)
    assert_matches_pandas(final, [frame])
    assert sorted(changelog.epoch.unique()) == list(range(epochs))
    # the changelog rows of each epoch are the keys of exactly that epoch's row groups
    for epoch, splits in enumerate(plan_epochs(spec)):
        (split,) = splits
        assert split.row_groups is not None
        rows = pq.ParquetFile(split.path).read_row_groups(range(*split.row_groups)).to_pandas()
        assert set(changelog[changelog.epoch == epoch].user) == set(rows.user), epoch


def plan_epochs(spec: Any) -> list[list[InputSplit]]:
    import glob

    files = sorted(glob.glob(spec.resolve(spec.source.path)))
    splits = plan_splits(files, "parquet", spec.source.max_split_bytes)
    return epochs_of(splits, spec.source.splits_per_epoch)


@pytest.mark.parametrize("metastore_url", ["sqlite"], indirect=True)  # Spark: one backend
def test_small_files_in_epochs_by_bytes_crash_resume_and_more_files_later(
    spark: Any, tmp_path: Path, metastore_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Epochs sized by work on real Spark: small files packed into epochs of ``epoch_bytes``
    (the run's log says how), crashed after the first epoch and resumed, then files landing
    after the job finished planned by the same rule; the final table equals pandas and each
    changelog epoch holds exactly the keys of its files."""
    import logging
    import shutil

    from checkpointing.spark.runtime import SimulatedCrash
    from tests.spark_pipeline import write_events

    files = sorted(write_events(tmp_path / "events").glob("*.parquet"))
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    for f in files[:4]:
        shutil.copy(f, inbox / f.name)
    kib = -(-2 * max(f.stat().st_size for f in files) // 1024)  # two files an epoch, not three
    source = f'{{format: parquet, path: "{inbox}/*.parquet", epoch_bytes: {kib}KiB}}'
    spec = make_spec(tmp_path, "bybytes", source)
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with caplog.at_level(logging.INFO, logger="checkpointing"):
        with pytest.raises(SimulatedCrash):
            run(spark, spec, metastore, storage, crash_after_epochs=1)
        assert "in 2 epochs of ~" in caplog.text
        assert "job bybytes: 4 splits (" in caplog.text
        assert f"(source.epoch_bytes {kib}KiB)" in caplog.text
        resumed = run(spark, spec, metastore, storage)
        assert (resumed.epochs_total, resumed.epochs_run) == (2, [1])
        for f in files[4:]:
            shutil.copy(f, inbox / f.name)
        later = run(spark, spec, metastore, storage)
        assert (later.epochs_total, later.epochs_run) == (3, [2])
        # the first run's epoch is compacted (its files only, no splits), the second's as read
        assert "job bybytes: 4 splits (" in caplog.text and "after 1 compacted epoch" in caplog.text
    final, changelog = tables(spark, spec)
    assert_matches_pandas(final, [pd.read_parquet(f) for f in files])
    for epoch in range(3):
        frame = pd.concat(pd.read_parquet(f) for f in files[2 * epoch : 2 * epoch + 2])
        assert set(changelog[changelog.epoch == epoch].user) == set(frame.user), epoch
