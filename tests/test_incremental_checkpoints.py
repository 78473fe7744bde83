"""Incremental checkpoints on real local Spark (issue 16): a checkpoint writes only the keys that
changed since the previous one and references the rest from earlier checkpoints' files under the
job's ``shared/``; restores (same parallelism and rescaled), ``ckpt inspect`` and the
corrupt-checkpoint fallback read across those chains. Outputs must equal a run that never
crashed and pandas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from checkpointing.metastore.engine import Metastore
from checkpointing.restore import lookup as restore
from checkpointing.restore.state_reader import inspect_state
from checkpointing.state.incremental import MAX_DELTAS, last_per_key, merge_chain, needs_full
from checkpointing.state.metadata import ChainedFile, CheckpointMetadata
from checkpointing.state.storage import FileSystemCheckpointStorage
from tests.spark_pipeline import (
    assert_matches_pandas,
    completed_ids,
    make_spec,
    run,
    tables,
)

EPOCHS = 8
KEYS = 4000


@pytest.fixture(scope="module")
def few_changes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Epoch 0 creates every key; each later epoch touches 8 of the 4,000 (0.2 %)."""
    path = tmp_path_factory.mktemp("few-changes")
    rng = np.random.default_rng(16)
    for epoch in range(EPOCHS):
        if epoch == 0:
            users = [f"u{k}" for k in range(KEYS)] * 2
        else:
            window = rng.choice(KEYS, size=8, replace=False)
            users = [f"u{k}" for k in rng.choice(window, size=40)]
        n = len(users)
        amount = rng.normal(50, 20, n).round(2)
        amount[rng.random(n) < 0.05] = np.nan
        frame = pd.DataFrame(
            {"user": users, "amount": amount, "quantity": rng.integers(1, 9, n).astype("int64")}
        )
        frame.to_parquet(path / f"part-{epoch:03d}.parquet", index=False)
    return path


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'metastore.db'}"
    Metastore(url, check_schema=False).upgrade()
    return url


def spec_for(tmp_path: Path, data: Path, name: str, **checkpoint: Any) -> Any:
    source = f'{{format: parquet, path: "{data}/*.parquet", splits_per_epoch: 1}}'
    return make_spec(
        tmp_path, name, source, checkpoint={"every_epochs": 1, "retained": 3, **checkpoint}
    )


def frames(data: Path, epochs: int = EPOCHS) -> list[pd.DataFrame]:
    return [pd.read_parquet(p) for p in sorted(data.glob("*.parquet"))[:epochs]]


def latest(metastore: Metastore, storage: Any, job: str) -> CheckpointMetadata:
    decision = restore.find_latest_valid(metastore, storage, job)
    assert decision.metadata is not None
    return decision.metadata


def aggregate_files(metadata: CheckpointMetadata) -> list[list[ChainedFile]]:
    [op] = [o for o in metadata.operators if o.operator_id == "aggregate"]
    return [s.files() for s in op.subtasks if s.handle]


def test_changes_only_then_exact_restores_same_and_rescaled(
    spark: Any, few_changes: Path, tmp_path: Path, sqlite_url: str
) -> None:
    from checkpointing.spark.runtime import SimulatedCrash

    metastore = Metastore(sqlite_url)
    # the reference: full snapshots, never crashed; its files stay in the checkpoint directory
    ref_storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt-ref'}")
    ref = spec_for(tmp_path, few_changes, "full-ref", incremental=False)
    run(spark, ref, metastore, ref_storage)
    assert not (tmp_path / "ckpt-ref" / "full-ref" / "shared").exists()
    full = latest(metastore, ref_storage, "full-ref")
    assert all(len(files) == 1 for files in aggregate_files(full))
    ref_final, ref_changelog = tables(spark, ref)
    assert_matches_pandas(ref_final, frames(few_changes))

    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    spec = spec_for(tmp_path, few_changes, "incr")
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=6)
    before = latest(metastore, storage, "incr")
    chains = aggregate_files(before)
    shared = storage.shared_url("incr")
    assert all(storage.contains(f.handle, shared) for files in chains for f in files)
    # each subtask: the first checkpoint's full snapshot, then the epochs' changes (an epoch
    # that changed none of its keys adds no file)
    assert all("/shared/chk-1/" in files[0].handle for files in chains), chains
    assert all(len(files) >= 3 for files in chains), chains
    base = sum(files[0].size for files in chains)
    changes = [f.size for files in chains for f in files[1:]]
    assert max(changes) < base / 8, (changes, base)  # a few changed keys cost a few keys' bytes
    # inspect reads across the chain: the state at epoch 5 is pandas' partials over 6 files
    view = inspect_state(metastore, storage, "incr", before.checkpoint_id, "aggregate")
    got = pd.DataFrame(view.rows).sort_values("user").set_index("user")
    counts = pd.concat(frames(few_changes, 6)).groupby("user").size()
    assert len(got) == KEYS
    assert set(view.files_read) == {f.handle for files in chains for f in files}
    pd.testing.assert_series_equal(got["__cnt_n"], counts, check_names=False)

    # same parallelism: the restore reads the chains and the next checkpoint builds on them
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=1)
    after = latest(metastore, storage, "incr")
    assert after.checkpoint_id > before.checkpoint_id
    continued = {f.handle for files in aggregate_files(after) for f in files}
    assert {files[0].handle for files in chains} <= continued  # the same full snapshots

    # rescaled (3 -> 4): each new subtask reads its key groups from the old chains
    result = run(spark, spec, metastore, storage, parallelism=4)
    assert result.epochs_run == [EPOCHS - 1]
    final, changelog = tables(spark, spec)
    pd.testing.assert_frame_equal(final, ref_final)
    pd.testing.assert_frame_equal(changelog, ref_changelog)
    last = latest(metastore, storage, "incr")
    assert all(len(files) == 1 for files in aggregate_files(last))  # rescaled: full again


def test_corrupt_shared_file_invalidates_every_checkpoint_using_it(
    spark: Any, few_changes: Path, tmp_path: Path, sqlite_url: str
) -> None:
    from checkpointing.spark.runtime import SimulatedCrash

    metastore = Metastore(sqlite_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    spec = spec_for(tmp_path, few_changes, "corrupt")
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=5)
    retained = completed_ids(metastore, "corrupt")
    assert len(retained) == 3
    newest = latest(metastore, storage, "corrupt")
    own = [
        files[-1]
        for files in aggregate_files(newest)
        if f"/chk-{newest.checkpoint_id}/" in files[-1].handle
    ]
    assert own, "the newest checkpoint wrote changes of its own"
    flip(storage, own[0].handle)
    # its own changes are corrupt: the one before it is the restore's
    decision = restore.find_latest_valid(metastore, storage, "corrupt")
    assert decision.checkpoint_id == retained[-2]
    assert [s.checkpoint_id for s in decision.skipped] == [retained[-1]]
    assert own[0].handle in decision.skipped[0].reason

    # the full snapshot every retained checkpoint builds on is corrupt: none of them is valid,
    # and each after the first is refused without reading the file again
    base = aggregate_files(newest)[0][0]
    assert all(base in files for files in map(aggregate_files_of(metastore, storage), retained))
    flip(storage, base.handle)
    decision = restore.find_latest_valid(metastore, storage, "corrupt")
    assert decision.metadata is None
    assert [s.checkpoint_id for s in decision.skipped] == retained[::-1]
    assert all(base.handle in s.reason for s in decision.skipped[1:])
    assert all("found verifying checkpoint" in s.reason for s in decision.skipped[1:])
    flip(storage, base.handle)  # mended

    # the run restores the one before the newest, and the output is exact
    result = run(spark, spec, metastore, storage)
    assert result.restored_from == retained[-2]
    final, _ = tables(spark, spec)
    assert_matches_pandas(final, frames(few_changes))


def aggregate_files_of(metastore: Metastore, storage: Any) -> Any:
    def files(checkpoint_id: int) -> list[ChainedFile]:
        decision = restore.load_checkpoint(metastore, storage, "corrupt", checkpoint_id, deep=False)
        assert decision.metadata is not None
        return [f for chain in aggregate_files(decision.metadata) for f in chain]

    return files


def flip(storage: FileSystemCheckpointStorage, url: str) -> None:
    path = storage.path_of(url)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------ the chain rules


def test_the_last_row_of_a_key_wins_nulls_being_one_key() -> None:
    older = pa.table({"k": ["a", "b", None, "c"], "key_group": [0, 1, 1, 2], "v": [1, 2, 3, 4]})
    newer = pa.table({"k": ["b", None, "d"], "key_group": [1, 1, 0], "v": [20, 30, 40]})
    merged = merge_chain([older, newer], ["k"])
    assert merged.to_pylist() == [
        {"k": "a", "key_group": 0, "v": 1},
        {"k": "d", "key_group": 0, "v": 40},
        {"k": "b", "key_group": 1, "v": 20},
        {"k": None, "key_group": 1, "v": 30},
        {"k": "c", "key_group": 2, "v": 4},
    ]
    assert merge_chain([older], ["k"]) is older
    twice = pa.table({"k": [1, 1, 2], "j": [1, 2, 1], "v": [1, 2, 3]})
    assert last_per_key(twice, ["k", "j"]).num_rows == 3
    assert last_per_key(twice, ["k"]).column("v").to_pylist() == [2, 3]


def test_a_chain_is_cut_when_its_changes_outweigh_or_outnumber_the_full_snapshot() -> None:
    def f(size: int) -> ChainedFile:
        return ChainedFile(handle=f"file:///s/{size}", size=size, checksum=None)

    assert needs_full([])
    assert not needs_full([f(1000)])
    assert not needs_full([f(1000), f(400), f(500)])
    assert needs_full([f(1000), f(400), f(600)])  # as many bytes of changes as of state
    assert needs_full([f(1000), *[f(1) for _ in range(MAX_DELTAS)]])
