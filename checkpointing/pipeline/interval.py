"""Interval-scoped pipelines: a run that processes its data interval, as most Airflow batch jobs do.

A spec with ``scope: interval`` is a template: its ``source.path`` and ``sink.path`` name the run's
data interval with the placeholders of :data:`VARIABLES` (``${DS}`` and friends, Airflow's
macros of the same names), and each interval is its own *job instance* — the job id plus the
interval's start (:meth:`DataInterval.job_id`, ``daily.20261125T000000``) — with its own
checkpoints, its own restores and its own sink directory or table. So a backfill runs intervals
side by side, a retry of one interval resumes within it, and incremental state never crosses
intervals. ``scope: incremental`` (the default) is the job that reads whatever is new since its
last run, for which these placeholders mean nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from checkpointing.errors import SpecError
from checkpointing.ids import validate_id

#: the placeholders a ``scope: interval`` spec's paths may use, as Airflow's macros: ``DS``
#: ``2026-11-25``, ``DS_NODASH`` ``20261125``, ``TS_NODASH`` ``20261125T000000``,
#: ``DATA_INTERVAL_START`` / ``DATA_INTERVAL_END`` ``2026-11-25T00:00:00+00:00`` (UTC)
VARIABLES = ("DS", "DS_NODASH", "TS_NODASH", "DATA_INTERVAL_START", "DATA_INTERVAL_END")


class Scope(StrEnum):
    """What one run of the job processes (:mod:`checkpointing.pipeline.interval`)."""

    INCREMENTAL = "incremental"  # whatever is new since the last run (the default)
    INTERVAL = "interval"  # its data interval: each interval its own job instance


#: a job instance id: ``<job>.<TS_NODASH of the interval's start>``
_INSTANCE = re.compile(r"^(?P<job>.+)\.(?P<start>[0-9]{8}T[0-9]{6})$")
_USES = re.compile(r"\$\{(" + "|".join(VARIABLES) + r")\}")


@dataclass(frozen=True)
class DataInterval:
    """A run's data interval ``[start, end)`` in UTC (Airflow's ``data_interval_start/end``).
    ``start == end`` is a point: Airflow 3's cron schedules (``CronTriggerTimetable``) and manual
    runs have a logical date and no interval; the instance is then that date's."""

    start: datetime
    end: datetime

    @classmethod
    def parse(cls, start: str, end: str) -> DataInterval:
        """From ISO 8601 texts (``2026-11-25``, ``2026-11-25T00:00:00+00:00``; no offset: UTC);
        :class:`SpecError` naming the bad one, or an end not after the start."""
        interval = cls(_instant(start, "start"), _instant(end, "end"))
        if interval.end < interval.start:
            raise SpecError(
                f"data interval: the end {end} is before the start {start} (an interval is "
                "[start, end))"
            )
        return interval

    def variables(self) -> dict[str, str]:
        """The values of :data:`VARIABLES` for this interval (years always of four digits, as
        ``isoformat`` writes them: ``strftime``'s ``%Y`` gives ``999`` for the year 999)."""
        start = self.start
        ds_nodash = f"{start.year:04d}{start.month:02d}{start.day:02d}"
        return {
            "DS": f"{start.year:04d}-{start.month:02d}-{start.day:02d}",
            "DS_NODASH": ds_nodash,
            "TS_NODASH": f"{ds_nodash}T{start.hour:02d}{start.minute:02d}{start.second:02d}",
            "DATA_INTERVAL_START": start.isoformat(),
            "DATA_INTERVAL_END": self.end.isoformat(),
        }

    def job_id(self, job: str) -> str:
        """The job instance of this interval: ``<job>.<start as TS_NODASH>``, a valid job id
        that :func:`pipeline_of` maps back to ``job`` (for any year, 1 to 9999)."""
        return validate_id(f"{job}.{self.variables()['TS_NODASH']}", "job id of the interval")

    def describe(self) -> str:
        return f"{self.start.isoformat()} to {self.end.isoformat()}"


def pipeline_of(job_id: str) -> str:
    """The pipeline (and DAG) a job id belongs to: an interval's job instance
    (``daily.20261125T000000``) is its pipeline's (``daily``); any other job id is its own (a
    spec's job may not end like an instance: :func:`check_job_name`)."""
    match = _INSTANCE.fullmatch(job_id)
    return match["job"] if match else job_id


def check_job_name(job: str) -> str:
    """A spec's job id must not look like an interval's job instance, whose permissions are its
    pipeline's: ``x.20261125T000000`` would be authorised as the DAG ``x``."""
    if _INSTANCE.fullmatch(job):
        raise ValueError(
            f"{job!r} ends like an interval's job instance (.<YYYYMMDDTHHMMSS>), which names "
            "the runs of scope: interval pipelines: choose another job id"
        )
    return job


def uses_interval(path: object) -> bool:
    """Does a path name the data interval (one of :data:`VARIABLES`)?"""
    return isinstance(path, str) and _USES.search(path) is not None


def _instant(text: str, which: str) -> datetime:
    try:
        value = datetime.fromisoformat(text.strip())
    except (TypeError, ValueError):
        raise SpecError(
            f"data interval: {which} {text!r} is not an ISO 8601 date or time "
            "(e.g. 2026-11-25 or 2026-11-25T00:00:00+00:00)"
        ) from None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
