"""The checkpoint API's actions, for a caller who may edit the pipeline's DAG: discard a
savepoint, restore from a checkpoint (a run of the deploy DAG), request a savepoint. Each is a
call of the core library; nothing here talks to Spark."""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, HTTPException, Path, Request, Response, status

from checkpointing.coordination import savepoints
from checkpointing.errors import StorageError
from checkpointing.metastore import views
from checkpointing.status import CheckpointStatus
from checkpointing_airflow.api import airflow_internals
from checkpointing_airflow.api.auth import Caller, CallerDep, EditablePipeline, may_trigger
from checkpointing_airflow.api.metastore import MetastoreDep, pipeline_job
from checkpointing_airflow.api.schemas import (
    ERRORS,
    MAX_ID,
    URL_PREFIX,
    CheckpointSummary,
    DeployRun,
    Problem,
    RequestState,
    RestoreRequestBody,
    SavepointRequestBody,
    request_state,
)
from checkpointing_airflow.dag_defaults import DEPLOY_DAG_ID

router = APIRouter()


@router.post(
    "/api/pipelines/{pipeline_id}/checkpoints/{checkpoint_id}/discard",
    response_model=CheckpointSummary,
    responses={
        **ERRORS,
        403: {"model": Problem, "description": "no edit access, or a cross-site request"},
        409: {
            "model": Problem,
            "description": "not a completed savepoint, or the pipeline's storage_url is "
            "outside the configured storage roots",
        },
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
    from checkpointing.state.storage import CheckpointStorage

    # the row's storage_url only inside the configured roots (else 409, nothing deleted)
    storage_url = pipeline_job(store, pipeline_id).storage_url
    savepoints.discard_savepoint(
        store, CheckpointStorage.from_job_row(pipeline_id, storage_url), pipeline_id, checkpoint_id
    )
    detail = views.checkpoint_detail(store, pipeline_id, checkpoint_id)
    return CheckpointSummary(**detail)


@router.post(
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
            "the pipeline is running, its storage_url is outside the configured storage "
            "roots, or the deploy DAG is not available",
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
    from checkpointing.restore.lookup import load_checkpoint, preview_restore
    from checkpointing.state.storage import CheckpointStorage

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
    job = pipeline_job(store, pipeline_id)
    if job.is_running:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"pipeline {pipeline_id} is running: stop it first (Stop with savepoint), then restore",
        )
    storage = CheckpointStorage.from_job_row(pipeline_id, job.storage_url)  # else 409
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
    try:
        return airflow_internals.trigger_manual_run(DEPLOY_DAG_ID, conf, caller.name)
    except airflow_internals.DagUnavailable:
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"deploy DAG {DEPLOY_DAG_ID} is not available: deploy dags/{DEPLOY_DAG_ID}.py to "
            "Airflow's DAGs folder and let the dag-processor parse it",
        ) from None
    except airflow_internals.RunRefused as exc:
        raise HTTPException(
            status.HTTP_409_CONFLICT, f"the deploy DAG refused the run: {exc}"
        ) from None


@router.post(
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
    return request_state(savepoints.request_status(store, pipeline_id, request_id))
