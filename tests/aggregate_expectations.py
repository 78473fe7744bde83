"""Independent pandas expectations for the mergeable aggregates (count_distinct,
approx_count_distinct, max_by, min_by, stddev, variance), shared by the Spark tests."""

from __future__ import annotations

from typing import Any

import pandas as pd

#: HLL sketches (lgK 12): an estimate is within 4 standard errors of 1.04/sqrt(4096)
APPROX_STANDARD_ERRORS = 4


def best(frame: pd.DataFrame, value: str, order: str, largest: bool) -> Any:
    """max_by/min_by with the documented rules, in plain pandas: rows with a null order are
    ignored; among the rows of the best order, the smallest non-null value wins (null when
    there is none)."""
    rows = frame[frame[order].notna()]
    if rows.empty:
        return None
    top = rows[order].max() if largest else rows[order].min()
    values = rows.loc[rows[order] == top, value].dropna()
    return None if values.empty else values.min()


def sample_stddev(values: pd.Series) -> float | None:
    """stddev (= stddev_samp) with SQL null semantics: null below two non-null values."""
    values = values.dropna().astype(float)
    return values.std(ddof=1) if len(values) >= 2 else None


def sample_variance(values: pd.Series) -> float | None:
    """variance (= var_samp) with SQL null semantics: null below two non-null values."""
    values = values.dropna().astype(float)
    return values.var(ddof=1) if len(values) >= 2 else None


def plain(value: Any) -> Any:
    """A numpy scalar as the Python value."""
    return value.item() if hasattr(value, "item") else value


def approx_within_bound(approx: int, exact: int) -> bool:
    """An approx_count_distinct estimate is within the stated error of the exact count (a few
    values: within one)."""
    from checkpointing.spark.partials import HLL_RELATIVE_STANDARD_ERROR

    bound = APPROX_STANDARD_ERRORS * HLL_RELATIVE_STANDARD_ERROR * exact
    return abs(approx - exact) <= max(1, bound)
