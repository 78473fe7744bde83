"""What the runtime runs on Spark's executors: writing a stage subtask's snapshot, reading the
key groups a restored subtask owns, reading row-group splits.

Kept apart from :mod:`checkpointing.spark.runtime` so that a Python worker imports only this,
Arrow and the storage layer — not the coordinator, SQLAlchemy and pandas, which cost every
worker seconds of start-up on a small machine (and a restore waits for them).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from checkpointing.spark.keys import KEY_GROUP, SUBTASK
from checkpointing.state.incremental import last_per_key, merge_chain
from checkpointing.state.keygroups import KeyGroupRange, key_group_range
from checkpointing.state.snapshot import (
    read_keyed_snapshot,
    read_snapshot_info,
    write_keyed_snapshot,
)

if TYPE_CHECKING:
    from pyspark.sql import types as T

    from checkpointing.state.storage import CheckpointStorage

#: the epoch of an incremental snapshot's changed rows (the last of a key wins)
SEQ = "__ckpt_seq"

#: one row per subtask snapshot written: what its acknowledgement carries
WRITTEN = pa.schema(
    [
        ("subtask", pa.int32()),
        ("url", pa.string()),
        ("size", pa.int64()),
        ("checksum", pa.string()),
        ("sync_ms", pa.int32()),
        ("async_ms", pa.int32()),
        ("groups", pa.list_(pa.int32())),
        ("group_bytes", pa.list_(pa.int64())),
    ]
)


def write_subtask_snapshot(
    storage: CheckpointStorage,
    location_url: str,
    partition_keys: list[int],
    max_parallelism: int,
    key: list[str],
    operator_id: str,
    table: pa.Table,
) -> pa.Table:
    """One stage subtask's state → its snapshot file (recording the key columns, for readers
    such as ``ckpt inspect``); one :data:`WRITTEN` row. ``partition_keys[i]`` is subtask ``i``'s
    value in the subtask column. With a :data:`SEQ` column, the rows are changes: several
    epochs' rows of a key, of which the highest ``SEQ`` is its state (an incremental snapshot
    of more than one epoch)."""
    started = time.monotonic()
    parallelism = len(partition_keys)
    subtask = partition_keys.index(int(table.column(SUBTASK)[0].as_py()))
    if SEQ in table.column_names:
        if len(pc.unique(table.column(SEQ))) > 1:
            table = last_per_key(table.sort_by([(SEQ, "ascending")]), key)
        table = table.drop_columns([SEQ])
    state = table.drop_columns([SUBTASK])
    state = state.rename_columns(["key_group" if c == KEY_GROUP else c for c in state.column_names])
    state = state.replace_schema_metadata(
        {**(state.schema.metadata or {}), b"key_columns": json.dumps(key).encode()}
    )
    key_groups = key_group_range(max_parallelism, parallelism, subtask)
    data = write_keyed_snapshot(
        state, operator_id=operator_id, key_groups=key_groups, max_parallelism=max_parallelism
    )
    sync_ms = int((time.monotonic() - started) * 1000)
    location = storage.location_for(location_url)
    info = storage.write_bytes(location.file_url(f"{operator_id}-{subtask}.arrow"), data)
    groups = read_snapshot_info(data).groups
    return pa.table(
        {
            "subtask": [subtask],
            "url": [info.url],
            "size": [info.size],
            "checksum": [info.checksum],
            "sync_ms": [sync_ms],
            "async_ms": [int((time.monotonic() - started) * 1000) - sync_ms],
            "groups": [sorted(groups)],
            "group_bytes": [[groups[g].nbytes for g in sorted(groups)]],
        },
        schema=WRITTEN,
    )


def read_subtask_snapshots(
    storage: CheckpointStorage,
    columns: list[str],
    key: list[str],
    batches: Iterator[pa.RecordBatch],
) -> Iterator[pa.RecordBatch]:
    """For each ``(part_key, urls, checksums, sizes, start, end, aggregate)``: just those key
    groups of an old subtask's state — its files, oldest first (one for a full snapshot, a chain
    for an incremental one: the last row of a key wins, or with ``aggregate`` every row, partial
    aggregates the driver's plan merges), each verified and never read past its recorded size —
    tagged with the new subtask's partition key."""
    for batch in batches:
        for row in batch.to_pylist():
            groups = KeyGroupRange(row["start"], row["end"])
            tables = [
                read_keyed_snapshot(
                    storage.read_bytes(url, checksum=checksum, size=size), groups, path=url
                )
                for url, checksum, size in zip(
                    row["urls"], row["checksums"], row["sizes"], strict=True
                )
            ]
            if row.get("aggregate"):
                # files written from a merge and from an epoch's partials may differ in
                # nullability only: unified
                table = pa.concat_tables(tables, promote_options="default")
            else:
                table = merge_chain(tables, key)
            table = table.append_column(
                SUBTASK, pa.array([row["part_key"]] * table.num_rows, pa.int32())
            )
            table = table.rename_columns(
                [KEY_GROUP if c == "key_group" else c for c in table.column_names]
            ).select(columns)
            yield from table.to_batches()


def read_row_groups(
    schema: T.StructType, batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """The rows of each ``(path, start, end)`` row-group range, as the input schema's Arrow
    types (the same rows Spark's reader gives for the whole file). ``path`` may be an object's
    URL (read through :mod:`checkpointing.state.object_store`: no Hadoop filesystem needed), and a
    null ``start`` is the whole file."""
    import pyarrow.parquet as pq
    from pyspark.sql.pandas.types import to_arrow_schema

    from checkpointing.state.object_store import is_object_url, open_object

    target = to_arrow_schema(schema)
    for batch in batches:
        for row in batch.to_pylist():
            path = row["path"]
            source = open_object(path) if is_object_url(path) else path
            groups = None if row["start"] is None else range(row["start"], row["end"])
            try:
                file = pq.ParquetFile(source)
                for part in file.iter_batches(row_groups=groups, columns=target.names):
                    table = pa.Table.from_batches([part]).select(target.names)
                    yield from table.cast(target).to_batches()
            finally:
                if not isinstance(source, str):
                    source.close()
