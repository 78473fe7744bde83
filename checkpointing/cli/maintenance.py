"""``ckpt gc | list-savepoints``: a job's housekeeping, through
:mod:`checkpointing.coordination.gc` (history rows, savepoint retention, orphan files)."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Annotated

import typer

from checkpointing.cli.common import AsJson, JobArg, handles_errors, out, print_json, state

if TYPE_CHECKING:
    from checkpointing.coordination.gc import GcPlan


def _duration(value: str | None, flag: str) -> timedelta | None:
    """A duration option, refused (one line, exit 2) when unreadable or negative."""
    if value is None:
        return None
    from checkpointing.config import parse_duration

    try:
        parsed = parse_duration(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=flag) from None
    if parsed < timedelta(0):
        raise typer.BadParameter(f"{value!r} is negative", param_hint=flag)
    return parsed


@handles_errors
def gc(
    job: JobArg,
    keep_history: Annotated[
        str,
        typer.Option(
            help="Prune history rows (ended checkpoints, finished requests, restores) older "
            "than this, e.g. 30d, 12h."
        ),
    ] = "30d",
    grace: Annotated[
        str,
        typer.Option(help="Leave files modified more recently than this (writes in flight)."),
    ] = "1h",
    keep_savepoints: Annotated[
        int | None,
        typer.Option(
            min=0,
            metavar="N",
            help="Discard completed savepoints beyond the N newest (default: the job's "
            "savepoint_retention).",
        ),
    ] = None,
    savepoint_max_age: Annotated[
        str | None,
        typer.Option(
            help="Discard completed savepoints older than this, e.g. 90d (default: the "
            "job's savepoint_retention)."
        ),
    ] = None,
    orphans: Annotated[
        bool, typer.Option("--orphans/--no-orphans", help="Delete orphan files in storage.")
    ] = True,
    vacuum_sink: Annotated[
        str | None,
        typer.Option(
            metavar="TABLE",
            help="Also delete the job's Delta sink table's files (at this location) that no "
            "retained checkpoint or savepoint can restore.",
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what would go, delete nothing.")
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Run even though the job is RUNNING.")
    ] = False,
    as_json: AsJson = False,
) -> None:
    """Garbage-collect a job: prune old history rows, expire savepoints by a retention, delete
    orphan files in its checkpoint storage. Never what a restore needs."""
    from checkpointing.coordination.gc import GcOptions, run_gc
    from checkpointing.metastore.jobs import job_storage

    history = _duration(keep_history, "--keep-history")
    options = GcOptions(
        keep_history=history if history is not None else timedelta(days=30),
        grace=_duration(grace, "--grace") or timedelta(0),
        keep_savepoints=keep_savepoints,
        savepoint_max_age=_duration(savepoint_max_age, "--savepoint-max-age"),
        orphans=orphans,
        force=force,
        vacuum_sink=vacuum_sink,
    )
    metastore = state.metastore()
    storage = job_storage(metastore, job, state.storage_url)
    plan = run_gc(metastore, storage, job, options, dry_run=dry_run)
    if as_json:
        print_json(plan.to_dict())
    else:
        _print_plan(plan)
    if plan.errors:
        raise typer.Exit(1)


def _print_plan(plan: GcPlan) -> None:
    from checkpointing.cli.render import human_bytes

    verb = "would delete" if plan.dry_run else "deleted"
    out.print(
        f"job {plan.job_id}: {verb} {len(plan.checkpoints)} checkpoint row(s) "
        f"({plan.tasks} task, {plan.acks} ack), {len(plan.requests)} request(s), "
        f"{len(plan.restores)} restore(s)",
        soft_wrap=True,
    )
    out.print(
        f"job {plan.job_id}: {verb} {len(plan.savepoints)} savepoint(s) "
        f"({human_bytes(plan.savepoint_bytes)}), {len(plan.orphans)} orphan file(s) "
        f"({human_bytes(plan.orphan_bytes)})",
        soft_wrap=True,
    )
    if plan.sink_files:
        out.print(
            f"job {plan.job_id}: {verb} {len(plan.sink_files)} sink table file(s) "
            f"({human_bytes(plan.sink_bytes)})",
            soft_wrap=True,
        )
    for sp in plan.savepoints:
        out.print(f"  savepoint {sp.checkpoint_id}: {sp.location}", soft_wrap=True)
    for f in plan.orphans:
        out.print(f"  {f.url} ({human_bytes(f.size)})", soft_wrap=True)
    for s in plan.sink_files:
        out.print(f"  {s.table}/{s.name} ({human_bytes(s.size)})", soft_wrap=True)
    for error in plan.errors:
        out.print(f"  not deleted: {error}", soft_wrap=True)


@handles_errors
def list_savepoints(job: JobArg, as_json: AsJson = False) -> None:
    """List a job's completed savepoints, newest first, with their age and size."""
    from checkpointing.coordination.gc import list_savepoints

    rows = list_savepoints(state.metastore(), job)
    if as_json:
        print_json([r.to_dict() for r in rows])
        return
    if not rows:
        out.print(f"job {job} has no completed savepoints")
        return
    from rich.table import Table

    from checkpointing.cli.render import human_bytes

    table = Table(title=f"savepoints of {job}")
    for column in ("id", "type", "completed", "age", "size"):
        table.add_column(column, no_wrap=True)
    table.add_column("location", overflow="fold")  # whole: it is what --restore takes
    for r in rows:
        table.add_row(
            str(r.checkpoint_id),
            r.checkpoint_type,
            r.completed_at.isoformat(timespec="seconds"),
            _age(r.age),
            human_bytes(r.size),
            r.location,
        )
    out.print(table)


def _age(age: timedelta) -> str:
    seconds = int(age.total_seconds())
    if seconds < 3600:
        return f"{seconds // 60}m"
    if seconds < 86400:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"
