"""Reading an epoch's splits from an object store: every split (whole object or run of row
groups) is read by Arrow on an executor, never by Spark's file reader, which would need the
cluster's Hadoop filesystem for the scheme (hadoop-aws and its jars for ``s3a://``)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T
from pyspark.sql.pandas.types import from_arrow_schema

from checkpointing.pipeline.splits import InputSplit
from checkpointing.spark.executor import read_row_groups
from checkpointing.state.object_store import read_schema


def object_schema(split: InputSplit) -> T.StructType:
    """The input schema from the split's Parquet footer, every column nullable: what Spark's
    Parquet reader gives for the same file (so state schemas match a local run's)."""
    schema = from_arrow_schema(read_schema(split.path))
    return T.StructType([T.StructField(f.name, f.dataType, True) for f in schema.fields])


def read_object_splits(
    spark: SparkSession, splits: Sequence[InputSplit], schema: T.StructType
) -> DataFrame:
    """The rows of ``splits``, one Spark task per split, read on the executors as ``schema``."""
    tasks = spark.createDataFrame(
        [(s.path, *(s.row_groups if s.row_groups is not None else (None, None))) for s in splits],
        "path string, start int, end int",
    ).repartition(len(splits))
    return tasks.mapInArrow(partial(read_row_groups, schema), schema)
