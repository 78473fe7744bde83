"""Ack throughput and last-ack -> COMPLETED latency of the checkpoint coordinator.

Run by ``make bench`` (never by the tests)::

    python bench/ack_bench.py [--quick] [--backend sqlite|postgresql ...]

For each backend a throwaway metastore is created and migrated (SQLite: a file in a temporary
directory; PostgreSQL: a fresh database created through the admin connection, dropped after), and
three figures are measured against 1,024-task checkpoints:

* **batched**: one client acks each checkpoint in batches of ``--batch`` acks; acks per second
  over the batches that do not complete the checkpoint (the completing batch is reported apart,
  and end to end including completion);
* **single**: ``--writers`` processes (spawned) ack one task per call (one transaction per ack)
  concurrently; acks per second over the wall time from the common start to the last return;
* **completion**: 1,023 tasks acked, then the time of the final single-ack call, which returns
  only after the checkpoint row is COMPLETED (``_metadata`` written); median and p95.

Results go to ``bench/results/acks.json`` (figures, machine info, targets) and a summary table
is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from importlib import metadata as importlib_metadata
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import make_url

from checkpointing.config import CheckpointConfig
from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.pending import AckResult, TaskAck, TaskSpec
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint, CheckpointAck
from checkpointing.state.storage import FileSystemCheckpointStorage
from checkpointing.status import CheckpointStatus

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/'s modules, beside this file
from machine import loadavg
from machine import machine_info as host_info

BACKENDS = ("sqlite", "postgresql")
DEFAULT_PG_ADMIN_URL = "postgresql+psycopg://127.0.0.1:5432/test"
RESULTS = Path(__file__).resolve().parent / "results" / "acks.json"

#: what the PostgreSQL metastore must sustain (SQLite figures are informational)
TARGETS: dict[str, Any] = {
    "backend": "postgresql",
    "batched_acks_per_s_min": 20_000,
    "single_acks_per_s_min": 1_000,
    "completion_ms_max": 250,
    "completion_statistic": "p95",
}

console = Console()


# ============================================================================ setup


@dataclass(frozen=True)
class Settings:
    quick: bool
    tasks: int
    batch: int
    writers: int
    batched_rounds: int
    single_rounds: int
    completion_runs: int


def make_settings(args: argparse.Namespace) -> Settings:
    quick = bool(args.quick)
    return Settings(
        quick=quick,
        tasks=args.tasks,
        batch=args.batch,
        writers=args.writers,
        batched_rounds=args.rounds or (3 if quick else 10),
        single_rounds=args.rounds or (1 if quick else 3),
        completion_runs=args.runs or (5 if quick else 20),
    )


def make_plan(n: int, tag: str) -> list[TaskSpec]:
    """``n`` tasks: operators of up to 128 subtasks each."""
    per_op = min(n, 128)
    ops = math.ceil(n / per_op)
    plan: list[TaskSpec] = []
    for op in range(ops):
        parallelism = min(per_op, n - op * per_op)
        plan += [
            TaskSpec(f"op-{op}", i, f"{tag}-op{op}-{i}", parallelism, max(128, parallelism))
            for i in range(parallelism)
        ]
    return plan


def ack_for(location: str, attempt_id: str) -> TaskAck:
    return TaskAck(
        attempt_id,
        state_handle=f"{location}/{attempt_id}.state",
        state_size=4096,
        checksum="sha256:" + "0" * 64,
        sync_ms=1,
        async_ms=3,
    )


@contextmanager
def throwaway_metastore(backend: str, workdir: Path, pg_admin_url: str) -> Iterator[str]:
    """Create and migrate an empty metastore; remove it afterwards."""
    if backend == "sqlite":
        url = f"sqlite:///{workdir / 'bench-metastore.db'}"
        Metastore(url, check_schema=False).upgrade()
        yield url
        return
    admin_url = make_url(pg_admin_url)
    name = f"ckpt_bench_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = admin_url.set(database=name).render_as_string(hide_password=False)
    try:
        store = Metastore(url, check_schema=False)
        store.upgrade()
        store.dispose()
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def new_job(url: str, workdir: Path, job_id: str) -> tuple[Metastore, CheckpointCoordinator]:
    store = Metastore(url)
    storage = FileSystemCheckpointStorage(f"file://{workdir / 'checkpoints'}")
    config = CheckpointConfig(timeout=timedelta(hours=1), retained=1)
    return store, CheckpointCoordinator(job_id, store, storage, config)


def trigger(coord: CheckpointCoordinator, plan: Sequence[TaskSpec]) -> tuple[int, str]:
    pending = coord.trigger_checkpoint(tasks=plan)
    return pending.checkpoint_id, pending.location


def status_of(store: Metastore, job_id: str, checkpoint_id: int) -> tuple[str, int]:
    with store.transaction() as s:
        status = s.scalar(
            select(Checkpoint.status).where(
                Checkpoint.job_id == job_id, Checkpoint.checkpoint_id == checkpoint_id
            )
        )
        acked = s.scalar(
            select(func.count()).where(
                CheckpointAck.job_id == job_id, CheckpointAck.checkpoint_id == checkpoint_id
            )
        )
    return str(status), int(acked or 0)


def chunks(items: Sequence[TaskAck], size: int) -> list[Sequence[TaskAck]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (no interpolation: a reported p95 is a measured value)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def summary(values: Sequence[float]) -> dict[str, float]:
    return {
        "min": min(values),
        "median": statistics.median(values),
        "p95": percentile(values, 95),
        "max": max(values),
    }


# ============================================================================ (a) batched


def bench_batched(url: str, workdir: Path, s: Settings) -> dict[str, Any]:
    job_id = f"bench-batched-{uuid.uuid4().hex[:8]}"
    store, coord = new_job(url, workdir, job_id)
    non_final_acks, non_final_s, end_to_end_s, final_s = 0, 0.0, [], []
    try:
        for r in range(s.batched_rounds):
            plan = make_plan(s.tasks, f"b{r}")
            cid, location = trigger(coord, plan)
            batches = chunks([ack_for(location, t.attempt_id) for t in plan], s.batch)
            start = time.perf_counter()
            for i, batch in enumerate(batches):
                t0 = time.perf_counter()
                outcome = coord.receive_acknowledge(cid, batch)
                took = time.perf_counter() - t0
                if list(outcome.results.values()).count(AckResult.SUCCESS) != len(batch):
                    raise RuntimeError(f"batched: unexpected results {outcome.results}")
                if i < len(batches) - 1:
                    non_final_acks += len(batch)
                    non_final_s += took
                else:
                    final_s.append(took)
                    if outcome.completed is None:
                        raise RuntimeError(f"batched: checkpoint {cid} not completed")
            end_to_end_s.append(time.perf_counter() - start)
            if status_of(store, job_id, cid) != (CheckpointStatus.COMPLETED, s.tasks):
                raise RuntimeError(f"batched: checkpoint {cid} not COMPLETED with all acks")
    finally:
        store.dispose()
    total_acks = s.tasks * s.batched_rounds
    return {
        "acks_per_s": non_final_acks / non_final_s,
        "acks_per_s_incl_completion": total_acks / sum(end_to_end_s),
        "batch_size": s.batch,
        "checkpoints": s.batched_rounds,
        "acks": total_acks,
        "completing_batch_ms": summary([x * 1000 for x in final_s]),
        "checkpoint_end_to_end_ms": summary([x * 1000 for x in end_to_end_s]),
    }


# ============================================================================ (b) single


def _single_writer(
    url: str, job_id: str, barrier: Barrier, inbox: Any, outbox: Any, index: int
) -> None:
    """A writer process: its own metastore and coordinator; acks one task per call."""
    try:
        store = Metastore(url)
        coord = CheckpointCoordinator(job_id, store)
    except Exception:
        outbox.put((index, "error", traceback.format_exc()))
        return
    outbox.put((index, "ready", None))
    while (cmd := inbox.get()) is not None:
        checkpoint_id, acks = cmd
        try:
            barrier.wait(timeout=120)
            success, completed = 0, 0
            start, cpu = time.monotonic(), time.process_time()
            for ack in acks:
                outcome = coord.receive_acknowledge(checkpoint_id, [ack])
                success += outcome.results[ack.attempt_id] is AckResult.SUCCESS
                completed += outcome.completed is not None
            end, cpu = time.monotonic(), time.process_time() - cpu
            outbox.put((index, "done", (start, end, cpu, success, completed)))
        except Exception:
            outbox.put((index, "error", traceback.format_exc()))
    store.dispose()


def bench_single(url: str, workdir: Path, s: Settings) -> dict[str, Any]:
    job_id = f"bench-single-{uuid.uuid4().hex[:8]}"
    store, coord = new_job(url, workdir, job_id)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(s.writers)
    outbox = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(s.writers)]
    procs = [
        ctx.Process(
            target=_single_writer,
            args=(url, job_id, barrier, inboxes[i], outbox, i),
            name=f"ack-writer-{i}",
        )
        for i in range(s.writers)
    ]
    for p in procs:
        p.start()
    rates: list[float] = []
    client_cpu_ms: list[float] = []
    try:
        _collect(outbox, s.writers, "ready")
        for r in range(s.single_rounds):
            plan = make_plan(s.tasks, f"s{r}")
            cid, location = trigger(coord, plan)
            acks = [ack_for(location, t.attempt_id) for t in plan]
            for i, inbox in enumerate(inboxes):
                inbox.put((cid, acks[i :: s.writers]))
            done = _collect(outbox, s.writers, "done")
            starts, ends, cpu, success, completed = zip(*done, strict=True)
            if sum(success) != s.tasks or sum(completed) != 1:
                raise RuntimeError(
                    f"single: {sum(success)} SUCCESS, {sum(completed)} completions "
                    f"(expected {s.tasks} and 1)"
                )
            if status_of(store, job_id, cid) != (CheckpointStatus.COMPLETED, s.tasks):
                raise RuntimeError(f"single: checkpoint {cid} not COMPLETED with all acks")
            rates.append(s.tasks / (max(ends) - min(starts)))
            client_cpu_ms.append(sum(cpu) / s.tasks * 1000)
    finally:
        for inbox in inboxes:
            inbox.put(None)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
        store.dispose()
    return {
        "acks_per_s": statistics.median(rates),
        "acks_per_s_per_round": rates,
        "client_cpu_ms_per_ack": statistics.median(client_cpu_ms),
        "writers": s.writers,
        "checkpoints": s.single_rounds,
        "acks": s.tasks * s.single_rounds,
    }


def _collect(outbox: Any, n: int, kind: str) -> list[Any]:
    got: dict[int, Any] = {}
    while len(got) < n:
        index, what, payload = outbox.get(timeout=300)
        if what == "error":
            raise RuntimeError(f"writer {index} failed:\n{payload}")
        if what != kind:
            raise RuntimeError(f"writer {index}: expected {kind}, got {what}")
        got[index] = payload
    return [got[i] for i in range(n)]


# ============================================================================ (c) completion


def bench_completion(url: str, workdir: Path, s: Settings) -> dict[str, Any]:
    job_id = f"bench-complete-{uuid.uuid4().hex[:8]}"
    store, coord = new_job(url, workdir, job_id)
    latencies: list[float] = []
    try:
        for r in range(s.completion_runs):
            plan = make_plan(s.tasks, f"c{r}")
            cid, location = trigger(coord, plan)
            acks = [ack_for(location, t.attempt_id) for t in plan]
            *first, last = acks
            for batch in chunks(first, s.batch):
                coord.receive_acknowledge(cid, batch)
            t0 = time.perf_counter()
            outcome = coord.receive_acknowledge(cid, [last])
            took = time.perf_counter() - t0
            if outcome.completed is None:
                raise RuntimeError(f"completion: checkpoint {cid} was not completed by last ack")
            if status_of(store, job_id, cid) != (CheckpointStatus.COMPLETED, s.tasks):
                raise RuntimeError(f"completion: checkpoint {cid} is not COMPLETED")
            latencies.append(took * 1000)
    finally:
        store.dispose()
    return {"ms": summary(latencies), "runs": len(latencies), "samples_ms": latencies}


# ============================================================================ report


def machine_info(pg_admin_url: str | None) -> dict[str, Any]:
    info: dict[str, Any] = {
        **host_info(),  # git_dirty: the measured code differs from the commit
        "sqlite": sqlite3.sqlite_version,
        "packages": {
            p: importlib_metadata.version(p) for p in ("sqlalchemy", "psycopg", "alembic")
        },
    }
    if pg_admin_url:
        try:
            engine = create_engine(make_url(pg_admin_url))
            with engine.connect() as conn:
                info["postgresql"] = conn.execute(text("SHOW server_version")).scalar_one()
                info["postgresql_synchronous_commit"] = conn.execute(
                    text("SHOW synchronous_commit")
                ).scalar_one()
            engine.dispose()
        except Exception as exc:
            info["postgresql"] = f"unavailable: {exc}"
    return info


def verdicts(results: dict[str, Any]) -> dict[str, bool] | None:
    pg = results.get("postgresql")
    if not pg:
        return None
    return {
        "batched": pg["batched"]["acks_per_s"] >= TARGETS["batched_acks_per_s_min"],
        "single": pg["single"]["acks_per_s"] >= TARGETS["single_acks_per_s_min"],
        "completion": pg["completion"]["ms"]["p95"] <= TARGETS["completion_ms_max"],
    }


def print_summary(report: dict[str, Any]) -> None:
    results = report["results"]
    backends = [b for b in BACKENDS if b in results]
    s = report["settings"]
    table = Table(
        title=f"Checkpoint acks: {s['tasks']}-task checkpoints"
        + (" (quick)" if s["quick"] else ""),
    )
    table.add_column("metric")
    for b in backends:
        table.add_column(b, justify="right")
    table.add_column("PG target", justify="right")
    table.add_column("PG", justify="center")
    ok = report.get("meets_targets") or {}

    def mark(key: str) -> str:
        if key not in ok:
            return ""
        return "[green]pass[/green]" if ok[key] else "[red]MISS[/red]"

    def row(label: str, values: list[str], target: str = "", key: str = "") -> None:
        table.add_row(label, *values, target, mark(key))

    row(
        f"batched acks/s (batches of {s['batch']})",
        [f"{results[b]['batched']['acks_per_s']:,.0f}" for b in backends],
        f">= {TARGETS['batched_acks_per_s_min']:,}",
        "batched",
    )
    row(
        "  incl. completing batch",
        [f"{results[b]['batched']['acks_per_s_incl_completion']:,.0f}" for b in backends],
    )
    row(
        f"single acks/s ({s['writers']} processes)",
        [f"{results[b]['single']['acks_per_s']:,.0f}" for b in backends],
        f">= {TARGETS['single_acks_per_s_min']:,}",
        "single",
    )
    sweeps = sorted({w for b in backends for w in results[b]["single"].get("sweep", {})}, key=int)
    for w in sweeps:
        row(
            f"  single acks/s ({w} processes)",
            [
                f"{results[b]['single']['sweep'][w]['acks_per_s']:,.0f}"
                if w in results[b]["single"].get("sweep", {})
                else ""
                for b in backends
            ],
        )
    row(
        "last ack -> COMPLETED median (ms)",
        [f"{results[b]['completion']['ms']['median']:.1f}" for b in backends],
    )
    row(
        "last ack -> COMPLETED p95 (ms)",
        [f"{results[b]['completion']['ms']['p95']:.1f}" for b in backends],
        f"<= {TARGETS['completion_ms_max']}",
        "completion",
    )
    console.print(table)
    m = report["machine"]
    console.print(
        f"[dim]{m['cpu_count']} CPUs ({m['cpu_model']}), Python {m['python']}, "
        f"SQLite {m['sqlite']}, PostgreSQL {m.get('postgresql', 'n/a')}; "
        f"load {m['loadavg_1m_before']} -> {m['loadavg_1m_after']}[/dim]"
    )


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


# ============================================================================ main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a short run (fewer rounds)")
    parser.add_argument(
        "--backend",
        action="append",
        choices=BACKENDS,
        help="backend to measure (repeatable; default: both)",
    )
    parser.add_argument(
        "--pg-admin-url",
        default=os.environ.get("CKPT_BENCH_PG_URL")
        or os.environ.get("CKPT_TEST_PG_URL")
        or DEFAULT_PG_ADMIN_URL,
        help="PostgreSQL database used to create and drop the throwaway bench database",
    )
    parser.add_argument("--tasks", type=int, default=1024, help="tasks per checkpoint")
    parser.add_argument("--batch", type=int, default=256, help="acks per batched call")
    parser.add_argument("--writers", type=int, default=16, help="single-ack writer processes")
    parser.add_argument(
        "--sweep-writers",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[],
        metavar="N,N,...",
        help="also measure single acks with these writer counts (informational)",
    )
    parser.add_argument("--rounds", type=int, help="checkpoints per throughput figure")
    parser.add_argument("--runs", type=int, help="completion-latency runs")
    parser.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    settings = make_settings(args)
    backends = args.backend or list(BACKENDS)
    results: dict[str, Any] = {}
    started = datetime.now(UTC)
    load_before = loadavg()
    for backend in backends:
        workdir = Path(tempfile.mkdtemp(prefix=f"ckpt-bench-{backend}-"))
        try:
            with throwaway_metastore(backend, workdir, args.pg_admin_url) as url:
                console.print(f"[bold]{backend}[/bold]: batched acks ...")
                batched = bench_batched(url, workdir, settings)
                console.print(f"[bold]{backend}[/bold]: {settings.writers} single-ack writers ...")
                single = bench_single(url, workdir, settings)
                sweep = {}
                for writers in args.sweep_writers:
                    console.print(f"[bold]{backend}[/bold]: {writers} single-ack writers ...")
                    sweep[str(writers)] = bench_single(
                        url, workdir, replace(settings, writers=writers)
                    )
                if sweep:
                    single["sweep"] = sweep
                console.print(f"[bold]{backend}[/bold]: last ack -> COMPLETED latency ...")
                completion = bench_completion(url, workdir, settings)
            results[backend] = {"batched": batched, "single": single, "completion": completion}
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    report: dict[str, Any] = {
        "benchmark": "acks",
        "generated_at": started.isoformat(),
        "duration_s": round((datetime.now(UTC) - started).total_seconds(), 1),
        "settings": {
            "quick": settings.quick,
            "tasks": settings.tasks,
            "batch": settings.batch,
            "writers": settings.writers,
            "batched_rounds": settings.batched_rounds,
            "single_rounds": settings.single_rounds,
            "completion_runs": settings.completion_runs,
        },
        "machine": {
            **machine_info(args.pg_admin_url if "postgresql" in backends else None),
            # other work on the machine skews the figures: the 1-minute load around the run
            "loadavg_1m_before": load_before,
            "loadavg_1m_after": loadavg(),
        },
        "targets": TARGETS,
        "results": results,
        "meets_targets": verdicts(results),
    }
    write_report(report, args.output)
    print_summary(report)
    console.print(f"results written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
