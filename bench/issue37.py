"""Issue 37's measurement (``python bench/spark_bench.py --issue37``): four data sets, each with W
(``plain_job``), the hand-written design (``design_job``) and ours (``ckpt run``), whole
processes, paired per round; every figure is the median of the per-round ratios with their
min-max (``spark_stats.paired_ratios``).

Sets (20 files each, 2 files per epoch: 10 epochs, in name order; ``local[2]``, parallelism 4):

* a — 5 M events over ~510 k keys (the main workload's keys per event)
* b — 5 M events over 5 k keys (few keys: small state)
* c — 50 M events over 5.1 M keys (the realistic size)
* d — 50 M events over 500 k keys, plus ours crashed at 80 % (``ckpt run`` killed — SIGKILL to
  its process group — as it prints its 8th of 10 epochs) and resumed by ``ckpt run`` again on
  the same directory (restore latest): (crashed + resume) / W, against the plain job's rerun
  from zero, 0.8 W + W = 1.8 W by formula.

Ours is ``ckpt run`` on ``spark_workers.write_spec``'s spec: ``checkpoint.every_epochs: 1``,
``source.splits_per_epoch: 2`` (a checkpoint after each of the 10 epochs), ``sink.changelog:
false`` (the final table only, as W writes; no changelog sink), parallelism 4. Each run's
process tree is sampled (``machine.Watch``) for its peak resident memory; W's, the design's and
ours' are reported, and ours / W paired per round. Every run records the machine's load before
and after it and the JVMs that were not its own; a run is flagged (``machine.load_flags``) when
more than 10 % of the cores' time was busy in the 3 s before it (measured from /proc/stat; the
1-min load average, recorded too, still holds the bench's own previous run for a minute) or
another JVM ran; before each run the bench waits up to ``--settle`` seconds (default 60) for
the cores to be idle.

``--scale F`` runs the same sets at F times their events and keys (``--quick``: 0.04, 200 k /
2 M events) into ``issue37-quick.json``, never ``issue37.json``.

Duration on this 2-core machine, estimated from the anchor runs (W 18 s at 5 M, 51 s at 50 M;
ours every 10 % 40 s at 5 M, 200 s at 50 M; the design assumed ~1.5 W) plus up to 60 s of
settling before each run: per round about 2.5 min for a, 2 min for b, 7 min for c, 10 min for d
— about 65 min for 3 rounds, plus the data's generation on first use (5 M events ~1 min, each
50 M set ~5-8 min).
"""

from __future__ import annotations

import dataclasses
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import spark_stats
from machine import BUSY_LIMIT, BUSY_WINDOW_S, LOAD_LIMIT, loadavg, machine_info
from spark_plan import Runner, base_task, rotated
from spark_report import console, write_report
from spark_workload import RESULTS_DIR, Settings, ensure_data

#: set -> events, keys, with the crash and resume
SETS: dict[str, dict[str, Any]] = {
    "a": {"events": 5_000_000, "keys": 510_000, "crash": False},
    "b": {"events": 5_000_000, "keys": 5_000, "crash": False},
    "c": {"events": 50_000_000, "keys": 5_100_000, "crash": False},
    "d": {"events": 50_000_000, "keys": 500_000, "crash": True},
}
FILES, FILES_PER_EPOCH, PARALLELISM = 20, 2, 4
EPOCHS = FILES // FILES_PER_EPOCH
CRASH_AFTER = round(EPOCHS * 0.8)
QUICK_SCALE = 0.04
JAVA_KEYS = ("other_java_start", "other_java_max", "other_java_end")
W, DESIGN, OURS, CRASH, RESUME = "plain", "design", "ours", "ours-crash", "ours-resume"
#: variant -> its task (spark_process.run_process)
TASKS: dict[str, dict[str, Any]] = {
    W: {"process": "plain"},
    DESIGN: {"process": "design"},
    OURS: {"process": "cli", "every_epochs": True},
    CRASH: {
        "process": "cli",
        "every_epochs": True,
        "kill_after_epochs": CRASH_AFTER,
        "keep_live": True,
    },
    RESUME: {"process": "cli", "every_epochs": True, "fresh": False},
}
#: the reported ratios: name -> (numerator, denominator)
RATIOS = {"ours_vs_w": (OURS, W), "ours_vs_design": (OURS, DESIGN), "design_vs_w": (DESIGN, W)}

DEFINITIONS = {
    "plain": "W: bench/plain_job.py, one plain Spark job over all 20 files (a whole process)",
    "design": "the hand-written design: bench/design_job.py, per epoch (2 files) a partial "
    "aggregate with its key group, sorted by it, written to chk/epoch-<e>/ + _COMMITTED; at "
    "the end one merge into the output table (a whole process)",
    "ours": "`ckpt run` (a whole process), checkpoint.every_epochs: 1, splits_per_epoch: 2 "
    "(10 epochs), sink.changelog: false, parallelism 4",
    "ours-crash": f"ours, SIGKILLed (its process group) when it prints epoch {CRASH_AFTER} of "
    f"{EPOCHS} done: process_s is spawn to the kill",
    "ours-resume": "`ckpt run` again on the crashed run's directory (restore latest) to the end",
    "process_s": "wall seconds from the process's spawn to its job's end and its session's stop",
    "paired ratio": "per round numerator / denominator (the round's runs back to back, in an "
    "order rotated by the round); figures: median of those per-round ratios, with min and max",
    "crash_resume_vs_w": "(ours-crash + ours-resume) / W per round; plain_rerun_vs_w = 0.8 + 1 "
    "(the plain job's crashed 80 % then its rerun from zero, by formula)",
    "peak_rss_bytes": "the most resident memory of the run's process tree at once (Python, "
    "driver JVM, Python workers; sampled every 0.25 s)",
    "load_flags": f"why a run may be skewed: more than {BUSY_LIMIT:.0%} of the cores' time busy in "
    f"the {BUSY_WINDOW_S:g} s before it (cpu_busy_before, from /proc/stat, after settling up to "
    "--settle seconds; loadavg_1m is recorded too, but lags a minute behind the previous run), "
    "or any JVM not the run's own before, during or after it",
    "output": "W's, the design's and ours' output tables must hold the same rows "
    "(spark_process.output_check's digest; checks.same_output)",
}


def scaled(name: str, scale: float) -> dict[str, Any]:
    x = SETS[name]
    return {
        **x,
        "events": max(1000, round(x["events"] * scale)),
        "keys": max(10, round(x["keys"] * scale)),
    }


def settings(base: Settings, rounds: int) -> Settings:
    return dataclasses.replace(
        base,
        epochs=EPOCHS,
        files_per_epoch=FILES_PER_EPOCH,
        parallelism=PARALLELISM,
        rounds=rounds,
        crash_after_epochs=CRASH_AFTER,
    )


def total_runs(names: list[str], rounds: int) -> int:
    return rounds * sum(3 + 2 * SETS[n]["crash"] for n in names)


def measure_set(
    s: Settings, data: dict[str, Any], work: Path, runner: Runner, crash: bool, tag: str
) -> list[dict[str, Any]]:
    """Every round: W, the design and ours in a rotated order, then the crash and its resume."""
    live = work / "live"
    base = base_task(s, data["dir"], live, FILES_PER_EPOCH)
    first = len(runner.runs)
    for r in range(s.rounds):
        label = f"{tag}round {r + 1}"
        for variant in rotated([W, DESIGN, OURS], r):
            runner.one(variant, r, {**base, **TASKS[variant]}, tag=label)
        if crash:
            c = runner.one(CRASH, r, {**base, **TASKS[CRASH]}, tag=label)
            if not c.get("failed") and c.get("crashed"):
                runner.one(RESUME, r, {**base, **TASKS[RESUME]}, tag=label)
        shutil.rmtree(live, ignore_errors=True)
    return runner.runs[first:]


def per_round(runs: list[dict[str, Any]], variant: str, key: str) -> dict[int, float]:
    return {
        r["round"]: r[key]
        for r in runs
        if r["variant"] == variant and not r.get("failed") and r.get(key) is not None
    }


def set_section(
    name: str, data: dict[str, Any], runs: list[dict[str, Any]], rounds: int
) -> dict[str, Any]:
    variants = [W, DESIGN, OURS] + ([CRASH, RESUME] if SETS[name]["crash"] else [])
    seconds = {
        v: {
            "per_round": [per_round(runs, v, "process_s").get(k) for k in range(rounds)],
            **spark_stats.spread(list(per_round(runs, v, "process_s").values())),
        }
        for v in variants
    }
    w = per_round(runs, W, "process_s")
    ratios: dict[str, Any] = {
        k: spark_stats.paired_ratios(
            per_round(runs, a, "process_s"), per_round(runs, b, "process_s")
        )
        for k, (a, b) in RATIOS.items()
    }
    if SETS[name]["crash"]:
        crashed, resumed = per_round(runs, CRASH, "process_s"), per_round(runs, RESUME, "process_s")
        total = {k: crashed[k] + resumed[k] for k in crashed if k in resumed}
        ratios["crash_resume_vs_w"] = spark_stats.paired_ratios(total, w)
        ratios["plain_rerun_vs_w"] = round(CRASH_AFTER / EPOCHS + 1, 3)
    memory = {
        v: {
            "per_round": [per_round(runs, v, "peak_rss_bytes").get(k) for k in range(rounds)],
            **spark_stats.spread(list(per_round(runs, v, "peak_rss_bytes").values())),
        }
        for v in (W, DESIGN, OURS)
    }
    memory["ours_vs_w"] = spark_stats.paired_ratios(
        per_round(runs, OURS, "peak_rss_bytes"), per_round(runs, W, "peak_rss_bytes")
    )
    flagged = [r for r in runs if r.get("load_flags")]
    return {
        "label": f"{data['events']:,} events / {data['keys_parameter']:,} keys",
        "crash": SETS[name]["crash"],
        "data": {k: v for k, v in data.items() if k != "per_file"},
        "process_s": seconds,
        "ratios": ratios,
        "peak_rss_bytes": memory,
        "failed": {
            r["variant"] + f" (round {r['round'] + 1})": r.get("cause")
            for r in runs
            if r.get("failed")
        },
        "runs": len(runs),
        "flagged_runs": len(flagged),
        "checks": spark_stats.checks(data["events"], [r for r in runs if r["variant"] != CRASH]),
    }


def run(args: Any, base: Settings, data_root: Path, work_root: Path) -> int:
    names = args.sets or list(SETS)
    if bad := [n for n in names if n not in SETS]:
        raise SystemExit(f"--sets: unknown set {bad[0]!r} (known: {', '.join(SETS)})")
    scale = args.scale if args.scale is not None else (QUICK_SCALE if args.quick else 1.0)
    rounds = args.rounds or (1 if args.quick else 3)
    settle_s = 60.0 if args.settle is None else args.settle
    s = settings(base, rounds)
    full = scale == 1.0 and not args.quick
    output = args.output or RESULTS_DIR / ("issue37.json" if full else "issue37-quick.json")
    started = datetime.now(UTC)
    load_before = loadavg()
    datasets = {
        n: ensure_data(data_root, events=x["events"], keys=x["keys"], files=FILES, seed=s.seed)
        for n in names
        for x in [scaled(n, scale)]
    }
    work_root.mkdir(parents=True, exist_ok=True)
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="issue37-", dir=work_root))
    runner = Runner(s, work, total_runs(names, rounds), settle_s=settle_s)
    sections: dict[str, Any] = {}
    try:
        for n in names:
            d = datasets[n]
            runs = measure_set(s, d, work, runner, SETS[n]["crash"], f"set {n}, ")
            for r in runs:
                r["set"] = n
            sections[n] = set_section(n, d, runs, rounds)
    except BaseException:
        console.print(f"[red]failed; logs kept in {work}[/red]")
        raise
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    flagged = [r for r in runner.runs if r.get("load_flags")]
    report = {
        "benchmark": "issue37",
        "generated_at": started.isoformat(),
        "duration_s": round((datetime.now(UTC) - started).total_seconds(), 1),
        "command": "python bench/spark_bench.py --issue37"
        + (f" --sets {','.join(names)}" if args.sets else "")
        + (f" --rounds {rounds}" if args.rounds else "")
        + (f" --scale {scale:g}" if args.scale is not None else "")
        + (" --quick" if args.quick else "")
        + (f" --settle {settle_s:g}" if args.settle is not None else ""),
        "settings": {
            "sets": {n: scaled(n, scale) for n in names},
            "scale": scale,
            "quick": not full,
            "rounds": rounds,
            "files": FILES,
            "files_per_epoch": FILES_PER_EPOCH,
            "epochs": EPOCHS,
            "crash_after_epochs": CRASH_AFTER,
            "parallelism": PARALLELISM,
            "shuffle_partitions": PARALLELISM,
            "master": s.master,
            "driver_memory": s.driver_memory,
            "seed": s.seed,
            "settle_s": settle_s,
            "load_limit": LOAD_LIMIT,
            "busy_limit": BUSY_LIMIT,
        },
        "machine": {
            **machine_info(),
            "loadavg_1m_before": load_before,
            "loadavg_1m_after": loadavg(),
        },
        "definitions": DEFINITIONS,
        "load": {
            "runs": len(runner.runs),
            "flagged": len(flagged),
            "flagged_runs": [
                {
                    "set": r.get("set"),
                    "round": r["round"] + 1,
                    "variant": r["variant"],
                    "why": r["load_flags"],
                }
                for r in flagged
            ],
            "loadavg_1m_max": max((r["loadavg_1m"] or 0 for r in runner.runs), default=None),
            "other_java_max": max(
                (max(r.get(k) or 0 for k in JAVA_KEYS) for r in runner.runs), default=0
            ),
        },
        "sets": sections,
        "runs": runner.runs,
    }
    write_report(report, output)
    print_summary(report)
    console.print(f"results written to {output}")
    return 0 if all(x["checks"]["consistent"] for x in sections.values()) else 1


def print_summary(report: dict[str, Any]) -> None:
    from readme_tables import issue37_table

    console.print(issue37_table(report))
