"""The hand-written design, the benchmark's second anchor (issue 37): what a careful user writes by
hand to get a restartable batch job out of plain PySpark — per epoch (``--files-per-epoch`` input
files at a time, in name order, as our runs' epochs) a partial aggregate per key with its key
group, sorted by key group and written to ``<work>/epoch-<e>/`` with a ``_COMMITTED`` marker;
at the end one merge of every epoch's partials into the output table (W's columns and values)::

    per epoch:  read(epoch files).groupBy(user).agg(count(1) c, count(amount) ca, sum(amount) s,
                min(quantity) mn, max(quantity) mx) + key group
                -> sortWithinPartitions(key group) -> epoch-<e>/ + _COMMITTED
    at the end: read(epoch-*/).groupBy(user).agg(sum(c) n, sum(s) total,
                sum(s) / sum(ca) avg_amount, min(mn) min_q, max(mx) max_q)

The average divides by ``sum(ca)``, the non-null amounts, not by ``sum(c)``: about 1 % of the
amounts are null and W's ``avg(amount)`` ignores them (``sum(s) / sum(c)`` would differ).

The key group is our runtime's (``checkpointing.spark.keys.key_group_column``, copied: the job
imports nothing of this project): ``pmod(xxhash64(<length>:<text>), 128)``. The design never
restarts here (no crash is simulated for it); its per-epoch commits are what a restart would
resume from. Same session settings, whole-process timing and ``--result-json`` as ``plain_job``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # plain_job, beside this file

from plain_job import arguments, session, timed

MAX_PARALLELISM = 128  # our runtime's default max_parallelism: its key groups


def main(argv: list[str] | None = None) -> int:
    p = arguments("The hand-written design (the benchmark's second anchor, issue 37)")
    p.add_argument("--work", type=Path, required=True, help="the epochs' committed partials")
    p.add_argument("--files-per-epoch", type=int, default=1)
    args = p.parse_args(argv)
    t0 = time.time()
    from pyspark.sql import functions as F

    spark = session("design-job", args.master, args.shuffle_partitions)
    files = sorted(Path(args.input).resolve().glob("*.parquet"))
    n = args.files_per_epoch
    epochs = [files[i : i + n] for i in range(0, len(files), n)]
    text = F.col("user").cast("string")
    canonical = F.when(F.col("user").isNull(), F.lit("N")).otherwise(
        F.concat(F.length(text).cast("string"), F.lit(":"), text)
    )
    key_group = F.pmod(F.xxhash64(canonical), F.lit(MAX_PARALLELISM)).cast("int")

    def job() -> None:
        done = []
        for e, epoch_files in enumerate(epochs):
            out = args.work.resolve() / f"epoch-{e}"
            (
                spark.read.parquet(*(f"file://{f}" for f in epoch_files))
                .groupBy("user")
                .agg(
                    F.count(F.lit(1)).alias("c"),
                    F.count("amount").alias("ca"),  # avg ignores null amounts, as W's
                    F.sum("amount").alias("s"),
                    F.min("quantity").alias("mn"),
                    F.max("quantity").alias("mx"),
                )
                .withColumn("key_group", key_group)
                .sortWithinPartitions("key_group")
                .write.mode("overwrite")
                .parquet(f"file://{out}")
            )
            (out / "_COMMITTED").write_text(f"{len(epoch_files)} files\n")
            done.append(f"file://{out}")
        (
            spark.read.parquet(*done)
            .groupBy("user")
            .agg(
                F.sum("c").alias("n"),
                F.sum("s").alias("total"),
                F.try_divide(F.sum("s"), F.sum("ca")).alias("avg_amount"),
                F.min("mn").alias("min_q"),
                F.max("mx").alias("max_q"),
            )
            .write.mode("errorifexists")
            .parquet(f"file://{Path(args.output).resolve()}")
        )

    timed(spark, t0, args.result_json, job)
    return 0


if __name__ == "__main__":
    sys.exit(main())
