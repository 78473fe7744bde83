"""The Spark runtime: runs a :class:`~checkpointing.spec.PipelineSpec` in epochs, checkpointing at
epoch boundaries, and resumes from the latest checkpoint with the same or another parallelism.

Operators (Flink's words): ``source`` — the input splits still to read (operator list state, dealt
round-robin over its subtasks on restore); ``aggregate`` — per-key partial aggregates (keyed state,
``max_parallelism`` key groups, subtask ``i`` owns Flink's contiguous range); ``sink`` — the
two-phase-commit sink's staged epochs (list state). Each epoch: read its splits, pre-aggregate
them, merge into the state (which stays partitioned by subtask between epochs), stage the changed
rows in the sink. At a boundary with a triggered checkpoint (the barrier: the epoch boundary is
global, so alignment is free), every aggregate subtask writes its snapshot from the executor and
the driver acknowledges them in one batch per operator; the completion notification commits the
sink's staged epochs.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pyarrow as pa
from py4j.protocol import Py4JJavaError
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.pandas.types import from_arrow_schema
from sqlalchemy import select

from checkpointing import restore
from checkpointing.assignment import plan_restore, snapshots_from_metadata
from checkpointing.coordinator import CheckpointCoordinator, CompletedCheckpoint
from checkpointing.errors import CheckpointingError, UnknownCheckpointError
from checkpointing.failure import CheckpointException
from checkpointing.ids import validate_id
from checkpointing.keygroups import key_group_range
from checkpointing.metadata import CheckpointMetadata
from checkpointing.metastore import Metastore
from checkpointing.models import Checkpoint, CheckpointTask
from checkpointing.pending import TaskAck, TaskSpec
from checkpointing.properties import CheckpointStatus, JobStatus, RestoreStatus
from checkpointing.recovery import pipeline_plan
from checkpointing.sink_guard import check_pipeline_sink
from checkpointing.spark.aggregations import AggregationPlan
from checkpointing.spark.executor import (
    WRITTEN,
    read_row_groups,
    read_subtask_snapshots,
    write_subtask_snapshot,
)
from checkpointing.spark.keys import (
    KEY_GROUP,
    SUBTASK,
    check_key_columns,
    key_group_column,
    partition_keys,
)
from checkpointing.spark.sink import TwoPhaseCommitSink
from checkpointing.spark.stages import AggregationStage, Stage
from checkpointing.spec import PipelineSpec, SpecError
from checkpointing.splits import InputSplit, epochs_of, plan_splits
from checkpointing.storage import CheckpointStorage

log = logging.getLogger(__name__)

SOURCE, AGGREGATE, SINK = "source", "aggregate", "sink"


class SimulatedCrash(RuntimeError):
    """Raised by the ``crash_after_epochs`` test hook: the job dies between two epochs."""


@dataclass(frozen=True)
class RunOptions:
    """:param restore: ``latest`` (resume if the job has checkpoints), ``none``, a checkpoint id,
        or a savepoint/checkpoint path.
    :param parallelism: override the spec's parallelism (a rescaled restore).
    :param attempt: this execution attempt's id (default: random).
    :param crash_after_epochs: test hook — raise :class:`SimulatedCrash` after this many epochs
        of this attempt.
    """

    restore: str = "latest"
    parallelism: int | None = None
    attempt: str | None = None
    crash_after_epochs: int | None = None
    allow_non_restored_state: bool = False
    #: restore from a checkpoint or savepoint path of another job (refused otherwise)
    allow_other_job: bool = False
    #: the coordinator identity to act under: an Airflow operator passes its own, so the
    #: operator (Flink's JobManager) and this driver are one coordinator of the job
    coordinator_id: str | None = None


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


def spark_session(
    app_name: str = "ckpt", master: str | None = None, conf: dict[str, str] | None = None
) -> SparkSession:
    """A Spark session whose Python workers run this interpreter (they need pyarrow and this
    package), keeping partitioning of cached state across joins on a subset of the keys.

    Under ``spark-submit`` the master, driver address and app name are the submitter's (an
    Airflow Spark connection); otherwise ``master`` (default ``local[2]``) runs on loopback.
    ``conf`` adds or overrides settings, e.g. ``spark.executorEnv.*`` for a cluster's executors."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.config("spark.sql.requireAllClusterKeysForCoPartition", "false")
    if not under_spark_submit():
        master = master or "local[2]"
        builder = (
            builder.master(master)
            .appName(app_name)
            .config("spark.pyspark.python", sys.executable)
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")  # ours is the progress display
        )
        if master.startswith("local") or "127.0.0.1" in master or "localhost" in master:
            # one machine: stay on loopback; a real cluster's executors must reach the driver
            builder = builder.config("spark.driver.host", "127.0.0.1").config(
                "spark.driver.bindAddress", "127.0.0.1"
            )
    elif master:
        builder = builder.master(master)
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


@contextmanager
def session_settings(spark: SparkSession, settings: dict[str, str]) -> Iterator[None]:
    """Runtime SQL settings for the duration of a run, then the session's own values again (a
    Python API user's session is theirs)."""
    before = {key: spark.conf.get(key, None) for key in settings}
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)


def under_spark_submit() -> bool:
    """True in a driver launched by ``spark-submit``, whose JVM is already up with its conf."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def input_files(spec: PipelineSpec) -> list[str]:
    """The files the spec's source glob matches, sorted; none is a :class:`SpecError`."""
    pattern = spec.resolve(spec.source.path)
    files = sorted(glob.glob(pattern.removeprefix("file://")))
    if not files:
        raise SpecError(f"source.path: {pattern!r} matches no files")
    return files


class RestoreSourceError(CheckpointingError, ValueError):
    """The restore source (``--restore``) cannot be restored from."""


def check_run(
    spec: PipelineSpec,
    options: RunOptions,
    storage: CheckpointStorage,
    metastore: Metastore | None,
) -> None:
    """Refuse what can be refused before a Spark session starts and before anything is written
    (the job is not registered, no restore is recorded): the parallelism, the input files, the
    sink path, and the restore source. Reads only; ``metastore`` None: there is none yet (so no
    checkpoint to restore by id). :class:`RestoreSourceError` names a bad ``restore``."""
    parallelism = options.parallelism or spec.parallelism
    if parallelism > spec.max_parallelism:
        raise SpecError(f"parallelism {parallelism} exceeds max_parallelism {spec.max_parallelism}")
    input_files(spec)
    check_pipeline_sink(spec, storage.base_url)  # not the input, the storage, ~, / ...
    sink = TwoPhaseCommitSink(spec.resolve(spec.sink.path), job=spec.job)  # nor foreign files
    choice = options.restore
    try:
        if choice == "none":
            if sink.committed_epochs():
                raise SpecError(
                    f"sink.path: {sink.path} holds committed output of an earlier run; "
                    "use --restore latest to resume it, or a new sink path"
                )
        elif choice == "latest":
            pass
        elif choice.isdigit():
            if metastore is None:
                raise UnknownCheckpointError(f"job {spec.job} has no checkpoint {choice}")
            restore.load_checkpoint(metastore, storage, spec.job, int(choice), deep=False)
        else:
            restore.load_external(
                storage,
                choice,
                deep=False,
                job_id=spec.job,
                allow_other_job=options.allow_other_job,
            )
    except (CheckpointingError, ValueError) as exc:
        if isinstance(exc, SpecError):
            raise
        raise RestoreSourceError(f"restore {choice!r}: {exc}") from None


class PipelineRun:
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
    ) -> None:
        """``stage``: the keyed stateful stage (e.g. a Python API
        :class:`~checkpointing.spark.stages.ArrowStage`); default the spec's aggregations.
        ``stages``: a chain of them instead, each fed the rows the one before emits in the same
        epoch; the first is keyed by the spec's key, the others by their own."""
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
        self.epochs = self._epochs()
        if stage is not None and stages:
            raise ValueError("give either stage or stages, not both")
        if stages:
            chain = list(stages)
        elif stage is not None:
            chain = [stage]
        elif spec.aggregations:
            chain = [AggregationStage(AggregationPlan(spec.key, spec.aggregations))]
        else:
            raise SpecError("aggregations: needs at least one aggregation (or a stage)")
        self.stages = chained_stages(chain, spec.key)
        check_pipeline_sink(spec, storage.base_url)
        self.sink = TwoPhaseCommitSink(spec.resolve(spec.sink.path), job=spec.job)
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
        #: the source's rows' schema, fixed by the first read (and each stage's input from it)
        self.input_schema: T.StructType | None = None
        self.next_epoch = 0
        #: rows in the last epoch's input, when cheap to know (Parquet footers)
        self.last_epoch_rows: int | None = None
        #: the last epoch covered by a completed checkpoint (its sink epochs are committed)
        self.covered_epoch = -1
        self.result = RunResult(spec.job, len(self.epochs))

    # ------------------------------------------------------------------ input

    def _epochs(self) -> list[list[InputSplit]]:
        source = self.spec.source
        splits = plan_splits(input_files(self.spec), source.format.value, source.max_split_bytes)
        return epochs_of(splits, source.splits_per_epoch)

    def _read(self, splits: Sequence[InputSplit]) -> DataFrame:
        """The rows of ``splits``: whole files through Spark's own reader, row-group ranges of
        big Parquet files through Arrow on the executors (only those row groups are read)."""
        whole = [s.path for s in splits if s.row_groups is None]
        ranged = [s for s in splits if s.row_groups is not None]
        reader = self.spark.read.format(self.spec.source.format.value)
        if self.spec.source.format.value == "csv":
            reader = reader.options(header=self.spec.source.header, inferSchema=True)
            reader = reader.option("mode", "FAILFAST")
        if self.input_schema is None and not whole:
            self.input_schema = self._checked(reader.load(ranged[0].path)).schema
        if self.input_schema is not None:
            reader = reader.schema(self.input_schema)
        parts = [self._checked(reader.load(whole))] if whole else []
        if ranged:
            assert self.input_schema is not None
            tasks = self.spark.createDataFrame(
                [(s.path, *s.row_groups) for s in ranged if s.row_groups is not None],
                "path string, start int, end int",
            ).repartition(len(ranged))
            parts.append(
                tasks.mapInArrow(partial(read_row_groups, self.input_schema), self.input_schema)
            )
        df = parts[0]
        for part in parts[1:]:
            df = df.unionByName(part)
        return df

    def _checked(self, df: DataFrame) -> DataFrame:
        """The first input read: check it fits the key and the stage, and fix its schema for
        every later read (and the state)."""
        if self.input_schema is None:
            schema = df.schema
            for s in self.stages:  # e.g. key columns exist, aggregated columns are numeric
                s.input_schema = schema
                check_key_columns(schema, s.key)
                s.stage.check(schema)
                schema = s.stage.output_schema(schema)  # what it emits: the next one's input
            self.input_schema = df.schema
        return df

    # ------------------------------------------------------------------ run

    def run(self) -> RunResult:
        with session_settings(self.spark, self._sql_settings()):
            return self._run()

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
                    raise SimulatedCrash(f"crash injected after epoch {epoch}")
            self._finish()
        except BaseException:
            self._fail()
            raise
        return self.result

    def _fail(self) -> None:
        """This attempt failed: abort its pending checkpoints (job failover, not counted) and mark
        the job FAILED, which drops queued savepoint requests with a reason instead of leaving
        them waiting; the next attempt marks it RUNNING again."""
        try:
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
                f"{', '.join(s.describe() for s in splits)}: {_spark_reason(exc)}"
            ) from exc
        rows = _parquet_rows(splits) if self.spec.source.format.value == "parquet" else None
        self.last_epoch_rows = rows
        self.result.rows_read += rows or 0

    def _process_splits(self, epoch: int, splits: Sequence[InputSplit]) -> None:
        rows = self._read(splits)
        for s in self.stages:  # each stage's changed rows are the next one's input
            state = s.state if s.state is not None else self._empty_state(s)
            s.state, rows = s.stage.step(state, rows, partial(self._keyed, s.key))
        self.sink.stage(epoch, rows)

    def _keyed(self, key: Sequence[str], df: DataFrame) -> DataFrame:
        """``df`` with its key group and subtask, partitioned by subtask like the state."""
        return (
            df.withColumn(KEY_GROUP, key_group_column(key, self.max_parallelism))
            .withColumn(SUBTASK, self._subtask_column())
            .repartition(self.parallelism, SUBTASK)
        )

    def _subtask_column(self) -> Any:
        """The owning subtask's partition key: subtask ``floor(kg * p / maxP)`` (the inverse
        of Flink's key-group ranges), as the value that sends it to Spark partition ``i``."""
        index = (F.col(KEY_GROUP) * F.lit(self.parallelism) / F.lit(self.max_parallelism)).cast(
            "int"
        )
        keys = F.array(*(F.lit(k) for k in self.partition_keys))
        return F.element_at(keys, index + 1)

    def _empty_state(self, s: StageRun) -> DataFrame:
        assert s.input_schema is not None
        schema = s.stage.state_schema(
            s.input_schema,
            extra_fields=[
                T.StructField(SUBTASK, T.IntegerType()),
                T.StructField(KEY_GROUP, T.IntegerType()),
            ],
        )
        # hash-partitioned by subtask like every later state: the first merge's union then
        # keeps that partitioning instead of shuffling by every grouping column from then on
        return self.spark.createDataFrame([], schema).repartition(self.parallelism, SUBTASK)

    # ------------------------------------------------------------------ checkpoints

    def _barrier(self, epoch: int, *, force: bool = False) -> None:
        """The epoch boundary: trigger what is due, then snapshot every pending checkpoint that
        waits for this attempt's tasks."""
        every = self.spec.checkpoint.every_epochs
        due = force or (every is not None and (epoch + 1) % every == 0)
        if due:
            try:
                self.coordinator.trigger_checkpoint(forced=force)
            except CheckpointException as exc:
                log.info("job %s: no checkpoint after epoch %d: %s", self.spec.job, epoch, exc)
        self.coordinator.run_once()  # queued requests (savepoints), expiry, notifications
        for checkpoint_id, location in self._pending_for_this_attempt():
            self._snapshot(checkpoint_id, location, epoch)

    def _pending_for_this_attempt(self) -> list[tuple[int, str]]:
        with self.metastore.transaction() as s:
            rows = s.execute(
                select(Checkpoint.checkpoint_id, Checkpoint.storage_location)
                .join(
                    CheckpointTask,
                    (CheckpointTask.job_id == Checkpoint.job_id)
                    & (CheckpointTask.checkpoint_id == Checkpoint.checkpoint_id),
                )
                .where(
                    Checkpoint.job_id == self.spec.job,
                    Checkpoint.status == CheckpointStatus.PENDING,
                    CheckpointTask.attempt_id == self.plan[0].attempt_id,
                )
                .order_by(Checkpoint.checkpoint_id)
            ).all()
        return [(r[0], r[1]) for r in rows]

    def _snapshot(self, checkpoint_id: int, location_url: str, epoch: int) -> None:
        started = time.monotonic()
        remaining = self._remaining_splits(epoch + 1)
        staged = [{"epoch": e} for e in self.sink.staged_epochs() if e <= epoch]
        acks_by_op = {
            SOURCE: _list_acks(self.plan, SOURCE, remaining),
            SINK: _list_acks(self.plan, SINK, staged),
        }
        for s in self.stages:
            acks_by_op[s.operator_id] = self._snapshot_stage(s, location_url)
        for op in (SOURCE, SINK, *(s.operator_id for s in self.stages)):  # a batch per operator
            outcome = self.coordinator.receive_acknowledge(checkpoint_id, acks_by_op[op])
            if outcome.completed is not None:
                self.result.checkpoints.append(checkpoint_id)
        log.info(
            "job %s: snapshot for checkpoint %d after epoch %d in %d ms",
            self.spec.job,
            checkpoint_id,
            epoch,
            (time.monotonic() - started) * 1000,
        )

    def _snapshot_stage(self, s: StageRun, location_url: str) -> list[TaskAck]:
        """Every subtask of one keyed stage writes its snapshot from the executor; its acks."""
        state = s.state if s.state is not None else self._empty_state(s)
        storage, keys, max_parallelism = self.storage, self.partition_keys, self.max_parallelism
        key, operator_id = list(s.key), s.operator_id

        def writer(table: pa.Table) -> pa.Table:  # annotated: Spark infers the UDF type from it
            return write_subtask_snapshot(
                storage, location_url, keys, max_parallelism, key, operator_id, table
            )

        snapshots = state.groupBy(SUBTASK).applyInArrow(writer, from_arrow_schema(WRITTEN))
        written = {row["subtask"]: row for row in snapshots.collect()}
        acks = []
        for task in (t for t in self.plan if t.operator_id == operator_id):
            r = key_group_range(self.max_parallelism, self.parallelism, task.subtask_index)
            row = written.get(task.subtask_index)
            meta: dict[str, Any] = {"key_groups": [r.start, r.end], "group_bytes": {}}
            if row is None:  # no keys in this subtask's key groups
                acks.append(TaskAck(task.attempt_id, state_meta=meta))
                continue
            meta["group_bytes"] = dict(zip(row["groups"], row["group_bytes"], strict=True))
            acks.append(
                TaskAck(
                    task.attempt_id,
                    row["url"],
                    row["size"],
                    row["checksum"],
                    row["sync_ms"],
                    row["async_ms"],
                    state_meta=meta,
                )
            )
        return acks

    def _remaining_splits(self, first_epoch: int) -> list[dict[str, Any]]:
        """The source's list state: every split of the epochs from ``first_epoch`` on."""
        return [s.to_state(e) for e in range(first_epoch, len(self.epochs)) for s in self.epochs[e]]

    def _check_source(self, subtasks: Sequence[Any], checkpoint_id: int) -> None:
        """The splits the checkpoint says remain must be the ones this run would read next:
        otherwise the input (or ``splits_per_epoch``, ``max_split_bytes``) changed since, and
        resuming would skip or repeat input."""

        def key(item: dict[str, Any]) -> str:
            return json.dumps(InputSplit.from_state(item).to_state(int(item["epoch"])))

        restored = sorted(key(dict(item)) for s in subtasks for item in s.list_state)
        planned = sorted(key(item) for item in self._remaining_splits(self.next_epoch))
        if restored != planned:
            missing = sorted(set(restored) - set(planned))
            extra = sorted(set(planned) - set(restored))
            raise SpecError(
                f"source: the input does not match checkpoint {checkpoint_id}: it has "
                f"{len(restored)} split(s) left to read, this run plans {len(planned)} "
                f"(only in the checkpoint: {missing[:2]}; only now: {extra[:2]}). Restore with "
                "the input, splits_per_epoch and max_split_bytes it was taken with"
            )

    def _commit_sink(self, completed: CompletedCheckpoint) -> None:
        """The completion notification: commit the epochs the checkpoint covers."""
        covered = through_epoch(completed.metadata, len(self.epochs))
        self.sink.commit(covered)
        self.covered_epoch = max(self.covered_epoch, covered)

    def _finish(self) -> None:
        """All epochs done: a last checkpoint covers everything (its notification commits the
        last epochs), then the final table is published atomically and the job finishes."""
        last = len(self.epochs) - 1
        if self.covered_epoch < last:
            self._barrier(last, force=True)
        self.coordinator.notify_pending_completions()
        if self.covered_epoch < last:
            raise RuntimeError(
                f"job {self.spec.job}: the final checkpoint did not complete; see `ckpt list`"
            )
        last = self.stages[-1]
        state = last.state if last.state is not None else self._empty_state(last)
        token = f"{self.spec.job}-{self.attempt}"
        self.result.final_path = self.sink.publish_final(last.stage.final(state), token)
        self.coordinator.shutdown(JobStatus.FINISHED)

    # ------------------------------------------------------------------ restore

    def _restore(self) -> None:
        choice = self.options.restore
        if choice == "none":
            decision = restore.RestoreDecision(self.spec.job, None, None, None, None)
            if self.sink.committed_epochs():
                raise SpecError(
                    f"sink.path: {self.sink.path} holds committed output of an earlier run; "
                    "use --restore latest to resume it, or a new sink path"
                )
        elif choice == "latest":
            decision = restore.find_latest_valid(self.metastore, self.storage, self.spec.job)
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
        assignment = None
        if decision.metadata is not None:
            assignment = self._load_state(decision.metadata)
            self.result.restored_from = decision.checkpoint_id
        committed, discarded = self.sink.recover(
            None if decision.metadata is None else self.next_epoch - 1
        )
        if committed or discarded:
            log.info("sink: committed %s, discarded %s on restore", committed, discarded)
        restore.record_restore(
            self.metastore,
            decision,
            attempt=self.attempt,
            parallelism=self.parallelism,
            assignment=assignment,
            status=RestoreStatus.RESTORED,
        )

    def _load_state(self, metadata: CheckpointMetadata) -> dict[str, Any]:
        plan = plan_restore(
            snapshots_from_metadata(metadata),
            self.operators,
            new_parallelism=self.parallelism,
            max_parallelism=self.max_parallelism,
            allow_non_restored_state=self.options.allow_non_restored_state,
        )
        self.covered_epoch = through_epoch(metadata, len(self.epochs))
        self.next_epoch = self.covered_epoch + 1
        self._check_source(plan.operator(SOURCE).subtasks, metadata.checkpoint_id)
        # sets the input schema, which defines the state schema (the next epoch's files: their
        # listing is then warm for the first epoch after the restore)
        self._read(self.epochs[min(self.next_epoch, len(self.epochs) - 1)])
        handles = {h.handle: h for h in metadata.handles()}
        for s in self.stages:
            reads = [
                (
                    self.partition_keys[t.subtask_index],
                    r.url,
                    handles[r.url].checksum,
                    handles[r.url].size,  # bounds the executor's read of the file
                    r.key_groups.start,
                    r.key_groups.end,
                )
                for t in plan.operator(s.operator_id).subtasks
                for r in t.reads
            ]
            s.state = self._load_stage(s, reads)
        return plan.to_dict()

    def _load_stage(self, s: StageRun, reads: list[tuple[Any, ...]]) -> DataFrame:
        """One stage's restored state: each new subtask's executor reads just its key groups of
        the old snapshot files; partitioned by subtask as the state always is."""
        empty = self._empty_state(s)
        if not reads:
            return empty
        tasks = self.spark.createDataFrame(
            reads, "part_key int, url string, checksum string, size long, start int, end int"
        ).repartition(len(reads))
        reader = partial(read_subtask_snapshots, self.storage, empty.schema.names)
        loaded = tasks.mapInArrow(reader, empty.schema)
        return loaded.repartition(self.parallelism, SUBTASK).localCheckpoint(eager=True)


@dataclass
class StageRun:
    """A keyed stage of a run: its operator id (its snapshots' name), key, input schema (fixed
    by the first read) and current state."""

    operator_id: str
    stage: Stage
    key: list[str]
    input_schema: T.StructType | None = None
    state: DataFrame | None = None


def chained_stages(stages: Sequence[Stage], key: Sequence[str]) -> list[StageRun]:
    """The runs of a chain of stages: the first keyed by the pipeline's ``key``, the others by
    their own; operator ids from each stage's ``uid``, else ``aggregate`` for the first (the
    id a single-stage job has always had) and ``stage-<i>`` after it. Ids must be distinct:
    they name the state a restore maps back to each stage."""
    runs: list[StageRun] = []
    for i, stage in enumerate(stages):
        if i == 0:
            stage = stage.with_key(key)
        stage_key = list(getattr(stage, "key", None) or [])
        if not stage_key:
            raise SpecError(f"stage {i + 1} ({stage!r}) has no key: give it key=[...]")
        uid = getattr(stage, "uid", None) or (AGGREGATE if i == 0 else f"stage-{i + 1}")
        validate_id(uid, f"stage {i + 1} uid")
        if uid in (SOURCE, SINK) or any(r.operator_id == uid for r in runs):
            raise SpecError(f"stage {i + 1}: operator id {uid!r} is taken; give it another uid")
        runs.append(StageRun(uid, stage, stage_key))
    return runs


class InputError(CheckpointingError):
    """An epoch's input could not be read or processed (names the epoch, files and reason);
    nothing of that epoch was staged or checkpointed."""


def _spark_reason(exc: BaseException) -> str:
    """The useful lines of a Spark/Py4J error: its message and each cause's, not the JVM stack
    (e.g. failed reading FILE; caused by: malformed record [..]; caused by: For input string)."""
    lines = [ln.strip().removeprefix(": ") for ln in str(exc).splitlines() if ln.strip()]
    main = next(
        (ln for ln in lines if ln.startswith("org.apache.spark.") or ln.startswith("[")),
        lines[0] if lines else type(exc).__name__,
    )
    causes = [ln.removeprefix("Caused by: ") for ln in lines if ln.startswith("Caused by: ")]
    return "; caused by: ".join(part[:1000] for part in dict.fromkeys([main, *causes]))


def _parquet_rows(splits: Sequence[InputSplit]) -> int | None:
    """Rows of an epoch from the Parquet footers (no data read), for the rows/s progress."""
    import pyarrow.parquet as pq

    try:
        return sum(
            s.rows if s.rows is not None else pq.ParquetFile(s.path).metadata.num_rows
            for s in splits
        )
    except (OSError, pa.ArrowException):
        return None


def through_epoch(metadata: CheckpointMetadata, num_epochs: int) -> int:
    """The last epoch a checkpoint covers: one before the first split still to read."""
    for op in metadata.operators:
        if op.operator_id == SOURCE:
            remaining = [int(item["epoch"]) for s in op.subtasks for item in (s.list_state or [])]
            return (min(remaining) if remaining else num_epochs) - 1
    raise ValueError("checkpoint has no source state")


def _list_acks(
    plan: Sequence[TaskSpec], operator: str, items: list[dict[str, Any]]
) -> list[TaskAck]:
    tasks = [t for t in plan if t.operator_id == operator]
    dealt: list[list[dict[str, Any]]] = [[] for _ in tasks]
    for i, item in enumerate(items):
        dealt[i % len(tasks)].append(item)
    return [
        TaskAck(t.attempt_id, state_meta={"list_state": d})
        for t, d in zip(tasks, dealt, strict=True)
    ]
