"""Checkpoint alerts through Airflow notifiers: the checkpoint events of a try
(:mod:`checkpointing.coordination.events`) that an operator should hear of, sent to any
``BaseNotifier`` (Slack, SMTP, PagerDuty ...) the way Airflow's ``on_failure_callback`` does.

A notifier gets the task's context plus ``checkpoint_alert`` (a :class:`CheckpointAlert`: the
pipeline, the checkpoint, the reason, the message and the link to the Checkpoints page), so its
templated fields can say ``{{ checkpoint_alert.message }}``. A notifier that raises is logged and
never fails the job. docs/operations.md says what each alert means and what to do.
"""

from __future__ import annotations

import copy
import importlib
import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from checkpointing.coordination.events import (
    CheckpointCompleted,
    CheckpointEvent,
    CheckpointFailed,
    ConsecutiveCheckpointFailures,
    Restored,
    TolerableFailuresExceeded,
)
from checkpointing.pipeline.alerts_spec import ALERT_KINDS, AlertsSpec

log = logging.getLogger(__name__)

#: a notifier: an Airflow ``BaseNotifier``, or any callable taking the context
Notifier = Callable[[Any], Any]


@dataclass(frozen=True)
class CheckpointAlert:
    """One alert, as notifiers see it (``{{ checkpoint_alert.message }}``)."""

    kind: str
    pipeline: str
    message: str
    url: str
    checkpoint_id: int | None = None
    reason: str | None = None

    def __str__(self) -> str:
        return self.message


def alerts_of(event: CheckpointEvent, pipeline: str, url: str) -> list[CheckpointAlert]:
    """The alerts ``event`` raises (most raise none)."""
    see = f"Checkpoints: {url}"
    if isinstance(event, ConsecutiveCheckpointFailures):
        return [
            CheckpointAlert(
                "checkpoint_failures",
                pipeline,
                f"pipeline {pipeline}: {event.count} consecutive checkpoint failure(s), last "
                f"checkpoint {event.checkpoint_id}: {event.reason}; the job fails after "
                f"{event.tolerable_failures + 1} (tolerable_failures={event.tolerable_failures}). "
                + see,
                url,
                event.checkpoint_id,
                event.reason,
            )
        ]
    if isinstance(event, TolerableFailuresExceeded):
        return [
            CheckpointAlert(
                "tolerable_failures_exceeded",
                pipeline,
                f"pipeline {pipeline}: the job fails: {event.count} consecutive checkpoint "
                f"failures exceed tolerable_failures={event.tolerable_failures} "
                f"({event.cause or 'no cause recorded'}). " + see,
                url,
                reason="TOLERABLE_FAILURES_EXCEEDED",
            )
        ]
    if isinstance(event, Restored):
        return _restore_alerts(event, pipeline, url, see)
    if isinstance(event, CheckpointCompleted) and event.is_savepoint:
        return [
            CheckpointAlert(
                "savepoint_completed",
                pipeline,
                f"pipeline {pipeline}: savepoint {event.checkpoint_id} completed at "
                f"{event.location}. " + see,
                url,
                event.checkpoint_id,
            )
        ]
    if isinstance(event, CheckpointFailed) and event.is_savepoint:
        return [
            CheckpointAlert(
                "savepoint_failed",
                pipeline,
                f"pipeline {pipeline}: savepoint {event.checkpoint_id} failed: {event.reason}"
                + (f" ({event.message})" if event.message else "")
                + ". "
                + see,
                url,
                event.checkpoint_id,
                event.reason,
            )
        ]
    return []


def _restore_alerts(event: Restored, pipeline: str, url: str, see: str) -> list[CheckpointAlert]:
    alerts = []
    if event.skipped:
        skipped = "; ".join(f"checkpoint {c}: {r}" for c, r in event.skipped)
        redone = "" if event.epochs_redone is None else f", {event.epochs_redone} epoch(s) redone"
        alerts.append(
            CheckpointAlert(
                "restore_fallback",
                pipeline,
                f"pipeline {pipeline}: attempt {event.attempt} restored checkpoint "
                f"{event.checkpoint_id} after skipping unusable ones ({skipped}){redone}. " + see,
                url,
                event.checkpoint_id,
                skipped,
            )
        )
    if event.rescaled:
        alerts.append(
            CheckpointAlert(
                "restore_rescaled",
                pipeline,
                f"pipeline {pipeline}: attempt {event.attempt} restored checkpoint "
                f"{event.checkpoint_id} at parallelism {event.parallelism} (taken at "
                f"{event.previous_parallelism}). " + see,
                url,
                event.checkpoint_id,
                "RESCALED",
            )
        )
    return alerts


class CheckpointAlerts:
    """A :class:`~checkpointing.coordination.events.CheckpointEventListener` sending each alert
    to the notifiers of its kind.

    :param pipeline: the job id.
    :param notifiers: alert kind → notifiers; the kind ``"all"`` hears every alert.
    :param context: the task's context, handed to each notifier with ``checkpoint_alert``.
    :param url: the pipeline's Checkpoints page.
    """

    def __init__(
        self,
        pipeline: str,
        notifiers: Mapping[str, Sequence[Notifier]],
        context: Mapping[str, Any],
        url: str,
    ) -> None:
        self.pipeline = pipeline
        self.notifiers = notifiers
        self.context = context
        self.url = url
        #: every alert raised, for the task's log and tests
        self.sent: list[CheckpointAlert] = []
        self._queue: queue.Queue[tuple[Notifier, CheckpointAlert] | None] = queue.Queue()
        self._worker: threading.Thread | None = None

    def on_event(self, event: CheckpointEvent) -> None:
        """Queue the event's alerts for the sending thread: a slow notifier (a chat service's
        timeout) must not hold up the coordinator loop that triggers and expires checkpoints."""
        for alert in alerts_of(event, self.pipeline, self.url):
            self.sent.append(alert)
            log.warning("checkpoint alert %s: %s", alert.kind, alert.message)
            for notifier in [*self.notifiers.get(alert.kind, ()), *self.notifiers.get("all", ())]:
                self._queue.put((notifier, alert))
                if self._worker is None or not self._worker.is_alive():
                    self._worker = threading.Thread(
                        target=self._run, name=f"ckpt-alerts-{self.pipeline}", daemon=True
                    )
                    self._worker.start()

    def close(self, timeout: float = 30) -> None:
        """Wait, up to ``timeout`` seconds, for the queued alerts to be sent: the try's last ones
        (the job failing) go out before the task ends."""
        worker = self._worker
        if worker is not None and worker.is_alive():
            self._queue.put(None)
            worker.join(timeout)
            if worker.is_alive():
                log.warning("checkpoint alerts: notifiers still sending after %.0f s", timeout)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._send(*item)

    def _send(self, notifier: Notifier, alert: CheckpointAlert) -> None:
        """Airflow's notifiers render their templated fields in place, once: each alert gets a
        copy, so the next one renders its own message."""
        context = {**self.context, "checkpoint_alert": alert}
        try:
            copy.copy(notifier)(context)
        except Exception:  # a notifier that raises never fails the job
            log.exception("checkpoint alert %s: notifier %r failed", alert.kind, notifier)


def normalize_alerts(
    alerts: Mapping[str, Notifier | Sequence[Notifier]] | Sequence[Notifier] | None,
) -> dict[str, list[Notifier]]:
    """The operator's ``alerts`` as kind → notifiers: a notifier or a list of them hears every
    alert; a mapping names the kinds (or ``all``). Unknown kinds are refused."""
    if not alerts:
        return {}
    if not isinstance(alerts, Mapping):
        alerts = {"all": alerts}  # type: ignore[dict-item]
    out: dict[str, list[Notifier]] = {}
    for kind, notifiers in alerts.items():
        if kind != "all" and kind not in ALERT_KINDS:
            raise ValueError(f"unknown alert kind {kind!r}: one of all, {', '.join(ALERT_KINDS)}")
        listed = list(notifiers) if isinstance(notifiers, list | tuple) else [notifiers]
        out.setdefault(kind, []).extend(listed)  # type: ignore[arg-type]
    return out


def notifiers_from_spec(spec: AlertsSpec) -> dict[str, list[Notifier]]:
    """The notifiers a spec's ``alerts:`` section names, built (imported and instantiated)."""
    out: dict[str, list[Notifier]] = {}
    for entry in spec.notifiers:
        module, _, name = entry.notifier.rpartition(".")
        notifier = getattr(importlib.import_module(module), name)(**entry.args)
        for kind in entry.on:
            out.setdefault(kind, []).append(notifier)
    return out
