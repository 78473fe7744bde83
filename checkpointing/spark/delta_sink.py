"""Exactly-once Delta Lake sink (Flink's ``TwoPhaseCommitSinkFunction`` over a Delta table),
local or on S3, written with delta-rs and Arrow: no Spark Delta jars.

* **Pre-commit** (:meth:`TableSink.stage`): the executors write the epoch's Parquet data files
  into the table's location and return only their metadata (one row per file; the driver never
  collects rows). Readers do not see them: a Delta reader reads the files the log adds.

  - ``upsert`` (one row per key): the key groups fall into at most
    :data:`~checkpointing.sinks.delta_files.MAX_BUCKETS` buckets of contiguous key groups, one file
    each. An epoch's changed rows of a bucket are merged on an executor with the bucket's newest
    file (its rows of other keys kept) into a new file, copy-on-write.
  - ``changelog``: each Spark partition's changed rows of the epoch become one file, with the
    epoch as a BIGINT ``epoch`` column.

* **Commit** (:meth:`TableSink.commit`, on checkpoint completion): one Delta transaction per
  completed checkpoint, app transaction ``(job, checkpoint id)``: upsert removes each replaced
  bucket file and adds the newest staged one; changelog adds the epochs' files. Staged files a
  newer one of the same bucket superseded before the commit are deleted after it.

* **Recover** (:meth:`TableSink.recover`): the table says which checkpoint it holds (the job's
  ``txn``, and the last epoch in the commit metadata). A table ahead of the restored checkpoint
  is first brought back to that checkpoint's version (``RESTORE``, reported by
  :meth:`TableSink.recovery_detail`); then the checkpoint's staged epochs the table lacks are
  committed (from the sink's list state: the files' names, sizes and row counts), and every file
  of ours that no version in the log references is deleted (the staged epochs beyond the
  checkpoint, leftovers of retried tasks). A repeated commit is a no-op (its ``txn`` is there).

Limits: one writer per table (the job's driver); an upsert table keeps the last row emitted per
key (a stage that drops keys from its state leaves their last rows in the table); files committed
on recovery carry only their row counts as statistics.
"""

from __future__ import annotations

from collections.abc import Sequence

from checkpointing.sinks.table_formats import DeltaFormat
from checkpointing.spark.table_sink import TableSink


def DeltaSink(  # named as the sink it opens: a TableSink over a Delta table
    path: str,
    *,
    job: str | None,
    key: Sequence[str],
    mode: str = "upsert",
    max_parallelism: int = 128,
    partition_by: Sequence[str] = (),
) -> TableSink:
    """The Delta table sink at ``path``: a :class:`~checkpointing.spark.table_sink.TableSink`
    over a :class:`~checkpointing.sinks.table_formats.DeltaFormat`. Reads only: refuses a
    location ``job`` may not write to (see :func:`checkpointing.sinks.delta_log.check_location`).
    ``partition_by``: the table's partition columns (changelog only: an upsert table's files are
    buckets of keys)."""
    if mode not in ("upsert", "changelog"):
        raise ValueError(f"sink.mode: {mode!r} is not upsert or changelog")
    if partition_by and mode == "upsert":
        raise ValueError("sink.partition_by: a Delta upsert table is not partitioned")
    return TableSink(
        DeltaFormat(path, job, partition_by),
        job=job,
        key=key,
        mode=mode,
        max_parallelism=max_parallelism,
        partition_by=partition_by,
    )
