"""Spark pipeline benchmark (issues 16, 23): every figure against the plain Spark batch job W that
a user runs instead (the anchor), checkpoint overhead, Spark Structured Streaming as the peer,
recovery after a crash, rescaled restore, run time against input size, how checkpoint cost grows
with state size and change rate, and the disk's physical limits — all measured in one run on one
machine.

Run by ``make bench`` (never by the tests); ``make bench QUICK=1`` passes ``--quick``::

    python bench/spark_bench.py [--quick] [--rounds N] [--events N --keys K --epochs E]
                                [--sizes N,N] [--no-growth | --growth-only] [--growth-sizes N,N,N]
    python bench/spark_bench.py --issue37 [--rounds 3] [--sets a,b,c,d] [--scale F] [--settle S]

``--issue37`` (``issue37``): W, the hand-written design (``design_job.py``) and ours (``ckpt
run``, a checkpoint after each of 10 epochs) on issue 37's four data sets, every figure the median
of paired per-round ratios with min-max, peak memory and the machine's load per run, written to
``bench/results/issue37.json``; ``python bench/readme_tables.py`` then writes the tables of
docs/benchmarks.md and the README's cost.

The second anchor (issue 37): the hand-written design, ``design_job.py`` — plain PySpark that
commits each epoch's partial aggregates and merges them at the end — runs in every round's
rotation as ``design`` beside W; its output table must equal W's (``spark_stats.checks``).

The anchor (``spark_anchor``): W = ``plain_job.py``, the same query over the same files as one
plain Spark job (``local[2]``, shuffle partitions = parallelism, the same session settings and
output format), a whole process as a user starts it, in every round's rotation; every variant is
reported as x W by whole-process seconds (spawn to the job's end), paired per round, W first,
with the totals of a crash at 80 %: the plain job rerun from zero (0.8 W + W) and ours resumed
(the measured crashed run + the measured resume). ``--sizes 50000000`` adds the issue's realistic
size (50 M events over 5.1 M keys in 20 files, 441 MiB; W about 92 s, ``every`` today dies of
memory at epoch 5, recorded as failed): W, off, every, the streaming peer, the crash and the
resume at each further size, plotted with the main size to ``bench/results/run_time_vs_size.png``
(``--events 50000000`` instead measures everything at that size).

Workload (``spark_workload``): ``groupBy(user)`` with ``count()``, ``sum(amount)``,
``avg(amount)``, ``min(quantity)``, ``max(quantity)`` over ``ckpt generate-data`` synthetic
events (default 5,000,000 events over 510,000 keys in 20 files, one per epoch), ``local[2]``,
parallelism 4. Main measurement (``spark_plan``): variants ``off``, ``every`` (incremental),
``every-full``, ``every-delta``, ``peer-changelog`` and ``peer-rocksdb`` (Structured Streaming,
RocksDB with and without changelog checkpointing), ``crash`` at 80 % and ``restore-p4/p2/p8``,
each in its own process (``spark_workers``), three rounds by default in rotated orders.
Statistics (``spark_stats``): min / median / max of every figure, ratios against the issue's
targets with per-round paired ratios and a verdict whether their spread is too wide to judge.
Growth (``spark_growth``): ``every`` and ``every-full`` at three sizes x two change rates, per
checkpoint bytes written, snapshot seconds, state size and changed key groups; plotted to
``bench/results/snapshot_cost.png``. Disk (``disk_probe``): sequential write and read of 512 MiB
under the work directory at the start and end; the snapshot write and restore read throughputs
are reported as fractions of it (target >= 50 %).

Results: ``bench/results/spark.json`` (sections: settings, machine, definitions, targets, disk,
anchor, main, growth, runs) and a printed summary; ``--quick`` writes
``bench/results/spark-quick.json``, ``snapshot_cost-quick.png`` and ``run_time_vs_size-quick.png``
instead, so a quick run never replaces the full run's files.

Duration of the default run on this 2-core machine, estimated from the last measured 5 M-event
runs (47-59 s each, restores 26-30 s, about 10 s more per process for JVM and session start and
the output check; W about 27 s, the design about 1.5 W): main measurement 3 rounds x 13 runs of
about 55 s ≈ 35 min;
growth 12 runs (0.4 M, 1.5 M, 5 M events, 10 epochs) ≈ 7 min; disk probes < 1 min; with
``bench/ack_bench.py`` (about 1 min) ``make bench`` takes about 43 min, plus about 1 min to
generate the data on first use — more when others' Spark jobs share the machine. ``--sizes
50000000`` adds 3 rounds x 6 runs at 50 M events (W 92 s, ours 20-26 s per epoch until it fails):
roughly an hour more, plus the data's generation.
``--quick`` (200 k events in 6 epochs, 1 round; the size sweep at 60 k events; growth at 30 k /
80 k / 200 k events in 4 epochs): about 13 min on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/'s modules, beside this file

import disk_probe
import spark_anchor
import spark_growth
import spark_plan
import spark_stats
from machine import loadavg, machine_info
from spark_report import DEFINITIONS, console, print_summary, write_report
from spark_workload import (
    DATA_ROOT,
    LARGE_SIZE,
    RESULTS_DIR,
    WORK_ROOT,
    Settings,
    ensure_data,
    growth_keys,
    make_settings,
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ints = lambda v: [int(x) for x in v.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(
        description="Spark pipeline benchmark (issues 16, 23): see bench/spark_bench.py's docstring"
    )
    p.add_argument("--quick", action="store_true", help="small data, one round (development)")
    p.add_argument("--events", type=int, help="events (default 5,000,000; quick 200,000)")
    p.add_argument(
        "--keys",
        type=int,
        help="keys parameter (default 0.102 per event: 510,000 at 5 M; quick 20,000)",
    )
    p.add_argument(
        "--sizes",
        type=ints,
        metavar="N,N,...",
        help="the size sweep's further sizes in events, beside --events (keys in proportion, the "
        f"same files): W, off, every, peer-changelog, crash, restore; e.g. {LARGE_SIZE} (the "
        "issue's realistic size); default none (quick: 60000; '' for none)",
    )
    p.add_argument(
        "--variants",
        type=lambda v: [x for x in v.split(",") if x],
        metavar="V,V,...",
        help="only these runs in the main measurement (full runs: "
        f"{', '.join(spark_plan.FULL_RUNS)}; and {', '.join(spark_plan.EXTRA_RUNS)}), e.g. a "
        "shorter run at a large size: --events 50000000 --variants plain,off,every-tenth,crash "
        "--rescale-to ''; default all",
    )
    p.add_argument("--epochs", type=int, help="epochs (default 20; quick 6)")
    p.add_argument("--files-per-epoch", type=int, default=1, help="input files per epoch")
    p.add_argument("--seed", type=int, default=0, help="data seed")
    p.add_argument("--parallelism", type=int, default=4, help="parallelism of the full runs")
    p.add_argument(
        "--rescale-to",
        type=ints,
        default=[2, 8],
        metavar="N,N,...",
        help="parallelisms of the rescaled restores (default 2,8)",
    )
    p.add_argument("--rounds", type=int, help="runs of each variant (default 3; quick 1)")
    p.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    p.add_argument("--driver-memory", help="spark.driver.memory (default: Spark's, as ckpt run)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--no-growth", action="store_true", help="skip the growth experiment")
    g.add_argument("--growth-only", action="store_true", help="only the growth experiment")
    p.add_argument(
        "--growth-sizes",
        type=ints,
        metavar="N,N,...",
        help="growth experiment sizes in events (default 400000,1500000,5000000; "
        "quick 30000,80000,200000)",
    )
    p.add_argument("--growth-epochs", type=int, help="growth runs' epochs (default 10; quick 4)")
    p.add_argument("--data-dir", type=Path, default=DATA_ROOT, help="cache of generated data")
    p.add_argument("--keep-work", action="store_true", help="keep the work directory and logs")
    p.add_argument(
        "--output",
        type=Path,
        help="JSON results file (default bench/results/spark.json; --quick: spark-quick.json; "
        "--growth-only: spark-growth.json or spark-growth-quick.json)",
    )
    p.add_argument("--plot", type=Path, help="growth plot (default beside the JSON file)")
    p.add_argument(
        "--size-plot", type=Path, help="run time against input size (default beside the JSON)"
    )
    g = p.add_argument_group("issue 37 (--issue37; see bench/issue37.py)")
    g.add_argument(
        "--issue37",
        action="store_true",
        help="W, the hand-written design and ours (ckpt run) on issue 37's four data sets, "
        "written to bench/results/issue37.json (scaled or --quick: issue37-quick.json)",
    )
    g.add_argument(
        "--sets",
        type=lambda v: [x for x in v.split(",") if x],
        metavar="S,S,...",
        help="issue 37's sets to run (default a,b,c,d)",
    )
    g.add_argument(
        "--scale",
        type=float,
        help="issue 37's sets at this fraction of their events and keys (default 1; quick 0.04)",
    )
    g.add_argument(
        "--settle",
        type=float,
        help="issue 37: seconds to wait at most before each run for the cores to be idle (at "
        "most 10%% busy over 3 s; default 60; 0: never wait)",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def default_output(args: argparse.Namespace) -> Path:
    """Never the full run's file for a quick or a partial run."""
    name = "spark-growth" if args.growth_only else "spark"
    return RESULTS_DIR / (name + ("-quick" if args.quick else "") + ".json")


def size_data(s: Settings, data_root: Path, events: int) -> dict[str, Any]:
    """A size sweep's data set: the main one's shape (files, seed), keys in proportion."""
    return ensure_data(
        data_root, events=events, keys=growth_keys(events), files=s.files, seed=s.seed
    )


def anchor_section(
    s: Settings, sets: list[tuple[dict[str, Any], list[dict[str, Any]]]], plot_path: Path
) -> dict[str, Any]:
    """x W per size (the main size first), the session settings' check, the size plot."""
    sizes = [
        {
            "main": i == 0,
            **spark_anchor.size_section(runs, d, s.crash_after_epochs, s.epochs, s.parallelism),
            "checks": spark_stats.checks(d["events"], runs),
        }
        for i, (d, runs) in enumerate(sets)
    ]
    spark_anchor.plot(
        sizes,
        plot_path,
        f"Run time against input size (whole processes)\n{s.epochs} epochs of "
        f"{s.files_per_epoch} file(s), {s.master}, parallelism {s.parallelism}, "
        f"{s.rounds} round(s)" + (" (quick)" if s.quick else ""),
    )
    return {
        "key": spark_anchor.KEY,
        "sizes": sizes,
        "session_settings": spark_anchor.session_check([r for _, runs in sets for r in runs]),
        "plot": str(plot_path),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        from spark_workers import worker_main

        worker_main(json.loads(args.worker))
        return 0
    s = make_settings(args)
    if args.issue37:
        import issue37

        return issue37.run(args, s, args.data_dir, WORK_ROOT)
    output = args.output or default_output(args)
    plot_path = args.plot or output.with_name(
        "snapshot_cost" + ("-quick" if args.quick else "") + ".png"
    )
    started = datetime.now(UTC)
    load_before = loadavg()
    WORK_ROOT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="spark-bench-", dir=WORK_ROOT))
    probes = [disk_probe.probe(work, s.disk_probe_bytes)]
    console.print(
        f"disk: write {probes[0]['write_mib_s']} MiB/s, read {probes[0]['read_mib_s']} MiB/s"
    )
    data = None
    if s.main:
        data = ensure_data(
            args.data_dir,
            events=s.events,
            keys=s.keys,
            files=s.files,
            seed=s.seed,
        )
    size_sets = [size_data(s, args.data_dir, n) for n in s.sizes] if s.main else []
    growth_sets = spark_growth.data_sets(s, args.data_dir) if s.growth else []
    known = (*spark_plan.FULL_RUNS, *spark_plan.EXTRA_RUNS)
    if args.variants is not None and (bad := [v for v in args.variants if v not in known]):
        raise SystemExit(f"--variants: unknown run {bad[0]!r} (known: {', '.join(known)})")
    total = (spark_plan.main_runs(s, args.variants) + spark_plan.sweep_runs(s) if s.main else 0) + (
        spark_growth.growth_runs(s) if s.growth else 0
    )
    runner = spark_plan.Runner(s, work, total)
    main_runs: list[dict[str, Any]] = []
    sweep: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    growth: dict[str, Any] | None = None
    try:
        if data is not None:
            main_runs = spark_plan.measure(
                s,
                data,
                work,
                runner,
                variants=[
                    v for v in args.variants or spark_plan.FULL_RUNS if v in spark_plan.FULL_RUNS
                ],
                extras=[
                    v for v in args.variants or spark_plan.EXTRA_RUNS if v in spark_plan.EXTRA_RUNS
                ],
            )
        for d in size_sets:
            runs = spark_plan.measure(
                s,
                d,
                work,
                runner,
                variants=spark_plan.SWEEP_RUNS,
                rescale_to=(),
                tag=f"{d['events']:,} events, ",
            )
            sweep.append((d, runs))
        if growth_sets:
            growth = spark_growth.measure(s, growth_sets, work, runner)
    except BaseException:
        console.print(f"[red]failed; logs kept in {work}[/red]")
        raise
    probes.append(disk_probe.probe(work, s.disk_probe_bytes))
    disk = disk_probe.limits(probes)
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    report: dict[str, Any] = {
        "benchmark": "spark",
        "generated_at": started.isoformat(),
        "duration_s": round((datetime.now(UTC) - started).total_seconds(), 1),
        "settings": {**asdict(s), "files": s.files, "shuffle_partitions": s.parallelism},
        "machine": {
            **machine_info(),
            "loadavg_1m_before": load_before,
            "loadavg_1m_after": loadavg(),
            # other work on the machine skews the figures: seen before each run
            "loadavg_1m_max": max((x["loadavg_1m"] or 0 for x in runner.runs), default=None),
            "other_spark_jvms_max": max((x["other_spark_jvms"] for x in runner.runs), default=0),
        },
        "definitions": DEFINITIONS,
        "targets": {**spark_stats.TARGETS, "throughput_min_fraction_of_disk": 0.5},
        "disk": disk,
    }
    if data is not None:
        size_plot = args.size_plot or output.with_name(
            "run_time_vs_size" + ("-quick" if args.quick else "") + ".png"
        )
        report["anchor"] = anchor_section(s, [(data, main_runs), *sweep], size_plot)
        r = spark_stats.ratios(s.rescale_to, s.parallelism, main_runs)
        checks = spark_stats.checks(s.events, main_runs)
        if not checks["consistent"]:
            console.print(f"[red]output mismatch: {checks}[/red]")
        report["main"] = {
            "data": data,
            "figures": spark_stats.figures(main_runs),
            "ratios": r,
            "meets_targets": spark_stats.verdicts(r),
            "throughput": spark_stats.throughput(main_runs, disk),
            "checks": checks,
        }
    if growth is not None:
        spark_growth.plot(
            growth,
            plot_path,
            f"Snapshot cost: every (incremental) vs every-full, {s.growth_epochs} epochs, "
            f"sizes {', '.join(f'{x:,}' for x in s.growth_sizes)} events "
            "(seconds: each run's first checkpoint left out)",
        )
        growth["plot"] = str(plot_path)
        growth["data"] = [{k: v for k, v in d.items() if k != "per_file"} for d in growth_sets]
        growth["checks"] = {
            str(d["events"]) + "-" + d["change"]: spark_stats.checks(
                d["events"],
                [r for r in runner.runs[len(main_runs) :] if r.get("data_dir") == d["dir"]],
            )
            for d in growth_sets
        }
        report["growth"] = growth
    report["runs"] = runner.runs
    write_report(report, output)
    print_summary(report)
    console.print(f"results written to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
