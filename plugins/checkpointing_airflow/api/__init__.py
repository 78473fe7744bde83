"""The checkpoint REST API: a FastAPI app that Airflow's api-server mounts under ``/checkpoints``
(registered by :mod:`checkpointing_airflow.checkpoints_plugin`).

JSON for the Checkpoints UI and for scripts, in four rooms:

- :mod:`~checkpointing_airflow.api.schemas`: the JSON shapes (responses, bodies, filters);
- :mod:`~checkpointing_airflow.api.auth`: who may do what (Airflow login, per-DAG read and edit
  access, cross-site forgery, request-body limits);
- :mod:`~checkpointing_airflow.api.routes`: the reads, queries of
  :mod:`checkpointing.metastore.views`;
- :mod:`~checkpointing_airflow.api.actions`: discard a savepoint, restore, request a savepoint;

plus :mod:`~checkpointing_airflow.api.metastore` (the metastore dependency and the HTTP status of
the core library's errors). This module assembles the app: those routes, the OpenAPI schema and
the Checkpoints page, each behind a login.

Airflow's plugin manager imports every ``.py`` file under ``plugins/``, in every component: this
package imports only FastAPI, pydantic and the core library at import time; Airflow's auth and
models are imported when a request needs them, i.e. only inside the api-server.
"""

from __future__ import annotations

from pathlib import Path as FilePath
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request, status
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from fastapi.security import HTTPAuthorizationCredentials

from checkpointing.errors import CheckpointingError
from checkpointing_airflow.api import actions, routes
from checkpointing_airflow.api.auth import BoundedBodies, CallerDep, authenticated, bearer
from checkpointing_airflow.api.metastore import checkpointing_error
from checkpointing_airflow.api.schemas import URL_PREFIX

__all__ = ["UI_PAGE", "URL_PREFIX", "app"]

#: the Checkpoints page: one self-contained HTML file with plain JS (no build step, no CDN)
UI_PAGE = FilePath(__file__).parent.parent / "ui.html"

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
app.add_exception_handler(CheckpointingError, checkpointing_error)  # type: ignore[arg-type]
app.add_middleware(BoundedBodies)


@app.get("/openapi.json", include_in_schema=False)
def openapi(request: Request, _caller: CallerDep) -> JSONResponse:
    """The OpenAPI schema, with the mount point as its server so that "try it out" works."""
    schema = dict(app.openapi())
    schema["servers"] = [{"url": request.scope.get("root_path", "").rstrip("/") or "/"}]
    return JSONResponse(schema)


@app.get("/ui/", include_in_schema=False, response_model=None)
async def ui(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
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


app.include_router(routes.router)
app.include_router(actions.router)
