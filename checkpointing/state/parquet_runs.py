"""Keyed state kept as key-group-sorted Parquet runs (``file_format: parquet`` in a state
handle): written by Spark's own Parquet writer (:mod:`checkpointing.spark.keyed_runs`), read here
without Spark, e.g. by ``ckpt inspect``. A run holds key columns, the key-group column and
partial-aggregate columns, one row per key; a file may hold several subtasks' key groups, so a
reader takes the ones it wants with a filter on the (sorted) key-group column, which Parquet's
row-group statistics turn into skipped row groups."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from checkpointing.errors import CorruptSnapshotError
from checkpointing.state.keygroups import KeyGroupRange
from checkpointing.state.snapshot import KEY_GROUP_COLUMN

#: the key-group column as Spark writes it (``checkpointing.spark.keys.KEY_GROUP``)
RUN_KEY_GROUP = "__key_group"


def read_run(data: bytes, groups: KeyGroupRange, *, path: str) -> pa.Table:
    """The rows of ``groups`` in one run (bytes already verified against ``_metadata``), with
    the key-group column named as in an Arrow snapshot (``key_group``)."""
    try:
        table = pq.read_table(
            pa.BufferReader(data),
            filters=[(RUN_KEY_GROUP, ">=", groups.start), (RUN_KEY_GROUP, "<=", groups.end)],
        )
    except (pa.ArrowException, ValueError) as exc:
        raise CorruptSnapshotError(path, f"not a readable Parquet run ({exc})") from None
    if RUN_KEY_GROUP not in table.column_names:
        raise CorruptSnapshotError(path, f"a Parquet run without its {RUN_KEY_GROUP} column")
    names = [KEY_GROUP_COLUMN if c == RUN_KEY_GROUP else c for c in table.column_names]
    return table.rename_columns(names).replace_schema_metadata(None)


def run_schema(data: bytes, *, path: str) -> pa.Schema:
    """A run's schema, its key-group column named as in an Arrow snapshot."""
    return read_run(data, KeyGroupRange(0, -1), path=path).schema
