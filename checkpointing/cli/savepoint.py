"""``ckpt savepoint``: request a savepoint from a running job (:mod:`checkpointing.savepoints`),
and optionally wait for it."""

from __future__ import annotations

from typing import Annotated

import typer

from checkpointing.cli.common import err, handles_errors, out, print_json, state


@handles_errors
def savepoint(
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
