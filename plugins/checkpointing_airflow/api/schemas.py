"""The checkpoint API's JSON shapes: responses, request bodies and query filters.

The rows come from :mod:`checkpointing.metastore.views` and the core library's results, which are
the source of these shapes: every key they return has its field here (the API adds a few of its
own, e.g. a pipeline's ``can_edit``), and ``tests/test_checkpoint_api.py`` holds them to it. Where
a core dataclass already is the shape (a savepoint request's state, a key-group range, a
checkpoint a restore skipped), the model is derived from it (:func:`from_core`).
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from enum import StrEnum
from typing import Any, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model

from checkpointing.coordination import savepoints
from checkpointing.restore.lookup import SkippedCheckpoint as CoreSkippedCheckpoint
from checkpointing.state.keygroups import KeyGroupRange as CoreKeyGroupRange
from checkpointing.status import CheckpointStatus, CheckpointType

#: where the api-server mounts the app (not under Airflow's reserved /api/v2, /ui, /auth …)
URL_PREFIX = "/checkpoints"
MAX_ID = 2**63 - 1
MAX_REQUEST_ID = 2**31 - 1
#: Flink's upper bound of max parallelism; a restore plan above the checkpoint's own max
#: parallelism is refused by the assignment with the operator named
MAX_PARALLELISM = 32768
DEFAULT_PAGE = 50
MAX_PAGE = 500


def from_core(
    core: type,
    doc: str | None = None,
    *,
    descriptions: dict[str, str] | None = None,
    **extra: Any,
) -> type[BaseModel]:
    """A response model with the fields of the core dataclass ``core`` (same names, types and
    order, named like it), documented by ``descriptions``, plus the ``extra`` fields."""
    hints = get_type_hints(core)
    described = descriptions or {}
    fields: dict[str, Any] = {
        f.name: (hints[f.name], Field(description=described[f.name]))
        if f.name in described
        else (hints[f.name], ...)
        for f in dataclasses.fields(core)
    }
    return create_model(core.__name__, __doc__=doc, **fields, **extra)


KeyGroupRange = from_core(CoreKeyGroupRange)
SkippedCheckpoint = from_core(CoreSkippedCheckpoint)
#: where a savepoint request stands: :class:`checkpointing.coordination.savepoints.RequestState`
#: with its ``done`` and ``succeeded`` properties as fields
RequestState = from_core(
    savepoints.RequestState,
    "Where a savepoint request stands (``checkpointing.coordination.savepoints.RequestState``).",
    descriptions={
        "status": "QUEUED, TRIGGERED, COMPLETED, FAILED or DROPPED",
        "savepoint_path": "set once the savepoint completed",
    },
    done=(bool, ...),
    succeeded=(bool, ...),
)


def request_state(state: savepoints.RequestState) -> BaseModel:
    """The response of a savepoint request's state."""
    return RequestState(**state.to_dict(), done=state.done, succeeded=state.succeeded)


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
    checkpointed_size: int | None = Field(
        description="bytes this checkpoint wrote itself: an incremental one reuses the rest of "
        "its state from earlier checkpoints"
    )
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


class OperatorSummary(BaseModel):
    """One operator of a checkpoint, its subtasks taken together (a step's: the step)."""

    operator_id: str
    subtasks: int
    acked: int = Field(description="subtasks acknowledged")
    state_size: int = Field(description="bytes of the acknowledged subtasks' state")
    latest_ack: datetime | None


class RequestRef(BaseModel):
    request_id: int
    requested_by: str


class InputRun(BaseModel):
    """One run (attempt) that read part of the input, from the source's list state."""

    attempt: str | None = Field(description="the run that read it (None: not recorded)")
    compacted: bool = Field(
        default=False, description="the files earlier runs read, compacted (their runs not kept)"
    )
    first_epoch: int | None
    last_epoch: int | None
    files: int = Field(description="distinct files it read (wholly or some row groups)")
    splits: int = Field(description="splits it read (a large Parquet file is several)")
    bytes: int | None = Field(description="sum of those files' sizes, when known")


class InputFile(BaseModel):
    """One input file of the checkpoint's source state."""

    path: str = Field(description="a local path or an object's URL (s3://bucket/key)")
    epochs: list[int] = Field(description="the epochs its splits were (or are to be) read in")
    size: int | None
    etag: str | None = Field(description="an object's ETag")
    mtime: datetime | None = Field(description="a local file's modification time")
    attempts: list[str] = Field(description="the runs that read its splits")
    splits: int
    remaining_splits: int = Field(description="its splits still to read (0: read)")


class InputTable(BaseModel):
    """One file of a static table the transform joined (``tables:``), as the checkpoint
    recorded it: a restore over another version is refused unless allowed."""

    table: str
    path: str = Field(description="a local path or an object's URL (s3://bucket/key)")
    size: int | None
    etag: str | None = Field(description="an object's ETag")
    mtime: datetime | None = Field(description="a local file's modification time")


class ConsumedInput(BaseModel):
    """Which input the checkpoint's runs consumed, from the source's acknowledgements."""

    runs: list[InputRun] = Field(description="in epoch order")
    files_processed: int = Field(description="files read (wholly or partly)")
    bytes_processed: int | None
    splits_processed: int
    splits_remaining: int = Field(description="splits still to read")
    files_remaining: int
    next_epoch: int | None = Field(description="the first epoch the next run reads")
    files_total: int
    files: list[InputFile] = Field(description="by first epoch, at most 1000")
    files_omitted: int = Field(description="files not listed (beyond the limit)")
    tables: list[InputTable] = Field(
        default_factory=list, description="the static tables' files, by table and path"
    )


class CheckpointDetail(CheckpointSummary):
    """A checkpoint with its properties, every subtask's ack and the input its runs consumed
    (``ckpt show --json``)."""

    job_id: str
    properties: dict[str, bool]
    metadata_checksum: str | None
    notified_at: datetime | None
    notify_error: str | None
    request: RequestRef | None
    operators: list[OperatorSummary] = Field(description="per operator, in operator order")
    tasks: list[TaskAck]
    input: ConsumedInput | None = Field(
        description="the input consumed: None when the source did not acknowledge it"
    )


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
    from_job_id: str | None = Field(
        description="the job a checkpoint or savepoint path belongs to, when not this one"
    )
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


#: the error answers every pipeline route documents
ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": Problem, "description": "not logged in to Airflow"},
    403: {"model": Problem, "description": "no access to the pipeline's DAG"},
    404: {"model": Problem, "description": "unknown pipeline or id"},
}
