"""The Spark writer of a pipeline's sink, behind the two-phase-commit protocol of
:mod:`checkpointing.sinks.protocol`.

Which sink a spec gets is :func:`open_sink`'s choice (``sink.format``): the Parquet directory
sink (:mod:`checkpointing.spark.parquet_sink`, local; :mod:`checkpointing.spark.s3_parquet_sink`
on ``s3://``), a Delta Lake table (:mod:`checkpointing.spark.delta_sink`, local or on an object
store) or an Iceberg table in a SQL catalog (:mod:`checkpointing.spark.iceberg_sink`, local or S3
warehouse).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from checkpointing.sinks.protocol import Sink
from checkpointing.state.object_store import is_object_url

if TYPE_CHECKING:
    from checkpointing.pipeline.spec import PipelineSpec


def open_sink(
    spec: PipelineSpec, *, job: str | None = None, key: Sequence[str] | None = None
) -> Sink:
    """The sink ``spec.sink`` describes, for ``job`` (None: read only, or as no job); ``key``:
    the key of the rows it gets (the last keyed stage's; default ``spec.key``), which an upsert
    table keeps one row per. Refuses a location it may not write to (another job's, foreign
    content, an unreachable bucket) before anything is written."""
    path = spec.resolve(spec.sink.path)
    if spec.sink.format == "delta":
        from checkpointing.spark.delta_sink import DeltaSink

        return DeltaSink(
            path,
            job=job,
            key=list(key or spec.key),
            mode=spec.sink_mode,
            max_parallelism=spec.max_parallelism,
            partition_by=spec.sink.partition_by,
        )
    if spec.sink.format == "iceberg":
        from checkpointing.spark.iceberg_sink import IcebergSink

        return IcebergSink(
            path,
            table=spec.sink.table or "",
            catalog=spec.catalog_url(),
            job=job,
            key=list(key or spec.key),
            mode=spec.sink_mode,
            max_parallelism=spec.max_parallelism,
        )
    if is_object_url(path):
        from checkpointing.spark.s3_parquet_sink import S3ParquetSink

        return S3ParquetSink(path, job=job, partition_by=spec.sink.partition_by)
    from checkpointing.spark.parquet_sink import TwoPhaseCommitSink

    return TwoPhaseCommitSink(path, job=job, partition_by=spec.sink.partition_by)
