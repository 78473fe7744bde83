"""Exactly-once Iceberg sink (Flink's ``TwoPhaseCommitSinkFunction`` over an Iceberg table in
pyiceberg's SQL catalog), with a local or S3 warehouse; no Spark Iceberg jars.

* **Pre-commit** (:meth:`IcebergSink.stage`): the executors write the epoch's Parquet data files
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

* **Commit** (:meth:`IcebergSink.commit`, on checkpoint completion): one Iceberg snapshot per
  completed checkpoint (an overwrite in upsert mode, an append otherwise), its summary carrying
  the job, the checkpoint id and the last epoch (:mod:`checkpointing.sinks.iceberg_table`); a
  checkpoint the current snapshot already has (or a newer one) is a no-op.

* **Recover** (:meth:`IcebergSink.recover`): a table ahead of the restored checkpoint is rolled
  back to that checkpoint's snapshot (reported by :meth:`IcebergSink.recovery_detail`), the
  checkpoint's staged epochs the table lacks are committed (from the sink's list state), and
  every data file of ours no snapshot references is deleted.

Limits: one writer per table (the job's driver); no partition spec (an unpartitioned table);
snapshots are never expired by the sink (``expire_snapshots`` is the table owner's call, after
which a restore to an older checkpoint than the oldest snapshot is refused).
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

from checkpointing.errors import ConfigError, StorageError
from checkpointing.sinks import iceberg_table as it
from checkpointing.sinks.delta_files import (
    WRITTEN,
    DataFile,
    bucket_count,
    delete_own_files,
    file_name,
    file_stats,
    filesystem,
    list_own_files,
    parse_name,
    write_bucket,
)
from checkpointing.sinks.delta_log import top_level_entries
from checkpointing.spark.keys import key_group_column
from checkpointing.spark.parquet_sink import validate_epoch

if TYPE_CHECKING:
    from pyiceberg.table import Table

log = logging.getLogger(__name__)

_BUCKET = "__bucket"
MODES = ("upsert", "append")


class IcebergSink:
    """An Iceberg table written exactly once per checkpoint; see the module docstring."""

    def __init__(
        self,
        warehouse: str,
        *,
        table: str,
        catalog: str | None = None,
        job: str | None,
        key: Sequence[str],
        mode: str = "upsert",
        max_parallelism: int = 128,
    ) -> None:
        """Reads only: refuses a table ``job`` may not write (another job's or writer's, a
        non-empty location that is no table of the catalog, an unreachable catalog)."""
        if mode not in MODES:
            raise ValueError(f"sink.mode: {mode!r} is not upsert or append")
        try:
            self.identifier = it.parse_identifier(table)
        except ValueError as exc:
            raise ConfigError(f"{it.TABLE_FIELD}: {exc}") from None
        self.name = table
        self.warehouse = it.warehouse_url(warehouse)
        catalog_url = catalog or it.default_catalog(self.warehouse)
        if catalog_url is None:
            raise ConfigError(
                f"{it.CATALOG_FIELD}: an s3:// warehouse needs a catalog (a SQLAlchemy URL, "
                "e.g. postgresql+psycopg://host/db)"
            )
        self.catalog_url = catalog_url
        self.path = it.table_location(self.warehouse, self.identifier)
        self.data = it.data_url(self.path)
        self.job = job
        self.key = list(key)
        self.mode = mode
        self.max_parallelism = max_parallelism
        self.buckets = bucket_count(max_parallelism)
        self._catalog = it.open_catalog(catalog_url, self.warehouse)
        self._table = self._check_location()
        self._schema: pa.Schema | None = None
        self._staged: dict[int, list[DataFile]] = {}
        #: upsert: bucket → the file the table holds for it, and its newest (staged) file
        self._committed: dict[int, str] = {}
        self._current: dict[int, str] = {}
        self._epoch = -1
        self._detail: dict[str, Any] | None = None
        self._lock = threading.RLock()
        if self._table is not None:
            self._load(self._table)

    def __repr__(self) -> str:
        return f"IcebergSink({self.name!r} at {self.path!r}, mode={self.mode!r})"

    # ------------------------------------------------------------------ the table

    def _check_location(self) -> Table | None:
        table = it.load_table(self._catalog, self.identifier)
        if table is not None:
            if table.location().removeprefix("file://").rstrip("/") != self.path.removeprefix(
                "file://"
            ):
                raise ConfigError(
                    f"{it.TABLE_FIELD}: {self.name} is at {table.location()}, not in the "
                    f"warehouse of sink.path ({self.warehouse}); use another table"
                )
            if self.job is not None:
                it.check_owner(table, self.name, self.job)
            return table
        entries = top_level_entries(self.path)
        if entries:
            shown = ", ".join(entries[:3]) + (", …" if len(entries) > 3 else "")
            raise ConfigError(
                f"{it.FIELD}: {self.path} is not empty ({shown}) and is no table of the "
                "catalog; use another table or warehouse, the sink never writes among files "
                "it did not create"
            )
        return None

    def _load(self, table: Table) -> None:
        self._epoch = it.current_state(table).epoch
        self.buckets = it.table_buckets(table) or self.buckets
        self._committed, self._current = {}, {}
        for name in it.live_files(table):
            parsed = parse_name(name)
            if parsed is not None and parsed[2] == "g":
                self._committed[parsed[3]] = name
                self._current[parsed[3]] = name

    def _writable(self, df: DataFrame) -> Table:
        if self.job is None:
            raise StorageError(f"{self!r} was opened read-only (no job)")
        schema = self.schema_for(df)
        if self._schema is not None and schema != self._schema:
            raise StorageError(f"{it.TABLE_FIELD}: {self.name}: epochs differ in schema")
        if self._table is None:
            self._table = it.load_table(self._catalog, self.identifier)
        if self._table is None:
            self._table = it.create_table(
                self._catalog,
                self.identifier,
                self.path,
                job=self.job,
                mode=self.mode,
                buckets=self.buckets,
                schema=schema,
                catalog_url=self.catalog_url,
            )
            log.info("sink: created Iceberg table %s at %s (%s)", self.name, self.path, self.mode)
        elif self._schema is None:
            it.check_owner(self._table, self.name, self.job)
            it.check_schema(self._table, self.name, schema)
        if self._schema is None:  # the executors write into it (Arrow makes no local parents)
            filesystem_, root = filesystem(self.data)
            filesystem_.create_dir(root, recursive=True)
        self._schema = schema
        return self._table

    def schema_for(self, df: DataFrame) -> pa.Schema:
        """The table's Arrow schema for rows shaped like ``df`` (all columns nullable)."""
        names = [f.name for f in df.schema.fields]
        missing = [k for k in self.key if k not in names]
        if self.mode == "upsert" and missing:
            raise ValueError(f"sink: key column(s) {missing} are not in the rows ({names})")
        return pa.schema([f.with_nullable(True) for f in to_arrow_schema(df.schema)])

    # ------------------------------------------------------------------ phase one

    def stage(self, epoch: int, df: DataFrame) -> None:
        """Pre-commit: the executors write the epoch's files; the driver keeps their metadata."""
        epoch = validate_epoch(epoch)
        if epoch <= self._epoch or epoch in self._staged:
            raise StorageError(
                f"{it.TABLE_FIELD}: {self.name}: epoch {epoch} is already staged or in the "
                f"table (holds epochs up to {self._epoch})"
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

            def append(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
                from pyspark import TaskContext

                context = TaskContext.get()
                partition = context.partitionId() if context is not None else 0
                yield from write_rows(url, job, epoch, schema, partition, batches)

            written = df.mapInArrow(append, from_arrow_schema(WRITTEN))
        files = [
            DataFile(epoch, r.part, r.path, r.size, r.rows)
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
        """One item per staged, uncommitted epoch ``<= up_to_epoch``: its files."""
        with self._lock:
            staged = sorted(self._staged.items())
        return [
            {"epoch": e, "files": [f.item() for f in fs]} for e, fs in staged if e <= up_to_epoch
        ]

    # ------------------------------------------------------------------ phase two

    def commit(self, up_to_epoch: int, checkpoint_id: int | None = None) -> list[int]:
        """One snapshot for the checkpoint: the staged epochs ``<= up_to_epoch``. A checkpoint
        the current snapshot already has (or a newer one) is a no-op."""
        up_to = validate_epoch(up_to_epoch, "up_to_epoch")
        with self._lock:
            pending = {e: files for e, files in self._staged.items() if e <= up_to}
            if self._table is None or self.job is None:
                return []
            self._table = self._table.refresh()
            done = it.current_state(self._table).checkpoint_id
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
        assert self.job is not None and self._table is not None
        epochs = sorted(pending)
        if self.mode == "upsert":
            newest: dict[int, DataFile] = {}
            for e in epochs:
                newest.update({f.part: f for f in pending[e]})
            adds = [newest[b] for b in sorted(newest)]
            removes = [self._committed[b] for b in newest if b in self._committed]
            superseded = [f.path for e in epochs for f in pending[e] if newest[f.part] is not f]
        else:
            adds = [f for e in epochs for f in pending[e]]
            removes, superseded = [], []
        epoch = max([self._epoch, *epochs])
        self._table = it.commit_files(
            self._table,
            job=self.job,
            checkpoint_id=checkpoint_id,
            epoch=epoch,
            epochs=epochs,
            adds=[f"{self.data}/{f.path}" for f in adds],
            removes=removes,
            catalog_url=self.catalog_url,
        )
        self._epoch = epoch
        if self.mode == "upsert":
            self._committed.update({f.part: f.path for f in adds})
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
        table = it.load_table(self._catalog, self.identifier)
        self._table = table
        if table is None or self.job is None:
            return [], []
        it.check_owner(table, self.name, self.job)
        now = it.current_state(table)
        if limit is not None and checkpoint_id is not None and now.checkpoint_id > checkpoint_id:
            target = it.state_for_checkpoint(table, checkpoint_id)
            table = self._table = it.rollback(table, target, self.catalog_url)
            self._detail = {
                "table": self.name,
                "location": self.path,
                "restored_to_snapshot": target.snapshot_id,
                "from_snapshot": now.snapshot_id,
                "checkpoint_id": checkpoint_id,
                "table_checkpoint_id": now.checkpoint_id,
            }
            log.warning(
                "sink: Iceberg table %s was ahead of checkpoint %d (its snapshot of checkpoint "
                "%d): rolled back to snapshot %d",
                self.name,
                checkpoint_id,
                now.checkpoint_id,
                target.snapshot_id,
            )
        self._load(table)
        done = it.current_state(table).checkpoint_id
        if limit is None and done > it.NO_CHECKPOINT:
            self._start_over(done)
        pending = self._pending(state, limit)
        existing = list_own_files(self.data, self.job)
        missing = sorted(f.path for fs in pending.values() for f in fs if f.path not in existing)
        if missing:
            raise StorageError(
                f"{it.TABLE_FIELD}: {self.name}: checkpoint {checkpoint_id}'s staged files are "
                f"gone ({', '.join(missing[:3])}); restore from a newer checkpoint"
            )
        committed: list[int] = []
        if limit is not None and checkpoint_id is not None and (pending or done < checkpoint_id):
            committed = self._commit(pending, checkpoint_id)
        elif pending:  # no checkpoint id: commit under the table's current one
            committed = self._commit(pending, done)
        assert self._table is not None
        orphans = set(existing) - it.referenced_files(self._table)
        deleted = delete_own_files(self.data, self.job, orphans)
        return committed, it.own_file_epochs(deleted, -1 if limit is None else limit)

    def _start_over(self, done: int) -> None:
        """An empty start over a table this job committed to: allowed only when the table
        holds no epoch; an empty snapshot of no checkpoint lets the new run's checkpoints
        (whose ids may start again, in a new metastore) commit."""
        assert self.job is not None and self._table is not None
        if self._epoch >= 0:
            raise StorageError(
                f"{it.TABLE_FIELD}: {self.name} holds epochs 0 to {self._epoch} committed by "
                f"checkpoint {done}; an empty start would write them again (restore a checkpoint)"
            )
        self._table = it.commit_files(
            self._table,
            job=self.job,
            checkpoint_id=it.NO_CHECKPOINT,
            epoch=-1,
            epochs=[],
            adds=[],
            removes=[],
            catalog_url=self.catalog_url,
        )

    def _pending(
        self, state: Sequence[dict[str, Any]], limit: int | None
    ) -> dict[int, list[DataFile]]:
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
        """Epochs the table holds (0 to its last epoch)."""
        table = it.load_table(self._catalog, self.identifier)
        if table is None:
            return []
        return list(range(it.current_state(table).epoch + 1))

    # ------------------------------------------------------------------ the end

    def publish_final(self, df: DataFrame, token: str) -> str:
        """Nothing to write: the table is the final table after the last checkpoint's commit.
        Returns its location; files of ours no snapshot references are deleted."""
        with self._lock:
            if not self._staged and self._table is not None and self.job is not None:
                try:
                    orphans = set(list_own_files(self.data, self.job))
                    orphans -= it.referenced_files(self._table.refresh())
                    delete_own_files(self.data, self.job, orphans)
                except OSError as exc:
                    log.warning("sink: could not delete leftover files: %s", exc)
        return self.path


def write_rows(
    url: str,
    job: str,
    epoch: int,
    schema: pa.Schema,
    partition: int,
    batches: Iterator[pa.RecordBatch],
) -> Iterator[pa.RecordBatch]:
    """Append, on an executor: one Spark partition's rows of the epoch, as they are, as one
    file; one :data:`WRITTEN` row, none for an empty partition."""
    import time

    import pyarrow.parquet as pq

    rows = [pa.Table.from_batches([b]) for b in batches if b.num_rows]
    if not rows:
        return
    table = pa.concat_tables(rows).select(schema.names).cast(schema)
    filesystem_, root = filesystem(url)
    name = file_name(job, epoch, "p", partition)
    pq.write_table(table, f"{root}/{name}", filesystem=filesystem_)
    size = filesystem_.get_file_info(f"{root}/{name}").size
    yield from pa.table(
        {
            "part": [partition],
            "path": [name],
            "size": [int(size)],
            "rows": [table.num_rows],
            "stats": [file_stats(table)],
            "mtime": [int(time.time() * 1000)],
        },
        schema=WRITTEN,
    ).to_batches()
