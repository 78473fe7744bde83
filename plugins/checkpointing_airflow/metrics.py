"""Checkpoint metrics through Airflow's ``Stats``: StatsD, Datadog or OpenTelemetry, whichever the
deployment's ``[metrics]`` section configures (nothing when none is).

The operator's coordinator loop watches its attempt
(:class:`~checkpointing.coordination.stats_tracker.CheckpointStatsTracker`) and
:class:`CheckpointMetrics` turns the events into Flink's checkpoint metrics, under the prefix
:data:`PREFIX` (after Airflow's own ``statsd_prefix``). Every metric is sent twice, like Airflow's
own: once by its name with the tag ``pipeline`` (and ``reason`` for failures), for backends that
keep tags (OpenTelemetry, Datadog, StatsD with InfluxDB tags), and, while Airflow's
``[metrics] legacy_names_on`` is true (its default), once more with the pipeline (and reason)
appended to the name, for plain StatsD. docs/operations.md lists them.
"""

from __future__ import annotations

import logging
import re
from datetime import timedelta
from typing import Any

from checkpointing.coordination.events import (
    CheckpointCompleted,
    CheckpointEvent,
    CheckpointFailed,
    CheckpointingProgress,
    Restored,
)

log = logging.getLogger(__name__)

#: the prefix of every metric of this provider
PREFIX = "ckpt"

#: name → (kind, unit, meaning): the documented metrics (docs/operations.md)
METRICS: dict[str, tuple[str, str, str]] = {
    "checkpoints.completed": ("counter", "", "checkpoints completed"),
    "checkpoints.failed": ("counter", "", "checkpoints aborted, tagged by reason"),
    "savepoints.completed": ("counter", "", "savepoints completed"),
    "savepoints.failed": ("counter", "", "savepoints aborted, tagged by reason"),
    "checkpoint.duration": ("timer", "ms", "trigger to completion (lastCheckpointDuration)"),
    "checkpoint.size": ("gauge", "bytes", "state size of the last one (lastCheckpointSize)"),
    "checkpoint.checkpointed_size": ("gauge", "bytes", "bytes the last one wrote itself"),
    "checkpoint.consecutive_failures": ("gauge", "", "counted failures since the last success"),
    "checkpoint.last_completed_age": ("gauge", "s", "age of the last completed checkpoint"),
    "epochs.throughput": ("gauge", "epochs/min", "epochs done per minute between checkpoints"),
    "restores": ("counter", "", "restores (tagged rescaled, fallback: true/false)"),
    "restore.duration": ("timer", "ms", "the driver's restore, lookup to sink recovery"),
    "restore.epochs_redone": ("gauge", "", "epochs covered by newer checkpoints, run again"),
    "restore.timestamp": ("gauge", "ms", "when the last restore happened (epoch ms)"),
}


def _stats() -> Any:
    """Airflow's Stats (``airflow.sdk.observability.stats`` since 3.3; ``airflow.stats`` before)."""
    try:
        from airflow.sdk.observability.stats import Stats
    except ImportError:  # Airflow 3.2
        from airflow.stats import Stats  # type: ignore[no-redef]
    return Stats


def _name_part(value: str) -> str:
    """A tag value as one part of a StatsD name (what Stats accepts: letters, digits, ``_-``)."""
    return re.sub(r"[^a-zA-Z0-9_-]", "_", value)


class CheckpointMetrics:
    """A :class:`~checkpointing.coordination.events.CheckpointEventListener` that records each
    event's metrics through ``Stats``; a backend that fails is logged, never raised.

    :param pipeline: the tag (and name suffix) of every metric: the job id.
    :param legacy_names: also send the names with the pipeline appended; default: Airflow's
        ``[metrics] legacy_names_on``.
    """

    def __init__(self, pipeline: str, stats: Any = None, legacy_names: bool | None = None) -> None:
        self.pipeline = pipeline
        self.stats = stats
        if legacy_names is None:
            from airflow.sdk.configuration import conf

            legacy_names = conf.getboolean("metrics", "legacy_names_on", fallback=True)
        self.legacy_names = legacy_names

    def on_event(self, event: CheckpointEvent) -> None:
        try:
            self._record(event)
        except Exception:  # a metrics backend that is down changes nothing in the job
            log.warning("job %s: checkpoint metrics not sent", self.pipeline, exc_info=True)

    def _record(self, event: CheckpointEvent) -> None:
        if isinstance(event, CheckpointCompleted):
            kind = "savepoints" if event.is_savepoint else "checkpoints"
            self.incr(f"{kind}.completed")
            if not event.is_savepoint:
                self.timing("checkpoint.duration", event.duration_s)
                self.gauge("checkpoint.size", event.state_size)
                self.gauge("checkpoint.checkpointed_size", event.checkpointed_size)
                self.gauge("checkpoint.consecutive_failures", 0)
                if event.epoch_throughput is not None:
                    self.gauge("epochs.throughput", round(event.epoch_throughput * 60, 3))
        elif isinstance(event, CheckpointFailed):
            kind = "savepoints" if event.is_savepoint else "checkpoints"
            self.incr(f"{kind}.failed", reason=event.reason)
            self.gauge("checkpoint.consecutive_failures", event.consecutive_failures)
        elif isinstance(event, CheckpointingProgress):
            if event.last_completed_age_s is not None:
                self.gauge("checkpoint.last_completed_age", round(event.last_completed_age_s, 3))
        elif isinstance(event, Restored):
            self._record_restore(event)

    def _record_restore(self, event: Restored) -> None:
        from time import time

        self.incr(
            "restores",
            tags={
                "rescaled": str(event.rescaled).lower(),
                "fallback": str(bool(event.skipped)).lower(),
            },
        )
        self.gauge("restore.timestamp", int(time() * 1000))
        if event.duration_s is not None:
            self.timing("restore.duration", event.duration_s)
        if event.epochs_redone is not None:
            self.gauge("restore.epochs_redone", event.epochs_redone)

    # ------------------------------------------------------------------ sending

    def _tags(self, extra: dict[str, str] | None) -> dict[str, str]:
        return {"pipeline": self.pipeline, **(extra or {})}

    def _names(self, name: str, reason: str | None = None) -> tuple[str, str]:
        """The tagged name and the plain StatsD one (pipeline, then reason, appended)."""
        plain = f"{PREFIX}.{name}.{_name_part(self.pipeline)}"
        return f"{PREFIX}.{name}", plain if reason is None else f"{plain}.{_name_part(reason)}"

    def incr(
        self, name: str, *, reason: str | None = None, tags: dict[str, str] | None = None
    ) -> None:
        stats = self.stats or _stats()
        extra = {**(tags or {}), **({"reason": reason} if reason else {})}
        tagged, plain = self._names(name, reason)
        stats.incr(tagged, tags=self._tags(extra))
        if self.legacy_names:
            stats.incr(plain)

    def gauge(self, name: str, value: float) -> None:
        stats = self.stats or _stats()
        tagged, plain = self._names(name)
        stats.gauge(tagged, value, tags=self._tags(None))
        if self.legacy_names:
            stats.gauge(plain, value)

    def timing(self, name: str, seconds: float) -> None:
        stats = self.stats or _stats()
        tagged, plain = self._names(name)
        stats.timing(tagged, timedelta(seconds=seconds), tags=self._tags(None))
        if self.legacy_names:
            stats.timing(plain, timedelta(seconds=seconds))
