"""Keyed aggregations as partial aggregates folded epoch by epoch (in the JVM, no Python UDFs)
give the SQL result of aggregating all the input at once — checked against the independent
pandas computation, for every aggregation kind, with null values and null keys."""

from __future__ import annotations

import datetime as dt
import math
import random
from collections.abc import Iterable, Sequence
from decimal import Decimal
from typing import Any

import pandas as pd
import pytest

from tests import oracle

KEY = ["carrier", "origin", "month"]
SCHEMA_DDL = "carrier string, origin string, month int, dep_delay double, distance int"
AGGREGATIONS = {
    "flights": "count()",
    "delayed": "count(dep_delay)",
    "measured": "count(distance)",
    "total_delay": "sum(dep_delay)",
    "total_distance": "sum(distance)",
    "min_delay": "min(dep_delay)",
    "max_delay": "max(dep_delay)",
    "min_distance": "min(distance)",
    "max_distance": "max(distance)",
    "avg_delay": "avg(dep_delay)",
    "avg_distance": "avg(distance)",
}
COLUMN_AT = {name: i for i, name in enumerate([*KEY, *AGGREGATIONS])}
EPOCHS = 5
#: a key whose value columns are null in every row, spread over several epochs
ALL_NULL_KEY = ("ZZ", "JFK", 7)


def _rows(seed: int = 20130101, n: int = 2400) -> list[tuple[Any, ...]]:
    """(carrier, origin, month, dep_delay, distance, epoch); nulls in keys and values."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        rows.append(
            (
                rng.choice(["AA", "B6", "DL", "UA", "9E", None]),
                rng.choice(["EWR", "JFK", "LGA"]),
                rng.choice([*range(1, 13), None]),
                None if rng.random() < 0.15 else round(rng.gauss(12.0, 40.0), 2),
                None if rng.random() < 0.1 else rng.randint(80, 4983),
                rng.randrange(EPOCHS),
            )
        )
    rows += [(*ALL_NULL_KEY, None, None, epoch) for epoch in (0, 2, 2, 4)]
    return rows


@pytest.fixture(scope="module")
def flights(spark: Any) -> tuple[Any, list[tuple[Any, ...]]]:
    rows = _rows()
    df = spark.createDataFrame(rows, SCHEMA_DDL + ", epoch int")
    return df, rows


def _plan(schema: Any = None) -> Any:
    from checkpointing.spark.aggregations import AggregationPlan

    return AggregationPlan(KEY, AGGREGATIONS, schema)


def _epoch(df: Any, epoch: int) -> Any:
    from pyspark.sql import functions as F

    return df.where(F.col("epoch") == epoch).drop("epoch")


def _fold(plan: Any, spark: Any, deltas: Iterable[Any]) -> Any:
    state = plan.empty_state(spark)
    for delta in deltas:
        state = plan.merge(state, delta, KEY)
    return state


def _plain(value: Any) -> Any:
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return None
    return value.item() if hasattr(value, "item") else value


def _sort_key(row: Sequence[Any], width: int) -> tuple[Any, ...]:
    return tuple((v is None, v) for v in row[:width])


def _expected(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    frame = pd.DataFrame(
        {
            "carrier": pd.Series([r[0] for r in rows], dtype=object),
            "origin": pd.Series([r[1] for r in rows], dtype=object),
            "month": pd.Series([r[2] for r in rows], dtype="Int64"),
            "dep_delay": pd.Series([r[3] for r in rows], dtype="float64"),
            "distance": pd.Series([r[4] for r in rows], dtype="Int64"),
        }
    )
    got = oracle.expected_sql(frame, KEY, AGGREGATIONS)  # the spec's texts, read by DuckDB
    out = [tuple(_plain(v) for v in row) for row in got[[*KEY, *AGGREGATIONS]].to_numpy()]
    return sorted(out, key=lambda r: _sort_key(r, len(KEY)))


def _collect(df: Any) -> list[tuple[Any, ...]]:
    out = [tuple(_plain(v) for v in row) for row in df.collect()]
    return sorted(out, key=lambda r: _sort_key(r, len(KEY)))


def _assert_same(got: list[tuple[Any, ...]], expected: list[tuple[Any, ...]]) -> None:
    assert len(got) == len(expected)
    names = [*KEY, *AGGREGATIONS]
    for g, e in zip(got, expected, strict=True):
        assert g[: len(KEY)] == e[: len(KEY)]
        for name, a, b in zip(names, g, e, strict=True):
            if isinstance(a, float) or isinstance(b, float):
                assert a is not None and b is not None, (g[: len(KEY)], name, a, b)
                assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9), (g[:3], name, a, b)
            else:
                assert a == b, (g[: len(KEY)], name, a, b)


def test_folding_epochs_gives_the_result_over_all_rows(spark: Any, flights: Any) -> None:
    df, rows = flights
    plan = _plan(df.drop("epoch").schema)
    deltas = [_epoch(df, e).groupBy(*KEY).agg(*plan.partials()) for e in range(EPOCHS)]
    state = _fold(plan, spark, deltas)
    assert state.columns == [*KEY, *plan.partial_columns]
    assert [f.dataType for f in state.schema.fields] == [
        f.dataType for f in plan.state_schema().fields
    ]

    result = plan.final(state)
    assert result.columns == [*KEY, *AGGREGATIONS]
    got, expected = _collect(result), _expected(rows)
    _assert_same(got, expected)
    # the data exercise what they should: null keys, keys missing from some epochs, null results
    assert any(r[0] is None for r in got) and any(r[2] is None for r in got)
    assert len(got) > len({r[:3] for r in rows if r[-1] == 0})
    all_null = next(r for r in got if r[:3] == ALL_NULL_KEY)
    assert all_null[COLUMN_AT["flights"]] == 4 and all_null[COLUMN_AT["delayed"]] == 0
    assert all_null[COLUMN_AT["total_delay"]] is None and all_null[COLUMN_AT["avg_delay"]] is None


def test_merging_is_associative_and_order_free(spark: Any, flights: Any) -> None:
    df, rows = flights
    plan = _plan(df.drop("epoch").schema)
    deltas = [_epoch(df, e).groupBy(*KEY).agg(*plan.partials()) for e in range(EPOCHS)]
    empty = _epoch(df, EPOCHS).groupBy(*KEY).agg(*plan.partials())  # no rows
    expected = _expected(rows)

    shuffled = _fold(plan, spark, [deltas[i] for i in (3, 0, 4, 1, 2)] + [empty])
    all_at_once = plan.merge(
        plan.empty_state(spark), df.drop("epoch").groupBy(*KEY).agg(*plan.partials()), KEY
    )
    # deltas merged among themselves first, then into the state
    left = plan.merge(deltas[0], deltas[1], KEY)
    right = plan.merge(deltas[2], plan.merge(deltas[3], deltas[4], KEY), KEY)
    tree = plan.merge(plan.empty_state(spark), plan.merge(right, left, KEY), KEY)
    # a state merged with itself: every partial doubles (a self-join must not be ambiguous)
    doubled = plan.merge(all_at_once, all_at_once, KEY)

    for state in (shuffled, all_at_once, tree):
        _assert_same(_collect(plan.final(state)), expected)
    twice = {r[:3]: r for r in _collect(plan.final(doubled))}
    flights_at, total_at = COLUMN_AT["flights"], COLUMN_AT["total_distance"]
    for row in expected:
        assert twice[row[:3]][flights_at] == 2 * row[flights_at]
        total = row[total_at]
        assert twice[row[:3]][total_at] == (None if total is None else 2 * total)


def test_keys_with_only_null_values(spark: Any) -> None:
    from checkpointing.spark.aggregations import AggregationPlan

    schema = "k string, x double, n int, s string"
    plan = AggregationPlan(
        ["k"],
        {
            "rows": "count()",
            "nx": "count(x)",
            "sx": "sum(x)",
            "sn": "sum(n)",
            "lo": "min(x)",
            "hi": "max(n)",
            "ls": "min(s)",
            "ax": "avg(x)",
            "an": "avg(n)",
        },
    )
    epochs = [
        [("none", None, None, None), ("late", None, None, None), ("early", 2.5, 4, "b")],
        [("none", None, None, None), ("late", 1.5, 3, "c"), ("early", None, None, None)],
        [("none", None, None, None), ("only_here", None, None, None)],
    ]
    input_schema = spark.createDataFrame([], schema).schema
    state = plan.empty_state(spark, input_schema)
    for rows in epochs:
        delta = spark.createDataFrame(rows, schema).groupBy("k").agg(*plan.partials())
        state = plan.merge(state, delta, ["k"])
    got = {r.k: r.asDict() for r in plan.final(state).collect()}
    nulls = dict.fromkeys(["sx", "sn", "lo", "hi", "ls", "ax", "an"])
    assert got["none"] == {"k": "none", "rows": 3, "nx": 0, **nulls}
    assert got["only_here"] == {"k": "only_here", "rows": 1, "nx": 0, **nulls}
    # null on one side of a merge, a value on the other: the value
    for key, x, n, s in (("late", 1.5, 3, "c"), ("early", 2.5, 4, "b")):
        assert got[key] == {
            "k": key, "rows": 2, "nx": 1, "sx": x, "sn": n, "lo": x, "hi": n, "ls": s,
            "ax": x, "an": float(n),
        }  # fmt: skip


def test_types_of_partials_state_and_results(spark: Any) -> None:
    from pyspark.sql import types as T

    from checkpointing.spark.aggregations import AggregationPlan

    schema = T.StructType(
        [
            T.StructField("k", T.StringType()),
            T.StructField("b", T.ByteType()),
            T.StructField("i", T.IntegerType()),
            T.StructField("f", T.FloatType()),
            T.StructField("dec", T.DecimalType(10, 2)),
            T.StructField("d", T.DateType()),
            T.StructField("s", T.StringType()),
            T.StructField("flag", T.BooleanType()),
        ]
    )
    aggregations = {
        "n": "count()",
        "n_flag": "count(flag)",
        "sum_b": "sum(b)",
        "sum_i": "sum(i)",
        "sum_f": "sum(f)",
        "sum_dec": "sum(dec)",
        "avg_i": "avg(i)",
        "avg_dec": "avg(dec)",
        "first_day": "min(d)",
        "last_day": "max(d)",
        "min_s": "min(s)",
        "max_s": "max(s)",
        "max_i": "max(i)",
        "min_dec": "min(dec)",
    }
    day = dt.date(2013, 1, 1)
    rows = [
        ("a", 100, 2_000_000_000, 0.5, Decimal("12345678.91"), day, "JFK", True),
        ("a", 100, 2_000_000_000, 0.25, Decimal("0.09"), day + dt.timedelta(days=40), "EWR", None),
        ("b", None, None, None, None, None, None, None),
    ]
    df = spark.createDataFrame(rows, schema)
    plan = AggregationPlan(["k"], aggregations, schema)
    state = plan.empty_state(spark)
    assert state.schema == plan.state_schema()
    delta = df.groupBy("k").agg(*plan.partials())
    assert delta.schema == plan.state_schema()  # the types Spark's own aggregates give
    # without a schema the partials are Spark's natural aggregates: the same types
    natural = df.groupBy("k").agg(*AggregationPlan(["k"], aggregations).partials())
    assert natural.schema == plan.state_schema()

    state = plan.merge(plan.merge(state, delta, ["k"]), delta, ["k"])
    assert [f.dataType for f in state.schema] == [f.dataType for f in plan.state_schema()]
    result = plan.final(state)
    types = {f.name: f.dataType for f in result.schema}
    assert types == {
        "k": T.StringType(),
        "n": T.LongType(),
        "n_flag": T.LongType(),
        "sum_b": T.LongType(),
        "sum_i": T.LongType(),
        "sum_f": T.DoubleType(),
        "sum_dec": T.DecimalType(20, 2),
        "avg_i": T.DoubleType(),
        "avg_dec": T.DecimalType(14, 6),  # Spark's avg of decimal(10, 2): decimal(p+4, s+4)
        "first_day": T.DateType(),
        "last_day": T.DateType(),
        "min_s": T.StringType(),
        "max_s": T.StringType(),
        "max_i": T.IntegerType(),
        "min_dec": T.DecimalType(10, 2),
    }
    got = {r.k: r.asDict() for r in result.collect()}
    a = got["a"]
    assert (a["n"], a["n_flag"], a["sum_b"]) == (4, 2, 400)  # a byte column's sum is no byte
    assert a["sum_i"] == 8_000_000_000  # beyond int, no overflow
    assert a["sum_f"] == 1.5 and a["sum_dec"] == Decimal("24691358.00")
    assert a["avg_i"] == 2e9 and a["avg_dec"] == Decimal("6172839.500000")  # exact
    assert (a["first_day"], a["last_day"]) == (day, day + dt.timedelta(days=40))
    assert (a["min_s"], a["max_s"], a["max_i"], a["min_dec"]) == (
        "EWR",
        "JFK",
        2_000_000_000,
        Decimal("0.09"),
    )
    assert got["b"]["n"] == 2 and got["b"]["n_flag"] == 0 and got["b"]["avg_dec"] is None


def test_passthrough_columns_such_as_the_key_group(spark: Any, flights: Any) -> None:
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from checkpointing.spark.keys import key_group_column

    df, rows = flights
    plan = _plan(df.drop("epoch").schema)
    extra = [T.StructField("kg", T.IntegerType())]
    on = [*KEY, "kg"]
    state = plan.empty_state(spark, extra_fields=extra)
    assert state.columns == [*on, *plan.partial_columns]
    for epochs in ([0, 1, 2], [3, 4]):
        part = df.where(F.col("epoch").isin(epochs)).drop("epoch")
        part = part.withColumn("kg", key_group_column(KEY, 128))
        state = plan.merge(state, part.groupBy(*on).agg(*plan.partials()), on)
    result = plan.final(state, extra=["kg"])
    assert result.columns == [*KEY, "kg", *AGGREGATIONS]
    _assert_same(_collect(result.drop("kg")), _expected(rows))


def test_plans_the_input_cannot_feed_are_refused(spark: Any) -> None:
    from pyspark.sql import types as T

    from checkpointing.spark.aggregations import AggregationPlan

    schema = spark.createDataFrame([], SCHEMA_DDL + ", cancelled boolean, day date").schema
    with pytest.raises(ValueError, match=r"aggregation avg_x = avg\(x\): column 'x' is not in"):
        AggregationPlan(KEY, {"flights": "count()", "avg_x": "avg(x)"}, schema)
    with pytest.raises(ValueError, match=r"nx = count\(x\): column 'x' is not in the input"):
        AggregationPlan(KEY, {"nx": "count(x)"}).partials(schema)
    with pytest.raises(ValueError, match=r"s = sum\(carrier\): .* type string; sum needs a numer"):
        AggregationPlan(KEY, {"s": "sum(carrier)"}, schema)
    with pytest.raises(ValueError, match=r"a = avg\(cancelled\): .* type boolean; avg needs"):
        AggregationPlan(KEY, {"a": "avg(cancelled)"}).partials(schema)
    with pytest.raises(ValueError, match=r"a = avg\(day\): .* type date; avg needs a numeric"):
        AggregationPlan(KEY, {"a": "avg(day)"}).state_schema(schema)
    with pytest.raises(ValueError, match="key: column 'tailnum' is not in the input"):
        AggregationPlan(["tailnum"], {"n": "count()"}, schema)
    with pytest.raises(ValueError, match="clash with key columns"):
        AggregationPlan(KEY, {"origin": "count()"})
    with pytest.raises(ValueError, match="is not an aggregation"):
        AggregationPlan(KEY, {"m": "median(dep_delay)"})
    with pytest.raises(ValueError, match="needs the input schema"):
        AggregationPlan(KEY, {"n": "count()"}).state_schema()
    # min/max/count of any orderable type are fine
    AggregationPlan(KEY, {"a": "min(day)", "b": "max(carrier)", "c": "count(cancelled)"}, schema)

    plan = AggregationPlan(KEY, {"n": "count()", "s": "sum(distance)"}, schema)
    state = plan.empty_state(spark)
    with pytest.raises(ValueError, match=r"the delta lacks columns \['__sum_s'\]"):
        plan.merge(state, state.drop("__sum_s"), KEY)
    with pytest.raises(ValueError, match=r"lacks key columns \['month'\]"):
        plan.merge(state, state, ["carrier", "origin"])
    assert isinstance(plan.state_schema()["__sum_s"].dataType, T.LongType)
