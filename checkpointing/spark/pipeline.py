"""The Python API's job: :class:`Pipeline` — source → keyed stage(s), or none → sink, built in
Python rather than a spec file, and run by :class:`~checkpointing.spark.runtime.PipelineRun` like
one.

The stages it takes are :mod:`checkpointing.spark.stages`' (:class:`ArrowStage` for user Arrow
code, :class:`AggregationStage` for declarative aggregations).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from checkpointing.config import describe_validation_error
from checkpointing.errors import ConfigError
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
    from checkpointing.spark.runtime import RunResult
    from checkpointing.spark.transform import TransformFn
    from checkpointing.state.storage import CheckpointStorage


class Pipeline:
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
    just its path); ``fields`` any other spec field (``max_parallelism``, ``storage``, …)."""

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
        # the runtime (coordinator, SQLAlchemy) loads when a pipeline runs, not where it is
        # declared: a Python worker importing the module of a stage's function needs none of it
        from checkpointing.spark.preflight import RunOptions
        from checkpointing.spark.restarts import run_with_restarts
        from checkpointing.spark.runtime import PipelineRun

        def start(opts: RunOptions) -> PipelineRun:
            return PipelineRun(
                self.spec,
                spark,
                metastore,
                storage,
                opts,
                on_epoch=on_epoch,
                stages=self.stages,
                transform=self.transform,
            )

        return run_with_restarts(
            start,
            options or RunOptions(),
            attempts=self.spec.restarts,
            delay=self.spec.restart_delay,
        )
