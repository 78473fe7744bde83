"""``ckpt run``: a pipeline spec on Spark (:class:`checkpointing.spark.runtime.PipelineRun`),
checked before Spark starts, with a progress bar (or a line per epoch in logs)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from checkpointing.cli.common import (
    EXIT_ERROR,
    AsJson,
    err,
    handles_errors,
    out,
    print_error,
    print_json,
    real_console,
    state,
)
from checkpointing.cli.preflight import (
    AllowChangedTablesOption,
    AllowOtherJobOption,
    FullRefreshOption,
    IntervalEndOption,
    IntervalStartOption,
    ParallelismOption,
    RestoreOption,
    check_before_spark,
    data_interval,
)
from checkpointing.errors import CheckpointingError, ConfigError, InvalidIdError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

    from checkpointing.metastore.engine import Metastore
    from checkpointing.pipeline.spec import PipelineSpec
    from checkpointing.spark.preflight import RunOptions
    from checkpointing.spark.runtime import RunResult
    from checkpointing.state.storage import CheckpointStorage


@handles_errors
def run(
    ctx: typer.Context,
    pipeline: Annotated[
        Path,
        typer.Argument(
            metavar="SPEC",
            help="The pipeline spec (YAML). It may name Python code: pipeline: my_pkg.jobs:build "
            "(a function returning a Pipeline) or transform: my_pkg.jobs:clean, imported from "
            "the installed packages and the spec's py_files before Spark starts. Or a PySpark "
            "script (.py) whose steps are checkpointed, its own arguments after it (after -- "
            "when they start with -).",
        ),
    ],
    restore: RestoreOption = "latest",
    parallelism: ParallelismOption = None,
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
    allow_other_job: AllowOtherJobOption = False,
    allow_changed_tables: AllowChangedTablesOption = False,
    interval_start: IntervalStartOption = None,
    interval_end: IntervalEndOption = None,
    full_refresh: FullRefreshOption = False,
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
    as_json: AsJson = False,
) -> None:
    """Run a pipeline: epochs with checkpoints, resuming from the latest checkpoint.

    Everything `ckpt validate` checks is checked first, before Spark starts and before anything
    is written. A spec with pipeline: module.path:build runs the Pipeline that function
    returns, with the spec's deployment fields. With --json, the run's summary is one JSON
    object on stdout (the epochs' lines go to stderr). A script (SPEC ending in .py) runs as
    python would run it, its checkpointed steps under these settings (docs/steps.md)."""
    if pipeline.suffix == ".py":
        from checkpointing.steps.script import EXIT_REFUSED, is_refusal, run_script

        given = {
            "--parallelism": parallelism is not None,
            "--master": master is not None,
            "--attempt": attempt is not None,
            "--allow-non-restored-state": allow_non_restored_state,
            "--allow-other-job": allow_other_job,
            "--allow-changed-tables": allow_changed_tables,
            "--interval-start": interval_start is not None,
            "--interval-end": interval_end is not None,
            "--full-refresh": full_refresh,
            "--json": as_json,
            "--coordinator-id": coordinator_id is not None,
            "--refresh-token": refresh_token is not None,
            "--fail-after-epochs": fail_after_epochs is not None,
        }
        for flag in (f for f, set_ in given.items() if set_):
            raise typer.BadParameter(
                "applies to a spec; a script sets its own Spark session and options",
                param_hint=flag,
            )
        # the run's progress, as a spec's epochs are: each step reused or computed, and why
        logging.getLogger("checkpointing.spark.steps").setLevel(logging.INFO)
        try:
            code = run_script(pipeline, ctx.args, state.settings, restore=restore)
        except (ConfigError, InvalidIdError) as exc:
            if not is_refusal(exc):  # an object store away: a retry may get past it
                raise
            print_error(exc)  # a retry would be refused the same way
            raise typer.Exit(EXIT_REFUSED) from None
        raise typer.Exit(code)
    if ctx.args:
        raise typer.BadParameter(
            f"unexpected {ctx.args[0]!r}: only a script (.py) takes arguments after it",
            param_hint="SPEC",
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
    checked = check_before_spark(pipeline, options, data_interval(interval_start, interval_end))
    spec, metastore = checked.spec, checked.metastore
    if not checked.has_schema:  # the embedded default, on a first run: created now
        metastore.dispose()
        metastore = state.metastore(check_schema=False)
        metastore.upgrade()
    result = _run_on_spark(spec, options, metastore, checked.storage, master, quiet=as_json)
    if as_json:
        print_json(run_summary(pipeline, spec, result))
        return
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
    out.print(
        f"job {spec.job} finished: {len(result.epochs_run)} of {result.epochs_total} epochs run "
        f"({source}); checkpoints {result.checkpoints}; final table {_final(spec, result)}",
        soft_wrap=True,
    )


def _final(spec: PipelineSpec, result: RunResult) -> str | None:
    if spec.sink.format == "iceberg":
        return f"{spec.sink.table} (Iceberg, at {result.final_path})"
    return result.final_path


def run_summary(pipeline: Path, spec: PipelineSpec, result: RunResult) -> dict[str, Any]:
    """``ckpt run --json``: what the run did, as one JSON object (docs/cli.md)."""
    return {
        "spec": str(pipeline),
        "job": spec.job,
        "status": "STOPPED_WITH_SAVEPOINT" if result.stopped_with_savepoint else "FINISHED",
        "restored_from": result.restored_from,
        "epochs_run": len(result.epochs_run),
        "epochs_total": result.epochs_total,
        "checkpoints": list(result.checkpoints),
        "savepoint": result.stopped_with_savepoint,
        "final": result.final_path,
        "sink_format": spec.sink.format,
        "rows_read": result.rows_read,
        "restarts": result.restarts,
    }


def _run_on_spark(
    spec: PipelineSpec,
    options: RunOptions,
    metastore: Metastore,
    storage: CheckpointStorage,
    master: str | None,
    *,
    quiet: bool = False,
) -> RunResult:
    """The run, with its progress shown (``quiet``: as lines on stderr, stdout left to the
    JSON summary); a Spark error is one line here (details in the log)."""
    from checkpointing.spark.pipeline import run_spec
    from checkpointing.spark.session import spark_session, stop_session

    spark = spark_session(f"ckpt-{spec.job}", master)
    progress, on_epoch, holder = _progress(spec, err if quiet else out)
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


def _progress(spec: PipelineSpec, console: Console) -> tuple[Progress, Any, dict[str, Any]]:
    """A progress bar on a terminal, a line per epoch otherwise (on ``console``); the epoch
    callback updates it from the run (put in the returned holder as ``"run"``)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    interactive = console.is_terminal
    progress = Progress(
        TextColumn(spec.job, style="bold", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "epochs  {task.fields[rate]}  last checkpoint {task.fields[checkpoint]}", markup=False
        ),
        console=real_console(console),
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
            console.print(
                f"job {spec.job}: epoch {epoch + 1}/{run.result.epochs_total} done in "
                f"{millis} ms ({rate}); last completed checkpoint {last}"
            )

    return progress, on_epoch, holder
