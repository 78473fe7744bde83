"""What is decided before a Spark session starts and before anything is written: a run's
:class:`RunOptions`, and :func:`check_run`, which refuses the options, input, sink and restore
source a run could not go through with (reads only; starts no Spark)."""

from __future__ import annotations

import glob
from dataclasses import dataclass

from checkpointing import restore
from checkpointing.errors import (
    CheckpointingError,
    NoCheckpointError,
    UnknownCheckpointError,
    UnknownJobError,
)
from checkpointing.metastore import Metastore
from checkpointing.object_store import ObjectInfo, ObjectStoreError, is_object_url, list_objects
from checkpointing.sink_guard import check_pipeline_sink
from checkpointing.spark.sinks import Sink, open_sink
from checkpointing.spec import PipelineSpec, SpecError
from checkpointing.storage import CheckpointStorage


@dataclass(frozen=True)
class RunOptions:
    """:param restore: ``latest`` (resume if the job has checkpoints), ``none``, a checkpoint id,
        or a savepoint/checkpoint path.
    :param parallelism: override the spec's parallelism (a rescaled restore).
    :param attempt: this execution attempt's id (default: random).
    :param crash_after_epochs: test hook — raise
        :class:`~checkpointing.spark.runtime.SimulatedCrash` after this many epochs
        of this attempt.
    """

    restore: str = "latest"
    parallelism: int | None = None
    attempt: str | None = None
    crash_after_epochs: int | None = None
    allow_non_restored_state: bool = False
    #: restore from a checkpoint or savepoint path of another job (refused otherwise)
    allow_other_job: bool = False
    #: the coordinator identity to act under: an Airflow operator passes its own, so the
    #: operator (Flink's JobManager) and this driver are one coordinator of the job
    coordinator_id: str | None = None


def input_files(spec: PipelineSpec) -> list[str] | list[ObjectInfo]:
    """The files the spec's source glob matches, sorted (on an object store: the objects, with
    their size and ETag, sorted by key); none, or an object store that cannot be listed, is a
    :class:`SpecError`."""
    pattern = spec.resolve(spec.source.path)
    if is_object_url(pattern):
        try:
            objects = list_objects(pattern)
        except ObjectStoreError as exc:
            raise SpecError(f"source.path: {exc}") from None
        if not objects:
            raise SpecError(f"source.path: {pattern!r} matches no objects")
        return objects
    files = sorted(glob.glob(pattern.removeprefix("file://")))
    if not files:
        raise SpecError(f"source.path: {pattern!r} matches no files")
    return files


class RestoreSourceError(CheckpointingError, ValueError):
    """The restore source (``--restore``) cannot be restored from."""


def check_run(
    spec: PipelineSpec,
    options: RunOptions,
    storage: CheckpointStorage,
    metastore: Metastore | None,
) -> None:
    """Refuse what can be refused before a Spark session starts and before anything is written
    (the job is not registered, no restore is recorded): the parallelism, the input files, the
    sink path, and the restore source. Reads only; ``metastore`` None: there is none yet (so no
    checkpoint to restore by id). :class:`RestoreSourceError` names a bad ``restore``."""
    parallelism = options.parallelism or spec.parallelism
    if parallelism > spec.max_parallelism:
        raise SpecError(f"parallelism {parallelism} exceeds max_parallelism {spec.max_parallelism}")
    input_files(spec)
    check_pipeline_sink(spec, storage.base_url)  # not the input, the storage, ~, / ...
    sink = open_sink(spec, job=spec.job)  # nor foreign files
    choice = options.restore
    try:
        if choice == "none":
            refuse_empty_start(sink, spec.job, choice)
        elif choice == "latest":
            if metastore is None or not _has_restorable_checkpoint(metastore, storage, spec.job):
                refuse_empty_start(sink, spec.job, choice)
        elif choice.isdigit():
            if metastore is None:
                raise UnknownCheckpointError(f"job {spec.job} has no checkpoint {choice}")
            restore.load_checkpoint(metastore, storage, spec.job, int(choice), deep=False)
        else:
            restore.load_external(
                storage,
                choice,
                deep=False,
                job_id=spec.job,
                allow_other_job=options.allow_other_job,
            )
    except (CheckpointingError, ValueError) as exc:
        if isinstance(exc, SpecError):
            raise
        raise RestoreSourceError(f"restore {choice!r}: {exc}") from None


def refuse_empty_start(sink: Sink, job: str, choice: str) -> None:
    """A run that would start empty (``--restore none``, or ``latest`` finding no checkpoint)
    must not write over committed output: it would recompute every epoch from the first, leaving
    the earlier run's epochs in the changelog beside the new ones (data that no checkpoint
    covers). :class:`SpecError` naming the sink and the ways out."""
    committed = sink.committed_epochs()
    if not committed:
        return
    held = f"committed epochs {committed[0]} to {committed[-1]} of an earlier run"
    if choice == "none":
        raise SpecError(
            f"sink.path: {sink.path} holds {held}; use --restore latest to resume it, "
            "or a new sink path"
        )
    raise SpecError(
        f"sink.path: {sink.path} holds {held}, and job {job} has no checkpoint to resume from "
        "(a finished job's checkpoints are discarded): restore a savepoint (--restore PATH) or "
        "use a new sink path; starting empty would recompute the output over it"
    )


def _has_restorable_checkpoint(metastore: Metastore, storage: CheckpointStorage, job: str) -> bool:
    """Whether ``--restore latest`` finds a checkpoint or savepoint (sizes checked, read only)."""
    try:
        restore.find_latest_valid(metastore, storage, job, deep=False, strict=True)
    except (UnknownJobError, NoCheckpointError):
        return False
    return True
