"""Running one step's checkpoint, and resuming a step a crash cut short.

A crashed run leaves its step's PENDING checkpoint with the files its committed Spark tasks
acknowledged. The next run's coordinator takes over and aborts that checkpoint (deleting its
directory), so before the takeover :class:`Salvage` hard-links each acknowledged file, found
only inside the directory the ids give and kept only when its checksum still matches, into the
job's ``steps-salvage/<step>/``. When the step is reached again with the same fingerprint, and
it is deterministic and narrow over a checkpointed input (``ck.step(name, fn, input=up)``, a
plan with one file scan and no exchange), its kept partitions are linked into the new
checkpoint and acknowledged, and ``fn`` runs over the missing partitions' input files only.
Otherwise the whole step reruns and the log says why.

A narrow step reads one input file per Spark partition (file packing off), and records each
partition's input file, so a partition is matched to its input across runs.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from sqlalchemy import select

from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint, CheckpointAck
from checkpointing.spark import step_writer
from checkpointing.spark.session import session_settings
from checkpointing.state.storage import CheckpointStorage, FileSystemCheckpointStorage
from checkpointing.status import CheckpointStatus
from checkpointing.steps.plan import STEP_KEY, StepFile, StepRecord

log = logging.getLogger(__name__)

#: a narrow step over a checkpointed input: one input file per Spark partition, never split
#: (and its plan static: its leaves are read for each partition's file)
NARROW_SQL = {
    "spark.sql.adaptive.enabled": "false",
    "spark.sql.files.maxPartitionBytes": str(1 << 62),
    "spark.sql.files.openCostInBytes": str(1 << 62),
}
SALVAGE_DIR = "steps-salvage"


@dataclass(frozen=True)
class KeptStep:
    """A step's partitions a crashed run acknowledged, linked into the salvage directory."""

    name: str
    fingerprint: str
    parallelism: int
    #: partition -> (salvaged file, size, checksum, its input file)
    files: dict[int, tuple[str, int, str | None, str | None]]


class Salvage:
    """The acknowledged partitions of a crashed run's pending step checkpoints."""

    def __init__(self, storage: CheckpointStorage, job: str, steps: dict[str, KeptStep]) -> None:
        self.storage = storage
        self.job = job
        self.steps = steps

    @classmethod
    def collect(cls, metastore: Metastore, storage: CheckpointStorage, job: str) -> Salvage:
        """Link what the job's PENDING step checkpoints acknowledged (before the takeover)."""
        if not isinstance(storage, FileSystemCheckpointStorage):
            return cls(storage, job, {})
        with metastore.transaction() as s:
            rows = s.execute(
                select(Checkpoint.checkpoint_id, CheckpointAck)
                .join(
                    CheckpointAck,
                    (CheckpointAck.job_id == Checkpoint.job_id)
                    & (CheckpointAck.checkpoint_id == Checkpoint.checkpoint_id),
                )
                .where(Checkpoint.job_id == job, Checkpoint.status == CheckpointStatus.PENDING)
            ).all()
            found = [
                (cid, a.state_handle, a.state_size, a.checksum, a.state_meta) for cid, a in rows
            ]
        root = storage.path_of(f"{storage.job_url(job)}/{SALVAGE_DIR}")
        shutil.rmtree(root, ignore_errors=True)  # an earlier salvage nobody took
        steps: dict[str, KeptStep] = {}
        for cid, handle, size, checksum, meta in found:
            item = _item(meta)
            if item is None or not handle:
                continue
            name = str(item[STEP_KEY])
            own = f"{storage.shared_checkpoint_url(job, cid)}/{name}"
            # only a file inside the directory the ids give (a row is anyone's to write)
            if handle.rsplit("/", 1)[0] != own or not storage.contains(handle, own):
                continue
            partition = int(item["partition"])
            target = root / name / f"{partition}.parquet"
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(storage.path_of(handle), target)
            except OSError:
                continue
            url = target.as_uri()
            if step_writer.file_checksum(storage, url) != (size, checksum):
                target.unlink(missing_ok=True)
                continue
            kept = steps.get(name)
            if kept is None or kept.fingerprint != item["fingerprint"]:
                kept = KeptStep(name, str(item["fingerprint"]), int(item["parallelism"]), {})
                steps[name] = kept
            kept.files[partition] = (url, size, checksum, item.get("input"))
        for kept in steps.values():
            log.info(
                "job %s: step %s: %d of %d partitions acknowledged before the crash are kept",
                job,
                kept.name,
                len(kept.files),
                kept.parallelism,
            )
        return cls(storage, job, steps)

    def take(self, name: str, fingerprint: str) -> KeptStep | None:
        kept = self.steps.pop(name, None)
        return kept if kept is not None and kept.fingerprint == fingerprint else None

    def discard(self) -> None:
        """Nothing more can use them (the run ends)."""
        if isinstance(self.storage, FileSystemCheckpointStorage):
            root = self.storage.path_of(f"{self.storage.job_url(self.job)}/{SALVAGE_DIR}")
            shutil.rmtree(root, ignore_errors=True)


def _item(meta: Any) -> dict[str, Any] | None:
    items = meta.get("list_state") if isinstance(meta, dict) else None
    item = items[0] if isinstance(items, list) and items else None
    return item if isinstance(item, dict) and STEP_KEY in item else None


def step_input(input: DataFrame | None, step_files: Collection[str]) -> bool:
    """Whether ``input`` is a checkpointed step as read back: a bare scan of step files only
    (what a partial resume reads again, file by file, with the step's schema)."""
    if input is None:
        return False
    if input._jdf.queryExecution().analyzed().getClass().getSimpleName() != "LogicalRelation":
        return False
    files = [step_writer.as_url(p) for p in input.inputFiles()]
    return bool(files) and all(f in step_files for f in files)


def resumable(
    name: str,
    kept: KeptStep | None,
    facts: step_writer.PlanFacts,
    input: DataFrame | None,
    *,
    is_step: bool,
) -> str | None:
    """Why a step cut short cannot recompute only its missing partitions, or None
    (``is_step``: :func:`step_input` of ``input``)."""
    if kept is None:
        return None
    if facts.nondeterministic:
        return f"{facts.nondeterministic}: a non-deterministic step is checkpointed whole"
    if input is None:
        return "it names no checkpointed input (ck.step(name, fn, input=step))"
    if not is_step:
        # its missing partitions are recomputed from its input's files read with its schema
        return "its input is not a step as read back (a chained, transformed or other DataFrame)"
    if not facts.narrow:
        return "it is not narrow over its input (a join, aggregate, window, sort or shuffle)"
    return None


def scan_inputs(df: DataFrame) -> list[str | None]:
    """Each output partition's input file, from the physical plan's file scan (one file per
    partition under :data:`NARROW_SQL`; None where a partition reads no file)."""
    plan = df._jdf.queryExecution().executedPlan()
    leaves = plan.collectLeaves()
    for i in range(leaves.size()):
        leaf = leaves.apply(i)
        if leaf.getClass().getSimpleName() == "FileSourceScanExec":
            parts = leaf.inputRDD().partitions()
            out: list[str | None] = []
            for p in parts:
                files = p.files()
                out.append(str(files[0].filePath().toString()) if len(files) else None)
            return out
    raise ValueError("no file scan in the plan")


def checkpoint_step(
    spark: SparkSession,
    coordinator: CheckpointCoordinator,
    *,
    name: str,
    df: DataFrame,
    fingerprint: str,
    upstream: tuple[str, ...],
    deterministic: bool,
    carried: list[StepRecord],
    run: str,
    seq: int,
    kept: KeptStep | None,
    narrow: bool,
    input: DataFrame | None,
    fn: Any,
    published: bool = False,
) -> tuple[StepRecord, int, int]:
    """Trigger the step's checkpoint, acknowledge what it carries, write its partitions (or
    only the missing ones) and acknowledge each; returns its record, the partitions computed
    and those kept from a crashed run. ``published``: its files become the published table
    (``ck.write``'s step). A step is planned under the session's own settings (its shuffles
    coalesced by adaptive execution, as without checkpoints), a narrow one resumable from its
    input's files under :data:`NARROW_SQL` as well."""
    storage = coordinator.storage
    extra = NARROW_SQL if narrow and input is not None else {}
    with session_settings(spark, extra):
        fresh = df.select("*")
        prepared, n = step_writer.planned(spark, fresh)
        inputs = scan_inputs(fresh) if extra else [None] * n
        if extra and len(inputs) != n:  # not one partition per input file after all
            log.info("step %s: %d tasks over %d input splits: not resumable", name, n, len(inputs))
            inputs, kept = [None] * n, None
        if kept is not None and (
            kept.parallelism != n or any(inputs[p] != f[3] for p, f in kept.files.items())
        ):
            log.info("step %s reruns whole: its partitions no longer match its input's", name)
            kept = None
        record = StepRecord(
            name,
            fingerprint,
            upstream,
            df.schema.json(),
            n,
            deterministic,
            partition_inputs=tuple(inputs),
        )
        checkpoint_id, tasks = step_writer.trigger_step(coordinator, run, seq, carried, record)
        directory = f"{storage.shared_checkpoint_url(coordinator.job_id, checkpoint_id)}/{name}"
        tag = f"ckpt-step-{run}-{seq}"
        acker = step_writer.StepAcknowledger(
            coordinator,
            checkpoint_id,
            record,
            tasks.own,
            directory,
            on_failed=lambda: spark.sparkContext.cancelJobsWithTag(tag),
        )
        salvaged = 0
        if kept is not None:
            salvaged = _link_kept(storage, kept, directory, acker)
        missing = [p for p in range(n) if p not in acker.files]
        if kept is None:
            spark.sparkContext.addJobTag(tag)  # this thread's jobs: the write's
            acker.start()
            try:
                step_writer.write_partitions(spark, prepared, directory, published=published)
            except Exception as exc:
                # cancelled for the acker's reason, or failed first because a later try's
                # takeover deleted the aborted checkpoint's directory under it
                why = acker.error or _superseded(coordinator)
                if why is not None:
                    raise why from exc
                raise
            finally:
                acker.stop()
                spark.sparkContext.removeJobTag(tag)
            acker.finish()
        elif missing:
            _write_missing(spark, storage, fn, input, missing, inputs, directory, acker)
            acker.finish()
        else:
            acker.finish()
    if acker.completed is None:
        raise step_writer.StepCheckpointError(
            f"step {name}: checkpoint {checkpoint_id} did not complete"
        )
    step_writer.remove_leftovers(storage, directory)
    files = tuple(sorted(acker.files.values(), key=lambda f: f.partition))
    computed = n - salvaged
    if kept is not None:
        log.info("step %s: recomputed %d missing partitions, kept %d", name, len(missing), salvaged)
    return replace(record, files=files), computed, salvaged


def _superseded(coordinator: CheckpointCoordinator) -> BaseException | None:
    """The refusal to raise when a later try took the job over from ``coordinator``."""
    with coordinator.metastore.transaction() as s:
        return coordinator.fencing.superseded(s)


def _link_kept(
    storage: CheckpointStorage, kept: KeptStep, directory: str, acker: step_writer.StepAcknowledger
) -> int:
    """Link the kept files into the new checkpoint's directory and acknowledge them."""
    assert isinstance(storage, FileSystemCheckpointStorage)
    target_dir = storage.path_of(directory)
    target_dir.mkdir(parents=True, exist_ok=True)
    linked = []
    for p, (url, size, checksum, _) in sorted(kept.files.items()):
        name = step_writer.part_name(p)
        os.link(storage.path_of(url), target_dir / name)
        linked.append(StepFile(p, f"{directory}/{name}", size, checksum))
    acker.ack_many(linked)
    return len(kept.files)


def _write_missing(
    spark: SparkSession,
    storage: CheckpointStorage,
    fn: Any,
    input: DataFrame | None,
    missing: list[int],
    inputs: list[str | None],
    directory: str,
    acker: step_writer.StepAcknowledger,
) -> None:
    """``fn`` over the missing partitions' input files only; each output file renamed to the
    partition its input file had."""
    assert isinstance(storage, FileSystemCheckpointStorage) and input is not None
    wanted = {inputs[p]: p for p in missing if inputs[p] is not None}
    subset = spark.read.schema(input.schema).parquet(*wanted) if wanted else None
    if subset is not None:
        part = fn(subset).select("*")
        order = scan_inputs(part)
        scratch = f"{directory}/_missing"
        step_writer.write_partitions(spark, part, scratch)
        written = []
        for entry in sorted(storage.path_of(scratch).iterdir()):
            match = step_writer._PART.match(entry.name)
            if match is None:
                continue
            source = order[int(match.group(1))]
            p = wanted[source]
            name = step_writer.part_name(p)
            os.rename(entry, storage.path_of(directory) / name)
            size, checksum = step_writer.file_checksum(storage, f"{directory}/{name}")
            written.append(StepFile(p, f"{directory}/{name}", size, checksum))
        acker.ack_many(written)
        shutil.rmtree(storage.path_of(scratch), ignore_errors=True)
