"""``python -m demo``: the demos of this checkout (``make demo``) and its local Airflow
(``python -m demo airflow``, ``make airflow``).

Options and output as the ``ckpt`` command's: the settings from flags, then ``CKPT_*``, then the
embedded defaults under ``CKPT_HOME``; errors are one line on stderr and a non-zero exit code;
every value is printed as text (the console's markup is off, styles are given as Text)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from checkpointing.cli.common import (
    EXIT_ERROR,
    MetastoreUrlOption,
    StorageUrlOption,
    VerboseOption,
    configure_logging,
    handles_errors,
    out,
    print_error,
)
from checkpointing.config import Settings
from demo import SPEC_PATH

#: the demos' own lines: markup off like the ``ckpt`` consoles, never wrapped mid-word in logs
console = Console(width=None if out.is_terminal else 160, markup=False)

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.callback(invoke_without_command=True)
@handles_errors
def demo(
    ctx: typer.Context,
    job: Annotated[
        str | None,
        typer.Option(
            help="Job id (default: nycflights13_routes_demo; demo-nycflights13 with "
            "--no-airflow; demo-core with --core)."
        ),
    ] = None,
    airflow: Annotated[
        bool,
        typer.Option(
            "--airflow/--no-airflow",
            help="Run the pipeline as an Airflow DAG (airflow dags test, spark-submit), or "
            "directly on Spark in this process.",
        ),
    ] = True,
    core: Annotated[
        bool,
        typer.Option(
            "--core",
            help="Instead: the core alone with a simulated job, no Spark (triggers, acks, "
            "subsumption, a savepoint, a declined checkpoint, fallback past a corrupt one).",
        ),
    ] = False,
    crash_after: Annotated[
        int | None,
        typer.Option(min=1, metavar="N", help="Inject the crash after this many epochs."),
    ] = None,
    spec: Annotated[
        Path | None,
        typer.Option(help="Pipeline spec (default: nycflights13.yaml of dags/pipelines/)."),
    ] = None,
    master: Annotated[str, typer.Option(help="Spark master URL (with --no-airflow).")] = "local[2]",
    metastore_url: MetastoreUrlOption = None,
    storage_url: StorageUrlOption = None,
    verbose: VerboseOption = False,
) -> None:
    """Run the nycflights13 example pipeline as an Airflow DAG with a crash injected in its first
    try; the retry resumes from the latest checkpoint. Verify the result against pandas and print
    the history. `python -m demo airflow` starts a local Airflow instead."""
    configure_logging(verbose)
    settings = Settings.resolve(metastore_url, storage_url)
    if ctx.invoked_subcommand is not None:
        if job or not airflow or core or crash_after or spec or master != "local[2]":
            raise typer.BadParameter(
                f"the demo's options do not apply to `{ctx.invoked_subcommand}`: give them "
                "without it"
            )
        ctx.obj = settings
        return
    if core:
        from demo.core import run_demo

        run_demo(settings, job or "demo-core", console)
        return
    if airflow:
        from demo import airflow_demo

        check = airflow_demo.run_airflow_demo(
            settings, console, job=job or airflow_demo.DEFAULT_JOB, spec_path=spec or SPEC_PATH,
            crash_after=crash_after,
        )  # fmt: skip
    else:
        from demo import spark_only

        check = spark_only.run_flights_demo(
            settings, console, job=job or spark_only.DEFAULT_JOB, spec_path=spec or SPEC_PATH,
            crash_after=crash_after, master=master,
        )  # fmt: skip
    if not check.ok:
        raise typer.Exit(EXIT_ERROR)


@app.command("airflow")
@handles_errors
def airflow_cmd(
    ctx: typer.Context,
    port: Annotated[
        int, typer.Option(min=1, max=65535, metavar="PORT", help="The API server's port.")
    ] = 8080,
    ready_timeout: Annotated[
        float,
        typer.Option(min=1, metavar="SECONDS", help="How long to wait for the API server."),
    ] = 300,
    dags: Annotated[
        list[Path] | None,
        typer.Option(
            "--dags",
            exists=True,
            file_okay=False,
            metavar="DIR",
            help="Also serve the DAGs of this folder (repeatable).",
        ),
    ] = None,
) -> None:
    """Start a local Airflow 3 (api-server, scheduler, dag-processor, triggerer) with this
    project's DAGs and plugins on 127.0.0.1, print its URL and login, run until Ctrl-C.

    Your AIRFLOW__*, AIRFLOW_CONN_*, AIRFLOW_VAR_* reach Airflow, except what it sets here."""
    from demo.local_airflow import run_local_airflow

    try:
        code = run_local_airflow(
            ctx.obj, console, port=port, ready_timeout=ready_timeout, user_dags=dags or ()
        )
    except RuntimeError as exc:  # e.g. airflow db migrate failed: Airflow's own message
        print_error(exc)
        raise typer.Exit(EXIT_ERROR) from None
    if code:
        raise typer.Exit(code)


def main() -> None:
    app(prog_name="python -m demo")
