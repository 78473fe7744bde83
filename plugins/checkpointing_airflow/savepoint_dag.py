"""``checkpoint_savepoint``: a savepoint of a running pipeline, from the trigger form, waited
for (Flink's savepoint and stop-with-savepoint).

Airflow is imported inside the functions, so the module imports without it."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpointing.errors import CheckpointingError
from checkpointing_airflow.dag_defaults import (
    JOB_ID_PATTERN,
    METASTORE_CONN_ID,
    SAVEPOINT_DAG_ID,
    START_DATE,
    TAG,
)
from checkpointing_airflow.dag_files import known_pipelines
from checkpointing_airflow.permissions import authorize_run

if TYPE_CHECKING:
    from airflow.sdk import DAG

    from checkpointing.coordination.savepoints import RequestState
    from checkpointing.metastore.engine import Metastore

log = logging.getLogger(__name__)


def build_savepoint_dag(
    pipelines_dir: str | Path,
    *,
    metastore_conn_id: str = METASTORE_CONN_ID,
    check_permissions: bool = True,
) -> DAG:
    """``checkpoint_savepoint``: a savepoint of a running pipeline of ``pipelines_dir``, from
    the trigger form. Airflow checks only the permission to trigger this DAG, so the task checks
    that the run's triggering user may edit the target pipeline's DAG (:func:`authorize_trigger`;
    ``check_permissions=False`` turns that off, see there)."""
    from airflow.sdk import DAG, Param, get_current_context, task

    pipelines_dir = Path(pipelines_dir)
    jobs = list(known_pipelines(pipelines_dir))
    with DAG(
        dag_id=SAVEPOINT_DAG_ID,
        description="Take a savepoint of a running pipeline (optionally stopping it)",
        doc_md=(
            "### Savepoint of a running pipeline\n\n"
            "Queues a savepoint request in the checkpoint metastore; the job takes it at its "
            "next epoch boundary, and this run waits for it. The result (XCom `return_value`) "
            "is the savepoint's path, which the `checkpoint_deploy` DAG (**from**) and "
            "`ckpt run --restore` take. With **stop**, the job ends after the savepoint, "
            "Flink's stop-with-savepoint. A job that is not running fails the run at once, "
            "and so does a user who may not edit the pipeline's own DAG."
        ),
        schedule=None,
        start_date=START_DATE,
        catchup=False,
        tags=[TAG],
        params={
            "pipeline": Param(
                type="string",
                pattern=JOB_ID_PATTERN,
                title="Pipeline",
                description="The job id of the running pipeline.",
                **({"examples": jobs} if jobs else {}),
            ),
            "stop": Param(
                False,
                type="boolean",
                title="Stop after the savepoint",
                description="End the job once the savepoint completes.",
            ),
            "timeout": Param(
                600,
                type="integer",
                minimum=1,
                title="Timeout (seconds)",
                description="How long to wait for the job's next epoch boundary.",
            ),
        },
    ) as dag:

        @task(task_id="savepoint", retries=0)
        def savepoint() -> str | None:
            """The savepoint's path; the whole request state is in the XCom ``request``."""
            from checkpointing_airflow.hooks import CheckpointMetastoreHook

            context = get_current_context()
            ti = context["ti"]
            if check_permissions:
                authorize_run(
                    context["dag_run"],
                    str(context["params"]["pipeline"]),
                    jobs=list(known_pipelines(pipelines_dir)),
                )
            metastore = CheckpointMetastoreHook(metastore_conn_id).get_metastore()
            try:
                state = savepoint_from_params(
                    context["params"],
                    metastore=metastore,
                    requested_by=f"airflow:{ti.dag_id}/{ti.run_id}",
                )
            finally:
                metastore.dispose()
            ti.xcom_push(key="request", value=state.to_dict())
            return state.savepoint_path

        savepoint()
    return dag


def take_savepoint(
    metastore: Metastore,
    job_id: str,
    *,
    stop: bool,
    timeout: float,
    requested_by: str,
    poll: float = 2.0,
) -> RequestState:
    """Request a savepoint of a running job and wait until it completes."""
    from checkpointing.coordination import savepoints

    request_id = savepoints.request_savepoint(
        metastore, job_id, stop=stop, requested_by=requested_by[:256]
    )
    log.info(
        "job %s: %ssavepoint request %d queued; waiting up to %g s for its next epoch boundary",
        job_id,
        "stop-with-" if stop else "",
        request_id,
        timeout,
    )
    state = savepoints.wait_for_request(metastore, job_id, request_id, timeout=timeout, poll=poll)
    log.info(
        "job %s: savepoint %s completed: %s", job_id, state.checkpoint_id, state.savepoint_path
    )
    return state


def savepoint_from_params(
    params: Mapping[str, Any], *, metastore: Metastore, requested_by: str, poll: float = 2.0
) -> RequestState:
    """The savepoint task: a job that is not running, unknown, or whose savepoint failed or did
    not come in time fails the task without retries (retrying cannot help), with the reason."""
    from airflow.sdk.exceptions import AirflowFailException

    try:
        return take_savepoint(
            metastore,
            str(params["pipeline"]),
            stop=bool(params.get("stop", False)),
            timeout=float(params.get("timeout", 600)),
            requested_by=requested_by,
            poll=poll,
        )
    except CheckpointingError as exc:
        raise AirflowFailException(str(exc)) from None
