"""What the step API costs (issue 39), as whole processes against W, the same script without
``ck`` (``bench/steps_job.py``), in paired rounds on the same data:

* ``steps / W``: every step checkpointed (the join, the aggregate, the window, the write);
* ``crashed + resumed / W``: the checkpointed job SIGKILLed at 80 % of that round's W time,
  then rerun: the killed part (0.8 W) plus the resume, against 1.8 for rerunning W from zero;
* ``killed in step 4 + resumed / W``: SIGKILLed as its 4th step (the write) starts, whenever
  that is, then rerun: the time until the kill plus the resume;
* the same three with the join chained into the aggregate (``ck.step(..., chained=True)``):
  ``chained / W``, ``chained, crashed + resumed / W``, ``chained, killed in step 4 + resumed / W``;
* what the figures are made of: ``manual / W``, the same steps written with Spark's own writer
  and read back by hand (the floor any checkpoint of every step pays), ``steps / manual`` (what
  the step API adds to that floor), ``resume after step 4 / W`` (the resume alone) and
  ``start / W`` (a process that only starts its session and reads the inputs' schemas: what
  every resume pays before its own work).

Before the first round the data is flushed to disk and W runs once untimed. Each figure is the
median of the per-round ratios (min-max); each run records the share of the
cores busy just before it and other JVMs seen (``bench/machine.py``). Every checkpointed run's
output, and the manual one's, is compared with W's (pyarrow, after the timing). Results:
``bench/results/steps.json`` (``--quick``: ``steps-quick.json``, small data, one round)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from machine import cpu_busy, load_flags, loadavg, machine_info, other_spark_jvms
from spark_stats import paired_ratios

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
JOB = BENCH / "steps_job.py"
CRASH_AT = 0.8
#: the log line of the step API starting the job's 4th step (ck.write's ``output``)
LAST_STEP = "step output: computing it"
REGIONS = [f"region-{i:02d}" for i in range(20)]


def write_data(root: Path, orders: int, customers: int, seed: int = 7) -> None:
    """``orders/`` (8 files) and ``customers/`` (2 files), deterministic."""
    rng = np.random.default_rng(seed)
    for name, rows, files in (("orders", orders, 8), ("customers", customers, 2)):
        (root / name).mkdir(parents=True, exist_ok=True)
        per = rows // files
        for i in range(files):
            lo = i * per
            if name == "orders":
                table = pa.table(
                    {
                        "oid": np.arange(lo, lo + per, dtype=np.int64),
                        "cid": rng.integers(0, customers, per, dtype=np.int64),
                        "day": rng.integers(0, 365, per, dtype=np.int32),
                        "amount": np.round(rng.gamma(2.0, 30.0, per), 2),
                        "qty": rng.integers(1, 10, per, dtype=np.int32),
                    }
                )
            else:
                cid = np.arange(lo, lo + per, dtype=np.int64)
                table = pa.table(
                    {
                        "cid": cid,
                        "region": pa.array(np.array(REGIONS)[cid % len(REGIONS)]),
                        "segment": pa.array(np.where(cid % 3 == 0, "retail", "business")),
                        "signup_day": rng.integers(0, 3650, per, dtype=np.int32),
                    }
                )
            pq.write_table(table, root / name / f"part-{i:02d}.parquet")


def warm_up(data: Path, work: Path, master: str, mode: str = "plain") -> None:
    """Before the first timed run: the data's writes flushed to disk (else the first run pays
    for them), and one untimed W run (its files in the page cache, as every later run has
    them)."""
    os.sync()
    run(mode, data, work / "warm-up", work / "h-warm-up", master)
    shutil.rmtree(work / "warm-up", ignore_errors=True)


def run(
    mode: str,
    data: Path,
    out: Path,
    home: Path,
    master: str,
    kill_after: float | None = None,
    kill_at_line: str | None = None,
    kill_when: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """One whole process, timed from spawn to exit, or to its SIGKILL: ``kill_after`` seconds
    after its spawn, as soon as its log has a line containing ``kill_at_line``, or as soon as
    ``kill_when()`` holds."""
    home.mkdir(parents=True, exist_ok=True)
    result = home / f"{out.name}.json"
    env = {**os.environ, "CKPT_HOME": str(home)}
    for key in ("CKPT_METASTORE_URL", "CKPT_STORAGE_URL"):
        env.pop(key, None)
    record: dict[str, Any] = {
        "mode": mode,
        "cpu_busy_before": cpu_busy(),
        "loadavg_1m": loadavg(),
        "other_spark_jvms": other_spark_jvms(),
    }
    cmd = [sys.executable, str(JOB), mode, str(data), str(out), "--master", master]
    start = time.monotonic()
    # its own process group: the SIGKILL reaches the driver's JVM too, as a lost node's would
    with open(home / f"{out.name}.log", "ab") as log:
        proc = subprocess.Popen(
            [*cmd, "--result-json", str(result)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    if kill_after is not None or kill_at_line is not None or kill_when is not None:
        deadline = start + (kill_after if kill_after is not None else 3600)
        log_path = home / f"{out.name}.log"
        while proc.poll() is None and time.monotonic() < deadline:
            if kill_at_line is not None and kill_at_line in log_path.read_text(errors="replace"):
                break
            if kill_when is not None and kill_when():
                break
            time.sleep(0.02 if kill_when is not None else 0.05)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        else:
            record["finished_before_kill"] = True
        record["seconds"] = round(time.monotonic() - start, 3)
        return record
    code = proc.wait()
    record["seconds"] = round(time.monotonic() - start, 3)
    if code != 0:
        tail = (home / f"{out.name}.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"{mode} run failed with exit code {code}:\n{tail}")
    if result.exists():
        record.update({k: v for k, v in json.loads(result.read_text()).items() if k != "process_s"})
    return record


def save(report: dict[str, Any], output: Path) -> None:
    """Write ``report`` to ``output`` and print its ratios."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps(report["ratios"], indent=2))
    print(f"written: {output}")


def rows_of(path: Path) -> list[tuple[Any, ...]]:
    """A published table's rows, sorted (W's directory, or the step API's ``final``)."""
    table = pq.read_table(path)
    cols = ["day", "region", "rev", "n", "qty", "rank"]
    rows = [tuple(r[c] for c in cols) for r in table.select(cols).to_pylist()]
    return sorted((d, g, round(rv, 4), n, round(q, 6), k) for d, g, rv, n, q, k in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--orders", type=int, default=4_000_000)
    p.add_argument("--customers", type=int, default=400_000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--master", default="local[2]")
    p.add_argument("--quick", action="store_true", help="400 k orders, one round")
    p.add_argument("--output", type=Path)
    p.add_argument(
        "--goals-only",
        action="store_true",
        help="only W, start alone, every step checkpointed, the join chained and killed as "
        "step 4 starts + resume (a long job's rounds: the crash at 80 %% and by hand left out)",
    )
    args = p.parse_args()
    if args.quick:
        args.orders, args.customers, args.rounds = 400_000, 40_000, 1
    output = args.output or RESULTS / ("steps-quick.json" if args.quick else "steps.json")

    work = Path(tempfile.mkdtemp(prefix="steps-bench-"))
    try:
        data = work / "data"
        write_data(data, args.orders, args.customers)
        warm_up(data, work, args.master)
        runs: list[dict[str, Any]] = []
        w: dict[int, float] = {}
        steps: dict[int, float] = {}
        crashed: dict[int, float] = {}
        in_last: dict[int, float] = {}
        manual: dict[int, float] = {}
        start: dict[int, float] = {}
        resume_alone: dict[int, float] = {}
        chained: dict[int, float] = {}
        chained_crashed: dict[int, float] = {}
        chained_in_last: dict[int, float] = {}
        chained_resume: dict[int, float] = {}
        every = not args.goals_only
        for rnd in range(args.rounds):
            plain = run("plain", data, work / f"w-{rnd}", work / f"hw-{rnd}", args.master)
            w[rnd] = plain["seconds"]
            full = run("steps", data, work / f"s-{rnd}", work / f"hs-{rnd}", args.master)
            steps[rnd] = full["seconds"]
            same = rows_of(work / f"w-{rnd}") == rows_of(work / f"s-{rnd}" / "final")
            started = run("start", data, work / f"z-{rnd}", work / f"hz-{rnd}", args.master)
            start[rnd] = started["seconds"]
            same_after = True
            batch = [plain, full, started]
            if every:
                by_hand = run("manual", data, work / f"m-{rnd}", work / f"hm-{rnd}", args.master)
                manual[rnd] = by_hand["seconds"]
                same = same and rows_of(work / f"w-{rnd}") == rows_of(work / f"m-{rnd}" / "final")
                by_hand["output_equals_w"] = same
                home = work / f"hc-{rnd}"
                killed = run(
                    "steps",
                    data,
                    work / f"c-{rnd}",
                    home,
                    args.master,
                    kill_after=CRASH_AT * w[rnd],
                )
                resumed = run("steps", data, work / f"c-{rnd}", home, args.master)
                crashed[rnd] = CRASH_AT * w[rnd] + resumed["seconds"]
                same_after = rows_of(work / f"w-{rnd}") == rows_of(work / f"c-{rnd}" / "final")
                # killed in step 4 (the write), whenever it starts
                home4 = work / f"h4-{rnd}"
                killed4 = run(
                    "steps", data, work / f"k-{rnd}", home4, args.master, kill_at_line=LAST_STEP
                )
                resumed4 = run("steps", data, work / f"k-{rnd}", home4, args.master)
                in_last[rnd] = killed4["seconds"] + resumed4["seconds"]
                resume_alone[rnd] = resumed4["seconds"]
                same_after = same_after and rows_of(work / f"w-{rnd}") == rows_of(
                    work / f"k-{rnd}" / "final"
                )
                killed["variant"], resumed["variant"] = "killed", "resumed"
                killed4["variant"], resumed4["variant"] = "killed-in-step-4", "resumed-after-step-4"
                resumed["output_equals_w"] = resumed4["output_equals_w"] = same_after
                batch += [by_hand, killed, resumed, killed4, resumed4]
            # the join chained: a full run, a crash at 80 % of W, a kill as step 4 starts
            ch = run("chained", data, work / f"j-{rnd}", work / f"hj-{rnd}", args.master)
            chained[rnd] = ch["seconds"]
            same = same and rows_of(work / f"w-{rnd}") == rows_of(work / f"j-{rnd}" / "final")
            if every:
                homej, out_j = work / f"hjc-{rnd}", work / f"jc-{rnd}"
                killed_j = run(
                    "chained", data, out_j, homej, args.master, kill_after=CRASH_AT * w[rnd]
                )
                resumed_j = run("chained", data, out_j, homej, args.master)
                chained_crashed[rnd] = CRASH_AT * w[rnd] + resumed_j["seconds"]
                same_after = same_after and rows_of(work / f"w-{rnd}") == rows_of(out_j / "final")
                killed_j["variant"], resumed_j["variant"] = "killed", "resumed"
                resumed_j["output_equals_w"] = same_after
                batch += [killed_j, resumed_j]
            homej4, out_j4 = work / f"hj4-{rnd}", work / f"j4-{rnd}"
            killed_j4 = run("chained", data, out_j4, homej4, args.master, kill_at_line=LAST_STEP)
            resumed_j4 = run("chained", data, out_j4, homej4, args.master)
            chained_in_last[rnd] = killed_j4["seconds"] + resumed_j4["seconds"]
            chained_resume[rnd] = resumed_j4["seconds"]
            same_after = same_after and rows_of(work / f"w-{rnd}") == rows_of(out_j4 / "final")
            killed_j4["variant"] = "killed-in-step-4"
            resumed_j4["variant"] = "resumed-after-step-4"
            full["output_equals_w"] = ch["output_equals_w"] = same
            resumed_j4["output_equals_w"] = same_after
            batch += [ch, killed_j4, resumed_j4]
            for record in batch:
                record["round"] = rnd
                record["load_flags"] = load_flags(record)
            runs += batch
            print(
                f"round {rnd}: W {w[rnd]:.1f} s, steps {steps[rnd] / w[rnd]:.2f}x, start alone "
                f"{start[rnd]:.1f} s"
                + (
                    f", killed at {CRASH_AT * w[rnd]:.1f} s + resumed {crashed[rnd] / w[rnd]:.2f}x"
                    f", killed in step 4 + resumed {in_last[rnd] / w[rnd]:.2f}x"
                    if every
                    else ""
                )
                + f"; chained {chained[rnd] / w[rnd]:.2f}x"
                + (f", crashed + resumed {chained_crashed[rnd] / w[rnd]:.2f}x" if every else "")
                + f", killed in step 4 at {killed_j4['seconds']:.1f} s + resumed "
                f"{resumed_j4['seconds']:.1f} s ({chained_in_last[rnd] / w[rnd]:.2f}x; reused "
                f"{resumed_j4.get('reused')}); outputs equal: {same and same_after}",
                flush=True,
            )
        report = {
            "benchmark": "steps (issue 39)",
            "date": datetime.now(UTC).date().isoformat(),
            "job": "orders.join(customers) -> groupBy(day, region) -> rank() over day -> write",
            "orders": args.orders,
            "customers": args.customers,
            "master": args.master,
            "rounds": args.rounds,
            "warm_up": True,
            "goals_only": args.goals_only,
            "crash_at": CRASH_AT,
            "machine": machine_info(),
            "ratios": {
                "steps_over_w": paired_ratios(steps, w),
                "crashed_resumed_over_w": paired_ratios(crashed, w),
                "killed_in_step_4_resumed_over_w": paired_ratios(in_last, w),
                "manual_over_w": paired_ratios(manual, w),
                "steps_over_manual": paired_ratios(steps, manual),
                "resume_after_step_4_over_w": paired_ratios(resume_alone, w),
                "start_over_w": paired_ratios(start, w),
                "chained_over_w": paired_ratios(chained, w),
                "chained_crashed_resumed_over_w": paired_ratios(chained_crashed, w),
                "chained_killed_in_step_4_resumed_over_w": paired_ratios(chained_in_last, w),
                "chained_resume_after_step_4_over_w": paired_ratios(chained_resume, w),
                "w_rerun_over_w": 1 + CRASH_AT,
            },
            "w_seconds": w,
            "start_seconds": start,
            "chained_resume_seconds": chained_resume,
            "runs": runs,
        }
        save(report, output)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
