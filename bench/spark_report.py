"""The report of ``bench/spark_bench.py``: the definitions written into the JSON, the printed
summary tables, and the atomic write of the results file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rich.table import Table
from spark_plan import console
from spark_stats import SPREAD_RULE

DEFINITIONS = {
    "plain": "W, the anchor (issue 23): the plain Spark batch job a user runs instead, "
    "bench/plain_job.py started as `python plain_job.py` (a whole process): spark.read.parquet("
    "all input files).groupBy(user).agg(count, sum(amount), avg(amount), min(quantity), "
    "max(quantity)).write.parquet(out), the same master, session settings (those of "
    "checkpointing.spark.session, compared in anchor.session_settings) and output format "
    "(Parquet, Spark's default codec) as ours, spark.sql.shuffle.partitions = parallelism, "
    "adaptive execution at Spark's default; timed in turn with the other variants, in the "
    "rotation of every round",
    "design": "the hand-written design, the second anchor (issue 37): bench/design_job.py as a "
    "whole process, plain PySpark with W's session settings: per epoch (the same files per epoch "
    "as ours) read the epoch's files, groupBy(user).agg(count, count(amount), sum(amount), "
    "min(quantity), max(quantity)) with the key group pmod(xxhash64(<length>:<key>), 128), "
    "sortWithinPartitions(key group), written to chk/epoch-<e>/ + a _COMMITTED marker; at the end "
    "the partials merged into W's output table (sum, sum, sum(s) / sum(non-null amounts), min, "
    "max); its table must equal W's (checks.output_digests)",
    "peak_rss_bytes": "whole-process variants (W, the design, ckpt run): the most resident memory "
    "of the process tree at once (sampled every 0.25 s)",
    "load_flags": "per run, why its figures may be skewed: the 1-min load average before it above "
    "0.5, or a JVM not its own before (other_java_start, other_spark_jvms), during "
    "(other_java_max) or after it (other_java_end)",
    "every-cli": "'every''s spec run by `ckpt run pipeline.yaml` as a user starts it (a whole "
    "process, CKPT_HOME = the run's directory, the embedded metastore created by the run): the "
    "command's imports, preflight and progress included; timed only as a whole process",
    "process_s": "wall seconds of the whole process, from its spawn to the job's end and its "
    "Spark session's stop (Python start, imports, JVM and session start included; the bench's "
    "own output check and reads after the job are left out; exit_s is spawn to exit, "
    "stop_s the session's stop); of ckpt run: spawn to its 'job <id> finished' line, printed "
    "right after its session stopped",
    "x_plain": "anchor.sizes[].vs_plain: a variant's median process_s / W's median process_s; "
    "paired_by_round: the same ratio within each round (the variants of a round run back to "
    "back, W among them, in rotated order) with its min / median / max; vs_plain_run_s: the same "
    "by run_s (session start to the job's end, W's included)",
    "crash_at_80": "total time with one crash at crash_fraction (80 % of the epochs by default) "
    "as x W: plain_rerun = fraction * W + W by formula (the plain job's crashed part, then its "
    "rerun from zero measured as W itself); ours_crashed_and_resumed = the crash variant's "
    "process_s (spawn to the simulated crash, measured) + restore-p<parallelism>'s process_s "
    "(a new process resuming from the latest checkpoint to the end), paired per round; when no "
    "crash run was measured the crashed part is fraction * every, and crashed_part says so",
    "sizes": "anchor.sizes: the main size and each --sizes size (the size sweep: plain, off, "
    "every, peer-changelog, crash, restore at the same parallelism, the same rounds; keys = "
    "0.102 per event, the same file count); failed: runs that did not finish at that size, with "
    "their cause; plotted to anchor.plot (whole-process seconds against input size)",
    "off": "our runtime, checkpoint.every_epochs and interval unset: no checkpoint during the "
    "epochs; the runtime's one forced final checkpoint (it commits the sink) still runs",
    "every": "our runtime, checkpoint.every_epochs: 1 (retained 1), checkpoint.incremental "
    "left at its default (true): a checkpoint at every epoch boundary, each committing that "
    "epoch's staged changelog",
    "every-full": "'every' with checkpoint.incremental: false (every checkpoint writes the whole "
    "state)",
    "every-delta": "'every' with sink format: delta (mode: upsert, a local table)",
    "every-tenth": "'every' with source.epoch_bytes = ceil(1.1 x input bytes / 10) instead of "
    "splits_per_epoch: 10 epochs, a checkpoint after each (the issue's 'at least every 10 %')",
    "every-changelog": "'every' with sink.changelog: true (each epoch's changed rows staged and "
    "committed, the state merged every epoch); every other variant of ours has "
    "changelog: false (the final table only, as W)",
    "peer-changelog": "Spark Structured Streaming at its best here: readStream parquet (schema "
    "given), maxFilesPerTrigger = files per epoch, groupBy(user).agg(count, sum, avg, min, max), "
    "RocksDBStateStoreProvider with spark.sql.streaming.stateStore.rocksdb."
    "changelogCheckpointing.enabled=true, trigger(availableNow=True), update mode, foreachBatch "
    "-> parquet per micro-batch",
    "peer-rocksdb": "'peer-changelog' with changelog checkpointing off (a RocksDB snapshot per "
    "micro-batch)",
    "warm-restart": "'every' with fail_task_after_epochs = 80 % of the epochs: that epoch's "
    "Spark job fails in a task (raise_error), the driver alive; the run restarts from its latest "
    "checkpoint in the same application (spec restarts) and runs to the end",
    "crash": "'every' with crash_after_epochs = 80 % of the epochs (SimulatedCrash)",
    "restore-p<N>": "restart from a copy of the crashed run's metastore, checkpoints and sink with "
    "restore=latest at parallelism N, to the end (final table published)",
    "run_s": "wall seconds from after the Spark session is up to the job's end (session start-up "
    "is recorded apart as session_s)",
    "cpu_s": "CPU seconds of the worker process tree (driver JVM, Python workers) over run_s",
    "with_session_s": "run_s + session_s: what a restart costs end to end, JVM start included",
    "figures": "per variant min / median / max over the rounds of run_s, cpu_s, with_session_s, "
    "checkpoints_snapshot_s / checkpoints_write_s (the run's checkpoints' snapshot_s / write_s "
    "summed; an asynchronous write overlaps the next epoch) and each timed phase (seconds summed "
    "over the run's calls; per-call seconds are in runs[].phase_calls_s; snapshot is the "
    "synchronous part, await_write the driver's wait for the previous snapshot's write)",
    "ratio": "value: median(numerator runs) / median(denominator runs); paired_by_round: the same "
    "ratio within each round (the variants of a round run back to back), with its min / median / "
    "max and relative_spread = (max - min) / median",
    "vs_structured_streaming": "every-changelog / the faster peer by median run_s "
    "(peer-changelog or peer-rocksdb; the one used is the ratio's denominator)",
    "too_wide_to_judge": SPREAD_RULE,
    "sink_s_per_checkpoint": "seconds in the sink's stage, commit and publish_final over the run, "
    "divided by its checkpoints",
    "delta_sink_cost_per_checkpoint": "sink_s_per_checkpoint of every-delta / every, per round "
    "(paired), with median, min, max and stdev",
    "checkpoint_costs": "per checkpoint, read after the run from its metastore: state_size "
    "(ckpt_checkpoints.state_size, the full state's bytes), checkpointed_size (bytes that "
    "checkpoint wrote; null while the metastore has no such column), the acks' summed state_size, "
    "max sync_ms / async_ms, changed_groups (sum of the keyed acks' state_meta.changed_groups; "
    "null when not reported); timed here: sync_s (the runtime's _snapshot call less its wait for "
    "the previous snapshot's write), write_s (the keyed state's background write, timed on its "
    "thread; null with synchronous snapshots) and snapshot_s = sync_s + write_s (with synchronous "
    "snapshots: the _snapshot call); null for checkpoints of an earlier run",
    "disk": "raw sequential write (512 MiB in 8 MiB blocks + fsync) and read (after "
    "posix_fadvise DONTNEED) of the disk under the work directory, at the run's start and end; "
    "the limit is the better of the two",
    "throughput": "snapshot_write_<variant>: bytes written (checkpointed_size, else state_size) / "
    "write seconds (write_s, the background write of an asynchronous snapshot; else snapshot_s) "
    "summed over the run's checkpoints, min / median / max over the rounds; "
    "restore_read: restored checkpoint's state_size / restore phase seconds over the restore "
    "runs; fraction_of_disk = median / the disk's limit; target >= 0.5",
    "growth": "see bench/spark_growth.py: every (incremental) and every-full at three sizes and "
    "two "
    "change rates (most keys per epoch; a moving window of 3 % of the keys per epoch), one run "
    "each; per checkpoint the bytes written, snapshot seconds, state size, changed key groups, "
    "keys touched and keys so far; changed_state_bytes_est = state_size * touched / so far",
}


def _f(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def print_summary(report: dict[str, Any]) -> None:
    s = report["settings"]
    if report.get("anchor"):
        print_anchor(report)
    if report.get("main"):
        print_main(report)
    if report.get("disk"):
        d = report["disk"]
        console.print(
            f"disk under the work dir: write {d['write_mib_s']} MiB/s, read {d['read_mib_s']} MiB/s"
        )
    t = (report.get("main") or {}).get("throughput") or {}
    if len(t) > 1:  # beyond its target: measured by the main runs (not by --growth-only)
        table = Table(title="Throughput vs the disk (target >= 50 %)")
        for col in ("", "MiB/s min / median / max", "of disk", ""):
            table.add_column(col, justify="left" if not col else "right")
        for name, v in t.items():
            if not isinstance(v, dict):
                continue
            m = v["mib_s"]
            mark = "[green]pass[/green]" if v["pass"] else "[red]MISS[/red]"
            table.add_row(
                name,
                f"{_f(m['min'], '.2f')} / {_f(m['median'], '.2f')} / {_f(m['max'], '.2f')}",
                f"{v['fraction_of_disk']:.1%}",
                mark,
            )
        console.print(table)
    if report.get("growth"):
        print_growth(report["growth"])
    m = report["machine"]
    console.print(
        f"[dim]{m['cpu_count']} CPUs ({m['cpu_model']}), Python {m['python']}, "
        f"Spark {m['packages']['pyspark']}, {m['java']}; load {m['loadavg_1m_before']} -> "
        f"{m['loadavg_1m_after']}, other Spark JVMs seen: {m['other_spark_jvms_max']}; "
        f"{report['duration_s']:.0f} s{' (quick)' if s['quick'] else ''}[/dim]"
    )


def print_anchor(report: dict[str, Any]) -> None:
    """Per size: W first, every variant as x W, the crash-at-80 % totals (issue 23)."""
    a, s = report["anchor"], report["settings"]
    for size in a["sizes"]:
        title = (
            f"x the plain Spark job W (whole processes): {size['events']:,} events, "
            f"{size['files']} files, {_mib(size['bytes'])} MiB, {s['rounds']} round(s)"
            + (" (quick: small data, noisy)" if s["quick"] else "")
        )
        table = Table(title=title)
        for col in ("run", "s median (min-max)", "x W", "paired per round", "goal", ""):
            table.add_column(col, justify="left" if col == "run" else "right")
        for variant, r in size["vs_plain"].items():
            p = size["process_s"][variant]
            goal = r.get("goal_max")
            table.add_row(
                "plain Spark job (W)" if variant == "plain" else variant,
                f"{p['median']:.1f} ({p['min']:.1f}-{p['max']:.1f})",
                f"{r['value']:.2f}x",
                f"{_f(r['paired']['min'], '.2f')}-{_f(r['paired']['max'], '.2f')}",
                "" if goal is None else f"<= {goal}x",
                _mark(r),
            )
        for variant, causes in size["failed"].items():
            why = "; ".join(dict.fromkeys(c or "?" for c in causes))
            table.add_row(variant, f"[red]failed x{len(causes)}[/red]", "", "", "", why[:70])
        c = size["crash_at_80"]
        plain, ours = c.get("plain_rerun"), c.get("ours_crashed_and_resumed")
        if plain:
            table.add_row(
                f"plain job crashed at {c['crash_fraction']:.0%}, rerun from zero",
                f"{plain['seconds_median']:.1f}",
                f"{plain['value']:.2f}x",
                "(formula)",
                "",
                "",
            )
        if ours:
            table.add_row(
                f"ours crashed at {c['crash_fraction']:.0%} and resumed",
                f"{ours['seconds_median']:.1f} ({ours['crashed_s_median']:.1f} + "
                f"{ours['resume_s_median']:.1f})",
                f"{ours['value']:.2f}x",
                f"{_f(ours['paired']['min'], '.2f')}-{_f(ours['paired']['max'], '.2f')}",
                f"<= {ours['goal_max']}x",
                _mark(ours),
            )
        console.print(table)
    check = a.get("session_settings", {})
    if check.get("compared") and not check["same"]:
        console.print(f"[yellow]session settings differ from W's: {check['differ']}[/yellow]")
    if a.get("plot"):
        console.print(f"plot: {a['plot']}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}" if n < 10 * 2**20 else f"{n / 2**20:.0f}"


def _mark(r: dict[str, Any]) -> str:
    if "meets_goal" not in r:
        return ""
    return "[green]goal met[/green]" if r["meets_goal"] else "[red]MISS[/red]"


def print_main(report: dict[str, Any]) -> None:
    s, main = report["settings"], report["main"]
    f = main["figures"]
    title = (
        f"Spark pipeline: {s['events']:,} events, {main['checks']['distinct_keys']} keys, "
        f"{s['epochs']} epochs, parallelism {s['parallelism']}, {s['rounds']} round(s)"
        + (" (quick)" if s["quick"] else "")
    )
    table = Table(title=title)
    for col in ("variant", "process s median", "run s min / median / max", "CPU s median",
                "snapshot s median", "driver waited s median"):  # fmt: skip
        table.add_column(col, justify="left" if col == "variant" else "right")
    for variant, v in f.items():
        r = v.get("run_s")
        snap = v.get("checkpoints_snapshot_s", {}).get("median")
        phases = v.get("phases_s", {})
        waited = [phases[k]["median"] for k in ("snapshot", "await_write") if k in phases]
        table.add_row(
            variant,
            _f(v.get("process_s", {}).get("median")),
            "-" if r is None else f"{r['min']:.1f} / {r['median']:.1f} / {r['max']:.1f}",
            _f(v.get("cpu_s", {}).get("median")),
            _f(snap),
            _f(sum(waited) if waited else None),
        )
    console.print(table)
    table = Table(title="Ratios (issue 16 targets)")
    for col in ("ratio", "value", "paired min / med / max", "spread", "CPU", "target", ""):
        table.add_column(col, justify="left" if col == "ratio" else "right")
    rs = main["ratios"]
    for name, r in rs.items():
        if not isinstance(r, dict) or "pass" not in r:
            continue
        if r["value"] is None:
            table.add_row(f"{name} ({r['numerator']} / {r['denominator']})", "not measured")
            continue
        mark = "[green]pass[/green]" if r["pass"] else "[red]MISS[/red]"
        if r["too_wide_to_judge"]:
            mark += " [yellow](too noisy)[/yellow]"
        elif r["too_wide_to_judge"] is None:
            mark += " [dim](1 round)[/dim]"
        p = r["paired"]
        table.add_row(
            f"{name} ({r['numerator']} / {r['denominator']})",
            f"{r['value']:.2f}x",
            f"{p['min']:.2f} / {p['median']:.2f} / {p['max']:.2f}",
            _f(r["relative_spread"], ".2f"),
            _f(rs["cpu"][name], ".2f") + "x",
            f"<= {r['target_max']}x",
            mark,
        )
    console.print(table)
    info = rs.get("informational", {})
    console.print(
        "every / peer: "
        + ", ".join(f"{k.removeprefix('every_vs_')} {_f(v, '.2f')}x" for k, v in info.items()
                    if k.startswith("every_vs_peer"))
        + f"; every / every-full {_f(info.get('every_vs_every_full'), '.2f')}x; every-full / off "
        f"{_f(info['every_full_overhead']['value'], '.2f')}x; ckpt run / every (whole processes) "
        f"{_f(info.get('every_cli_vs_every'), '.2f')}x"
    )  # fmt: skip
    cost = rs.get("delta_sink_cost_per_checkpoint")
    if cost:
        per = cost["sink_s_per_checkpoint"]
        console.print(
            f"Delta sink cost per checkpoint vs Parquet: {cost['median']:.2f}x (min "
            f"{cost['min']:.2f}, max {cost['max']:.2f}); {per['every-delta']:.3f} s vs "
            f"{per['every']:.3f} s"
        )


def print_growth(growth: dict[str, Any]) -> None:
    table = Table(title="Checkpoint cost growth (one run each)")
    for col in ("events", "change", "variant", "run s", "ckpts", "snapshot s median",
                "written MiB", "write MiB/s", "final state MiB", "written / state",
                "changed groups"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("change", "variant") else "right")
    for g in growth["summary"]:
        table.add_row(
            f"{g['events']:,}",
            g["change"],
            g["variant"],
            f"{g['run_s']:.1f}",
            str(g["checkpoints"]),
            _f(g["snapshot_s_median"], ".3f"),
            f"{g['written_bytes_total'] / 2**20:.1f}",
            _f(g.get("write_mib_s"), ".2f"),
            _f(g["final_state_bytes"] and g["final_state_bytes"] / 2**20),
            _f(g["written_per_state_median"], ".2f"),
            "yes" if g["changed_groups_recorded"] else "no",
        )
    console.print(table)
    if growth.get("plot"):
        console.print(f"plot: {growth['plot']}")


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)
