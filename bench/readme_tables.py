# ruff: noqa: RUF001, RUF002  (Markdown: the multiplication sign and en dash are meant)
"""README's benchmark tables, generated from ``bench/results/*.json`` (issue 37) and written between
the markers ``<!-- bench:begin -->`` and ``<!-- bench:end -->``::

    python bench/readme_tables.py            # rewrite README.md's section
    python bench/readme_tables.py --check    # exit 1 when README.md's section differs
    python bench/readme_tables.py --print    # print the section

Every ratio is the median of the paired per-round ratios with their min–max (the runs of a round
run back to back); the load each run was taken under is stated from the JSON's per-run records
(``machine.load_flags``), never assumed. Sources: ``acks.json``, ``issue37.json`` (one line when it
does not exist yet), ``spark-anchor.json``, ``spark-anchor-50m.json`` and ``spark.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/'s modules, beside this file

from machine import BUSY_LIMIT, BUSY_WINDOW_S, LOAD_LIMIT, load_flags

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
README = BENCH.parent / "README.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"

#: anchor variants -> README row labels, in order
ANCHOR_ROWS = {
    "plain": "**plain Spark job (W)**",
    "design": "the hand-written design (`bench/design_job.py`)",
    "off": "ours, checkpoints off",
    "every": "ours, checkpoint every epoch (20)",
    "every-tenth": "ours, checkpoint every 10 % of the input (10 epochs by `epoch_bytes`)",
    "every-cli": "`ckpt run`, checkpoint every epoch",
    "every-changelog": "ours every epoch with the changelog (`changelog: true`)",
    "peer-changelog": "Structured Streaming, RocksDB + changelog",
    "warm-restart": "ours with a task failure at 80 %, warm restart in the same application",
}
SETS_LABELS = {
    "a": "a: 5 M events / ~510 k keys",
    "b": "b: 5 M events / 5 k keys",
    "c": "c: 50 M events / 5.1 M keys",
    "d": "d: 50 M events / 500 k keys, crash at 80 %",
}


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def paired(p: dict[str, Any] | None) -> str:
    """A paired ratio: its median and (min–max); one round: the median alone."""
    if not p or p.get("median") is None:
        return "not measured"
    if p["min"] == p["max"]:
        return x(p["median"])
    return f"{x(p['median'])} ({p['min']:.2f}–{p['max']:.2f})"


def paired_of(values: list[float]) -> dict[str, Any] | None:
    """min / median / max of per-round ratios already computed (old results' paired_by_round)."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def secs(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f} s"


def load_line(runs: list[dict[str, Any]]) -> str:
    """How many runs were taken under load, from their own records."""
    flagged = [r for r in runs if load_flags(r)]
    loads = [r["loadavg_1m"] for r in runs if r.get("loadavg_1m") is not None]
    jvms = max((r.get("other_spark_jvms") or 0 for r in runs), default=0)
    java = max(
        (r.get(k) or 0 for r in runs for k in ("other_java_start", "other_java_max")), default=0
    )
    busy = [r["cpu_busy_before"] for r in runs if r.get("cpu_busy_before") is not None]
    idle = (
        f"at most {BUSY_LIMIT:.0%} of the cores busy in the {BUSY_WINDOW_S:g} s before each"
        if busy
        else f"1-min load ≤ {LOAD_LIMIT} before each"
    )
    if not flagged:
        return f"Load: none of the {len(runs)} runs was flagged ({idle}, no other JVM)."
    parts = [f"cores {min(busy):.0%}–{max(busy):.0%} busy before the runs"] if busy else []
    if loads and not busy:
        parts.append(f"1-min load {min(loads):.2f}–{max(loads):.2f} before the runs")
    if jvms:
        parts.append(f"up to {jvms} other Spark JVM(s)")
    if java:
        parts.append(f"up to {java} other JVM(s)")
    return (
        f"Load: **{len(flagged)} of {len(runs)} runs flagged** as taken under load "
        f"(not {idle}, or another JVM running; {', '.join(parts)}): the "
        "machine was not idle, so compare ratios, not seconds."
    )


def acks_section(report: dict[str, Any]) -> str:
    r, t = report["results"], report["targets"]

    def row(backend: str) -> dict[str, Any]:
        b = r[backend]
        return {
            "batched": f"{b['batched']['acks_per_s']:,.0f}",
            "single": f"{b['single']['acks_per_s']:,.0f}",
            "completion": f"{b['completion']['ms']['median']:.0f} / "
            f"{b['completion']['ms']['p95']:.0f}",
        }

    sq, pg = row("sqlite"), row("postgresql")
    pgr = r["postgresql"]
    single_met = pgr["single"]["acks_per_s"] >= t["single_acks_per_s_min"]
    batched_met = pgr["batched"]["acks_per_s"] >= t["batched_acks_per_s_min"]
    completion_met = pgr["completion"]["ms"][t["completion_statistic"]] <= t["completion_ms_max"]
    m, s = report["machine"], report["settings"]
    missed = {True: "", False: " (missed)"}
    return "\n".join(
        [
            f"`bench/results/acks.json` ({report['generated_at'][:10]}, {m['cpu_count']} cores, "
            f"PostgreSQL {m.get('postgresql', '?').split()[0]} on the same machine, "
            f"`synchronous_commit={m.get('postgresql_synchronous_commit', '?')}`, "
            f"{s['tasks']:,}-task checkpoints; 1-min load {m['loadavg_1m_before']} before, "
            f"{m['loadavg_1m_after']} after):",
            "",
            "| metric | SQLite | PostgreSQL | target (PostgreSQL) |",
            "|---|---|---|---|",
            f"| batched acks/s (batches of {s['batch']}) | {sq['batched']} | {pg['batched']} "
            f"| ≥ {t['batched_acks_per_s_min']:,}{missed[batched_met]} |",
            f"| single-ack transactions/s, {s['writers']} writer processes | {sq['single']} | "
            f"{pg['single']} | ≥ {t['single_acks_per_s_min']:,}{missed[single_met]} |",
            f"| last ack → COMPLETED, median / p95 (ms) | {sq['completion']} | "
            f"{pg['completion']} | ≤ {t['completion_ms_max']}{missed[completion_met]} |",
        ]
    )


def issue37_table(report: dict[str, Any]) -> str:
    """Issue 37's table: per set W, the design and ours, paired ratios, memory, load."""
    s = report["settings"]
    head = (
        f"`{report['command']}` ({report['generated_at'][:10]}, {s['rounds']} round(s), "
        f"{s['files']} files, {s['files_per_epoch']} per epoch ({s['epochs']} epochs), "
        f"`{s['master']}`, parallelism {s['parallelism']}"
        + (f", scale {s['scale']:g} of the issue's sizes" if s["scale"] != 1 else "")
        + "; whole processes; × = median of the paired per-round ratios (min–max)):"
    )
    rows = [
        head,
        "",
        "| set | W | design | ours | ours / W | ours / design | design / W "
        "| crashed + resumed / W (plain rerun) | peak RSS W / design / ours (ours / W) "
        "| runs flagged |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, x37 in report["sets"].items():
        p, r, mem = x37["process_s"], x37["ratios"], x37["peak_rss_bytes"]
        label = SETS_LABELS.get(name, name)
        if s["scale"] != 1:
            label = f"{name}: {x37['label']}"
        crash = "–"
        if x37["crash"]:
            crash = f"{paired(r.get('crash_resume_vs_w'))} ({x(r.get('plain_rerun_vs_w'))})"
        mib = [mem[v]["median"] for v in ("plain", "design", "ours")]
        rss = " / ".join("–" if v is None else f"{v / 2**20:,.0f}" for v in mib)
        failed = f"; failed: {', '.join(x37['failed'])}" if x37["failed"] else ""
        check = "" if x37["checks"]["consistent"] else " **(outputs differ)**"
        rows.append(
            f"| {label}{check} | {secs(p['plain']['median'])} | {secs(p['design']['median'])} "
            f"| {secs(p['ours']['median'])} | {paired(r['ours_vs_w'])} "
            f"| {paired(r['ours_vs_design'])} | {paired(r['design_vs_w'])} | {crash} "
            f"| {rss} MiB ({paired(mem['ours_vs_w'])}) | {x37['flagged_runs']} of "
            f"{x37['runs']}{failed} |"
        )
    rows += ["", load_line(report["runs"])]
    return "\n".join(rows)


def anchor_table(report: dict[str, Any], title: str) -> str:
    """An anchor run's first size: every variant as × W (paired medians), the crash totals."""
    size = report["anchor"]["sizes"][0]
    s = report["settings"]
    rows = [
        f"{title} ({report['generated_at'][:10]}: {size['events']:,} events, "
        f"{size['files']} files in {s['epochs']} epochs, {s['rounds']} rounds, whole processes; "
        "× W = median of the paired per-round ratios (min–max)):",
        "",
        f"| run ({size['events'] / 1e6:g} M events) | whole process, median | × W | goal |",
        "|---|---|---|---|",
    ]
    vs = size["vs_plain"]
    for variant, label in ANCHOR_ROWS.items():
        if variant not in vs:
            continue
        v = vs[variant]
        goal = v.get("goal_max")
        mark = "" if goal is None else f"≤ {goal}" + ("" if v.get("meets_goal") else " (missed)")
        ratio = "1.00" if variant == "plain" else paired(paired_of(v["paired_by_round"]))
        rows.append(f"| {label} | {secs(v['seconds_median'])} | {ratio} | {mark} |")
    for variant, causes in size.get("failed", {}).items():
        rows.append(f"| {ANCHOR_ROWS.get(variant, variant)} | failed ×{len(causes)} | | |")
    c = size["crash_at_80"]
    if c.get("plain_rerun"):
        rows.append(
            f"| plain job crashed at {c['crash_fraction']:.0%} and rerun from zero "
            f"| (0.8 W + W) | {x(c['plain_rerun']['value'])} | |"
        )
    ours = c.get("ours_crashed_and_resumed")
    if ours:
        goal = f"≤ {ours['goal_max']}" + ("" if ours["meets_goal"] else " (missed)")
        rows.append(
            f"| ours crashed at {c['crash_fraction']:.0%} (killed) and resumed in a new process "
            f"({ours['crashed_s_median']:.1f} s + {ours['resume_s_median']:.1f} s) "
            f"| {secs(ours['seconds_median'])} | {paired(paired_of(ours['paired_by_round']))} "
            f"| {goal} |"
        )
    rows += ["", load_line(report["runs"])]
    return "\n".join(rows)


def ratios_table(report: dict[str, Any]) -> str:
    """The full run before the anchor existed: issue 16's ratios."""
    r = report["main"]["ratios"]
    names = {
        "checkpoint_overhead": "checkpoint every epoch / off",
        "vs_structured_streaming": "every epoch (changelog) / Structured Streaming",
        "recovery": "restart after a crash at 80 % / a full run",
    }
    rows = [
        f"The full run before the anchor existed (`bench/results/spark.json`, "
        f"{report['generated_at'][:10]}, {report['settings']['rounds']} rounds, in-process "
        "run_s; median of the paired per-round ratios (min–max)):",
        "",
        "| ratio | value | target |",
        "|---|---|---|",
    ]
    for key, v in r.items():
        if not isinstance(v, dict) or "pass" not in v or v["value"] is None:
            continue
        label = names.get(key, key.replace("_", " "))
        if key.startswith("rescaled_restore_"):
            a, b = key.removeprefix("rescaled_restore_").split("_to_")
            label = f"rescaled restore {a}→{b} / same-parallelism restore"
        miss = "" if statistics.median(v["paired_by_round"]) <= v["target_max"] else " (missed)"
        rows.append(
            f"| {label} | {paired(paired_of(v['paired_by_round']))} | ≤ {v['target_max']}{miss} |"
        )
    rows += ["", load_line(report["runs"])]
    return "\n".join(rows)


def generate() -> str:
    parts = [
        "<!-- generated by `python bench/readme_tables.py` from bench/results/*.json: "
        "edit those or the script, not this section -->"
    ]
    if acks := load("acks.json"):
        parts.append(acks_section(acks))
    i37 = load("issue37.json")
    parts.append(
        "**Issue 37** (W, the hand-written design and ours on four data sets): "
        + (
            "\n\n" + issue37_table(i37)
            if i37
            else "not measured yet — `bench/results/issue37.json` does not exist (run "
            "`python bench/spark_bench.py --issue37`, then `python bench/readme_tables.py`)."
        )
    )
    if a := load("spark-anchor.json"):
        parts.append(anchor_table(a, "The anchor run, `bench/results/spark-anchor.json`"))
    if a := load("spark-anchor-50m.json"):
        parts.append(anchor_table(a, "The realistic size, `bench/results/spark-anchor-50m.json`"))
    if sp := load("spark.json"):
        parts.append(ratios_table(sp))
    return "\n\n".join(parts) + "\n"


def readme_section(text: str) -> str:
    """README's text between the markers (exclusive, the newline after BEGIN dropped)."""
    if BEGIN not in text or END not in text:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} section")
    return text.split(BEGIN, 1)[1].split(END, 1)[0].removeprefix("\n")


def replaced(text: str, section: str) -> str:
    head, rest = text.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{section}{END}{rest.split(END, 1)[1]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="README's benchmark tables from bench/results/*.json")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="exit 1 when README.md's section differs")
    g.add_argument("--print", action="store_true", help="print the generated section")
    p.add_argument("--readme", type=Path, default=README)
    args = p.parse_args(argv)
    section = generate()
    if args.print:
        print(section, end="")
        return 0
    text = args.readme.read_text()
    if args.check:
        if readme_section(text) != section:
            print(f"{args.readme}: the benchmark tables differ from bench/results/*.json (run "
                  "python bench/readme_tables.py)", file=sys.stderr)  # fmt: skip
            return 1
        return 0
    readme_section(text)  # the markers must be there
    new = replaced(text, section)
    if new != text:
        args.readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
