"""The Spark runtime: runs a :class:`~checkpointing.pipeline.spec.PipelineSpec` in epochs,
checkpointing at epoch boundaries, and resumes from the latest checkpoint with the same or another
parallelism.

Operators (Flink's words): ``source`` — the input splits still to read (operator list state, dealt
round-robin over its subtasks on restore); ``aggregate`` — the keyed stage's state, e.g. per-key
partial aggregates (keyed state, ``max_parallelism`` key groups, subtask ``i`` owns Flink's
contiguous range; a chain has one such operator per stage); ``sink`` — the two-phase-commit
sink's staged epochs (list state). Each epoch: read its splits, fold them into each stage's state
(which stays partitioned by subtask between epochs), stage the last stage's changed rows in the
sink. At a boundary with a triggered checkpoint (the barrier: the epoch boundary is global, so
alignment is free), every keyed subtask writes its snapshot from the executor and the driver
acknowledges them in one batch per operator; the completion notification commits the sink's
staged epochs.

Here: the run and its epoch loop. Elsewhere: the options and the checks before Spark starts
(:mod:`~checkpointing.spark.preflight`), the session (:mod:`~checkpointing.spark.session`), what
a run restores (:mod:`~checkpointing.spark.run_restore`), the operator state's snapshot and
restore on the driver (:mod:`~checkpointing.spark.state`) and on the executors
(:mod:`~checkpointing.spark.executor`), the keyed stages (:mod:`~checkpointing.spark.stages`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from py4j.protocol import Py4JJavaError
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.failure import CheckpointException
from checkpointing.coordination.heartbeat import Heartbeat
from checkpointing.coordination.pending import awaiting_attempt
from checkpointing.coordination.store import CompletedCheckpoint
from checkpointing.errors import SharedStateError, SparkJvmError
from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline.operator_ids import SINK, SOURCE
from checkpointing.pipeline.spec import PipelineSpec, SpecError
from checkpointing.pipeline.splits import Consumed, InputSplit, parquet_rows, source_state
from checkpointing.restore.recovery import pipeline_plan
from checkpointing.sinks.guard import check_pipeline_sink
from checkpointing.spark import keyed_runs
from checkpointing.spark.async_snapshot import AsyncSnapshots, StageWrite
from checkpointing.spark.input_reader import InputError, InputReader, spark_reason
from checkpointing.spark.jvm_failure import JvmWatch, exception_chain
from checkpointing.spark.keyed_runs import EpochWriteError
from checkpointing.spark.keys import (
    KEY_GROUP,
    SUBTASK,
    check_key_columns,
    check_partition_columns,
    key_group_column,
    partition_keys,
    subtask_column,
)
from checkpointing.spark.lazy_state import add_epoch, compact, lazy_stage
from checkpointing.spark.lazy_state import changes as lazy_changes
from checkpointing.spark.preflight import (
    RestoreSourceError,
    RunOptions,
    check_run,
    checkpoint_every,
    input_files,
)
from checkpointing.spark.run_restore import RunRestore
from checkpointing.spark.session import session_settings
from checkpointing.spark.sinks import open_sink
from checkpointing.spark.stages import Stage, stage_chain
from checkpointing.spark.state import (
    MAX_DIRTY_EPOCHS,
    StageRun,
    chained_stages,
    changed_rows,
    empty_state,
    list_acks,
    snapshot_stage,
    through_epoch,
    writes_full,
)
from checkpointing.spark.transform import InputTransform, TransformFn
from checkpointing.state.incremental import CHAIN_AGGREGATE, CHAIN_REPLACE
from checkpointing.state.storage import CheckpointStorage
from checkpointing.status import CheckpointType, JobStatus

#: re-exported from preflight and input_reader (not spark_session: a test patching it in session
#: must not leave a stale copy here)
__all__ = ["InputError", "PipelineRun", "RestoreSourceError", "RunOptions", "RunResult"]
__all__ += ["SimulatedCrash", "check_run"]

log = logging.getLogger(__name__)


class SimulatedCrash(RuntimeError):
    """Raised by the ``crash_after_epochs`` test hook: the job dies between two epochs."""


@dataclass
class RunResult:
    job_id: str
    epochs_total: int
    epochs_run: list[int] = field(default_factory=list)
    restored_from: int | None = None
    checkpoints: list[int] = field(default_factory=list)
    final_path: str | None = None
    #: set when a stop-with-savepoint ended the run: the savepoint to resume from
    stopped_with_savepoint: str | None = None
    rows_read: int = 0
    #: seconds the restore spent: finding and verifying the checkpoint, the input's schema,
    #: reading the state, the sink's recovery, in all
    restore_phases: dict[str, float] = field(default_factory=dict)
    #: warm restarts before this attempt (see :mod:`~checkpointing.spark.restarts`)
    restarts: int = 0


class PipelineRun:
    """One attempt of a pipeline: restore, then epochs with barriers, then the final table."""

    def __init__(
        self,
        spec: PipelineSpec,
        spark: SparkSession,
        metastore: Metastore,
        storage: CheckpointStorage,
        options: RunOptions | None = None,
        *,
        on_epoch: Callable[[int, int], None] | None = None,
        stage: Stage | None = None,
        stages: Sequence[Stage] = (),
        transform: TransformFn | None = None,
    ) -> None:
        """``stage``: the keyed stateful stage (e.g. a Python API
        :class:`~checkpointing.spark.stages.ArrowStage`); default the spec's aggregations.
        ``stages``: a chain of them instead, each fed the rows the one before emits in the same
        epoch; the first is keyed by the spec's key, the others by their own. ``transform``:
        the Python API's per-epoch transform (else the spec's SQL one, if any)."""
        self.spec = spec
        self.spark = spark
        self.metastore = metastore
        self.storage = storage
        self.options = options or RunOptions()
        self.on_epoch = on_epoch
        self.parallelism = self.options.parallelism or spec.parallelism
        self.max_parallelism = spec.max_parallelism
        if self.parallelism > self.max_parallelism:
            raise SpecError(
                f"parallelism {self.parallelism} exceeds max_parallelism {self.max_parallelism}"
            )
        #: subtask i's value of the state's subtask column: Spark puts it in partition i
        self.partition_keys = partition_keys(self.parallelism)
        self.attempt = self.options.attempt or f"a{uuid.uuid4().hex[:10]}"
        files = input_files(spec)  # listed now: the restore plans the epochs from them
        self.inputs = InputTransform(spark, spec, transform)  # and the static tables
        #: the epochs to run, from the restore: a checkpoint's own epochs and the files new
        #: since, or every file for an empty start
        self.epochs: list[list[InputSplit]] = []
        #: the run that read each epoch (list state of processed splits), restored or this one
        self.read_by: dict[int, str] = {}
        #: the files read before this run, compacted (None: every processed split an item)
        self.consumed: Consumed | None = None
        self.stages = chained_stages(stage_chain(spec, stage, stages), spec.key)
        if (lazy := lazy_stage(spec, self.stages)) is not None:  # only the final table is read
            lazy.lazy = True
        for s in self.stages:  # a stage that tells its changed rows can snapshot just those
            s.chains = {} if spec.checkpoint.incremental and s.stage.incremental else None
        if lazy is not None:  # its state the checkpoints' Parquet runs, where Spark can write them
            keyed_runs.attach(lazy, spec, spark, storage, self.attempt, self.parallelism)
        check_pipeline_sink(spec, storage.base_url)
        self.sink = open_sink(spec, job=spec.job, key=self.stages[-1].key if self.stages else None)
        self.operators = [SOURCE, *(s.operator_id for s in self.stages), SINK]
        self.plan = pipeline_plan(
            self.attempt, self.parallelism, self.max_parallelism, self.operators
        )
        self.coordinator = CheckpointCoordinator(
            spec.job,
            metastore,
            storage,
            spec.checkpoint.config(),
            coordinator_id=self.options.coordinator_id,
            plan_provider=lambda: self.plan,
            completion_listeners=[self._commit_sink],
        )
        #: the source's reader; its schema, fixed by the first read, is each stage's input's
        self.reader = InputReader(spark, spec)
        #: the first rows' schema was checked against the stages and the sink
        self.checked = False
        self.next_epoch = 0
        #: a checkpoint after every N-th epoch (set by the restore, which knows the epochs)
        self.every: int | None = spec.checkpoint.every_epochs
        #: rows in the last epoch's input, when cheap to know (Parquet footers)
        self.last_epoch_rows: int | None = None
        #: the last epoch covered by a completed checkpoint (its sink epochs are committed)
        self.covered_epoch = -1
        self.result = RunResult(spec.job, 0)
        #: a Spark JVM's death or lack of memory said as such (settings read while it answers)
        self.jvm = JvmWatch.of(spark, spec)
        #: what the run is doing, for that message: where, and whether an epoch's input is in it
        self.doing = ("while starting", False)
        #: the checkpoint whose files are being written while the next epoch runs
        self.snapshots = AsyncSnapshots()
        self.restorer = RunRestore(
            spec,
            spark,
            metastore,
            storage,
            self.options,
            attempt=self.attempt,
            parallelism=self.parallelism,
            stages=self.stages,
            sink=self.sink,
            inputs=self.inputs,
            files=files,
            read=self._read,
        )

    # ------------------------------------------------------------------ input

    def _read(self, splits: Sequence[InputSplit]) -> DataFrame:
        """The transform's output over the rows of ``splits``; the first checks the stages."""
        rows = self.inputs.apply(self.reader.read(splits))
        if not self.checked:
            self._check_stages(rows.schema)
            self.checked = True
        return rows

    def _check_stages(self, schema: T.StructType) -> None:
        """The first rows (the transform's output) fit the key and the stages, whose state
        schemas they fix: e.g. key columns exist, aggregated columns are numeric; and the
        sink's partition columns are in what the last stage emits."""
        with self.inputs.naming_output():
            for s in self.stages:
                s.input_schema = schema
                check_key_columns(schema, s.key)
                s.stage.check(schema)
                schema = s.stage.output_schema(schema)  # what it emits: the next one's input
            check_partition_columns(schema, self.spec.sink.partition_by)

    # ------------------------------------------------------------------ run

    def run(self) -> RunResult:
        try:
            with session_settings(self.spark, self._sql_settings()), self.inputs:
                try:
                    return self._run()
                finally:
                    self.snapshots.close()
                    for s in self.stages:
                        if s.runs is not None:
                            s.runs.close()
        except Exception as exc:  # putting settings back fails on a JVM gone: not the news
            lost = next((e for e in exception_chain(exc) if isinstance(e, SparkJvmError)), None)
            if lost is None or lost is exc:
                raise
            raise lost from lost.__cause__

    def _sql_settings(self) -> dict[str, str]:
        """Keep the state where it is between epochs: adaptive execution hides a checkpointed
        plan's hash partitioning (every merge would then reshuffle the whole state), and our
        shuffles are by subtask, so ``parallelism`` partitions are all there is to use."""
        return {
            "spark.sql.adaptive.enabled": "false",
            "spark.sql.shuffle.partitions": str(self.parallelism),
        }

    def _run(self) -> RunResult:
        if self.options.coordinator_id:  # the operator activated it; a newer try may have since
            self.coordinator.join()
        else:
            self.coordinator.activate()
        self.coordinator.job_status_changed(JobStatus.RUNNING)
        with Heartbeat(self.metastore, self.spec.job, self.coordinator.coordinator_id):
            return self._epochs()

    def _epochs(self) -> RunResult:
        crash_at = self.options.crash_after_epochs
        try:
            self._restore()
            for epoch in range(self.next_epoch, len(self.epochs)):
                started = time.monotonic()
                self._process(epoch)
                self.next_epoch = epoch + 1
                self.result.epochs_run.append(epoch)
                self._barrier(epoch)
                if self.on_epoch:
                    self.on_epoch(epoch, int((time.monotonic() - started) * 1000))
                if self.coordinator.stop_savepoint is not None:
                    return self._stop_with_savepoint(epoch)
                if crash_at is not None and len(self.result.epochs_run) >= crash_at:
                    self._complete_inflight()  # the hook dies after the epoch's checkpoint
                    raise SimulatedCrash(f"crash injected after epoch {epoch}")
            self._finish()
        except BaseException as exc:
            lost = self._jvm_failure(exc) if isinstance(exc, Exception) else None
            self._fail()
            if lost is not None:
                raise lost from exc
            if isinstance(exc, EpochWriteError):  # said as any epoch's failure
                cause = exc.__cause__ or exc
                raise InputError(
                    f"job {self.spec.job}: epoch {exc.epoch} failed reading {exc.describe}: "
                    f"{spark_reason(cause)}"
                ) from cause
            raise
        return self.result

    def _jvm_failure(self, exc: Exception) -> SparkJvmError | None:
        """``exc`` as the one line that says which Spark JVM died or ran out of memory, where
        the run was and what to raise; None when no JVM caused it."""
        where, in_epoch = self.doing
        chain = exception_chain(exc)
        if (late := next((e for e in chain if isinstance(e, EpochWriteError)), None)) is not None:
            runs = next(s.runs for s in self.stages if s.runs is not None)  # its job ran behind
            epochs = " and ".join(str(e) for e in runs.failed_epochs(late.epoch))
            at_once = " (their Spark jobs ran at once)" if " and " in epochs else ""
            where = f"in epoch{'s' if at_once else ''} {epochs}{at_once} while merging the state"
            return self.jvm.failure(exc, f"{where} of stage {late.operator_id!r}", in_epoch=True)
        if (inflight := self.snapshots.inflight) is not None:  # its Spark job ran alongside
            where += f" (checkpoint {inflight.checkpoint_id}'s snapshot being written meanwhile)"
        return self.jvm.failure(exc, where, in_epoch=in_epoch)

    def _restore(self) -> None:
        """Start where the restore says: its epochs, each stage's state and chains."""
        self.doing = ("while restoring the job's state", False)
        for s in self.stages:
            if s.runs is not None:
                s.runs.clear_stale_staging()
        restored = self.restorer.restore()
        self.epochs, self.read_by = restored.epochs, restored.read_by
        self.consumed = restored.consumed
        self.covered_epoch, self.next_epoch = restored.covered_epoch, restored.next_epoch
        for s in self.stages:
            state = restored.states.get(s.operator_id)
            if state is not None and s.lazy:  # read back as partials: merged when compacted
                s.state, s.deltas = self._empty_state(s), [state]
            elif state is not None:
                s.state = state
            if s.chains is not None:
                s.chains = restored.chains.get(s.operator_id, s.chains)
        self.result.restored_from = restored.checkpoint_id
        self.result.epochs_total = len(self.epochs)
        self.every, how = checkpoint_every(self.spec, len(self.epochs))
        log.info("job %s: %d epoch(s) planned; %s", self.spec.job, len(self.epochs), how)
        self.result.restore_phases = dict(restored.phases)

    def _fail(self) -> None:
        """This attempt failed: abort its pending checkpoints (job failover, not counted) and mark
        the job FAILED, which drops queued savepoint requests with a reason instead of leaving
        them waiting; the next attempt marks it RUNNING again."""
        try:  # the snapshot in flight is of a consistent boundary: acknowledge it if written
            self._complete_inflight()
        except Exception:
            log.exception("job %s: the snapshot in flight failed too", self.spec.job)
        try:
            self.snapshots.abandon()
            self.coordinator.stop_background()
            self.coordinator.failover(f"attempt {self.attempt} failed")
            self.coordinator.job_status_changed(JobStatus.FAILED)
        except Exception:  # never mask the failure itself
            log.exception("job %s: could not record the failed attempt", self.spec.job)

    def _stop_with_savepoint(self, epoch: int) -> RunResult:
        """Flink's stop-with-savepoint: the savepoint completed (its notification committed the
        sink's epochs), so the job ends here; a later run resumes from the savepoint."""
        completed = self.coordinator.stop_savepoint
        assert completed is not None
        self.coordinator.notify_pending_completions()
        self.result.stopped_with_savepoint = completed.location
        self.coordinator.shutdown(JobStatus.FINISHED)
        log.info(
            "job %s: stopped with savepoint %d after epoch %d: %s",
            self.spec.job,
            completed.checkpoint_id,
            epoch,
            completed.location,
        )
        return self.result

    def _process(self, epoch: int) -> None:
        splits = self.epochs[epoch]
        try:
            self._process_splits(epoch, splits)
        except (Py4JJavaError, PySparkException) as exc:  # say which epoch and files, keep cause
            raise InputError(
                f"job {self.spec.job}: epoch {epoch} failed reading "
                f"{', '.join(s.describe() for s in splits)}: {spark_reason(exc)}"
            ) from exc
        rows = parquet_rows(splits) if self.spec.source.format.value == "parquet" else None
        self.last_epoch_rows = rows
        self.result.rows_read += rows or 0

    def _process_splits(self, epoch: int, splits: Sequence[InputSplit]) -> None:
        rows = self._read(splits)
        if len(self.result.epochs_run) == self.options.fail_task_after_epochs:  # test hook
            failure = F.raise_error(F.lit(f"task failure injected in epoch {epoch}"))
            rows = rows.where(F.coalesce(failure.cast("boolean"), F.lit(True)))
        for s in self.stages:  # each stage's changed rows are the next one's input
            self.doing = (
                f"in epoch {epoch} while merging the state of stage {s.operator_id!r}",
                True,
            )
            if s.runs is not None:  # its partial aggregates written as runs, in the background
                s.runs.add_epoch(epoch, rows, ", ".join(x.describe() for x in splits))
                return
            if s.lazy:  # the last stage, whose changed rows nobody reads: no merge, no output
                track, reset = s.chains is not None, self.snapshots.inflight is None
                add_epoch(s, epoch, rows, partial(self._keyed, s.key), track=track, reset=reset)
                return
            if s.state is None:
                s.state = self._empty_state(s)
            step = s.stage.step(s.state, rows, partial(self._keyed, s.key))
            s.state, rows = step.state, step.output
            if s.chains is not None:  # incremental: the next snapshot writes these rows
                if step.changed_state is None:
                    raise TypeError(f"{s.stage!r} is incremental: its step must give changed_state")
                reset = self.snapshots.inflight is None
                s.track_changes(epoch, step.changed_state, MAX_DIRTY_EPOCHS, reset=reset)
        if self.spec.sink.changelog or not self.stages:
            self.doing = (f"in epoch {epoch} while staging its rows in the sink", True)
            self.sink.stage(epoch, rows)

    def _keyed(self, key: Sequence[str], df: DataFrame) -> DataFrame:
        """``df`` with its key group and subtask, partitioned by subtask like the state."""
        return (
            df.withColumn(KEY_GROUP, key_group_column(key, self.max_parallelism))
            .withColumn(SUBTASK, subtask_column(self.parallelism, self.max_parallelism))
            .repartition(self.parallelism, SUBTASK)
        )

    def _empty_state(self, s: StageRun) -> DataFrame:
        return empty_state(self.spark, s, self.parallelism)

    # ------------------------------------------------------------------ checkpoints

    def _barrier(self, epoch: int, *, force: bool = False) -> None:
        """The epoch boundary: acknowledge the snapshot written meanwhile, trigger what is due,
        then snapshot every pending checkpoint that waits for this attempt's tasks (a periodic
        checkpoint's files are written while the next epoch runs; a savepoint's and a forced
        one's before this returns)."""
        self.doing = (f"at the checkpoint barrier after epoch {epoch}", False)
        self._complete_inflight()
        every = self.every
        due = force or (every is not None and (epoch + 1) % every == 0)
        if due:
            try:
                self.coordinator.trigger_checkpoint(forced=force)
            except CheckpointException as exc:
                log.info("job %s: no checkpoint after epoch %d: %s", self.spec.job, epoch, exc)
        self.coordinator.run_once()  # queued requests (savepoints), expiry, notifications
        for checkpoint_id, location, ctype in self._pending_for_this_attempt():
            self._snapshot(checkpoint_id, location, epoch, ctype)
            if force or ctype is not CheckpointType.CHECKPOINT:
                self._complete_inflight()

    def _pending_for_this_attempt(self) -> list[tuple[int, str, CheckpointType]]:
        with self.metastore.transaction() as s:
            return awaiting_attempt(s, self.spec.job, self.plan[0].attempt_id)

    def _snapshot(
        self, checkpoint_id: int, location_url: str, epoch: int, ctype: CheckpointType
    ) -> None:
        """The synchronous part of every operator's snapshot: the list state, and what each
        keyed stage will write; the writing then runs in the background (see
        :mod:`~checkpointing.spark.async_snapshot`). An incremental checkpoint's keyed stages
        write their changes under the job's ``shared/``; a savepoint is always full and
        self-contained, in its own directory."""
        self._complete_inflight()
        staged = self.sink.snapshot_state(epoch)
        lists = {
            SOURCE: list_acks(self.plan, SOURCE, self._source_state(epoch + 1)),
            SINK: list_acks(self.plan, SINK, staged),
        }
        incremental = ctype is CheckpointType.CHECKPOINT
        writes = {
            s.operator_id: self._stage_write(s, checkpoint_id, location_url, epoch, incremental)
            for s in self.stages
        }
        self.snapshots.submit(checkpoint_id, epoch, incremental, lists, writes)

    def _complete_inflight(self) -> None:
        """Acknowledge the snapshot in flight once written, a batch per operator; when that
        completes its checkpoint, later incremental snapshots build on it."""
        taken = self.snapshots.take()
        if taken is None:
            return
        snapshot, acks, chains = taken
        for op in (SOURCE, SINK, *(s.operator_id for s in self.stages)):
            try:
                outcome = self.coordinator.receive_acknowledge(snapshot.checkpoint_id, acks[op])
            except SharedStateError as exc:  # aborted: a file it builds on is no longer held
                if any(s.runs is not None for s in self.stages):  # the state itself is gone
                    raise
                log.warning("job %s: %s; the next snapshot is full", self.spec.job, exc)
                for s in self.stages:
                    s.chains = None if s.chains is None else {}
                return
            if outcome.completed is None:
                continue
            self.result.checkpoints.append(snapshot.checkpoint_id)
            for s in self.stages:
                if s.runs is not None:
                    s.runs.completed(chains[s.operator_id])
            if snapshot.incremental:
                for s in self.stages:
                    if s.chains is not None:
                        s.chains = chains[s.operator_id]
                        s.dirty = [(e, df) for e, df in s.dirty if e > snapshot.epoch]
        log.info(
            "job %s: snapshot for checkpoint %d after epoch %d written and acknowledged %d ms "
            "after the epoch",
            self.spec.job,
            snapshot.checkpoint_id,
            snapshot.epoch,
            (time.monotonic() - snapshot.started) * 1000,
        )

    def _stage_write(
        self, s: StageRun, checkpoint_id: int, location_url: str, epoch: int, incremental: bool
    ) -> StageWrite:
        """What one keyed stage's subtasks will write, fixed now (its state, changes and chains
        as of this boundary); the returned call writes it from the executors."""
        if s.runs is not None:
            runs, plan = s.runs, self.plan
            shared = self.storage.shared_checkpoint_url(self.spec.job, checkpoint_id)
            full = None if incremental else location_url
            return lambda: runs.snapshot(
                checkpoint_id, epoch, plan, shared_url=shared, full_url=full
            )
        empty = partial(self._empty_state, s)
        if s.state is None and not s.lazy:
            s.state = empty()
        args, where = (self.plan, self.storage), (self.partition_keys, self.max_parallelism)
        if not incremental or s.chains is None:  # a full snapshot needs the state whole
            state = compact(s, empty) if s.lazy else s.state
            assert state is not None
            return lambda: (snapshot_stage(state, s, *args, location_url, *where)[0], {})
        state = s.state if s.state is not None else empty()
        chains = dict(s.chains)
        if not s.lazy:
            changes, how = changed_rows(s), CHAIN_REPLACE
        else:  # the epochs' partial aggregates; a subtask whose chain is cut writes it whole
            cut = (writes_full(chains, i, CHAIN_AGGREGATE) for i in range(self.parallelism))
            state = compact(s, empty) if any(cut) else state
            changes, how = lazy_changes(s), CHAIN_AGGREGATE
        shared = self.storage.shared_checkpoint_url(self.spec.job, checkpoint_id)
        return lambda: snapshot_stage(
            state, s, *args, shared, *where, chains=chains, changes=changes, chain_merge=how
        )

    def _source_state(self, first_epoch: int) -> list[dict[str, Any]]:
        """The source's list state (Flink's ``PendingSplitsCheckpoint``): the files earlier
        runs read (compacted), the splits processed before ``first_epoch`` (each with the run
        that read it), those still to read, and the static tables' files."""
        state = source_state(self.epochs, first_epoch, self.consumed, self.read_by, self.attempt)
        return state + self.inputs.items

    def _commit_sink(self, completed: CompletedCheckpoint) -> None:
        """The completion notification: commit the epochs the checkpoint covers."""
        covered = through_epoch(completed.metadata, len(self.epochs))
        self.sink.commit(covered, completed.checkpoint_id)
        self.covered_epoch = max(self.covered_epoch, covered)

    def _finish(self) -> None:
        """All epochs done: a last checkpoint covers everything (its notification commits the
        last epochs), then the final table is published atomically and the job finishes."""
        last = len(self.epochs) - 1
        self._complete_inflight()
        if self.covered_epoch < last:
            self._barrier(last, force=True)
        self.coordinator.notify_pending_completions()
        if self.covered_epoch < last:
            raise RuntimeError(
                f"job {self.spec.job}: the final checkpoint did not complete; see `ckpt list`"
            )
        self.doing = ("while publishing the final table", False)
        if not self.stages:  # stateless: the committed epochs are the table
            self.result.final_path = self.spec.final_location()
            self.coordinator.shutdown(JobStatus.FINISHED)
            return
        last = self.stages[-1]
        if last.runs is not None:
            state = last.runs.final_state(self._empty_state(last))
        elif last.lazy:
            state = compact(last, partial(self._empty_state, last))
        else:
            state = last.state if last.state is not None else self._empty_state(last)
        token = f"{self.spec.job}-{self.attempt}"
        self.result.final_path = self.sink.publish_final(last.stage.final(state), token)
        self.coordinator.shutdown(JobStatus.FINISHED)
