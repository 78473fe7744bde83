"""``ckpt run``: a pipeline spec on Spark (:class:`checkpointing.spark.runtime.PipelineRun`),
checked before Spark starts, with a progress bar (or a line per epoch in logs)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from checkpointing.cli.common import (
    EXIT_ERROR,
    handles_errors,
    out,
    print_error,
    real_console,
    state,
)
from checkpointing.errors import CheckpointingError, ConfigError

if TYPE_CHECKING:
    from rich.progress import Progress

    from checkpointing.metastore.engine import Metastore
    from checkpointing.pipeline.spec import PipelineSpec
    from checkpointing.spark.preflight import RunOptions
    from checkpointing.state.storage import CheckpointStorage


@handles_errors
def run(
    pipeline: Annotated[
        Path,
        typer.Argument(
            help="The pipeline spec (YAML). It may name Python code: pipeline: my_pkg.jobs:build "
            "(a function returning a Pipeline) or transform: my_pkg.jobs:clean, imported from "
            "the installed packages and the spec's py_files before Spark starts."
        ),
    ],
    restore: Annotated[
        str, typer.Option(help="latest (resume when there are checkpoints), none, an id, a path")
    ] = "latest",
    parallelism: Annotated[
        int | None,
        typer.Option(min=1, metavar="N", help="Override the spec's parallelism (rescale)."),
    ] = None,
    master: Annotated[
        str | None,
        typer.Option(help="Spark master URL [default: local[2], or spark-submit's master]"),
    ] = None,
    attempt: Annotated[str | None, typer.Option(help="Execution attempt id.")] = None,
    coordinator_id: Annotated[
        str | None,
        typer.Option(hidden=True, help="Act as this coordinator (set by the Airflow operator)."),
    ] = None,
    allow_non_restored_state: Annotated[
        bool,
        typer.Option(
            "--allow-non-restored-state",
            help="Restore even if the checkpoint has state of operators no longer here.",
        ),
    ] = False,
    allow_other_job: Annotated[
        bool,
        typer.Option(
            "--allow-other-job",
            help="Let --restore be a checkpoint or savepoint path of another job.",
        ),
    ] = False,
    allow_changed_tables: Annotated[
        bool,
        typer.Option(
            "--allow-changed-tables",
            help="Restore even if a static table (tables:) changed since the checkpoint; the "
            "change is recorded in the restore.",
        ),
    ] = False,
    interval_start: Annotated[
        str | None,
        typer.Option(
            metavar="ISO",
            help="A scope: interval spec's data interval start (2026-11-25 or an ISO 8601 "
            "time; no offset: UTC): the run is that interval's own job instance.",
        ),
    ] = None,
    interval_end: Annotated[
        str | None,
        typer.Option(metavar="ISO", help="The data interval's end (exclusive)."),
    ] = None,
    full_refresh: Annotated[
        bool,
        typer.Option(
            "--full-refresh",
            help="A scope: interval job: replace the interval's output — its sink reset (only "
            "the job's own output), then an empty start.",
        ),
    ] = False,
    refresh_token: Annotated[
        str | None,
        typer.Option(
            hidden=True,
            help="The full refresh's identity across tries (set by the Airflow operator): a try "
            "of a refresh already begun resumes it.",
        ),
    ] = None,
    fail_after_epochs: Annotated[
        int | None,
        typer.Option(
            min=1, hidden=True, help="Failure drill: crash after this many epochs of this run."
        ),
    ] = None,
) -> None:
    """Run a pipeline: epochs with checkpoints, resuming from the latest checkpoint.

    A spec with pipeline: module.path:build runs the Pipeline that function returns, with the
    spec's deployment fields; an entry point that does not import, or returns no Pipeline, is
    refused before Spark starts."""
    from checkpointing.ids import validate_id
    from checkpointing.metastore.jobs import storage_url_for_run
    from checkpointing.pipeline.interval import DataInterval
    from checkpointing.pipeline.spec import load_spec
    from checkpointing.state.storage import CheckpointStorage

    interval = None
    if (interval_start is None) != (interval_end is None):
        given = "--interval-start" if interval_end is None else "--interval-end"
        raise ConfigError(f"{given}: give the data interval's start and end together")
    if interval_start is not None and interval_end is not None:
        interval = DataInterval.parse(interval_start, interval_end)
    spec = load_spec(pipeline, interval=interval)
    spec.check_runnable()
    for value, name in ((attempt, "attempt"), (coordinator_id, "coordinator id")):
        if value is not None:
            validate_id(value, name)
    if parallelism is not None and parallelism > spec.max_parallelism:
        raise ConfigError(
            f"--parallelism {parallelism} exceeds max_parallelism {spec.max_parallelism} of "
            f"{pipeline}"
        )
    storage = CheckpointStorage.from_url(
        storage_url_for_run(state.storage_url, spec, state.settings)
    )
    from checkpointing.spark.preflight import RunOptions

    options = RunOptions(
        restore=restore,
        parallelism=parallelism,
        attempt=attempt,
        coordinator_id=coordinator_id,
        allow_non_restored_state=allow_non_restored_state,
        allow_other_job=allow_other_job,
        allow_changed_tables=allow_changed_tables,
        crash_after_epochs=fail_after_epochs,
        full_refresh=full_refresh,
        refresh_token=refresh_token,
    )
    metastore = _checked_metastore(spec, options, storage)
    result = _run_on_spark(spec, options, metastore, storage, master)
    source = (
        f"restored from checkpoint {result.restored_from}"
        if result.restored_from is not None
        else "started empty"
    )
    if result.stopped_with_savepoint:
        out.print(
            f"job {spec.job} stopped with savepoint {result.checkpoints[-1]} after "
            f"{len(result.epochs_run)} of {result.epochs_total} epochs ({source}); resume with "
            f"`ckpt run {pipeline} --restore {result.stopped_with_savepoint}`",
            soft_wrap=True,
        )
        return
    final = result.final_path
    if spec.sink.format == "iceberg":
        final = f"{spec.sink.table} (Iceberg, at {final})"
    out.print(
        f"job {spec.job} finished: {len(result.epochs_run)} of {result.epochs_total} epochs run "
        f"({source}); checkpoints {result.checkpoints}; final table {final}",
        soft_wrap=True,
    )


def _checked_metastore(
    spec: PipelineSpec, options: RunOptions, storage: CheckpointStorage
) -> Metastore:
    """Everything checked before Spark starts and before anything is written; then the
    metastore to run with. The embedded default metastore is created on a first run, a
    user-supplied one needs ``ckpt db upgrade``."""
    from checkpointing.spark.preflight import RestoreSourceError, check_run

    settings = state.settings
    metastore = state.metastore(check_schema=not settings.embedded_metastore, create=False)
    schema = metastore.current_revision()
    if schema is not None:  # an older embedded schema is migrated by `ckpt db upgrade` only
        metastore.check_schema()
    try:
        check_run(spec, options, storage, metastore if schema is not None else None)
    except RestoreSourceError as exc:  # "restore 'x': why" names the option
        raise ConfigError(f"--{exc}") from None
    if schema is None:
        metastore.dispose()
        metastore = state.metastore(check_schema=False)
        metastore.upgrade()
    return metastore


def _run_on_spark(
    spec: PipelineSpec,
    options: RunOptions,
    metastore: Metastore,
    storage: CheckpointStorage,
    master: str | None,
) -> Any:
    """The run, with its progress shown; a Spark error is one line here (details in the log)."""
    from checkpointing.spark.pipeline import run_spec
    from checkpointing.spark.session import spark_session, stop_session

    spark = spark_session(f"ckpt-{spec.job}", master)
    progress, on_epoch, holder = _progress(spec)
    try:
        with progress:
            return run_spec(
                spec,
                spark,
                metastore,
                storage,
                options,
                on_epoch=on_epoch,
                on_start=lambda run: holder.__setitem__("run", run),
            )
    except CheckpointingError:
        raise
    except Exception as exc:  # Spark errors: one line here, the details are in the log
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print_error(f"job {spec.job} failed: {first}")
        raise typer.Exit(EXIT_ERROR) from None
    finally:
        stop_session(spark)  # not a JVM that is gone: that would hide why it went


def _progress(spec: PipelineSpec) -> tuple[Progress, Any, dict[str, Any]]:
    """A progress bar on a terminal, a line per epoch otherwise; the epoch callback updates it
    from the run (put in the returned holder as ``"run"``)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    interactive = out.is_terminal
    progress = Progress(
        TextColumn(spec.job, style="bold", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "epochs  {task.fields[rate]}  last checkpoint {task.fields[checkpoint]}", markup=False
        ),
        console=real_console(out),
        disable=not interactive,
    )
    task = progress.add_task("epochs", total=None, rate="-", checkpoint="-")
    holder: dict[str, Any] = {}

    def on_epoch(epoch: int, millis: int) -> None:
        run = holder["run"]
        done = run.next_epoch
        last = run.result.checkpoints[-1] if run.result.checkpoints else "-"
        rows = run.last_epoch_rows
        rate = f"{rows / max(millis, 1) * 1000:,.0f} rows/s" if rows is not None else "-"
        progress.update(
            task, total=run.result.epochs_total, completed=done,
            rate=f"{rate}, {millis / 1000:.1f} s/epoch", checkpoint=last,
        )  # fmt: skip
        if not interactive:
            out.print(
                f"job {spec.job}: epoch {epoch + 1}/{run.result.epochs_total} done in "
                f"{millis} ms ({rate}); last completed checkpoint {last}"
            )

    return progress, on_epoch, holder
