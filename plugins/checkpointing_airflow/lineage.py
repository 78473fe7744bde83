"""Lineage of a pipeline's tries: its OpenLineage datasets and checkpoint facet (through the
OpenLineage provider, which calls the operator's ``get_openlineage_facets_on_*``), and the
Airflow Asset of its sink, the pipeline task's outlet, for data-aware scheduling downstream.

Datasets follow OpenLineage's naming: a local path is namespace ``file``, an S3 prefix namespace
``s3://bucket`` with the key prefix as name (a source's glob is cut at its directory); an Iceberg
table is named by its location, with ``namespace.table`` in its ``symlinks`` facet. The run
facet ``checkpointing`` carries what the try restored and checkpointed
(:class:`CheckpointRunFacet`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attr
from openlineage.client.generated.base import InputDataset, OutputDataset, RunFacet

from checkpointing.coordination.events import CheckpointCompleted, CheckpointEvent, Restored

if TYPE_CHECKING:
    from airflow.providers.openlineage.extractors import OperatorLineage
    from airflow.sdk import Asset

    from checkpointing.pipeline.spec import PipelineSpec

#: the producer named in the facet
PRODUCER = "https://github.com/airflow-spark-checkpointing/checkpointing_airflow"
_GLOB = re.compile(r"[*?\[{]")


@attr.define
class CheckpointRunFacet(RunFacet):
    """What a try of a checkpointed pipeline restored and checkpointed."""

    attempt: str
    parallelism: int | None = attr.field(default=None)
    restoredCheckpointId: int | None = attr.field(default=None)
    restoredPath: str | None = attr.field(default=None)
    skippedCheckpoints: list[int] = attr.field(factory=list)
    rescaledFrom: int | None = attr.field(default=None)
    epochsRedone: int | None = attr.field(default=None)
    epochsDone: int | None = attr.field(default=None)
    checkpoints: list[int] = attr.field(factory=list)
    lastCheckpointId: int | None = attr.field(default=None)
    lastCheckpointLocation: str | None = attr.field(default=None)

    @staticmethod
    def _get_schema() -> str:
        return f"{PRODUCER}/docs/operations.md#lineage"


class TryLineage:
    """A checkpoint-event listener that keeps what the try's facet reports (the operator's
    tracker feeds it; the OpenLineage listener reads it when the try ends)."""

    def __init__(self, attempt: str) -> None:
        self.attempt = attempt
        self.restored: Restored | None = None
        self.completed: list[CheckpointCompleted] = []

    def on_event(self, event: CheckpointEvent) -> None:
        if isinstance(event, Restored):
            self.restored = event
        elif isinstance(event, CheckpointCompleted) and not event.is_savepoint:
            self.completed.append(event)

    def facet(self) -> CheckpointRunFacet:
        restored, last = self.restored, (self.completed[-1] if self.completed else None)
        return CheckpointRunFacet(
            attempt=self.attempt,
            parallelism=restored.parallelism if restored else None,
            restoredCheckpointId=restored.checkpoint_id if restored else None,
            restoredPath=restored.external_path if restored else None,
            skippedCheckpoints=[c for c, _ in restored.skipped] if restored else [],
            rescaledFrom=restored.previous_parallelism if restored and restored.rescaled else None,
            epochsRedone=restored.epochs_redone if restored else None,
            epochsDone=last.epochs_done if last else restored.epochs_done if restored else None,
            checkpoints=[c.checkpoint_id for c in self.completed],
            lastCheckpointId=last.checkpoint_id if last else None,
            lastCheckpointLocation=last.location if last else None,
            producer=PRODUCER,
        )


def _prefix(path: str) -> str:
    """A source path without its glob: the directory the files are listed from."""
    match = _GLOB.search(path)
    if match is None:
        return path.rstrip("/")
    return path[: match.start()].rsplit("/", 1)[0] or "/"


def dataset_name(location: str) -> tuple[str, str]:
    """OpenLineage's (namespace, name) of a path or URL."""
    if location.startswith(("s3://", "s3a://", "gs://", "abfss://")):
        scheme, rest = location.split("://", 1)
        bucket, _, key = rest.partition("/")
        return f"{'s3' if scheme == 's3a' else scheme}://{bucket}", key.strip("/") or "/"
    if location.startswith("file://"):
        location = location.removeprefix("file://")
    return "file", str(Path(location))


def input_datasets(spec: PipelineSpec) -> list[InputDataset]:
    """The source (its files' directory or prefix) and every static table."""
    paths = [spec.resolve(spec.source.path), *(spec.resolve(t.path) for t in spec.tables.values())]
    seen: dict[tuple[str, str], None] = {}
    for path in paths:
        seen.setdefault(dataset_name(_prefix(path)), None)
    return [InputDataset(namespace=ns, name=name) for ns, name in seen]


def sink_location(spec: PipelineSpec) -> str:
    """Where the sink is: the Parquet or Delta directory, or the Iceberg table's location."""
    if spec.sink.format == "iceberg":
        return spec.final_location()
    return spec.resolve(spec.sink.path).rstrip("/")


def output_dataset(spec: PipelineSpec) -> OutputDataset:
    """The sink by its location (as OpenLineage's Spark integration names tables); an Iceberg
    table also by its name, a ``symlinks`` facet of type TABLE."""
    namespace, name = dataset_name(sink_location(spec))
    if spec.sink.format != "iceberg" or not spec.sink.table:
        return OutputDataset(namespace=namespace, name=name)
    from openlineage.client.generated.symlinks_dataset import Identifier, SymlinksDatasetFacet

    warehouse, _ = dataset_name(spec.resolve(spec.sink.path))
    table = Identifier(namespace=warehouse, name=spec.sink.table, type="TABLE")
    return OutputDataset(
        namespace=namespace, name=name, facets={"symlinks": SymlinksDatasetFacet([table])}
    )


def sink_asset(spec: PipelineSpec) -> Asset:
    """The sink as an Airflow Asset: named by its URI (``file:///...``, ``s3://...``) so a DAG
    scheduled on ``Asset("<uri>")`` runs after each successful run of the pipeline."""
    from airflow.sdk import Asset

    location = sink_location(spec)
    uri = location if "://" in location else Path(location).as_uri()
    return Asset(uri, extra={"pipeline": spec.job, "format": spec.sink.format})


def operator_lineage(spec: PipelineSpec, facet: CheckpointRunFacet | None = None) -> Any:
    """The OpenLineage provider's ``OperatorLineage`` of a try."""
    from airflow.providers.openlineage.extractors import OperatorLineage

    lineage: OperatorLineage = OperatorLineage(
        inputs=input_datasets(spec), outputs=[output_dataset(spec)]
    )
    if facet is not None:
        lineage.run_facets["checkpointing"] = facet
    return lineage


def lineage_parent(op: Any, context: Any) -> dict[str, Any]:
    """``op.conf`` with OpenLineage's parent-job properties (``spark.openlineage.parentRunId``
    and its kin) when the provider's ``openlineage_inject_parent_job_info`` (or ``[openlineage]
    spark_inject_parent_job_info``) asks for them: the Spark application's own lineage events
    (OpenLineage's Spark listener, which sees a script's inputs and outputs) then name this
    try's run as their parent. The provider injects them in ``execute``, after our hook was
    built; so here, before. Its transport injection is not done: a transport's settings may hold
    credentials, which never go on spark-submit's command line (configure the listener's
    transport on the cluster)."""
    conf = dict(op.conf or {})
    if not getattr(op, "_openlineage_inject_parent_job_info", False):
        return conf
    # the provider's own import (a no-op without the OpenLineage provider)
    from airflow.providers.common.compat.openlineage.utils.spark import (
        inject_parent_job_information_into_spark_properties,
    )

    try:
        return inject_parent_job_information_into_spark_properties(conf, context)
    except Exception as exc:  # lineage never fails the try
        op.log.warning("OpenLineage parent-job properties not injected: %s", exc)
        return conf
