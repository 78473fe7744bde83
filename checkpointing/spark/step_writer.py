"""One step's checkpoint on the Spark side: what a step's plan is (its identity), writing each of
its Spark tasks' partitions with Spark's own Parquet writer into the checkpoint's directory,
acknowledging each committed file (size, SHA-256) as a subtask, and reading a step back.

The write uses the ``FileOutputCommitter``'s algorithm 2: a task's commit renames its file into
the step's directory, so a watcher thread on the driver acknowledges files while later tasks
still run, and a crash leaves the committed tasks' files acknowledged in the PENDING checkpoint
(:mod:`checkpointing.spark.steps` salvages them). The checkpoint's task plan must be fixed
before it is triggered: a step's plan is prepared first (:func:`planned`), which under the
session's adaptive execution runs its shuffles' map stages and lets Spark coalesce the last
stage's partitions, as the job without checkpoints would; the write then runs exactly those
tasks. No row passes through Python.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import StructType

from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.failure import CoordinatorSuperseded
from checkpointing.coordination.pending import AckResult, TaskAck, TaskSpec
from checkpointing.errors import CheckpointingError
from checkpointing.spark.session import session_settings
from checkpointing.state.storage import CheckpointStorage, FileSystemCheckpointStorage
from checkpointing.steps.identity import (
    InputFile,
    nondeterminism,
    operator_id,
    without_ids,
    without_seeds,
)
from checkpointing.steps.plan import StepFile, StepRecord, carried

log = logging.getLogger(__name__)

#: a task's file as Spark names it: ``part-<partition>-<job uuid>[-c<n>].<codec>.parquet``
_PART = re.compile(r"^part-(\d{5,})-[0-9a-f-]+(?:-c\d+)?(?:\.[a-z0-9]+)*\.parquet$")
#: what the local file system's writer leaves beside the data (deleted after completion)
_LEFTOVER = re.compile(r"^(\..+\.crc|_SUCCESS)$")
#: a shuffle node in a physical plan's text (a broadcast's exchange, or a reuse of one, is not)
_SHUFFLE = re.compile(r"^[\s:+\-*]*(?:Exchange\b|ReusedExchange\b(?!.*BroadcastExchange))", re.M)
#: logical nodes that shuffle whenever their input has more than one partition (a plan over one
#: partition shows no exchange for them): an aggregate, a window, a global sort, a repartition,
#: a set operation, a limit
_WIDE = re.compile(
    r"^[\s:+\-]*(?:Aggregate|Window|Repartition\w*|Intersect|Except|Deduplicate\w*|"
    r"GlobalLimit|Tail|Sort \[.*\], true)\b",
    re.M,
)
#: while a step's plan is described (planning only, nothing runs): the physical plan shows
#: every shuffle as the static planner places it
STEP_SQL = {"spark.sql.adaptive.enabled": "false"}
#: Spark's default codec, named: the files this project links into a step's directory itself are
#: named as the writer names its own. (Zstandard makes them a third smaller but costs about 7 %
#: more CPU to write, measured on the step benchmark's join.)
CODEC = "snappy"
WRITE_OPTIONS = {
    "compression": CODEC,
    "mapreduce.fileoutputcommitter.algorithm.version": "2",
    "mapreduce.fileoutputcommitter.marksuccessfuljobs": "false",
    "maxRecordsPerFile": "0",
}
#: for the files only this project's Spark reads back (every step but the published one):
#: Parquet's version 2 pages and encodings, written about 6 % faster on the step benchmark (a
#: published table keeps Spark's defaults, which any reader of the table reads)
INTERNAL_OPTIONS = {"parquet.writer.version": "v2"}


class StepCheckpointError(CheckpointingError):
    """A step's checkpoint did not complete."""


@dataclass(frozen=True)
class PlanFacts:
    """What a step's DataFrame is, as its identity needs it."""

    plan: str
    named_plan: str
    schema: str
    inputs: tuple[InputFile, ...]
    #: files of checkpointed steps it reads (their step decides their identity)
    step_files: tuple[str, ...]
    nondeterministic: str | None
    #: a single file scan and no exchange: each output partition is one input partition
    narrow: bool
    #: its plan shuffles: an exchange other than a broadcast's in its physical plan, or a node
    #: that shuffles at any partition count but one in its optimized plan
    shuffles: bool = True


def describe(spark: SparkSession, df: DataFrame, storage: CheckpointStorage, job: str) -> PlanFacts:
    """The plan facts of ``df`` (planning only: nothing runs)."""
    with session_settings(spark, STEP_SQL):
        qe = df._jdf.queryExecution()
        analyzed = qe.analyzed()
        optimized = qe.optimizedPlan().toString()
        # planning only: a shuffle some logical nodes hide (applyInPandas, a rebalance hint)
        # shows here as an Exchange
        physical = qe.executedPlan().toString()
    shared = storage.shared_url(job)
    inputs, step_files = [], []
    for path in df.inputFiles():
        url = as_url(path)
        if storage.contains(url, shared):
            step_files.append(url)
        else:
            inputs.append(_input_file(spark, path))
    return PlanFacts(
        plan=without_seeds(analyzed.canonicalized().toString()),
        named_plan=without_ids(analyzed.toString()),
        schema=df.schema.json(),
        inputs=tuple(inputs),
        step_files=tuple(step_files),
        nondeterministic=nondeterminism(
            bool(analyzed.deterministic()), analyzed.toString(), optimized
        ),
        narrow=optimized.count("Relation [") == 1
        and not _has_exchange(optimized)
        and "Exchange" not in physical,
        shuffles=_SHUFFLE.search(physical) is not None or _WIDE.search(optimized) is not None,
    )


def _has_exchange(optimized: str) -> bool:
    """Whether the optimized plan needs a shuffle (an aggregate, join, window, sort,
    repartition, distinct or set operation)."""
    wide = (
        "Aggregate",
        "Join",
        "Window",
        "Sort ",
        "Repartition",
        "Distinct",
        "Union",
        "Intersect",
        "Except",
        "Expand",
        "Generate",
        "GlobalLimit",
        "Tail",
    )
    return any(line.lstrip(" +-:").startswith(wide) for line in optimized.splitlines())


def as_url(path: str) -> str:
    return path if "://" in path else Path(path).as_uri()


def _input_file(spark: SparkSession, path: str) -> InputFile:
    """A file's version as Hadoop's file system lists it (any scheme Spark reads)."""
    jvm = spark.sparkContext._jvm
    hpath = jvm.org.apache.hadoop.fs.Path(path)
    status = hpath.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()).getFileStatus(hpath)
    return InputFile(path, int(status.getLen()), int(status.getModificationTime()))


def read_step(spark: SparkSession, record: StepRecord) -> DataFrame:
    """A completed step's rows, read back from its files with the schema it was written with:
    any parallelism reads them (rescale is free)."""
    schema = StructType.fromJson(json.loads(record.schema))
    urls = record.urls
    if not urls:
        return spark.createDataFrame(spark.sparkContext.emptyRDD(), schema)
    return spark.read.schema(schema).parquet(*urls)


def file_checksum(storage: CheckpointStorage, url: str) -> tuple[int, str]:
    """A file's size and ``sha256:<hex>``, streamed on a local file system."""
    if isinstance(storage, FileSystemCheckpointStorage):
        with open(storage.path_of(url), "rb") as f:
            digest = hashlib.file_digest(f, "sha256")
            return f.tell(), f"sha256:{digest.hexdigest()}"
    data = storage.read_bytes(url)
    return len(data), f"sha256:{hashlib.sha256(data).hexdigest()}"


@dataclass
class StepTasks:
    """The subtasks of one step checkpoint: those it carries, and its own step's."""

    specs: list[TaskSpec]
    carried_acks: list[TaskAck]
    #: own partition -> attempt id
    own: dict[int, str]


def step_tasks(
    run: str, checkpoint_seq: int, records: Sequence[StepRecord], own: StepRecord
) -> StepTasks:
    """Every earlier step's subtasks carried with their files, then ``own``'s ``parallelism``
    subtasks (each acked when its Spark task's file is committed)."""
    specs: list[TaskSpec] = []
    acks: list[TaskAck] = []
    n = 0
    for record, f in carried(records):
        attempt = f"{run}-c{checkpoint_seq}-t{n}"
        n += 1
        specs.append(_spec(record, f.partition, attempt))
        acks.append(
            TaskAck(
                attempt,
                f.handle,
                f.size,
                f.checksum,
                state_meta={"list_state": [record.item(f.partition)]},
            )
        )
    mine = {}
    for p in range(own.parallelism):
        attempt = f"{run}-c{checkpoint_seq}-t{n}"
        n += 1
        specs.append(_spec(own, p, attempt))
        mine[p] = attempt
    return StepTasks(specs, acks, mine)


def trigger_step(
    coordinator: CheckpointCoordinator,
    run: str,
    seq: int,
    carried: Sequence[StepRecord],
    record: StepRecord,
) -> tuple[int, StepTasks]:
    """Trigger ``record``'s checkpoint and acknowledge what it carries; its id and tasks (its
    own still to acknowledge)."""
    tasks = step_tasks(run, seq, carried, record)
    pending = coordinator.trigger_checkpoint(tasks=tasks.specs, forced=True)
    if tasks.carried_acks:
        outcome = coordinator.receive_acknowledge(pending.checkpoint_id, tasks.carried_acks)
        if outcome.refused:
            raise StepCheckpointError(
                f"step {record.name}: the earlier steps' files were refused: "
                f"{next(iter(outcome.refused.values()))}"
            )
    return pending.checkpoint_id, tasks


def _spec(record: StepRecord, partition: int, attempt: str) -> TaskSpec:
    return TaskSpec(
        operator_id(record.name),
        partition,
        attempt,
        record.parallelism,
        max(128, record.parallelism),
    )


class StepAcknowledger:
    """Acknowledges a step's own subtasks, each once: a committed file as soon as it is seen
    (the watcher thread while Spark writes), the tasks that wrote nothing at the end.

    Once its checkpoint cannot complete (an ack refused, the checkpoint aborted by a later
    try's takeover, this coordinator superseded), the watcher stops, keeps the reason
    (:attr:`error`, raised by :meth:`finish`) and calls ``on_failed``: the step's Spark write
    is cancelled instead of running to its end for nothing."""

    def __init__(
        self,
        coordinator: CheckpointCoordinator,
        checkpoint_id: int,
        record: StepRecord,
        attempts: dict[int, str],
        directory: str,
        on_failed: Callable[[], None] | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.storage = coordinator.storage
        self.checkpoint_id = checkpoint_id
        self.record = record
        self.attempts = attempts
        self.directory = directory
        self.files: dict[int, StepFile] = {}
        self.completed: Any = None
        #: why the checkpoint cannot complete (set by the watcher, raised by finish)
        self.error: BaseException | None = None
        self.on_failed = on_failed
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def ack_many(self, files: Sequence[StepFile]) -> None:
        """Acknowledge ``files`` (each a subtask's) in one metastore transaction: a step of
        hundreds of tasks is not hundreds of round trips."""
        with self._lock:
            fresh = {
                f.partition: f
                for f in files
                if f.partition not in self.files and f.partition in self.attempts
            }
            if not fresh:
                return
            acks = [
                TaskAck(
                    self.attempts[p],
                    f.handle,
                    f.size,
                    f.checksum,
                    state_meta={"list_state": [self.record.item(p)]},
                )
                for p, f in sorted(fresh.items())
            ]
            outcome = self.coordinator.receive_acknowledge(self.checkpoint_id, acks)
            if outcome.refused:
                attempt, why = next(iter(outcome.refused.items()))
                raise StepCheckpointError(
                    f"step {self.record.name}: ack of subtask {attempt} refused: {why}"
                )
            if AckResult.DISCARDED in outcome.results.values():
                raise StepCheckpointError(
                    f"step {self.record.name}: checkpoint {self.checkpoint_id} was aborted "
                    "(a later try took the job over, or it expired)"
                )
            self.files.update(fresh)
            if outcome.completed is not None:
                self.completed = outcome.completed

    def scan(self) -> None:
        """Acknowledge every committed file not acknowledged yet."""
        found = []
        for name in self._listing():
            match = _PART.match(name)
            if match is None:
                continue
            partition = int(match.group(1))
            if partition in self.files:
                continue
            url = f"{self.directory}/{name}"
            size, checksum = file_checksum(self.storage, url)
            found.append(StepFile(partition, url, size, checksum))
        self.ack_many(found)

    def _listing(self) -> list[str]:
        storage = self.storage
        if isinstance(storage, FileSystemCheckpointStorage):
            try:
                return sorted(os.listdir(storage.path_of(self.directory)))
            except FileNotFoundError:
                return []
        return sorted(u.rsplit("/", 1)[-1] for u in storage.list_files(self.directory))

    def start(self, poll: float = 0.1) -> None:
        def watch() -> None:
            while not self._stop.wait(poll):
                try:
                    self.scan()
                except (StepCheckpointError, CoordinatorSuperseded) as exc:
                    self.error = exc
                    log.warning("%s: cancelling the step's write", exc)
                    if self.on_failed is not None:
                        self.on_failed()
                    return
                except Exception:
                    log.exception("step %s: acknowledging committed files", self.record.name)

        self._thread = threading.Thread(target=watch, name=f"ack-{self.record.name}", daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """After the write: the last files, then the tasks that wrote none."""
        self.stop()
        if self.error is not None:
            raise self.error
        self.scan()
        missing = sorted(set(self.attempts) - set(self.files))
        self.ack_many([StepFile(p, None, 0, None) for p in missing])

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def part_name(partition: int) -> str:
    """A file name for ``partition`` as Spark's writer names a task's file (:data:`_PART`): for
    files this project links or moves into a step's directory itself."""
    return f"part-{partition:05d}-{uuid.uuid4()}-c000.{CODEC}.parquet"


def write_partitions(
    spark: SparkSession,
    df: DataFrame,
    directory: str,
    on_started: Callable[[], None] | None = None,
    *,
    published: bool = False,
) -> None:
    """Write ``df`` with Spark's Parquet writer into ``directory``, one file per task
    (``published``: the files become a table others read, in Spark's default format)."""
    writer = df.write.mode("append")
    options = WRITE_OPTIONS if published else {**WRITE_OPTIONS, **INTERNAL_OPTIONS}
    for key, value in options.items():
        writer = writer.option(key, value)
    if on_started is not None:
        on_started()
    writer.parquet(directory)


def planned(spark: SparkSession, df: DataFrame) -> tuple[DataFrame, int]:
    """``df`` over the RDD its plan prepares, and that RDD's task count: the write runs the
    plan counted here. Asking a plan its task count prepares it (a broadcast side is built);
    ``df.write`` would plan ``df`` again and build every broadcast a second time (the step's
    whole input read twice, and both relations held in the driver's memory). As
    ``Dataset.checkpoint`` does, the prepared RDD becomes a ``LogicalRDD`` with ``df``'s
    output (the write needs no partitioning or ordering of it). Under adaptive execution,
    preparing the plan runs its shuffles' map stages and fixes the last stage's (coalesced)
    partitions: the task count is the one the write runs (one at least), known before the
    step's checkpoint is triggered."""
    jdf = df._jdf
    rdd = jdf.queryExecution().toRdd()
    jvm = spark.sparkContext._jvm
    logical_rdd = getattr(getattr(jvm.org.apache.spark.sql.execution, "LogicalRDD$"), "MODULE$")
    plan = logical_rdd.fromDataset(rdd, jdf, False)
    prepared = jvm.org.apache.spark.sql.classic.Dataset.ofRows(jdf.sparkSession(), plan)
    # a plan of no partition (adaptive execution replaces a stage that produced no rows by an
    # empty relation) is written by one task, its file the schema only: partition 0
    return DataFrame(prepared, spark), max(1, int(rdd.getNumPartitions()))


def remove_leftovers(storage: CheckpointStorage, directory: str) -> None:
    """The checksum files and markers Hadoop's local writer left beside the acknowledged files
    (nothing references them; the directory is the step's, derived from ids)."""
    if not isinstance(storage, FileSystemCheckpointStorage):
        return
    path = storage.path_of(directory)
    for entry in path.iterdir() if path.is_dir() else []:
        if _LEFTOVER.match(entry.name) and entry.is_file():
            entry.unlink(missing_ok=True)
