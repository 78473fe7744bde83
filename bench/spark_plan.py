"""The measurement plan of ``bench/spark_bench.py``'s main figures: which variants run, in which
order, from which state.

Each round runs every full-run variant once, in an order rotated by the round (to spread drift
over the variants), then a crash run and restores at the same and other parallelisms (rotated)
from identical copies of the crashed state. Variants:

* ``plain``: W, the plain Spark batch job over the same files (``plain_job``), a whole process as
  a user starts it — the anchor every other variant is reported against (issue 23).
* ``design``: the hand-written design (``design_job``, issue 37), the second anchor: plain
  PySpark committing each epoch's partial aggregates (sorted by key group) and merging them at
  the end, a whole process as W.
* ``off``: our runtime with no periodic checkpoints (``every_epochs`` and ``interval`` unset).
  The runtime still takes one forced checkpoint at the end, whose completion commits the sink's
  staged epochs — the minimum for its exactly-once output, so "off" means "only that one".
* ``every``: our runtime, a checkpoint at every epoch boundary (``every_epochs: 1``), incremental
  (the spec's default, ``checkpoint.incremental: true``).
* ``every-cli``: ``every``'s spec run by ``ckpt run``, a whole process as a user starts it
  (``spark_process``): the command's imports, preflight and progress included.
* ``every-full``: ``every`` with ``checkpoint.incremental: false``: every checkpoint is full.
* ``every-tenth``: ``every`` with epochs planned by work, ``source.epoch_bytes`` = a tenth of the
  input (x 1.1, so whole files pack): 10 epochs, a checkpoint after each, the issue's goal
  ("a checkpoint at least every 10 % of the input") at its cheapest.
* ``every-changelog``: ``every`` with ``sink.changelog: true``: each epoch's changed rows staged
  and committed (the state merged every epoch), like the streaming peer's per-batch output.
  Every other variant of ours publishes only the final table (``changelog: false``), as W does.
* ``every-delta``: ``every`` writing a Delta table (``format: delta``, ``mode: upsert``, local)
  instead of the Parquet sink: with ``every``, the sinks' cost per checkpoint (``sink_cost``).
* ``peer-changelog``: Spark Structured Streaming at its best here — ``readStream`` of the same
  Parquet files (schema given), ``maxFilesPerTrigger`` = files per epoch, the same aggregation,
  RocksDB state store with changelog checkpointing
  (``spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled=true``),
  ``trigger(availableNow=True)``, a fresh ``checkpointLocation``, update output mode written per
  micro-batch to Parquet by ``foreachBatch`` (the closest to our changelog sink).
* ``peer-rocksdb``: the same with changelog checkpointing off (RocksDB snapshots every batch).
* ``warm-restart``: ``every`` whose epoch after 80 % of the epochs fails in a Spark task (the
  driver alive): the run restores its latest checkpoint in the same application (``restarts``)
  and runs to the end — the total time with one task failure, as one process.
* ``crash``: ``every`` killed (``SimulatedCrash``) after 80 % of the epochs; its metastore,
  checkpoint storage and sink are moved aside.
* ``restore-p<N>``: from an identical copy of that crashed state, restart with ``--restore latest``
  at parallelism N and run to the end. The same parallelism is the recovery figure; others are
  rescaled restores.

The size sweep (``--sizes``) runs ``SWEEP_RUNS`` (W, ``off``, ``every``, the streaming peer with
changelog checkpointing), the crash and the same-parallelism restore at each further size, the
same rounds. A run that fails (e.g. a JVM out of memory at a size it cannot handle) is recorded
with its log's tail (``failed``) and the measurement goes on.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from machine import (
    BUSY_LIMIT,
    cpu_busy,
    java_pids,
    load_flags,
    loadavg,
    other_spark_jvms,
)
from rich.console import Console
from spark_process import run_process
from spark_workers import run_worker
from spark_workload import Settings

console = Console()
if not console.is_terminal:  # a log file or pipe: wide enough for the summary tables
    console.width = 150

OURS = {"fresh": True, "parallelism": None}
#: full-run variant -> its task
FULL_RUNS: dict[str, dict[str, Any]] = {
    "plain": {"process": "plain"},
    "design": {"process": "design"},
    "off": {**OURS, "every_epochs": False},
    "every": {**OURS, "every_epochs": True},
    "every-cli": {"process": "cli", "every_epochs": True},
    "every-full": {**OURS, "every_epochs": True, "incremental": False},
    "every-changelog": {**OURS, "every_epochs": True, "sink_changelog": True},
    "every-tenth": {**OURS, "every_epochs": True, "epoch_fraction": 10},
    "every-delta": {**OURS, "every_epochs": True, "delta": True},
    "peer-changelog": {"peer": True, "changelog": True},
    "peer-rocksdb": {"peer": True, "changelog": False},
}
PEERS = ("peer-changelog", "peer-rocksdb")
#: the anchor (issue 23)
PLAIN = "plain"
#: the size sweep's full runs: the plot's lines (the crash and a restore are added)
SWEEP_RUNS = (PLAIN, "off", "every", "every-tenth", "peer-changelog")
WARM, CRASH = "warm-restart", "crash"
#: the runs after the full runs of a round: a warm restart; a crash and the restores from it
EXTRA_RUNS = (WARM, CRASH)


def rotated(items: Sequence[str], by: int) -> list[str]:
    k = by % len(items)
    return [*items[k:], *items[:k]]


class Runner:
    """Runs workers one after another, numbering them and noting the machine's load."""

    def __init__(self, s: Settings, work: Path, total: int, settle_s: float = 0.0) -> None:
        self.s, self.work, self.total, self.settle_s = s, work, total, settle_s
        self.runs: list[dict[str, Any]] = []

    def one(self, variant: str, round_no: int, task: dict[str, Any], tag: str = "") -> dict:
        """One run, recorded; a failed run is recorded as ``failed`` with its log's tail (a
        size may be beyond what a variant survives: the others are still measured)."""
        n = len(self.runs) + 1
        settled, busy = settle(self.settle_s)
        load, others, java = loadavg(), other_spark_jvms(), len(java_pids())
        console.print(
            f"[{n}/{self.total}] {tag or f'round {round_no + 1}'}: [bold]{variant}[/bold] "
            f"(busy {busy if busy is None else f'{busy:.0%}'}, load {load}, other Spark JVMs "
            f"{others}, JVMs {java}) ...",
            end=" ",
        )
        log = self.work / f"{n:03d}-{variant}.log"
        run = run_process if task.get("process") else run_worker
        try:
            result = run({**task, "variant": variant}, log, self.s.driver_memory)
        except RuntimeError as exc:
            tail = str(exc).splitlines()
            result = {"failed": True, "error": tail[-40:], "cause": failure_cause(tail)}
            console.print(f"[red]failed: {result['cause']}[/red] (log {log})")
        # the machine's load: before (between our runs, every JVM is someone else's), during
        # (run_process's Watch: JVMs outside the run's tree) and after the run
        result.update(
            round=round_no,
            variant=variant,
            cpu_busy_before=busy,
            loadavg_1m=load,
            loadavg_1m_end=loadavg(),
            other_spark_jvms=others,
            other_java_start=java,
            # the run's own JVM may still be exiting: not someone else's
            other_java_end=len(java_pids() - set(result.get("own_java_pids") or ())),
            settled_s=settled,
        )
        result["load_flags"] = load_flags(result)
        result["data_dir"] = task.get("data")
        if result.get("run_s") is not None and result.get("session_s") is not None:
            result["with_session_s"] = round(result["run_s"] + result["session_s"], 3)
        self.runs.append(result)
        if not result.get("failed"):
            run_s = result.get("run_s")
            console.print(
                f"{result['process_s']:.1f} s whole process"
                + (f", {run_s:.1f} s run" if run_s is not None else "")
            )
        return result


def settle(max_s: float) -> tuple[float, float | None]:
    """Wait up to ``max_s`` seconds until the cores are idle: at most ``BUSY_LIMIT`` of their
    time busy over ``BUSY_WINDOW_S`` (the previous run's writeback, say, done). The seconds
    waited and the last busy share measured (the run's ``cpu_busy_before``)."""
    t0 = time.monotonic()
    busy = cpu_busy()
    while busy is not None and busy > BUSY_LIMIT and time.monotonic() - t0 < max_s:
        busy = cpu_busy()
    return round(time.monotonic() - t0, 1), busy


def failure_cause(lines: list[str]) -> str:
    """The line that says why a run failed: a JVM out of memory first, else the last line."""
    for needle in ("OutOfMemoryError", "Error:", "Exception:"):
        hit = next((x.strip() for x in lines if needle in x), None)
        if hit:
            return hit[:300]
    return (lines[-1].strip() if lines else "unknown")[:300]


def base_task(s: Settings, data_dir: str, live: Path, files_per_epoch: int) -> dict[str, Any]:
    return {
        "master": s.master,
        "data": data_dir,
        "files_per_epoch": files_per_epoch,
        "spec_parallelism": s.parallelism,
        "shuffle_partitions": s.parallelism,
        "live": str(live),
    }


def main_runs(s: Settings, variants: Sequence[str] | None = None) -> int:
    if variants is None:
        return s.rounds * (len(FULL_RUNS) + 3 + len(s.rescale_to))
    full = [v for v in variants if v in FULL_RUNS]
    extra = (WARM in variants) + (CRASH in variants) * (2 + len(s.rescale_to))
    return s.rounds * (len(full) + extra)


def sweep_runs(s: Settings) -> int:
    return s.rounds * len(s.sizes) * (len(SWEEP_RUNS) + 3)


def measure(
    s: Settings,
    data: dict[str, Any],
    work: Path,
    runner: Runner,
    variants: Sequence[str] = tuple(FULL_RUNS),
    rescale_to: Sequence[int] | None = None,
    tag: str = "",
    extras: Sequence[str] = EXTRA_RUNS,
) -> list[dict]:
    """Every variant once per round, interleaved (see the module docstring), then ``extras``
    (the warm restart; the crash and its restores); the runs."""
    live, snapshot = work / "live", work / "crashed"
    base = base_task(s, data["dir"], live, s.files_per_epoch)
    parallelisms = [s.parallelism, *(s.rescale_to if rescale_to is None else rescale_to)]
    first = len(runner.runs)
    for r in range(s.rounds):
        label = f"{tag}round {r + 1}"
        for variant in rotated(list(variants), r):
            runner.one(variant, r, {**base, **FULL_RUNS[variant]}, tag=label)
        # a task failure at the crash's point, the driver alive: a warm restart to the end
        warm = {"every_epochs": True, "fail_task_after_epochs": s.crash_after_epochs}
        if WARM in extras:
            runner.one(WARM, r, {**base, **OURS, **warm}, tag=label)
        if CRASH not in extras:
            continue
        crash = runner.one(
            "crash",
            r,
            {**base, **OURS, "every_epochs": True, "crash_after_epochs": s.crash_after_epochs},
            tag=label,
        )
        if crash.get("failed"):  # nothing to restore from this round
            shutil.rmtree(live, ignore_errors=True)
            continue
        if not crash["crashed"]:
            raise RuntimeError("the crash run did not crash")
        shutil.rmtree(snapshot, ignore_errors=True)
        os.replace(live, snapshot)  # metastore.db (+ WAL), checkpoints/, sink/, pipeline.yaml
        for p in rotated([str(p) for p in parallelisms], r):
            shutil.rmtree(live, ignore_errors=True)
            shutil.copytree(snapshot, live, symlinks=True)  # same absolute paths as the crash
            task = {**base, "fresh": False, "parallelism": int(p)}
            runner.one(f"restore-p{p}", r, task, tag=label)
        shutil.rmtree(snapshot, ignore_errors=True)
    shutil.rmtree(live, ignore_errors=True)
    return runner.runs[first:]
