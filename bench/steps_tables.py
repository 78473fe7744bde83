# ruff: noqa: RUF001  (Markdown: the multiplication sign and en dash are meant)
"""The step API's figures (issue 39), generated from ``bench/results/steps.json``,
``steps-long.json`` (``bench/steps_bench.py``; the same job on 12 M orders, and on a longer run
with the runs issue 39's goals need) and ``steps-narrow.json`` (``bench/steps_narrow.py``, the
partial resume counted) by ``bench/readme_tables.py`` into two sections:

* ``docs/steps.md``, between ``<!-- steps-cost:begin -->`` and ``<!-- steps-cost:end -->``: the
  tables (every step checkpointed, the crash at 80 % of W, the crash in step 4, and the same
  three with the join chained, each / W; then the longer run's, and the partial resume's);
* ``README.md``, between ``<!-- steps:begin -->`` and ``<!-- steps:end -->``: its first
  screen's cost, the step API's headline figures.
"""

from __future__ import annotations

import statistics
from typing import Any

from machine import load_flags

STEPS = ("<!-- steps-cost:begin -->", "<!-- steps-cost:end -->")
GLANCE = ("<!-- steps:begin -->", "<!-- steps:end -->")
#: said of a run made before the bench flushed its data and ran W once, untimed, first
NO_WARM_UP = " (measured before the bench flushed its data and ran W once untimed first)"
NOT_MEASURED = (
    "not measured yet (`python bench/steps_bench.py`, then `python bench/readme_tables.py`)"
)


def _x(p: dict[str, Any] | None) -> str:
    if not p:
        return "–"
    return f"{p['median']:.2f}× ({p['min']:.2f}–{p['max']:.2f})"


def _w_s(report: dict[str, Any]) -> float:
    return statistics.median(float(v) for v in report["w_seconds"].values())


def _seconds(report: dict[str, Any], key: str) -> str:
    values = [float(v) for v in (report.get(key) or {}).values()]
    return f"{statistics.median(values):.1f} s" if values else "–"


def _checked(runs: list[dict[str, Any]]) -> tuple[int, bool]:
    """How many runs were flagged as under load, and whether every output equalled W's."""
    flagged = sum(1 for run in runs if load_flags(run))
    return flagged, all(run.get("output_equals_w", True) for run in runs)


def long_section(report: dict[str, Any] | None) -> str:
    """docs/steps.md's second table: the same job on a longer run, the goals' rows only."""
    if report is None:
        return ""
    r, runs = report["ratios"], report["runs"]
    flagged, equal = _checked(runs)
    rows = [
        ("every step checkpointed", _x(r.get("steps_over_w")), "≤ 1.25×"),
        ("the join chained, every other step checkpointed", _x(r.get("chained_over_w")), "≤ 1.25×"),
        (
            "the join chained, SIGKILLed as step 4 starts, + resume",
            _x(r.get("chained_killed_in_step_4_resumed_over_w")),
            "≤ 1.35×",
        ),
        (
            f"its resume alone ({_seconds(report, 'chained_resume_seconds')})",
            _x(r.get("chained_resume_after_step_4_over_w")),
            "",
        ),
        (f"start alone ({_seconds(report, 'start_seconds')})", _x(r.get("start_over_w")), ""),
    ]
    table = "\n".join(
        ["| run | / W (median, min–max) | issue 39's goal |", "|---|---|---|"]
        + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    )
    date = str(report.get("date") or "")
    return (
        f"\nThe same job on a longer run, `bench/results/steps-long.json`"
        f"{', ' + date if date else ''}: {report['orders']:,} orders, {report['rounds']} paired "
        f"round(s), W {_w_s(report):.1f} s (median), {flagged} of {len(runs)} runs flagged as "
        f"under load; every checkpointed output {'equal' if equal else 'NOT equal'} to W's. "
        "Only the runs the goals need (`--goals-only`):\n\n"
        f"{table}\n"
    )


def narrow_section(report: dict[str, Any] | None) -> str:
    """docs/steps.md's third table: a narrow step killed half way, its resume counted."""
    if report is None:
        return ""
    r, runs = report["ratios"], report["runs"]
    flagged, equal = _checked(runs)
    tasks = report["tasks"]
    rows = []
    for run in runs:
        if run.get("variant") != "resumed":
            continue
        kept = (run.get("partitions_salvaged") or {}).get("scored", 0)
        computed = (run.get("partitions_computed") or {}).get("scored", 0)
        killed = next(
            k for k in runs if k.get("variant") == "killed-half-way" and k["round"] == run["round"]
        )
        rows.append(
            f"| {run['round']} | {killed.get('committed_at_kill', '–')} of {tasks} | {kept} | "
            f"{computed} | {'yes' if kept + computed == tasks else 'NO'} |"
        )
    counts = "\n".join(
        [
            "| round | `scored`'s files at the kill | partitions kept | partitions recomputed "
            "| kept + recomputed = its tasks |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    date = str(report.get("date") or "")
    return (
        f"\nA narrow step killed half way, `bench/results/steps-narrow.json`"
        f"{', ' + date if date else ''} (`bench/steps_narrow.py`): {report['orders']:,} orders "
        f"repartitioned into {tasks} (the step `base`), a hash of each row over it (the narrow "
        f"step `scored`, `input=base`), the write; SIGKILLed once half of `scored`'s task files "
        f"are committed, then resumed; {report['rounds']} paired round(s), W "
        f"{_w_s(report):.1f} s (median), {flagged} of {len(runs)} runs flagged as under load; "
        f"every output {'equal' if equal else 'NOT equal'} to W's. The job, every step "
        f"checkpointed: {_x(r.get('narrow_over_w'))} W; killed half way and resumed: "
        f"{_x(r.get('killed_resumed_over_w'))} W in all, against "
        f"{_x(r.get('killed_rerun_over_w'))} for the same crash and a rerun of W.\n\n"
        f"{counts}\n"
    )


def steps_section(
    report: dict[str, Any] | None,
    generated: str,
    long: dict[str, Any] | None = None,
    narrow: dict[str, Any] | None = None,
) -> str:
    """docs/steps.md's tables."""
    extra = long_section(long) + narrow_section(narrow)
    if report is None:
        return f"{generated}\n{NOT_MEASURED}\n" + extra
    r = report["ratios"]
    runs = report["runs"]
    w_s = _w_s(report)
    flagged = sum(1 for run in runs if load_flags(run))
    equal = all(run.get("output_equals_w", True) for run in runs)
    reused = sorted(
        {
            tuple(run.get("reused") or ())
            for run in runs
            if run.get("variant") == "resumed-after-step-4" and run["mode"] == "steps"
        }
    )
    date = str(report.get("date") or "")
    rows = [
        (
            "every step checkpointed (join, aggregate, window, write)",
            _x(r["steps_over_w"]),
            "≤ 1.25×",
        ),
        (
            f"SIGKILLed at {report['crash_at']:.0%} of W's time, + resume",
            _x(r["crashed_resumed_over_w"]),
            f"(W rerun: {1 + report['crash_at']:.2f}×)",
        ),
        (
            "SIGKILLed as step 4 starts, + resume",
            _x(r.get("killed_in_step_4_resumed_over_w")),
            "≤ 1.35×",
        ),
        (
            "the join chained (`chained=True`), every other step checkpointed",
            _x(r.get("chained_over_w")),
            "≤ 1.25×",
        ),
        (
            f"the join chained, SIGKILLed at {report['crash_at']:.0%} of W's time, + resume",
            _x(r.get("chained_crashed_resumed_over_w")),
            f"(W rerun: {1 + report['crash_at']:.2f}×)",
        ),
        (
            "the join chained, SIGKILLed as step 4 starts, + resume",
            _x(r.get("chained_killed_in_step_4_resumed_over_w")),
            "≤ 1.35×",
        ),
    ]
    parts = [
        (
            "by hand / W: each step written with Spark's writer and read back, the floor any "
            "checkpoint of every step pays",
            _x(r.get("manual_over_w")),
        ),
        ("steps / by hand: what the step API adds to that floor", _x(r.get("steps_over_manual"))),
        (
            "resume alone / W, after the kill in step 4",
            _x(r.get("resume_after_step_4_over_w")),
        ),
        (
            "start alone / W: a process that starts its session and reads the inputs' schemas",
            _x(r.get("start_over_w")),
        ),
    ]
    table = "\n".join(
        ["| run | / W (median, min–max) | issue 39's goal |", "|---|---|---|"]
        + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    )
    made_of = "\n".join(
        ["| what the figures are made of | ratio (median, min–max) |", "|---|---|"]
        + [f"| {a} | {b} |" for a, b in parts]
    )
    return (
        f"{generated}\n"
        f"`bench/results/steps.json`{', ' + date if date else ''}: {report['orders']:,} orders "
        f"joined with {report['customers']:,} customers on `{report['master']}`, "
        f"{report['rounds']} paired round(s), whole processes (Python and JVM start included); "
        f"W {w_s:.1f} s (median), {flagged} of {len(runs)} runs flagged as under load; every "
        f"checkpointed output {'equal' if equal else 'NOT equal'} to W's"
        f"{'' if report.get('warm_up') else NO_WARM_UP}.\n\n{table}\n\n"
        f"{made_of}\n\n"
        f"After the kill in step 4 the resume reused "
        f"{', '.join(map(str, reused[0])) if reused else 'nothing'}.\n" + extra
    )


def steps_glance(
    report: dict[str, Any] | None, generated: str, long: dict[str, Any] | None = None
) -> str:
    """The README's first-screen cost: the step API's headline figures, from the longer run
    (the project is for long jobs) when there is one, then the 12 M orders run's; the job as
    the README shows it (its join chained) first, then with every step's rows written."""
    main = long if long and long["ratios"].get("chained_over_w") else report
    if main is None or not main["ratios"].get("steps_over_w"):
        return f"{generated}\n**What it costs**: {NOT_MEASURED}.\n"

    def three(r: dict[str, Any]) -> tuple[str, str, str]:
        def m(key: str) -> str:
            return f"{r[key]['median']:.2f}×" if r.get(key) else "–"

        return (
            m("steps_over_w"),
            m("chained_over_w"),
            m("chained_killed_in_step_4_resumed_over_w"),
        )

    every, chained, killed = three(main["ratios"])
    text = (
        f"{generated}\n**What it costs** ([every figure](docs/steps.md#cost)), against W, the "
        "same script without `ck`, on the job below (whole processes, "
        f"`{main['master']}`, {main['orders'] / 1e6:.0f} M orders, W {_w_s(main):.0f} s): as "
        f"shown (the join's step chained: its rows recomputed by the step that reads them, not "
        f"written), **{chained} W**, and killed as its last step starts and resumed, "
        f"**{killed} W** in all; without `chained=True`, the join's rows written and read "
        f"back, **{every} W**"
    )
    if main is not report and report is not None:
        short = three(report["ratios"])
        text += (
            f". On a W of {_w_s(report):.0f} s, where a resume's new process is half of W: "
            f"{short[1]}, {short[2]} and {short[0]}"
        )
    return text + ".\n"
