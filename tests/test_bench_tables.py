# ruff: noqa: RUF001  (Markdown: the multiplication sign and en dash are meant)
"""docs/benchmarks.md's tables, README.md's cost sections (the step API's on its first screen,
a spec's headline cost and its one-paragraph summary) and docs/steps.md's tables are generated
from bench/results/*.json, and the paired statistics they report are the median of per-round
ratios, not a ratio of medians."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import readme_tables  # noqa: E402
import spark_stats  # noqa: E402
from machine import load_flags  # noqa: E402


def test_benchmarks_page_holds_the_generated_tables() -> None:
    text = readme_tables.BENCHMARKS.read_text()
    assert readme_tables.BEGIN in text and readme_tables.END in text
    assert readme_tables.TABLES.of(text, readme_tables.BENCHMARKS) == readme_tables.generate(), (
        "docs/benchmarks.md's tables differ from bench/results/*.json: run "
        "python bench/readme_tables.py"
    )


def test_readme_holds_a_specs_generated_cost() -> None:
    text = readme_tables.README.read_text()
    assert readme_tables.COST.of(text, readme_tables.README) == readme_tables.generate_cost(), (
        "README.md's headline cost differs from bench/results/*.json: run "
        "python bench/readme_tables.py"
    )
    assert readme_tables.BEGIN not in text  # the full tables live in docs/benchmarks.md


def test_the_readme_summarises_a_specs_generated_cost() -> None:
    """A spec's cost is generated from the same JSON, typed by no one: the range of ours / W
    over the four sets, the crash against W's rerun, Structured Streaming against W; it sits
    where the README shows a spec, the first screen's cost being the step API's
    (tests/test_readme_first_screen.py renders where)."""
    text = readme_tables.README.read_text()
    glance = readme_tables.GLANCE.of(text, readme_tables.README)
    assert glance == readme_tables.generate_glance(), (
        "README.md's first-screen cost differs from bench/results/*.json: run "
        "python bench/readme_tables.py"
    )
    lines = text.splitlines()
    # the first screen's cost is the step API's, under the title's paragraph; a spec's where
    # the README shows a spec
    assert lines.index(readme_tables.STEPS_LINE.begin) < 15
    spec_section = text.split("## Your job, before and after", 1)[1].split("\n## ", 1)[0]
    assert readme_tables.GLANCE_BEGIN in spec_section and readme_tables.GLANCE_END in spec_section
    i37 = readme_tables.load("issue37.json")
    assert i37, "bench/results/issue37.json is the README's source"
    medians = sorted(s["ratios"]["ours_vs_w"]["median"] for s in i37["sets"].values())
    assert f"**{medians[0]:.2f}–{medians[-1]:.2f}× W**" in glance
    crashed = i37["sets"]["d"]["ratios"]
    assert f"{crashed['crash_resume_vs_w']['median']:.2f}× W in all" in glance
    assert f"costs {crashed['plain_rerun_vs_w']:.2f}×" in glance
    assert "just be rerun" in glance  # resuming set d cost more than its rerun
    assert "Structured Streaming `Trigger.AvailableNow` took **" in glance
    assert f"]({readme_tables.COST_ANCHOR})" in glance and "## Should you use it?" in text


def test_check_fails_on_a_changed_section_and_the_writer_fixes_it(tmp_path: Path) -> None:
    readme, bench = tmp_path / "README.md", tmp_path / "benchmarks.md"
    steps_doc = tmp_path / "steps.md"
    cost, tables = readme_tables.generate_cost(), readme_tables.generate()
    glance = readme_tables.generate_glance()
    line, table = (section.begin + "\n" + section.end for section in (
        readme_tables.STEPS_LINE, readme_tables.STEPS_TABLE
    ))  # fmt: skip
    readme.write_text(
        f"# x\n\n{readme_tables.GLANCE_BEGIN}\n{glance}{readme_tables.GLANCE_END}\n\n{line}\n\n"
        f"{readme_tables.COST_BEGIN}\n{cost}{readme_tables.COST_END}\n\nafter\n"
    )
    bench.write_text(f"# b\n\n{readme_tables.BEGIN}\n{tables}{readme_tables.END}\n\nend\n")
    steps_doc.write_text(f"# s\n\n{table}\n")
    paths = ["--readme", str(readme), "--benchmarks", str(bench), "--steps", str(steps_doc)]
    assert readme_tables.main(["--check", *paths]) == 1  # the step sections are empty
    assert readme_tables.main(paths) == 0
    assert readme_tables.main(["--check", *paths]) == 0
    for path in (bench, readme, steps_doc):
        assert "edit those or the script" in path.read_text()
        path.write_text(path.read_text().replace("edit those or the script", "hand-edited"))
        assert readme_tables.main(["--check", *paths]) == 1
        assert readme_tables.main(paths) == 0
        assert readme_tables.main(["--check", *paths]) == 0
    readme.write_text(readme.read_text().replace("**What a spec costs**", "**Cost**"))
    assert readme_tables.main(["--check", *paths]) == 1  # a spec's summary too
    assert readme_tables.main(paths) == 0
    assert readme_tables.GLANCE.of(readme.read_text(), readme) == glance
    assert readme.read_text().endswith(f"{readme_tables.COST_END}\n\nafter\n")
    assert bench.read_text().endswith(f"{readme_tables.END}\n\nend\n")
    bench.write_text("# no markers\n")
    with pytest.raises(SystemExit, match="no <!-- bench:begin -->"):
        readme_tables.main(paths)


def test_median_of_paired_ratios_is_not_the_ratio_of_medians() -> None:
    # round 1 was slow for the denominator only: its pair says 0.5, the others 2.0
    ours = {0: 10.0, 1: 20.0, 2: 30.0}
    w = {0: 5.0, 1: 40.0, 2: 15.0}
    p = spark_stats.paired_ratios(ours, w)
    assert p == {
        "median": 2.0,
        "min": 0.5,
        "max": 2.0,
        "per_round": [2.0, 0.5, 2.0],
        "rounds": [0, 1, 2],
    }
    assert spark_stats.ratio_of_medians(ours, w) == pytest.approx(20 / 15, abs=1e-3)
    assert p["median"] != spark_stats.ratio_of_medians(ours, w)


def test_paired_ratios_pair_only_rounds_both_sides_have() -> None:
    p = spark_stats.paired_ratios({0: 3.0, 1: 6.0, 3: 9.0}, {0: 1.0, 1: 4.0, 2: 5.0})
    assert p is not None
    assert p["rounds"] == [0, 1]
    assert p["per_round"] == [3.0, 1.5]
    assert p["median"] == 2.25  # the even count's middle two, averaged
    assert spark_stats.paired_ratios({0: 1.0}, {1: 1.0}) is None
    assert spark_stats.paired_ratios({}, {}) is None


def test_a_run_under_load_is_flagged() -> None:
    assert load_flags({"loadavg_1m": 0.3, "other_spark_jvms": 0}) == []
    assert load_flags({"loadavg_1m": 0.9, "other_spark_jvms": 0}) == [
        "1-min load 0.9 > 0.5 before the run"
    ]
    assert load_flags({"loadavg_1m": 0.1, "other_java_max": 2}) == ["2 other JVM(s) running"]


def issue37_run(variant: str, r: int, s: float, rss: int = 100, load: float = 0.1) -> dict:
    return {
        "variant": variant,
        "round": r,
        "process_s": s,
        "peak_rss_bytes": rss,
        "loadavg_1m": load,
        "load_flags": load_flags({"loadavg_1m": load}),
        "output_keys": 5,
        "output_events": 50,
        "output_digest": "same",
    }


def issue37_runs() -> list[dict]:
    run = issue37_run
    return [
        run("plain", 0, 10.0, 100),
        run("design", 0, 15.0),
        run("ours", 0, 30.0, 300),
        {**run("ours-crash", 0, 20.0), "output_digest": None},
        run("ours-resume", 0, 10.0),
        run("plain", 1, 20.0, 200, load=2.0),
        run("design", 1, 20.0),
        run("ours", 1, 30.0, 200),
        {**run("ours-crash", 1, 25.0), "output_digest": None},
        run("ours-resume", 1, 15.0),
    ]


DATA = {"events": 50, "keys_parameter": 5, "dir": "/x", "files": 20, "bytes": 1}


def test_issue37_set_reports_paired_ratios_and_the_crash_total() -> None:
    import issue37

    runs = issue37_runs()
    x = issue37.set_section("d", DATA, runs, rounds=2)
    assert x["ratios"]["ours_vs_w"]["per_round"] == [3.0, 1.5]
    assert x["ratios"]["ours_vs_w"]["median"] == 2.25
    assert x["ratios"]["ours_vs_design"]["per_round"] == [2.0, 1.5]
    assert x["ratios"]["design_vs_w"]["per_round"] == [1.5, 1.0]
    assert x["ratios"]["crash_resume_vs_w"]["per_round"] == [3.0, 2.0]
    assert x["ratios"]["plain_rerun_vs_w"] == 1.8
    assert x["peak_rss_bytes"]["ours_vs_w"]["per_round"] == [3.0, 1.0]
    assert x["process_s"]["plain"]["per_round"] == [10.0, 20.0]
    assert x["flagged_runs"] == 1
    assert x["checks"]["consistent"]
    runs[2]["output_digest"] = "other"  # ours wrote another table than W's
    assert not issue37.set_section("d", DATA, runs, rounds=2)["checks"]["consistent"]


def test_readme_cost_comes_from_the_four_sets_once_measured(monkeypatch) -> None:
    """With issue37.json, the README's table is its sets' ratios; Structured Streaming's line
    still comes from the anchor run; without it, the anchor's rows and "not measured yet"."""
    import issue37

    runs = issue37_runs()
    report = {
        "generated_at": "2026-11-28T19:47:00+00:00",
        "settings": {
            "epochs": 10,
            "files_per_epoch": 2,
            "master": "local[2]",
            "rounds": 2,
            "scale": 1.0,
        },
        "machine": {"cpu_count": 2},
        "sets": {
            "a": issue37.set_section("a", DATA, runs[:3] + runs[5:8], rounds=2),
            "d": issue37.set_section("d", DATA, runs, rounds=2),
        },
        "runs": runs,
    }
    real = readme_tables.load
    monkeypatch.setattr(
        readme_tables, "load", lambda name: report if name == "issue37.json" else real(name)
    )
    cost = readme_tables.generate_cost()
    assert "| a: 5 M events / ~510 k keys | 2.25× (1.50–3.00) | 1.25× (1.00–1.50) |" in cost
    assert "| d: 50 M events / 500 k keys | 2.25× (1.50–3.00) |" in cost
    assert "| 2.50× (2.00–3.00) (1.80×) |" in cost  # (crashed + resumed) / W, then W's rerun
    glance = readme_tables.generate_glance()
    assert "took **2.25× W**" in glance  # both sets' medians: one figure, not a range
    assert "resumed, 2.50× W in all, where rerunning W from zero costs 1.80×" in glance
    assert "just be rerun" in glance
    assert "1 of 10 runs flagged as under load" in cost
    assert "not measured" not in cost
    if real("spark-anchor.json"):
        assert "Structured Streaming (SS) `Trigger.AvailableNow`" in cost
    monkeypatch.setattr(
        readme_tables, "load", lambda name: None if name == "issue37.json" else real(name)
    )
    assert readme_tables.NOT_MEASURED in readme_tables.generate_cost()
    assert "1.80×" not in readme_tables.generate_glance()  # no crash figure without the sets


def test_the_step_figures_are_the_runs_paired_ratios() -> None:
    """docs/steps.md's table and the README's step line, against steps.json's own runs: per
    round, the checkpointed run's seconds over W's, then the median (computed here)."""
    report = json.loads((ROOT / "bench" / "results" / "steps.json").read_text())
    runs = report["runs"]

    def seconds(variant: str | None, mode: str) -> dict[int, float]:
        return {
            r["round"]: r["seconds"]
            for r in runs
            if r.get("variant") == variant and r["mode"] == mode
        }

    w, full = seconds(None, "plain"), seconds(None, "steps")
    killed, resumed = seconds("killed-in-step-4", "steps"), seconds("resumed-after-step-4", "steps")
    steps_ratio = statistics.median(full[k] / w[k] for k in w)
    in_step_4 = statistics.median((killed[k] + resumed[k]) / w[k] for k in w)
    doc = (ROOT / "docs" / "steps.md").read_text()
    assert f"| {steps_ratio:.2f}× (" in doc and f"| {in_step_4:.2f}× (" in doc
    # what they are made of: the floor (each step written and read back by hand) and the step
    # API over it
    manual, start = seconds(None, "manual"), seconds(None, "start")
    floor = statistics.median(manual[k] / w[k] for k in w)
    over_floor = statistics.median(full[k] / manual[k] for k in w)
    alone = statistics.median(start[k] / w[k] for k in w)
    for figure in (floor, over_floor, alone):
        assert f"| {figure:.2f}× (" in doc, figure
    readme = (ROOT / "README.md").read_text()
    # the join chained: the same paired ratios over the chained runs
    chained = seconds(None, "chained")
    chained_ratio = statistics.median(chained[k] / w[k] for k in w)
    killed_j = seconds("killed-in-step-4", "chained")
    resumed_j = seconds("resumed-after-step-4", "chained")
    chained_in_4 = statistics.median((killed_j[k] + resumed_j[k]) / w[k] for k in w)
    row = next(line for line in doc.splitlines() if line.startswith("| the join chained (`"))
    assert f"| {chained_ratio:.2f}× (" in row
    row_4 = next(line for line in doc.splitlines() if "chained, SIGKILLed as step 4" in line)
    assert f"| {chained_in_4:.2f}× (" in row_4
    # the first screen: the short run's three figures after the longer run's
    assert f": {chained_ratio:.2f}×, {chained_in_4:.2f}× and {steps_ratio:.2f}×." in readme


def test_the_longer_run_and_the_partial_resume_are_their_runs_figures() -> None:
    """docs/steps.md's longer-run table and the README's headline kill-in-step-4 figure, and the
    partial resume's counts, against steps-long.json's and steps-narrow.json's own runs."""
    long = json.loads((ROOT / "bench" / "results" / "steps-long.json").read_text())
    runs = long["runs"]

    def seconds(rs: list[dict], variant: str | None, mode: str) -> dict[int, float]:
        return {
            r["round"]: r["seconds"]
            for r in rs
            if r.get("variant") == variant and r["mode"] == mode
        }

    w = seconds(runs, None, "plain")
    killed = seconds(runs, "killed-in-step-4", "chained")
    resumed = seconds(runs, "resumed-after-step-4", "chained")
    in_4 = statistics.median((killed[k] + resumed[k]) / w[k] for k in w)
    w_s = statistics.median(w.values())
    doc = (ROOT / "docs" / "steps.md").read_text()
    longer = doc.split("The same job on a longer run", 1)[1]
    row = next(line for line in longer.splitlines() if "chained, SIGKILLed as step 4" in line)
    assert f"| {in_4:.2f}× (" in row and "≤ 1.35×" in row
    chained, full = seconds(runs, None, "chained"), seconds(runs, None, "steps")
    chained_ratio = statistics.median(chained[k] / w[k] for k in w)
    steps_ratio = statistics.median(full[k] / w[k] for k in w)
    readme = (ROOT / "README.md").read_text()
    assert f"W {w_s:.0f} s): as shown (the join's step chained" in readme
    assert f"not written), **{chained_ratio:.2f}× W**, and killed as its last step" in readme
    assert f"the join's rows written and read back, **{steps_ratio:.2f}× W**" in readme
    first = next(line for line in longer.splitlines() if line.startswith("| every step"))
    assert f"| {steps_ratio:.2f}× (" in first
    assert f"resumed, **{in_4:.2f}× W** in all" in readme
    assert long["goals_only"] and all(r.get("output_equals_w", True) for r in runs)
    # the partial resume: what each resume kept and recomputed adds up to the step's tasks,
    # and it kept no more than the crashed run had committed (a committed file without its
    # acknowledgement is recomputed)
    narrow = json.loads((ROOT / "bench" / "results" / "steps-narrow.json").read_text())
    tasks = narrow["tasks"]
    for r in narrow["runs"]:
        if r.get("variant") != "resumed":
            continue
        killed = next(
            k for k in narrow["runs"]
            if k.get("variant") == "killed-half-way" and k["round"] == r["round"]
        )  # fmt: skip
        kept, computed = r["partitions_salvaged"]["scored"], r["partitions_computed"]["scored"]
        assert kept + computed == tasks and 0 < kept <= killed["committed_at_kill"] < tasks, r
        assert r["reused"] == ["base"] and r["output_equals_w"], r
        row = f"| {r['round']} | {killed['committed_at_kill']} of {tasks} | {kept} | {computed} |"
        assert f"{row} yes |" in doc, row
