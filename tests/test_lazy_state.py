"""Runs that publish only the final table (``sink.changelog: false``, issue 23) keep the
aggregation's state as a base plus per-epoch partial aggregates, merged lazily: incremental
checkpoints write those partials as ``chain_merge: aggregate`` chains. One long scenario on real
local Spark: crashes, a restore at the same parallelism that continues the chains, a rescaled
restore that merges them, in-memory compaction and chain cuts along the way, ``ckpt inspect``
across an aggregate chain; the final table must equal an eager, never-crashed run's and pandas'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest

from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline.spec import SpecError, load_spec
from checkpointing.restore.state_reader import inspect_state
from checkpointing.state import incremental
from checkpointing.state.incremental import CHAIN_AGGREGATE, merge_chain
from checkpointing.state.metadata import CheckpointMetadata
from checkpointing.state.storage import FileSystemCheckpointStorage
from tests.spark_pipeline import (
    EPOCHS,
    assert_matches_pandas,
    checkpoint_metadata,
    make_spec,
    run,
    sink_of,
    write_events,
)


@pytest.fixture
def metastore(sqlite_metastore: Metastore) -> Metastore:
    return sqlite_metastore


def final_of(spark: Any, spec: Any) -> pd.DataFrame:
    return sink_of(spec).read_final(spark).toPandas().sort_values("user").reset_index(drop=True)


def aggregate_handles(metadata: CheckpointMetadata) -> list[Any]:
    [op] = [o for o in metadata.operators if o.operator_id == "aggregate"]
    return [s for s in op.subtasks if s.handle]


def test_partial_aggregate_chains_are_exact_across_crashes_restores_and_rescale(
    spark: Any, tmp_path: Path, metastore: Metastore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from checkpointing.spark import keyed_runs, lazy_state
    from checkpointing.spark.runtime import SimulatedCrash

    # the Arrow snapshots of partials: what a stage takes where Spark cannot write its runs
    # (s3:// checkpoint storage); local storage keeps runs (tests/test_keyed_runs.py)
    monkeypatch.setattr(keyed_runs, "supports", lambda storage, spark: False)
    # compaction in memory every 2 epochs, and a chain cut after 2 changes
    monkeypatch.setattr(lazy_state, "MAX_DELTAS", 2)
    monkeypatch.setattr(incremental, "MAX_DELTAS", 2)
    events = write_events(tmp_path / "events")
    frames = [pd.read_parquet(p) for p in sorted(events.glob("*.parquet"))]
    source = f'{{format: parquet, path: "{events}/*.parquet", splits_per_epoch: 1}}'
    ref = make_spec(tmp_path, "eager", source)  # the changelog sink: merged every epoch
    run(spark, ref, metastore, FileSystemCheckpointStorage(f"file://{tmp_path / 'ck-ref'}"))
    reference = final_of(spark, ref)
    assert_matches_pandas(reference, frames)

    sink = f"{{path: {tmp_path / 'lazy-out'}, changelog: false}}"
    checkpoint = {"every_epochs": 1, "retained": 3}
    spec = make_spec(tmp_path, "lazy", source, sink=sink, checkpoint=checkpoint)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ck'}")
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=2)
    assert not (tmp_path / "lazy-out" / "changelog").exists()  # nothing staged per epoch
    assert not list((tmp_path / "lazy-out").glob("_staging/epoch-*"))
    first = checkpoint_metadata(metastore, storage, "lazy", 2)
    chained = [h for h in aggregate_handles(first) if h.chain]
    assert chained and all(h.chain_merge == CHAIN_AGGREGATE for h in chained)
    # inspect merges the chain's partials: the state after epoch 1 is pandas' over 2 files
    view = inspect_state(metastore, storage, "lazy", 2, "aggregate")
    got = pd.DataFrame(view.rows).set_index("user").sort_index()
    head = pd.concat(frames[:2])
    pd.testing.assert_series_equal(
        got["__cnt_n"], head.groupby("user").size(), check_names=False, check_dtype=False
    )
    pd.testing.assert_series_equal(
        got["__max_max_q"], head.groupby("user")["quantity"].max(), check_names=False
    )

    # the same parallelism: the restore merges the chains, the next checkpoint continues them,
    # the one after cuts them (the state compacted, written whole)
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=2)
    bases = {h.files()[0].handle for h in aggregate_handles(first)}
    continued = checkpoint_metadata(metastore, storage, "lazy", 3)
    assert bases == {h.files()[0].handle for h in aggregate_handles(continued)}
    cut = checkpoint_metadata(metastore, storage, "lazy", 4)
    assert all(not h.chain for h in aggregate_handles(cut))

    # rescaled 3 -> 4: every new subtask merges its key groups of the old partials
    result = run(spark, spec, metastore, storage, parallelism=4)
    assert result.epochs_run == list(range(4, EPOCHS))
    pd.testing.assert_frame_equal(final_of(spark, spec), reference)


def test_a_delta_sink_refuses_changelog_false_before_anything_runs(tmp_path: Path) -> None:
    spec = tmp_path / "p.yaml"
    spec.write_text(
        f"job: j\nsource: {{format: parquet, path: {tmp_path}/*.parquet}}\nkey: user\n"
        f"aggregations: {{n: count()}}\nsink: {{path: {tmp_path}/t, format: delta, "
        "changelog: false}\n"
    )
    with pytest.raises(SpecError, match="changelog: false is for the parquet sink"):
        load_spec(spec)


def test_inspect_merges_sums_and_extremes_and_refuses_what_needs_the_pipeline() -> None:
    key = ["user"]
    old = pa.table({"user": ["a", None], "key_group": [1, 2], "__cnt_n": [2, 1],
                    "__sum_s": [1.5, None], "__min_m": [3, 4]})  # fmt: skip
    new = pa.table({"user": [None, "a"], "key_group": [2, 1], "__cnt_n": [1, 5],
                    "__sum_s": [None, 2.0], "__min_m": [9, 1]})  # fmt: skip
    merged = merge_chain([old, new], key, CHAIN_AGGREGATE).to_pylist()
    assert merged == [
        {"user": "a", "key_group": 1, "__cnt_n": 7, "__sum_s": 3.5, "__min_m": 1},
        {"user": None, "key_group": 2, "__cnt_n": 2, "__sum_s": None, "__min_m": 4},
    ]
    sets = pa.table({"user": ["a"], "key_group": [1], "__set_d": [[1, 2]]})
    with pytest.raises(ValueError, match="'__set_d' is a partial aggregate only"):
        merge_chain([sets, sets], key, CHAIN_AGGREGATE)
