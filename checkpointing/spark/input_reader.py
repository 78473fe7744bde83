"""Reading an epoch's input splits: whole files through Spark's own reader, row-group ranges of
big Parquet files through Arrow on the executors, anything on an object store through Arrow on
the executors (no Hadoop filesystem needed). The first read fixes the input's schema for every
later one, so an epoch can never change it silently."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

from checkpointing.errors import CheckpointingError
from checkpointing.pipeline.spec import PipelineSpec
from checkpointing.pipeline.splits import InputSplit
from checkpointing.spark.executor import read_row_groups
from checkpointing.spark.object_source import object_schema, read_object_splits
from checkpointing.state.object_store import is_object_url


class InputReader:
    """The source's reader for one run; ``schema`` is the input's, fixed by the first read."""

    def __init__(self, spark: SparkSession, spec: PipelineSpec) -> None:
        self.spark = spark
        self.spec = spec
        self.schema: T.StructType | None = None

    def read(self, splits: Sequence[InputSplit]) -> DataFrame:
        """The rows of ``splits`` (not yet transformed)."""
        if is_object_url(splits[0].path):
            schema = self.schema or object_schema(splits[0])
            return self._checked(read_object_splits(self.spark, splits, schema))
        whole = [s.path for s in splits if s.row_groups is None]
        ranged = [s for s in splits if s.row_groups is not None]
        reader = self.spark.read.format(self.spec.source.format.value)
        if self.spec.source.format.value == "csv":
            reader = reader.options(header=self.spec.source.header, inferSchema=True)
            reader = reader.option("mode", "FAILFAST")
        if self.schema is None and not whole:
            self.schema = self._checked(reader.load(ranged[0].path)).schema
        if self.schema is not None:
            reader = reader.schema(self.schema)
        parts = [self._checked(reader.load(whole))] if whole else []
        if ranged:
            assert self.schema is not None
            tasks = self.spark.createDataFrame(
                [(s.path, *s.row_groups) for s in ranged if s.row_groups is not None],
                "path string, start int, end int",
            ).repartition(len(ranged))
            parts.append(tasks.mapInArrow(partial(read_row_groups, self.schema), self.schema))
        df = parts[0]
        for part in parts[1:]:
            df = df.unionByName(part)
        return df

    def _checked(self, df: DataFrame) -> DataFrame:
        if self.schema is None:
            self.schema = df.schema
        return df


class InputError(CheckpointingError):
    """An epoch's input could not be read or processed (names the epoch, files and reason);
    nothing of that epoch was staged or checkpointed."""


def spark_reason(exc: BaseException) -> str:
    """The useful lines of a Spark/Py4J error: its message and each cause's, not the JVM stack
    (e.g. failed reading FILE; caused by: malformed record [..]; caused by: For input string)."""
    lines = [ln.strip().removeprefix(": ") for ln in str(exc).splitlines() if ln.strip()]
    main = next(
        (ln for ln in lines if ln.startswith("org.apache.spark.") or ln.startswith("[")),
        lines[0] if lines else type(exc).__name__,
    )
    causes = [ln.removeprefix("Caused by: ") for ln in lines if ln.startswith("Caused by: ")]
    return "; caused by: ".join(part[:1000] for part in dict.fromkeys([main, *causes]))
