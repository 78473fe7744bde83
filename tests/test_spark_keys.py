"""The JVM (Spark's xxhash64 expression) and Python compute the same key group for every key:
keyed state written by executors can be looked up from Python (``ckpt inspect``) and reassigned
on restore without reading it."""

from __future__ import annotations

import datetime as dt
import random
import string
from typing import Any

import pytest

from checkpointing.state.keygroups import key_group_for


def _random_text(rng: random.Random) -> str:
    alphabet = string.ascii_letters + string.digits + ":N -_é漢字🙂\t"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))


@pytest.mark.parametrize("max_parallelism", [1, 7, 128, 32768])
def test_spark_and_python_agree_on_key_groups(spark: Any, max_parallelism: int) -> None:
    from pyspark.sql import types as T

    from checkpointing.spark.keys import key_group_column

    rng = random.Random(max_parallelism)
    rows = [
        (
            rng.choice([None, _random_text(rng)]),
            rng.choice([None, rng.randint(-(2**63), 2**63 - 1), rng.randint(-5, 5)]),
            rng.choice([None, True, False]),
            rng.choice([None, dt.date(2013, 1, 1) + dt.timedelta(days=rng.randint(0, 3650))]),
        )
        for _ in range(400)
    ] + [("JFK", 1, True, dt.date(2013, 1, 2)), ("", 0, False, None), (None, None, None, None)]
    schema = T.StructType(
        [
            T.StructField("s", T.StringType()),
            T.StructField("n", T.LongType()),
            T.StructField("b", T.BooleanType()),
            T.StructField("d", T.DateType()),
        ]
    )
    df = spark.createDataFrame(rows, schema)  # type: ignore[attr-defined]
    got = df.select("*", key_group_column(["s", "n", "b", "d"], max_parallelism).alias("kg"))
    for row in got.collect():
        key = (row.s, row.n, row.b, row.d)
        assert row.kg == key_group_for(key, max_parallelism), key


def test_integer_widths_do_not_change_the_key_group(spark: Any) -> None:
    from pyspark.sql import functions as F

    from checkpointing.spark.keys import key_group_column

    df = spark.range(-50, 50).select(  # type: ignore[attr-defined]
        F.col("id").cast("int").alias("i"), F.col("id").cast("short").alias("h"), "id"
    )
    for row in df.select(
        key_group_column(["i"], 128).alias("a"),
        key_group_column(["h"], 128).alias("b"),
        key_group_column(["id"], 128).alias("c"),
        "id",
    ).collect():
        assert row.a == row.b == row.c == key_group_for([row.id], 128)


def test_unsupported_key_columns_are_refused(spark: Any) -> None:
    from checkpointing.spark.keys import check_key_columns

    df = spark.createDataFrame([(1.5, "a")], "x double, y string")  # type: ignore[attr-defined]
    check_key_columns(df, ["y"])
    with pytest.raises(ValueError, match="column 'x' has type double"):
        check_key_columns(df, ["x"])
    with pytest.raises(ValueError, match="column 'z' is not in the input"):
        check_key_columns(df, ["z"])


def test_partition_keys_put_subtask_i_in_spark_partition_i(spark: Any) -> None:
    """The state is hash-partitioned by its subtask column; its values must send subtask i to
    partition i (plain indexes would crowd several subtasks into one Spark task)."""
    from pyspark.sql import functions as F

    from checkpointing.spark.keys import murmur3_int, partition_keys

    values = [*range(-50, 300), 2**31 - 1, -(2**31)]
    df = spark.createDataFrame([(v,) for v in values], "v int")
    hashed = {r.v: r.h for r in df.select("v", F.hash("v").alias("h")).collect()}
    assert {v: murmur3_int(v) for v in values} == hashed
    for p in (1, 2, 3, 4, 7, 16):
        keys = partition_keys(p)
        placed = (
            spark.createDataFrame([(k,) for k in keys], "s int")
            .repartition(p, "s")
            .select("s", F.spark_partition_id().alias("part"))
            .collect()
        )
        assert sorted((keys.index(r.s), r.part) for r in placed) == [(i, i) for i in range(p)]
