"""What ``ckpt run`` checks before Spark starts, shared with ``ckpt validate`` so that the two
can never disagree: the spec (fields, paths, entry points), the run's options, the input
globs, the sink's ownership and the restore source, through :func:`load_spec` and
:func:`checkpointing.spark.preflight.check_run`. Reads only: nothing is written, not even
the embedded metastore's file. Also the options the two commands share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from checkpointing.cli.common import state
from checkpointing.errors import ConfigError, SpecError

if TYPE_CHECKING:
    from checkpointing.metastore.engine import Metastore
    from checkpointing.pipeline.interval import DataInterval
    from checkpointing.pipeline.spec import PipelineSpec
    from checkpointing.spark.preflight import RunOptions
    from checkpointing.state.storage import CheckpointStorage

# ------------------------------------------------------------------ options of run and validate

RestoreOption = Annotated[
    str,
    typer.Option(
        metavar="SOURCE",
        help="latest (resume when there are checkpoints), none, a checkpoint id, or a "
        "checkpoint or savepoint path.",
    ),
]
ParallelismOption = Annotated[
    int | None,
    typer.Option(min=1, metavar="N", help="Override the spec's parallelism (rescale)."),
]
AllowOtherJobOption = Annotated[
    bool,
    typer.Option(
        "--allow-other-job",
        help="Let --restore be a checkpoint or savepoint path of another job.",
    ),
]
AllowChangedTablesOption = Annotated[
    bool,
    typer.Option(
        "--allow-changed-tables",
        help="Restore even if a static table (tables:) changed since the checkpoint; the "
        "change is recorded in the restore.",
    ),
]
IntervalStartOption = Annotated[
    str | None,
    typer.Option(
        metavar="ISO",
        help="A scope: interval spec's data interval start (2026-11-25 or an ISO 8601 time; "
        "no offset: UTC): the run is that interval's own job instance.",
    ),
]
IntervalEndOption = Annotated[
    str | None, typer.Option(metavar="ISO", help="The data interval's end (exclusive).")
]
FullRefreshOption = Annotated[
    bool,
    typer.Option(
        "--full-refresh",
        help="A scope: interval job: replace the interval's output — its sink reset (only "
        "the job's own output), then an empty start.",
    ),
]


def data_interval(start: str | None, end: str | None) -> DataInterval | None:
    """``--interval-start``/``--interval-end`` as a :class:`DataInterval` (None: neither)."""
    from checkpointing.pipeline.interval import DataInterval

    if (start is None) != (end is None):
        given = "--interval-start" if end is None else "--interval-end"
        raise ConfigError(f"{given}: give the data interval's start and end together")
    if start is None or end is None:
        return None
    return DataInterval.parse(start, end)


# --------------------------------------------------------------------------------- the checks


@dataclass
class Checked:
    """A run that passed every check: its spec and storage, and the metastore it read (open;
    ``has_schema`` False: an embedded one not created yet, which a run creates)."""

    spec: PipelineSpec
    storage: CheckpointStorage
    metastore: Metastore
    has_schema: bool


def check_before_spark(
    pipeline: Path, options: RunOptions, interval: DataInterval | None
) -> Checked:
    """Every check of a run before Spark starts and before anything is written; raises a
    :class:`~checkpointing.errors.CheckpointingError` naming the spec file, the field or the
    option. The embedded default metastore is read if it exists and never created here; a
    metastore the user names must have its schema (``ckpt db upgrade``)."""
    from checkpointing.ids import validate_id
    from checkpointing.metastore.jobs import storage_url_for_run
    from checkpointing.pipeline.spec import load_spec
    from checkpointing.spark.preflight import RestoreSourceError, check_run
    from checkpointing.state.storage import CheckpointStorage

    spec = load_spec(pipeline, interval=interval)
    spec.check_runnable()
    for value, name in ((options.attempt, "attempt"), (options.coordinator_id, "coordinator id")):
        if value is not None:
            validate_id(value, name)
    if options.parallelism is not None and options.parallelism > spec.max_parallelism:
        raise ConfigError(
            f"--parallelism {options.parallelism} exceeds max_parallelism "
            f"{spec.max_parallelism} of {pipeline}"
        )
    storage = CheckpointStorage.from_url(
        storage_url_for_run(state.storage_url, spec, state.settings)
    )
    settings = state.settings
    metastore = state.metastore(check_schema=not settings.embedded_metastore, create=False)
    try:
        schema = metastore.current_revision()
        if schema is not None:  # an older embedded schema is migrated by `ckpt db upgrade`
            metastore.check_schema()
        try:
            check_run(spec, options, storage, metastore if schema is not None else None)
        except RestoreSourceError as exc:  # "restore 'x': why" names the option
            raise ConfigError(f"--{exc}") from None
        except ConfigError as exc:  # "sink.path: …": and the file, as load_spec's errors
            raise SpecError(naming_the_file(pipeline, spec, exc)) from None
    except BaseException:
        metastore.dispose()
        raise
    return Checked(spec, storage, metastore, schema is not None)


def naming_the_file(pipeline: Path, spec: PipelineSpec | None, exc: object) -> str:
    """``exc``'s message, led by the spec file unless it names it already (as
    :func:`~checkpointing.pipeline.spec.load_spec`'s errors do)."""
    message = str(exc)
    names = {str(pipeline), str(spec.spec_path) if spec is not None else str(pipeline)}
    if any(message.startswith(name) for name in names):
        return message
    return f"{pipeline}: {message}"
