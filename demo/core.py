"""``python -m demo --core``: a real end-to-end checkpoint cycle of the core on embedded defaults,
without Spark (``make demo`` runs the Spark example pipeline, :mod:`demo.airflow_demo`).

A simulated job (a source of 2 subtasks and an aggregation of 4) runs epochs; at each epoch
boundary it looks in the metastore for triggered checkpoints (the barrier), writes every task's
snapshot to checkpoint storage from a thread pool and acknowledges them in one batch per operator.
The coordinator runs in its background thread with periodic triggers, exactly as a real job's
would. Along the way: a savepoint requested from "outside" (as the UI will), a checkpoint declined
by a task, a failover, a corrupt newest checkpoint, and the restore lookup falling back past it.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from functools import partial

from rich.console import Console
from rich.text import Text
from sqlalchemy import delete, select

from checkpointing.cli.render import checkpoints_table
from checkpointing.config import CheckpointConfig, Settings
from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.pending import TaskAck, TaskSpec
from checkpointing.coordination.store import CompletedCheckpoint
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint, Job
from checkpointing.metastore.views import list_checkpoints, list_restores
from checkpointing.restore import lookup as restore
from checkpointing.state.storage import CheckpointStorage
from checkpointing.status import CheckpointStatus, CheckpointType, JobStatus

OPERATORS = {"source": 2, "aggregate": 4}
MAX_PARALLELISM = 128
EPOCH = timedelta(milliseconds=120)


def _plan(attempt: int) -> list[TaskSpec]:
    return [
        TaskSpec(op, i, f"a{attempt}-{op}-{i}", p, MAX_PARALLELISM)
        for op, p in OPERATORS.items()
        for i in range(p)
    ]


class SimulatedJob:
    """Stands in for a Spark job: epochs, barriers, snapshots, acks — fast and Spark-free."""

    def __init__(self, coordinator: CheckpointCoordinator, plan: list[TaskSpec]) -> None:
        self.coordinator = coordinator
        self.plan = plan
        self.epoch = 0
        self.snapshotted: set[int] = set()
        self.decline_next = False
        self.pool = ThreadPoolExecutor(max_workers=4)

    def snapshot(self, checkpoint_id: int, location_url: str, task: TaskSpec) -> TaskAck:
        start = time.perf_counter()
        state = {"operator": task.operator_id, "subtask": task.subtask_index, "epoch": self.epoch}
        data = json.dumps(state).encode() * 64
        sync_ms = int((time.perf_counter() - start) * 1000)
        location = self.coordinator.storage.location_for(location_url)
        info = self.coordinator.storage.write_bytes(
            location.file_url(f"{task.operator_id}-{task.subtask_index}.state"), data
        )
        async_ms = int((time.perf_counter() - start) * 1000) - sync_ms
        return TaskAck(task.attempt_id, info.url, info.size, info.checksum, sync_ms, async_ms)

    def run_epoch(self) -> None:
        time.sleep(EPOCH.total_seconds())  # "process" the epoch's input
        self.epoch += 1
        with self.coordinator.metastore.transaction() as s:
            barriers = s.execute(
                select(Checkpoint.checkpoint_id, Checkpoint.storage_location).where(
                    Checkpoint.job_id == self.coordinator.job_id,
                    Checkpoint.status == CheckpointStatus.PENDING,
                )
            ).all()
        for checkpoint_id, location in barriers:
            if checkpoint_id in self.snapshotted:
                continue
            self.snapshotted.add(checkpoint_id)
            if self.decline_next:
                self.decline_next = False
                task = self.plan[-1]
                self.coordinator.receive_decline(
                    checkpoint_id, task.attempt_id, "disk full (simulated)"
                )
                continue
            for op in OPERATORS:
                tasks = [t for t in self.plan if t.operator_id == op]
                acks = list(self.pool.map(partial(self.snapshot, checkpoint_id, location), tasks))
                self.coordinator.receive_acknowledge(checkpoint_id, acks)  # one batch per stage


def _count(
    metastore: Metastore, job_id: str, status: CheckpointStatus, ctype: str | None = None
) -> int:
    with metastore.transaction() as s:
        q = select(Checkpoint.checkpoint_id).where(
            Checkpoint.job_id == job_id, Checkpoint.status == status
        )
        if ctype:
            q = q.where(Checkpoint.checkpoint_type == ctype)
        return len(s.scalars(q).all())


def _run_until(job: SimulatedJob, done: callable, limit: int = 200) -> None:  # type: ignore[valid-type]
    for _ in range(limit):
        job.run_epoch()
        if done():
            return
    raise RuntimeError("demo did not reach its next step; see the log")


def _step(number: str, text: str) -> Text:
    """``number`` in bold, then ``text`` as it is."""
    return Text.assemble((number, "bold"), " ", text)


def run_demo(settings: Settings, job_id: str, console: Console) -> None:
    """The cycle, printed as it goes on ``console`` (markup off: every value prints as text)."""
    console.print(_step("metastore", settings.display_metastore_url))
    console.print(_step("storage  ", settings.storage_url))
    metastore = Metastore(settings.metastore_url, check_schema=False)
    metastore.upgrade()
    storage = CheckpointStorage.from_url(settings.storage_url)
    with metastore.transaction() as s:  # each demo run starts afresh
        s.execute(delete(Job).where(Job.job_id == job_id))
    storage.delete_tree(storage.job_url(job_id))

    config = CheckpointConfig.parse(
        {
            "interval": "300ms",
            "min_pause": "100ms",
            "timeout": "10s",
            "retained": 2,
            "tolerable_failures": 2,
            "retention": "retain_on_failure",
        }
    )
    commits: list[int] = []

    def commit_sink(c: CompletedCheckpoint) -> None:
        commits.append(c.checkpoint_id)  # a real sink publishes the checkpoint's staged output

    plan = _plan(attempt=1)
    coordinator = CheckpointCoordinator(
        job_id,
        metastore,
        storage,
        config,
        plan_provider=lambda: plan,
        completion_listeners=[commit_sink],
    )
    job = SimulatedJob(coordinator, plan)
    console.print()
    console.print(_step("1.", f"job {job_id} RUNNING: periodic checkpoints every 300ms (retain 2)"))
    coordinator.job_status_changed(JobStatus.RUNNING)
    coordinator.run_in_background(timedelta(milliseconds=50))
    try:
        _run_until(
            job,
            lambda: (
                _count(metastore, job_id, CheckpointStatus.COMPLETED)
                + _count(metastore, job_id, CheckpointStatus.SUBSUMED)
                >= 4
            ),
        )

        console.print(_step("2.", "a savepoint requested from outside the job (as the UI does)"))
        outsider = CheckpointCoordinator(job_id, metastore)  # another process's view of the job
        outsider.request(CheckpointType.SAVEPOINT, requested_by="demo-user")
        _run_until(
            job, lambda: _count(metastore, job_id, CheckpointStatus.COMPLETED, "SAVEPOINT") >= 1
        )

        console.print(_step("3.", "a task declines the next checkpoint"))
        job.decline_next = True
        _run_until(job, lambda: _count(metastore, job_id, CheckpointStatus.ABORTED) >= 1)
        before = _count(metastore, job_id, CheckpointStatus.COMPLETED, "CHECKPOINT") + _count(
            metastore, job_id, CheckpointStatus.SUBSUMED
        )
        _run_until(
            job,
            lambda: (
                _count(metastore, job_id, CheckpointStatus.COMPLETED, "CHECKPOINT")
                + _count(metastore, job_id, CheckpointStatus.SUBSUMED)
                > before
            ),
        )
    finally:
        coordinator.stop_background()

    console.print(_step("4.", "the job fails: pending checkpoints are aborted (failover)"))
    coordinator.failover("demo: worker lost")

    latest = list_checkpoints(
        metastore, job_id, status="COMPLETED", checkpoint_type="CHECKPOINT", limit=1
    )[0]
    files = storage.list_files(latest["storage_location"])
    victim = next(f for f in files if f.endswith(".state"))
    console.print(
        _step("5.", f"corrupting checkpoint {latest['checkpoint_id']}: flipping a byte of {victim}")
    )
    data = bytearray(storage.read_bytes(victim))
    data[0] ^= 0xFF
    storage.write_bytes(victim, bytes(data))

    console.print(_step("6.", "restore lookup for the retry (attempt 2, parallelism 3)"))
    decision = restore.find_latest_valid(metastore, storage, job_id, prefer_checkpoint=True)
    restore.record_restore(metastore, decision, attempt="attempt-2", parallelism=3)
    coordinator.shutdown(JobStatus.FAILED)  # retain_on_failure: checkpoints are kept

    console.print()
    console.print(
        checkpoints_table(list_checkpoints(metastore, job_id), f"Checkpoint history of {job_id}")
    )
    for r in list_restores(metastore, job_id):
        console.print(_step("restore", f"#{r['restore_id']} for {r['attempt']}: {r['message']}"))
    console.print(_step("commits", f"run by completion notifications: {commits}"))
    if decision.start_empty or not decision.skipped:
        raise RuntimeError("demo expected a fallback past the corrupt checkpoint")
    console.print(
        Text.assemble(
            "\n",
            ("ok", "green"),
            f": restored from {decision.checkpoint_type} {decision.checkpoint_id}, "
            f"skipping corrupt checkpoint {decision.skipped[0].checkpoint_id}.\n"
            f"Try: ckpt list {job_id} | ckpt show {job_id} {decision.checkpoint_id} | "
            f"ckpt restores {job_id}",
        )
    )
