"""Key groups as a Spark column expression — the JVM twin of :mod:`checkpointing.keygroups`.

Computed with Spark SQL functions (no Python per record): each key column's canonical text
``<length>:<text>`` (``N`` for null), concatenated, then ``pmod(xxhash64(…), max_parallelism)``.
Spark's ``xxhash64`` is XXH64 of the UTF-8 bytes with seed 42, so the result equals
:func:`checkpointing.keygroups.key_group_for` for the same key — a test holds them together.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

#: the state's key-group and subtask columns (every stage's state carries them)
KEY_GROUP, SUBTASK = "__key_group", "__subtask"

_KEY_TYPES = (T.StringType, T.IntegralType, T.BooleanType, T.DateType)


def check_key_columns(df: DataFrame, columns: Sequence[str], where: str = "key") -> None:
    """Refuse key columns that are missing or of a type without a canonical text form."""
    fields = {f.name: f.dataType for f in df.schema.fields}
    for name in columns:
        if name not in fields:
            raise ValueError(f"{where}: column {name!r} is not in the input ({sorted(fields)})")
        if not isinstance(fields[name], _KEY_TYPES):
            raise ValueError(
                f"{where}: column {name!r} has type {fields[name].simpleString()}; key columns "
                "must be string, integer, boolean or date"
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
