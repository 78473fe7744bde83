"""Per-pipeline permission checks of the generic DAGs (savepoint, deploy): Airflow checks only
the permission to trigger those DAGs, so their tasks check that the run's triggering user may
edit the target pipeline's own DAG."""

from __future__ import annotations

import logging
from typing import Any, Literal

from checkpointing.errors import CheckpointingError
from checkpointing.pipeline.interval import pipeline_of

log = logging.getLogger(__name__)


class PermissionRefused(CheckpointingError):
    """The user who triggered a savepoint or deploy run may not edit the target pipeline's DAG."""


def authorize_trigger(
    user_name: str | None,
    job_id: str,
    *,
    team_name: str | None = None,
    method: Literal["GET", "PUT"] = "PUT",
) -> str:
    """That ``user_name`` (a run's ``triggering_user_name``) may edit (``PUT``; read with
    ``method="GET"``) the DAG of pipeline ``job_id``, asked of the configured auth manager;
    returns the name, else raises :class:`PermissionRefused`.

    Airflow checks only the permission to trigger the generic savepoint and deploy DAGs, and its
    tasks cannot reach Airflow's database (the task SDK blocks it), so the check is made here with
    what a worker has: the auth manager's configuration. SimpleAuthManager's users and roles are
    configuration, so they are checked; in multi-team mode the pipeline's team is ``team_name``
    (the generic DAGs act only on the specs of their own folder, i.e. their own bundle and team).
    Other auth managers (FAB, Keycloak) keep users in a database or an identity provider that a
    task cannot ask: the run is refused, and a deployment that wants the generic DAGs anyway
    builds them with ``check_permissions=False`` and grants them only to users who may edit
    every pipeline. A run without a triggering user, or by a name the auth manager does not know,
    is refused."""
    from airflow.api_fastapi.app import create_auth_manager, get_auth_manager_cls
    from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager
    from airflow.configuration import conf

    verb = "edit" if method == "PUT" else "read"
    if not user_name:
        raise PermissionRefused(
            f"pipeline {job_id}: the run has no triggering user, so its permission to {verb} the "
            f"DAG {job_id} cannot be checked; trigger it as a user"
        )
    manager_cls = get_auth_manager_cls()
    if not issubclass(manager_cls, SimpleAuthManager):
        raise PermissionRefused(
            f"pipeline {job_id}: the auth manager {manager_cls.__name__} cannot be asked from a "
            f"task whether user {user_name!r} may {verb} the DAG {job_id}; trigger the pipeline's "
            "own DAG, or see docs/airflow.md (check_permissions) to use this DAG anyway"
        )
    if conf.getboolean("core", "simple_auth_manager_all_admins", fallback=False):
        return user_name  # every visitor is an admin
    manager = create_auth_manager()
    user = next((u for u in manager.get_users() if u.username == user_name), None)
    dag_id = pipeline_of(job_id)  # an interval's job instance is its pipeline's DAG
    allowed = user is not None and manager.is_authorized_dag(
        method=method, details=DagDetails(id=dag_id, team_name=team_name), user=user
    )
    if not allowed and method == "GET":
        raise PermissionRefused(
            f"user {user_name!r} may not read the DAG {job_id}: a deploy from another pipeline's "
            "checkpoint or savepoint needs the permission to read that pipeline's DAG"
        )
    if not allowed:
        raise PermissionRefused(
            f"user {user_name!r} may not edit the DAG {job_id}: savepoints, deploys and chosen "
            "restores of a pipeline need the permission to edit its own DAG"
        )
    return user_name


def authorize_run(dag_run: Any, job_id: str, *, jobs: list[str]) -> None:
    """The generic DAGs' check, failing the task for good: ``job_id`` is one of the pipelines
    of the DAG's folder (``jobs``) and the run's triggering user may edit its DAG."""
    from airflow.sdk.exceptions import AirflowFailException

    if job_id not in jobs:
        known = ", ".join(jobs) or "none"
        raise AirflowFailException(f"pipeline: unknown pipeline {job_id!r} (known: {known})")
    try:
        user = authorize_trigger(
            getattr(dag_run, "triggering_user_name", None),
            job_id,
            team_name=getattr(dag_run, "team_name", None),
        )
    except PermissionRefused as exc:
        raise AirflowFailException(str(exc)) from None
    log.info("user %r may edit the DAG %s", user, job_id)


def authorize_source(dag_run: Any, source_job: str, *, jobs: list[str]) -> None:
    """A deploy from another pipeline's state (``allow_other_job``) reads that pipeline's state
    into the target's sink, so the run's triggering user must be allowed to read the source
    pipeline's DAG too, in its team. A worker knows a pipeline's team only for the specs of the
    generic DAG's own folder (its bundle and team): in multi-team mode a source job outside that
    folder is refused, since its team (and so the user's right on it) cannot be known."""
    from airflow.configuration import conf
    from airflow.sdk.exceptions import AirflowFailException

    team_name = getattr(dag_run, "team_name", None)
    multi_team = conf.getboolean("core", "multi_team", fallback=False)
    try:
        if multi_team and source_job not in jobs:
            raise PermissionRefused(
                f"from: job {source_job} is not a pipeline of this DAG's folder, so its team and "
                "the triggering user's right to read it cannot be checked (multi-team mode)"
            )
        user = authorize_trigger(
            getattr(dag_run, "triggering_user_name", None),
            source_job,
            team_name=team_name,
            method="GET",
        )
    except PermissionRefused as exc:
        raise AirflowFailException(str(exc)) from None
    log.info("user %r may read the DAG %s, the deploy's source", user, source_job)
