"""The task-facing face of the checkpoint coordinator (Flink's ``CheckpointCoordinatorGateway``:
``acknowledgeCheckpoint`` and ``declineCheckpoint``), and what an ack batch comes back with.

Acks and declines come from any process (Spark executors, the driver, the Airflow operator), each
through its own :class:`~checkpointing.coordination.coordinator.CheckpointCoordinator` for the
job; the metastore keeps them consistent. Two methods and no behaviour, as in Flink: the
coordinator implements them by delegating to its
:class:`~checkpointing.coordination.completion.CompletionHandler`, which satisfies this protocol
too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from checkpointing.coordination.failure import CheckpointFailureReason
from checkpointing.coordination.pending import AckResult, TaskAck
from checkpointing.coordination.store import CompletedCheckpoint


@dataclass
class AckOutcome:
    """What became of an ack batch: each attempt's :class:`AckResult`, the checkpoint this
    batch completed (None unless its last ack was in it), the state files deleted because their
    acks did not count, and the acks refused by validation (never recorded)."""

    results: dict[str, AckResult]
    completed: CompletedCheckpoint | None = None
    deleted_handles: list[str] = field(default_factory=list)
    #: acks never recorded, attempt → why (their checkpoint was declined)
    refused: dict[str, str] = field(default_factory=dict)


class CheckpointCoordinatorGateway(Protocol):
    """What a task may tell the coordinator about a checkpoint."""

    def receive_acknowledge(self, checkpoint_id: int, acks: Sequence[TaskAck]) -> AckOutcome:
        """Flink's ``acknowledgeCheckpoint``: the tasks' snapshots are written."""
        ...

    def receive_decline(
        self,
        checkpoint_id: int,
        attempt_id: str,
        reason: CheckpointFailureReason | str = CheckpointFailureReason.CHECKPOINT_DECLINED,
        message: str | None = None,
    ) -> bool:
        """Flink's ``declineCheckpoint``: the task could not (or need not) snapshot; whether
        the checkpoint was aborted."""
        ...
