"""The asynchronous part of a checkpoint's snapshot (Flink's sync/async split).

At the epoch boundary the runtime fixes *what* to write — the operators' list state, each
stage's materialised state and its changed rows, the chains they build on — which costs no
Spark job. Writing the keyed state files is a Spark job that then runs on a background thread
while the driver goes on with the next epoch; its acknowledgements are sent when it is done (at
the next boundary, before anything else is triggered), so the checkpoint completes after, and
the sink's commits stay in checkpoint order because at most one snapshot is in flight.

A crash while the write runs loses nothing: the checkpoint was never acknowledged, so it is
aborted on failover like any pending one, and the restore uses the one before it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from checkpointing.coordination.pending import TaskAck

log = logging.getLogger(__name__)

#: a stage's write: its acks and the chains it leaves (see ``checkpointing.spark.state``)
StageWrite = Callable[[], tuple[list[TaskAck], dict[int, Any]]]


@dataclass
class InflightSnapshot:
    """A checkpoint whose synchronous part is done and whose files are being written."""

    checkpoint_id: int
    epoch: int
    incremental: bool
    #: operator id -> acks known at the boundary (list state: no file to write)
    list_acks: dict[str, list[TaskAck]]
    #: operator id of each stage, in ``future``'s result order
    stages: list[str]
    future: Future[list[tuple[list[TaskAck], dict[int, Any]]]]
    started: float


class AsyncSnapshots:
    """At most one snapshot in flight, written on one background thread."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self.inflight: InflightSnapshot | None = None

    def submit(
        self,
        checkpoint_id: int,
        epoch: int,
        incremental: bool,
        list_acks: dict[str, list[TaskAck]],
        writes: dict[str, StageWrite],
    ) -> InflightSnapshot:
        assert self.inflight is None, "one snapshot in flight at a time"
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-snapshot")
        stages = list(writes)
        future = self._pool.submit(lambda: [writes[op]() for op in stages])
        self.inflight = InflightSnapshot(
            checkpoint_id, epoch, incremental, list_acks, stages, future, time.monotonic()
        )
        return self.inflight

    def take(self) -> tuple[InflightSnapshot, dict[str, list[TaskAck]], dict[str, Any]] | None:
        """Wait for the snapshot in flight: it, every operator's acks, and each stage's chains
        (a failed write raises)."""
        snapshot, self.inflight = self.inflight, None
        if snapshot is None:
            return None
        written = snapshot.future.result()
        acks = dict(snapshot.list_acks)
        chains = {}
        for op, (stage_acks, after) in zip(snapshot.stages, written, strict=True):
            acks[op] = stage_acks
            chains[op] = after
        return snapshot, acks, chains

    def abandon(self) -> None:
        """The attempt failed: let the write in flight end (so that no file appears after its
        checkpoint is disposed of) and drop it unacknowledged."""
        snapshot, self.inflight = self.inflight, None
        if snapshot is not None:
            try:
                snapshot.future.result()
            except Exception as exc:  # the attempt's own failure is what counts
                log.info("checkpoint %d: abandoned write failed: %s", snapshot.checkpoint_id, exc)

    def close(self) -> None:
        self.abandon()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
