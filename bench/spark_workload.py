"""The workload of ``bench/spark_bench.py``: its settings, the pipeline, and the input data.

Two change rates, each a seeded data set cached under ``.ckpt/bench-data/`` keyed by its
parameters (generated into a temporary directory and renamed into place when complete, so an
interrupted run never leaves a partial data set that later runs would trust):

* ``most`` — ``ckpt generate-data --dataset synthetic``: each epoch's events fall on keys drawn
  with a Zipf-like skew from all keys, so most keys seen so far are touched in every epoch (the
  main measurement's workload: 5,000,000 events over 510,000 keys — about 507,000 of them occur —
  in 20 files, one per epoch).
* ``few`` — this module's generator: the first events create every key once (a shuffled
  permutation, which fills the first epoch or epochs), then each epoch's events fall on a moving
  window of ``FEW_PERCENT`` (3 %) of the keys, the window advancing by its own width each epoch.
  The window is cut from a random order of the keys, so its keys are scattered over nearly
  every key group, as hashed keys are: an incremental snapshot's cost must follow the changed
  keys, not depend on their locality. Same columns and value distributions as ``most``.

Each data set records per file the distinct keys it touches and the keys seen so far (the
"changed state" of the growth experiment's plot).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
RESULTS_DIR = BENCH / "results"
DATA_ROOT = ROOT / ".ckpt" / "bench-data"
WORK_ROOT = ROOT / ".ckpt" / "bench-work"
JOB = "bench-events"
DATA_MARKER = "_complete.json"  # leading underscore: Spark's file listing skips it anyway
#: share of the keys each epoch of the ``few`` data set touches
FEW_PERCENT = 0.03
#: keys per event of the main workload (510,000 / 5,000,000): the growth sizes keep it
KEYS_PER_EVENT = 0.102

#: output column -> our aggregation; the peers compute the same with Spark's functions
AGGREGATIONS = {
    "n": "count()",
    "total": "sum(amount)",
    "avg_amount": "avg(amount)",
    "min_q": "min(quantity)",
    "max_q": "max(quantity)",
}


@dataclass(frozen=True)
class Settings:
    quick: bool
    events: int
    keys: int
    epochs: int
    files_per_epoch: int
    seed: int
    parallelism: int
    rescale_to: tuple[int, ...]
    rounds: int
    crash_after_epochs: int
    master: str
    driver_memory: str | None
    main: bool  # the main measurement (variants, ratios)
    growth: bool  # the growth experiment
    growth_sizes: tuple[int, ...]  # events; keys in proportion (KEYS_PER_EVENT)
    growth_epochs: int
    disk_probe_bytes: int
    sizes: tuple[int, ...] = ()  # the size sweep's further sizes (events; keys in proportion)

    @property
    def files(self) -> int:
        return self.epochs * self.files_per_epoch


def make_settings(args: argparse.Namespace) -> Settings:
    quick = bool(args.quick)
    epochs = args.epochs or (6 if quick else 20)
    events = args.events or (200_000 if quick else 5_000_000)
    # keys in proportion to the events (5 M -> 510,000; 50 M -> 5.1 M), but quick's own default
    keys = args.keys or (20_000 if quick and not args.events else growth_keys(events))
    sizes = QUICK_SIZES if quick else ()
    if args.sizes is not None:
        sizes = tuple(args.sizes)
    return Settings(
        quick=quick,
        events=events,
        keys=keys,
        epochs=epochs,
        files_per_epoch=args.files_per_epoch,
        seed=args.seed,
        parallelism=args.parallelism,
        rescale_to=tuple(args.rescale_to),
        rounds=args.rounds or (1 if quick else 3),
        crash_after_epochs=max(1, min(epochs - 1, round(epochs * 0.8))),
        master=args.master,
        driver_memory=args.driver_memory,
        main=not args.growth_only,
        growth=not args.no_growth,
        growth_sizes=tuple(
            args.growth_sizes or ((30_000, 80_000, 200_000) if quick else GROWTH_SIZES)
        ),
        growth_epochs=args.growth_epochs or (4 if quick else 10),
        disk_probe_bytes=(64 << 20) if quick else (512 << 20),
        sizes=tuple(x for x in sizes if x != events),
    )


#: the growth experiment's sizes (events) of a default run
GROWTH_SIZES = (400_000, 1_500_000, 5_000_000)
#: the size sweep's further sizes of a quick run (a full run's: none unless --sizes; the issue's
#: second size is --sizes 50000000: 50 M events over 5.1 M keys, 20 files, 441 MiB)
QUICK_SIZES = (60_000,)
#: the issue's realistic size (issue 23)
LARGE_SIZE = 50_000_000


def growth_keys(events: int) -> int:
    return max(10, round(events * KEYS_PER_EVENT))


# ============================================================================ data


def ensure_data(
    root: Path, *, events: int, keys: int, files: int, seed: int, change: str = "most"
) -> dict[str, Any]:
    """The input files of one data set (generated once per parameter set), and what they hold."""
    name = f"events-e{events}-k{keys}-f{files}-s{seed}" + ("" if change == "most" else "-few2")
    dest = root / name
    marker = dest / DATA_MARKER
    if not marker.exists():
        print(f"generating {events:,} events over {keys:,} keys ({change}) into {dest} ...")
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
        started = time.perf_counter()
        if change == "most":
            cmd = [
                sys.executable, "-m", "checkpointing.cli", "generate-data", str(tmp),
                "--dataset", "synthetic", "--events", str(events), "--keys", str(keys),
                "--files", str(files), "--seed", str(seed),
            ]  # fmt: skip
            subprocess.run(cmd, check=True, cwd=ROOT)
            how: list[str] | str = cmd[2:]
        else:
            write_few(tmp, events=events, keys=keys, files=files, seed=seed)
            how = f"bench/spark_workload.py write_few (window {FEW_PERCENT:.0%} of the keys)"
        seconds = round(time.perf_counter() - started, 1)
        info = {"command": how, "seconds": seconds, "per_file": file_key_stats(tmp)}
        (tmp / DATA_MARKER).write_text(json.dumps(info))
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    info = json.loads(marker.read_text())
    paths = sorted(dest.glob("*.parquet"))
    if len(paths) != files:
        raise RuntimeError(f"{dest}: expected {files} Parquet files, found {len(paths)}")
    return {
        "dir": str(dest),
        "change": change,
        "files": len(paths),
        "bytes": sum(p.stat().st_size for p in paths),
        "events": events,
        "keys_parameter": keys,
        "seed": seed,
        "generated_s": info.get("seconds"),
        "per_file": info.get("per_file"),
    }


def file_key_stats(directory: Path) -> list[dict[str, int]]:
    """Per file (in name order): events, distinct keys touched, distinct keys seen so far."""
    seen = np.empty(0, dtype=np.int64)
    out = []
    for path in sorted(directory.glob("*.parquet")):
        users = pq.read_table(path, columns=["user"]).column("user")
        ids = np.unique(pc.cast(pc.utf8_slice_codeunits(users, 1), pa.int64()).to_numpy())
        seen = np.union1d(seen, ids)
        out.append({"events": len(users), "touched_keys": len(ids), "keys_so_far": len(seen)})
    return out


def write_few(dest: Path, *, events: int, keys: int, files: int, seed: int) -> None:
    """The ``few`` data set (see the module docstring), ``events-NNNNN.parquet`` as ``most``."""
    rng = np.random.default_rng(seed)
    scattered = rng.permutation(keys)  # the window's keys: over nearly every key group
    window = max(1, round(keys * FEW_PERCENT))
    creation = rng.permutation(keys)
    per_file = -(-events // files)
    dest.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        lo, hi = i * per_file, min(events, (i + 1) * per_file)
        if hi <= lo:
            break
        n = hi - lo
        created = creation[lo : min(hi, keys)] if lo < keys else creation[:0]
        start = (i * window) % keys
        offsets = (start + rng.integers(0, window, size=n - len(created))) % keys
        key_ids = np.concatenate([created, scattered[offsets]])
        amount = np.round(rng.gamma(2.0, 20.0, size=n), 2)
        table = pa.table(
            {
                "user": pa.array(np.char.add("u", key_ids.astype(str))),
                "amount": pa.array(amount, mask=rng.random(n) < 0.01),
                "quantity": pa.array(rng.integers(1, 10, size=n, dtype=np.int64)),
            }
        )
        pq.write_table(table, dest / f"events-{i:05d}.parquet")
