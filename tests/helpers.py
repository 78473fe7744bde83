"""Shared helpers for the coordinator behaviour tests: build a job, write task snapshots, ack,
and read back what the metastore and the storage hold."""

from __future__ import annotations

import random
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import select

from checkpointing.clock import ManualClock
from checkpointing.config import CheckpointConfig
from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.failure import TolerableFailuresExceeded
from checkpointing.coordination.gateway import AckOutcome
from checkpointing.coordination.pending import PendingCheckpoint, TaskAck, TaskSpec
from checkpointing.coordination.store import CompletedCheckpoint
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import (
    Checkpoint,
    CheckpointAck,
    CheckpointRequest,
    CheckpointTask,
    Job,
    RestoreEvent,
)
from checkpointing.state.storage import CheckpointStorage, FileSystemCheckpointStorage

JOB = "job-a"


def make_plan(operators: dict[str, int] | None = None, *, attempt: str = "a0") -> list[TaskSpec]:
    """One task per subtask of each operator; attempt ids ``<op>-<i>-<attempt>``."""
    operators = operators or {"source": 2, "sink": 1}
    return [
        TaskSpec(op, i, f"{op}-{i}-{attempt}", parallelism, max_parallelism=16)
        for op, parallelism in operators.items()
        for i in range(parallelism)
    ]


class Plan:
    """A mutable plan provider: tests swap ``tasks`` (or set None: tasks not running)."""

    def __init__(self, tasks: Sequence[TaskSpec] | None) -> None:
        self.tasks = list(tasks) if tasks is not None else None

    def __call__(self) -> list[TaskSpec] | None:
        return self.tasks


def new_coordinator(
    metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
    *,
    plan: Sequence[TaskSpec] | Plan | None = None,
    job_id: str = JOB,
    failures: list[TolerableFailuresExceeded] | None = None,
    listeners: Sequence[Callable[[CompletedCheckpoint], None]] = (),
    seed: int | None = None,
    **config: Any,
) -> CheckpointCoordinator:
    """A coordinator for ``job_id`` with ``config`` passed through ``CheckpointConfig.parse``."""
    provider = plan if isinstance(plan, Plan) else Plan(plan if plan is not None else make_plan())
    return CheckpointCoordinator(
        job_id,
        metastore,
        storage,
        CheckpointConfig.parse(config),
        clock=clock,
        plan_provider=provider,
        completion_listeners=listeners,
        on_job_failure=failures.append if failures is not None else None,
        scheduler_rng=random.Random(seed) if seed is not None else None,
    )


def snapshot(
    storage: CheckpointStorage,
    pending: PendingCheckpoint,
    task: TaskSpec,
    data: bytes | None = None,
) -> TaskAck:
    """Write the task's snapshot file inside the checkpoint's location; return its ack."""
    name = f"{task.operator_id}-{task.subtask_index}-{task.attempt_id}"
    url = storage.location_for(pending.location).file_url(name)
    info = storage.write_bytes(url, data if data is not None else f"state of {name}".encode())
    return TaskAck(task.attempt_id, info.url, info.size, info.checksum)


def ack_all(
    coordinator: CheckpointCoordinator, pending: PendingCheckpoint, *, batch: bool = True
) -> AckOutcome:
    """Snapshot and acknowledge every task of ``pending``; return the last outcome."""
    acks = [snapshot(coordinator.storage, pending, t) for t in pending.tasks]
    if batch:
        return coordinator.receive_acknowledge(pending.checkpoint_id, acks)
    outcome = None
    for a in acks:
        outcome = coordinator.receive_acknowledge(pending.checkpoint_id, [a])
    assert outcome is not None
    return outcome


def complete(coordinator: CheckpointCoordinator, **trigger: Any) -> CompletedCheckpoint:
    """Trigger (checkpoint or, with ``savepoint=True``, a savepoint) and ack everything."""
    if trigger.pop("savepoint", False):
        pending = coordinator.trigger_savepoint(**trigger)
    else:
        pending = coordinator.trigger_checkpoint(**trigger)
    outcome = ack_all(coordinator, pending)
    assert outcome.completed is not None, outcome
    return outcome.completed


# ---------------------------------------------------------------- reading the metastore


def checkpoint_row(metastore: Metastore, checkpoint_id: int, job_id: str = JOB) -> Checkpoint:
    with metastore.transaction() as s:
        row = s.get(Checkpoint, (job_id, checkpoint_id))
        assert row is not None, f"no checkpoint {checkpoint_id}"
        return row


def checkpoint_rows(metastore: Metastore, job_id: str = JOB) -> list[Checkpoint]:
    with metastore.transaction() as s:
        return list(
            s.scalars(
                select(Checkpoint)
                .where(Checkpoint.job_id == job_id)
                .order_by(Checkpoint.checkpoint_id)
            )
        )


def statuses(metastore: Metastore, job_id: str = JOB) -> dict[int, str]:
    return {r.checkpoint_id: r.status for r in checkpoint_rows(metastore, job_id)}


def job_row(metastore: Metastore, job_id: str = JOB) -> Job:
    with metastore.transaction() as s:
        job = s.get(Job, job_id)
        assert job is not None
        return job


def task_rows(metastore: Metastore, checkpoint_id: int, job_id: str = JOB) -> list[CheckpointTask]:
    with metastore.transaction() as s:
        return list(
            s.scalars(
                select(CheckpointTask).where(
                    CheckpointTask.job_id == job_id, CheckpointTask.checkpoint_id == checkpoint_id
                )
            )
        )


def ack_rows(metastore: Metastore, checkpoint_id: int, job_id: str = JOB) -> list[CheckpointAck]:
    with metastore.transaction() as s:
        return list(
            s.scalars(
                select(CheckpointAck).where(
                    CheckpointAck.job_id == job_id, CheckpointAck.checkpoint_id == checkpoint_id
                )
            )
        )


def request_rows(metastore: Metastore, job_id: str = JOB) -> list[CheckpointRequest]:
    with metastore.transaction() as s:
        return list(
            s.scalars(
                select(CheckpointRequest)
                .where(CheckpointRequest.job_id == job_id)
                .order_by(CheckpointRequest.request_id)
            )
        )


def restore_rows(metastore: Metastore, job_id: str = JOB) -> list[RestoreEvent]:
    with metastore.transaction() as s:
        return list(
            s.scalars(
                select(RestoreEvent)
                .where(RestoreEvent.job_id == job_id)
                .order_by(RestoreEvent.restore_id)
            )
        )


def failures_count(metastore: Metastore, job_id: str = JOB) -> int:
    return job_row(metastore, job_id).consecutive_failures


# ---------------------------------------------------------------- reading the storage


def path(storage: FileSystemCheckpointStorage, url: str) -> Path:
    return storage.path_of(url)


def location_exists(storage: FileSystemCheckpointStorage, url: str) -> bool:
    return storage.path_of(url).is_dir()


def free_port() -> int:
    """A TCP port free on loopback now (for a server a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
