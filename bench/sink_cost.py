"""The sinks' cost per checkpoint, for ``bench/spark_bench.py``: the ``every`` run (Parquet
sink) and the ``every-delta`` run (Delta sink, ``mode: upsert``, a local table) of each round
time their sink's calls — ``stage`` (the executors write the epoch's output), ``commit`` (on each
checkpoint's completion) and ``publish_final`` — and the report divides each run's total by its
checkpoints. The ratio Delta / Parquet is given per round (paired: the two runs of a round run
back to back) with its median and spread.

The Delta upsert table rewrites each bucket of key groups an epoch touches (copy-on-write), the
Parquet sink writes only the changed rows: the ratio says what a table that always holds the
current aggregates costs over an append-only changelog."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

#: the sink calls timed
CALLS = ("stage", "commit", "publish_final")


def time_sink(sink: Any) -> dict[str, float]:
    """Wrap ``sink``'s calls (on the instance) to add their seconds to the returned dict."""
    seconds = dict.fromkeys(CALLS, 0.0)

    def timed(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                seconds[name] += time.perf_counter() - t0

        return wrapper

    for name in CALLS:
        setattr(sink, name, timed(name, getattr(sink, name)))
    return seconds


def output_counts(spark: Any, final_path: str, delta: bool) -> tuple[int, int]:
    """Keys and counted events of the final table (a Delta table through its log: its
    directory also holds files earlier versions removed)."""
    if delta:
        import pyarrow.compute as pc
        from deltalake import DeltaTable

        table = DeltaTable(final_path).to_pyarrow_table(columns=["n"])
        return table.num_rows, int(pc.sum(table.column("n")).as_py() or 0)
    from pyspark.sql import functions as F

    final = spark.read.parquet(final_path)
    row = final.agg(F.count(F.lit(1)).alias("keys"), F.sum("n").alias("events")).first()
    return int(row["keys"]), int(row["events"])


def cost_ratio(runs: list[dict[str, Any]], num: str = "every-delta", den: str = "every") -> dict:
    """Sink seconds per checkpoint of ``num`` / ``den``, paired by round: median and spread."""

    def per_checkpoint(variant: str) -> dict[int, float]:
        return {
            r["round"]: r["sink_s_per_checkpoint"]
            for r in runs
            if r["variant"] == variant and r.get("sink_s_per_checkpoint")
        }

    a, b = per_checkpoint(num), per_checkpoint(den)
    paired = [round(a[k] / b[k], 3) for k in sorted(a) if k in b and b[k] > 0]
    if not paired:
        return {}
    return {
        "numerator": num,
        "denominator": den,
        "sink_s_per_checkpoint": {
            num: round(statistics.median(a.values()), 4),
            den: round(statistics.median(b.values()), 4),
        },
        "paired_by_round": paired,
        "median": round(statistics.median(paired), 3),
        "min": min(paired),
        "max": max(paired),
        "stdev": round(statistics.stdev(paired), 3) if len(paired) > 1 else None,
    }
