"""Who may do what in the checkpoint API: the caller's Airflow login, per-DAG permissions,
refusal of cross-site forgeries and of large or unauthenticated request bodies.

Airflow does not protect plugin endpoints, so every route depends on :func:`authenticated`: the
caller's Airflow JWT (``Authorization: Bearer`` from ``POST /auth/token``, or the ``_token``
cookie of Airflow's UI) resolved by Airflow's auth manager, else 401. A pipeline's DAG id is its
job id, so reads need read (``GET``) access to that DAG and actions edit (``PUT``) access, else
403. Actions authenticated by the cookie, which browsers attach on their own, must carry
:data:`CSRF_HEADER` and come from Airflow's own origin (:func:`_refuse_forgery`).

Airflow's auth and models are imported when a request needs them, i.e. only in the api-server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from fastapi import Depends, HTTPException, Path, Request, status
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from checkpointing.errors import InvalidIdError
from checkpointing.ids import validate_id
from checkpointing.pipeline.interval import pipeline_of
from checkpointing_airflow.api.airflow_internals import dag_team_name, request_user
from checkpointing_airflow.dag_defaults import JOB_ID_PATTERN

#: the header a cookie-authenticated action must carry (any non-empty value): a cross-site form
#: cannot set it, and cross-site ``fetch`` needs a CORS preflight that this app never grants
CSRF_HEADER = "X-Requested-By"
#: a job id, the pipeline's DAG id, as a path pattern (the one of ``checkpointing.ids``)
PIPELINE_ID_PATTERN = JOB_ID_PATTERN
#: Starlette renamed the constant (…_ENTITY → …_CONTENT); the number is what clients see
UNPROCESSABLE = 422
#: the largest request body taken (the action bodies are a few bytes of JSON): larger ones are
#: refused with 413 by their Content-Length, before the body is read or the login checked
MAX_BODY = 64 * 1024


@dataclass(frozen=True)
class Caller:
    """An authenticated Airflow user, and whether the browser's cookie (rather than an explicit
    bearer token) authenticated the request."""

    user: Any
    by_cookie: bool

    @property
    def name(self) -> str:
        return str(self.user.get_name())


bearer = HTTPBearer(
    auto_error=False,
    description="Airflow's JWT: `POST /auth/token` with username and password",
)


async def authenticated(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> Caller:
    """The caller, as Airflow's own API resolves it (bearer token first, else the UI's cookie,
    refreshed by Airflow's middleware), else 401. Airflow answers a token that does not verify
    with 403; here anything short of a valid login is 401, so that clients know to log in."""
    try:
        user = await request_user(request, credentials)
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

    dag_id = pipeline_of(pipeline_id)  # an interval's job instance is its pipeline's
    return bool(
        get_auth_manager().is_authorized_dag(
            method=method,
            details=DagDetails(id=dag_id, team_name=dag_team_name(dag_id)),
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


def may_trigger(caller: Caller, dag_id: str) -> bool:
    """Whether the auth manager lets the caller trigger runs of ``dag_id``: what Airflow's own
    ``POST /api/v2/dags/{dag_id}/dagRuns`` asks (``POST`` on the DAG's runs)."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import (
        DagAccessEntity,
        DagDetails,
    )

    return bool(
        get_auth_manager().is_authorized_dag(
            method="POST",
            access_entity=DagAccessEntity.RUN,
            details=DagDetails(id=dag_id, team_name=dag_team_name(dag_id)),
            user=caller.user,
        )
    )


class BoundedBodies:
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
                await authenticated(request, await bearer(request))
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
