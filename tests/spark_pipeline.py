"""Helpers for the Spark runtime tests: a pipeline spec over generated events, running it, and
reading back the sink's final table and changelog to compare runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from checkpointing.metastore import views
from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline import datasets
from checkpointing.pipeline.spec import PipelineSpec, load_spec
from checkpointing.restore import lookup
from checkpointing.state.metadata import CheckpointMetadata
from tests import oracle

AGGS = {
    "n": ("count", None),
    "n_amount": ("count", "amount"),
    "total": ("sum", "amount"),
    "avg_amount": ("avg", "amount"),
    "max_q": ("max", "quantity"),
    "min_q": ("min", "quantity"),
}
EPOCHS = 6


def make_spec(
    tmp_path: Path,
    name: str,
    source: str,
    *,
    sink: Path | str | None = None,
    interval: Any = None,
    **overrides: Any,
) -> PipelineSpec:
    """A spec for job ``name`` over ``source`` (the YAML of the source mapping); ``sink``: its
    path, or the YAML of the sink mapping when a str starting with ``{``; ``interval``: the
    data interval a ``scope: interval`` spec is bound to. A path alone opts in to the changelog
    (the epochs' committed rows)."""
    spec = tmp_path / f"{name}.yaml"
    if isinstance(sink, str) and sink.startswith("{"):
        sink_yaml = sink
    else:
        # the changelog opted in: these runs' tests read every epoch's committed rows too
        sink_yaml = f"{{path: {sink or tmp_path / (name + '-out')}, changelog: true}}"
    aggs = "\n".join(f"  {k}: {f}({c or ''})" for k, (f, c) in AGGS.items())
    spec.write_text(
        f"""
job: {name}
source: {source}
key: user
aggregations:
{aggs}
sink: {sink_yaml}
parallelism: 3
max_parallelism: 16
checkpoint: {{every_epochs: 1, retained: 2}}
"""
    )
    return load_spec(spec, overrides, interval=interval)


def events_spec(tmp_path: Path, events: Path, name: str, **overrides: Any) -> PipelineSpec:
    source = f'{{format: parquet, path: "{events}/*.parquet", splits_per_epoch: 1}}'
    return make_spec(tmp_path, name, source, **overrides)


def run(
    spark: Any,
    spec: PipelineSpec,
    metastore: Metastore,
    storage: Any,
    *,
    on_epoch: Any = None,
    **options: Any,
) -> Any:
    from checkpointing.spark.preflight import RunOptions
    from checkpointing.spark.runtime import PipelineRun

    return PipelineRun(
        spec, spark, metastore, storage, RunOptions(**options), on_epoch=on_epoch
    ).run()


def sink_of(spec: PipelineSpec) -> Any:
    from checkpointing.spark.parquet_sink import TwoPhaseCommitSink

    return TwoPhaseCommitSink(spec.resolve(spec.sink.path))


def tables(spark: Any, spec: PipelineSpec) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The sink's final table and changelog, read independently of the sink (``spark`` is
    unused: kept for the callers)."""
    return oracle.read_parquet_sink(Path(spec.resolve(spec.sink.path)))


def assert_matches_pandas(final: pd.DataFrame, frames: list[pd.DataFrame]) -> None:
    expected = oracle.expected_aggregates(pd.concat(frames), ["user"], AGGS)
    pd.testing.assert_frame_equal(
        final[expected.columns.tolist()], expected, check_dtype=False, check_exact=False
    )


def completed_ids(metastore: Metastore, job: str, kind: str | None = None) -> list[int]:
    """Completed checkpoint (or ``kind``) ids, oldest first."""
    rows = views.list_checkpoints(metastore, job, status="COMPLETED", checkpoint_type=kind)
    return sorted(r["checkpoint_id"] for r in rows)


def assert_equals_reference(spark: Any, spec: PipelineSpec, reference: Any) -> None:
    final, changelog = tables(spark, spec)
    pd.testing.assert_frame_equal(final, reference[0])
    pd.testing.assert_frame_equal(changelog, reference[1])


def write_events(path: Path) -> Path:
    """The runtime tests' input: 6,000 seeded events over 300 keys in one file per epoch."""
    datasets.generate_events(path, events=6_000, keys=300, files=EPOCHS, seed=3)
    return path


def reference_run(
    spark: Any, events: Path, workdir: Path, metastore_url: str
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A crash-free run (job ``reference``), checked against an independent pandas computation;
    returns its final table and changelog for other runs to equal."""
    from checkpointing.state.storage import FileSystemCheckpointStorage

    spec = events_spec(workdir, events, "reference")
    storage = FileSystemCheckpointStorage(f"file://{workdir / 'ckpt-ref'}")
    result = run(spark, spec, Metastore(metastore_url), storage)
    assert result.epochs_run == list(range(EPOCHS))
    assert result.restored_from is None
    final, changelog = tables(spark, spec)
    assert_matches_pandas(final, [pd.read_parquet(p) for p in sorted(events.glob("*.parquet"))])
    assert sorted(changelog.epoch.unique()) == list(range(EPOCHS))
    return final, changelog


def checkpoint_metadata(
    metastore: Metastore, storage: Any, job: str, checkpoint_id: int
) -> CheckpointMetadata:
    """The ``_metadata`` of ``job``'s checkpoint ``checkpoint_id``, loaded as a restore does."""
    decision = lookup.load_checkpoint(metastore, storage, job, checkpoint_id)
    assert decision.metadata is not None
    return decision.metadata
