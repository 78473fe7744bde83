"""How checkpoint cost grows, for ``bench/spark_bench.py``: the ``every`` variant (incremental
checkpoints, the spec's default) and ``every-full`` (``checkpoint.incremental: false``) at three
sizes (default 0.4 M, 1.5 M and 5 M events, keys in proportion as the main workload: 0.102 per
event; 10 epochs, a checkpoint after each) and two change rates (``most``: most keys touched per
epoch; ``few``: a moving window of 3 % of the keys per epoch — see ``spark_workload``), one run
each.

Per checkpoint it records, from the run's metastore and the runtime's timed ``_snapshot`` calls:
bytes written (``checkpointed_size``; its ``state_size`` when the metastore has no such column
yet), snapshot seconds, state size (the full state's bytes), changed key groups (the keyed acks'
``state_meta.changed_groups``, null until the runtime reports it), and from the data the keys the
epoch touched and the keys so far; the changed state is estimated as state size * touched keys /
keys so far. ``plot`` draws ``bench/results/snapshot_cost.png``: snapshot bytes and seconds
against state size and against changed state, incremental vs full, both change rates (the seconds
panels leave out each run's first checkpoint, whose write also pays the first write job's
warm-up: ``first_of_run`` in the points).
"""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path
from typing import Any

from spark_plan import Runner, base_task, rotated
from spark_stats import written_bytes
from spark_workload import Settings, ensure_data, growth_keys

VARIANTS = {"every": None, "every-full": False}  # variant -> checkpoint.incremental
CHANGES = ("most", "few")


def growth_runs(s: Settings) -> int:
    return len(s.growth_sizes) * len(CHANGES) * len(VARIANTS)


def data_sets(s: Settings, data_root: Path) -> list[dict[str, Any]]:
    return [
        ensure_data(
            data_root,
            events=size,
            keys=growth_keys(size),
            files=s.growth_epochs,
            seed=s.seed,
            change=change,
        )
        for size in s.growth_sizes
        for change in CHANGES
    ]


def measure(s: Settings, sets: list[dict[str, Any]], work: Path, runner: Runner) -> dict:
    """One run of each variant per data set; the per-checkpoint points and a summary."""
    live = work / "growth-live"
    points: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    for i, data in enumerate(sets):
        base = base_task(s, data["dir"], live, 1)
        for variant in rotated(list(VARIANTS), i):
            task = {**base, "fresh": True, "parallelism": None, "every_epochs": True}
            task["incremental"] = VARIANTS[variant]
            tag = f"growth {data['events']:,} events, {data['change']}"
            run = runner.one(f"growth-{variant}", 0, task, tag=tag)
            if run.get("failed"):  # recorded in runs[] with its cause
                continue
            mine = run_points(run, data, variant)
            points += mine
            summary.append(summarize(run, data, variant, mine))
        shutil.rmtree(live, ignore_errors=True)
    return {"summary": summary, "points": points}


def run_points(run: dict[str, Any], data: dict[str, Any], variant: str) -> list[dict]:
    per_file = data.get("per_file") or []
    out: list[dict[str, Any]] = []
    for c in run.get("checkpoint_costs", {}).get("checkpoints", []):
        if c.get("snapshot_s") is None:
            continue
        epoch = c.get("epoch")
        f = per_file[epoch] if epoch is not None and epoch < len(per_file) else {}
        touched, so_far = f.get("touched_keys"), f.get("keys_so_far")
        state = c.get("state_size")
        out.append(
            {
                "events": data["events"],
                "keys": data["keys_parameter"],
                "change": data["change"],
                "variant": variant,
                "incremental": run.get("incremental"),
                "checkpoint_id": c["checkpoint_id"],
                # the run's first snapshot also pays for the first write job's warm-up
                "first_of_run": not out,
                "epoch": epoch,
                "status": c.get("status"),
                "snapshot_s": c["snapshot_s"],
                "sync_s": c.get("sync_s"),
                "write_s": c.get("write_s"),
                "written_bytes": written_bytes(c),
                "checkpointed_size": c.get("checkpointed_size"),
                "state_size": state,
                "changed_groups": c.get("changed_groups"),
                "max_sync_ms": c.get("max_sync_ms"),
                "max_async_ms": c.get("max_async_ms"),
                "touched_keys": touched,
                "keys_so_far": so_far,
                "changed_state_bytes_est": round(state * touched / so_far)
                if state and touched and so_far
                else None,
            }
        )
    return out


def summarize(
    run: dict[str, Any], data: dict[str, Any], variant: str, points: list[dict]
) -> dict[str, Any]:
    snap = [p["snapshot_s"] for p in points if not p["first_of_run"]]
    write_s = sum(p["write_s"] or p["snapshot_s"] for p in points)
    written = [p["written_bytes"] or 0 for p in points]
    states = [p["state_size"] or 0 for p in points]
    return {
        "events": data["events"],
        "keys": data["keys_parameter"],
        "change": data["change"],
        "variant": variant,
        "run_s": run["run_s"],
        "checkpoints": len(points),
        "snapshot_s_total": round(sum(snap), 3),
        "snapshot_s_median": round(statistics.median(snap), 4) if snap else None,  # not the 1st
        "written_bytes_total": sum(written),
        "write_mib_s": round(sum(written) / write_s / 2**20, 1) if write_s else None,
        "final_state_bytes": states[-1] if states else None,
        "written_per_state_median": round(
            statistics.median(w / st for w, st in zip(written, states, strict=True) if st), 4
        )
        if any(states)
        else None,
        "checkpointed_size_recorded": any(p["checkpointed_size"] is not None for p in points),
        "changed_groups_recorded": any(p["changed_groups"] is not None for p in points),
        "output_keys": run.get("output_keys"),
        "output_events": run.get("output_events"),
    }


def plot(growth: dict[str, Any], path: Path, title: str) -> None:
    """Snapshot bytes and seconds against state size and against changed state (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = growth["points"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    colours = {"every": "tab:blue", "every-full": "tab:orange"}
    markers = {"most": "o", "few": "^"}
    labels = {"every": "incremental", "every-full": "full"}
    panels = [
        (axes[0][0], "state_size", "written_bytes", "state size (bytes)", "bytes written"),
        (axes[0][1], "state_size", "snapshot_s", "state size (bytes)", "snapshot seconds"),
        (axes[1][0], "changed_state_bytes_est", "written_bytes", "changed state (bytes, est.)",
         "bytes written"),
        (axes[1][1], "changed_state_bytes_est", "snapshot_s", "changed state (bytes, est.)",
         "snapshot seconds"),
    ]  # fmt: skip
    for ax, x, y, xlabel, ylabel in panels:
        for variant in VARIANTS:
            for change in CHANGES:
                sel = [
                    p
                    for p in points
                    if p["variant"] == variant and p["change"] == change and p[x] and p[y]
                    and not (y == "snapshot_s" and p.get("first_of_run"))
                ]  # fmt: skip
                if sel:
                    full = variant == "every-full"  # hollow: incremental shows through
                    ax.scatter(
                        [p[x] for p in sel],
                        [p[y] for p in sel],
                        facecolors="none" if full else colours[variant],
                        edgecolors=colours[variant],
                        marker=markers[change],
                        alpha=0.7,
                        s=26,
                        label=f"{labels[variant]}, {change} keys per epoch",
                    )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
