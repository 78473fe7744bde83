"""``ckpt savepoint``: request a savepoint from a running job
(:mod:`checkpointing.coordination.savepoints`),
and optionally wait for it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated

import typer

from checkpointing.cli.common import AsJson, err, handles_errors, out, print_json, state, waiting

if TYPE_CHECKING:
    from checkpointing.coordination.savepoints import RequestState
    from checkpointing.metastore.engine import Metastore


@handles_errors
def savepoint(
    job: Annotated[str, typer.Argument(metavar="JOB", help="The running job.")],
    stop: Annotated[bool, typer.Option("--stop", help="End the job after the savepoint.")] = False,
    wait: Annotated[
        bool, typer.Option("--wait", help="Wait until the savepoint completes or fails.")
    ] = False,
    timeout: Annotated[str, typer.Option(help="How long --wait waits, e.g. 90s, 10m.")] = "10m",
    as_json: AsJson = False,
) -> None:
    """Request a savepoint from a running job (taken at its next epoch boundary)."""
    import getpass

    from checkpointing.config import parse_duration
    from checkpointing.coordination import savepoints

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
    done = _wait(metastore, job, request_id, limit, quiet=as_json)
    if as_json:
        print_json(done.to_dict())
    else:
        out.print(
            f"savepoint {done.checkpoint_id} of job {job} completed: {done.savepoint_path}"
            + (" (the job stops)" if stop else ""),
            soft_wrap=True,
        )


def _wait(
    metastore: Metastore, job: str, request_id: int, timeout: float, *, quiet: bool
) -> RequestState:
    """Until the request is done, saying where it stands (a spinner on a terminal); raise as
    :func:`checkpointing.coordination.savepoints.wait_for_request` does if it failed or time ran
    out."""
    from checkpointing.coordination import savepoints

    deadline = time.monotonic() + timeout
    with waiting(err, quiet=quiet) as say:
        while not (current := savepoints.request_status(metastore, job, request_id)).done:
            if time.monotonic() >= deadline:
                raise savepoints.RequestTimeoutError(
                    f"savepoint request {request_id} of job {job!r} is still {current.status} "
                    f"after {timeout:g} s; the job takes it at its next epoch boundary "
                    f"(see `ckpt requests {job}`)"
                )
            say(f"waiting for savepoint of job {job} (request {request_id}): {current.status}…")
            time.sleep(0.5)
    return savepoints.wait_for_request(metastore, job, request_id, timeout=0)  # done: its verdict
