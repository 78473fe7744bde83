# ruff: noqa: RUF001  (Markdown: the multiplication sign and en dash are meant)
"""The step API's figures (issue 39), generated from ``bench/results/steps.json``
(``bench/steps_bench.py``) by ``bench/readme_tables.py`` into two sections:

* ``docs/steps.md``, between ``<!-- steps-cost:begin -->`` and ``<!-- steps-cost:end -->``: the
  table (every step checkpointed, the crash at 80 % of W, the crash in step 4, and the same
  three with the join chained, each / W);
* ``README.md``, between ``<!-- steps:begin -->`` and ``<!-- steps:end -->``: its first
  screen's line on the step API, with the headline figure.
"""

from __future__ import annotations

import statistics
from typing import Any

from machine import load_flags

STEPS = ("<!-- steps-cost:begin -->", "<!-- steps-cost:end -->")
GLANCE = ("<!-- steps:begin -->", "<!-- steps:end -->")
NOT_MEASURED = (
    "not measured yet (`python bench/steps_bench.py`, then `python bench/readme_tables.py`)"
)


def _x(p: dict[str, Any] | None) -> str:
    if not p:
        return "–"
    return f"{p['median']:.2f}× ({p['min']:.2f}–{p['max']:.2f})"


def steps_section(report: dict[str, Any] | None, generated: str) -> str:
    """docs/steps.md's table."""
    if report is None:
        return f"{generated}\n{NOT_MEASURED}\n"
    r = report["ratios"]
    runs = report["runs"]
    w_s = statistics.median(float(v) for v in report["w_seconds"].values())
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
        f"checkpointed output {'equal' if equal else 'NOT equal'} to W's.\n\n{table}\n\n"
        f"{made_of}\n\n"
        f"After the kill in step 4 the resume reused "
        f"{', '.join(map(str, reused[0])) if reused else 'nothing'}.\n"
    )


def steps_glance(report: dict[str, Any] | None, generated: str) -> str:
    """The README's first-screen line on the step API."""
    ratios = report["ratios"] if report else {}
    figure = (
        f"every step checkpointed, {ratios['steps_over_w']['median']:.2f}× W on our 4-step "
        "benchmark"
        if ratios.get("steps_over_w")
        else "not measured yet"
    )
    if ratios.get("chained_over_w"):
        figure += f"; {ratios['chained_over_w']['median']:.2f}× with its join chained"
    return (
        f"{generated}\nAny other DataFrame job: name its steps, "
        f'`ck.step("joined", lambda: ...)` ([docs/steps.md](docs/steps.md); new: {figure}).\n'
    )
