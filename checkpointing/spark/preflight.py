"""What is decided before a Spark session starts and before anything is written: a run's
:class:`RunOptions`, and :func:`check_run`, which refuses the options, input, sink and restore
source a run could not go through with (reads only; starts no Spark)."""

from __future__ import annotations

import glob
from dataclasses import dataclass

from checkpointing.errors import (
    CheckpointingError,
    NoCheckpointError,
    UnknownCheckpointError,
    UnknownJobError,
)
from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline.interval import Scope
from checkpointing.pipeline.operator_ids import SOURCE
from checkpointing.pipeline.spec import PipelineSpec, SpecError
from checkpointing.pipeline.splits import has_progress, resume
from checkpointing.pipeline.tables import check_tables, table_files, table_items
from checkpointing.restore import lookup as restore
from checkpointing.sinks.guard import check_pipeline_sink
from checkpointing.sinks.protocol import Sink
from checkpointing.spark.sinks import open_sink
from checkpointing.state.metadata import CheckpointMetadata
from checkpointing.state.object_store import (
    ObjectInfo,
    ObjectStoreError,
    is_object_url,
    list_objects,
)
from checkpointing.state.storage import CheckpointStorage


@dataclass(frozen=True)
class RunOptions:
    """:param restore: ``latest`` (resume if the job has checkpoints), ``none``, a checkpoint id,
        or a savepoint/checkpoint path.
    :param parallelism: override the spec's parallelism (a rescaled restore).
    :param attempt: this execution attempt's id (default: random).
    :param crash_after_epochs: test hook — raise
        :class:`~checkpointing.spark.runtime.SimulatedCrash` after this many epochs
        of this attempt.
    :param fail_task_after_epochs: test hook — after this many epochs of this attempt, the next
        epoch's Spark job fails in a task (a real task failure: the driver stays alive).
    """

    restore: str = "latest"
    parallelism: int | None = None
    attempt: str | None = None
    crash_after_epochs: int | None = None
    fail_task_after_epochs: int | None = None
    allow_non_restored_state: bool = False
    #: restore from a checkpoint or savepoint path of another job (refused otherwise)
    allow_other_job: bool = False
    #: the coordinator identity to act under: an Airflow operator passes its own, so the
    #: operator (Flink's JobManager) and this driver are one coordinator of the job
    coordinator_id: str | None = None
    #: restore even if a static table changed since the checkpoint (recorded in the restore)
    allow_changed_tables: bool = False
    #: a ``scope: interval`` job's full refresh: its sink reset (:meth:`Sink.reset`), then an
    #: empty start that writes the interval's output again
    full_refresh: bool = False
    #: the refresh's identity across tries (the Airflow DAG run): a try of a refresh this token
    #: already began resumes it from its own latest checkpoint instead of resetting again
    refresh_token: str | None = None


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
    spec.check_runnable()  # an interval spec's template is not a job
    parallelism = options.parallelism or spec.parallelism
    if parallelism > spec.max_parallelism:
        raise SpecError(f"parallelism {parallelism} exceeds max_parallelism {spec.max_parallelism}")
    files = input_files(spec)
    tables = table_items(table_files(spec))  # every table's glob matches files
    check_pipeline_sink(spec, storage.base_url)  # not the input, the storage, ~, / ...
    sink = open_sink(spec, job=spec.job)  # nor foreign files
    choice = options.restore
    decision: restore.RestoreDecision | None = None
    if options.full_refresh:
        check_full_refresh(spec, choice)
        return  # its sink is reset and it starts empty: nothing to restore or to check
    try:
        if choice == "none":
            refuse_empty_start(sink, spec.job, choice)
        elif choice == "latest":
            decision = None if metastore is None else _latest(metastore, storage, spec.job)
            if decision is None:
                refuse_empty_start(sink, spec.job, choice)
        elif choice.isdigit():
            if metastore is None:
                raise UnknownCheckpointError(f"job {spec.job} has no checkpoint {choice}")
            decision = restore.load_checkpoint(
                metastore, storage, spec.job, int(choice), deep=False
            )
        else:
            decision = restore.load_external(
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
    if decision is not None and decision.metadata is not None:
        check_input(spec, files, decision.metadata)
        recorded = decision.metadata.list_items(SOURCE)
        check_tables(
            recorded,
            tables,
            decision.metadata.checkpoint_id,
            allow_changed=options.allow_changed_tables,
        )


def check_input(
    spec: PipelineSpec, files: list[str] | list[ObjectInfo], metadata: CheckpointMetadata
) -> None:
    """The input the checkpoint read or still has to read is as the source's
    ``on_changed_input`` wants it (a changed file, or a partly read one gone, is a
    :class:`~checkpointing.pipeline.splits.SplitError` naming it; a file read and gone since is
    forgotten); new files are fine: they are the next epochs. A checkpoint without processed
    splits is checked by the runtime, as before."""
    items = metadata.list_items(SOURCE)
    if has_progress(items):
        source = spec.source
        resume(
            items,
            files,
            source.format.value,
            source.max_split_bytes,
            source.splits_per_epoch,
            metadata.checkpoint_id,
            source.epoch_bytes,
            source.on_changed_input.value,
            source.max_file_age,
        )


def check_full_refresh(spec: PipelineSpec, choice: str) -> None:
    """A full refresh replaces one interval's output: only a ``scope: interval`` job has one
    (an incremental job's output is every run's), and it starts empty."""
    if spec.scope is not Scope.INTERVAL:
        raise SpecError(
            f"--full-refresh: job {spec.job} is scope: incremental, whose output holds every "
            "run's input; a full refresh is for a scope: interval job's interval (for this one: "
            "a new sink path, or --restore a savepoint)"
        )
    if choice not in ("latest", "none"):
        raise SpecError(f"--full-refresh starts empty: it takes no --restore {choice}")


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
        "(none completed, or its checkpoints were discarded): restore a savepoint "
        "(--restore PATH) or use a new sink path; starting empty would recompute the output "
        "over it"
    )


def _latest(
    metastore: Metastore, storage: CheckpointStorage, job: str
) -> restore.RestoreDecision | None:
    """What ``--restore latest`` finds (sizes checked, read only); None: nothing to restore."""
    try:
        return restore.find_latest_valid(metastore, storage, job, deep=False, strict=True)
    except (UnknownJobError, NoCheckpointError):
        return None


#: checkpoints a run takes by default (a spec with neither ``every_epochs`` nor an ``interval``):
#: one every ~10 % of its epochs, so a crash costs at most about a tenth of the run
DEFAULT_CHECKPOINTS = 10


def checkpoint_every(spec: PipelineSpec, epochs: int) -> tuple[int | None, str]:
    """Every how many epochs the run checkpoints, and how that was planned (for its log)."""
    every = spec.checkpoint.every_epochs
    interval = spec.checkpoint.config().periodic_interval
    if every is not None:
        how = f"a checkpoint every {every} epoch(s) (checkpoint.every_epochs)"
    elif interval is not None:
        how = f"a checkpoint every {interval} (checkpoint.interval)"
    else:
        every = max(1, -(-epochs // DEFAULT_CHECKPOINTS))
        how = (
            f"a checkpoint every {every} epoch(s), ~{100 // DEFAULT_CHECKPOINTS} % of the input "
            "(the default: set checkpoint.every_epochs or checkpoint.interval to change it)"
        )
    return every, how + ", and one after the last epoch"
