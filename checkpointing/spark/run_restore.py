"""How a run starts (Flink's state initialisation of a task on (re)start): the checkpoint it
restores, or none, and what restoring it gives the run — the input epochs it resumes, every
stage's state read back on the executors (each new subtask its own key groups), the chains its
incremental snapshots continue — with the sink brought to the checkpoint and the restore recorded.

:class:`~checkpointing.spark.runtime.PipelineRun` builds a :class:`RunRestore` from what a
restore reads and writes, and applies the :class:`Restored` it returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline.operator_ids import SINK, SOURCE
from checkpointing.pipeline.spec import PipelineSpec
from checkpointing.pipeline.splits import (
    Consumed,
    InputSplit,
    describe_epochs,
    has_progress,
    is_processed,
    plan_epochs,
    plan_splits,
    resume,
    schema_splits,
)
from checkpointing.restore import lookup, refresh
from checkpointing.restore.assignment import StateAssignment, plan_restore, snapshots_from_metadata
from checkpointing.sinks.protocol import Sink
from checkpointing.spark.keys import partition_keys
from checkpointing.spark.preflight import RunOptions, check_full_refresh, refuse_empty_start
from checkpointing.spark.stages import AggregationStage
from checkpointing.spark.state import (
    StageRun,
    SubtaskChain,
    check_source,
    continued_chains,
    empty_state,
    remaining_splits,
    restore_stage,
    restored_runs,
    through_epoch,
)
from checkpointing.spark.transform import InputTransform
from checkpointing.state.incremental import CHAIN_AGGREGATE, CHAIN_REPLACE
from checkpointing.state.metadata import CheckpointMetadata
from checkpointing.state.object_store import ObjectInfo
from checkpointing.state.storage import CheckpointStorage
from checkpointing.status import RestoreStatus

log = logging.getLogger(__name__)

#: reads an epoch's input; the first read fixes the input's and the stages' state schemas
ReadFn = Callable[[Sequence[InputSplit]], DataFrame]


@dataclass(frozen=True)
class Restored:
    """Where a run resumes: what its restore found, for the run to apply."""

    #: the checkpoint restored; None for an empty start
    checkpoint_id: int | None
    #: the epochs to run: a checkpoint's own and the files new since, or every file planned anew
    epochs: list[list[InputSplit]]
    #: the run that read each epoch the checkpoint processed (restored list state)
    read_by: dict[int, str] = field(default_factory=dict)
    #: the files read before this run, compacted (None: an empty start or an older checkpoint)
    consumed: Consumed | None = None
    #: the last epoch the checkpoint covers (its sink epochs are committed); -1 for none
    covered_epoch: int = -1
    #: each stage's restored state, by operator id (none for an empty start)
    states: dict[str, DataFrame] = field(default_factory=dict)
    #: by operator id, the chains an incremental stage's next snapshots build on
    chains: dict[str, dict[int, SubtaskChain]] = field(default_factory=dict)
    #: seconds the restore spent: finding and verifying the checkpoint, the input's schema,
    #: reading the state, the sink's recovery, in all
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def next_epoch(self) -> int:
        return self.covered_epoch + 1


class RunRestore:
    """The restore of one run: ``options.restore`` chooses the checkpoint (``none``,
    ``latest``, an id, a path), ``stages`` and ``sink`` are what it brings back, ``files`` the
    input listed for the run and ``read`` how the run reads an epoch (the restore reads the
    next one to learn the state's schema)."""

    def __init__(
        self,
        spec: PipelineSpec,
        spark: SparkSession,
        metastore: Metastore,
        storage: CheckpointStorage,
        options: RunOptions,
        *,
        attempt: str,
        parallelism: int,
        stages: Sequence[StageRun],
        sink: Sink,
        inputs: InputTransform,
        files: list[str] | list[ObjectInfo],
        read: ReadFn,
    ) -> None:
        self.spec = spec
        self.spark = spark
        self.metastore = metastore
        self.storage = storage
        self.options = options
        self.attempt = attempt
        self.parallelism = parallelism
        self.partition_keys = partition_keys(parallelism)
        self.stages = list(stages)
        self.operators = [SOURCE, *(s.operator_id for s in self.stages), SINK]
        self.sink = sink
        self.inputs = inputs
        self.files = files
        self.read = read

    def restore(self) -> Restored:
        """Restore what ``options.restore`` chooses; record the restore; time its phases."""
        started = time.monotonic()
        reset = self._full_refresh()
        decision = self._decide(resume=reset is not None and reset.get("resumed", False))
        log.info("%s", decision.describe())
        phases = {"lookup_s": time.monotonic() - started}
        assignment = None
        if decision.metadata is None:
            restored = Restored(None, self._planned_epochs(), phases=phases)
        else:
            restored, assignment = self._load(decision.metadata, phases)
        mark = time.monotonic()
        committed, discarded = self.sink.recover(
            None if decision.metadata is None else restored.covered_epoch,
            checkpoint_id=decision.checkpoint_id,
            state=[] if decision.metadata is None else decision.metadata.list_items(SINK),
        )
        if committed or discarded:
            log.info("sink: committed %s, discarded %s on restore", committed, discarded)
        if reset is not None:
            assignment = {**(assignment or {}), "full_refresh": reset}
        detail = self.sink.recovery_detail()
        if detail is not None:  # e.g. the table brought back to what the checkpoint committed
            log.info("sink: %s", detail)
            assignment = {**(assignment or {}), "sink": detail}
        # how long the restore took, for the watching operator's metrics (restore_duration)
        assignment = {**(assignment or {}), "restore_s": round(time.monotonic() - started, 3)}
        lookup.record_restore(
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
        log.info("job %s: %s", self.spec.job, describe_epochs(restored.epochs, self.spec.source))
        return restored

    def _full_refresh(self) -> dict[str, Any] | None:
        """``options.full_refresh``: the sink reset, for the empty start that follows."""
        if not self.options.full_refresh:
            return None
        check_full_refresh(self.spec, self.options.restore)  # the checks hold on every path
        token = self.options.refresh_token
        if token is not None and refresh.began(self.metastore, self.storage, self.spec.job, token):
            log.info(
                "job %s: resuming the full refresh %s begun by an earlier try", self.spec.job, token
            )
            return {"resumed": True, "token": token}
        floor = refresh.begin(self.metastore, self.spec.job, token)  # first: old ones unusable
        epochs = self.sink.reset()  # then the output (idempotent: a retry resets again)
        log.warning(
            "job %s: full refresh from checkpoint %d: the sink's %d epoch(s) removed (%s); "
            "starting empty",
            self.spec.job,
            floor,
            len(epochs),
            self.sink.path,
        )
        return {"epochs_removed": len(epochs), "sink": str(self.sink.path), "from": floor}

    def _decide(self, *, resume: bool = False) -> lookup.RestoreDecision:
        """The checkpoint ``options.restore`` chooses, verified; an empty start is refused
        where the sink holds committed output. A full refresh starts empty, or ``resume``s
        from its own latest checkpoint."""
        choice = self.options.restore
        if self.options.full_refresh:
            choice = "latest" if resume else "none"
        if choice == "none":
            refuse_empty_start(self.sink, self.spec.job, choice)
            return lookup.RestoreDecision(self.spec.job, None, None, None, None)
        if choice == "latest":
            decision = lookup.find_latest_valid(self.metastore, self.storage, self.spec.job)
            if decision.metadata is None:  # none, or none valid: never start over committed output
                refuse_empty_start(self.sink, self.spec.job, choice)
            return decision
        if choice.isdigit():
            return lookup.load_checkpoint(self.metastore, self.storage, self.spec.job, int(choice))
        # recorded under this job, not the savepoint's (which may be unknown to this metastore)
        return lookup.load_external(
            self.storage,
            choice,
            job_id=self.spec.job,
            allow_other_job=self.options.allow_other_job,
        )

    def _planned_epochs(self) -> list[list[InputSplit]]:
        """Every input file in epochs: an empty start's, or an older checkpoint's (one whose
        source state has no processed splits)."""
        source = self.spec.source
        splits = plan_splits(self.files, source.format.value, source.max_split_bytes)
        return plan_epochs(splits, source.splits_per_epoch, source.epoch_bytes)

    def _load(
        self, metadata: CheckpointMetadata, phases: dict[str, float]
    ) -> tuple[Restored, dict[str, Any]]:
        """The run resumed from ``metadata``, and the restore's assignment to record."""
        source = metadata.list_items(SOURCE)
        processed = has_progress(source)
        epochs = [] if processed else self._planned_epochs()
        plan = plan_restore(
            snapshots_from_metadata(metadata),
            self.operators,
            new_parallelism=self.parallelism,
            max_parallelism=self.spec.max_parallelism,
            allow_non_restored_state=self.options.allow_non_restored_state,
        )
        read_by: dict[int, str] = {}
        consumed = None
        if processed:  # the epochs it read, its remaining, new files
            resumed = resume(
                source,
                self.files,
                self.spec.source.format.value,
                self.spec.source.max_split_bytes,
                self.spec.source.splits_per_epoch,
                metadata.checkpoint_id,
                self.spec.source.epoch_bytes,
                self.spec.source.on_changed_input.value,
                self.spec.source.max_file_age,
            )
            epochs, consumed = resumed.epochs, resumed.consumed
            if resumed.aged or resumed.skipped:
                log.info(
                    "job %s: source.max_file_age %s: %d file(s) read earlier forgotten as too "
                    "old, %d listed file(s) too old skipped",
                    self.spec.job,
                    self.spec.source.max_file_age,
                    len(resumed.aged),
                    len(resumed.skipped),
                )
            if resumed.gone:
                log.info(
                    "job %s: %d file(s) read earlier are gone (forgotten), e.g. %s",
                    self.spec.job,
                    len(resumed.gone),
                    resumed.gone[0],
                )
            if resumed.changed:
                log.warning(
                    "job %s: %d file(s) read earlier have changed (source.on_changed_input %s): %s",
                    self.spec.job,
                    len(resumed.changed),
                    self.spec.source.on_changed_input.value,
                    ", ".join(resumed.changed[:5]),
                )
            read_by = {
                int(i["epoch"]): str(i["attempt"])
                for i in source
                if is_processed(i) and isinstance(i.get("attempt"), str)
            }
        covered = through_epoch(metadata, len(epochs))
        changed = self.inputs.check_restore(source, metadata.checkpoint_id, self.options)
        if not processed:  # an older checkpoint: the same input only
            planned = remaining_splits(epochs, covered + 1)
            check_source(plan.operator(SOURCE), planned, metadata.checkpoint_id)
        if covered + 1 >= len(epochs):
            log.info(
                "job %s: no new input since checkpoint %d (%d epochs, %d files read)",
                self.spec.job,
                metadata.checkpoint_id,
                len(epochs),
                len({s.path for e in epochs for s in e}),
            )
        # sets the input schema, which defines the state schema (the next epoch's files: their
        # listing is then warm for the first epoch after the restore)
        mark = time.monotonic()
        self.read(schema_splits(epochs, covered + 1, self.files))
        phases["input_schema_s"] = time.monotonic() - mark
        mark = time.monotonic()
        states, chains = self._stage_states(plan, metadata)
        phases["state_s"] = time.monotonic() - mark
        restored = Restored(
            metadata.checkpoint_id, epochs, read_by, consumed, covered, states, chains, phases
        )
        return restored, {**plan.to_dict(), **({"tables": changed} if changed else {})}

    def _stage_states(
        self, plan: StateAssignment, metadata: CheckpointMetadata
    ) -> tuple[dict[str, DataFrame], dict[str, dict[int, SubtaskChain]]]:
        """Each stage's state read back as ``plan`` assigns it, and the chains of those whose
        snapshots are incremental: a subtask with the same key groups in shared files builds
        on them."""
        states, chains = {}, {}
        for s in self.stages:
            restored = plan.operator(s.operator_id)
            runs = restored_runs(metadata, s.operator_id)
            if s.runs is not None and runs is not None:  # taken over as they are
                s.runs.restore(runs)
                continue
            states[s.operator_id] = restore_stage(
                self.spark,
                self.storage,
                empty_state(self.spark, s, self.parallelism),
                restored,
                metadata,
                self.partition_keys,
                s.key,
                merge=_merge_of(s),
                unmerged=s.lazy,  # merged with the next compaction's
            )
            if s.runs is not None:  # Arrow snapshots: the first run of this attempt
                s.runs.add_base(_merge_of(s)(states.pop(s.operator_id)))  # type: ignore[misc]
                continue
            if s.chains is not None:
                shared = self.storage.shared_url(self.spec.job)
                how = CHAIN_AGGREGATE if s.lazy else CHAIN_REPLACE
                chains[s.operator_id] = continued_chains(
                    restored, metadata, shared, self.storage, how
                )
        return states, chains


def _merge_of(s: StageRun) -> Callable[[DataFrame], DataFrame] | None:
    """How a stage merges partial aggregates read back (an aggregate chain), if it can."""
    stage = s.stage
    if not isinstance(stage, AggregationStage):
        return None
    return lambda df: stage.compact([df])
