"""The plain Spark batch job W, the benchmark's anchor (issue 23): what a user runs today instead
of a checkpointed pipeline — the same query over the same input as one Spark job, started as a
whole process (``python bench/plain_job.py ...``, JVM start included)::

    spark.read.parquet(all input files).groupBy(user)
         .agg(count, sum(amount), avg(amount), min(quantity), max(quantity)).write.parquet(out)

Session settings are those of ``checkpointing.spark.session.spark_session`` (the master,
loopback, no UI, this interpreter for the Python workers), written out here so that the job
imports nothing of this project, plus ``spark.sql.shuffle.partitions`` = the benchmark's
parallelism. Adaptive query execution stays at Spark's default, as in a user's job (our runtime
turns it off for its runs, to keep its state's partitioning). The output is a Parquet table with
Spark's default codec, as our sink's final table; no fsync (a plain job does not).

``--result-json`` (the benchmark's, after the job): its timings (``ended_at``: the session's stop
returned, less the benchmark's own work before it), the process tree's CPU seconds over the run
and the session's settings, to compare with our runs' (``session_conf``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

#: settings compared between W and our runs (the benchmark's check that the sessions match)
SESSION_CONF_KEYS = (
    "spark.master",
    "spark.driver.memory",
    "spark.driver.host",
    "spark.ui.enabled",
    "spark.sql.requireAllClusterKeysForCoPartition",
    "spark.serializer",
)
#: SQL settings compared the same way (the session's values before a run sets its own)
SESSION_SQL_KEYS = ("spark.sql.parquet.compression.codec", "spark.sql.adaptive.enabled")


def session_conf(spark: Any) -> dict[str, str | None]:
    """The compared settings as the running session has them (None: Spark's default)."""
    conf = spark.sparkContext.getConf()
    out: dict[str, str | None] = {k: conf.get(k, None) for k in SESSION_CONF_KEYS}
    for key in SESSION_SQL_KEYS:
        out[key] = spark.conf.get(key)  # the effective value, Spark's default included
    return out


def arguments(description: str) -> argparse.ArgumentParser:
    """The command line W and the design share (``design_job`` adds its own options)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("input", help="directory of the input Parquet files")
    p.add_argument("output", help="output directory (must not exist)")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--shuffle-partitions", type=int, default=4)
    p.add_argument("--result-json", type=Path, help="the benchmark's timings, written last")
    return p


def session(app: str, master: str, shuffle_partitions: int) -> Any:
    """The Spark session of W and the design: our runtime's settings, written out here."""
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    return (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.sql.requireAllClusterKeysForCoPartition", "false")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .getOrCreate()
    )


def timed(spark: Any, t0: float, result_json: Path | None, job: Any) -> None:
    """Run ``job()`` on the session, stop it, and write the benchmark's timings (``t0``: the
    process's start) to ``result_json``: the benchmark's own work is left out of them."""
    cpu0 = _tree_cpu() if result_json else 0.0  # over the run only, as our runs' cpu_s
    session_up = time.time()
    job()
    written = time.time()
    cpu_s = _tree_cpu() - cpu0 if result_json else None
    conf = session_conf(spark) if result_json else None
    stop_started = time.time()
    spark.stop()
    ended = time.time()
    if result_json:
        result = {
            "started_at": t0,
            "ended_at": ended - (stop_started - written),
            "session_s": round(session_up - t0, 3),
            "run_s": round(written - session_up, 3),
            "stop_s": round(ended - stop_started, 3),
            "cpu_s": None if cpu_s is None else round(cpu_s, 2),
            "session_conf": conf,
        }
        result_json.write_text(json.dumps(result))


def w_aggregates() -> list[Any]:
    """W's aggregates (the benchmark's query; Structured Streaming's peer runs them too)."""
    from pyspark.sql import functions as F

    return [
        F.count(F.lit(1)).alias("n"),
        F.sum("amount").alias("total"),
        F.avg("amount").alias("avg_amount"),
        F.min("quantity").alias("min_q"),
        F.max("quantity").alias("max_q"),
    ]


def main(argv: list[str] | None = None) -> int:
    args = arguments("The plain Spark batch job (the benchmark's W)").parse_args(argv)
    t0 = time.time()

    spark = session("plain-job", args.master, args.shuffle_partitions)

    def job() -> None:
        (
            spark.read.parquet(f"file://{Path(args.input).resolve()}/*.parquet")
            .groupBy("user")
            .agg(*w_aggregates())
            .write.mode("errorifexists")
            .parquet(f"file://{Path(args.output).resolve()}")
        )

    timed(spark, t0, args.result_json, job)
    return 0


def _tree_cpu() -> float:
    """CPU seconds of this process and its descendants (the driver JVM), from /proc."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import tree_cpu_seconds

    return tree_cpu_seconds(os.getpid())


if __name__ == "__main__":
    sys.exit(main())
