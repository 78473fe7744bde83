"""The example jobs: a transform function and a function building a whole :class:`Pipeline`.

``clean`` filters with a Python UDF (:func:`is_customer`), so the executors' Python workers
import this module too: what ``py_files`` ships them."""

from __future__ import annotations

from collections.abc import Mapping

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from checkpointing.spark import AggregationStage, Pipeline
from checkpointing.spark.aggregations import AggregationPlan

#: the job ``build`` returns
JOB = "py_events"
AGGREGATIONS = {"n": "count()", "total": "sum(amount)", "avg_amount": "avg(amount)"}


def is_customer(user):  # type: ignore[no-untyped-def]  # hints would make a pandas UDF
    """A customer's id starts with ``u`` (every generated event's does)."""
    return user is not None and user.startswith("u")


def customers(rows: DataFrame, tables: Mapping[str, DataFrame]) -> DataFrame:
    """The events of customers (Spark SQL functions: the driver runs this)."""
    return rows.where(F.col("user").startswith("u"))


def clean(rows: DataFrame, tables: Mapping[str, DataFrame]) -> DataFrame:
    """The customers' events that have an amount: ``transform: ckpt_example.jobs:clean``; the
    customer test is a Python UDF, so the executors' workers import this module."""
    customer = F.udf(is_customer, T.BooleanType())
    return rows.where(customer("user") & F.col("amount").isNotNull())


def build() -> Pipeline:
    """``pipeline: ckpt_example.jobs:build``: per customer, count, total and average amount of
    the events under ``events/`` (relative paths are to the spec file's folder), into ``out``."""
    return _events()


def build_on_s3() -> Pipeline:
    """:func:`build` with its checkpoints in the bucket ``ckpt`` of the S3 endpoint that the
    connection or the environment gives."""
    return _events(storage="s3://ckpt/checkpoints")


def _events(**fields: object) -> Pipeline:
    return Pipeline(
        job=JOB,
        source={"format": "parquet", "path": "events/*.parquet", "splits_per_epoch": 1},
        key="user",
        transform=customers,
        stage=AggregationStage(AggregationPlan(["user"], AGGREGATIONS)),
        sink={"path": "out", "changelog": True},  # every epoch's rows too: checked exactly once
        parallelism=2,
        max_parallelism=16,
        checkpoint={"every_epochs": 1, "retained": 2},
        **fields,
    )


def with_vips(rows: DataFrame, tables: Mapping[str, DataFrame]) -> DataFrame:
    """Each event flagged ``vip`` from the static table ``vips`` (a user column)."""
    vips = tables["vips"].select("user", F.lit(True).alias("vip"))
    return rows.join(vips, "user", "left").fillna({"vip": False})


def build_with_vips() -> Pipeline:
    """:func:`build` with a static table joined by its Python transform."""
    pipeline = build()
    return Pipeline(
        job=JOB,
        source=pipeline.spec.source,
        key="user",
        transform=with_vips,
        tables={"vips": {"format": "parquet", "path": "vips.parquet"}},
        stage=AggregationStage(AggregationPlan(["user"], AGGREGATIONS)),
        sink="out",
    )
