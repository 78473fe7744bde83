"""The two-phase-commit sink protocol (Flink's ``TwoPhaseCommitSinkFunction``), Spark-free: the
runtime stages each epoch's rows, snapshots the staged but uncommitted epochs as the sink's list
state, commits them when a checkpoint covering them completes, and on restore brings the sink in
line with the restored checkpoint. The writers are :mod:`checkpointing.spark.parquet_sink`,
:mod:`checkpointing.spark.s3_parquet_sink`, :mod:`checkpointing.spark.delta_sink` and
:mod:`checkpointing.spark.iceberg_sink`, chosen by
:func:`checkpointing.spark.sinks.open_sink`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

#: a sink's list state in a checkpoint: one JSON-able item per staged, uncommitted epoch
ListState = Sequence[dict[str, Any]]
#: what :meth:`Sink.recover` returns: ``(epochs committed now, epochs discarded)``
Recovery = tuple[list[int], list[int]]


class Sink(Protocol):
    """What the runtime needs of a two-phase-commit sink."""

    #: where it writes (a local directory, or a table URL), for messages
    path: Path | str

    def stage(self, epoch: int, df: DataFrame) -> None:
        """Pre-commit: write ``df`` (the epoch's changed rows) invisibly to readers."""
        ...

    def snapshot_state(self, up_to_epoch: int) -> list[dict[str, Any]]:
        """The sink's list state in a checkpoint taken after ``up_to_epoch``: one item per
        staged, uncommitted epoch ``<= up_to_epoch`` (each with its ``epoch``)."""
        ...

    def commit(self, up_to_epoch: int, checkpoint_id: int | None = None) -> list[int]:
        """Commit: make every staged epoch ``<= up_to_epoch`` visible, once (idempotent); the
        epochs this call committed. ``checkpoint_id``: the completed checkpoint that covers
        them (a transactional sink records it with the commit)."""
        ...

    def recover(
        self,
        checkpoint_epoch: int | None,
        *,
        checkpoint_id: int | None = None,
        state: Sequence[dict[str, Any]] = (),
    ) -> tuple[list[int], list[int]]:
        """Bring the sink in line with a restore from a checkpoint covering epochs
        ``<= checkpoint_epoch`` (``None``: an empty start) whose sink list state is ``state``:
        commit what it covered but never committed, drop what it does not cover. Returns
        ``(epochs committed now, epochs discarded)``."""
        ...

    def reset(self) -> list[int]:
        """A full refresh (``--full-refresh``): take the sink back to holding no epoch of the
        job — its committed and staged epochs and its final table gone, or a table brought
        back to its creation — so that an empty start may write it again; the epochs it held.
        Only the job's own output goes; idempotent."""
        ...

    def recovery_detail(self) -> dict[str, Any] | None:
        """What the last :meth:`recover` did beyond committing and discarding epochs (e.g. a
        table brought back to an older version), recorded with the restore; None: nothing."""
        ...

    def committed_epochs(self) -> list[int]:
        """Epochs whose output is committed (an empty start over them is refused)."""
        ...

    def publish_final(self, df: DataFrame, token: str) -> str | None:
        """The job finished: publish the final table (``df``: one row per key), idempotently
        per ``token``; its location, or None when the sink has no separate final table."""
        ...
