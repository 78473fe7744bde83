"""The last aggregation's keyed state *is* the checkpoints' files: key-group-sorted Parquet runs
written once by Spark's own writer (issue 37).

When only the final table is published (``sink.changelog: false``, the default), nobody reads the
aggregation's state between epochs. So each epoch computes its partial aggregates with Spark's
aggregate (map-side combine, one shuffle by key), adds the key-group column, sorts each
partition by it and writes them with ``DataFrameWriter.parquet`` into this attempt's staging
directory — one Spark job per epoch, no row through Python, nothing cached between epochs. Up
to :data:`MAX_IN_FLIGHT` epochs are written at once (an epoch's write overlaps the next one's
read).

A checkpoint after epoch ``e`` hard-links (copies, across file systems) the files of the epochs
since the last completed checkpoint into its ``shared/chk-<id>/`` and acknowledges every subtask
with the operator's whole chain of runs (Flink's file merging, FLIP-306: one physical file holds
several subtasks' key groups; each subtask reads only its ``key_groups`` from it, a pushed-down
filter on the sorted key-group column). The shared state registry then keeps each file while a
retained checkpoint uses it. A staged epoch stays in staging until a checkpoint covering it
completes, so an aborted checkpoint (whose ``shared/chk-<id>/`` the cleaner deletes) loses
nothing.

The final table is one merge of every run (what the plain job's ``groupBy`` does anyway). A
restore takes the checkpoint's runs over as they are — whatever the new parallelism: the rows
carry their key group, so rescaling reads nothing. When the runs of the state pass
:func:`max_runs` they are merged (a tiered compaction, on the snapshot thread, off the epochs'
critical path). A savepoint is self-contained: its snapshot merges every run into one file per
subtask, each holding exactly that subtask's key groups, in the savepoint's own directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from checkpointing.coordination.pending import TaskAck, TaskSpec
from checkpointing.coordination.shared_state import within
from checkpointing.errors import CheckpointingError
from checkpointing.ids import validate_id
from checkpointing.pipeline.spec import PipelineSpec
from checkpointing.spark.keys import KEY_GROUP, SUBTASK, key_group_column, subtask_column
from checkpointing.spark.stages import AggregationStage
from checkpointing.spark.state import StageRun
from checkpointing.state.incremental import CHAIN_AGGREGATE
from checkpointing.state.keygroups import key_group_range
from checkpointing.state.metadata import MAX_CHAIN, PARQUET, ChainedFile
from checkpointing.state.s3_storage import S3CheckpointStorage
from checkpointing.state.storage import CheckpointStorage, FileSystemCheckpointStorage

log = logging.getLogger(__name__)

#: epochs whose Spark write may run at once: the next epoch's read overlaps the last's write
MAX_IN_FLIGHT = 2
#: references to run files one checkpoint's ``_metadata`` may hold (every subtask lists every
#: run): bounds its size at high parallelism
MAX_REFERENCES = 4096
_CHUNK = 1 << 20


def max_runs(parallelism: int) -> int:
    """Run files the state may span before they are merged: within an ack's chain bound, and
    fewer at high parallelism (every subtask references every run)."""
    return max(2, min(MAX_CHAIN - 16, MAX_REFERENCES // parallelism))


def supports(storage: CheckpointStorage, spark: SparkSession) -> bool:
    """Spark writes the runs itself on local checkpoint storage; for ``s3://`` (no Hadoop S3
    connector needed) it writes them on this host and the driver uploads them, which needs a
    local master (every executor writes where the driver reads). Elsewhere (``s3://`` with a
    cluster) the stage keeps the Arrow snapshots its executors upload themselves."""
    if isinstance(storage, FileSystemCheckpointStorage):
        return True
    master = spark.sparkContext.master
    return isinstance(storage, S3CheckpointStorage) and master.startswith("local")


def attach(
    s: StageRun,
    spec: PipelineSpec,
    spark: SparkSession,
    storage: CheckpointStorage,
    attempt: str,
    parallelism: int,
) -> None:
    """Keep the lazily merged stage ``s``'s state as runs when they can be written (and its
    checkpoints are incremental: ``incremental: false`` asks for self-contained ones)."""
    if spec.checkpoint.incremental and supports(storage, spark):
        s.chains = None  # no chains of Arrow snapshots: the runs are its chain
        s.runs = KeyedRuns(spark, storage, spec.job, attempt, s, parallelism, spec.max_parallelism)


@dataclass
class _Epoch:
    epoch: int
    future: Future[None]
    describe: str
    directory: Path


@dataclass
class RunsSnapshot:
    """What a completed checkpoint of the runs leaves: the files the state spans after it."""

    epoch: int
    files: list[ChainedFile]
    #: a savepoint's own files (merged into its directory), not the state's chain
    savepoint: bool = False


@dataclass
class KeyedRuns:
    """One aggregation stage's state as runs: the files committed by completed checkpoints (in
    ``shared/``), and the epochs staged since."""

    spark: SparkSession
    storage: CheckpointStorage
    job: str
    attempt: str
    stage_run: StageRun
    parallelism: int
    max_parallelism: int
    #: runs in shared storage, registered by the last completed checkpoint (or restored)
    committed: list[ChainedFile] = field(default_factory=list)
    #: the last epoch those cover (-1: none)
    committed_epoch: int = -1
    #: epochs written (or being written) into staging since, oldest first
    staged: list[_Epoch] = field(default_factory=list)
    #: object storage: where this host keeps a copy of each committed run (url -> path), for
    #: the merges Spark reads locally
    copies: dict[str, Path] = field(default_factory=dict)
    _pool: ThreadPoolExecutor | None = None
    _local_root: Path | None = None

    @property
    def stage(self) -> AggregationStage:
        stage = self.stage_run.stage
        assert isinstance(stage, AggregationStage)
        return stage

    @property
    def local(self) -> bool:
        """Runs written straight into the checkpoint storage's file system."""
        return isinstance(self.storage, FileSystemCheckpointStorage)

    @property
    def staging(self) -> Path:
        """This attempt's staging directory, derived from ids (never from a row): beside the
        job's checkpoints on local storage (so a checkpoint hard-links its runs), a temporary
        directory of this host for object storage."""
        attempt = validate_id(self.attempt, "attempt id")
        if isinstance(self.storage, FileSystemCheckpointStorage):
            return self.storage.path_of(self.storage.job_url(self.job)) / "staging" / attempt
        if self._local_root is None:
            self._local_root = Path(tempfile.mkdtemp(prefix=f"ckpt-runs-{self.job}-"))
        return self._local_root / attempt

    # ------------------------------------------------------------------ epochs

    def add_epoch(self, epoch: int, rows: DataFrame, describe: str) -> None:
        """Write ``rows``' partial aggregates as the epoch's runs, in the background; waits
        while :data:`MAX_IN_FLIGHT` epochs are being written (their errors raise here)."""
        self._wait_in_flight(MAX_IN_FLIGHT - 1)
        key = list(self.stage_run.key)
        partials = (
            rows.withColumn(KEY_GROUP, key_group_column(key, self.max_parallelism))
            .groupBy(KEY_GROUP, *key)
            .agg(*self.stage.plan.partials(rows.schema))
        )
        columns = [*key, KEY_GROUP, *self.stage.plan.partial_columns]
        runs = partials.select(*columns).sortWithinPartitions(KEY_GROUP)
        directory = self.staging / f"e{epoch}"
        writer = runs.write.mode("overwrite")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(MAX_IN_FLIGHT, thread_name_prefix="ckpt-epoch")
        future = self._pool.submit(writer.parquet, directory.as_uri())
        self.staged.append(_Epoch(epoch, future, describe, directory))

    def _wait_in_flight(self, at_most: int) -> None:
        running = [e for e in self.staged if not e.future.done()]
        for e in running[: max(0, len(running) - at_most)]:
            self._result(e)
        for e in self.staged:  # a failed write raises now, not only at the next barrier
            if e.future.done():
                self._result(e)

    def _result(self, e: _Epoch) -> None:
        try:
            e.future.result()
        except Exception as exc:
            raise EpochWriteError(e.epoch, self.stage_run.operator_id, e.describe, exc) from exc

    def failed_epochs(self, first: int) -> list[int]:
        """The epochs whose writes failed (``first`` among them), for the message of a JVM
        that died under them: a write still running then dies with it (its call may not have
        returned yet, so it is waited for a little, and named either way)."""
        wait([e.future for e in self.staged], timeout=10)
        failed = {e.epoch for e in self.staged if not e.future.done() or e.future.exception()}
        return sorted(failed | {first})

    def drain(self) -> None:
        """Wait for every epoch in flight (an error raises)."""
        for e in self.staged:
            self._result(e)

    # ------------------------------------------------------------------ snapshots

    def snapshot(
        self,
        checkpoint_id: int,
        epoch: int,
        plan: Sequence[TaskSpec],
        *,
        shared_url: str,
        full_url: str | None = None,
    ) -> tuple[list[TaskAck], RunsSnapshot]:
        """The stage's acks for a checkpoint after ``epoch`` (run on the snapshot thread): the
        runs since the last completed checkpoint linked into ``shared_url`` (its
        ``shared/chk-<id>/``), every subtask acknowledging the whole chain; past
        :func:`max_runs`, every run merged there instead; or, with ``full_url`` (a savepoint),
        every run merged into one file per subtask there."""
        started = time.monotonic()
        new = [e for e in self.staged if e.epoch <= epoch]
        for e in new:
            self._result(e)
        staged = [p for e in new for p in _parts(e.directory)]
        op = self.stage_run.operator_id
        if full_url is not None:
            paths = [*self._committed_paths(), *staged]
            files = self._write_merged(paths, f"{full_url}/{op}", by_subtask=True)
        elif len(self.committed) + len(staged) > max_runs(self.parallelism):
            paths = [*self._committed_paths(), *staged]
            files = self._write_merged(paths, f"{shared_url}/{op}-merged", by_subtask=False)
            log.info(
                "job %s: checkpoint %d: %d run files merged into %d",
                self.job,
                checkpoint_id,
                len(paths),
                len(files),
            )
        else:
            files = self.committed + self._link(new, f"{shared_url}/{op}")
        ms = int((time.monotonic() - started) * 1000)
        savepoint = full_url is not None
        acks = self._acks(plan, files, exact=savepoint, async_ms=ms)
        return acks, RunsSnapshot(epoch, files, savepoint)

    def completed(self, snapshot: RunsSnapshot) -> None:
        """A checkpoint of these runs completed: its files are the committed state, the staged
        epochs it covers are no longer needed (their links are in ``shared/``). A savepoint's
        files are its own: the state's chain stands."""
        if snapshot.savepoint:
            return
        self.committed, self.committed_epoch = snapshot.files, snapshot.epoch
        done = [e for e in self.staged if e.epoch <= snapshot.epoch]
        self.staged = [e for e in self.staged if e.epoch > snapshot.epoch]
        kept = {str(p) for f in self.committed if (p := self.copies.get(f.handle))}
        self.copies = {
            f.handle: self.copies[f.handle] for f in self.committed if f.handle in self.copies
        }
        for e in done:  # on object storage its committed runs' copies stay
            if not any(k.startswith(f"{e.directory}/") for k in kept):
                shutil.rmtree(e.directory, ignore_errors=True)

    def _committed_paths(self) -> list[Path]:
        if self.local:
            return [self.storage.path_of(f.handle) for f in self.committed]
        return [self.copies[f.handle] for f in self.committed]

    def _link(self, epochs: Sequence[_Epoch], target: str) -> list[ChainedFile]:
        """The epochs' part files placed under ``target``; their entries."""
        return [
            self._place(part, f"{target}/e{e.epoch}-{part.name}")
            for e in epochs
            for part in _parts(e.directory)
        ]

    def _place(self, part: Path, url: str) -> ChainedFile:
        """A run written on this host put at ``url``: hard-linked (copied across file systems)
        on local storage, uploaded to object storage (the local file kept as its copy)."""
        if isinstance(self.storage, FileSystemCheckpointStorage):
            dest = self.storage.path_of(url)
            dest.parent.mkdir(parents=True, exist_ok=True)
            _link_or_copy(part, dest)
            return _entry(dest)
        info = self.storage.write_bytes(url, part.read_bytes())
        self.copies[url] = part
        return ChainedFile(handle=info.url, size=info.size, checksum=info.checksum)

    def _write_merged(
        self, paths: Sequence[Path], url: str, *, by_subtask: bool
    ) -> list[ChainedFile]:
        """``paths``' runs merged (one row per key) and written into ``directory``, sorted by
        key group; ``by_subtask``: one file per subtask holding exactly its key groups (Spark
        partition ``i`` is subtask ``i``), else hashed by key as an epoch's runs are."""
        if not paths:
            return []
        key = list(self.stage_run.key)
        runs = self.spark.read.parquet(*(p.as_uri() for p in paths))
        merged = self.stage.plan.merge(runs, runs.where(F.lit(False)), [KEY_GROUP, *key])
        if by_subtask:
            subtask = subtask_column(self.parallelism, self.max_parallelism)
            merged = merged.withColumn(SUBTASK, subtask).repartition(self.parallelism, SUBTASK)
        columns = [*key, KEY_GROUP, *self.stage.plan.partial_columns]
        merged = merged.sortWithinPartitions(KEY_GROUP).select(*columns)
        directory = self.staging / f"merged-{uuid.uuid4().hex[:8]}"
        merged.write.parquet(directory.as_uri())
        return [self._place(p, f"{url}/{p.name}") for p in _parts(directory)]

    def _acks(
        self, plan: Sequence[TaskSpec], files: list[ChainedFile], *, exact: bool, async_ms: int
    ) -> list[TaskAck]:
        """Every subtask's ack: its key groups, read from every run (``exact``: its own file,
        the ``i``-th of one per subtask)."""
        acks = []
        op = self.stage_run.operator_id
        for task in (t for t in plan if t.operator_id == op):
            i = task.subtask_index
            r = key_group_range(self.max_parallelism, self.parallelism, i)
            meta: dict[str, object] = {"key_groups": [r.start, r.end], "file_format": PARQUET}
            mine = [f for f in files if _partition_of(f) == i] if exact else files
            if not mine:
                acks.append(TaskAck(task.attempt_id, state_meta=meta))
                continue
            if len(mine) > 1:
                meta["chain"] = [f.model_dump() for f in mine[:-1]]
                meta["chain_merge"] = CHAIN_AGGREGATE
            last = mine[-1]
            acks.append(
                TaskAck(task.attempt_id, last.handle, last.size, last.checksum, 0, async_ms, meta)
            )
        return acks

    # ------------------------------------------------------------------ restore and the end

    def restore(self, files: Sequence[ChainedFile]) -> None:
        """Continue from a checkpoint's runs (any parallelism: the rows carry their key group).
        The job's own shared runs are referenced again; a savepoint's or another job's are
        never claimed (Flink's no-claim restore): they are copied into this attempt's staging
        as its first run, which its first checkpoint places in its own ``shared/chk-<id>/``. On
        object storage each run is copied to this host (verified as it is read)."""
        files = list(dict.fromkeys(files))
        shared = self.storage.shared_url(self.job)
        self.committed = [f for f in files if within(f.handle, shared)]
        foreign = [f for f in files if not within(f.handle, shared)]
        if not self.local:
            directory = self.staging / "restored-runs"
            directory.mkdir(parents=True, exist_ok=True)
            for n, f in enumerate(self.committed):
                self.copies[f.handle] = self._copy_here(f, directory / f"part-{n:05d}.parquet")
        if foreign:
            directory = self.staging / "restored"
            directory.mkdir(parents=True, exist_ok=True)
            for n, f in enumerate(foreign):
                self._copy_here(f, directory / f"part-{n:05d}-restored.parquet")
            self._stage_done(-1, "the restored state", directory)

    def _copy_here(self, f: ChainedFile, path: Path) -> Path:
        """A run of the storage at ``path`` on this host: hard-linked on local storage (runs are
        never written again), downloaded and verified from object storage."""
        if isinstance(self.storage, FileSystemCheckpointStorage):
            _link_or_copy(self.storage.path_of(f.handle), path)
        else:
            path.write_bytes(self.storage.read_bytes(f.handle, size=f.size, checksum=f.checksum))
        return path

    def _stage_done(self, epoch: int, describe: str, directory: Path) -> None:
        done: Future[None] = Future()
        done.set_result(None)
        self.staged.insert(0, _Epoch(epoch, done, describe, directory))

    def add_base(self, state: DataFrame) -> None:
        """Continue from a state restored in another format (Arrow snapshots): written once as
        this attempt's first run, linked into the next checkpoint like an epoch's."""
        key = list(self.stage_run.key)
        columns = [*key, KEY_GROUP, *self.stage.plan.partial_columns]
        directory = self.staging / "restored"
        state.select(*columns).sortWithinPartitions(KEY_GROUP).write.mode("overwrite").parquet(
            directory.as_uri()
        )
        self._stage_done(-1, "the restored state", directory)

    def final_state(self, empty: DataFrame) -> DataFrame:
        """The state merged, one row per key (no subtask column): the final table's input."""
        self.drain()
        paths = self._committed_paths()
        paths += [p for e in self.staged for p in _parts(e.directory)]
        key = list(self.stage_run.key)
        if not paths:
            runs = empty.drop(SUBTASK)
        else:
            runs = self.spark.read.parquet(*(p.as_uri() for p in paths))
        return self.stage.plan.merge(runs, runs.where(F.lit(False)), key)

    def state_bytes(self) -> int:
        return sum(f.size for f in self.committed)

    def close(self, *, keep_staging: bool = False) -> None:
        """Let the writes in flight end (no file appears after the attempt), then drop this
        attempt's staging."""
        for e in self.staged:
            try:
                e.future.result()
            except Exception as exc:  # the attempt's own failure is what counts
                log.info("epoch %d: abandoned write failed: %s", e.epoch, exc)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if not keep_staging:
            shutil.rmtree(self.staging, ignore_errors=True)
            if self._local_root is not None:
                shutil.rmtree(self._local_root, ignore_errors=True)

    def clear_stale_staging(self) -> None:
        """Other attempts' staging of this job (an attempt that died): never acknowledged
        except through links, so nothing a checkpoint uses."""
        if not self.local:
            return  # a temporary directory of this attempt's own
        root = self.staging.parent
        if not root.is_dir():
            return
        for entry in root.iterdir():
            if entry.name != self.attempt and entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)


class EpochWriteError(CheckpointingError):
    """An epoch's Spark job failed (reading its input, its transform, or writing its runs)."""

    def __init__(self, epoch: int, operator_id: str, describe: str, cause: BaseException) -> None:
        super().__init__(f"epoch {epoch} failed reading {describe}: {cause}")
        self.epoch = epoch
        self.operator_id = operator_id
        self.describe = describe


def _parts(directory: Path) -> list[Path]:
    """The part files Spark committed into ``directory`` (not its ``.crc`` side files nor its
    ``_SUCCESS`` marker), in name order (``part-<partition>-…``)."""
    if not directory.is_dir():
        return []
    return sorted(
        p for p in directory.iterdir() if p.name.startswith("part-") and p.suffix == ".parquet"
    )


def _partition_of(f: ChainedFile) -> int:
    """The Spark partition a part file was written by (``…/part-00003-….parquet`` -> 3)."""
    name = f.handle.rsplit("/", 1)[-1]
    return int(name.split("-")[1])


def _link_or_copy(source: Path, dest: Path) -> None:
    try:
        os.link(source, dest)
    except FileExistsError:
        dest.unlink()
        os.link(source, dest)
    except OSError:  # another file system, or links not allowed
        shutil.copyfile(source, dest)


def _entry(path: Path) -> ChainedFile:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return ChainedFile(
        handle=path.as_uri(), size=path.stat().st_size, checksum="sha256:" + digest.hexdigest()
    )
