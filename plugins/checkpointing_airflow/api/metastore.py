"""The checkpoint metastore the routes read, and what callers are told when the core library
fails: unknown → 404, malformed → 422, a state that forbids the action → 409, the metastore down
or not migrated → 503 (its reason goes to the api-server's log only)."""

from __future__ import annotations

import logging
import re
import threading
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from fastapi.responses import JSONResponse

from checkpointing.coordination import savepoints
from checkpointing.errors import (
    CheckpointingError,
    InvalidIdError,
    MetastoreUnavailable,
    NoCheckpointError,
    SchemaOutdated,
    StorageError,
    UnknownCheckpointError,
    UnknownJobError,
)
from checkpointing.metastore import jobs
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.jobs import JobInfo
from checkpointing.restore.assignment import StateAssignmentError
from checkpointing_airflow.api.auth import UNPROCESSABLE

log = logging.getLogger(__name__)

#: what any caller is told when the metastore cannot be used; the reason goes to the log only
METASTORE_PROBLEM = (
    "the checkpoint metastore is unavailable (unreachable, misconfigured or not migrated); "
    "the reason is in the api-server's log"
)


_metastores: dict[str, Metastore] = {}
_metastores_lock = threading.Lock()


def metastore() -> Metastore:
    """The checkpoint metastore, found like the operators find it (connection
    ``checkpoint_metastore``, else ``CKPT_METASTORE_URL``, else the embedded default); one
    engine per URL for the life of the api-server, so its pool is reused across requests."""
    from checkpointing_airflow.hooks import CheckpointMetastoreHook, open_metastore

    try:
        url = CheckpointMetastoreHook().get_url()
        with _metastores_lock:
            if url not in _metastores:
                _metastores[url] = open_metastore(url)
            return _metastores[url]
    except Exception as exc:  # a bad connection or URL: no caller sees which, or why
        _log_metastore_problem(exc)
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, METASTORE_PROBLEM) from None


_USERINFO = re.compile(r"://[^/\s]*@")


def _log_metastore_problem(exc: BaseException) -> None:
    """The metastore's error for the api-server's log, with any user and password of a URL in it
    cut out (the core library's messages carry none; a driver's might)."""
    log.warning(
        "checkpoint API: metastore problem: %s: %s",
        type(exc).__name__,
        _USERINFO.sub("://***@", str(exc)),
    )


MetastoreDep = Annotated[Metastore, Depends(metastore)]


def pipeline_job(store: Metastore, pipeline_id: str) -> JobInfo:
    """The pipeline's job (:func:`checkpointing.metastore.jobs.require_job`), its error
    worded for the API (a pipeline, not a ``ckpt jobs`` hint): 404 by :func:`_status_of`."""
    try:
        return jobs.require_job(store, pipeline_id)
    except UnknownJobError:
        raise UnknownJobError(f"unknown pipeline {pipeline_id!r}") from None


def _status_of(exc: CheckpointingError) -> int:
    """The HTTP status of the core library's errors: unknown → 404, malformed → 422, a state
    that forbids the action → 409, the metastore down or not migrated → 503."""
    if isinstance(exc, UnknownJobError | UnknownCheckpointError | NoCheckpointError):
        return status.HTTP_404_NOT_FOUND
    if isinstance(exc, savepoints.UnknownRequestError):
        return status.HTTP_404_NOT_FOUND
    if isinstance(exc, InvalidIdError | StateAssignmentError):
        return UNPROCESSABLE
    if isinstance(
        exc, savepoints.JobNotRunningError | savepoints.NotASavepointError | StorageError
    ):
        return status.HTTP_409_CONFLICT
    if isinstance(exc, MetastoreUnavailable | SchemaOutdated):
        return status.HTTP_503_SERVICE_UNAVAILABLE
    return status.HTTP_400_BAD_REQUEST


async def checkpointing_error(_request: Request, exc: CheckpointingError) -> JSONResponse:
    """The app's handler of the core library's errors."""
    if isinstance(exc, MetastoreUnavailable | SchemaOutdated):
        _log_metastore_problem(exc)
        return JSONResponse({"detail": METASTORE_PROBLEM}, status_code=_status_of(exc))
    return JSONResponse({"detail": str(exc)}, status_code=_status_of(exc))
