"""Key groups as a Spark column expression — the JVM twin of :mod:`checkpointing.state.keygroups`.

Computed with Spark SQL functions (no Python per record): each key column's canonical text
``<length>:<text>`` (``N`` for null), concatenated, then ``pmod(xxhash64(…), max_parallelism)``.
Spark's ``xxhash64`` is XXH64 of the UTF-8 bytes with seed 42, so the result equals
:func:`checkpointing.state.keygroups.key_group_for` for the same key — a test holds them together.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from checkpointing.pipeline.spec import SpecError

#: the state's key-group and subtask columns (every stage's state carries them). The subtask
#: column holds the subtask's *partition key* (see :func:`partition_keys`), not its index.
KEY_GROUP, SUBTASK = "__key_group", "__subtask"

_KEY_TYPES = (T.StringType, T.IntegralType, T.BooleanType, T.DateType)


def check_key_columns(
    df: DataFrame | T.StructType, columns: Sequence[str], where: str = "key"
) -> None:
    """Refuse key columns that are missing or of a type without a canonical text form."""
    schema = df if isinstance(df, T.StructType) else df.schema
    fields = {f.name: f.dataType for f in schema.fields}
    for name in columns:
        if name not in fields:
            what = "output" if where.startswith("sink.") else "input"
            raise ValueError(f"{where}: column {name!r} is not in the {what} ({sorted(fields)})")
        if not isinstance(fields[name], _KEY_TYPES):
            raise ValueError(
                f"{where}: column {name!r} has type {fields[name].simpleString()}; "
                f"{'partition' if where.startswith('sink.') else 'key'} columns must be "
                "string, integer, boolean or date"
            )


def check_partition_columns(schema: T.StructType, columns: Sequence[str]) -> None:
    """The sink's ``partition_by`` columns are in the output, of a type whose values make a
    stable directory name (as a key's), and leave at least one column for the data files."""
    if not columns:
        return
    try:
        check_key_columns(schema, columns, where="sink.partition_by")
    except ValueError as exc:  # the sink's field, not the transform's: said as such
        raise SpecError(str(exc)) from None
    if len(schema.fields) <= len(columns):
        raise SpecError(
            "sink.partition_by: every output column would be a directory name; keep at least "
            f"one out of it (the output: {', '.join(f.name for f in schema.fields)})"
        )


def canonical_key_column(columns: Sequence[str]) -> Column:
    parts = []
    for name in columns:
        text = F.col(name).cast("string")
        parts.append(
            F.when(F.col(name).isNull(), F.lit("N")).otherwise(
                F.concat(F.length(text).cast("string"), F.lit(":"), text)
            )
        )
    return F.concat(*parts)


def key_group_column(columns: Sequence[str], max_parallelism: int) -> Column:
    return F.pmod(F.xxhash64(canonical_key_column(columns)), F.lit(max_parallelism)).cast("int")


def subtask_column(parallelism: int, max_parallelism: int) -> Column:
    """The owning subtask's partition key of a row with :data:`KEY_GROUP`: subtask
    ``floor(kg * p / maxP)`` (the inverse of Flink's key-group ranges), as the value that sends
    it to Spark partition ``i`` (see :func:`partition_keys`)."""
    index = (F.col(KEY_GROUP) * F.lit(parallelism) / F.lit(max_parallelism)).cast("int")
    keys = F.array(*(F.lit(k) for k in partition_keys(parallelism)))
    return F.element_at(keys, index + 1)


def partition_keys(parallelism: int) -> list[int]:
    """For each subtask ``i``, the smallest int that Spark's hash partitioning
    (``pmod(murmur3(value, 42), parallelism)``, as in ``repartition(parallelism, col)``) sends to
    partition ``i``.

    The state is hash-partitioned by its subtask column; with plain indexes in it, Murmur3 sends
    several subtasks to one partition and leaves others empty (for 4 subtasks: 0, 1 and 3 all to
    partition 3) — one Spark task would do most of the work. With these keys, subtask ``i`` is
    exactly Spark partition ``i``: one task each, as Flink runs one task per subtask.
    """
    keys: dict[int, int] = {}
    value = 0
    while len(keys) < parallelism:
        keys.setdefault(murmur3_int(value) % parallelism, value)
        value += 1
    return [keys[i] for i in range(parallelism)]


def murmur3_int(value: int, seed: int = 42) -> int:
    """Spark's ``Murmur3_x86_32.hashInt`` (the hash of ``F.hash`` and hash partitioning) of a
    32-bit int, as a signed int."""
    mask = 0xFFFFFFFF

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & mask

    k1 = (value & mask) * 0xCC9E2D51 & mask
    k1 = rotl(k1, 15) * 0x1B873593 & mask
    h1 = (seed & mask) ^ k1
    h1 = (rotl(h1, 13) * 5 + 0xE6546B64) & mask
    h1 ^= 4  # the input's length in bytes
    h1 ^= h1 >> 16
    h1 = h1 * 0x85EBCA6B & mask
    h1 ^= h1 >> 13
    h1 = h1 * 0xC2B2AE35 & mask
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 & 0x80000000 else h1
