"""A spec's optional ``maintenance:`` section: the pipeline's scheduled garbage collection
(``ckpt gc``, :mod:`checkpointing.coordination.gc`), which the Airflow DAG factory runs as the
DAG ``<job>__maintenance``. Its fields are gc's options; savepoints follow the job's
``checkpoint.savepoint_retention``, as ``ckpt gc`` does without its savepoint flags."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from checkpointing.config import parse_duration

#: gc's defaults (as in :mod:`checkpointing.coordination.gc`)
DEFAULT_KEEP_HISTORY = timedelta(days=30)
DEFAULT_GRACE = timedelta(hours=1)


class MaintenanceSpec(BaseModel):
    """``schedule``: when the maintenance DAG runs (a cron expression or preset); ``keep_history``:
    prune ended checkpoints, finished requests and restores older than this; ``grace``: leave
    files modified more recently; ``orphans``: delete orphan files in the checkpoint storage;
    ``vacuum_sink``: also delete the Delta sink table's files no retained checkpoint can
    restore (a ``format: delta`` sink only)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schedule: str = "@weekly"
    keep_history: timedelta = DEFAULT_KEEP_HISTORY
    grace: timedelta = DEFAULT_GRACE
    orphans: bool = True
    vacuum_sink: bool = False

    @field_validator("keep_history", "grace", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> timedelta:
        value = parse_duration(v)
        if value < timedelta(0):
            raise ValueError("must not be negative")
        return value

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("a cron expression or preset such as '@weekly'; it may not be empty")
        return v
