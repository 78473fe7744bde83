"""The checkpoint REST API: a FastAPI app that Airflow's api-server mounts under ``/checkpoints``
(registered by :mod:`checkpointing_airflow.checkpoints_plugin`).

JSON for the Checkpoints UI and for scripts: pipelines, their checkpoints (filtered, paged),
one checkpoint's acks, restores, savepoint requests and restore plans. Every read is a query of
:mod:`checkpointing.views` (the same data as ``ckpt … --json``), every action a call of the core
library; nothing here talks to Spark.

**Who may do what.** Airflow does not protect plugin endpoints, so every route depends on
:func:`authenticated`: the caller's Airflow JWT (``Authorization: Bearer`` from ``POST
/auth/token``, or the ``_token`` cookie of Airflow's UI) resolved by Airflow's auth manager,
else 401. A pipeline's DAG id is its job id (the DAG factory names each pipeline's DAG after its
job), so reads need read (``GET``) access to that DAG and actions edit (``PUT``) access, else 403,
asked of the configured auth manager (SimpleAuthManager, FAB, Keycloak …). Actions authenticated
by the cookie, which browsers attach on their own, must carry the ``X-Requested-By`` header and
come from Airflow's own origin, so that another site cannot forge them (:func:`_refuse_forgery`).

Airflow's plugin manager imports every ``.py`` file under ``plugins/``, in every component: this
module imports only FastAPI, pydantic and the core library at import time; Airflow's auth and
models are imported when a request needs them, i.e. only inside the api-server.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from pathlib import Path as FilePath
from typing import Annotated, Any, Literal
from urllib.parse import quote, urlsplit

from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request, Response, status
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field

from checkpointing import savepoints, views
from checkpointing.assignment import StateAssignmentError
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
from checkpointing.ids import validate_id
from checkpointing.metastore import Metastore
from checkpointing.properties import CheckpointStatus, CheckpointType
from checkpointing_airflow.dag_factory import DEPLOY_DAG_ID

log = logging.getLogger(__name__)

#: where the api-server mounts this app (not under Airflow's reserved /api/v2, /ui, /auth …)
URL_PREFIX = "/checkpoints"
#: the header a cookie-authenticated action must carry (any non-empty value): a cross-site form
#: cannot set it, and cross-site ``fetch`` needs a CORS preflight that this app never grants
CSRF_HEADER = "X-Requested-By"
#: a job id, the pipeline's DAG id (``checkpointing.ids``, ``dag_factory.JOB_ID_PATTERN``)
PIPELINE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
MAX_ID = 2**63 - 1
MAX_REQUEST_ID = 2**31 - 1
#: Flink's upper bound of max parallelism; a restore plan above the checkpoint's own max
#: parallelism is refused by the assignment with the operator named
MAX_PARALLELISM = 32768
#: Starlette renamed the constant (…_ENTITY → …_CONTENT); the number is what clients see
UNPROCESSABLE = 422
DEFAULT_PAGE = 50
MAX_PAGE = 500
#: the largest request body taken (the action bodies are a few bytes of JSON): larger ones are
#: refused with 413 by their Content-Length, before the body is read or the login checked
MAX_BODY = 64 * 1024
#: what any caller is told when the metastore cannot be used; the reason goes to the log only
METASTORE_PROBLEM = (
    "the checkpoint metastore is unavailable (unreachable, misconfigured or not migrated); "
    "the reason is in the api-server's log"
)
#: the Checkpoints page: one self-contained HTML file with plain JS (no build step, no CDN)
UI_PAGE = FilePath(__file__).with_name("ui.html")

# ============================================================================ response models


class CheckpointSummary(BaseModel):
    """One row of a pipeline's checkpoint history (``ckpt list --json``)."""

    checkpoint_id: int
    type: str = Field(description="CHECKPOINT, SAVEPOINT or SAVEPOINT_THEN_STOP")
    status: str = Field(description="PENDING, COMPLETED, ABORTED, SUBSUMED or DISCARDED")
    trigger_at: datetime | None
    completed_at: datetime | None
    ended_at: datetime | None
    deadline_at: datetime | None
    duration_ms: int | None = Field(description="trigger to completion (or end), end to end")
    acked_tasks: int
    num_tasks: int
    state_size: int | None = Field(description="bytes of state, all acked tasks")
    failure_reason: str | None
    failure_message: str | None
    storage_location: str | None
    metadata_path: str | None
    periodic: bool
    forced: bool


class Pipeline(BaseModel):
    """A job in the metastore (its DAG has the same id) and where its checkpoints stand."""

    job_id: str
    status: str = Field(description="CREATED, RUNNING, FINISHED, CANCELED, FAILED, SUSPENDED")
    running: bool = Field(description="a savepoint can be requested only while running")
    storage_url: str
    checkpoints: dict[str, int] = Field(description="number of checkpoints by status")
    last_completed_id: int | None
    last_completion_at: datetime | None
    consecutive_failures: int
    periodic_scheduling: bool
    failure_cause: str | None
    latest_checkpoint: CheckpointSummary | None = Field(description="the newest, any status")
    can_edit: bool = Field(description="whether the caller may act on it (savepoints)")


class PipelineList(BaseModel):
    pipelines: list[Pipeline]
    total: int


class CheckpointPage(BaseModel):
    """A page of the history, newest first; ``total`` counts every match of the filters."""

    checkpoints: list[CheckpointSummary]
    total: int
    limit: int
    offset: int


class TaskAck(BaseModel):
    """One operator subtask of a checkpoint and its acknowledgement, if any."""

    operator_id: str
    subtask_index: int
    attempt_id: str
    parallelism: int
    max_parallelism: int
    acked: bool
    state_handle: str | None
    state_size: int | None
    checksum: str | None
    sync_ms: int | None
    async_ms: int | None
    acked_at: datetime | None


class RequestRef(BaseModel):
    request_id: int
    requested_by: str


class CheckpointDetail(CheckpointSummary):
    """A checkpoint with its properties and every subtask's ack (``ckpt show --json``)."""

    job_id: str
    properties: dict[str, bool]
    metadata_checksum: str | None
    notified_at: datetime | None
    notify_error: str | None
    request: RequestRef | None
    tasks: list[TaskAck]


class Restore(BaseModel):
    """A restore decision: which checkpoint, which attempt, the assignment and the fallbacks."""

    restore_id: int
    attempt: str
    checkpoint_id: int | None
    checkpoint_type: str | None
    external_path: str | None
    parallelism: int | None
    status: str = Field(description="PLANNED, RESTORED or EMPTY")
    fallbacks: list[Any] = Field(description="checkpoints skipped as unusable, with the reason")
    assignment: dict[str, Any] | None
    message: str | None
    created_at: datetime | None


class RestoreList(BaseModel):
    """A page of the restore history, newest first; ``total`` counts them all."""

    restores: list[Restore]
    total: int
    limit: int
    offset: int


class Spread(BaseModel):
    min: int
    avg: float
    max: int


class PipelineSummary(BaseModel):
    """A pipeline's checkpoints at a glance, like Flink's checkpoint summary."""

    job_id: str
    counts: dict[str, int] = Field(description="number of checkpoints by status")
    completed: int = Field(description="checkpoints that completed (subsumed ones included)")
    duration_ms: Spread | None = Field(description="end-to-end duration of the completed ones")
    state_size: Spread | None = Field(description="bytes of state of the completed ones")
    latest_completed: CheckpointSummary | None
    latest_failed: CheckpointSummary | None = Field(description="the newest aborted checkpoint")
    latest_savepoint: CheckpointSummary | None = Field(description="the newest completed one")
    latest_restore: Restore | None


class SavepointRequestBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stop: bool = Field(False, description="end the job once the savepoint completes")


class RestoreRequestBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    parallelism: int | None = Field(
        None, ge=1, le=MAX_PARALLELISM, description="empty: the pipeline spec's parallelism"
    )


class DeployRun(BaseModel):
    """The run of the deploy DAG that restores the pipeline from a checkpoint or savepoint."""

    dag_id: str
    dag_run_id: str
    state: str
    conf: dict[str, Any] = Field(description="the deploy DAG's params: pipeline, from, parallelism")
    url: str = Field(description="the run's page in Airflow's UI (a path)")


class RequestSummary(BaseModel):
    request_id: int
    type: str
    status: str = Field(description="QUEUED, TRIGGERED, COMPLETED, FAILED or DROPPED")
    forced: bool
    checkpoint_id: int | None
    requested_by: str
    requested_at: datetime | None
    finished_at: datetime | None
    message: str | None


class RequestList(BaseModel):
    requests: list[RequestSummary]


class RequestState(BaseModel):
    """Where a savepoint request stands (``checkpointing.savepoints.RequestState``)."""

    request_id: int
    job_id: str
    checkpoint_type: str
    status: str = Field(description="QUEUED, TRIGGERED, COMPLETED, FAILED or DROPPED")
    requested_by: str
    requested_at: datetime
    finished_at: datetime | None
    message: str | None
    checkpoint_id: int | None
    checkpoint_status: str | None
    savepoint_path: str | None = Field(description="set once the savepoint completed")
    done: bool
    succeeded: bool


class KeyGroupRange(BaseModel):
    start: int
    end: int


class SkippedCheckpoint(BaseModel):
    checkpoint_id: int
    reason: str


class OperatorPlan(BaseModel):
    operator_id: str
    old_parallelism: int
    parallelism: int
    max_parallelism: int
    list_mode: str | None
    bytes: int
    files: int
    list_items: int


class SubtaskPlan(BaseModel):
    subtask: int
    key_groups: KeyGroupRange | None
    files: list[dict[str, Any]] = Field(description="state files read, with their key groups")
    bytes: int
    list_state: dict[str, list[dict[str, Any]]]


class RestorePlan(BaseModel):
    """Dry run of a restore (``ckpt restore-plan --json``): nothing is recorded."""

    job_id: str
    dry_run: bool
    checkpoint_id: int | None
    checkpoint_type: str | None
    metadata_path: str | None
    completed_at: datetime
    skipped: list[SkippedCheckpoint]
    parallelism: int
    operators: list[OperatorPlan]
    bytes: int
    subtasks: list[SubtaskPlan]
    plan: dict[str, Any] = Field(description="the assignment a restore would record")


class Problem(BaseModel):
    detail: str


# ============================================================================ the metastore

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

# ============================================================================ who may do what


@dataclass(frozen=True)
class Caller:
    """An authenticated Airflow user, and whether the browser's cookie (rather than an explicit
    bearer token) authenticated the request."""

    user: Any
    by_cookie: bool

    @property
    def name(self) -> str:
        return str(self.user.get_name())


_bearer = HTTPBearer(
    auto_error=False,
    description="Airflow's JWT: `POST /auth/token` with username and password",
)


async def authenticated(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Caller:
    """The caller, as Airflow's own API resolves it (bearer token first, else the UI's cookie,
    refreshed by Airflow's middleware), else 401. Airflow answers a token that does not verify
    with 403; here anything short of a valid login is 401, so that clients know to log in."""
    from airflow.api_fastapi.core_api.security import get_user

    try:
        user = await get_user(request, _oauth_token=None, bearer_credentials=credentials)
    except HTTPException as exc:
        if exc.status_code in (status.HTTP_401_UNAUTHORIZED, status.HTTP_403_FORBIDDEN):
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                f"not authenticated: {exc.detail} (log in to Airflow, or send "
                "'Authorization: Bearer <token>' from POST /auth/token)",
                headers={"WWW-Authenticate": "Bearer"},
            ) from None
        raise
    by_bearer = credentials is not None and credentials.scheme.lower() == "bearer"
    return Caller(user, by_cookie=not by_bearer)


CallerDep = Annotated[Caller, Depends(authenticated)]
Method = Literal["GET", "PUT"]


def may_access(caller: Caller, pipeline_id: str, method: Method) -> bool:
    """Whether the auth manager lets the caller read (GET) or edit (PUT) the pipeline's DAG;
    the DAG's team is asked for as Airflow's own DAG endpoints do (multi-team setups)."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails
    from airflow.models.dag import DagModel

    return bool(
        get_auth_manager().is_authorized_dag(
            method=method,
            details=DagDetails(id=pipeline_id, team_name=DagModel.get_team_name(pipeline_id)),
            user=caller.user,
        )
    )


PipelineIdPath = Annotated[
    str,
    Path(
        pattern=PIPELINE_ID_PATTERN,
        description="the job id, which is also the id of the pipeline's DAG",
        examples=["nycflights13_routes"],
    ),
]


def _valid_pipeline_id(pipeline_id: str) -> str:
    try:
        return validate_id(pipeline_id, "pipeline id")
    except InvalidIdError as exc:
        raise HTTPException(UNPROCESSABLE, str(exc)) from None


def readable_pipeline(pipeline_id: PipelineIdPath, caller: CallerDep) -> str:
    """The pipeline id of the path, once the caller may read its DAG (else 403)."""
    pipeline_id = _valid_pipeline_id(pipeline_id)
    if not may_access(caller, pipeline_id, "GET"):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, f"no read access to the DAG of pipeline {pipeline_id!r}"
        )
    return pipeline_id


def editable_pipeline(request: Request, pipeline_id: PipelineIdPath, caller: CallerDep) -> str:
    """The pipeline id of the path, once the caller may edit its DAG (else 403) and the request
    cannot be a cross-site forgery."""
    pipeline_id = _valid_pipeline_id(pipeline_id)
    _refuse_forgery(request, caller)
    if not may_access(caller, pipeline_id, "PUT"):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"user {caller.name!r} has no edit access to the DAG of pipeline {pipeline_id!r}: "
            "actions need the permission to edit it",
        )
    return pipeline_id


def _refuse_forgery(request: Request, caller: Caller) -> None:
    """Browsers attach Airflow's cookie to any request to its host, including one a page of
    another site makes (a form post, an image, a no-CORS fetch); they never add an
    ``Authorization`` header on their own. So an action authenticated by the cookie must carry
    :data:`CSRF_HEADER` (which needs a CORS preflight cross-origin) and, when the browser says
    where it comes from (``Origin``, else ``Referer``), come from Airflow's own origin."""
    if not caller.by_cookie:
        return
    if not request.headers.get(CSRF_HEADER, "").strip():
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"cross-site request refused: an action authenticated by Airflow's cookie needs the "
            f"header {CSRF_HEADER} (or use 'Authorization: Bearer <token>')",
        )
    claimed = request.headers.get("origin") or _origin_of(request.headers.get("referer"))
    if claimed is None:
        return
    allowed = {_origin_of(str(request.base_url))}
    from airflow.configuration import conf

    if base_url := conf.get("api", "base_url", fallback=None):
        allowed.add(_origin_of(base_url))
    if claimed.lower() not in allowed:
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"cross-site request refused: origin {claimed!r} is not Airflow's",
        )


def _origin_of(url: str | None) -> str | None:
    """``scheme://host[:port]`` of a URL, lower case; ``'null'`` (an opaque origin) stays."""
    if not url:
        return None
    if url == "null":
        return url
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower() if parts.scheme and parts.netloc else url


ReadablePipeline = Annotated[str, Depends(readable_pipeline)]
EditablePipeline = Annotated[str, Depends(editable_pipeline)]

# ============================================================================ errors


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


ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": Problem, "description": "not logged in to Airflow"},
    403: {"model": Problem, "description": "no access to the pipeline's DAG"},
    404: {"model": Problem, "description": "unknown pipeline or id"},
}

# ============================================================================ the app


class StatusFilter(StrEnum):
    PENDING = CheckpointStatus.PENDING.value
    COMPLETED = CheckpointStatus.COMPLETED.value
    ABORTED = CheckpointStatus.ABORTED.value
    SUBSUMED = CheckpointStatus.SUBSUMED.value
    DISCARDED = CheckpointStatus.DISCARDED.value


class TypeFilter(StrEnum):
    CHECKPOINT = CheckpointType.CHECKPOINT.value
    SAVEPOINT = CheckpointType.SAVEPOINT.value
    SAVEPOINT_THEN_STOP = CheckpointType.SAVEPOINT_THEN_STOP.value


app = FastAPI(
    title="Checkpoints",
    version="1",
    description=(
        "Checkpoints, savepoints and restores of the checkpointed Spark pipelines. Log in to "
        "Airflow (`POST /auth/token`) and send `Authorization: Bearer <token>`; reads need read "
        "access to the pipeline's DAG (its id is the job id), actions edit access."
    ),
    # the schema and its page need a login too: served by the routes below
    openapi_url=None,
    docs_url=None,
    redoc_url=None,
)


@app.exception_handler(CheckpointingError)
async def _checkpointing_error(_request: Request, exc: CheckpointingError) -> JSONResponse:
    if isinstance(exc, MetastoreUnavailable | SchemaOutdated):
        _log_metastore_problem(exc)
        return JSONResponse({"detail": METASTORE_PROBLEM}, status_code=_status_of(exc))
    return JSONResponse({"detail": str(exc)}, status_code=_status_of(exc))


class _BoundedBodies:
    """ASGI middleware: a request body larger than :data:`MAX_BODY` (by its ``Content-Length``)
    is refused with 413 and one without a length (chunked) with 411, before a byte of it is
    read; any other request with a body must be logged in (else 401) before the body is read
    and parsed. The server (h11/httptools) delivers no more than ``Content-Length`` bytes."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        length = request.headers.get("content-length")
        chunked = "chunked" in request.headers.get("transfer-encoding", "").lower()
        if length is None and not chunked:
            await self.app(scope, receive, send)
            return
        refusal: HTTPException | None = None
        if chunked or length is None:
            refusal = HTTPException(411, "a request body needs a Content-Length")
        elif not length.strip().isdigit():
            refusal = HTTPException(status.HTTP_400_BAD_REQUEST, "malformed Content-Length")
        elif int(length) > MAX_BODY:
            refusal = HTTPException(413, f"request body larger than {MAX_BODY} bytes")
        elif int(length) > 0:
            try:
                await authenticated(request, await _bearer(request))
            except HTTPException as exc:
                refusal = exc
        if refusal is None:
            await self.app(scope, receive, send)
            return
        headers = dict(refusal.headers or {})
        headers["Connection"] = "close"  # the unread body must not be taken for a next request
        response = JSONResponse(
            {"detail": refusal.detail}, status_code=refusal.status_code, headers=headers
        )
        await response(scope, receive, send)


app.add_middleware(_BoundedBodies)


@app.get("/openapi.json", include_in_schema=False)
def openapi(request: Request, _caller: CallerDep) -> JSONResponse:
    """The OpenAPI schema, with the mount point as its server so that "try it out" works."""
    schema = dict(app.openapi())
    schema["servers"] = [{"url": request.scope.get("root_path", "").rstrip("/") or "/"}]
    return JSONResponse(schema)


@app.get("/ui/", include_in_schema=False, response_model=None)
async def ui(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> HTMLResponse | RedirectResponse:
    """The Checkpoints page (``?pipeline=<job id>`` selects one). It calls the JSON API with
    relative URLs and the UI's cookie; a visitor who is not logged in is sent to Airflow's login
    page and back."""
    try:
        await authenticated(request, credentials)
    except HTTPException as exc:
        if exc.status_code != status.HTTP_401_UNAUTHORIZED:
            raise
        from airflow.api_fastapi.app import get_auth_manager

        here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(get_auth_manager().get_url_login(next_url=here), status_code=303)
    return HTMLResponse(
        UI_PAGE.read_text(encoding="utf-8"),
        headers={"Cache-Control": "no-store", "X-Frame-Options": "SAMEORIGIN"},
    )


def _pipeline(row: dict[str, Any], latest: list[dict[str, Any]], can_edit: bool) -> Pipeline:
    return Pipeline(
        **row,
        running=row["status"] == "RUNNING",
        latest_checkpoint=CheckpointSummary(**latest[0]) if latest else None,
        can_edit=can_edit,
    )


@app.get(
    "/api/pipelines",
    response_model=PipelineList,
    responses={401: ERRORS[401]},
    summary="Pipelines the caller may read",
)
def list_pipelines(caller: CallerDep, store: MetastoreDep) -> PipelineList:
    """Every job of the metastore whose DAG the caller may read, with its status, checkpoint
    counts by status and its newest checkpoint."""
    pipelines = []
    for row in views.list_jobs(store):
        if not may_access(caller, row["job_id"], "GET"):
            continue
        latest = views.list_checkpoints(store, row["job_id"], limit=1)
        pipelines.append(_pipeline(row, latest, may_access(caller, row["job_id"], "PUT")))
    return PipelineList(pipelines=pipelines, total=len(pipelines))


@app.get(
    "/api/pipelines/{pipeline_id}",
    response_model=Pipeline,
    responses=ERRORS,
    summary="One pipeline",
)
def get_pipeline(pipeline_id: ReadablePipeline, caller: CallerDep, store: MetastoreDep) -> Pipeline:
    for row in views.list_jobs(store):
        if row["job_id"] == pipeline_id:
            latest = views.list_checkpoints(store, pipeline_id, limit=1)
            return _pipeline(row, latest, may_access(caller, pipeline_id, "PUT"))
    raise UnknownJobError(f"unknown pipeline {pipeline_id!r}")


@app.get(
    "/api/pipelines/{pipeline_id}/summary",
    response_model=PipelineSummary,
    responses=ERRORS,
    summary="Counts by status, min/avg/max duration and size, latest of each kind",
)
def pipeline_summary(pipeline_id: ReadablePipeline, store: MetastoreDep) -> PipelineSummary:
    return PipelineSummary(**views.checkpoint_stats(store, pipeline_id))


@app.get(
    "/api/pipelines/{pipeline_id}/checkpoints",
    response_model=CheckpointPage,
    responses=ERRORS,
    summary="Checkpoint history, newest first",
)
def list_checkpoints(
    pipeline_id: ReadablePipeline,
    store: MetastoreDep,
    status_: Annotated[StatusFilter | None, Query(alias="status")] = None,
    type_: Annotated[TypeFilter | None, Query(alias="type")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = DEFAULT_PAGE,
    offset: Annotated[int, Query(ge=0, le=MAX_ID)] = 0,
) -> CheckpointPage:
    status_value = status_.value if status_ else None
    type_value = type_.value if type_ else None
    rows = views.list_checkpoints(
        store,
        pipeline_id,
        status=status_value,
        checkpoint_type=type_value,
        limit=limit,
        offset=offset,
    )
    total = views.count_checkpoints(
        store, pipeline_id, status=status_value, checkpoint_type=type_value
    )
    return CheckpointPage(
        checkpoints=[CheckpointSummary(**r) for r in rows], total=total, limit=limit, offset=offset
    )


@app.get(
    "/api/pipelines/{pipeline_id}/checkpoints/{checkpoint_id}",
    response_model=CheckpointDetail,
    responses=ERRORS,
    summary="One checkpoint, per operator subtask",
)
def get_checkpoint(
    pipeline_id: ReadablePipeline,
    checkpoint_id: Annotated[int, Path(ge=1, le=MAX_ID)],
    store: MetastoreDep,
) -> CheckpointDetail:
    return CheckpointDetail(**views.checkpoint_detail(store, pipeline_id, checkpoint_id))


@app.post(
    "/api/pipelines/{pipeline_id}/checkpoints/{checkpoint_id}/discard",
    response_model=CheckpointSummary,
    responses={
        **ERRORS,
        403: {"model": Problem, "description": "no edit access, or a cross-site request"},
        409: {"model": Problem, "description": "not a completed savepoint"},
    },
    summary="Discard a completed savepoint (its files are deleted)",
)
def discard_savepoint(
    pipeline_id: EditablePipeline,
    checkpoint_id: Annotated[int, Path(ge=1, le=MAX_ID)],
    store: MetastoreDep,
) -> CheckpointSummary:
    """Marks the savepoint DISCARDED, so that no restore picks it, then deletes its files.
    Checkpoints are not user-owned (retention discards them): 409, as for any savepoint that is
    not COMPLETED."""
    from checkpointing.models import Job
    from checkpointing.storage import CheckpointStorage

    with store.transaction() as s:
        job = s.get(Job, pipeline_id)
        if job is None:
            raise UnknownJobError(f"unknown pipeline {pipeline_id!r}")
        storage_url = job.storage_url
    savepoints.discard_savepoint(
        store, CheckpointStorage.from_url(storage_url), pipeline_id, checkpoint_id
    )
    detail = views.checkpoint_detail(store, pipeline_id, checkpoint_id)
    return CheckpointSummary(**detail)


def may_trigger(caller: Caller, dag_id: str) -> bool:
    """Whether the auth manager lets the caller trigger runs of ``dag_id``: what Airflow's own
    ``POST /api/v2/dags/{dag_id}/dagRuns`` asks (``POST`` on the DAG's runs)."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import (
        DagAccessEntity,
        DagDetails,
    )
    from airflow.models.dag import DagModel

    return bool(
        get_auth_manager().is_authorized_dag(
            method="POST",
            access_entity=DagAccessEntity.RUN,
            details=DagDetails(id=dag_id, team_name=DagModel.get_team_name(dag_id)),
            user=caller.user,
        )
    )


@app.post(
    "/api/pipelines/{pipeline_id}/checkpoints/{checkpoint_id}/restore",
    response_model=DeployRun,
    status_code=status.HTTP_202_ACCEPTED,
    responses={
        **ERRORS,
        403: {
            "model": Problem,
            "description": "no edit access, no permission to trigger the deploy DAG, or a "
            "cross-site request",
        },
        409: {
            "model": Problem,
            "description": "not a completed checkpoint or savepoint, its files do not verify, "
            "the pipeline is running, or the deploy DAG is not available",
        },
    },
    summary="Restore from here: run the deploy DAG from this checkpoint or savepoint",
)
def restore_from_checkpoint(
    pipeline_id: EditablePipeline,
    checkpoint_id: Annotated[int, Path(ge=1, le=MAX_ID)],
    caller: CallerDep,
    store: MetastoreDep,
    request: Request,
    body: RestoreRequestBody | None = None,
) -> DeployRun:
    """Triggers a run of the ``checkpoint_deploy`` DAG with ``from`` = the checkpoint's
    ``_metadata`` path, once the checkpoint is COMPLETED, its ``_metadata`` and file sizes verify
    (as the deploy's ``check`` does) and, given a parallelism, its state can be assigned to it.
    Needs edit access to the pipeline's DAG and the permission to trigger the deploy DAG."""
    from checkpointing.models import Job
    from checkpointing.properties import JobStatus
    from checkpointing.restore import load_checkpoint, preview_restore
    from checkpointing.storage import CheckpointStorage

    if not may_trigger(caller, DEPLOY_DAG_ID):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"user {caller.name!r} may not trigger the DAG {DEPLOY_DAG_ID}: restoring needs the "
            "permission to run it",
        )
    parallelism = body.parallelism if body else None
    row = views.checkpoint_detail(store, pipeline_id, checkpoint_id)  # unknown: 404
    if row["status"] != CheckpointStatus.COMPLETED.value:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"checkpoint {checkpoint_id} of pipeline {pipeline_id} is {row['status']}: only a "
            "COMPLETED checkpoint or savepoint can be restored",
        )
    with store.transaction() as s:
        job = s.get(Job, pipeline_id)
        if job is None:
            raise UnknownJobError(f"unknown pipeline {pipeline_id!r}")
        storage_url, job_status = job.storage_url, job.status
    if job_status == JobStatus.RUNNING:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"pipeline {pipeline_id} is running: stop it first (Stop with savepoint), then restore",
        )
    storage = CheckpointStorage.from_url(storage_url)
    try:
        decision = load_checkpoint(store, storage, pipeline_id, checkpoint_id, deep=False)
        if parallelism is not None:
            preview_restore(
                store,
                storage,
                pipeline_id,
                parallelism=parallelism,
                source=str(checkpoint_id),
                deep=False,
            )
    except (StorageError, ValueError) as exc:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"checkpoint {checkpoint_id} of pipeline {pipeline_id} cannot be restored: its "
            f"files do not verify ({exc})",
        ) from None
    conf = {"pipeline": pipeline_id, "from": decision.metadata_path, "parallelism": parallelism}
    run_id, run_state = _trigger_deploy(conf, caller)
    root = request.scope.get("root_path", "").rstrip("/").removesuffix(URL_PREFIX)
    return DeployRun(
        dag_id=DEPLOY_DAG_ID,
        dag_run_id=run_id,
        state=run_state,
        conf=conf,
        url=f"{root}/dags/{DEPLOY_DAG_ID}/runs/{quote(run_id, safe='')}",
    )


def _trigger_deploy(conf: dict[str, Any], caller: Caller) -> tuple[str, str]:
    """A queued manual run of the deploy DAG, as Airflow's REST API creates one (its params
    validated against the conf), else 409 when the DAG is not in Airflow's database."""
    from airflow.api.common.trigger_dag import trigger_dag
    from airflow.exceptions import DagNotFound, ParamValidationError
    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session
    from airflow.utils.types import DagRunTriggeredByType
    from sqlalchemy import select

    unavailable = HTTPException(
        status.HTTP_409_CONFLICT,
        f"deploy DAG {DEPLOY_DAG_ID} is not available: deploy dags/{DEPLOY_DAG_ID}.py to "
        "Airflow's DAGs folder and let the dag-processor parse it",
    )
    with create_session() as session:
        deployed = session.scalar(
            select(DagModel.dag_id).where(~DagModel.is_stale, DagModel.dag_id == DEPLOY_DAG_ID)
        )
        if deployed is None:
            raise unavailable
        try:
            run = trigger_dag(
                DEPLOY_DAG_ID,
                triggered_by=DagRunTriggeredByType.REST_API,
                triggering_user_name=caller.name,
                conf=conf,
                session=session,
            )
        except DagNotFound:
            raise unavailable from None
        except (ParamValidationError, ValueError) as exc:
            raise HTTPException(
                status.HTTP_409_CONFLICT, f"the deploy DAG refused the run: {exc}"
            ) from None
        if run is None:
            raise unavailable
        session.flush()
        return str(run.run_id), str(getattr(run.state, "value", run.state))


@app.get(
    "/api/pipelines/{pipeline_id}/restores",
    response_model=RestoreList,
    responses=ERRORS,
    summary="Restore history, newest first",
)
def list_restores(
    pipeline_id: ReadablePipeline,
    store: MetastoreDep,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = DEFAULT_PAGE,
    offset: Annotated[int, Query(ge=0, le=MAX_ID)] = 0,
) -> RestoreList:
    """A page of the pipeline's restores; only that page is read from the metastore."""
    from sqlalchemy import func, select

    from checkpointing.models import Job, RestoreEvent

    with store.transaction() as s:
        if s.get(Job, pipeline_id) is None:
            raise UnknownJobError(f"unknown job {pipeline_id!r} (see `ckpt jobs`)")
        mine = RestoreEvent.job_id == pipeline_id
        total = s.scalar(select(func.count()).select_from(RestoreEvent).where(mine)) or 0
        rows = s.scalars(
            select(RestoreEvent)
            .where(mine)
            .order_by(RestoreEvent.restore_id.desc())
            .limit(limit)
            .offset(offset)
        )
        restores = [
            Restore(
                restore_id=r.restore_id,
                attempt=r.attempt,
                checkpoint_id=r.checkpoint_id,
                checkpoint_type=r.checkpoint_type,
                external_path=r.external_path,
                parallelism=r.parallelism,
                status=str(getattr(r.status, "value", r.status)),
                fallbacks=(r.fallbacks or {}).get("skipped", []),
                assignment=r.assignment,
                message=r.message,
                created_at=r.created_at,
            )
            for r in rows
        ]
    return RestoreList(restores=restores, total=total, limit=limit, offset=offset)


@app.get(
    "/api/pipelines/{pipeline_id}/requests",
    response_model=RequestList,
    responses=ERRORS,
    summary="Savepoint and checkpoint requests, newest first",
)
def list_requests(
    pipeline_id: ReadablePipeline,
    store: MetastoreDep,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = DEFAULT_PAGE,
) -> RequestList:
    return RequestList(
        requests=[RequestSummary(**r) for r in views.list_requests(store, pipeline_id, limit=limit)]
    )


def _request_state(state: savepoints.RequestState) -> RequestState:
    return RequestState(**state.to_dict(), done=state.done, succeeded=state.succeeded)


@app.post(
    "/api/pipelines/{pipeline_id}/savepoints",
    response_model=RequestState,
    status_code=status.HTTP_202_ACCEPTED,
    responses={
        **ERRORS,
        403: {"model": Problem, "description": "no edit access, or a cross-site request"},
        409: {"model": Problem, "description": "the pipeline is not running"},
    },
    summary="Request a savepoint (stop: then end the job)",
)
def request_savepoint(
    pipeline_id: EditablePipeline,
    caller: CallerDep,
    store: MetastoreDep,
    request: Request,
    response: Response,
    body: SavepointRequestBody | None = None,
) -> RequestState:
    """Queues the request; the job's coordinator takes it at its next epoch boundary. Follow it
    at the ``Location`` it answers with. A pipeline that is not running answers 409."""
    request_id = savepoints.request_savepoint(
        store,
        pipeline_id,
        stop=body.stop if body else False,
        requested_by=f"airflow:{caller.name}"[:256],
    )
    response.headers["Location"] = str(
        request.url_for("get_request", pipeline_id=pipeline_id, request_id=str(request_id))
    )
    return _request_state(savepoints.request_status(store, pipeline_id, request_id))


@app.get(
    "/api/pipelines/{pipeline_id}/requests/{request_id}",
    response_model=RequestState,
    responses=ERRORS,
    summary="Where a savepoint request stands",
)
def get_request(
    pipeline_id: ReadablePipeline,
    request_id: Annotated[int, Path(ge=1, le=MAX_REQUEST_ID)],
    store: MetastoreDep,
) -> RequestState:
    return _request_state(savepoints.request_status(store, pipeline_id, request_id))


@app.get(
    "/api/pipelines/{pipeline_id}/restore-plan",
    response_model=RestorePlan,
    responses={
        **ERRORS,
        409: {"model": Problem, "description": "the chosen checkpoint's files do not verify"},
    },
    summary="Dry run of a restore at a parallelism",
)
def restore_plan(
    pipeline_id: ReadablePipeline,
    store: MetastoreDep,
    parallelism: Annotated[int, Query(ge=1, le=MAX_PARALLELISM)],
    source: Annotated[
        str,
        Query(
            alias="from",
            pattern=r"^(latest|[1-9][0-9]{0,18})$",
            description="latest (falls back past unusable checkpoints) or a checkpoint id",
        ),
    ] = "latest",
) -> RestorePlan:
    """Which checkpoint a restore would read and what each new subtask would get; nothing is
    recorded. Files are checked by size (not checksum), as the deploy DAG's check does, so that
    a preview stays cheap on big state."""
    from checkpointing.models import Job
    from checkpointing.restore import preview_restore
    from checkpointing.storage import CheckpointStorage

    with store.transaction() as s:
        job = s.get(Job, pipeline_id)
        if job is None:
            raise UnknownJobError(f"unknown pipeline {pipeline_id!r}")
        storage_url = job.storage_url
    preview = preview_restore(
        store,
        CheckpointStorage.from_url(storage_url),
        pipeline_id,
        parallelism=parallelism,
        source=source,
        deep=False,
    )
    return RestorePlan(**preview.to_dict())
