"""Statistics of ``bench/spark_bench.py``: per-variant figures (min / median / max over the
rounds), ratios against the issue's targets with their per-round paired ratios and spread, the
verdict whether a spread is too wide to judge, the output checks, and the snapshot write and
restore read throughputs as fractions of the disk's measured limits."""

from __future__ import annotations

import statistics
from typing import Any

import sink_cost
from spark_plan import PEERS

#: ratio -> the issue's maximum (issue 16)
TARGETS: dict[str, float] = {
    "checkpoint_overhead": 1.05,  # every / off
    "vs_structured_streaming": 0.8,  # every / the faster peer (by median)
    "recovery": 0.30,  # restore at the same parallelism, to done / full run (every)
    "rescaled_restore": 1.2,  # restore at another parallelism / at the same one
}
#: the throughputs' minimum as a fraction of the disk's (issue 16)
THROUGHPUT_TARGET = 0.5
#: (max - min) / median of the paired ratios above which a ratio is too noisy to judge
SPREAD_LIMIT = 0.25

SPREAD_RULE = (
    "too_wide_to_judge is true when the per-round paired ratios' range [min, max] straddles the "
    f"target (min <= target < max) or their relative spread (max - min) / median exceeds "
    f"{SPREAD_LIMIT}; null when there is only one round (no spread to judge); then pass is the "
    "median ratio against the target but should not be trusted"
)


def spread(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"min": None, "median": None, "max": None}
    return {
        "min": round(min(values), 3),
        "median": round(statistics.median(values), 3),
        "max": round(max(values), 3),
    }


def measured(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs that finished (a failed run is recorded with its cause, not timed)."""
    return [r for r in runs if not r.get("failed")]


def figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant min / median / max of each timing; a timing a variant does not have (the
    whole-process ``every-cli`` has no inside view) is left out."""
    by_variant: dict[str, list[dict[str, Any]]] = {}
    for r in measured(runs):
        by_variant.setdefault(r["variant"], []).append(r)
    out: dict[str, Any] = {}
    for variant, rs in by_variant.items():
        v: dict[str, Any] = {"runs_s": [r.get("run_s") for r in rs]}
        for key in ("process_s", "run_s", "cpu_s", "with_session_s"):
            values = [r[key] for r in rs if r.get(key) is not None]
            if values:
                v[key] = spread(values)
        v["median_s"] = v.get("run_s", {}).get("median")
        costs = [r["checkpoint_costs"]["checkpoints"] for r in rs if r.get("checkpoint_costs")]
        if costs:  # this run's checkpoints: summed snapshot (sync + write) and write seconds
            for key in ("snapshot_s", "write_s"):
                v[f"checkpoints_{key}"] = spread(
                    [sum(c.get(key) or 0.0 for c in cs) for cs in costs]
                )
        phases = sorted({k for r in rs for k in r.get("phases_s", {})})
        if phases:
            v["phases_s"] = {k: spread([r["phases_s"].get(k, 0.0) for r in rs]) for k in phases}
        out[variant] = v
    return out


def faster_peer(runs: list[dict[str, Any]]) -> str:
    medians = {
        p: statistics.median(r["run_s"] for r in measured(runs) if r["variant"] == p)
        for p in PEERS
        if any(r["variant"] == p for r in measured(runs))
    }
    return min(medians, key=medians.__getitem__) if medians else PEERS[0]


def ratio(
    runs: list[dict[str, Any]], num: str, den: str, target: float, key: str = "run_s"
) -> dict[str, Any]:
    """Median over medians, and the same ratio within each round (paired: the variants of a
    round run back to back, so less drift) with its min / median / max and spread."""

    def of(variant: str) -> dict[int, float]:
        return {
            r["round"]: r[key]
            for r in measured(runs)
            if r["variant"] == variant and r.get(key) is not None
        }

    a, b = of(num), of(den)
    if not a or not b:  # a variant failed or was not run: nothing to judge
        return {
            "numerator": num,
            "denominator": den,
            "value": None,
            "paired_by_round": [],
            "paired": spread([]),
            "relative_spread": None,
            "target_max": target,
            "pass": None,
            "too_wide_to_judge": None,
            "not_measured": [v for v, x in ((num, a), (den, b)) if not x],
        }
    value = statistics.median(a.values()) / statistics.median(b.values())
    paired = [round(a[k] / b[k], 3) for k in sorted(a) if k in b]
    p = spread(paired)
    rel = (p["max"] - p["min"]) / p["median"] if len(paired) > 1 else None
    too_wide = None
    if len(paired) > 1:
        too_wide = (p["min"] <= target < p["max"]) or (rel is not None and rel > SPREAD_LIMIT)
    return {
        "numerator": num,
        "denominator": den,
        "value": round(value, 3),
        "paired_by_round": paired,
        "paired": p,
        "relative_spread": None if rel is None else round(rel, 3),
        "target_max": target,
        "pass": value <= target,
        "too_wide_to_judge": too_wide,
    }


def ratios(rescale_to: tuple[int, ...], parallelism: int, runs: list[dict]) -> dict[str, Any]:
    same = f"restore-p{parallelism}"
    peer = faster_peer(runs)
    out: dict[str, Any] = {
        "checkpoint_overhead": ratio(runs, "every", "off", TARGETS["checkpoint_overhead"]),
        # like for like: the peer writes every micro-batch's rows, as a changelog sink does
        "vs_structured_streaming": ratio(
            runs, "every-changelog", peer, TARGETS["vs_structured_streaming"]
        ),
        "recovery": ratio(runs, same, "every", TARGETS["recovery"]),
    }
    for p in rescale_to:
        out[f"rescaled_restore_{parallelism}_to_{p}"] = ratio(
            runs, f"restore-p{p}", same, TARGETS["rescaled_restore"]
        )
    judged = list(out)
    # informational: both peers, the full checkpoints' overhead, CPU seconds (less sensitive to
    # other work on a shared machine), wall seconds including the Spark session's start-up
    info = {
        f"every_vs_{p}": ratio(runs, "every", p, TARGETS["vs_structured_streaming"])["value"]
        for p in PEERS
        if any(r["variant"] == p for r in runs)
    }
    info["every_full_overhead"] = ratio(runs, "every-full", "off", TARGETS["checkpoint_overhead"])
    info["every_vs_every_full"] = ratio(runs, "every", "every-full", 1.0)["value"]
    # what the changelog costs: merging the whole state every epoch and staging its changes
    info["every_changelog_vs_every"] = ratio(runs, "every-changelog", "every", 1.0)["value"]
    # one task failure at 80 % and a warm restart, against the same run without a failure
    info["warm_restart_vs_every"] = ratio(runs, "warm-restart", "every", 1.0)["value"]
    # what `ckpt run` adds to the instrumented worker (imports, preflight, progress), whole
    # processes both
    info["every_cli_vs_every"] = ratio(runs, "every-cli", "every", 1.0, "process_s")["value"]
    out["informational"] = info
    out["delta_sink_cost_per_checkpoint"] = sink_cost.cost_ratio(runs)
    for extra, key in (("cpu", "cpu_s"), ("including_session_start", "with_session_s")):
        out[extra] = {
            name: ratio(runs, out[name]["numerator"], out[name]["denominator"], 1.0, key)["value"]
            for name in judged
        }
    return out


def verdicts(r: dict[str, Any]) -> dict[str, Any]:
    return {
        k: {"pass": v["pass"], "too_wide_to_judge": v["too_wide_to_judge"]}
        for k, v in r.items()
        if isinstance(v, dict) and "pass" in v
    }


def throughput(runs: list[dict[str, Any]], disk: dict[str, Any]) -> dict[str, Any]:
    """Snapshot write MiB/s (bytes the checkpoints wrote / their write seconds) of the runs
    with a checkpoint per epoch, and restore read MiB/s (restored state bytes / restore phase
    seconds) of the restores, each as a fraction of the disk's measured limit."""
    out: dict[str, Any] = {"target_min_fraction": THROUGHPUT_TARGET}
    for variant in sorted({r["variant"] for r in runs if r["variant"].startswith("every")}):
        rates = [w for r in runs if r["variant"] == variant and (w := write_rate(r))]
        if rates:
            mib = spread(rates)
            out[f"snapshot_write_{variant}"] = {
                "mib_s": mib,
                "fraction_of_disk": round(mib["median"] / disk["write_mib_s"], 3),
                "pass": mib["median"] / disk["write_mib_s"] >= THROUGHPUT_TARGET,
            }
    reads = [x for r in runs if r["variant"].startswith("restore-") and (x := read_rate(r))]
    if reads:
        mib = spread(reads)
        out["restore_read"] = {
            "mib_s": mib,
            "fraction_of_disk": round(mib["median"] / disk["read_mib_s"], 3),
            "pass": mib["median"] / disk["read_mib_s"] >= THROUGHPUT_TARGET,
        }
    return out


def written_bytes(c: dict[str, Any]) -> int | None:
    """Bytes a checkpoint wrote: ``checkpointed_size`` when the metastore has it, else its full
    ``state_size`` (what a full checkpoint writes)."""
    if c.get("checkpointed_size") is not None:
        return c["checkpointed_size"]
    return c.get("state_size")


def write_seconds(c: dict[str, Any]) -> float | None:
    """The seconds a checkpoint's snapshot spent writing: its background write when the
    runtime writes asynchronously, else the whole snapshot."""
    return c.get("write_s") or c.get("snapshot_s")


def write_rate(run: dict[str, Any]) -> float | None:
    timed = [
        c
        for c in run.get("checkpoint_costs", {}).get("checkpoints", [])
        if write_seconds(c) and written_bytes(c) is not None
    ]
    seconds = sum(write_seconds(c) for c in timed)
    return sum(written_bytes(c) for c in timed) / seconds / 2**20 if seconds else None


def read_rate(run: dict[str, Any]) -> float | None:
    restore_s = run.get("phases_s", {}).get("restore")
    size = run.get("restored_state_bytes")
    return size / restore_s / 2**20 if restore_s and size else None


def checks(events: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every finished run must produce every key once and count every event once; the runs
    whose whole output table was digested (``spark_process.output_check``: W, the design,
    ``ckpt run``) must have written the same table."""
    keys = {r["output_keys"] for r in runs if "output_keys" in r}
    counted = {r["output_events"] for r in runs if "output_events" in r}
    digests: dict[str, list[str]] = {}
    for r in runs:
        if r.get("output_digest"):
            digests.setdefault(r["output_digest"], []).append(r["variant"])
    avgs = [r["avg_projection"] for r in runs if r.get("avg_projection") is not None]
    same_avg = not avgs or (max(avgs) - min(avgs)) <= 1e-9 * max(1.0, abs(max(avgs)))
    same = len(digests) <= 1 and same_avg
    codes = sorted({r.get("code", "?") for r in runs})
    return {
        "distinct_keys": sorted(keys),
        "events_counted": sorted(counted),
        "output_digests": {k: sorted(set(v)) for k, v in digests.items()},
        "avg_projections": sorted(set(avgs)),
        "same_output": same,
        "consistent": len(keys) == 1 and counted == {events} and same,
        "code_versions": codes,
    }


def paired_ratios(num: dict[Any, float], den: dict[Any, float]) -> dict[str, Any] | None:
    """The figure every issue-37 ratio is: within each round (paired: the runs of a round run
    back to back) numerator / denominator, then the median of those per-round ratios with their
    min and max — not the ratio of the medians (``ratio_of_medians``), which pairs a fast round's
    numerator with a slow round's denominator. None when no round has both."""
    rounds = sorted(k for k in num if den.get(k))
    if not rounds:
        return None
    per_round = [num[k] / den[k] for k in rounds]
    return {
        "median": round(statistics.median(per_round), 6),
        "min": round(min(per_round), 6),
        "max": round(max(per_round), 6),
        "per_round": [round(x, 6) for x in per_round],
        "rounds": rounds,
    }


def ratio_of_medians(num: dict[Any, float], den: dict[Any, float]) -> float | None:
    """median(numerator) / median(denominator): for comparison only (see ``paired_ratios``)."""
    if not num or not den:
        return None
    return round(statistics.median(num.values()) / statistics.median(den.values()), 3)
