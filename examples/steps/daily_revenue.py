"""The daily revenue job of docs/steps.md, its steps checkpointed: orders joined with customers,
revenue per day and region, ranked per day, published exactly once.

    ckpt run examples/steps/daily_revenue.py ORDERS CUSTOMERS OUT

or deployed as a task by ``steps_script_dag.py`` beside it (spark-submit runs it; its Spark
session gets spark-submit's master and conf).
"""

import sys

from pyspark.sql import Window
from pyspark.sql import functions as F

from checkpointing.spark.session import spark_session
from checkpointing.spark.steps import checkpointed


def main(orders_path: str, customers_path: str, out: str) -> None:
    spark = spark_session("daily_revenue")  # under spark-submit: the submitter's master, conf
    orders = spark.read.parquet(orders_path)
    customers = spark.read.parquet(customers_path)
    by_revenue = Window.partitionBy("day").orderBy(F.desc("rev"), "region")
    with checkpointed(spark, job="daily_revenue") as ck:
        # no shuffle (customers is small enough for Spark to broadcast): chained, its rows
        # recomputed by the step that reads them rather than written and read back
        # (docs/steps.md, "Chained steps"; a join that shuffles is refused chained=True)
        enriched = ck.step("enriched", lambda: orders.join(customers, "cid"), chained=True)
        daily = ck.step(
            "daily",
            lambda: enriched.groupBy("day", "region").agg(
                F.sum("amount").alias("rev"), F.count(F.lit(1)).alias("n")
            ),
        )
        ranked = ck.step("ranked", lambda: daily.withColumn("rank", F.rank().over(by_revenue)))
        ck.write(ranked, out)  # <out>/final is the published table
    spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:4])
