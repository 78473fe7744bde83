"""Scale: many OS processes acknowledge one big checkpoint at once.

Each worker is a separate process (multiprocessing "spawn", as Spark executors would be) with its
own ``Metastore`` and its own ``CheckpointCoordinator`` loaded from the metastore. The workers
send single acks and small batches, some attempts are deliberately acked by two processes, and
some acks come from attempts that are not in the plan. Only outcomes are asserted, never timings:
no lost and no duplicated ack, consistent per-call results, exactly one completion, and a valid
``_metadata`` listing every task.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import threading
import traceback
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import distinct, func, select

from checkpointing.config import CheckpointConfig
from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.gateway import AckOutcome
from checkpointing.coordination.pending import AckResult, TaskAck, TaskSpec
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint, CheckpointAck
from checkpointing.state.metadata import read_metadata, verify_handles
from checkpointing.state.storage import FileSystemCheckpointStorage, checksum_of
from checkpointing.status import CheckpointStatus

pytestmark = pytest.mark.slow

#: generous limits so that a loaded machine fails loudly instead of hanging; not asserted
_START_TIMEOUT_S = 240
_RESULT_TIMEOUT_S = 420
#: sizes of the calls a worker makes: mostly single acks, some small batches
_CALL_SIZES = (1, 1, 1, 1, 2, 3, 4, 6, 8)


@dataclass(frozen=True)
class CallRecord:
    """What one ``receive_acknowledge`` call of a worker got back."""

    worker: int
    attempts: tuple[str, ...]
    results: dict[str, str]
    completed_id: int | None
    completed_handles: int | None
    metadata_path: str | None
    deleted_handles: tuple[str, ...]


@dataclass(frozen=True)
class Workload:
    calls: list[list[list[TaskAck]]]  # per worker, its calls in order
    handles: dict[str, str]  # attempt id -> state file URL (planned and unknown attempts)
    duplicates: set[str]  # planned attempts acked by two workers
    unknowns: set[str]  # attempts that are not in the plan


def _plan(n_tasks: int) -> list[TaskSpec]:
    per_op = 128
    return [
        TaskSpec(f"op-{op}", i, f"op{op}-sub{i}-att0", per_op, max_parallelism=per_op)
        for op in range(n_tasks // per_op)
        for i in range(per_op)
    ]


def _workload(
    storage: FileSystemCheckpointStorage, location: str, plan: list[TaskSpec], n_workers: int
) -> Workload:
    """Split the plan over the workers, add cross-worker duplicates and unknown attempts, cut
    each worker's share into single acks and small batches, and write every state file."""
    rng = random.Random(4242)
    planned = [t.attempt_id for t in plan]
    rng.shuffle(planned)
    unknowns = [f"ghost-{k}-att9" for k in range(max(2, n_workers // 2))]
    acks: dict[str, TaskAck] = {}
    for attempt in planned + unknowns:
        url = storage.location_for(location).file_url(f"{attempt}.state")
        data = f"state of {attempt}".encode()
        storage.path_of(url).write_bytes(data)
        acks[attempt] = TaskAck(attempt, url, len(data), checksum_of(data), sync_ms=1, async_ms=2)

    shares: list[list[str]] = [planned[w::n_workers] for w in range(n_workers)]
    # the first attempt of every worker is also acked by the next worker
    duplicates = {share[0] for share in shares}
    for w in range(n_workers):
        shares[(w + 1) % n_workers].append(shares[w][0])
    for k, ghost in enumerate(unknowns):
        shares[(k * 3) % n_workers].append(ghost)

    calls: list[list[list[TaskAck]]] = []
    for share in shares:
        rng.shuffle(share)
        mine: list[list[TaskAck]] = []
        i = 0
        while i < len(share):
            size = rng.choice(_CALL_SIZES)
            mine.append([acks[a] for a in share[i : i + size]])
            i += size
        calls.append(mine)
    return Workload(
        calls=calls,
        handles={a: ack.state_handle or "" for a, ack in acks.items()},
        duplicates=duplicates,
        unknowns=set(unknowns),
    )


def _ack_worker(
    index: int,
    url: str,
    job_id: str,
    checkpoint_id: int,
    calls: list[list[TaskAck]],
    barrier: Barrier,
    results: Any,
) -> None:
    """One process: its own metastore and coordinator (config loaded from the metastore)."""
    try:
        metastore = Metastore(url)
        coordinator = CheckpointCoordinator(job_id, metastore)
        barrier.wait(timeout=_START_TIMEOUT_S)
        records = []
        for call in calls:
            outcome = coordinator.receive_acknowledge(checkpoint_id, call)
            done = outcome.completed
            records.append(
                CallRecord(
                    worker=index,
                    attempts=tuple(a.attempt_id for a in call),
                    results={a: r.value for a, r in outcome.results.items()},
                    completed_id=done.checkpoint_id if done else None,
                    completed_handles=len(done.metadata.handles()) if done else None,
                    metadata_path=done.metadata_path if done else None,
                    deleted_handles=tuple(outcome.deleted_handles),
                )
            )
        metastore.dispose()
        results.put((index, "ok", records))
    except BaseException:
        results.put((index, "error", traceback.format_exc()))


def _run_workers(url: str, job_id: str, checkpoint_id: int, workload: Workload) -> list[CallRecord]:
    ctx = mp.get_context("spawn")
    n = len(workload.calls)
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_ack_worker,
            args=(i, url, job_id, checkpoint_id, workload.calls[i], barrier, results),
            name=f"acker-{i}",
        )
        for i in range(n)
    ]
    for p in procs:
        p.start()
    records: list[CallRecord] = []
    errors: list[str] = []
    try:
        for _ in range(n):
            index, status, payload = results.get(timeout=_RESULT_TIMEOUT_S)
            if status == "ok":
                records.extend(payload)
            else:
                errors.append(f"worker {index}:\n{payload}")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():  # pragma: no cover - only when a worker hangs
                p.kill()
    assert errors == [], "\n".join(errors)
    assert {p.exitcode for p in procs} == {0}
    return records


def _scale(url: str, tmp_path: Path, n_workers: int, n_tasks: int) -> None:
    job_id = f"scale-{uuid.uuid4().hex[:10]}"
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'checkpoints'}")
    metastore = Metastore(url)
    owner = CheckpointCoordinator(
        job_id, metastore, storage, CheckpointConfig(timeout=timedelta(hours=1))
    )
    plan = _plan(n_tasks)
    pending = owner.trigger_checkpoint(tasks=plan)
    cid = pending.checkpoint_id
    work = _workload(storage, pending.location, plan, n_workers)
    planned = {t.attempt_id for t in plan}
    sends = [a.attempt_id for calls in work.calls for call in calls for a in call]
    assert len(sends) == n_tasks + len(work.duplicates) + len(work.unknowns)

    records = _run_workers(url, job_id, cid, work)

    # every call got one result per attempt it sent
    assert sorted(a for r in records for a in r.attempts) == sorted(sends)
    for r in records:
        assert set(r.results) == set(r.attempts), r
    by_attempt: dict[str, list[str]] = defaultdict(list)
    for r in records:
        for attempt, result in r.results.items():
            by_attempt[attempt].append(result)
    totals = Counter(res for results in by_attempt.values() for res in results)
    assert totals == {
        AckResult.SUCCESS.value: n_tasks,
        AckResult.DUPLICATE.value: len(work.duplicates),
        AckResult.UNKNOWN.value: len(work.unknowns),
    }
    for attempt in planned:
        expected = ["DUPLICATE", "SUCCESS"] if attempt in work.duplicates else ["SUCCESS"]
        assert sorted(by_attempt[attempt]) == expected, attempt
    for attempt in work.unknowns:
        assert by_attempt[attempt] == ["UNKNOWN"], attempt

    # exactly one caller, in one process, completed the checkpoint
    completions = [r for r in records if r.completed_id is not None]
    assert len(completions) == 1, completions
    [done] = completions
    assert done.completed_id == cid
    assert done.completed_handles == n_tasks

    # the metastore: every planned attempt acked exactly once, with the state it sent
    with metastore.transaction() as s:
        rows = s.execute(
            select(CheckpointAck.attempt_id, CheckpointAck.state_handle).where(
                CheckpointAck.job_id == job_id, CheckpointAck.checkpoint_id == cid
            )
        ).all()
        count, distinct_count = s.execute(
            select(func.count(), func.count(distinct(CheckpointAck.attempt_id))).where(
                CheckpointAck.job_id == job_id, CheckpointAck.checkpoint_id == cid
            )
        ).one()
        row = s.get(Checkpoint, (job_id, cid))
        assert row is not None
        status, metadata_path, checksum = row.status, row.metadata_path, row.metadata_checksum
    assert (count, distinct_count) == (n_tasks, n_tasks)
    assert {a: h for a, h in rows} == {a: work.handles[a] for a in planned}
    assert status == CheckpointStatus.COMPLETED
    assert metadata_path is not None and metadata_path == done.metadata_path

    # a valid _metadata listing every task's state, each file as acked
    metadata = read_metadata(storage, metadata_path, checksum)
    handles = {h.attempt_id: h.handle for h in metadata.handles()}
    assert handles == {a: work.handles[a] for a in planned}
    verify_handles(storage, metadata)

    # rejected state may be cleaned up (only that of unknown attempts: whether it is depends on
    # whether the checkpoint was still pending, which is up to the race), acked state never is
    deleted = [h for r in records for h in r.deleted_handles]
    assert len(deleted) == len(set(deleted))
    assert set(deleted) <= {work.handles[a] for a in work.unknowns}
    assert not any(storage.exists(h) for h in deleted)
    metastore.dispose()


@pytest.mark.postgres
@pytest.mark.usefixtures("storage")  # its storage a root: the ackers join without one
def test_32_processes_ack_one_1024_task_checkpoint_on_postgresql(
    pg_url: str, tmp_path: Path
) -> None:
    _scale(pg_url, tmp_path, n_workers=32, n_tasks=1024)


@pytest.mark.usefixtures("storage")  # its storage a root: the ackers join without one
def test_8_processes_ack_one_256_task_checkpoint_on_sqlite_without_lock_errors(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'metastore.db'}"
    Metastore(url, check_schema=False).upgrade()
    _scale(url, tmp_path, n_workers=8, n_tasks=256)


def _race_batches(
    url: str, job_id: str, checkpoint_id: int, batches: list[list[TaskAck]]
) -> list[AckOutcome]:
    """Each batch from its own coordinator (own engine) in its own thread, released at once."""
    ackers = [CheckpointCoordinator(job_id, Metastore(url)) for _ in batches]
    barrier = threading.Barrier(len(batches))
    outcomes: list[AckOutcome] = []
    errors: list[BaseException] = []

    def run(coord: CheckpointCoordinator, batch: list[TaskAck]) -> None:
        barrier.wait()
        try:
            outcomes.append(coord.receive_acknowledge(checkpoint_id, batch))
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=(c, b)) for c, b in zip(ackers, batches, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in ackers:
        c.metastore.dispose()
    assert errors == []
    return outcomes


@pytest.mark.usefixtures("storage")  # its storage a root: the ackers join without one
def test_overlapping_batches_in_any_order_never_deadlock(
    metastore_url: str, tmp_path: Path
) -> None:
    """Several ackers send batches covering the same attempts in different orders at once (a
    retried batch racing its original, say): no deadlock, each ack recorded exactly once."""
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'checkpoints'}")
    metastore = Metastore(metastore_url)
    job_id = f"overlap-{uuid.uuid4().hex[:8]}"
    owner = CheckpointCoordinator(
        job_id, metastore, storage, CheckpointConfig(timeout=timedelta(hours=1))
    )
    plan = _plan(128)
    rng = random.Random(7)
    for _round in range(3):
        pending = owner.trigger_checkpoint(tasks=plan)
        batches = [rng.sample([TaskAck(t.attempt_id) for t in plan], len(plan)) for _ in range(6)]

        outcomes = _race_batches(metastore_url, job_id, pending.checkpoint_id, batches)

        successes = Counter(
            a for o in outcomes for a, r in o.results.items() if r is AckResult.SUCCESS
        )
        assert successes == Counter(t.attempt_id for t in plan)
        assert len([o for o in outcomes if o.completed is not None]) == 1
    metastore.dispose()
