"""README's benchmark tables are generated from bench/results/*.json (issue 37), and the paired
statistics they report are the median of per-round ratios, not a ratio of medians."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import readme_tables  # noqa: E402
import spark_stats  # noqa: E402
from machine import load_flags  # noqa: E402


def test_readme_section_equals_the_generated_tables() -> None:
    text = readme_tables.README.read_text()
    assert readme_tables.BEGIN in text and readme_tables.END in text
    assert readme_tables.readme_section(text) == readme_tables.generate(), (
        "README.md's benchmark tables differ from bench/results/*.json: run "
        "python bench/readme_tables.py"
    )


def test_check_fails_on_a_changed_readme_and_the_writer_fixes_it(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    section = readme_tables.generate()
    readme.write_text(f"# x\n\n{readme_tables.BEGIN}\n{section}{readme_tables.END}\n\nafter\n")
    assert readme_tables.main(["--check", "--readme", str(readme)]) == 0
    readme.write_text(readme.read_text().replace("| metric |", "| a hand-edited metric |"))
    assert readme_tables.main(["--check", "--readme", str(readme)]) == 1
    assert readme_tables.main(["--readme", str(readme)]) == 0
    assert readme_tables.main(["--check", "--readme", str(readme)]) == 0
    assert readme.read_text().endswith(f"{readme_tables.END}\n\nafter\n")


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


def test_issue37_set_reports_paired_ratios_and_the_crash_total() -> None:
    import issue37

    def run(variant: str, r: int, s: float, rss: int = 100, load: float = 0.1) -> dict:
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

    runs = [
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
    data = {"events": 50, "keys_parameter": 5, "dir": "/x", "files": 20, "bytes": 1}
    x = issue37.set_section("d", data, runs, rounds=2)
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
    assert not issue37.set_section("d", data, runs, rounds=2)["checks"]["consistent"]
