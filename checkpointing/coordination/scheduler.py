"""When the next periodic checkpoint is due (Flink's ``ScheduledTrigger`` timer).

Pure timing logic, driven by a clock: the coordinator's background loop (or a test) asks
:meth:`due` and reports :meth:`fired`. The first trigger comes after a random delay in
``[min_pause, interval]`` so that many jobs started together do not checkpoint in lockstep; then
at a fixed rate. A min-pause refusal moves the next trigger to the earliest allowed time.
"""

from __future__ import annotations

import random
from datetime import datetime, timedelta


class PeriodicScheduler:
    def __init__(
        self, interval: timedelta, min_pause: timedelta, rng: random.Random | None = None
    ) -> None:
        if interval <= timedelta(0):
            raise ValueError("periodic scheduling needs a positive interval")
        self.interval = interval
        self.min_pause = min(min_pause, interval)
        self._rng = rng or random.Random()
        self.next_at: datetime | None = None

    @property
    def running(self) -> bool:
        return self.next_at is not None

    def initial_delay(self) -> timedelta:
        low, high = self.min_pause.total_seconds(), self.interval.total_seconds()
        return timedelta(seconds=self._rng.uniform(low, high))

    def start(self, now: datetime) -> datetime:
        self.next_at = now + self.initial_delay()
        return self.next_at

    def stop(self) -> None:
        self.next_at = None

    def due(self, now: datetime) -> bool:
        return self.next_at is not None and now >= self.next_at

    def fired(self, now: datetime) -> None:
        """Fixed rate; missed periods are skipped rather than fired in a burst."""
        if self.next_at is None:
            return
        while self.next_at <= now:
            self.next_at += self.interval

    def reschedule_at(self, earliest: datetime) -> None:
        """Min pause not yet over: try again when it is, then at the fixed rate."""
        if self.next_at is not None:
            self.next_at = earliest
