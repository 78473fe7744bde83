"""Incremental keyed snapshots: what a subtask's state is when it spans a chain of files, and
when a chain is long enough that the next snapshot should be full again.

A full snapshot holds every row of the subtask's key groups. An incremental one holds only the
rows of the keys that changed since the subtask's previous completed checkpoint, and refers to
the files before it (``chain`` in its state handle, see :mod:`checkpointing.state.metadata`).
Reading the chain oldest first and keeping the last row of each key gives the state back — the
log-structured merge of Flink's changelog state backend and of Spark's RocksDB changelog
checkpoints, with key-group-indexed files so that a rescaled subtask reads only its groups.

A chain is cut (the next snapshot is *materialised* in full) when its changes add up to as many
bytes as its full snapshot, or it has :data:`MAX_DELTAS` of them: a restore then reads at most
about twice the state. Pure Arrow, no Spark: the executors and ``ckpt inspect`` share it.

How a chain's files combine is its handle's ``chain_merge``: :data:`CHAIN_REPLACE` (the default: the
last row of a key wins, each change is the key's whole new state) or :data:`CHAIN_AGGREGATE` (each
change holds the partial aggregates of the epochs since the previous file, merged with the
rows before by the aggregation: what a lazily merged aggregation state writes, see
:mod:`checkpointing.spark.lazy_state`). A restore merges an aggregate chain in Spark with the
stage's own merge; :func:`merge_partials` is the Arrow merge of the partial kinds a reader
without the pipeline (``ckpt inspect``) can combine from the column names alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

from checkpointing.state.metadata import ChainedFile
from checkpointing.state.snapshot import KEY_GROUP_COLUMN

#: chain_merge values: the last row of a key wins / rows are partial aggregates, merged
CHAIN_REPLACE, CHAIN_AGGREGATE = "replace", "aggregate"
#: partial-aggregate columns a reader can merge by name (``__<kind>_<output>``) and how
_PARTIAL_MERGES = {"__cnt_": "sum", "__sum_": "sum", "__min_": "min", "__max_": "max"}

#: changes after a full snapshot before the next is full again
MAX_DELTAS = 8
#: a chain whose changes' bytes reach this multiple of its full snapshot's is cut
MAX_DELTA_RATIO = 1.0
#: the same for a chain of partial aggregates: its restore merges every row anyway, and a cut
#: costs the whole state's merge (a compaction), so it may read up to about 4x the state
MAX_PARTIALS_RATIO = 3.0
_ROW = "__ckpt_row"


def needs_full(chain: Sequence[ChainedFile], how: str | None = None) -> bool:
    """Whether the next snapshot of a subtask whose state spans ``chain`` (its full snapshot,
    then the changes after it, combined as ``how`` says) must be full: no chain, or one long or
    heavy enough."""
    if not chain:
        return True
    base, deltas = chain[0], chain[1:]
    if len(deltas) >= MAX_DELTAS:
        return True
    ratio = MAX_PARTIALS_RATIO if how == CHAIN_AGGREGATE else MAX_DELTA_RATIO
    return sum(f.size for f in deltas) >= ratio * max(base.size, 1)


def last_per_key(table: pa.Table, key: Sequence[str]) -> pa.Table:
    """The last row of each key of ``table`` (in row order); null key values are one key, as
    SQL's ``GROUP BY`` has them; in the order of those last rows."""
    if table.num_rows == 0:
        return table
    numbered = table.append_column(_ROW, pa.array(range(table.num_rows), pa.int64()))
    last = numbered.group_by(list(key), use_threads=False).aggregate([(_ROW, "max")])
    rows = pc.sort_indices(last.column(f"{_ROW}_max"))
    return table.take(pc.take(last.column(f"{_ROW}_max"), rows))


def merge_chain(
    tables: Sequence[pa.Table], key: Sequence[str], how: str | None = CHAIN_REPLACE
) -> pa.Table:
    """One subtask's state from its chain's tables, oldest first, in key-group order as a single
    snapshot's rows are: the last row of each key (``how`` :data:`CHAIN_REPLACE` or None), or the
    partial aggregates merged (:data:`CHAIN_AGGREGATE`, see :func:`merge_partials`)."""
    if len(tables) == 1:
        return tables[0]
    # partials written by a merge and by an epoch may differ in nullability only: unified
    promote = "default" if how == CHAIN_AGGREGATE else "none"
    table = pa.concat_tables(tables, promote_options=promote)
    merged = merge_partials(table, key) if how == CHAIN_AGGREGATE else last_per_key(table, key)
    return merged.sort_by(KEY_GROUP_COLUMN) if KEY_GROUP_COLUMN in merged.column_names else merged


def merge_partials(table: pa.Table, key: Sequence[str]) -> pa.Table:
    """One row per key of ``table``'s partial aggregates: counts and sums added, minima and
    maxima taken (nulls ignored, as SQL's); the other columns must be the key's own (e.g. its
    key group). Refuses partial kinds that need the pipeline's aggregation to merge (sets,
    sketches, moments): only a restore merges those."""
    if table.num_rows == 0:
        return table
    aggregates, plain = [], [c for c in table.column_names if c not in key]
    for column in list(plain):
        how = next((h for p, h in _PARTIAL_MERGES.items() if column.startswith(p)), None)
        if how is not None:
            aggregates.append((column, how))
            plain.remove(column)
        elif column.startswith("__") and column != KEY_GROUP_COLUMN:
            raise ValueError(
                f"column {column!r} is a partial aggregate only the pipeline's restore can merge "
                "(its chain of partial aggregates is merged when restored)"
            )
    aggregates += [(c, "min") for c in plain]  # a key's own columns: one value per key
    grouped = table.group_by(list(key), use_threads=False).aggregate(aggregates)
    names = {f"{c}_{h}": c for c, h in aggregates}
    grouped = grouped.rename_columns([names.get(c, c) for c in grouped.column_names])
    return grouped.select(table.column_names).cast(table.schema)
