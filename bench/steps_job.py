"""The step API's benchmark job (issue 39), run as a whole process by ``bench/steps_bench.py``:
a join of two large inputs, an aggregate, a window, a write::

    enriched = orders.join(customers, "cid")
    daily = enriched.groupBy("day", "region").agg(sum(amount), count, avg(qty))
    ranked = daily.withColumn("rank", rank() over (partition by day order by rev desc))
    ranked.write.parquet(out)

``plain`` is W, the job as a user has it; ``steps`` the same lines with ``ck.step`` around each
step and ``ck.write`` for the write (every step checkpointed), its metastore and storage from
``CKPT_METASTORE_URL``/``CKPT_STORAGE_URL``; ``chained`` the same with the join chained into the
aggregate that reads it (``ck.step(..., chained=True)``: checkpointed as its plan and inputs, not
its 12 million rows); ``manual`` the floor any checkpoint of every step
pays on Spark: each step's output written with Spark's own writer and read back, by hand (no
coordinator, no acknowledgement, nothing to resume from); ``start`` a process's fixed cost: the
session started and the inputs' schemas read, nothing run (what every resume pays before its
own work). ``narrow`` is another job, for the partial resume: the orders repartitioned by
``oid`` into 16 (the step ``base``), then a narrow step over it, ``scored``: a hash of each row
(``ck.step(..., input=base)``), then the write; ``narrow-plain`` the same without ``ck``.
The session is Spark's defaults (adaptive execution on, 200 shuffle partitions) on
``--master``, as a user's job has it. ``--result-json``: the time from the process's start to
the session's stop, and the step API's counts."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

STARTED = time.monotonic()
#: the narrow job's tasks (its base step's partitions), and how much hashing each row costs
NARROW_TASKS = 16
NARROW_REPEAT = 40


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "mode", choices=("plain", "steps", "chained", "manual", "start", "narrow", "narrow-plain")
    )
    p.add_argument("data", help="directory holding orders/ and customers/ (Parquet)")
    p.add_argument("output", help="output directory")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--result-json", type=Path)
    args = p.parse_args()

    import logging

    # the step API's lines (which step runs, reused or computed), timestamped for the bench
    logging.basicConfig(format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("checkpointing").setLevel(logging.INFO)

    from pyspark.sql import SparkSession, Window
    from pyspark.sql import functions as F

    if args.mode in (
        "steps",
        "chained",
        "narrow",
    ):  # where a user's script imports it: at its top, before the session
        from checkpointing.spark.steps import checkpointed

    spark = (
        SparkSession.builder.master(args.master)
        .appName(f"steps-bench-{args.mode}")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    orders = spark.read.parquet(f"{args.data}/orders")
    customers = spark.read.parquet(f"{args.data}/customers")
    w = Window.partitionBy("day").orderBy(F.desc("rev"), "region")

    def daily_of(enriched):  # type: ignore[no-untyped-def]
        return enriched.groupBy("day", "region").agg(
            F.sum("amount").alias("rev"), F.count(F.lit(1)).alias("n"), F.avg("qty").alias("qty")
        )

    def materialized(df, name):  # type: ignore[no-untyped-def]
        path = f"{args.output}/_steps/{name}"
        df.write.mode("overwrite").parquet(path)
        return spark.read.parquet(path)

    def scored_of(base):  # type: ignore[no-untyped-def]
        row = F.concat_ws(":", "oid", "cid", "day", "amount", "qty")
        return base.withColumn("h", F.sha2(F.repeat(row, NARROW_REPEAT), 256))

    stats: dict[str, object] = {}
    if args.mode == "start":
        pass
    elif args.mode == "narrow-plain":
        scored_of(orders.repartition(NARROW_TASKS, "oid")).write.parquet(args.output)
    elif args.mode == "narrow":
        with checkpointed(spark, job="steps_narrow") as ck:
            base = ck.step("base", lambda: orders.repartition(NARROW_TASKS, "oid"))
            scored = ck.step("scored", scored_of, input=base)
            ck.write(scored, args.output)
        stats = {
            "reused": ck.stats.reused,
            "computed": ck.stats.computed,
            "partitions_computed": ck.stats.partitions_computed,
            "partitions_salvaged": ck.stats.partitions_salvaged,
        }
    elif args.mode == "manual":
        enriched = materialized(orders.join(customers, "cid"), "enriched")
        daily = materialized(daily_of(enriched), "daily")
        ranked = materialized(daily.withColumn("rank", F.rank().over(w)), "ranked")
        ranked.write.mode("overwrite").parquet(f"{args.output}/final")
    elif args.mode == "plain":
        ranked = daily_of(orders.join(customers, "cid")).withColumn("rank", F.rank().over(w))
        ranked.write.mode("overwrite").parquet(args.output)
    else:
        with checkpointed(spark, job="steps_bench") as ck:
            enriched = ck.step(
                "enriched", lambda: orders.join(customers, "cid"), chained=args.mode == "chained"
            )
            daily = ck.step("daily", lambda: daily_of(enriched))
            ranked = ck.step("ranked", lambda: daily.withColumn("rank", F.rank().over(w)))
            ck.write(ranked, args.output)
        s = ck.stats
        stats = {
            "reused": s.reused,
            "computed": s.computed,
            "chained": s.chained,
            "partitions_computed": s.partitions_computed,
            "bytes_written": s.bytes_written,
            "restored_from": s.restored_from,
        }
    spark.stop()
    if args.result_json is not None:
        args.result_json.write_text(
            json.dumps({"process_s": round(time.monotonic() - STARTED, 3), **stats})
        )


if __name__ == "__main__":
    main()
