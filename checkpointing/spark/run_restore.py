"""How a run starts: the checkpoint it restores (or none) and what restoring it does — the input
epochs it resumes, every stage's state read back on the executors (each new subtask its own key
groups, across incremental chains), the sink brought to the checkpoint — and the restore event
that records it. Part of :class:`~checkpointing.spark.runtime.PipelineRun`, kept apart to keep
each module to one concern.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline.operator_ids import SINK, SOURCE
from checkpointing.pipeline.spec import PipelineSpec
from checkpointing.pipeline.splits import InputSplit, is_processed, resume_epochs
from checkpointing.restore import lookup as restore
from checkpointing.restore.assignment import plan_restore, snapshots_from_metadata
from checkpointing.sinks.protocol import Sink
from checkpointing.spark.preflight import RunOptions, refuse_empty_start
from checkpointing.spark.state import (
    StageRun,
    check_source,
    continued_chains,
    restore_stage,
    through_epoch,
)
from checkpointing.spark.transform import InputTransform
from checkpointing.state.metadata import CheckpointMetadata
from checkpointing.state.storage import CheckpointStorage
from checkpointing.status import RestoreStatus

log = logging.getLogger(__name__)


class RunRestore:
    """The restore half of :class:`~checkpointing.spark.runtime.PipelineRun` (a mixin: it reads
    and sets the run's epochs, stages, sink and result, declared here)."""

    spec: PipelineSpec
    spark: SparkSession
    metastore: Metastore
    storage: CheckpointStorage
    options: RunOptions
    attempt: str
    parallelism: int
    max_parallelism: int
    partition_keys: list[int]
    operators: list[str]
    stages: list[StageRun]
    sink: Sink
    inputs: InputTransform
    files: Any
    epochs: list[list[InputSplit]]
    read_by: dict[int, str]
    next_epoch: int
    covered_epoch: int
    result: Any
    _epochs: Callable[[], list[list[InputSplit]]]
    _read: Callable[[Sequence[InputSplit]], DataFrame]
    _remaining_splits: Callable[[int], list[dict[str, Any]]]
    _empty_state: Callable[[StageRun], DataFrame]

    def _restore(self) -> None:
        """Restore what ``options.restore`` chooses; record the restore; time its phases."""
        started = time.monotonic()
        choice = self.options.restore
        if choice == "none":
            decision = restore.RestoreDecision(self.spec.job, None, None, None, None)
            refuse_empty_start(self.sink, self.spec.job, choice)
        elif choice == "latest":
            decision = restore.find_latest_valid(self.metastore, self.storage, self.spec.job)
            if decision.metadata is None:  # none, or none valid: never start over committed output
                refuse_empty_start(self.sink, self.spec.job, choice)
        elif choice.isdigit():
            decision = restore.load_checkpoint(
                self.metastore, self.storage, self.spec.job, int(choice)
            )
        else:
            # recorded under this job, not the savepoint's (which may be unknown to this metastore)
            decision = restore.load_external(
                self.storage,
                choice,
                job_id=self.spec.job,
                allow_other_job=self.options.allow_other_job,
            )
        log.info("%s", decision.describe())
        phases = self.result.restore_phases
        phases["lookup_s"] = time.monotonic() - started
        assignment = None
        source = [] if decision.metadata is None else decision.metadata.list_items(SOURCE)
        if not any(is_processed(i) for i in source):  # empty start, or an older checkpoint
            self.epochs = self._epochs()
        if decision.metadata is not None:
            assignment = self._load_state(decision.metadata)
            self.result.restored_from = decision.checkpoint_id
        self.result.epochs_total = len(self.epochs)
        mark = time.monotonic()
        committed, discarded = self.sink.recover(
            None if decision.metadata is None else self.next_epoch - 1,
            checkpoint_id=decision.checkpoint_id,
            state=[] if decision.metadata is None else decision.metadata.list_items(SINK),
        )
        if committed or discarded:
            log.info("sink: committed %s, discarded %s on restore", committed, discarded)
        detail = self.sink.recovery_detail()
        if detail is not None:  # e.g. the table brought back to what the checkpoint committed
            log.info("sink: %s", detail)
            assignment = {**(assignment or {}), "sink": detail}
        restore.record_restore(
            self.metastore,
            decision,
            attempt=self.attempt,
            parallelism=self.parallelism,
            assignment=assignment,
            status=RestoreStatus.RESTORED,
        )
        phases["sink_s"] = time.monotonic() - mark
        phases["total_s"] = time.monotonic() - started
        if decision.metadata is not None:
            log.info(
                "job %s: restored checkpoint %d in %.1f s (%s)",
                self.spec.job,
                decision.checkpoint_id,
                phases["total_s"],
                ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in phases.items()),
            )

    def _load_state(self, metadata: CheckpointMetadata) -> dict[str, Any]:
        plan = plan_restore(
            snapshots_from_metadata(metadata),
            self.operators,
            new_parallelism=self.parallelism,
            max_parallelism=self.max_parallelism,
            allow_non_restored_state=self.options.allow_non_restored_state,
        )
        source = metadata.list_items(SOURCE)
        if any(is_processed(i) for i in source):  # the epochs it read, its remaining, new files
            self.epochs = resume_epochs(
                source,
                self.files,
                self.spec.source.format.value,
                self.spec.source.max_split_bytes,
                self.spec.source.splits_per_epoch,
                metadata.checkpoint_id,
            )
            self.read_by = {
                int(i["epoch"]): str(i["attempt"])
                for i in source
                if is_processed(i) and isinstance(i.get("attempt"), str)
            }
        self.covered_epoch = through_epoch(metadata, len(self.epochs))
        self.next_epoch = self.covered_epoch + 1
        changed = self.inputs.check_restore(source, metadata.checkpoint_id, self.options)
        if not any(is_processed(i) for i in source):  # an older checkpoint: the same input only
            planned = self._remaining_splits(self.next_epoch)
            check_source(plan.operator(SOURCE), planned, metadata.checkpoint_id)
        if self.next_epoch >= len(self.epochs):
            log.info(
                "job %s: no new input since checkpoint %d (%d epochs, %d files read)",
                self.spec.job,
                metadata.checkpoint_id,
                len(self.epochs),
                len({s.path for e in self.epochs for s in e}),
            )
        # sets the input schema, which defines the state schema (the next epoch's files: their
        # listing is then warm for the first epoch after the restore)
        mark = time.monotonic()
        self._read(self.epochs[min(self.next_epoch, len(self.epochs) - 1)])
        self.result.restore_phases["input_schema_s"] = time.monotonic() - mark
        mark = time.monotonic()
        for s in self.stages:
            s.state = restore_stage(
                self.spark,
                self.storage,
                self._empty_state(s),
                plan.operator(s.operator_id),
                metadata,
                self.partition_keys,
                s.key,
            )
            if s.chains is not None:  # the same key groups in shared files: build on them
                shared = self.storage.shared_url(self.spec.job)
                s.chains = continued_chains(
                    plan.operator(s.operator_id), metadata, shared, self.storage
                )
        self.result.restore_phases["state_s"] = time.monotonic() - mark
        return {**plan.to_dict(), **({"tables": changed} if changed else {})}
