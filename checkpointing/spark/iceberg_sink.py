"""Exactly-once Iceberg sink (Flink's ``TwoPhaseCommitSinkFunction`` over an Iceberg table in
pyiceberg's SQL catalog), with a local or S3 warehouse; no Spark Iceberg jars.

* **Pre-commit** (:meth:`TableSink.stage`): the executors write the epoch's Parquet data files
  into the table's ``data/`` folder and return only their metadata (one row per file; the driver
  never collects rows). Readers do not see them: an Iceberg reader reads the files the current
  snapshot's manifests list.

  - ``upsert`` (one row per key): as the Delta sink, the key groups fall into at most
    :data:`~checkpointing.sinks.delta_files.MAX_BUCKETS` buckets, one file each; an epoch's changed
    rows of a bucket are merged on an executor with the bucket's newest file into a new file
    (copy-on-write). pyiceberg writes no equality or position deletes we could rely on, and its
    own ``upsert`` needs the rows on the driver; an overwrite snapshot that deletes the replaced
    bucket files and adds the new ones is plain Iceberg any reader reads.
  - ``append``: each Spark partition's rows of the epoch become one file, as they are.

* **Commit** (:meth:`TableSink.commit`, on checkpoint completion): one Iceberg snapshot per
  completed checkpoint (an overwrite in upsert mode, an append otherwise), its summary carrying
  the job, the checkpoint id and the last epoch (:mod:`checkpointing.sinks.iceberg_table`); a
  checkpoint the current snapshot already has (or a newer one) is a no-op.

* **Recover** (:meth:`TableSink.recover`): a table ahead of the restored checkpoint is rolled
  back to that checkpoint's snapshot (reported by :meth:`TableSink.recovery_detail`), the
  checkpoint's staged epochs the table lacks are committed (from the sink's list state), and
  every data file of ours no snapshot references is deleted.

Limits: one writer per table (the job's driver); no partition spec (an unpartitioned table);
snapshots are never expired by the sink (``expire_snapshots`` is the table owner's call, after
which a restore to an older checkpoint than the oldest snapshot is refused).
"""

from __future__ import annotations

from collections.abc import Sequence

from checkpointing.sinks.table_formats import IcebergFormat
from checkpointing.spark.table_sink import TableSink

MODES = ("upsert", "append")


def IcebergSink(  # named as the sink it opens: a TableSink over an Iceberg table
    warehouse: str,
    *,
    table: str,
    catalog: str | None = None,
    job: str | None,
    key: Sequence[str],
    mode: str = "upsert",
    max_parallelism: int = 128,
) -> TableSink:
    """The Iceberg table sink of ``table`` in ``warehouse``: a
    :class:`~checkpointing.spark.table_sink.TableSink` over an
    :class:`~checkpointing.sinks.table_formats.IcebergFormat`. Reads only: refuses a table
    ``job`` may not write (another job's or writer's, a non-empty location that is no table of
    the catalog, an unreachable catalog)."""
    if mode not in MODES:
        raise ValueError(f"sink.mode: {mode!r} is not upsert or append")
    return TableSink(
        IcebergFormat(warehouse, table, catalog, job),
        job=job,
        key=key,
        mode=mode,
        max_parallelism=max_parallelism,
    )
