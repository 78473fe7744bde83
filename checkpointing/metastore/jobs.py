"""Jobs: the one module that reads, registers and resolves a job (its storage, its status).

Callers outside the core (CLI, Airflow plugin) get plain :class:`JobInfo` values, never ORM rows,
so the ``ckpt_jobs`` columns can change without touching them. Core code that changes the row in
a transaction it already holds uses :func:`lock_job` / :func:`register_job` with its session.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from sqlalchemy import update
from sqlalchemy.orm import Session

from checkpointing.clock import ms
from checkpointing.config import (
    ENV_STORAGE_URL,
    CheckpointConfig,
    RetentionPolicy,
    SavepointRetention,
    Settings,
)
from checkpointing.errors import UnknownJobError
from checkpointing.ids import validate_id
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Job
from checkpointing.status import JobStatus

if TYPE_CHECKING:
    from checkpointing.pipeline.spec import PipelineSpec
    from checkpointing.state.storage import CheckpointStorage


@dataclass(frozen=True)
class JobInfo:
    """What callers read of a job: its status, storage, configuration and coordinator state."""

    job_id: str
    status: JobStatus
    storage_url: str
    config: CheckpointConfig
    coordinator_id: str | None
    periodic_scheduling: bool
    consecutive_failures: int
    last_completed_id: int | None
    last_completion_at: datetime | None
    failure_cause: str | None
    created_at: datetime
    updated_at: datetime
    heartbeat_at: datetime | None = None

    @property
    def is_running(self) -> bool:
        return self.status is JobStatus.RUNNING


def config_of(job: Job) -> CheckpointConfig:
    """The job's stored ``CheckpointConfig`` (the columns written by :func:`register_job`)."""
    return CheckpointConfig(
        interval=timedelta(milliseconds=job.interval_ms) if job.interval_ms is not None else None,
        timeout=timedelta(milliseconds=job.timeout_ms),
        min_pause=timedelta(milliseconds=job.min_pause_ms),
        max_concurrent=job.max_concurrent,
        tolerable_failures=job.tolerable_failures,
        retained=job.retained,
        retention=RetentionPolicy(job.retention),
        prefer_checkpoint_for_recovery=job.prefer_checkpoint_for_recovery,
        savepoint_retention=(
            None
            if job.savepoint_keep is None and job.savepoint_max_age_ms is None
            else SavepointRetention(
                count=job.savepoint_keep,
                max_age=(
                    timedelta(milliseconds=job.savepoint_max_age_ms)
                    if job.savepoint_max_age_ms is not None
                    else None
                ),
            )
        ),
    )


def job_info(job: Job) -> JobInfo:
    """A detached, read-only copy of the row (safe to use after the session closes)."""
    return JobInfo(
        job_id=job.job_id,
        status=JobStatus(job.status),
        storage_url=job.storage_url,
        config=config_of(job),
        coordinator_id=job.coordinator_id,
        periodic_scheduling=job.periodic_scheduling,
        consecutive_failures=job.consecutive_failures,
        last_completed_id=job.last_completed_id,
        last_completion_at=job.last_completion_at,
        failure_cause=job.failure_cause,
        created_at=job.created_at,
        updated_at=job.updated_at,
        heartbeat_at=job.heartbeat_at,
    )


def unknown_job(job_id: str) -> UnknownJobError:
    """The one message for a job that is not in the metastore."""
    return UnknownJobError(f"unknown job {job_id!r} (see `ckpt jobs`)")


# ------------------------------------------------------------------------ read (own transaction)


def get_job(metastore: Metastore, job_id: str) -> JobInfo | None:
    """The job, or None when it was never registered. The id is validated first (path-safe)."""
    job_id = validate_id(job_id, "job id")
    with metastore.transaction() as s:
        job = s.get(Job, job_id)
        return job_info(job) if job is not None else None


def require_job(metastore: Metastore, job_id: str) -> JobInfo:
    """The job; :class:`UnknownJobError` when it was never registered. The one check of every
    reader that names the job before its checkpoints (the views, the restore lookup, the API)."""
    info = get_job(metastore, job_id)
    if info is None:
        raise unknown_job(job_id)
    return info


def job_exists(metastore: Metastore, job_id: str) -> bool:
    return get_job(metastore, job_id) is not None


def job_status(metastore: Metastore, job_id: str) -> JobStatus | None:
    """The job's status (Flink's ``JobStatus``), or None for a job never registered."""
    info = get_job(metastore, job_id)
    return info.status if info is not None else None


# ------------------------------------------------------------------------ storage


def storage_url_for_run(
    override: str | None = None, spec: PipelineSpec | None = None, settings: Settings | None = None
) -> str:
    """Where a run's checkpoints go: the flag, then the spec's ``storage``, then the settings
    (``CKPT_STORAGE_URL`` or the local default). Used before the job is (re)registered."""
    if override:
        return override
    if spec is not None and spec.storage:
        return spec.resolve(spec.storage)
    return (settings or Settings.resolve()).storage_url


def job_storage_url(metastore: Metastore, job_id: str, override: str | None = None) -> str:
    """The job's storage URL: the flag (or ``CKPT_STORAGE_URL``) when given, else the storage the
    job registered with (its state may live on S3 while the default is local), else the
    settings' default for a job never registered."""
    url = override or os.environ.get(ENV_STORAGE_URL)
    if url:
        return url
    info = get_job(metastore, job_id)
    return info.storage_url if info is not None else Settings.resolve().storage_url


def job_storage(
    metastore: Metastore, job_id: str, override: str | None = None
) -> CheckpointStorage:
    """:func:`job_storage_url` opened as a :class:`CheckpointStorage`. The URL the caller gave
    (a flag, ``CKPT_STORAGE_URL``) is taken as is; the one the job's row records only inside
    the configured storage roots (:meth:`CheckpointStorage.from_job_row`: any driver can write
    that row)."""
    from checkpointing.state.storage import CheckpointStorage

    url = override or os.environ.get(ENV_STORAGE_URL)
    if url:
        return CheckpointStorage.from_url(url)
    info = get_job(metastore, job_id)
    if info is None:
        return CheckpointStorage.from_url(Settings.resolve().storage_url)
    return CheckpointStorage.from_job_row(job_id, info.storage_url)


def registered_storage(metastore: Metastore, job_id: str) -> CheckpointStorage:
    """The storage the job registered with, ignoring flags, inside the configured storage roots
    (:meth:`CheckpointStorage.from_job_row`); :class:`UnknownJobError` if none."""
    from checkpointing.state.storage import CheckpointStorage

    return CheckpointStorage.from_job_row(job_id, require_job(metastore, job_id).storage_url)


# ------------------------------------------------------------------------ in a caller's session


def lock_job(s: Session, job_id: str) -> Job | None:
    """The job row locked for update (``SELECT … FOR UPDATE``): the fencing point of every
    change to the job and its checkpoints."""
    return s.get(Job, job_id, with_for_update=True)


def job_row(s: Session, job_id: str, *, lock: bool = False) -> Job:
    """The job's row in the caller's transaction (locked for update with ``lock``), for core code
    that changes it; :class:`UnknownJobError` when the job was never registered."""
    job = s.get(Job, job_id, with_for_update=lock or None)
    if job is None:
        raise unknown_job(job_id)
    return job


def register_job(
    s: Session, job_id: str, config: CheckpointConfig | None, storage_url: str | None, now: datetime
) -> tuple[CheckpointConfig, str]:
    """Register the job or update its configuration; with no ``config`` return the stored one.

    Returns the configuration and storage URL in force. A new job needs both a config and a
    storage URL (:class:`UnknownJobError` otherwise)."""
    job = lock_job(s, job_id)
    if config is None:
        if job is None:
            raise UnknownJobError(f"unknown job {job_id!r}")
        return config_of(job), job.storage_url
    if storage_url is None and job is None:
        raise UnknownJobError(f"job {job_id!r} is new: give its checkpoint storage")
    url = storage_url or job.storage_url  # type: ignore[union-attr]
    keep = config.savepoint_retention
    values = dict(
        storage_url=url,
        interval_ms=ms(config.interval) if config.interval is not None else None,
        timeout_ms=ms(config.timeout),
        min_pause_ms=ms(config.min_pause),
        max_concurrent=config.max_concurrent,
        tolerable_failures=config.tolerable_failures,
        retained=config.retained,
        retention=config.retention.value,
        prefer_checkpoint_for_recovery=config.prefer_checkpoint_for_recovery,
        savepoint_keep=keep.count if keep else None,
        savepoint_max_age_ms=ms(keep.max_age) if keep and keep.max_age is not None else None,
        updated_at=now,
    )
    if job is None:
        s.add(
            Job(
                job_id=job_id,
                status=JobStatus.CREATED,
                next_checkpoint_id=1,
                periodic_scheduling=False,
                consecutive_failures=0,
                created_at=now,
                **values,
            )
        )
    else:
        for k, v in values.items():
            setattr(job, k, v)
    return config, url


def update_job(s: Session, job_id: str, **values: object) -> None:
    """Change the job row's coordinator state (``status``, ``coordinator_id``,
    ``periodic_scheduling``, ``failure_cause``, ...) in the caller's transaction."""
    s.execute(update(Job).where(Job.job_id == job_id).values(**values))


def next_checkpoint_id(s: Session, job_id: str) -> int:
    """Strictly increasing per job, unique across racing coordinators (the job row is the
    counter; its update is atomic on every backend)."""
    new = s.execute(
        update(Job)
        .where(Job.job_id == job_id)
        .values(next_checkpoint_id=Job.next_checkpoint_id + 1)
        .returning(Job.next_checkpoint_id)
    ).scalar_one()
    return int(new) - 1
