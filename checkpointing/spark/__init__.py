"""Spark glue: the runtime that runs checkpointed jobs on PySpark. The only part of the project
that imports pyspark (the core in ``checkpointing`` never does).

The Python API is importable from here: ``from checkpointing.spark import Pipeline, ArrowStage,
AggregationStage``. Its names load on first use, so that a Python worker importing
:mod:`checkpointing.spark.executor` does not load the runtime, the coordinator and SQLAlchemy.

Modules: ``pipeline`` (the Python API's :class:`Pipeline`), ``stages`` (the keyed stage
protocol and its two kinds), ``runtime`` (:class:`PipelineRun`: epochs, barriers, completion),
``run_restore`` (what a run restores), ``state`` (operator state on the driver: snapshot acks,
restored state), ``async_snapshot`` (the snapshot written while the next epoch runs),
``preflight`` (:class:`RunOptions` and the checks before Spark starts), ``session`` (the Spark
session), ``executor`` and ``executor_env`` (what runs on executors), ``transform`` (the
per-epoch transform and static tables), ``object_source`` (input on an object store),
``sinks``, ``parquet_sink``, ``s3_parquet_sink``, ``table_sink``, ``delta_sink`` and
``iceberg_sink`` (the two-phase-commit sinks), ``aggregations``, ``partials`` and ``keys``.
What ``spark-submit`` runs is the CLI's (:mod:`checkpointing.cli.spark_app`): this package
never imports the CLI.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from checkpointing.spark.pipeline import Pipeline
    from checkpointing.spark.stages import AggregationStage, ArrowStage

__all__ = ["AggregationStage", "ArrowStage", "Pipeline"]

_HOMES = {
    "Pipeline": "checkpointing.spark.pipeline",
    "AggregationStage": "checkpointing.spark.stages",
    "ArrowStage": "checkpointing.spark.stages",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
