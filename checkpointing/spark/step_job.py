"""One run of a job whose steps are checkpoints: :class:`CheckpointedJob`, what
:func:`checkpointing.spark.steps.checkpointed` returns (see that module for the API)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from checkpointing.config import Settings
from checkpointing.coordination.fencing import CoordinatorFencing
from checkpointing.coordination.heartbeat import Heartbeat
from checkpointing.errors import ConfigError
from checkpointing.ids import validate_id
from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline.interval import check_job_name
from checkpointing.restore.lookup import find_latest_valid
from checkpointing.spark import step_chain, step_salvage, step_savepoints, step_writer
from checkpointing.spark.parquet_sink import TwoPhaseCommitSink
from checkpointing.state.storage import CheckpointStorage, FileSystemCheckpointStorage
from checkpointing.status import JobStatus
from checkpointing.steps.identity import StepIdentity, step_name
from checkpointing.steps.job_check import refuse_a_specs_job
from checkpointing.steps.plan import (
    StepRecord,
    change_line,
    decide,
    downstream_of,
    restored_steps,
    step_config,
)
from checkpointing.steps.script import (
    ENV_COORDINATOR,
    ENV_RESTORE,
    RESTORES,
    check_job,
    check_restore,
    refusal_cause,
)

#: the step API's log lines (which step runs, reused or computed) under its public module's name
log = logging.getLogger("checkpointing.spark.steps")


@dataclass
class StepStats:
    """What a run did, step by step (the test's and the log's counts)."""

    reused: list[str] = field(default_factory=list)
    computed: list[str] = field(default_factory=list)
    #: chained steps (checkpointed as their plan; their readers recompute them)
    chained: list[str] = field(default_factory=list)
    #: step -> partitions computed by this run (all of them, or only the missing ones)
    partitions_computed: dict[str, int] = field(default_factory=dict)
    #: step -> partitions kept from a checkpoint cut short
    partitions_salvaged: dict[str, int] = field(default_factory=dict)
    bytes_written: int = 0
    restored_from: int | None = None
    published: dict[str, str] = field(default_factory=dict)


def could_chain(
    name: str, facts: step_writer.PlanFacts, input: DataFrame | None, published: bool
) -> bool:
    """Whether a step written whole could have been chained instead (``chained=True`` would
    not refuse it), and is neither the published output nor a partial resume's narrow step."""
    return step_chain.refusal(name, facts) is None and input is None and not published


class CheckpointedJob:
    """One run of a job whose steps are checkpoints; use as a context manager
    (:func:`checkpointed`)."""

    def __init__(
        self,
        spark: SparkSession,
        job: str,
        *,
        metastore: Metastore | None = None,
        storage: CheckpointStorage | None = None,
        settings: Settings | None = None,
        restore: str | None = None,
        verify: bool = True,
    ) -> None:
        # none given: what `ckpt run script.py --restore` says, else the latest checkpoint
        restore = check_restore(restore or os.environ.get(ENV_RESTORE) or "latest")
        self.spark = spark
        # an interval's job instance id would be authorised as its pipeline's DAG (the API)
        self.job = check_job_name(step_name(job))
        check_job(self.job)  # deployed by the operator: the task's declared job
        settings = settings or Settings.resolve()
        self.storage = storage or CheckpointStorage.from_url(settings.storage_url)
        #: a savepoint given by path: read and verified before anything is written
        self._savepoint = (
            None
            if restore in RESTORES
            else step_savepoints.load_savepoint(self.storage, restore, self.job, deep=verify)
        )
        if metastore is None:
            if settings.embedded_metastore:  # created or migrated, then used: one engine
                metastore = Metastore(settings.metastore_url, check_schema=False)
                metastore.ensure_schema()
            else:
                metastore = Metastore(settings.metastore_url)
        self.metastore = metastore
        self.restore = restore
        self.verify = verify
        self.run_id = uuid.uuid4().hex[:8]
        self.stats = StepStats()
        self.coordinator: step_savepoints.StepCoordinator | None = None
        #: where a stop-with-savepoint ended the run (``restore=`` it to resume)
        self.stopped_with_savepoint: str | None = None
        self._stopped: step_savepoints.StoppedWithSavepoint | None = None
        self._heartbeat: Heartbeat | None = None
        self._publishing = False
        self.restored: dict[str, StepRecord] = {}
        self._done: dict[str, StepRecord] = {}
        #: steps this run computes: whatever reads them is computed too
        self._computed: set[str] = set()
        #: restored steps a change made stale (a changed step and what is downstream of it)
        self._stale: set[str] = set()
        self._by_file: dict[str, str] = {}
        self._salvage: step_salvage.Salvage | None = None
        self._seq = 0

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> CheckpointedJob:
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        stopped = isinstance(exc, step_savepoints.StoppedWithSavepoint)
        failed = exc_type is not None and not stopped
        # a refusal says so on the job row: a deferred try reads it there (not the exit code)
        cause = refusal_cause(exc) if failed else None
        self.close(JobStatus.FAILED if failed else JobStatus.FINISHED, cause=cause)
        return stopped  # a stop-with-savepoint ends the `with` block, not the script

    def start(self) -> None:
        """Register the job, restore its latest completed checkpoint, keep what a crashed
        run's step had acknowledged, then become its coordinator."""
        config = step_config()
        # deployed by the operator: the coordinator id its try named (an earlier try's driver,
        # still running, is fenced by it), else this run's own
        named = os.environ.get(ENV_COORDINATOR)
        coordinator_id = validate_id(named, ENV_COORDINATOR) if named else f"steps-{self.run_id}"
        if named:  # refused before it registers, salvages or restores anything once a later try
            # named another (the coordinator's construction writes the job's configuration)
            with self.metastore.transaction() as s:
                refusal = CoordinatorFencing(self.job, coordinator_id).superseded(s)
            if refusal is not None:
                raise refusal
        known = refuse_a_specs_job(self.metastore, self.job)  # before anything is written
        decision = self._savepoint
        if self.restore == "latest" and known is not None:  # a new job has nothing to restore
            decision = find_latest_valid(self.metastore, self.storage, self.job, deep=self.verify)
        coordinator = step_savepoints.StepCoordinator(
            self.job, self.metastore, self.storage, config, coordinator_id=coordinator_id
        )
        if decision is not None:
            self.restored = restored_steps(decision.metadata)
            self.stats.restored_from = decision.checkpoint_id
            if decision.checkpoint_id is not None:
                log.info(
                    "job %s: restored checkpoint %d: completed steps %s",
                    self.job,
                    decision.checkpoint_id,
                    sorted(self.restored),
                )
        if self.restore == "latest":
            # before the takeover aborts (and deletes) the crashed run's pending checkpoint
            self._salvage = step_salvage.Salvage.collect(self.metastore, self.storage, self.job)
        coordinator.activate(unless_superseded=bool(named))
        coordinator.job_status_changed(JobStatus.RUNNING)
        self.coordinator = coordinator
        # as a spec's driver does: the job row says when its driver was last alive (a SIGKILLed
        # script leaves it RUNNING; the stamp's age tells it is dead)
        self._heartbeat = Heartbeat(self.metastore, self.job, coordinator.coordinator_id)
        self._heartbeat.__enter__()
        by_path = self._savepoint is not None
        if decision is not None and step_savepoints.needs_adoption(
            decision, self.storage, self.job, by_path=by_path
        ):
            try:  # a savepoint's files become the job's shared state (the savepoint is left)
                self.restored = step_savepoints.adopt(coordinator, self.restored, self.run_id)
            except BaseException as exc:
                self.close(JobStatus.FAILED, cause=refusal_cause(exc))
                raise

    def close(self, status: JobStatus = JobStatus.FINISHED, *, cause: str | None = None) -> None:
        if self.coordinator is None:
            return
        if self._salvage is not None:
            # the job's salvage folder: a driver a later try superseded leaves it to that try's
            # driver, which may have collected its own partitions into it already
            with self.metastore.transaction() as s:
                superseded = self.coordinator.fencing.superseded(s) is not None
            if not superseded:
                self._salvage.discard()
        if self._heartbeat is not None:
            self._heartbeat.__exit__(None, None, None)
            self._heartbeat = None
        self.coordinator.shutdown(status, cause=cause)
        self.coordinator = None
        log.info(
            "job %s: %s; steps reused %s, computed %s, chained %s, partitions computed %s, "
            "salvaged %s",
            self.job,
            status.value.lower(),
            self.stats.reused,
            self.stats.computed,
            self.stats.chained,
            self.stats.partitions_computed,
            self.stats.partitions_salvaged,
        )

    # ------------------------------------------------------------------ steps

    def step(
        self,
        name: str,
        fn: Callable[..., DataFrame],
        *,
        input: DataFrame | None = None,
        chained: bool = False,
    ) -> DataFrame:
        """Run ``fn()`` (``fn(input)`` given ``input``) as checkpointed step ``name``, or reuse
        its checkpoint; the step's rows read back from its checkpoint. ``chained=True``: a step
        without a shuffle is checkpointed as its plan and inputs, not its rows, and the steps
        that read it recompute it (:mod:`checkpointing.spark.step_chain`)."""
        name = step_name(name)
        if self.coordinator is None:
            raise RuntimeError("ck.step runs inside `with checkpointed(...) as ck:`")
        if self._stopped is not None:  # a stop-with-savepoint a script's `except` swallowed
            raise self._stopped
        if name in self._done:
            raise ConfigError(f"step {name}: a job's step names must be unique")
        df = fn() if input is None else fn(input)
        if not isinstance(df, DataFrame):
            raise TypeError(
                f"step {name}: the function returned {type(df).__name__}, not a DataFrame"
            )
        facts = step_writer.describe(self.spark, df, self.storage, self.job)
        if chained and (refused := step_chain.refusal(name, facts)) is not None:
            raise ConfigError(refused)
        read = {self._by_file[f] for f in facts.step_files if f in self._by_file}
        chained_here = {n for n, r in self._done.items() if r.chained}
        read |= step_chain.chained_upstream(facts.named_plan, chained_here)
        upstream = sorted(read)
        foreign = [f for f in facts.step_files if f not in self._by_file]
        if foreign:
            raise ConfigError(
                f"step {name}: reads {foreign[0]}, a checkpoint file of no step of this run"
            )
        identity = StepIdentity(
            name,
            facts.plan,
            facts.named_plan,
            facts.schema,
            facts.inputs,
            tuple((u, self._done[u].fingerprint) for u in upstream),
            chained=chained,
            published=self._publishing,
        )
        fingerprint = identity.fingerprint
        computed_upstream = [u for u in upstream if u in self._computed]
        why_upstream = (
            f"it reads step {computed_upstream[0]}, which this run computes"
            if computed_upstream
            else None
        )
        decision = decide(name, fingerprint, self.restored, why_upstream)
        if decision.reuse is not None and name not in self._stale:
            record = decision.reuse
            if chained:
                self.stats.chained.append(name)
                log.info("job %s: step %s unchanged: chained into its readers", self.job, name)
            else:
                self.stats.reused.append(name)
                log.info("job %s: step %s unchanged: reusing its checkpoint", self.job, name)
        else:
            if name in self.restored and name not in self._stale:
                stale = [name, *downstream_of(name, self.restored)]
                self._stale.update(stale)
                log.warning(change_line(self.job, name, self.restored))
            elif name not in self.restored:
                log.info("job %s: step %s: computing it (%s)", self.job, name, decision.reason)
            if facts.nondeterministic:
                log.info(
                    "job %s: step %s is checkpointed whole: %s",
                    self.job,
                    name,
                    facts.nondeterministic,
                )
            if chained:
                record = self._chain(name, facts.schema, fingerprint, tuple(upstream))
            else:
                began = time.monotonic()
                record = self._compute(name, df, fingerprint, tuple(upstream), facts, input, fn)
                self.stats.computed.append(name)
                if could_chain(name, facts, input, self._publishing):
                    log.info(step_chain.hint(self.job, name, record.size, time.monotonic() - began))
            self._computed.add(name)
        self._done[name] = record
        self._by_file.update({u: name for u in record.urls})
        if not self._publishing:
            self._boundary()
        if chained:
            return step_chain.chained_frame(df, name)
        return step_writer.read_step(self.spark, record)

    def _chain(
        self, name: str, schema: str, fingerprint: str, upstream: tuple[str, ...]
    ) -> StepRecord:
        """A chained step's checkpoint: its identity, no rows."""
        assert self.coordinator is not None
        self._seq += 1
        log.info("job %s: step %s: chained into its readers (not written)", self.job, name)
        record = step_chain.checkpoint_chained(
            self.coordinator,
            step_chain.chained_record(name, fingerprint, upstream, schema),
            self._carried(),
            self.run_id,
            self._seq,
        )
        self.stats.chained.append(name)
        return record

    def _boundary(self) -> None:
        """A step boundary: take the savepoint requests queued meanwhile; a stop-with-savepoint
        ends the run (:class:`~checkpointing.spark.step_savepoints.StoppedWithSavepoint`)."""
        assert self.coordinator is not None
        stop = step_savepoints.take_requests(self.coordinator, self._carried(), self.run_id)
        if stop is not None:
            self.stopped_with_savepoint = stop.location
            self._stopped = step_savepoints.StoppedWithSavepoint(stop.checkpoint_id, stop.location)
            raise self._stopped

    def _carried(self) -> list[StepRecord]:
        """What the next step checkpoint carries: this run's steps, and the restored ones not
        reached yet that no change made stale (a later step may still reuse them)."""
        later = [
            r for n, r in self.restored.items() if n not in self._done and n not in self._stale
        ]
        return [*self._done.values(), *later]

    def _compute(
        self,
        name: str,
        df: DataFrame,
        fingerprint: str,
        upstream: tuple[str, ...],
        facts: step_writer.PlanFacts,
        input: DataFrame | None,
        fn: Callable[..., DataFrame],
    ) -> StepRecord:
        assert self.coordinator is not None
        self._seq += 1
        kept = self._salvage.take(name, fingerprint) if self._salvage is not None else None
        # only a step read back is re-read file by file (one task per file, for a resume)
        is_step = step_salvage.step_input(input, self._by_file)
        resumable = step_salvage.resumable(name, kept, facts, input, is_step=is_step)
        if kept is not None and resumable is not None:
            log.info(
                "job %s: step %s reruns whole: %s (%d partitions were acknowledged)",
                self.job,
                name,
                resumable,
                len(kept.files),
            )
            kept = None
        record, computed, salvaged = step_salvage.checkpoint_step(
            self.spark,
            self.coordinator,
            name=name,
            df=df,
            fingerprint=fingerprint,
            upstream=upstream,
            deterministic=facts.nondeterministic is None,
            carried=self._carried(),
            run=self.run_id,
            seq=self._seq,
            kept=kept,
            narrow=facts.narrow and facts.nondeterministic is None and is_step,
            input=input,
            fn=fn,
            published=self._publishing,
        )
        self.stats.partitions_computed[name] = computed
        if salvaged:
            self.stats.partitions_salvaged[name] = salvaged
        self.stats.bytes_written += record.size
        return record

    # ------------------------------------------------------------------ output

    @contextlib.contextmanager
    def _leading(self) -> Iterator[None]:
        """While held, this run's coordinator leads the job: its row stays locked, so a later
        try cannot take over in the middle (the publish's swap runs inside it)."""
        assert self.coordinator is not None
        with self.metastore.transaction() as s:
            refusal = self.coordinator.fencing.superseded(s)
            if refusal is not None:
                raise refusal
            yield

    def write(
        self, df: DataFrame, path: str, format: str = "parquet", *, name: str = "output"
    ) -> str:
        """Publish ``df`` at ``path`` exactly once: checkpointed as step ``name``, then written
        as ``<path>/final-<token>`` and swapped in as ``<path>/final`` atomically
        (:class:`~checkpointing.spark.parquet_sink.TwoPhaseCommitSink`); the token is the step's
        fingerprint, so a rerun that reuses the step publishes nothing twice."""
        if format != "parquet":
            raise ConfigError(f"format: only 'parquet' is supported, not {format!r}")
        sink = TwoPhaseCommitSink(path, job=self.job)  # refused before anything runs
        self._publishing = True  # its boundary is after the publish
        try:
            out = self.step(name, lambda: df)
        finally:
            self._publishing = False
        record = self._done[name]
        token = record.fingerprint.split(":", 1)[1][:32]
        # the step's files are the table: linked, not written a second time (only files inside
        # this job's shared state, as the step's own writer put them)
        shared = self.storage.shared_url(self.job)
        files = (
            [self.storage.path_of(u) for u in record.urls]
            if isinstance(self.storage, FileSystemCheckpointStorage)
            and all(self.storage.contains(u, shared) for u in record.urls)
            else None
        )
        with self._leading():  # a driver a later try superseded stages nothing either
            pass
        published = sink.publish_final(out, token, files, guard=self._leading)
        self.stats.published[name] = published
        log.info("job %s: published %s at %s", self.job, name, published)
        self._boundary()
        return published
