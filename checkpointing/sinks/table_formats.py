"""The table formats of the exactly-once table sink (:mod:`checkpointing.spark.table_sink`), no
Spark here: what differs between a Delta table (:mod:`checkpointing.sinks.delta_log`) and an
Iceberg table (:mod:`checkpointing.sinks.iceberg_table`) — opening, creating and checking the
table, the state it holds (the checkpoint of its newest commit, its last epoch, its files), one
checkpoint's commit, the roll-back to an older checkpoint's state, and the files any version of
it still references. The staged epochs, the commit and recover flow and the data files
themselves (:mod:`checkpointing.sinks.delta_files`) are the sink's, the same for both.

A format object holds the table's handle (None until the table exists) for one job's sink.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from checkpointing.errors import ConfigError
from checkpointing.sinks import delta_log as dl
from checkpointing.sinks import iceberg_table as it
from checkpointing.sinks.delta_files import DataFile, filesystem

if TYPE_CHECKING:
    from deltalake import DeltaTable
    from pyiceberg.table import Table

log = logging.getLogger(__name__)

#: the checkpoint of a commit no checkpoint made (a table's creation; ids start at 1)
NO_CHECKPOINT = dl.NO_CHECKPOINT
assert NO_CHECKPOINT == it.NO_CHECKPOINT


@dataclass(frozen=True)
class TableCommit:
    """One commit of the table: the files ``removes`` (``{name: size}``) replaced by ``adds``,
    recorded as checkpoint ``checkpoint_id``'s, the table holding epochs up to ``epoch`` after
    it (``epochs``: those it adds). ``schema``: the sink's (None: the table's)."""

    checkpoint_id: int
    epoch: int
    epochs: Sequence[int] = ()
    adds: Sequence[DataFile] = ()
    removes: Mapping[str, int] = field(default_factory=dict)
    schema: pa.Schema | None = None


class TableFormat(Protocol):
    """The format-specific operations of the table sink over one table."""

    #: the table's location, and the folder of its data files
    path: str
    data: str
    #: the field and the table, as error messages name them (``sink.path: s3://…``)
    subject: str

    def describe(self, mode: str) -> str:
        """The sink's ``repr``."""
        ...

    def open(self) -> bool:
        """Load the table anew (None when there is none) and check, for a job, that it is
        that job's; whether it exists."""
        ...

    def exists(self) -> bool:
        """Whether the handle holds a table (as last loaded)."""
        ...

    def prepare(self, schema: pa.Schema, *, mode: str, buckets: int, first: bool) -> None:
        """Before an epoch's files are written: the table opened or created (empty); on the
        ``first`` epoch of the sink, an existing table's owner and schema checked."""
        ...

    def differing_schema(self, schema: pa.Schema) -> str:
        """The message of an epoch whose schema is not the sink's earlier epochs'."""
        ...

    def current(self) -> tuple[int, int | None, dict[str, int]]:
        """The table's last epoch (-1: none), its upsert bucket count (None: not recorded) and
        its current data files ``{name: size}``."""
        ...

    def done(self, *, refresh: bool) -> int:
        """The checkpoint the table's current state belongs to (refreshed first, or not)."""
        ...

    def commit(self, change: TableCommit) -> None:
        """One commit of the table (see :class:`TableCommit`)."""
        ...

    def roll_back(self, checkpoint_id: int, done: int) -> dict[str, Any]:
        """Bring the table (ahead, at checkpoint ``done``) back to what ``checkpoint_id`` had
        committed; what was done, for the restore's record."""
        ...

    def referenced_files(self, *, refresh: bool) -> set[str]:
        """The data files any version of the table still holds (never deleted)."""
        ...

    def stored_epoch(self) -> int:
        """The last epoch of the table as stored now (opened anew; -1: none or no table)."""
        ...

    def final_columns(self, names: list[str], schema: pa.Schema) -> None:
        """The job finished with a final table of columns ``names``: a warning if it matters."""
        ...


class DeltaFormat:
    """A Delta table at ``path`` (delta-rs), optionally partitioned (a changelog table)."""

    def __init__(self, path: str, job: str | None, partition_by: Sequence[str] = ()) -> None:
        """Reads only: refuses a location ``job`` may not write to (see
        :func:`checkpointing.sinks.delta_log.check_location`)."""
        self.path = self.data = dl.table_url(path)
        self.subject = f"{dl.FIELD}: {self.path}"
        self.job = job
        self.partition_by = list(partition_by)
        self.table: DeltaTable | None = dl.check_location(self.path, job)

    def describe(self, mode: str) -> str:
        return f"DeltaSink({self.path!r}, mode={mode!r})"

    def open(self) -> bool:
        self.table = dl.open_table(self.path)
        if self.table is not None and self.job is not None:
            dl.check_owner(self.table, self.path, self.job)
        return self.table is not None

    def exists(self) -> bool:
        return self.table is not None

    def _table(self) -> DeltaTable:
        assert self.table is not None
        return self.table

    def prepare(self, schema: pa.Schema, *, mode: str, buckets: int, first: bool) -> None:
        assert self.job is not None
        if self.table is None:
            self.table = dl.open_table(self.path)
        if self.table is None:
            self.table = dl.create_table(
                self.path, self.job, mode, schema, buckets, self.partition_by
            )
            log.info("sink: created Delta table %s (%s)", self.path, mode)
        elif first:
            dl.check_owner(self.table, self.path, self.job)
            dl.check_schema(self.table, self.path, schema)
            dl.check_partitions(self.table, self.path, self.partition_by)

    def differing_schema(self, schema: pa.Schema) -> str:
        return f"{self.subject}: epochs differ in schema ({schema})"

    def current(self) -> tuple[int, int | None, dict[str, int]]:
        table = self._table()
        return dl.current_state(table).epoch, dl.table_buckets(table), dl.current_files(table)

    def done(self, *, refresh: bool) -> int:
        table = self._table()
        if refresh:
            table.update_incremental()
        return table.transaction_version(self.job) or NO_CHECKPOINT

    def commit(self, change: TableCommit) -> None:
        table = self._table()
        dl.commit_files(
            table,
            self.path,
            job=self.job or "",
            checkpoint_id=change.checkpoint_id,
            epoch=change.epoch,
            epochs=change.epochs,
            adds=change.adds,
            removes=change.removes,
            schema=change.schema if change.schema is not None else table.schema(),
        )

    def roll_back(self, checkpoint_id: int, done: int) -> dict[str, Any]:
        table = self._table()
        before = table.version()
        target = dl.state_for_checkpoint(table, checkpoint_id)
        dl.restore_table(table, self.path, self.job or "", target)
        log.warning(
            "sink: table %s was ahead of checkpoint %d (its commit of checkpoint %d): "
            "restored version %d",
            self.path,
            checkpoint_id,
            done,
            target.version,
        )
        return {
            "table": self.path,
            "restored_to_version": target.version,
            "from_version": before,
            "checkpoint_id": checkpoint_id,
            "table_checkpoint_id": done,
        }

    def referenced_files(self, *, refresh: bool) -> set[str]:
        return dl.referenced_files(self.path, self._table())

    def stored_epoch(self) -> int:
        table = dl.open_table(self.path)
        return -1 if table is None else dl.current_state(table).epoch

    def final_columns(self, names: list[str], schema: pa.Schema) -> None:
        if names != schema.names:
            log.warning(
                "sink: the final table's columns %s differ from the Delta table's %s",
                names,
                schema.names,
            )


class IcebergFormat:
    """The Iceberg table ``table`` (``<namespace>.<name>``) of a pyiceberg SQL catalog (by
    default a SQLite file in a local ``warehouse``; required for an S3 one)."""

    def __init__(self, warehouse: str, table: str, catalog: str | None, job: str | None) -> None:
        """Reads only: refuses a table ``job`` may not write (another job's or writer's, a
        non-empty location that is no table of the catalog, an unreachable catalog)."""
        try:
            self.identifier = it.parse_identifier(table)
        except ValueError as exc:
            raise ConfigError(f"{it.TABLE_FIELD}: {exc}") from None
        self.name = table
        self.subject = f"{it.TABLE_FIELD}: {table}"
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
        self._catalog = it.open_catalog(catalog_url, self.warehouse)
        self.table: Table | None = self._check_location()

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
        entries = dl.top_level_entries(self.path)
        if entries:
            shown = ", ".join(entries[:3]) + (", …" if len(entries) > 3 else "")
            raise ConfigError(
                f"{it.FIELD}: {self.path} is not empty ({shown}) and is no table of the "
                "catalog; use another table or warehouse, the sink never writes among files "
                "it did not create"
            )
        return None

    def describe(self, mode: str) -> str:
        return f"IcebergSink({self.name!r} at {self.path!r}, mode={mode!r})"

    def open(self) -> bool:
        self.table = it.load_table(self._catalog, self.identifier)
        if self.table is not None and self.job is not None:
            it.check_owner(self.table, self.name, self.job)
        return self.table is not None

    def exists(self) -> bool:
        return self.table is not None

    def _table(self) -> Table:
        assert self.table is not None
        return self.table

    def prepare(self, schema: pa.Schema, *, mode: str, buckets: int, first: bool) -> None:
        assert self.job is not None
        if self.table is None:
            self.table = it.load_table(self._catalog, self.identifier)
        if self.table is None:
            self.table = it.create_table(
                self._catalog,
                self.identifier,
                self.path,
                job=self.job,
                mode=mode,
                buckets=buckets,
                schema=schema,
                catalog_url=self.catalog_url,
            )
            log.info("sink: created Iceberg table %s at %s (%s)", self.name, self.path, mode)
        elif first:
            it.check_owner(self.table, self.name, self.job)
            it.check_schema(self.table, self.name, schema)
        if first:  # the executors write into it (Arrow makes no local parents)
            filesystem_, root = filesystem(self.data)
            filesystem_.create_dir(root, recursive=True)

    def differing_schema(self, schema: pa.Schema) -> str:
        return f"{self.subject}: epochs differ in schema"

    def current(self) -> tuple[int, int | None, dict[str, int]]:
        table = self._table()
        files = {n: int(f.file_size_in_bytes) for n, f in it.live_files(table).items()}
        return it.current_state(table).epoch, it.table_buckets(table), files

    def done(self, *, refresh: bool) -> int:
        if refresh:
            self.table = self._table().refresh()
        return it.current_state(self._table()).checkpoint_id

    def commit(self, change: TableCommit) -> None:
        self.table = it.commit_files(
            self._table(),
            job=self.job or "",
            checkpoint_id=change.checkpoint_id,
            epoch=change.epoch,
            epochs=change.epochs,
            adds=[f"{self.data}/{f.path}" for f in change.adds],
            removes=list(change.removes),
            catalog_url=self.catalog_url,
        )

    def roll_back(self, checkpoint_id: int, done: int) -> dict[str, Any]:
        now = it.current_state(self._table())
        target = it.state_for_checkpoint(self._table(), checkpoint_id)
        self.table = it.rollback(self._table(), target, self.catalog_url)
        log.warning(
            "sink: Iceberg table %s was ahead of checkpoint %d (its snapshot of checkpoint "
            "%d): rolled back to snapshot %d",
            self.name,
            checkpoint_id,
            done,
            target.snapshot_id,
        )
        return {
            "table": self.name,
            "location": self.path,
            "restored_to_snapshot": target.snapshot_id,
            "from_snapshot": now.snapshot_id,
            "checkpoint_id": checkpoint_id,
            "table_checkpoint_id": done,
        }

    def referenced_files(self, *, refresh: bool) -> set[str]:
        table = self._table()
        return it.referenced_files(table.refresh() if refresh else table)

    def stored_epoch(self) -> int:
        table = it.load_table(self._catalog, self.identifier)
        return -1 if table is None else it.current_state(table).epoch

    def final_columns(self, names: list[str], schema: pa.Schema) -> None:
        """The final table is the Iceberg table as committed: nothing to say."""
