"""The checkpoint API's reads: pipelines, their checkpoints (filtered, paged), one checkpoint's
acks, restores, savepoint requests and restore plans. Every read is a query of
:mod:`checkpointing.metastore.views` (the same data as ``ckpt … --json``) for a caller who may
read the pipeline's DAG (:mod:`checkpointing_airflow.api.auth`)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query

from checkpointing.coordination import savepoints
from checkpointing.errors import UnknownJobError
from checkpointing.metastore import views
from checkpointing_airflow.api.auth import CallerDep, ReadablePipeline, may_access
from checkpointing_airflow.api.metastore import MetastoreDep, pipeline_job
from checkpointing_airflow.api.schemas import (
    DEFAULT_PAGE,
    ERRORS,
    MAX_ID,
    MAX_PAGE,
    MAX_PARALLELISM,
    MAX_REQUEST_ID,
    CheckpointDetail,
    CheckpointPage,
    CheckpointSummary,
    Pipeline,
    PipelineList,
    PipelineSummary,
    Problem,
    RequestList,
    RequestState,
    RequestSummary,
    Restore,
    RestoreList,
    RestorePlan,
    StatusFilter,
    TypeFilter,
    request_state,
)

router = APIRouter()


def _pipeline(row: dict[str, Any], latest: list[dict[str, Any]], can_edit: bool) -> Pipeline:
    return Pipeline(
        **row,
        running=row["status"] == "RUNNING",
        latest_checkpoint=CheckpointSummary(**latest[0]) if latest else None,
        can_edit=can_edit,
    )


@router.get(
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


@router.get(
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


@router.get(
    "/api/pipelines/{pipeline_id}/summary",
    response_model=PipelineSummary,
    responses=ERRORS,
    summary="Counts by status, min/avg/max duration and size, latest of each kind",
)
def pipeline_summary(pipeline_id: ReadablePipeline, store: MetastoreDep) -> PipelineSummary:
    return PipelineSummary(**views.checkpoint_stats(store, pipeline_id))


@router.get(
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


@router.get(
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


@router.get(
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
    """A page of the pipeline's restores (``ckpt restores --json``); only that page is read
    from the metastore."""
    rows = views.list_restores(store, pipeline_id, limit=limit, offset=offset)
    total = views.count_restores(store, pipeline_id)
    return RestoreList(
        restores=[Restore(**r) for r in rows], total=total, limit=limit, offset=offset
    )


@router.get(
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


@router.get(
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
    return request_state(savepoints.request_status(store, pipeline_id, request_id))


@router.get(
    "/api/pipelines/{pipeline_id}/restore-plan",
    response_model=RestorePlan,
    responses={
        **ERRORS,
        409: {
            "model": Problem,
            "description": "the chosen checkpoint's files do not verify, or the pipeline's "
            "storage_url is outside the configured storage roots",
        },
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
    from checkpointing.restore.lookup import preview_restore
    from checkpointing.state.storage import CheckpointStorage

    preview = preview_restore(
        store,
        CheckpointStorage.from_job_row(pipeline_id, pipeline_job(store, pipeline_id).storage_url),
        pipeline_id,
        parallelism=parallelism,
        source=source,
        deep=False,
    )
    return RestorePlan(**preview.to_dict())
