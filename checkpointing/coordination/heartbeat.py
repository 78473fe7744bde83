"""The driver's heartbeat: how the metastore tells a running job from a dead one.

A driver that is SIGKILLed, or whose host goes away, leaves the job row RUNNING: nothing ran to
say otherwise. Flink's JobManager and TaskManagers heartbeat each other (``heartbeat.interval``,
``heartbeat.timeout``) and Airflow's task runner heartbeats the scheduler for the same reason.
Here the process running the job (``ckpt run``'s driver, or the driver the Airflow operator
submits) stamps ``heartbeat_at`` on the job row every :data:`HEARTBEAT_INTERVAL` while it runs;
a RUNNING job whose stamp is older than :data:`HEARTBEAT_TIMEOUT` has no live driver
(:func:`driver_alive`). The stamp is written only while the job row names the beating process as
its coordinator, so a superseded driver never makes its successor's job look alive or dead.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timedelta
from types import TracebackType

from sqlalchemy import update

from checkpointing.clock import Clock, SystemClock
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Job

log = logging.getLogger(__name__)

#: how often a running driver stamps the job row (Flink's ``heartbeat.interval`` is 10 s)
HEARTBEAT_INTERVAL = timedelta(seconds=10)
#: a RUNNING job whose driver has not stamped for this long is taken as dead: many missed beats,
#: so that a metastore hiccup or a long GC pause is not mistaken for a dead driver
HEARTBEAT_TIMEOUT = timedelta(minutes=5)


def beat(metastore: Metastore, job_id: str, coordinator_id: str, now: datetime) -> bool:
    """Stamp ``job_id``'s row if it still names ``coordinator_id``; False when it does not (a
    newer attempt took over: this driver is superseded and its beat does not count)."""
    with metastore.transaction() as s:
        result = s.execute(
            update(Job)
            .where(Job.job_id == job_id, Job.coordinator_id == coordinator_id)
            .values(heartbeat_at=now)
        )
        return bool(getattr(result, "rowcount", 0))


def driver_alive(
    heartbeat_at: datetime | None, now: datetime, timeout: timedelta = HEARTBEAT_TIMEOUT
) -> bool | None:
    """Did the driver beat within ``timeout`` of ``now``? None: it never beat (a driver older
    than the heartbeat, or one that has not started yet) — not known either way."""
    if heartbeat_at is None:
        return None
    return now - heartbeat_at <= timeout


def driver_starting(
    submitted_at: datetime,
    heartbeat_at: datetime | None,
    now: datetime,
    timeout: timedelta = HEARTBEAT_TIMEOUT,
) -> bool:
    """A driver submitted at ``submitted_at`` that has not beaten since and is still within
    ``timeout`` of its submission: it is starting (JVM, session, restore), not lost."""
    beat_since = heartbeat_at is not None and heartbeat_at >= submitted_at
    return not beat_since and now - submitted_at <= timeout


class Heartbeat:
    """A daemon thread stamping the job row every ``interval`` while the ``with`` block runs
    (first beat on entry). A failed beat is logged once and retried at the next one: the job
    goes on (the heartbeat only informs others)."""

    def __init__(
        self,
        metastore: Metastore,
        job_id: str,
        coordinator_id: str,
        *,
        interval: timedelta = HEARTBEAT_INTERVAL,
        clock: Clock | None = None,
    ) -> None:
        self.metastore = metastore
        self.job_id = job_id
        self.coordinator_id = coordinator_id
        self.interval = interval.total_seconds()
        self.clock = clock or SystemClock()
        self._stop = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._loop, name=f"ckpt-heartbeat-{job_id}")
        self._thread.daemon = True

    def __enter__(self) -> Heartbeat:
        self._beat()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._beat()

    def _beat(self) -> None:
        try:
            beat(self.metastore, self.job_id, self.coordinator_id, self.clock.now())
            self._warned = False
        except Exception as exc:  # the metastore is away: the job goes on, the next beat retries
            if not self._warned:
                log.warning("job %s: heartbeat not recorded: %s", self.job_id, exc)
                self._warned = True
