"""The data files of a Delta Lake sink table (no Spark, no delta-rs here): their names, how an
executor writes them (pre-commit), and listing and deleting the sink's own files.

A file is named ``ckpt-<job>-e<epoch>-<g|p><n>-<uuid>.parquet`` in the table's root: the job
that wrote it, the epoch whose rows it holds, then ``g<bucket>`` (upsert: one file per bucket of
key groups, rewritten copy-on-write) or ``p<partition>`` (changelog: one file per Spark
partition of an epoch; with partition columns, one file per Spark partition and partition
value, its values in the Add action and not in the file, as Delta stores them). The name is all a
restore needs to tell the sink's files from anyone
else's, and which epoch and bucket they belong to; the sink never deletes a file whose name does
not parse, or names another job.

Executors write the files here (with Arrow, through :mod:`checkpointing.state.object_store` on S3)
and
return one metadata row each; the driver commits them to the Delta log
(:mod:`checkpointing.sinks.delta_log`). Until then no reader sees them: a Delta reader reads only
the files the log adds.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from checkpointing.state.object_store import is_object_url

#: the sink's data files (see the module docstring); nothing else is ever deleted
FILE_NAME = re.compile(
    r"ckpt-(?P<job>[A-Za-z0-9][A-Za-z0-9._-]{0,127})-e(?P<epoch>0|[1-9][0-9]{0,18})"
    r"-(?P<kind>[gp])(?P<part>0|[1-9][0-9]{0,5})-[0-9a-f]{32}\.parquet",
    re.ASCII,
)
#: at most this many upsert files (buckets of contiguous key groups) per table: fewer files
#: cost less per epoch (each is read and rewritten by one task), more rewrite less of a table
#: whose epochs touch few keys. A table keeps the count it was created with (``ckptBuckets``).
MAX_BUCKETS = 32
#: one row per data file written on an executor: what the commit's Add action needs
WRITTEN = pa.schema(
    [
        ("part", pa.int32()),
        ("path", pa.string()),
        ("size", pa.int64()),
        ("rows", pa.int64()),
        ("stats", pa.string()),
        ("mtime", pa.int64()),
        ("partition_values", pa.string()),  # JSON {column: text or null}; "{}" unpartitioned
    ]
)
#: bounds of a partition-values entry read back from the sink's list state
_MAX_PARTITION_COLUMNS = 64
_MAX_PARTITION_VALUE = 4096
_STRING_STATS_MAX = 64


@dataclass(frozen=True)
class DataFile:
    """A data file the sink wrote (relative ``path`` in the table root) and what its Add
    action carries."""

    epoch: int
    part: int
    path: str
    size: int
    rows: int
    stats: str | None = None
    mtime: int = 0
    #: a partitioned table's values of this file's rows (Delta's ``partitionValues``)
    partition_values: tuple[tuple[str, str | None], ...] = ()

    def item(self) -> list[Any]:
        """Its entry in the sink's list state: small, JSON-able (stats are left out)."""
        item: list[Any] = [self.part, self.path, self.size, self.rows]
        return [*item, dict(self.partition_values)] if self.partition_values else item

    @classmethod
    def from_item(cls, epoch: int, item: Any) -> DataFile:
        part, path, size, rows, *more = item
        parsed = parse_name(str(path))
        if parsed is None or parsed[1] != epoch or parsed[3] != int(part) or len(more) > 1:
            raise ValueError(f"sink state: {path!r} is not a data file of epoch {epoch}")
        values = partition_values(more[0]) if more else ()
        return cls(epoch, int(part), str(path), int(size), int(rows), partition_values=values)

    def add_stats(self) -> str:
        return self.stats or json.dumps({"numRecords": self.rows})


def partition_values(raw: Any) -> tuple[tuple[str, str | None], ...]:
    """Partition values as stored (a JSON object of column → text or null), checked and
    bounded: they come from a snapshot or an executor, and go into the table's log."""
    if isinstance(raw, str):
        raw = json.loads(raw)
    if not isinstance(raw, dict) or len(raw) > _MAX_PARTITION_COLUMNS:
        raise ValueError(f"sink state: partition values {str(raw)[:80]!r} are not a mapping")
    for name, value in raw.items():
        if not isinstance(name, str) or not (value is None or isinstance(value, str)):
            raise ValueError(f"sink state: partition value {name!r}: expected text or null")
        if len(name) > _MAX_PARTITION_VALUE or len(value or "") > _MAX_PARTITION_VALUE:
            raise ValueError(f"sink state: partition value {name[:80]!r} is too long")
    return tuple(sorted(raw.items()))


def partition_text(value: Any) -> str | None:
    """A partition value as Delta's ``partitionValues`` writes it (null stays null)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, date):
        return value.isoformat()
    return str(value)


def file_name(job: str, epoch: int, kind: str, part: int) -> str:
    return f"ckpt-{job}-e{epoch}-{kind}{part}-{uuid.uuid4().hex}.parquet"


def parse_name(name: str) -> tuple[str, int, str, int] | None:
    """``(job, epoch, kind, part)`` of one of the sink's file names; None for anything else."""
    match = FILE_NAME.fullmatch(name)
    if match is None:
        return None
    return match["job"], int(match["epoch"]), match["kind"], int(match["part"])


def bucket_count(max_parallelism: int) -> int:
    return min(max_parallelism, MAX_BUCKETS)


# ============================================================================ filesystem


def filesystem(url: str) -> tuple[Any, str]:
    """The Arrow filesystem of a table location and the table root's path in it."""
    if is_object_url(url):
        from checkpointing.state.object_store import filesystem_for

        return filesystem_for(url.rstrip("/"))
    from pyarrow import fs

    return fs.LocalFileSystem(), local_path(url)


def local_path(url: str) -> str:
    return os.path.abspath(url.removeprefix("file://"))


def list_own_files(url: str, job: str) -> dict[str, int]:
    """The sink's data files of ``job`` in the table root: ``{name: size}``."""
    from pyarrow import fs

    filesystem_, root = filesystem(url)
    try:
        infos = filesystem_.get_file_info(fs.FileSelector(root, allow_not_found=True))
    except FileNotFoundError:
        return {}
    found = {}
    for info in infos:
        name = info.path.rsplit("/", 1)[-1]
        parsed = parse_name(name)
        if info.type == fs.FileType.File and parsed is not None and parsed[0] == job:
            found[name] = int(info.size or 0)
    return found


def delete_own_files(url: str, job: str, names: Iterable[str]) -> list[str]:
    """Delete the given data files, only those whose names are the sink's and ``job``'s."""
    filesystem_, root = filesystem(url)
    deleted = []
    for name in sorted(set(names)):
        parsed = parse_name(name)
        if parsed is None or parsed[0] != job or "/" in name:
            continue
        try:
            filesystem_.delete_file(f"{root}/{name}")
        except FileNotFoundError:
            continue
        deleted.append(name)
    return deleted


# ============================================================================ executors


def write_bucket(
    url: str,
    job: str,
    epoch: int,
    key: list[str],
    schema: pa.Schema,
    current: dict[int, str],
    bucket_column: str,
    table: pa.Table,
) -> pa.Table:
    """Upsert, on an executor: the epoch's changed rows of one bucket merged into the bucket's
    current file (its rows of other keys kept, copy-on-write) and written as a new file; one
    :data:`WRITTEN` row. ``current``: bucket → its newest file (committed or staged)."""
    import pyarrow.parquet as pq

    bucket = int(table.column(bucket_column)[0].as_py())
    new = table.select(schema.names).cast(schema)
    filesystem_, root = filesystem(url)
    old_name = current.get(bucket)
    if old_name is not None:
        old = pq.read_table(f"{root}/{old_name}", filesystem=filesystem_).select(schema.names)
        keep = pc.invert(pc.is_in(canonical_key(old, key), value_set=canonical_key(new, key)))
        new = pa.concat_tables([old.cast(schema).filter(keep), new])
    return _write(filesystem_, root, file_name(job, epoch, "g", bucket), bucket, new)


def write_partition(
    url: str,
    job: str,
    epoch: int,
    schema: pa.Schema,
    partition: int,
    batches: Iterator[pa.RecordBatch],
    partition_by: list[str] | None = None,
) -> Iterator[pa.RecordBatch]:
    """Changelog or append, on an executor: one Spark partition's rows of the epoch (the
    ``epoch`` column added when ``schema`` has one the rows lack) as one file — with
    ``partition_by``, one file per partition value, without those columns (their values go into
    the Add action); one :data:`WRITTEN` row per file, none for an empty partition."""
    rows = [pa.Table.from_batches([b]) for b in batches if b.num_rows]
    if not rows:
        return
    table = pa.concat_tables(rows)
    if "epoch" in schema.names and "epoch" not in table.column_names:
        table = table.append_column("epoch", pa.array([epoch] * table.num_rows, pa.int64()))
    table = table.select(schema.names).cast(schema)
    filesystem_, root = filesystem(url)
    if not partition_by:
        name = file_name(job, epoch, "p", partition)
        yield from _write(filesystem_, root, name, partition, table).to_batches()
        return
    data = [n for n in schema.names if n not in partition_by]
    for values in table.select(partition_by).group_by(partition_by).aggregate([]).to_pylist():
        match = None
        for column, value in values.items():
            test = pc.is_null(table[column]) if value is None else pc.equal(table[column], value)
            match = test if match is None else pc.and_(match, test)
        part = table.filter(pc.fill_null(match, False)).select(data)
        texts = json.dumps({c: partition_text(v) for c, v in values.items()})
        name = file_name(job, epoch, "p", partition)
        written = _write(filesystem_, root, name, partition, part, texts)
        yield from written.to_batches()


def _write(
    filesystem_: Any, root: str, name: str, part: int, table: pa.Table, values: str = "{}"
) -> pa.Table:
    import pyarrow.parquet as pq

    path = f"{root}/{name}"
    pq.write_table(table, path, filesystem=filesystem_)
    size = filesystem_.get_file_info(path).size
    return pa.table(
        {
            "part": [part],
            "path": [name],
            "size": [int(size)],
            "rows": [table.num_rows],
            "stats": [file_stats(table)],
            "mtime": [int(time.time() * 1000)],
            "partition_values": [values],
        },
        schema=WRITTEN,
    )


def canonical_key(table: pa.Table, key: list[str]) -> pa.Array:
    """One string per row that equals for equal keys, nulls included (``<len>:<text>`` per
    column, ``N`` for null, as :mod:`checkpointing.state.keygroups` encodes keys)."""
    pieces = []
    for name in key:
        column = table.column(name)
        text = pc.cast(column, pa.string())
        length = pc.cast(pc.utf8_length(text), pa.string())
        pieces.append(
            pc.if_else(pc.is_null(column), "N", pc.binary_join_element_wise(length, text, ":"))
        )
    if len(pieces) == 1:
        return pieces[0].combine_chunks() if hasattr(pieces[0], "combine_chunks") else pieces[0]
    joined = pc.binary_join_element_wise(*pieces, "")
    return joined.combine_chunks() if hasattr(joined, "combine_chunks") else joined


def file_stats(table: pa.Table) -> str:
    """Delta's per-file statistics: row and null counts, and minima and maxima of the integer,
    date and short string columns (never of floats, whose NaN ordering readers disagree on)."""
    mins: dict[str, Any] = {}
    maxs: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for field in table.schema:
        column = table.column(field.name)
        nulls[field.name] = column.null_count
        if column.null_count == len(column) or not _has_range(field.type):
            continue
        low, high = pc.min_max(column).values()
        low, high = _json_value(low.as_py()), _json_value(high.as_py())
        if low is None or high is None:
            continue
        if isinstance(low, str) and max(len(low), len(high)) > _STRING_STATS_MAX:
            continue
        mins[field.name], maxs[field.name] = low, high
    return json.dumps(
        {"numRecords": table.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls},
        allow_nan=False,
    )


def _has_range(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_date(kind) or pa.types.is_string(kind)


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return None
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
