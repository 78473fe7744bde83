"""Exactly-once Delta Lake sink (Flink's ``TwoPhaseCommitSinkFunction`` over a Delta table),
local or on S3, written with delta-rs and Arrow: no Spark Delta jars.

* **Pre-commit** (:meth:`DeltaSink.stage`): the executors write the epoch's Parquet data files
  into the table's location and return only their metadata (one row per file; the driver never
  collects rows). Readers do not see them: a Delta reader reads the files the log adds.

  - ``upsert`` (one row per key): the key groups fall into at most
    :data:`~checkpointing.sinks.delta_files.MAX_BUCKETS` buckets of contiguous key groups, one file
    each. An epoch's changed rows of a bucket are merged on an executor with the bucket's newest
    file (its rows of other keys kept) into a new file, copy-on-write.
  - ``changelog``: each Spark partition's changed rows of the epoch become one file, with the
    epoch as a BIGINT ``epoch`` column.

* **Commit** (:meth:`DeltaSink.commit`, on checkpoint completion): one Delta transaction per
  completed checkpoint, app transaction ``(job, checkpoint id)``: upsert removes each replaced
  bucket file and adds the newest staged one; changelog adds the epochs' files. Staged files a
  newer one of the same bucket superseded before the commit are deleted after it.

* **Recover** (:meth:`DeltaSink.recover`): the table says which checkpoint it holds (the job's
  ``txn``, and the last epoch in the commit metadata). A table ahead of the restored checkpoint
  is first brought back to that checkpoint's version (``RESTORE``, reported by
  :meth:`DeltaSink.recovery_detail`); then the checkpoint's staged epochs the table lacks are
  committed (from the sink's list state: the files' names, sizes and row counts), and every file
  of ours that no version in the log references is deleted (the staged epochs beyond the
  checkpoint, leftovers of retried tasks). A repeated commit is a no-op (its ``txn`` is there).

Limits: one writer per table (the job's driver); an upsert table keeps the last row emitted per
key (a stage that drops keys from its state leaves their last rows in the table); files committed
on recovery carry only their row counts as statistics.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

from checkpointing.errors import StorageError
from checkpointing.pipeline.spec import EPOCH_COLUMN
from checkpointing.sinks.delta_files import (
    WRITTEN,
    DataFile,
    bucket_count,
    delete_own_files,
    list_own_files,
    parse_name,
    partition_values,
    write_bucket,
    write_partition,
)
from checkpointing.sinks.delta_log import (
    FIELD,
    NO_CHECKPOINT,
    check_location,
    check_owner,
    check_partitions,
    check_schema,
    commit_files,
    create_table,
    current_files,
    current_state,
    open_table,
    referenced_files,
    restore_table,
    state_for_checkpoint,
    table_buckets,
    table_url,
)
from checkpointing.spark.keys import key_group_column
from checkpointing.spark.parquet_sink import validate_epoch

if TYPE_CHECKING:
    from deltalake import DeltaTable

log = logging.getLogger(__name__)

_BUCKET = "__bucket"


class DeltaSink:
    """A Delta table written exactly once per checkpoint; see the module docstring."""

    def __init__(
        self,
        path: str,
        *,
        job: str | None,
        key: Sequence[str],
        mode: str = "upsert",
        max_parallelism: int = 128,
        partition_by: Sequence[str] = (),
    ) -> None:
        """Reads only: refuses a location ``job`` may not write to (see
        :func:`checkpointing.sinks.delta_log.check_location`). ``partition_by``: the table's
        partition columns (changelog only: an upsert table's files are buckets of keys)."""
        if mode not in ("upsert", "changelog"):
            raise ValueError(f"sink.mode: {mode!r} is not upsert or changelog")
        if partition_by and mode == "upsert":
            raise ValueError("sink.partition_by: a Delta upsert table is not partitioned")
        self.partition_by = list(partition_by)
        self.path = table_url(path)
        self.job = job
        self.key = list(key)
        self.mode = mode
        self.max_parallelism = max_parallelism
        self.buckets = bucket_count(max_parallelism)
        self._table = check_location(self.path, job)
        self._schema: pa.Schema | None = None
        #: staged, uncommitted epochs and their files
        self._staged: dict[int, list[DataFile]] = {}
        #: upsert: bucket → the file the table holds for it (path, size), and its newest file
        self._committed: dict[int, tuple[str, int]] = {}
        self._current: dict[int, str] = {}
        #: the last epoch the table holds
        self._epoch = -1
        self._detail: dict[str, Any] | None = None
        #: a completion notification may commit from another thread than the epochs' stage
        self._lock = threading.RLock()
        if self._table is not None:
            self._load(self._table)

    def __repr__(self) -> str:
        return f"DeltaSink({self.path!r}, mode={self.mode!r})"

    # ------------------------------------------------------------------ the table

    def _load(self, table: DeltaTable) -> None:
        """The in-memory view of what the table holds."""
        self._epoch = current_state(table).epoch
        self.buckets = table_buckets(table) or self.buckets
        self._committed, self._current = {}, {}
        for name, size in current_files(table).items():
            parsed = parse_name(name)
            if parsed is not None and parsed[2] == "g":
                self._committed[parsed[3]] = (name, size)
                self._current[parsed[3]] = name

    def _writable(self, df: DataFrame) -> DeltaTable:
        """The table to write ``df``'s rows to: its schema checked against the existing table,
        or the table created (empty) — before the first data file is written."""
        if self.job is None:
            raise StorageError(f"{self!r} was opened read-only (no job)")
        schema = self.schema_for(df)
        if self._schema is not None and schema != self._schema:
            raise StorageError(f"{FIELD}: {self.path}: epochs differ in schema ({schema})")
        if self._table is None:
            self._table = open_table(self.path)
        if self._table is None:
            self._table = create_table(
                self.path, self.job, self.mode, schema, self.buckets, self.partition_by
            )
            log.info("sink: created Delta table %s (%s)", self.path, self.mode)
        elif self._schema is None:
            check_owner(self._table, self.path, self.job)
            check_schema(self._table, self.path, schema)
            check_partitions(self._table, self.path, self.partition_by)
        self._schema = schema
        return self._table

    def schema_for(self, df: DataFrame) -> pa.Schema:
        """The table's Arrow schema for rows shaped like ``df`` (all columns nullable)."""
        names = [f.name for f in df.schema.fields]
        if self.mode == "changelog" and any(n.lower() == EPOCH_COLUMN for n in names):
            raise ValueError(
                f"the changelog table adds the {EPOCH_COLUMN!r} column; the rows already have "
                "one (rename it)"
            )
        missing = [k for k in self.key if k not in names]
        if self.mode == "upsert" and missing:
            raise ValueError(f"sink: key column(s) {missing} are not in the rows ({names})")
        schema = to_arrow_schema(df.schema)
        if self.mode == "changelog":
            schema = schema.append(pa.field(EPOCH_COLUMN, pa.int64()))
        return pa.schema([f.with_nullable(True) for f in schema])

    # ------------------------------------------------------------------ phase one

    def stage(self, epoch: int, df: DataFrame) -> None:
        """Pre-commit: the executors write the epoch's files; the driver keeps their metadata."""
        epoch = validate_epoch(epoch)
        if epoch <= self._epoch or epoch in self._staged:
            raise StorageError(
                f"{FIELD}: {self.path}: epoch {epoch} is already staged or in the table "
                f"(holds epochs up to {self._epoch})"
            )
        self._writable(df)
        assert self._schema is not None and self.job is not None
        url, job, schema = self.path, self.job, self._schema
        if self.mode == "upsert":
            current, key = dict(self._current), list(self.key)

            def merge(table: pa.Table) -> pa.Table:  # annotated: Spark infers the UDF type
                return write_bucket(url, job, epoch, key, schema, current, _BUCKET, table)

            keyed = df.withColumn(_BUCKET, self._bucket_column())
            written = keyed.groupBy(_BUCKET).applyInArrow(merge, from_arrow_schema(WRITTEN))
        else:
            parts = self.partition_by

            def append(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
                from pyspark import TaskContext

                context = TaskContext.get()
                partition = context.partitionId() if context is not None else 0
                yield from write_partition(url, job, epoch, schema, partition, batches, parts)

            written = df.mapInArrow(append, from_arrow_schema(WRITTEN))
        files = [
            DataFile(
                epoch,
                r.part,
                r.path,
                r.size,
                r.rows,
                r.stats,
                r.mtime,
                partition_values(r.partition_values),
            )
            for r in written.collect()  # one small row per file written
        ]
        with self._lock:
            self._staged[epoch] = sorted(files, key=lambda f: f.part)
            if self.mode == "upsert":
                self._current.update({f.part: f.path for f in files})

    def _bucket_column(self) -> Any:
        group = key_group_column(self.key, self.max_parallelism)
        if self.buckets >= self.max_parallelism:
            return group
        return F.floor(group * F.lit(self.buckets) / F.lit(self.max_parallelism)).cast("int")

    def snapshot_state(self, up_to_epoch: int) -> list[dict[str, Any]]:
        """One item per staged, uncommitted epoch ``<= up_to_epoch``: its files as
        ``[part, path, size, rows]``, all :meth:`recover` needs to commit it."""
        with self._lock:
            staged = sorted(self._staged.items())
        return [
            {"epoch": e, "files": [f.item() for f in fs]} for e, fs in staged if e <= up_to_epoch
        ]

    # ------------------------------------------------------------------ phase two

    def commit(self, up_to_epoch: int, checkpoint_id: int | None = None) -> list[int]:
        """One Delta transaction for the checkpoint: the staged epochs ``<= up_to_epoch``. A
        checkpoint the table already has (its ``txn`` is there, or a newer one) is a no-op."""
        up_to = validate_epoch(up_to_epoch, "up_to_epoch")
        with self._lock:
            return self._commit_up_to(up_to, checkpoint_id)

    def _commit_up_to(self, up_to: int, checkpoint_id: int | None) -> list[int]:
        pending = {e: files for e, files in self._staged.items() if e <= up_to}
        table = self._table
        if table is None or self.job is None:
            return []
        table.update_incremental()
        done = table.transaction_version(self.job) or NO_CHECKPOINT
        if checkpoint_id is None:
            if not pending:
                return []
            checkpoint_id = done
        elif done >= checkpoint_id:
            for e in pending:
                del self._staged[e]
            return []
        return self._commit(table, pending, checkpoint_id)

    def _commit(
        self, table: DeltaTable, pending: dict[int, list[DataFile]], checkpoint_id: int
    ) -> list[int]:
        assert self.job is not None
        epochs = sorted(pending)
        if self.mode == "upsert":
            newest: dict[int, DataFile] = {}
            for e in epochs:
                newest.update({f.part: f for f in pending[e]})
            adds = [newest[b] for b in sorted(newest)]
            removes = dict(self._committed[b] for b in newest if b in self._committed)
            superseded = [f.path for e in epochs for f in pending[e] if newest[f.part] is not f]
        else:
            adds = [f for e in epochs for f in pending[e]]
            removes, superseded = {}, []
        epoch = max([self._epoch, *epochs])
        commit_files(
            table,
            self.path,
            job=self.job,
            checkpoint_id=checkpoint_id,
            epoch=epoch,
            epochs=epochs,
            adds=adds,
            removes=removes,
            schema=self._schema if self._schema is not None else table.schema(),
        )
        self._epoch = epoch
        for f in adds:
            if self.mode == "upsert":
                self._committed[f.part] = (f.path, f.size)
        for e in epochs:
            self._staged.pop(e, None)
        if superseded:  # never committed, and no later commit adds them
            try:
                delete_own_files(self.path, self.job, superseded)
            except OSError as exc:
                log.warning("sink: could not delete superseded staged files: %s", exc)
        return epochs

    # ------------------------------------------------------------------ restore

    def recover(
        self,
        checkpoint_epoch: int | None,
        *,
        checkpoint_id: int | None = None,
        state: Sequence[dict[str, Any]] = (),
    ) -> tuple[list[int], list[int]]:
        """Bring the table in line with a restore from checkpoint ``checkpoint_id`` (covering
        epochs ``<= checkpoint_epoch``; None: an empty start) whose sink list state is
        ``state``; returns ``(epochs committed now, epochs of deleted staged files)``."""
        with self._lock:
            return self._recover(checkpoint_epoch, checkpoint_id, state)

    def _recover(
        self,
        checkpoint_epoch: int | None,
        checkpoint_id: int | None,
        state: Sequence[dict[str, Any]],
    ) -> tuple[list[int], list[int]]:
        self._detail = None
        self._staged.clear()
        limit = None if checkpoint_epoch is None else validate_epoch(checkpoint_epoch)
        table = open_table(self.path)
        self._table = table
        if table is None or self.job is None:
            return [], []
        check_owner(table, self.path, self.job)
        done = table.transaction_version(self.job) or NO_CHECKPOINT
        if limit is not None and checkpoint_id is not None and done > checkpoint_id:
            before = table.version()
            target = state_for_checkpoint(table, checkpoint_id)
            restore_table(table, self.path, self.job, target)
            self._detail = {
                "table": self.path,
                "restored_to_version": target.version,
                "from_version": before,
                "checkpoint_id": checkpoint_id,
                "table_checkpoint_id": done,
            }
            log.warning(
                "sink: table %s was ahead of checkpoint %d (its commit of checkpoint %d): "
                "restored version %d",
                self.path,
                checkpoint_id,
                done,
                target.version,
            )
        self._load(table)
        if limit is None and done > NO_CHECKPOINT:
            self._start_over(table, done)
        pending = self._pending(state, limit)
        existing = list_own_files(self.path, self.job)
        missing = sorted(
            f.path for files in pending.values() for f in files if f.path not in existing
        )
        if missing:
            raise StorageError(
                f"{FIELD}: {self.path}: checkpoint {checkpoint_id}'s staged files are gone "
                f"({', '.join(missing[:3])}); restore from a newer checkpoint"
            )
        committed: list[int] = []
        done = table.transaction_version(self.job) or NO_CHECKPOINT
        if limit is not None and checkpoint_id is not None and (pending or done < checkpoint_id):
            committed = self._commit(table, pending, checkpoint_id)
        elif pending:  # no checkpoint id: commit under the table's current one
            committed = self._commit(table, pending, done)
        orphans = set(existing) - referenced_files(self.path, table)
        deleted = delete_own_files(self.path, self.job, orphans)
        beyond = -1 if limit is None else limit
        discarded = sorted({p[1] for n in deleted if (p := parse_name(n)) and p[1] > beyond})
        return committed, discarded

    def _start_over(self, table: DeltaTable, done: int) -> None:
        """An empty start over a table this job committed to: allowed only when the table
        holds no epoch (e.g. restored to its creation); the job's ``txn`` is reset, so that
        the new run's checkpoints (whose ids may start again, in a new metastore) commit."""
        assert self.job is not None
        if self._epoch >= 0:
            raise StorageError(
                f"{FIELD}: {self.path} holds epochs 0 to {self._epoch} committed by checkpoint "
                f"{done}; an empty start would write them again (restore a checkpoint)"
            )
        commit_files(
            table,
            self.path,
            job=self.job,
            checkpoint_id=NO_CHECKPOINT,
            epoch=-1,
            epochs=[],
            adds=[],
            removes={},
            schema=table.schema(),
        )

    def _pending(
        self, state: Sequence[dict[str, Any]], limit: int | None
    ) -> dict[int, list[DataFile]]:
        """The checkpoint's staged epochs the table does not hold yet."""
        if limit is None:
            return {}
        pending: dict[int, list[DataFile]] = {}
        for item in state:
            epoch = validate_epoch(item.get("epoch"))
            if self._epoch < epoch <= limit:
                pending[epoch] = [DataFile.from_item(epoch, f) for f in item.get("files", [])]
        return pending

    def recovery_detail(self) -> dict[str, Any] | None:
        return self._detail

    def committed_epochs(self) -> list[int]:
        """Epochs the table holds (0 to its last epoch), as this job committed them."""
        table = open_table(self.path)
        if table is None:
            return []
        return list(range(current_state(table).epoch + 1))

    # ------------------------------------------------------------------ the end

    def publish_final(self, df: DataFrame, token: str) -> str:
        """Nothing to write: an upsert table already is the final table after the last
        checkpoint's commit (a changelog table holds every epoch). Returns the table's URL;
        ``df`` is not read. Files of ours no version of the log adds (a retried task's
        leftovers) are deleted, as every epoch is committed by now."""
        with self._lock:
            if not self._staged and self._table is not None and self.job is not None:
                try:
                    orphans = set(list_own_files(self.path, self.job))
                    orphans -= referenced_files(self.path, self._table)
                    delete_own_files(self.path, self.job, orphans)
                except OSError as exc:
                    log.warning("sink: could not delete leftover files: %s", exc)
        if self.mode == "upsert" and self._schema is not None:
            names = [f.name for f in df.schema.fields]
            if names != self._schema.names:
                log.warning(
                    "sink: the final table's columns %s differ from the Delta table's %s",
                    names,
                    self._schema.names,
                )
        return self.path
