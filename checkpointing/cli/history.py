"""``ckpt jobs | list | show | restores | summary | requests | discard``: a job's checkpoint
history, read through :mod:`checkpointing.metastore.views`; discarding a savepoint through
:mod:`checkpointing.coordination.savepoints`."""

from __future__ import annotations

from typing import Annotated

import typer

from checkpointing.cli.common import (
    DEFAULT_LIMIT,
    EXIT_ERROR,
    AsJson,
    JobArg,
    Limit,
    choices,
    handles_errors,
    limit_or_all,
    out,
    print_json,
    state,
)
from checkpointing.status import CheckpointStatus, CheckpointType


@handles_errors
def jobs(as_json: AsJson = False) -> None:
    """List the jobs in the metastore."""
    from checkpointing.metastore.views import list_jobs

    rows = list_jobs(state.metastore())
    if as_json:
        print_json(rows)
        return
    from checkpointing.cli.render import jobs_table

    out.print(jobs_table(rows) if rows else "no jobs yet")


@handles_errors
def list_checkpoints(
    job: JobArg,
    status: Annotated[
        CheckpointStatus | None, choices(CheckpointStatus, "--status", help="Only this status.")
    ] = None,
    checkpoint_type: Annotated[
        CheckpointType | None, choices(CheckpointType, "--type", help="Only this type.")
    ] = None,
    limit: Limit = DEFAULT_LIMIT,
    as_json: AsJson = False,
) -> None:
    """List a job's checkpoints and savepoints, newest first."""
    from checkpointing.metastore import views

    rows = views.list_checkpoints(
        state.metastore(),
        job,
        status=status,
        checkpoint_type=checkpoint_type,
        limit=limit_or_all(limit),
    )
    if as_json:
        print_json(rows)
        return
    from checkpointing.cli.render import checkpoints_table

    out.print(checkpoints_table(rows, f"Checkpoints of {job}") if rows else "no checkpoints")
    _say_if_limited(len(rows), limit)


@handles_errors
def show(
    job: JobArg,
    checkpoint_id: Annotated[str, typer.Argument(metavar="CHECKPOINT_ID", help="Checkpoint id.")],
    files: Annotated[
        bool, typer.Option("--files", help="Also list the input files its runs read.")
    ] = False,
    as_json: AsJson = False,
) -> None:
    """Show one checkpoint: properties, location, every task's ack and the input its runs
    consumed (per run: epochs, files, bytes; the splits still to read)."""
    from rich.text import Text

    from checkpointing.ids import validate_checkpoint_id
    from checkpointing.metastore.views import checkpoint_detail

    detail = checkpoint_detail(state.metastore(), job, validate_checkpoint_id(checkpoint_id))
    if as_json:
        print_json(detail)
        return
    from checkpointing.cli.render import (
        checkpoints_table,
        input_files_table,
        input_table,
        input_totals,
        operators_table,
        tasks_table,
    )

    out.print(checkpoints_table([detail], f"{job} checkpoint {detail['checkpoint_id']}"))
    out.print(f"location: {detail['storage_location']}")
    out.print(f"metadata: {detail['metadata_path'] or '-'}")
    if detail["notify_error"]:
        out.print(Text("notification error:", style="red"), detail["notify_error"])
    out.print(operators_table(detail["operators"]))
    out.print(tasks_table(detail["tasks"]))
    section = detail["input"]
    if section is None:
        out.print("input: not recorded (no acknowledgement of a source)")
        return
    out.print(input_table(section))
    out.print(input_totals(section))
    if files:
        out.print(input_files_table(section))


@handles_errors
def restores(job: JobArg, as_json: AsJson = False) -> None:
    """List a job's restores: which checkpoint, for which attempt, and any fallback."""
    from checkpointing.metastore.views import list_restores

    rows = list_restores(state.metastore(), job)
    if as_json:
        print_json(rows)
        return
    from checkpointing.cli.render import restores_table

    out.print(restores_table(rows, f"Restores of {job}") if rows else "no restores")


@handles_errors
def summary(job: JobArg, as_json: AsJson = False) -> None:
    """A job's checkpoints at a glance (the UI's summary): counts by status, min/avg/max
    duration and state size, the latest completed, failed and savepoint, the latest restore."""
    from checkpointing.metastore.views import checkpoint_stats

    stats = checkpoint_stats(state.metastore(), job)
    if as_json:
        print_json(stats)
        return
    from checkpointing.cli.render import summary_table

    out.print(summary_table(stats, f"Summary of {job}"))


@handles_errors
def requests(
    job: JobArg,
    limit: Limit = DEFAULT_LIMIT,
    as_json: AsJson = False,
) -> None:
    """Savepoint and checkpoint requests of a job (from the CLI, the UI, DAGs) and their fate,
    newest first."""
    from checkpointing.metastore.views import list_requests

    rows = list_requests(state.metastore(), job, limit=limit_or_all(limit))
    if as_json:
        print_json(rows)
        return
    from checkpointing.cli.render import requests_table

    out.print(requests_table(rows, f"requests of job {job}"))
    _say_if_limited(len(rows), limit)


@handles_errors
def discard(
    job: JobArg,
    checkpoint_id: Annotated[
        str, typer.Argument(metavar="SAVEPOINT_ID", help="The savepoint's checkpoint id.")
    ],
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
) -> None:
    """Discard a completed savepoint: marked DISCARDED (no restore picks it), then its files
    are deleted. Refuses anything but a completed savepoint."""
    from checkpointing.coordination.savepoints import discard_savepoint
    from checkpointing.ids import validate_checkpoint_id
    from checkpointing.metastore.jobs import job_storage

    cid = validate_checkpoint_id(checkpoint_id)
    if not yes and not typer.confirm(f"Discard savepoint {cid} of {job} and delete its files?"):
        raise typer.Exit(EXIT_ERROR)
    metastore = state.metastore()
    storage = job_storage(metastore, job, state.storage_url)
    location = discard_savepoint(metastore, storage, job, cid)
    out.print(f"discarded savepoint {cid} of {job}: {location}")


def _say_if_limited(shown: int, limit: int) -> None:
    """Under a table that ``--limit`` may have cut: how to see the rest."""
    if limit and shown == limit:
        out.print(f"the newest {limit} shown; --limit N shows more, --limit 0 all")
