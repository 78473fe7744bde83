"""The Python API's job: :class:`Pipeline` — source → keyed stage(s), or none → sink, built in
Python rather than a spec file, and run by :class:`~checkpointing.spark.runtime.PipelineRun` like
one.

The stages it takes are :mod:`checkpointing.spark.stages`' (:class:`ArrowStage` for user Arrow
code, :class:`AggregationStage` for declarative aggregations).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from checkpointing.config import describe_validation_error
from checkpointing.errors import ConfigError
from checkpointing.pipeline.entry import (
    EntryPointError,
    PipelineDefinition,
    is_entry_point,
    transform_function,
)
from checkpointing.pipeline.spec import (
    CheckpointSpec,
    PipelineSpec,
    SinkSpec,
    SourceSpec,
    SpecError,
)
from checkpointing.sinks.guard import check_pipeline_sink
from checkpointing.spark.stages import Stage

if TYPE_CHECKING:
    from checkpointing.metastore.engine import Metastore
    from checkpointing.spark.preflight import RunOptions
    from checkpointing.spark.runtime import PipelineRun, RunResult
    from checkpointing.spark.transform import TransformFn
    from checkpointing.state.storage import CheckpointStorage


class Pipeline(PipelineDefinition):
    """A Python API job — source → keyed ``stage`` (or a chain of ``stages``) → sink — as a
    :class:`PipelineSpec` without aggregations plus the stages, run by the same runtime (and
    checkpoints) as a spec file. With no stage and no key it is stateless: each epoch's rows
    (after ``transform``) are appended to the sink exactly once.

    In a chain, each stage's input in an epoch is the rows the stage before it emitted (its
    ``changed`` rows) in that epoch — an append stream; the sink gets the last stage's. ``key``
    keys the first stage; later ones need their own ``key=`` (state is repartitioned by it).

    ``transform(input, tables) -> DataFrame`` turns each epoch's rows into the first stage's
    input, with ``tables`` (name → spec of a static table, as the spec's ``tables:``) as
    DataFrames read once per attempt; a SQL string works as the spec's ``transform:``. It runs
    on every epoch and again on a replayed one, so it must be deterministic (its plan is
    checked: no ``rand()``, ``uuid()``, ``current_timestamp()``…).

    ``source``, ``sink`` and ``checkpoint`` take what the spec's sections take (``sink`` may be
    just its path); ``fields`` any other spec field (``max_parallelism``, ``storage``, …).

    Deployed as a DAG or run by ``ckpt run``, a spec names the function that builds it
    (``pipeline: my_pkg.jobs:build``, :mod:`checkpointing.pipeline.entry`)."""

    def __init__(
        self,
        *,
        job: str,
        source: Mapping[str, Any] | SourceSpec,
        key: str | Sequence[str] = (),
        sink: str | Mapping[str, Any] | SinkSpec,
        stage: Stage | None = None,
        stages: Sequence[Stage] = (),
        parallelism: int = 2,
        checkpoint: Mapping[str, Any] | CheckpointSpec | None = None,
        transform: TransformFn | str | None = None,
        tables: Mapping[str, Any] | None = None,
        **fields: Any,
    ) -> None:
        if transform is not None and not isinstance(transform, str) and not callable(transform):
            raise TypeError(f"transform: a function or a SQL string, not {transform!r}")
        if is_entry_point(transform):  # "my_pkg.jobs:clean": the function it names
            try:
                transform = transform_function(str(transform).strip(), ())
            except EntryPointError as exc:
                raise SpecError(f"pipeline {job}: transform: {exc}") from None
        self.transform = None if isinstance(transform, str) else transform
        if isinstance(transform, str):
            fields["transform"] = transform
        if stage is not None and stages:
            raise ValueError("give a stage, or a chain of stages (stages=[...]), not both")
        if (stage is not None or stages) and not key:
            raise ValueError("key: the first stage is keyed by it (a stateless job has no stage)")
        if stage is None and not stages and key:
            raise ValueError("key: a keyed job needs a stage (stage=... or stages=[...])")
        try:
            self.spec = PipelineSpec.model_validate(
                {
                    "job": job,
                    "source": source,
                    **({"key": [key] if isinstance(key, str) else list(key)} if key else {}),
                    "sink": {"path": sink} if isinstance(sink, str) else sink,
                    "parallelism": parallelism,
                    "checkpoint": checkpoint if checkpoint is not None else {},
                    "tables": dict(tables or {}),
                    **fields,
                }
            )
        except ValidationError as exc:
            raise SpecError(describe_validation_error(exc, f"pipeline {job}")) from None
        try:  # refused before Spark runs anything (the runtime checks again, with the storage)
            check_pipeline_sink(self.spec)
        except ConfigError as exc:
            raise SpecError(f"pipeline {job}: {exc}") from None
        chain = list(stages) if stages else [stage] if stage is not None else []
        self.stages: list[Stage] = [chain[0].with_key(self.spec.key), *chain[1:]] if chain else []

    def run(
        self,
        spark: Any,
        metastore: Metastore,
        storage: CheckpointStorage,
        options: RunOptions | None = None,
        *,
        on_epoch: Callable[[int, int], None] | None = None,
    ) -> RunResult:
        return run_spec(
            self.spec,
            spark,
            metastore,
            storage,
            options,
            on_epoch=on_epoch,
            stages=self.stages,
            transform=self.transform,
        )


def run_spec(
    spec: PipelineSpec,
    spark: Any,
    metastore: Metastore,
    storage: CheckpointStorage,
    options: RunOptions | None = None,
    *,
    on_epoch: Callable[[int, int], None] | None = None,
    on_start: Callable[[PipelineRun], None] | None = None,
    stages: Sequence[Stage] | None = None,
    transform: TransformFn | None = None,
) -> RunResult:
    """Run ``spec`` with warm restarts (its ``restarts``): what ``ckpt run`` and the Airflow
    operator's driver do. A spec naming Python entry points runs their code (``spec.code``, as
    :func:`~checkpointing.pipeline.spec.load_spec` resolved it: a ``pipeline:``'s stages and
    transform, a ``transform: module:fn``), with its ``py_files`` shipped to the executors;
    ``stages``/``transform`` give them instead (the Python API). ``on_start`` sees each
    attempt's run before it starts."""
    # the runtime (coordinator, SQLAlchemy) loads when a pipeline runs, not where it is
    # declared: a Python worker importing the module of a stage's function needs none of it
    from checkpointing.spark.preflight import RunOptions
    from checkpointing.spark.restarts import run_with_restarts
    from checkpointing.spark.runtime import PipelineRun

    code = spec.code
    if stages is None:
        stages = list(code.stages) if code is not None else []
    if transform is None and code is not None:
        transform = code.transform
    ship_py_files(spark, spec.py_files)

    def start(opts: RunOptions) -> PipelineRun:
        run = PipelineRun(
            spec,
            spark,
            metastore,
            storage,
            opts,
            on_epoch=on_epoch,
            stages=stages,
            transform=transform,
        )
        if on_start is not None:
            on_start(run)
        return run

    return run_with_restarts(
        start, options or RunOptions(), attempts=spec.restarts, delay=spec.restart_delay
    )


def ship_py_files(spark: Any, files: Sequence[str]) -> None:
    """The executors' Python workers import the spec's code too (a stage's function, a UDF):
    ``py_files`` that spark-submit did not ship (``--py-files``) are added to the application
    (``SparkContext.addPyFile``), once per file name."""
    if not files:
        return
    context = spark.sparkContext
    submitted = context.getConf().get("spark.submit.pyFiles", "") or ""
    shipped = {Path(f).name for f in [*submitted.split(","), *context.listFiles] if f}
    for file in files:
        if Path(file).name not in shipped:
            context.addPyFile(file)
