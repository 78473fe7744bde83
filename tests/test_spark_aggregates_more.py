"""count_distinct, approx_count_distinct, max_by, min_by, stddev and variance as mergeable partial
states: folded over epochs in any order, and through a real run that crashes and restores at
another parallelism, they equal an independent pandas computation over all the rows at once
(HLL: an exact merge of sketches, within the stated error of the exact count)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from tests.aggregate_expectations import best, plain

KEY = ["k"]
SCHEMA_DDL = "k string, o int, v double, s string, epoch int"
AGGREGATIONS = {
    "n": "count()",
    "distinct_o": "count_distinct(o)",
    "distinct_s": "count_distinct(s)",
    "approx_s": "approx_count_distinct(s)",
    "top_s": "max_by(s, o)",
    "low_s": "min_by(s, o)",
    "top_v": "max_by(v, o)",
    "low_v": "min_by(v, o)",
    "sd_v": "stddev(v)",
    "var_o": "variance(o)",
}
EPOCHS = 5
#: strings where a prefix and its extension tie, the empty string, and non-ASCII
STRINGS = ["x", "xy", "", "y", "é", "Z", None]
ALL_NULL_KEY = "all-null"
ONE_ROW_KEY = "one-row"


def _rows(seed: int = 15, n: int = 1500) -> list[tuple[Any, ...]]:
    rng = random.Random(seed)
    rows = [
        (
            rng.choice(["a", "b", "c", "d", "e", None]),
            None if rng.random() < 0.15 else rng.randrange(6),  # few orders: many ties
            None if rng.random() < 0.1 else round(rng.gauss(100.0, 30.0), 1),
            rng.choice(STRINGS),
            rng.randrange(EPOCHS),
        )
        for _ in range(n)
    ]
    rows += [(ALL_NULL_KEY, None, None, None, e) for e in (0, 2, 4)]
    rows += [(ONE_ROW_KEY, 3, 7.5, "x", 1)]
    # a tie on the best order where only a null value and then a value arrive in later epochs
    rows += [("tie", 9, None, None, 0), ("tie", 9, 2.0, "b", 3), ("tie", 9, 1.0, "c", 4)]
    return rows


def expected(rows: list[tuple[Any, ...]]) -> dict[Any, dict[str, Any]]:
    """Per key, the SQL result over all rows, independently of Spark."""
    frame = pd.DataFrame(
        {
            "k": pd.Series([r[0] for r in rows], dtype=object),
            "o": pd.Series([r[1] for r in rows], dtype="Int64"),
            "v": pd.Series([r[2] for r in rows], dtype="float64"),
            "s": pd.Series([r[3] for r in rows], dtype=object),
        }
    )
    out = {}
    for k, g in frame.groupby("k", dropna=False):
        key = None if isinstance(k, float) and math.isnan(k) else k
        v, o = g["v"].dropna(), g["o"].dropna().astype(float)
        out[key] = {
            "n": len(g),
            "distinct_o": g["o"].nunique(),
            "distinct_s": g["s"].nunique(),
            "top_s": best(g, "s", "o", True),
            "low_s": best(g, "s", "o", False),
            "top_v": best(g, "v", "o", True),
            "low_v": best(g, "v", "o", False),
            "sd_v": v.std(ddof=1) if len(v) >= 2 else None,
            "var_o": o.var(ddof=1) if len(o) >= 2 else None,
        }
    return out


def assert_matches(got: dict[Any, dict[str, Any]], want: dict[Any, dict[str, Any]]) -> None:
    assert set(got) == set(want)
    for key, row in want.items():
        for name, value in row.items():
            actual = plain(got[key][name])
            value = plain(value)
            if name in ("sd_v", "var_o") and value is not None:
                assert actual is not None and math.isclose(actual, value, rel_tol=1e-9), (
                    key,
                    name,
                    actual,
                    value,
                )
            else:
                assert actual == value, (key, name, actual, value)


def _by_key(df: Any) -> dict[Any, dict[str, Any]]:
    return {r["k"]: r.asDict() for r in df.collect()}


@pytest.fixture(scope="module")
def data(spark: Any) -> tuple[Any, list[tuple[Any, ...]]]:
    rows = _rows()
    return spark.createDataFrame(rows, SCHEMA_DDL), rows


def _plan(schema: Any) -> Any:
    from checkpointing.spark.aggregations import AggregationPlan

    return AggregationPlan(KEY, AGGREGATIONS, schema)


def test_folding_epochs_in_any_order_gives_the_result_over_all_rows(spark: Any, data: Any) -> None:
    from pyspark.sql import functions as F

    df, rows = data
    plan = _plan(df.drop("epoch").schema)
    deltas = [
        df.where(F.col("epoch") == e)
        .drop("epoch")
        .groupBy(*KEY)
        .agg(*plan.partials())
        .localCheckpoint()
        for e in range(EPOCHS)
    ]
    want = expected(rows)
    shuffled = plan.empty_state(spark)
    for i in (4, 1, 3, 0, 2):
        shuffled = plan.merge(shuffled, deltas[i], KEY)
    left = plan.merge(deltas[3], deltas[0], KEY)
    tree = plan.merge(plan.merge(deltas[4], plan.merge(deltas[2], deltas[1], KEY), KEY), left, KEY)
    folds = [s.localCheckpoint() for s in (shuffled, tree)]
    results = [_by_key(plan.final(s)) for s in folds]
    for got in results:
        assert_matches(got, want)
    # every merge order gives the very same sets and pairs (moments: equal up to rounding, and
    # an HLL sketch's bytes in its small modes list values in arrival order: the same estimate)
    exact = [c for c in plan.partial_columns if c.startswith(("__set_", "__maxby_", "__minby_"))]
    states = [
        sorted((repr(r[0]), tuple(r)) for r in s.select(*KEY, *exact).collect()) for s in folds
    ]
    assert states[0] == states[1]
    assert all({k: r["approx_s"] for k, r in got.items()} == {
        k: r["approx_s"] for k, r in results[0].items()
    } for got in results)  # fmt: skip
    few = {k: (r["approx_s"], r["distinct_s"]) for k, r in results[0].items()}
    assert all(a == b for a, b in few.values()), few  # a few values: counted exactly
    # the data exercise what they should
    assert want[ALL_NULL_KEY] == {
        "n": 3, "distinct_o": 0, "distinct_s": 0, "top_s": None, "low_s": None,
        "top_v": None, "low_v": None, "sd_v": None, "var_o": None,
    }  # fmt: skip
    assert want[ONE_ROW_KEY]["sd_v"] is None and want[ONE_ROW_KEY]["top_v"] == 7.5
    assert (want["tie"]["top_v"], want["tie"]["top_s"]) == (1.0, "b")
    assert None in want
    # results equal Spark's own one-shot aggregates where Spark's are deterministic
    spark_own = _by_key(
        df.groupBy(*KEY).agg(
            F.count_distinct("o").alias("distinct_o"),
            F.count_distinct("s").alias("distinct_s"),
            F.stddev_samp("v").alias("sd_v"),
            F.var_samp("o").alias("var_o"),
        )
    )
    for key, row in spark_own.items():
        for name in ("distinct_o", "distinct_s"):
            assert results[0][key][name] == row[name]
        for name in ("sd_v", "var_o"):
            a, b = results[0][key][name], row[name]
            assert (a is None and b is None) or math.isclose(a, b, rel_tol=1e-9)


def test_approx_count_distinct_merges_sketches_exactly(spark: Any, data: Any) -> None:
    from pyspark.sql import functions as F

    from checkpointing.spark.aggregations import AggregationPlan
    from checkpointing.spark.partials import HLL_RELATIVE_STANDARD_ERROR

    df, _ = data
    many = df.select(
        (F.col("epoch") % 2).cast("string").alias("k"),
        F.concat_ws("-", F.col("k"), F.col("o"), F.col("v"), F.col("s")).alias("s"),
        "epoch",
    )
    big = spark.range(40_000).select(
        F.lit("big").alias("k"), (F.col("id") * 7919 % 30_011).cast("string").alias("s"),
        (F.col("id") % EPOCHS).cast("int").alias("epoch"),
    )  # fmt: skip
    df = many.unionByName(big)
    plan = AggregationPlan(KEY, {"approx": "approx_count_distinct(s)"}, df.drop("epoch").schema)
    deltas = [
        df.where(F.col("epoch") == e).drop("epoch").groupBy(*KEY).agg(*plan.partials())
        for e in range(EPOCHS)
    ]
    folds = []
    state = plan.empty_state(spark)
    for e in (3, 1, 4, 0, 2):
        state = plan.merge(state, deltas[e], KEY)
    folds.append(state.localCheckpoint())
    tree = plan.merge(
        plan.merge(deltas[0], deltas[4], KEY), plan.merge(deltas[2], deltas[1], KEY), KEY
    )
    folds.append(plan.merge(deltas[3], tree, KEY).localCheckpoint())
    estimates = [{r["k"]: r["approx"] for r in plan.final(f).collect()} for f in folds]
    assert estimates[0] == estimates[1]  # any merge order: the same estimate
    state = folds[0]
    merged = {r["k"]: r for r in state.join(plan.final(state), KEY).collect()}
    # Spark's own sketch over all rows at once (over the raw strings) adds nothing to the merged
    # state (a union of the two has its estimate); Spark's estimate of that sketch as it comes
    # and the result are within the bound of the exact count, and of each other
    one_shot = (
        df.groupBy(*KEY)
        .agg(F.hll_sketch_agg("s", 12).alias("sketch"), F.count_distinct("s").alias("exact"))
        .join(state, KEY)
        .select(
            *KEY,
            "exact",
            F.hll_sketch_estimate("sketch").alias("estimate"),
            F.hll_sketch_estimate(F.hll_union("sketch", "__hll_approx")).alias("both"),
        )
        .collect()
    )
    assert {r["k"] for r in one_shot} == set(merged) == {"0", "1", "big"}
    for r in one_shot:
        approx = merged[r["k"]]["approx"]
        assert approx == r["both"], (r, approx)
        bound = 4 * HLL_RELATIVE_STANDARD_ERROR * r["exact"]  # 4 standard errors
        assert abs(approx - r["exact"]) <= bound, (r, approx)
        assert abs(approx - r["estimate"]) <= bound, (r, approx)
    assert len(merged["big"]["__hll_approx"]) > 1000  # a dense sketch: really approximate
    assert merged["big"]["approx"] != 30_011  # (30,011 distinct values: not counted exactly)


def test_types_and_refusals(spark: Any) -> None:
    import datetime as dt
    from decimal import Decimal

    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from checkpointing.spark.aggregations import AggregationPlan

    schema = T.StructType(
        [
            T.StructField("k", T.StringType()),
            T.StructField("dec", T.DecimalType(12, 2)),
            T.StructField("day", T.DateType()),
            T.StructField("ts", T.TimestampType()),
            T.StructField("b", T.BinaryType()),
            T.StructField("f", T.FloatType()),
            T.StructField("i", T.LongType()),
            T.StructField("m", T.MapType(T.StringType(), T.IntegerType())),
            T.StructField("arr", T.ArrayType(T.IntegerType())),
            T.StructField("ntz", T.TimestampNTZType()),
        ]
    )
    day, ts = dt.date(2013, 1, 1), dt.datetime(2013, 1, 1, 12, 0)
    day_ts = dt.datetime(2013, 1, 1, 9, 30, 0, 500)
    big = Decimal("9999999999.99")
    rows = [
        ("a", big, day, ts, b"\x00\x01", 1.5, -(2**63), None, [1], ts),
        ("a", big, day + dt.timedelta(1), ts, b"\x00", float("nan"), -(2**63), None, [2], ts),
        (
            "a",
            Decimal("0.01"),
            day + dt.timedelta(1),
            ts,
            b"\x00",
            0.5,
            2**63 - 1,
            None,
            [2],
            day_ts,
        ),
    ]
    aggs = {
        "sum_dec": "sum(dec)",
        "avg_dec": "avg(dec)",
        "top_day": "max_by(day, i)",
        "low_day": "min_by(day, i)",  # a tie on the smallest long: the earliest day wins
        "top_b": "max_by(b, ts)",  # all tie: the smallest binary, a prefix before its extension
        "low_f": "min_by(f, ts)",
        "top_f": "max_by(f, dec)",  # a tie on the largest decimal: 1.5 beats NaN
        "top_ts": "max_by(ts, day)",
        "arr_low": "min_by(arr, i)",
        "top_ntz": "max_by(ntz, ts)",  # all tie: the earliest time
        "nd_day": "count_distinct(day)",
        "nd_f": "count_distinct(f)",
        "approx_day": "approx_count_distinct(day)",
        "approx_f": "approx_count_distinct(f)",
        "approx_dec": "approx_count_distinct(dec)",
        "sd_dec": "stddev(dec)",
    }
    df = spark.createDataFrame(rows, schema)
    plan = AggregationPlan(["k"], aggs, schema)
    deltas = [  # ties within an epoch's partial, and across the merge
        spark.createDataFrame(part, schema).groupBy("k").agg(*plan.partials())
        for part in (rows[2:], rows[:2])
    ]
    for delta in deltas:
        assert [f.dataType for f in delta.schema] == [f.dataType for f in plan.state_schema()]
    state = plan.merge(*deltas, ["k"])
    assert [f.dataType for f in state.schema] == [f.dataType for f in plan.state_schema()]
    got = plan.final(state).collect()[0].asDict()
    assert got["sum_dec"] == Decimal("19999999999.99")  # exact: decimal partials, no double
    spark_avg = df.agg(F.avg("dec")).collect()[0][0]
    assert isinstance(got["avg_dec"], Decimal) and got["avg_dec"] == spark_avg  # Spark's avg
    assert (got["top_day"], got["low_day"]) == (day + dt.timedelta(1), day)
    assert got["top_b"] == bytearray(b"\x00")  # b"\x00" < b"\x00\x01"
    assert (got["low_f"], got["top_f"]) == (0.5, 1.5)  # NaN is the largest: last in a tie
    assert got["top_ts"] == ts and got["arr_low"] == [1] and got["top_ntz"] == day_ts
    assert (got["nd_day"], got["nd_f"], got["approx_day"], got["approx_f"]) == (2, 3, 2, 3)
    assert got["approx_dec"] == 2
    assert math.isclose(got["sd_dec"], float(df.agg(F.stddev("dec")).collect()[0][0]))

    with pytest.raises(ValueError, match=r"top = max_by\(m, i\): column 'm' has type map"):
        AggregationPlan(["k"], {"top": "max_by(m, i)"}, schema)
    with pytest.raises(ValueError, match=r"order column 'm' has type map<string,int>, which has"):
        AggregationPlan(["k"], {"low": "min_by(i, m)"}, schema)
    with pytest.raises(ValueError, match=r"max_by\(i, nope\): column 'nope' is not in the input"):
        AggregationPlan(["k"], {"top": "max_by(i, nope)"}, schema)
    with pytest.raises(ValueError, match=r"sd = stddev\(day\): .* type date; stddev needs a num"):
        AggregationPlan(["k"], {"sd": "stddev(day)"}, schema)
    with pytest.raises(ValueError, match=r"a = approx_count_distinct\(arr\): .* type array<int>"):
        AggregationPlan(["k"], {"a": "approx_count_distinct(arr)"}, schema)
    with pytest.raises(ValueError, match=r"d = count_distinct\(m\): .* cannot be compared"):
        AggregationPlan(["k"], {"d": "count_distinct(m)"}, schema)


# ---------------------------------------------------------------------- a real run: crash, rescale

SPEC_AGGS = {
    "n": "count()",
    "distinct_q": "count_distinct(quantity)",
    "distinct_amount": "count_distinct(amount)",
    "approx_amount": "approx_count_distinct(amount)",
    "top_amount": "max_by(amount, quantity)",
    "low_amount": "min_by(amount, quantity)",
    "sd_amount": "stddev(amount)",
    "var_q": "variance(quantity)",
}


def _expected_events(frame: pd.DataFrame) -> dict[str, dict[str, Any]]:
    out = {}
    for user, g in frame.groupby("user"):
        amount = g["amount"].dropna()
        out[user] = {
            "n": len(g),
            "distinct_q": g["quantity"].nunique(),
            "distinct_amount": amount.nunique(),
            "top_amount": best(g, "amount", "quantity", True),
            "low_amount": best(g, "amount", "quantity", False),
            "sd_amount": amount.std(ddof=1) if len(amount) >= 2 else None,
            "var_q": g["quantity"].astype(float).var(ddof=1) if len(g) >= 2 else None,
        }
    return out


def kinds_spec(tmp_path: Path, job: str, sink: str, checkpoint: str = "") -> tuple[Any, Path]:
    """A spec of every aggregation kind over 4 files of generated events, and their folder."""
    from checkpointing.pipeline import datasets
    from checkpointing.pipeline.spec import load_spec

    events = tmp_path / "events"
    datasets.generate_events(events, events=4_000, keys=60, files=4, seed=11)
    aggs = "\n".join(f"  {k}: {v}" for k, v in SPEC_AGGS.items())
    path = tmp_path / f"{job}.yaml"
    path.write_text(
        f"""
job: {job}
source: {{format: parquet, path: "{events}/*.parquet"}}
key: user
aggregations:
{aggs}
sink: {sink}
parallelism: 3
max_parallelism: 16
{checkpoint}
"""
    )
    return load_spec(path), events


def assert_kinds_exact(got: dict[str, dict[str, Any]], events: Path) -> dict[str, dict[str, Any]]:
    """Every exact kind of ``got`` (rows by user) equals pandas' over all ``events``; the
    oracle's rows are returned."""
    frames = [pd.read_parquet(p) for p in sorted(events.glob("*.parquet"))]
    want = _expected_events(pd.concat(frames))
    assert set(got) == set(want)
    for user, row in want.items():
        for name, value in row.items():
            actual = plain(got[user][name])
            if isinstance(value, float) and name.startswith(("sd_", "var_")):
                assert math.isclose(actual, value, rel_tol=1e-9), (user, name, actual, value)
            else:
                assert actual == plain(value), (user, name, actual, value)
    return want


def test_a_crash_and_a_rescaled_restore_give_the_result_over_all_rows(
    spark: Any, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from checkpointing.cli import app
    from checkpointing.metastore.engine import Metastore
    from checkpointing.restore.state_reader import SHOWN_SET_VALUES, describe_value, inspect_state
    from checkpointing.spark.aggregations import AggregationPlan
    from checkpointing.spark.partials import HLL_RELATIVE_STANDARD_ERROR
    from checkpointing.spark.runtime import SimulatedCrash
    from checkpointing.state.storage import FileSystemCheckpointStorage
    from tests.spark_pipeline import completed_ids, run, tables

    spec, events = kinds_spec(
        tmp_path,
        "more",
        sink=f"{{path: {tmp_path / 'out'}, changelog: true}}",
        checkpoint="checkpoint: {every_epochs: 1, retained: 2}",
    )
    url = f"sqlite:///{tmp_path / 'metastore.db'}"
    Metastore(url, check_schema=False).upgrade()
    metastore = Metastore(url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, parallelism=3, crash_after_epochs=2)
    resumed = run(spark, spec, metastore, storage, parallelism=2)
    assert resumed.restored_from is not None and resumed.epochs_run == [2, 3]

    final, changelog = tables(spark, spec)
    got = {r["user"]: r for r in final.to_dict("records")}
    want = assert_kinds_exact(got, events)
    # the HLL estimate: that of the input files' sketches merged in one go, in another order
    # than the run's (any order gives the same estimate), within the bound of the exact count
    plan = AggregationPlan(["user"], {"a": SPEC_AGGS["approx_amount"]})
    files = [spark.read.parquet(str(p)) for p in sorted(events.glob("*.parquet"), reverse=True)]
    sketches = [f.groupBy("user").agg(*plan.partials(f.schema)) for f in files]
    union = sketches[0]
    for sketch in sketches[1:]:
        union = union.unionByName(sketch)
    merged = plan.final(plan.merge(plan.empty_state(spark, files[0].schema), union, ["user"]))
    estimates = {r["user"]: r["a"] for r in merged.collect()}
    for user, row in want.items():
        approx = got[user]["approx_amount"]
        assert approx == estimates[user], user
        bound = 4 * HLL_RELATIVE_STANDARD_ERROR * row["distinct_amount"]
        assert abs(approx - row["distinct_amount"]) <= max(1, bound), (user, approx, row)
    assert sorted(changelog.epoch.unique()) == [0, 1, 2, 3]

    # ckpt inspect shows each partial state readably (the last checkpoint: all the input)
    checkpoint = completed_ids(metastore, "more")[-1]
    user = max(want, key=lambda u: want[u]["n"])
    view = inspect_state(metastore, storage, "more", checkpoint, "aggregate", key=[user])
    (row,) = view.rows
    g = pd.concat(pd.read_parquet(p) for p in sorted(events.glob("*.parquet"))).query(
        "user == @user"
    )
    quantities = sorted(g.quantity.unique().tolist())
    assert row["__set_distinct_q"] == quantities
    shown = ", ".join(str(q) for q in quantities[:SHOWN_SET_VALUES])
    more = len(quantities) - SHOWN_SET_VALUES
    assert describe_value("__set_distinct_q", row["__set_distinct_q"]) == (
        f"{len(quantities)} distinct: {shown}" + (f", … (+{more} more)" if more > 0 else "")
    )
    sketch = row["__hll_approx_amount"]
    assert (
        describe_value("__hll_approx_amount", sketch) == f"HLL sketch (lgK 12, {len(sketch)} bytes)"
    )
    top = row["__maxby_top_amount"]
    assert top == {"order": int(g.quantity.max()), "value": want[user]["top_amount"]}
    assert describe_value("__maxby_top_amount", top) == (
        f"order={top['order']}, value={top['value']:.10g}"
    )
    moments = row["__mom_sd_amount"]
    amount = g.amount.dropna()
    assert moments["n"] == len(amount) and math.isclose(moments["mean"], amount.mean())
    assert math.isclose(moments["m2"], ((amount - amount.mean()) ** 2).sum(), rel_tol=1e-9)
    assert describe_value("__mom_sd_amount", moments).startswith(f"n={len(amount)}, mean=")
    runner = CliRunner()
    base = ["--metastore-url", url, "--storage-url", storage.base_url, "inspect", "more"]
    args = [*base, str(checkpoint), "--operator", "aggregate", "--key", user]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    text = "".join(result.stdout.split())
    for part in ("distinct:", "HLL", "order=", "M2="):  # (cells wrap in a narrow table)
        assert part in text, part
    data = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    assert data["rows"][0]["__hll_approx_amount"] == bytes(sketch).hex()  # JSON: hex bytes
