"""The exactly-once table sink (Flink's ``TwoPhaseCommitSinkFunction`` over a table), the same
for a Delta and an Iceberg table: :class:`TableSink` holds the staged epochs and their data
files, stages them on the executors and commits and recovers them, composed with a
:class:`~checkpointing.sinks.table_formats.TableFormat` that does what differs between the two
formats. :mod:`checkpointing.spark.delta_sink` and :mod:`checkpointing.spark.iceberg_sink` say
how each format uses it.

* **Pre-commit** (:meth:`TableSink.stage`): the executors write the epoch's Parquet data files
  into the table's data folder (:mod:`checkpointing.sinks.delta_files`) and return only their
  metadata (one row per file; the driver never collects rows). ``upsert``: one file per bucket
  of key groups, the epoch's changed rows merged copy-on-write with the bucket's newest file;
  otherwise one file per Spark partition (and partition value).
* **Commit** (:meth:`TableSink.commit`): one table commit per completed checkpoint, recorded as
  that checkpoint's; upsert replaces each bucket's committed file by its newest staged one, and
  deletes the staged files a newer one of the same bucket superseded before the commit.
* **Recover** (:meth:`TableSink.recover`): a table ahead of the restored checkpoint is brought
  back to that checkpoint's state, the checkpoint's staged epochs the table lacks are committed
  (from the sink's list state), and every file of ours no version of the table references is
  deleted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

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
from checkpointing.sinks.iceberg_table import own_file_epochs
from checkpointing.sinks.protocol import ListState, Recovery
from checkpointing.sinks.table_formats import NO_CHECKPOINT, TableCommit, TableFormat
from checkpointing.spark.keys import key_group_column
from checkpointing.spark.parquet_sink import validate_epoch

log = logging.getLogger(__name__)

_BUCKET = "__bucket"


class TableSink:
    """A table written exactly once per checkpoint, in the format ``table``; see the module
    docstring. ``mode``: ``upsert`` (one row per ``key``), else every epoch's rows appended
    (``changelog`` adds the epoch as a column)."""

    def __init__(
        self,
        table: TableFormat,
        *,
        job: str | None,
        key: Sequence[str],
        mode: str,
        max_parallelism: int,
        partition_by: Sequence[str] = (),
    ) -> None:
        self.table = table
        self.path = table.path
        self.data = table.data
        self.job = job
        self.key = list(key)
        self.mode = mode
        self.partition_by = list(partition_by)
        self.max_parallelism = max_parallelism
        self.buckets = bucket_count(max_parallelism)
        self._schema: pa.Schema | None = None
        #: staged, uncommitted epochs and their files
        self._staged: dict[int, list[DataFile]] = {}
        #: upsert: bucket → the file the table holds for it (name, size), and its newest file
        self._committed: dict[int, tuple[str, int]] = {}
        self._current: dict[int, str] = {}
        #: the last epoch the table holds
        self._epoch = -1
        self._detail: dict[str, Any] | None = None
        #: a completion notification may commit from another thread than the epochs' stage
        self._lock = threading.RLock()
        if table.exists():
            self._load()

    def __repr__(self) -> str:
        return self.table.describe(self.mode)

    # ------------------------------------------------------------------ the table

    def _load(self) -> None:
        """The in-memory view of what the table holds."""
        self._epoch, buckets, files = self.table.current()
        self.buckets = buckets or self.buckets
        self._committed, self._current = {}, {}
        for name, size in files.items():
            parsed = parse_name(name)
            if parsed is not None and parsed[2] == "g":
                self._committed[parsed[3]] = (name, size)
                self._current[parsed[3]] = name

    def _writable(self, df: DataFrame) -> None:
        """The table ready for ``df``'s rows: its schema checked against the existing table,
        or the table created (empty) — before the first data file is written."""
        if self.job is None:
            raise StorageError(f"{self!r} was opened read-only (no job)")
        schema = self.schema_for(df)
        if self._schema is not None and schema != self._schema:
            raise StorageError(self.table.differing_schema(schema))
        first = self._schema is None
        self.table.prepare(schema, mode=self.mode, buckets=self.buckets, first=first)
        self._schema = schema

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
                f"{self.table.subject}: epoch {epoch} is already staged or in the table "
                f"(holds epochs up to {self._epoch})"
            )
        self._writable(df)
        assert self._schema is not None and self.job is not None
        url, job, schema = self.data, self.job, self._schema
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
        """One table commit for the checkpoint: the staged epochs ``<= up_to_epoch``. A
        checkpoint the table already has (or a newer one) is a no-op."""
        up_to = validate_epoch(up_to_epoch, "up_to_epoch")
        with self._lock:
            pending = {e: files for e, files in self._staged.items() if e <= up_to}
            if not self.table.exists() or self.job is None:
                return []
            done = self.table.done(refresh=True)
            if checkpoint_id is None:
                if not pending:
                    return []
                checkpoint_id = done
            elif done >= checkpoint_id:
                for e in pending:
                    del self._staged[e]
                return []
            return self._commit(pending, checkpoint_id)

    def _commit(self, pending: dict[int, list[DataFile]], checkpoint_id: int) -> list[int]:
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
        self.table.commit(TableCommit(checkpoint_id, epoch, epochs, adds, removes, self._schema))
        self._epoch = epoch
        if self.mode == "upsert":
            self._committed.update({f.part: (f.path, f.size) for f in adds})
        for e in epochs:
            self._staged.pop(e, None)
        if superseded:  # never committed, and no later commit adds them
            try:
                delete_own_files(self.data, self.job, superseded)
            except OSError as exc:
                log.warning("sink: could not delete superseded staged files: %s", exc)
        return epochs

    # ------------------------------------------------------------------ restore

    def recover(
        self,
        checkpoint_epoch: int | None,
        *,
        checkpoint_id: int | None = None,
        state: ListState = (),
    ) -> Recovery:
        """:meth:`checkpointing.sinks.protocol.Sink.recover`: the table brought back to
        checkpoint ``checkpoint_id`` (epochs ``<= checkpoint_epoch``; None: an empty start),
        the epochs of its list ``state`` the table lacks committed, files beyond it deleted."""
        with self._lock:
            return self._recover(checkpoint_epoch, checkpoint_id, state)

    def _recover(
        self,
        checkpoint_epoch: int | None,
        checkpoint_id: int | None,
        state: ListState,
    ) -> Recovery:
        self._detail = None
        self._staged.clear()
        limit = None if checkpoint_epoch is None else validate_epoch(checkpoint_epoch)
        if not self.table.open() or self.job is None:
            return [], []
        done = self.table.done(refresh=False)
        if limit is not None and checkpoint_id is not None and done > checkpoint_id:
            self._detail = self.table.roll_back(checkpoint_id, done)
        self._load()
        if limit is None and done > NO_CHECKPOINT:
            self._start_over(done)
        pending = self._pending(state, limit)
        existing = list_own_files(self.data, self.job)
        missing = sorted(f.path for fs in pending.values() for f in fs if f.path not in existing)
        if missing:
            raise StorageError(
                f"{self.table.subject}: checkpoint {checkpoint_id}'s staged files are gone "
                f"({', '.join(missing[:3])}); restore from a newer checkpoint"
            )
        committed: list[int] = []
        done = self.table.done(refresh=False)
        if limit is not None and checkpoint_id is not None and (pending or done < checkpoint_id):
            committed = self._commit(pending, checkpoint_id)
        elif pending:  # no checkpoint id: commit under the table's current one
            committed = self._commit(pending, done)
        orphans = set(existing) - self.table.referenced_files(refresh=False)
        deleted = delete_own_files(self.data, self.job, orphans)
        return committed, own_file_epochs(deleted, -1 if limit is None else limit)

    def _start_over(self, done: int) -> None:
        """An empty start over a table this job committed to: allowed only when the table
        holds no epoch (e.g. restored to its creation); a commit of no checkpoint lets the new
        run's checkpoints (whose ids may start again, in a new metastore) commit."""
        if self._epoch >= 0:
            raise StorageError(
                f"{self.table.subject} holds epochs 0 to {self._epoch} committed by checkpoint "
                f"{done}; an empty start would write them again (restore a checkpoint)"
            )
        self.table.commit(TableCommit(NO_CHECKPOINT, -1))

    def _pending(self, state: ListState, limit: int | None) -> dict[int, list[DataFile]]:
        """The checkpoint's staged epochs the table does not hold yet."""
        if limit is None:
            return {}
        pending: dict[int, list[DataFile]] = {}
        for item in state:
            epoch = validate_epoch(item.get("epoch"))
            if self._epoch < epoch <= limit:
                pending[epoch] = [DataFile.from_item(epoch, f) for f in item.get("files", [])]
        return pending

    def reset(self) -> list[int]:
        """:meth:`checkpointing.sinks.protocol.Sink.reset`: the table brought back to its
        creation (a Delta ``RESTORE``, an Iceberg rollback: one new version, the older ones
        kept for time travel); the restore's empty start then commits over it."""
        with self._lock:
            self._staged.clear()
            if not self.table.open() or self.job is None:
                return []
            epochs = self.committed_epochs()
            done = self.table.done(refresh=False)
            if epochs and done > NO_CHECKPOINT:
                self.table.roll_back(NO_CHECKPOINT, done)
            return epochs

    def recovery_detail(self) -> dict[str, Any] | None:
        return self._detail

    def committed_epochs(self) -> list[int]:
        """Epochs the table holds (0 to its last epoch), as this job committed them."""
        return list(range(self.table.stored_epoch() + 1))

    # ------------------------------------------------------------------ the end

    def publish_final(self, df: DataFrame, token: str) -> str:
        """Nothing to write: the table is the final table after the last checkpoint's commit
        (an upsert table one row per key, any other every epoch's rows); ``df`` is not read.
        Returns the table's location; files of ours no version of the table references (a
        retried task's leftovers) are deleted, as every epoch is committed by now."""
        with self._lock:
            if not self._staged and self.table.exists() and self.job is not None:
                try:
                    orphans = set(list_own_files(self.data, self.job))
                    orphans -= self.table.referenced_files(refresh=True)
                    delete_own_files(self.data, self.job, orphans)
                except OSError as exc:
                    log.warning("sink: could not delete leftover files: %s", exc)
        if self.mode == "upsert" and self._schema is not None:
            self.table.final_columns([f.name for f in df.schema.fields], self._schema)
        return self.path
