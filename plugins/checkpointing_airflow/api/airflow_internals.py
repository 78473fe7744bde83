"""Every call of the checkpoint API into Airflow's internals, one function each.

Airflow has no public Python interface for these: a plugin app inside the api-server cannot
trigger a DAG run (the public way is the REST API, ``POST /api/v2/dags/{dag_id}/dagRuns``, which
would need the caller's token forwarded to itself) nor read a DAG's team (for multi-team auth
checks) otherwise, and it resolves its caller with the api-server's own dependency
(``get_user``), whose parameters change between releases. The auth manager calls
(``get_auth_manager``, ``DagDetails``, ``DagAccessEntity``) are Airflow's public auth-manager
interface and stay in ``auth.py``.

``tests/test_provider_package.py`` checks :data:`CONTRACT` and :data:`POSITIONAL`: that the
names and parameters used here still exist, so an Airflow upgrade that changes them fails there,
loudly, rather than at the first restore or login a user tries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastapi import Request
    from fastapi.security import HTTPAuthorizationCredentials

#: what this module relies on: "module:qualified name" → the parameters it needs by name
CONTRACT: dict[str, tuple[str, ...]] = {
    "airflow.api_fastapi.core_api.security:get_user": ("request", "bearer_credentials"),
    "airflow.api.common.trigger_dag:trigger_dag": (
        "dag_id",
        "triggered_by",
        "triggering_user_name",
        "conf",
        "session",
    ),
    "airflow.models.dag:DagModel.get_team_name": ("dag_id",),
    "airflow.models.dag:DagModel.dag_id": (),
    "airflow.models.dag:DagModel.is_stale": (),
    "airflow.utils.session:create_session": (),
    "airflow.utils.types:DagRunTriggeredByType.REST_API": (),
    "airflow.exceptions:DagNotFound": (),
    "airflow.exceptions:ParamValidationError": (),
}


#: callables called by position: their leading parameters in order (None: any name)
POSITIONAL: dict[str, tuple[str | None, ...]] = {
    # the token parameter is ``oauth_token`` in Airflow 3.2 and ``_oauth_token`` in 3.3
    "airflow.api_fastapi.core_api.security:get_user": ("request", None, "bearer_credentials"),
}


class DagUnavailable(LookupError):
    """The DAG is not in Airflow's database (not deployed, not parsed yet, or stale)."""


class RunRefused(ValueError):
    """The DAG refused the run: its params did not validate against the conf."""


async def request_user(request: Request, credentials: HTTPAuthorizationCredentials | None) -> Any:
    """The user of a request as Airflow's own API resolves it: the bearer token first, else the
    UI's cookie (refreshed by Airflow's middleware); Airflow's 401/403 ``HTTPException`` when
    neither verifies. By position: the OAuth token parameter's name differs between versions
    (the bearer credentials cover that header)."""
    from airflow.api_fastapi.core_api.security import get_user

    return await get_user(request, None, credentials)


def dag_team_name(dag_id: str) -> str | None:
    """The team owning ``dag_id`` (multi-team setups), as Airflow's own DAG endpoints ask it."""
    from airflow.models.dag import DagModel

    return DagModel.get_team_name(dag_id)


def trigger_manual_run(dag_id: str, conf: dict[str, Any], user_name: str) -> tuple[str, str]:
    """A queued manual run of ``dag_id`` as Airflow's REST API creates one (its params validated
    against ``conf``, triggered by the REST API on behalf of ``user_name``): its run id and
    state. :class:`DagUnavailable` when the DAG is not in Airflow's database (or stale),
    :class:`RunRefused` when its params refuse the conf."""
    from airflow.api.common.trigger_dag import trigger_dag
    from airflow.exceptions import DagNotFound, ParamValidationError
    from airflow.models.dag import DagModel
    from airflow.utils.session import create_session
    from airflow.utils.types import DagRunTriggeredByType
    from sqlalchemy import select

    with create_session() as session:
        deployed = session.scalar(
            select(DagModel.dag_id).where(~DagModel.is_stale, DagModel.dag_id == dag_id)
        )
        if deployed is None:
            raise DagUnavailable(dag_id)
        try:
            run = trigger_dag(
                dag_id,
                triggered_by=DagRunTriggeredByType.REST_API,
                triggering_user_name=user_name,
                conf=conf,
                session=session,
            )
        except DagNotFound:
            raise DagUnavailable(dag_id) from None
        except (ParamValidationError, ValueError) as exc:
            raise RunRefused(str(exc)) from None
        if run is None:
            raise DagUnavailable(dag_id)
        session.flush()
        return str(run.run_id), str(getattr(run.state, "value", run.state))
