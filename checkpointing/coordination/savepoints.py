"""Savepoints asked for from outside the running job: the CLI, an Airflow DAG, the UI.

Flink's REST ``/jobs/:id/savepoints`` (and ``stop``) for this project: a request row is queued in
the metastore; the job's coordinator triggers it at its next epoch boundary (forced, ahead of
periodic checkpoints) and the request row follows the savepoint to COMPLETED or FAILED. Callers
poll :func:`request_status` or block in :func:`wait_for_request`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from checkpointing.clock import Clock, SystemClock
from checkpointing.coordination import request_queue
from checkpointing.coordination.request_queue import (  # re-exported: the callers' name for it
    JobNotRunningError as JobNotRunningError,
)
from checkpointing.errors import CheckpointingError, UnknownCheckpointError
from checkpointing.ids import validate_id
from checkpointing.metastore import jobs
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint, CheckpointRequest
from checkpointing.status import CheckpointStatus, CheckpointType, RequestStatus

if TYPE_CHECKING:
    from checkpointing.state.storage import CheckpointStorage


class RequestFailedError(CheckpointingError):
    """The savepoint request ended without a completed savepoint (names the reason)."""


class UnknownRequestError(CheckpointingError, LookupError):
    """No such request for that job."""


class RequestTimeoutError(CheckpointingError):
    """The savepoint did not complete in time (the request stays queued or pending)."""


@dataclass(frozen=True)
class RequestState:
    """Where a savepoint request stands, with the savepoint it produced once there is one."""

    request_id: int
    job_id: str
    checkpoint_type: str
    status: str
    requested_by: str
    requested_at: datetime
    finished_at: datetime | None
    message: str | None
    checkpoint_id: int | None
    checkpoint_status: str | None
    #: the savepoint's directory: what ``--restore`` / the deploy DAG takes
    savepoint_path: str | None

    @property
    def done(self) -> bool:
        return self.status in (
            RequestStatus.COMPLETED,
            RequestStatus.FAILED,
            RequestStatus.DROPPED,
        ) or self.checkpoint_status in (CheckpointStatus.ABORTED, CheckpointStatus.DISCARDED)

    @property
    def succeeded(self) -> bool:
        return self.status == RequestStatus.COMPLETED

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        for key in ("requested_at", "finished_at"):
            data[key] = data[key].isoformat() if data[key] else None
        return data


def request_savepoint(
    metastore: Metastore,
    job_id: str,
    *,
    stop: bool = False,
    requested_by: str,
    clock: Clock | None = None,
) -> int:
    """Queue a savepoint (``stop``: then end the job) for the job's running coordinator.

    A request from outside the job: refused unless the job is RUNNING
    (:class:`JobNotRunningError`, see :func:`request_queue.queue_request`)."""
    validate_id(job_id, "job id")
    checkpoint_type = CheckpointType.SAVEPOINT_THEN_STOP if stop else CheckpointType.SAVEPOINT
    now = (clock or SystemClock()).now()
    with metastore.transaction() as s:
        return request_queue.queue_request(
            s,
            job_id,
            checkpoint_type,
            requested_by=requested_by,
            now=now,
            forced=True,
            from_outside=True,
        )


def request_status(metastore: Metastore, job_id: str, request_id: int) -> RequestState:
    validate_id(job_id, "job id")
    with metastore.transaction() as s:
        req = s.get(CheckpointRequest, request_id)
        if req is None or req.job_id != job_id:
            raise UnknownRequestError(f"job {job_id!r} has no savepoint request {request_id}")
        checkpoint = s.get(Checkpoint, (job_id, req.checkpoint_id)) if req.checkpoint_id else None
        return RequestState(
            request_id=req.request_id,
            job_id=req.job_id,
            checkpoint_type=req.checkpoint_type,
            status=req.status,
            requested_by=req.requested_by,
            requested_at=req.requested_at,
            finished_at=req.finished_at,
            message=req.message or (checkpoint.failure_message if checkpoint else None),
            checkpoint_id=req.checkpoint_id,
            checkpoint_status=checkpoint.status if checkpoint else None,
            savepoint_path=(
                checkpoint.storage_location
                if checkpoint is not None and checkpoint.status == CheckpointStatus.COMPLETED
                else None
            ),
        )


def wait_for_request(
    metastore: Metastore,
    job_id: str,
    request_id: int,
    *,
    timeout: float,
    poll: float = 0.5,
) -> RequestState:
    """Block until the request's savepoint completes; raise if it fails or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        state = request_status(metastore, job_id, request_id)
        if state.done:
            if not state.succeeded:
                raise RequestFailedError(
                    f"savepoint request {request_id} of job {job_id!r} "
                    f"{(state.checkpoint_status or state.status).lower()}: "
                    f"{state.message or 'no reason recorded'}"
                )
            return state
        if time.monotonic() >= deadline:
            raise RequestTimeoutError(
                f"savepoint request {request_id} of job {job_id!r} is still {state.status} "
                f"after {timeout:g} s; the job takes it at its next epoch boundary "
                f"(see `ckpt requests {job_id}`)"
            )
        time.sleep(poll)


class NotASavepointError(CheckpointingError):
    """Only a completed savepoint can be discarded by a user (checkpoints follow retention)."""


def discard_savepoint(
    metastore: Metastore,
    storage: CheckpointStorage,
    job_id: str,
    checkpoint_id: int,
    *,
    clock: Clock | None = None,
) -> str:
    """Discard a completed savepoint: it is marked DISCARDED (no restore will pick it) and then
    its files are deleted. Returns its location; refuses anything but a completed savepoint.

    The directory deleted is the one the ids give (``<job>/savepoints/savepoint-<id>``), never
    the row's ``storage_location`` (any driver can write rows): a savepoint whose row records
    another directory (a savepoint target, or a forged row) is refused with
    :class:`~checkpointing.state.storage.RefusedDeleteError`, before it is marked, and nothing
    is deleted (delete a savepoint written to a target of its own by hand)."""
    from checkpointing.coordination import store
    from checkpointing.coordination.cleaner import directory_kind

    validate_id(job_id, "job id")
    now = (clock or SystemClock()).now()
    with metastore.transaction() as s:
        jobs.job_row(s, job_id)
        disposal = store.discard_savepoint(s, job_id, checkpoint_id, now)
        if disposal is None:
            row = s.get(Checkpoint, (job_id, checkpoint_id))
            if row is None:
                raise UnknownCheckpointError(f"job {job_id!r} has no checkpoint {checkpoint_id}")
            raise NotASavepointError(
                f"checkpoint {checkpoint_id} of job {job_id!r} is a {row.status} "
                f"{row.checkpoint_type}: only a COMPLETED savepoint can be discarded"
            )
        kind = directory_kind(disposal.checkpoint_type)
        # refused (raises: the mark is rolled back) unless the row's location is the derived one
        storage.deletable_directory(job_id, checkpoint_id, kind, recorded=disposal.storage_location)
    return storage.discard_directory(
        job_id, checkpoint_id, kind, recorded=disposal.storage_location
    )
