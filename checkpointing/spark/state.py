"""A run's operator state on the driver, in Flink's words: the keyed state of each stage
(:class:`StageRun`: a table partitioned by subtask between epochs), snapshotted by every subtask
from its executor and restored by each new subtask reading just its key groups of the old files;
and the list state of the ``source`` (splits still to read) and ``sink`` (staged epochs),
dealt round-robin over their subtasks. What runs on the executors is
:mod:`checkpointing.spark.executor`; when a checkpoint is taken is the runtime's
(:mod:`checkpointing.spark.runtime`), what a run restores :mod:`checkpointing.spark.run_restore`'s.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.pandas.types import from_arrow_schema

from checkpointing.coordination.pending import TaskAck, TaskSpec
from checkpointing.ids import validate_id
from checkpointing.pipeline.operator_ids import AGGREGATE, SINK, SOURCE
from checkpointing.pipeline.spec import SpecError
from checkpointing.pipeline.splits import Consumed, InputSplit, is_processed, split_items
from checkpointing.restore.assignment import OperatorRestore
from checkpointing.spark.executor import (
    SEQ,
    WRITTEN,
    read_subtask_snapshots,
    write_subtask_snapshot,
)
from checkpointing.spark.keys import KEY_GROUP, SUBTASK
from checkpointing.spark.stages import Stage
from checkpointing.state.incremental import CHAIN_AGGREGATE, CHAIN_REPLACE, needs_full
from checkpointing.state.keygroups import KeyGroupRange, key_group_range
from checkpointing.state.metadata import PARQUET, ChainedFile, CheckpointMetadata
from checkpointing.state.storage import CheckpointStorage

#: epochs of changed rows (or a lazy state's deltas) kept for the next incremental snapshot
#: before they are dropped and the next snapshot is full: each holds its epoch's rows alive
MAX_DIRTY_EPOCHS = 4


@dataclass
class SubtaskChain:
    """The files one subtask's state spans as of its last completed checkpoint (oldest first:
    a full snapshot, then changes) and the bytes per key group over all of them: what its next
    incremental snapshot builds on."""

    files: list[ChainedFile]
    group_bytes: dict[int, int]


@dataclass
class StageRun:
    """A keyed stage of a run: its operator id (its snapshots' name), key, input schema (fixed
    by the first read) and current state."""

    operator_id: str
    stage: Stage
    key: list[str]
    input_schema: T.StructType | None = None
    state: DataFrame | None = None
    #: incremental snapshots: each subtask's chain as of the last completed checkpoint (empty:
    #: the next snapshot is full); None when this stage's snapshots are always full
    chains: dict[int, SubtaskChain] | None = None
    #: the state rows changed in each epoch since then, newest last: the next snapshot's changes
    #: (for a lazily merged state, the epochs' partial aggregates)
    dirty: list[tuple[int, DataFrame]] = field(default_factory=list)
    #: merged lazily (:mod:`~checkpointing.spark.lazy_state`): ``state`` is the base, these the
    #: partial aggregates of the epochs since it was last compacted
    lazy: bool = False
    deltas: list[DataFrame] = field(default_factory=list)
    #: a lazily merged state kept as the checkpoints' own Parquet runs instead
    #: (:class:`~checkpointing.spark.keyed_runs.KeyedRuns`): nothing held between epochs
    runs: Any = None

    def track_changes(self, epoch: int, changed: DataFrame, limit: int, *, reset: bool) -> None:
        """Keep the epoch's changed state rows (its step's ``changed_state``) for the next
        incremental snapshot. Kept whether or not a chain exists yet: the snapshot in flight
        may complete one, and the next snapshot then builds on it. Past ``limit`` epochs
        without a completed checkpoint they are dropped with the chains (when ``reset`` is
        allowed: no snapshot in flight, whose completion would bring back chains that lack
        them), so the next snapshot is full rather than old states held."""
        self.dirty.append((epoch, changed))
        if len(self.dirty) > limit and reset:
            self.dirty.clear()
            self.chains = {}


def chained_stages(stages: Sequence[Stage], key: Sequence[str]) -> list[StageRun]:
    """The runs of a chain of stages: the first keyed by the pipeline's ``key``, the others by
    their own; operator ids from each stage's ``uid``, else ``aggregate`` for the first (the
    id a single-stage job has always had) and ``stage-<i>`` after it. Ids must be distinct:
    they name the state a restore maps back to each stage."""
    runs: list[StageRun] = []
    for i, stage in enumerate(stages):
        if i == 0:
            stage = stage.with_key(key)
        stage_key = list(stage.key)
        if not stage_key:
            raise SpecError(f"stage {i + 1} ({stage!r}) has no key: give it key=[...]")
        uid = stage.uid or (AGGREGATE if i == 0 else f"stage-{i + 1}")
        validate_id(uid, f"stage {i + 1} uid")
        if uid in (SOURCE, SINK) or any(r.operator_id == uid for r in runs):
            raise SpecError(f"stage {i + 1}: operator id {uid!r} is taken; give it another uid")
        runs.append(StageRun(uid, stage, stage_key))
    return runs


def empty_state(spark: SparkSession, s: StageRun, parallelism: int) -> DataFrame:
    """A stage's state before it has any key: its schema, partitioned like every later state."""
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
    return spark.createDataFrame([], schema).repartition(parallelism, SUBTASK)


# ---------------------------------------------------------------------- snapshot


def changed_rows(s: StageRun) -> DataFrame | None:
    """The state rows a stage changed since its chains' checkpoint, each with its epoch in
    :data:`SEQ` (the last of a key wins); None when nothing changed."""
    changes = None
    for epoch, df in s.dirty:
        part = df.withColumn(SEQ, F.lit(epoch))
        changes = part if changes is None else changes.unionByName(part)
    return changes


def snapshot_stage(
    state: DataFrame,
    s: StageRun,
    plan: Sequence[TaskSpec],
    storage: CheckpointStorage,
    dir_url: str,
    partition_keys: Sequence[int],
    max_parallelism: int,
    *,
    chains: Mapping[int, SubtaskChain] | None = None,
    changes: DataFrame | None = None,
    chain_merge: str = CHAIN_REPLACE,
) -> tuple[list[TaskAck], dict[int, SubtaskChain]]:
    """Every subtask of one keyed stage writes its snapshot of ``state`` into ``dir_url`` from
    the executor; the acks of the stage's tasks in ``plan``, and each subtask's chain after it.

    Incremental (``chains`` given, and ``changes``: the rows changed since the chains' checkpoint,
    with their epoch in :data:`SEQ`): a subtask whose chain may grow writes only its changed
    rows and references the chain; the others (no chain yet, or one to cut) write in full.
    ``chain_merge``: how the chain's files combine, recorded in each handle that has a chain."""
    keys, key, operator_id = list(partition_keys), list(s.key), s.operator_id
    parallelism = len(keys)
    incremental = chains is not None
    chains = chains or {}
    delta = {
        i for i in range(parallelism) if incremental and not writes_full(chains, i, chain_merge)
    }
    full = [keys[i] for i in range(parallelism) if i not in delta]
    parts = []
    if full:
        rows = state if not delta else state.where(F.col(SUBTASK).isin(full))
        parts.append(rows.withColumn(SEQ, F.lit(-1)))
    if delta and changes is not None:  # none: nothing changed since the chains' checkpoint
        parts.append(changes if not full else changes.where(~F.col(SUBTASK).isin(full)))
    written: dict[int, Any] = {}
    if parts:
        source = parts[0] if len(parts) == 1 else parts[0].unionByName(parts[1])

        def writer(table: pa.Table) -> pa.Table:  # annotated: Spark infers the UDF type
            return write_subtask_snapshot(
                storage, dir_url, keys, max_parallelism, key, operator_id, table
            )

        snapshots = source.groupBy(SUBTASK).applyInArrow(writer, from_arrow_schema(WRITTEN))
        written = {row["subtask"]: row for row in snapshots.collect()}
    acks, after = [], {}
    for task in (t for t in plan if t.operator_id == operator_id):
        i = task.subtask_index
        r = key_group_range(max_parallelism, parallelism, i)
        row = written.get(i)
        meta: dict[str, Any] = {"key_groups": [r.start, r.end], "group_bytes": {}}
        new = None
        if row is not None:
            new = ChainedFile(handle=row["url"], size=row["size"], checksum=row["checksum"])
            meta["changed_groups"] = len(row["groups"])
        if i in delta:  # the chain, and this snapshot's changes if any
            before = chains[i]
            files = [*before.files, *([new] if new else [])]
            group_bytes = dict(before.group_bytes)
            for g, n in zip(
                row["groups"] if row else [], row["group_bytes"] if row else [], strict=True
            ):
                group_bytes[g] = group_bytes.get(g, 0) + n
            meta["changed_groups"] = meta.get("changed_groups", 0)
        else:
            files = [new] if new else []
            group_bytes = dict(zip(row["groups"], row["group_bytes"], strict=True)) if row else {}
        if incremental:
            after[i] = SubtaskChain(files, group_bytes)
        meta["group_bytes"] = group_bytes
        if not files:  # no keys in this subtask's key groups
            acks.append(TaskAck(task.attempt_id, state_meta=meta))
            continue
        if len(files) > 1:
            meta["chain"] = [f.model_dump() for f in files[:-1]]
            if chain_merge != CHAIN_REPLACE:
                meta["chain_merge"] = chain_merge
        last = files[-1]
        acks.append(
            TaskAck(
                task.attempt_id,
                last.handle,
                last.size,
                last.checksum,
                row["sync_ms"] if row else 0,
                row["async_ms"] if row else 0,
                state_meta=meta,
            )
        )
    return acks, after


def writes_full(chains: Mapping[int, SubtaskChain], subtask: int, chain_merge: str) -> bool:
    """Whether an incremental snapshot writes ``subtask``'s state in full: it has no chain yet,
    or one to cut. A subtask that had no keys at the chains' checkpoint (an empty chain) and
    whose changes are partial aggregates writes just those: merged among themselves, they are
    its whole state, so no compaction is needed for it."""
    chain = chains.get(subtask)
    if chain is None:
        return True
    if not chain.files and chain_merge == CHAIN_AGGREGATE:
        return False
    return needs_full(chain.files, chain_merge)


def continued_chains(
    restored: OperatorRestore,
    metadata: CheckpointMetadata,
    shared_url: str,
    storage: CheckpointStorage,
    chain_merge: str = CHAIN_REPLACE,
) -> dict[int, SubtaskChain]:
    """After a restore, the chains the new subtasks' incremental snapshots may build on: a
    subtask that restores exactly one old subtask's key groups, all of them, from files under
    the job's ``shared/`` (an incremental checkpoint's, which the registry keeps while referenced),
    continues its chain — if its files combine as this run's will (``chain_merge``); any other
    (rescaled, restored from a savepoint, or a chain of the other kind) starts with a full
    snapshot."""
    handles = {h.handle: h for h in metadata.handles()}
    out = {}
    for t in restored.subtasks:
        if len(t.reads) != 1:
            continue
        old = handles[t.reads[0].url]
        files = old.files()
        if (
            old.key_groups is None
            or KeyGroupRange(*old.key_groups) != t.key_groups
            or t.reads[0].key_groups != t.key_groups
            or not all(storage.contains(f.handle, shared_url) for f in files)
            or (len(files) > 1 and (old.chain_merge or CHAIN_REPLACE) != chain_merge)
        ):
            continue
        out[t.subtask_index] = SubtaskChain(files, dict(old.group_bytes or {}))
    return out


def list_acks(
    plan: Sequence[TaskSpec], operator: str, items: list[dict[str, Any]]
) -> list[TaskAck]:
    """The acks of a list-state operator's tasks: ``items`` dealt round-robin over them."""
    tasks = [t for t in plan if t.operator_id == operator]
    dealt: list[list[dict[str, Any]]] = [[] for _ in tasks]
    for i, item in enumerate(items):
        dealt[i % len(tasks)].append(item)
    return [
        TaskAck(t.attempt_id, state_meta={"list_state": d})
        for t, d in zip(tasks, dealt, strict=True)
    ]


def remaining_splits(
    epochs: Sequence[Sequence[InputSplit]], first_epoch: int
) -> list[dict[str, Any]]:
    """The source's list state items of every split of the epochs from ``first_epoch`` on."""
    return [s.to_state(e) for e in range(first_epoch, len(epochs)) for s in epochs[e]]


# ---------------------------------------------------------------------- restore


def through_epoch(metadata: CheckpointMetadata, num_epochs: int) -> int:
    """The last epoch a checkpoint covers: one before the first split still to read; with none
    left, the last epoch it processed (``num_epochs - 1`` for a source state without them)."""
    if not any(op.operator_id == SOURCE for op in metadata.operators):
        raise ValueError("checkpoint has no source state")
    source = metadata.list_items(SOURCE)
    items = split_items(source)  # not the static tables' files nor earlier runs' (compacted)
    remaining = [int(i["epoch"]) for i in items if not is_processed(i)]
    if remaining:
        return min(remaining) - 1
    processed = [int(i["epoch"]) for i in items if is_processed(i)]
    if processed:
        return max(processed)
    compacted = Consumed.from_items(source).epochs
    return compacted - 1 if compacted else num_epochs - 1


def check_source(
    restored: OperatorRestore, planned: Sequence[dict[str, Any]], checkpoint_id: int
) -> None:
    """For a checkpoint whose source state has no processed splits (taken before they were
    recorded): the splits it says remain must be the ones this run would read next
    (``planned``), otherwise the input (or ``splits_per_epoch``, ``epoch_bytes``,
    ``max_split_bytes``) changed since, and resuming would skip or repeat input. Newer
    checkpoints are resumed by :func:`checkpointing.pipeline.splits.resume`."""

    def key(item: dict[str, Any]) -> str:
        return json.dumps(InputSplit.from_state(item).to_state(int(item["epoch"])))

    old = sorted(
        key(item)
        for s in restored.subtasks
        for item in split_items(s.list_state)
        if not is_processed(item)
    )
    new = sorted(key(item) for item in planned)
    if old != new:
        missing = sorted(set(old) - set(new))
        extra = sorted(set(new) - set(old))
        raise SpecError(
            f"source: the input does not match checkpoint {checkpoint_id}: it has "
            f"{len(old)} split(s) left to read, this run plans {len(new)} "
            f"(only in the checkpoint: {missing[:2]}; only now: {extra[:2]}). Restore with "
            "the input, splits_per_epoch, epoch_bytes and max_split_bytes it was taken with"
        )


def restore_stage(
    spark: SparkSession,
    storage: CheckpointStorage,
    empty: DataFrame,
    restored: OperatorRestore,
    metadata: CheckpointMetadata,
    partition_keys: Sequence[int],
    key: Sequence[str],
    merge: Callable[[DataFrame], DataFrame] | None = None,
    *,
    unmerged: bool = False,
) -> DataFrame:
    """One stage's state restored from ``metadata`` as ``restored`` assigns it: each new
    subtask's executor reads just its key groups of the old snapshot files; partitioned by
    subtask as the state always is (``empty`` gives the schema, and is the state when there is
    nothing to read). Chains of partial aggregates (``chain_merge: aggregate``) are merged by
    ``merge`` (the stage's own, one row per key from many); a stage without one cannot restore
    them. ``unmerged``: give their rows as read (several per key), for a lazily merged state
    that merges them at its next compaction anyway."""
    if any(h.file_format == PARQUET for h in _operator_handles(metadata, restored)):
        return _restore_runs(spark, empty, restored, metadata, partition_keys, merge, unmerged)
    handles = {h.handle: h for h in metadata.handles()}
    files = {url: h.files() for url, h in handles.items()}
    reads = [
        (
            partition_keys[t.subtask_index],
            [f.handle for f in files[r.url]],
            [f.checksum for f in files[r.url]],
            [f.size for f in files[r.url]],  # bounds the executor's read of each file
            r.key_groups.start,
            r.key_groups.end,
            handles[r.url].chain_merge == CHAIN_AGGREGATE and len(files[r.url]) > 1,
        )
        for t in restored.subtasks
        for r in t.reads
    ]
    if not reads:
        return empty
    aggregated = any(r[-1] for r in reads)
    if aggregated and merge is None and not unmerged:
        raise SpecError(
            f"checkpoint {metadata.checkpoint_id}: the state of operator "
            f"{restored.operator_id!r} is a chain of partial aggregates, which only an "
            "aggregation stage can restore"
        )
    tasks = spark.createDataFrame(
        reads,
        "part_key int, urls array<string>, checksums array<string>, sizes array<long>, "
        "start int, end int, aggregate boolean",
    ).repartition(len(reads))
    reader = partial(read_subtask_snapshots, storage, empty.schema.names, list(key))
    loaded = tasks.mapInArrow(reader, empty.schema).repartition(len(partition_keys), SUBTASK)
    if aggregated and merge is not None and not unmerged:
        loaded = merge(loaded)
    return loaded.localCheckpoint(eager=True)


def _operator_handles(metadata: CheckpointMetadata, restored: OperatorRestore) -> list[Any]:
    return [
        h
        for op in metadata.operators
        if op.operator_id == restored.operator_id
        for h in op.subtasks
        if h.handle
    ]


def restored_runs(metadata: CheckpointMetadata, operator_id: str) -> list[ChainedFile] | None:
    """The Parquet runs an operator's state spans in ``metadata`` (each file once, in chain
    order), or None when its state is in another format."""
    handles = [
        h
        for op in metadata.operators
        if op.operator_id == operator_id
        for h in op.subtasks
        if h.handle
    ]
    if not handles or any(h.file_format != PARQUET for h in handles):
        return None if handles else []
    return list({f.handle: f for h in handles for f in h.files()}.values())


def _restore_runs(
    spark: SparkSession,
    empty: DataFrame,
    restored: OperatorRestore,
    metadata: CheckpointMetadata,
    partition_keys: Sequence[int],
    merge: Callable[[DataFrame], DataFrame] | None,
    unmerged: bool,
) -> DataFrame:
    """A state kept as Parquet runs (:mod:`~checkpointing.spark.keyed_runs`) read back as a
    table partitioned by subtask, for a stage that keeps its state in Spark: each run read once
    (every row carries its key group, so the new subtasks take their own whatever the
    parallelism), merged by ``merge`` unless ``unmerged``."""
    from checkpointing.spark.keys import subtask_column

    files = restored_runs(metadata, restored.operator_id) or []
    if not files:
        return empty
    if merge is None and not unmerged:
        raise SpecError(
            f"checkpoint {metadata.checkpoint_id}: the state of operator "
            f"{restored.operator_id!r} is partial aggregates, which only an aggregation stage "
            "can restore"
        )
    max_p = next(op.max_parallelism for op in metadata.operators)
    runs = spark.read.parquet(*(f.handle for f in files))
    runs = runs.withColumn(SUBTASK, subtask_column(len(partition_keys), max_p))
    loaded = runs.select(*empty.schema.names).repartition(len(partition_keys), SUBTASK)
    if merge is not None and not unmerged:
        loaded = merge(loaded)
    return loaded.localCheckpoint(eager=True)
