"""Input splits: big Parquet files become runs of row groups (planned from footers alone), and on
real Spark a job over one big file split across epochs — crashed, then resumed at another
parallelism — equals an independent pandas computation; a restore whose input no longer matches
the checkpoint's remaining splits is refused, naming what differs."""

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
from checkpointing.pipeline.spec import SpecError
from checkpointing.pipeline.splits import InputSplit, SplitError, epochs_of, plan_splits
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


def _split_spec(tmp_path: Path, data: Path, name: str, **overrides: Any) -> Any:
    limit = (data / "big.parquet").stat().st_size // 5
    source = (
        f'{{format: parquet, path: "{data}/*.parquet", splits_per_epoch: 1, '
        f"max_split_bytes: {limit}}}"
    )
    return make_spec(tmp_path, name, source, **overrides)


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
