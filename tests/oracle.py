"""The tests' independent oracle: the expected per-key aggregates computed by DuckDB's SQL over
the input rows, never by the product's code (a second engine with SQL's own null semantics:
``count(*)`` counts rows, ``count(c)`` non-null values, ``sum/min/max/avg`` skip nulls and are
NULL for a key with none); and a sink's output read by pyarrow from its documented layout,
never by the sink's own reader."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import duckdb
import pandas as pd

_SQL = {"count": "count", "sum": "sum", "avg": "avg", "min": "min", "max": "max"}


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def expected_aggregates(
    frame: pd.DataFrame, key: Sequence[str], aggregations: dict[str, tuple[str, str | None]]
) -> pd.DataFrame:
    """The spec's ``(function, column)`` aggregations (a None column: ``count(*)``) as
    :func:`expected_sql`."""
    return expected_sql(
        frame,
        key,
        {
            name: f"{_SQL[function]}({'*' if column is None else _quoted(column)})"
            for name, (function, column) in aggregations.items()
        },
    )


def expected_sql(
    frame: pd.DataFrame, key: Sequence[str], expressions: dict[str, str]
) -> pd.DataFrame:
    """``SELECT key, <expression> AS <name>, … FROM frame GROUP BY key ORDER BY key`` in DuckDB:
    one row per key (a NULL key is a group of its own, sorted last). ``count()``, the spec's
    spelling of a row count, is SQL's ``count(*)``."""
    columns = [
        f"{text.replace('count()', 'count(*)')} AS {_quoted(name)}"
        for name, text in expressions.items()
    ]
    keys = ", ".join(_quoted(k) for k in key)
    order = ", ".join(f"{_quoted(k)} NULLS LAST" for k in key)
    with duckdb.connect() as con:
        con.register("input_rows", frame)
        return con.execute(
            f"SELECT {keys}, {', '.join(columns)} FROM input_rows GROUP BY {keys} ORDER BY {order}"
        ).df()


def read_parquet_sink(
    path: Path, key: Sequence[str] = ("user",)
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A local Parquet sink's final table and changelog, read by pyarrow from the layout the
    sink documents (``<path>/final`` links the current table; ``<path>/changelog/epoch=<e>/``
    holds committed epochs, Hive-partitioned), never through the sink's own reader. Sorted by
    key (the changelog by epoch, then key); the changelog's ``epoch`` is a BIGINT."""
    import pyarrow.dataset as ds

    final = ds.dataset(path / "final", format="parquet").to_table().to_pandas()
    changelog_dir = path / "changelog"
    epochs = sorted(changelog_dir.glob("epoch=*"), key=lambda p: int(p.name.split("=")[1]))
    assert epochs, f"no committed epoch under {changelog_dir}"
    changelog = (
        ds.dataset(changelog_dir, format="parquet", partitioning="hive").to_table().to_pandas()
    )
    changelog["epoch"] = changelog["epoch"].astype("int64")
    final = final.sort_values(list(key)).reset_index(drop=True)
    changelog = changelog.sort_values(["epoch", *key]).reset_index(drop=True)
    return final, changelog
