"""Issue 39's third goal, counted: a narrow step SIGKILLed after half its tasks committed, then
resumed, recomputes only its missing partitions. ``bench/steps_job.py``'s ``narrow`` job (the
orders repartitioned into 16 by ``oid``, the step ``base``; a hash of each row over it, the
narrow step ``scored``, ``input=base``; the write), as whole processes in paired rounds against
``narrow-plain``, the same script without ``ck``:

* ``narrow / W``: the job, every step checkpointed, not killed;
* the kill: SIGKILLed once 8 of ``scored``'s 16 task files are in its checkpoint's directory;
  the resume's counts (``ck.stats``: partitions kept from the crashed run, partitions
  computed), and ``killed + resumed / W`` against ``killed + rerun / W`` (the crashed part plus
  a rerun from zero of the whole job without ``ck``).

Every output (the uncrashed run's and the resumed one's) is compared with W's, row for row
(pyarrow, after the timing). Results: ``bench/results/steps-narrow.json`` (``--quick``:
``steps-narrow-quick.json``)."""

from __future__ import annotations

import argparse
import shutil
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from machine import load_flags, machine_info
from spark_stats import paired_ratios
from steps_bench import RESULTS, run, save, warm_up, write_data

TASKS = 16  # steps_job.NARROW_TASKS


def committed(home: Path) -> int:
    """How many of ``scored``'s task files the running job has committed."""
    shared = home / "checkpoints" / "steps_narrow" / "shared"
    return len(list(shared.glob("chk-*/scored/part-*.parquet")))


def same_rows(w_out: Path, out: Path) -> bool:
    """W's table and the job's published one, row for row (sorted by ``oid``)."""
    a = pq.read_table(w_out).sort_by("oid")
    b = pq.read_table(out).select(a.column_names).sort_by("oid")
    return a.equals(b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--orders", type=int, default=4_000_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--quick", action="store_true", help="400 k orders, one round")
    p.add_argument("--output", type=Path)
    args = p.parse_args()
    if args.quick:
        args.orders, args.rounds = 400_000, 1
    name = "steps-narrow-quick.json" if args.quick else "steps-narrow.json"
    output = args.output or RESULTS / name
    work = Path(tempfile.mkdtemp(prefix="steps-narrow-"))
    try:
        data = work / "data"
        write_data(data, args.orders, max(1, args.orders // 10))
        warm_up(data, work, args.master, "narrow-plain")
        runs: list[dict[str, Any]] = []
        w: dict[int, float] = {}
        full: dict[int, float] = {}
        resumed_total: dict[int, float] = {}
        rerun_total: dict[int, float] = {}
        for rnd in range(args.rounds):
            plain = run("narrow-plain", data, work / f"w-{rnd}", work / f"hw-{rnd}", args.master)
            w[rnd] = plain["seconds"]
            uncrashed = run("narrow", data, work / f"n-{rnd}", work / f"hn-{rnd}", args.master)
            full[rnd] = uncrashed["seconds"]
            home, out = work / f"hk-{rnd}", work / f"k-{rnd}"
            killed = run(
                "narrow",
                data,
                out,
                home,
                args.master,
                kill_when=lambda home=home: committed(home) >= TASKS // 2,
            )
            killed["committed_at_kill"] = committed(home)
            resumed = run("narrow", data, out, home, args.master)
            resumed_total[rnd] = killed["seconds"] + resumed["seconds"]
            rerun_total[rnd] = killed["seconds"] + w[rnd]
            equal = same_rows(work / f"w-{rnd}", work / f"n-{rnd}" / "final")
            equal_after = same_rows(work / f"w-{rnd}", out / "final")
            uncrashed["output_equals_w"], resumed["output_equals_w"] = equal, equal_after
            killed["variant"], resumed["variant"] = "killed-half-way", "resumed"
            for record in (plain, uncrashed, killed, resumed):
                record["round"] = rnd
                record["load_flags"] = load_flags(record)
            runs += [plain, uncrashed, killed, resumed]
            print(
                f"round {rnd}: W {w[rnd]:.1f} s, narrow {full[rnd] / w[rnd]:.2f}x; killed at "
                f"{killed['seconds']:.1f} s with {killed['committed_at_kill']} of {TASKS} files; "
                f"resumed {resumed['seconds']:.1f} s: kept "
                f"{resumed.get('partitions_salvaged')}, computed "
                f"{resumed.get('partitions_computed')}, reused {resumed.get('reused')}; "
                f"outputs equal: {equal and equal_after}",
                flush=True,
            )
        report = {
            "benchmark": "steps, partial resume (issue 39)",
            "date": datetime.now(UTC).date().isoformat(),
            "job": "orders.repartition(16, oid) -> withColumn(sha2 of the row) -> write",
            "orders": args.orders,
            "tasks": TASKS,
            "master": args.master,
            "rounds": args.rounds,
            "warm_up": True,
            "machine": machine_info(),
            "ratios": {
                "narrow_over_w": paired_ratios(full, w),
                "killed_resumed_over_w": paired_ratios(resumed_total, w),
                "killed_rerun_over_w": paired_ratios(rerun_total, w),
            },
            "w_seconds": w,
            "runs": runs,
        }
        save(report, output)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
