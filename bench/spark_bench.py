"""Spark pipeline benchmark: checkpoint overhead, Spark Structured Streaming as the peer, recovery
after a crash, and rescaled restore — all measured side by side in one run on one machine.

Run by ``make bench`` (never by the tests)::

    python bench/spark_bench.py [--quick] [--rounds N] [--events N --keys K --epochs E]

Workload: ``ckpt generate-data`` synthetic events (default 5,000,000 events over 510,000 keys —
about 507,000 of them occur, the skew leaves a few unused — in 20 files, one file per epoch),
cached under ``.ckpt/bench-data/`` keyed by the parameters. One pipeline: ``groupBy(user)`` with
``count()``, ``sum(amount)``, ``avg(amount)``, ``min(quantity)``, ``max(quantity)``.

Variants, each run in its own process (a fresh JVM and Spark session, ``local[2]``, shuffle
partitions = parallelism), timed from after the session is up to the job's end:

* ``off``: our runtime with no periodic checkpoints (``every_epochs`` and ``interval`` unset).
  The runtime still takes one forced checkpoint at the end, whose completion commits the sink's
  staged epochs — the minimum for its exactly-once output, so "off" means "only that one".
* ``every``: our runtime, a checkpoint at every epoch boundary (``every_epochs: 1``).
* ``every-delta``: ``every`` writing a Delta table (``format: delta``, ``mode: upsert``, local)
  instead of the Parquet sink: with ``every``, the sinks' cost per checkpoint
  (``bench/sink_cost.py``).
* ``peer``: Spark Structured Streaming — ``readStream`` of the same Parquet files (schema given),
  ``maxFilesPerTrigger`` = files per epoch, the same aggregation, RocksDB state store,
  ``trigger(availableNow=True)``, a fresh ``checkpointLocation``, update output mode written per
  micro-batch to Parquet by ``foreachBatch`` (the closest to our changelog sink).
* ``crash``: ``every`` killed (``SimulatedCrash``) after 80 % of the epochs; its metastore,
  checkpoint storage and sink are copied aside.
* ``restore-p<N>``: from an identical copy of that crashed state, restart with ``--restore latest``
  at parallelism N and run to the end. The same parallelism is the recovery figure; others are
  rescaled restores.

Each round runs every variant once, in a rotated order (to spread drift over the variants); the
figures are medians over the rounds. Results go to ``bench/results/spark.json`` (per-run seconds,
phases, CPU seconds, machine load, ratios, targets, pass/fail) and a summary table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sink_cost  # bench/'s helper, beside this file

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results" / "spark.json"
DATA_ROOT = ROOT / ".ckpt" / "bench-data"
WORK_ROOT = ROOT / ".ckpt" / "bench-work"
JOB = "bench-events"
DATA_MARKER = "_complete.json"  # leading underscore: Spark's file listing skips it anyway

#: output column -> our aggregation; the peer computes the same with Spark's functions
AGGREGATIONS = {
    "n": "count()",
    "total": "sum(amount)",
    "avg_amount": "avg(amount)",
    "min_q": "min(quantity)",
    "max_q": "max(quantity)",
}

#: ratio name -> (numerator, denominator description, maximum)
TARGETS: dict[str, float] = {
    "checkpoint_overhead": 1.15,  # every / off
    "vs_structured_streaming": 1.0,  # every / peer
    "recovery": 0.35,  # restore at the same parallelism, to done / full run (every)
    "rescaled_restore": 1.5,  # restore at another parallelism / at the same one
}

console = Console()


# ============================================================================ settings


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

    @property
    def files(self) -> int:
        return self.epochs * self.files_per_epoch


def make_settings(args: argparse.Namespace) -> Settings:
    quick = bool(args.quick)
    epochs = args.epochs
    return Settings(
        quick=quick,
        events=args.events or (200_000 if quick else 5_000_000),
        keys=args.keys or (20_000 if quick else 510_000),
        epochs=epochs,
        files_per_epoch=args.files_per_epoch,
        seed=args.seed,
        parallelism=args.parallelism,
        rescale_to=tuple(args.rescale_to),
        rounds=args.rounds or (1 if quick else 3),
        crash_after_epochs=max(1, min(epochs - 1, round(epochs * 0.8))),
        master=args.master,
        driver_memory=args.driver_memory,
    )


# ============================================================================ data


def ensure_data(s: Settings, root: Path) -> dict[str, Any]:
    """The input files, generated once per parameter set with ``ckpt generate-data`` (into a
    temporary directory, renamed into place when complete, so an interrupted run never leaves a
    partial data set that later runs would trust)."""
    name = f"events-e{s.events}-k{s.keys}-f{s.files}-s{s.seed}"
    dest = root / name
    marker = dest / DATA_MARKER
    generated_s = None
    if not marker.exists():
        console.print(f"generating {s.events:,} events over {s.keys:,} keys into {dest} ...")
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
        started = time.perf_counter()
        cmd = [
            sys.executable, "-m", "checkpointing.cli", "generate-data", str(tmp),
            "--dataset", "synthetic", "--events", str(s.events), "--keys", str(s.keys),
            "--files", str(s.files), "--seed", str(s.seed),
        ]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=ROOT)
        generated_s = round(time.perf_counter() - started, 1)
        (tmp / DATA_MARKER).write_text(json.dumps({"command": cmd[2:], "seconds": generated_s}))
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    files = sorted(dest.glob("*.parquet"))
    if len(files) != s.files:
        raise RuntimeError(f"{dest}: expected {s.files} Parquet files, found {len(files)}")
    return {
        "dir": str(dest),
        "files": len(files),
        "bytes": sum(p.stat().st_size for p in files),
        "events": s.events,
        "keys_parameter": s.keys,
        "seed": s.seed,
        "generated_now_s": generated_s,
    }


# ============================================================================ workers
# Each measurement runs in a child process: a fresh JVM and session, so no run inherits another's
# JIT warm-up, cached blocks or garbage. Only the workers import pyspark.


def run_worker(task: dict[str, Any], log_path: Path, s: Settings) -> dict[str, Any]:
    result_path = log_path.with_suffix(".json")
    task = {**task, "result_path": str(result_path)}
    # no console progress bars (they would only fill the log); the same for every variant
    submit = ["--conf", "spark.ui.showConsoleProgress=false"]
    if s.driver_memory:
        submit += ["--driver-memory", s.driver_memory]
    env = {**os.environ, "PYSPARK_SUBMIT_ARGS": " ".join([*submit, "pyspark-shell"])}
    with log_path.open("w") as log:
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", json.dumps(task)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            check=False,
        )
    if proc.returncode != 0 or not result_path.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"worker {task['variant']} failed ({proc.returncode}):\n{tail}")
    return json.loads(result_path.read_text())


def worker_main(task: dict[str, Any]) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    from checkpointing.spark.session import spark_session

    started = time.perf_counter()
    spark = spark_session(f"bench-{task['variant']}", task["master"])
    spark.sparkContext.setLogLevel("WARN")
    spark.conf.set("spark.sql.shuffle.partitions", str(task["shuffle_partitions"]))
    session_s = time.perf_counter() - started
    body = work_peer if task["variant"] == "peer" else work_ours
    try:
        result = body(spark, task)
    finally:
        spark.stop()
    result["session_s"] = round(session_s, 3)
    result["code"] = code_fingerprint()
    Path(task["result_path"]).write_text(json.dumps(result))


def code_fingerprint() -> str:
    """A hash of the measured package's sources: the work tree may change during a long run
    (others edit it), so each run records what it imported."""
    import hashlib

    import checkpointing

    digest = hashlib.sha256()
    root = Path(checkpointing.__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return f"{root}:{digest.hexdigest()[:12]}"


@contextmanager
def measured() -> Iterator[dict[str, float]]:
    """Wall seconds and CPU seconds of this process tree (driver JVM, Python workers)."""
    out: dict[str, float] = {}
    cpu0, t0 = tree_cpu_seconds(os.getpid()), time.perf_counter()
    yield out
    out["run_s"] = round(time.perf_counter() - t0, 3)
    out["cpu_s"] = round(tree_cpu_seconds(os.getpid()) - cpu0, 2)


def work_ours(spark: Any, task: dict[str, Any]) -> dict[str, Any]:
    from checkpointing.metastore import Metastore
    from checkpointing.spark.preflight import RunOptions
    from checkpointing.spark.runtime import PipelineRun, SimulatedCrash
    from checkpointing.spec import load_spec
    from checkpointing.storage import FileSystemCheckpointStorage

    live = Path(task["live"])
    metastore_url = f"sqlite:///{live / 'metastore.db'}"
    if task["fresh"]:
        shutil.rmtree(live, ignore_errors=True)
        live.mkdir(parents=True)
        Metastore(metastore_url, check_schema=False).upgrade()
        checkpoint = {"every_epochs": 1} if task["every_epochs"] else {}
        (live / "pipeline.yaml").write_text(
            json.dumps(  # JSON is YAML
                {
                    "job": JOB,
                    "source": {
                        "format": "parquet",
                        "path": f"{task['data']}/*.parquet",
                        "splits_per_epoch": task["files_per_epoch"],
                    },
                    "key": "user",
                    "aggregations": AGGREGATIONS,
                    "sink": {"path": str(live / "sink")}
                    | ({"format": "delta"} if task.get("delta") else {}),
                    "parallelism": task["spec_parallelism"],
                    "checkpoint": checkpoint,
                },
                indent=1,
            )
        )
    spec = load_spec(live / "pipeline.yaml")
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{live / 'checkpoints'}")
    options = RunOptions(
        restore="latest" if not task["fresh"] else "none",
        parallelism=task["parallelism"],
        crash_after_epochs=task.get("crash_after_epochs"),
    )
    epochs_ms: list[int] = []
    run = _timed_run_class(PipelineRun)(
        spec, spark, metastore, storage, options, on_epoch=lambda _e, ms: epochs_ms.append(ms)
    )
    sink_s = sink_cost.time_sink(run.sink)
    crashed = False
    with measured() as m:
        try:
            result = run.run()
        except SimulatedCrash:
            crashed = True
    out: dict[str, Any] = {
        **m,
        "phases_s": {k: round(v, 3) for k, v in run.phases.items()},
        "phase_calls": dict(run.calls),
        "epochs_ms": epochs_ms,
        "crashed": crashed,
        "sink_s": {k: round(v, 3) for k, v in sink_s.items()},
    }
    if not crashed:
        delta = spec.sink.format == "delta"
        keys, events = sink_cost.output_counts(spark, result.final_path, delta)
        out.update(
            epochs_run=len(result.epochs_run),
            restored_from=result.restored_from,
            checkpoints=len(result.checkpoints),
            output_keys=keys,
            output_events=events,
            sink_s_per_checkpoint=round(sum(sink_s.values()) / max(1, len(result.checkpoints)), 4),
        )
    metastore.dispose()
    return out


def _timed_run_class(base: type) -> type:
    """``base`` with its phases timed (cumulative seconds per phase; nested phases overlap:
    ``finish`` includes its forced checkpoint's ``barrier`` and ``snapshot``). A phase the
    runtime no longer has is simply never called."""

    class TimedRun(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.phases: dict[str, float] = {}
            self.calls: dict[str, int] = {}
            super().__init__(*args, **kwargs)

        @contextmanager
        def _phase(self, name: str) -> Iterator[None]:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0
                self.calls[name] = self.calls.get(name, 0) + 1

        def _restore(self, *a: Any, **k: Any) -> Any:
            with self._phase("restore"):
                return super()._restore(*a, **k)

        def _process(self, *a: Any, **k: Any) -> Any:
            with self._phase("process"):
                return super()._process(*a, **k)

        def _barrier(self, *a: Any, **k: Any) -> Any:
            with self._phase("barrier"):
                return super()._barrier(*a, **k)

        def _snapshot(self, *a: Any, **k: Any) -> Any:
            with self._phase("snapshot"):
                return super()._snapshot(*a, **k)

        def _finish(self, *a: Any, **k: Any) -> Any:
            with self._phase("finish"):
                return super()._finish(*a, **k)

    return TimedRun


def work_peer(spark: Any, task: dict[str, Any]) -> dict[str, Any]:
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    live = Path(task["live"])
    shutil.rmtree(live, ignore_errors=True)
    live.mkdir(parents=True)
    out_dir, checkpoint_dir = live / "sink", live / "streaming-checkpoint"
    spark.conf.set(
        "spark.sql.streaming.stateStore.providerClass",
        "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
    )
    schema = T.StructType(
        [
            T.StructField("user", T.StringType()),
            T.StructField("amount", T.DoubleType()),
            T.StructField("quantity", T.LongType()),
        ]
    )

    def write_batch(df: Any, batch_id: int) -> None:
        # overwrite: a replayed micro-batch replaces its own output (idempotent per batch id)
        df.write.mode("overwrite").parquet(f"file://{out_dir}/batch={batch_id}")

    with measured() as m:
        query = (
            spark.readStream.schema(schema)
            .option("maxFilesPerTrigger", task["files_per_epoch"])
            .parquet(f"file://{task['data']}/*.parquet")
            .groupBy("user")
            .agg(
                F.count(F.lit(1)).alias("n"),
                F.sum("amount").alias("total"),
                F.avg("amount").alias("avg_amount"),
                F.min("quantity").alias("min_q"),
                F.max("quantity").alias("max_q"),
            )
            .writeStream.outputMode("update")
            .foreachBatch(write_batch)
            .option("checkpointLocation", f"file://{checkpoint_dir}")
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
    if query.exception() is not None:
        raise RuntimeError(f"streaming query failed: {query.exception()}")
    progress = query.recentProgress
    durations: dict[str, int] = {}
    for p in progress:
        for k, v in (p.durationMs or {}).items():
            durations[k] = durations.get(k, 0) + int(v)
    out = spark.read.parquet(f"file://{out_dir}")
    latest = out.groupBy("user").agg(F.max("n").alias("n"))  # counts only grow: max = final
    row = latest.agg(F.count(F.lit(1)).alias("keys"), F.sum("n").alias("events")).first()
    return {
        **m,
        "batches": len(progress),
        "batch_ms": [int((p.durationMs or {}).get("triggerExecution", 0)) for p in progress],
        "duration_ms_sum": durations,
        "state_rows": int(progress[-1].stateOperators[0].numRowsTotal) if progress else None,
        "output_keys": int(row["keys"]),
        "output_events": int(row["events"]),
        "state_store": spark.conf.get("spark.sql.streaming.stateStore.providerClass"),
        "changelog_checkpointing": spark.conf.get(
            "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "false"
        ),
    }


# ============================================================================ measurement plan


def rotated(items: Sequence[str], by: int) -> list[str]:
    k = by % len(items)
    return [*items[k:], *items[:k]]


def measure(s: Settings, data: dict[str, Any], work: Path) -> list[dict[str, Any]]:
    """Every variant once per round, interleaved: full runs in a rotated order, then a crash
    and restores (same and other parallelisms, rotated) from identical copies of its state."""
    live, snapshot = work / "live", work / "crashed"
    base: dict[str, Any] = {
        "master": s.master,
        "data": data["dir"],
        "files_per_epoch": s.files_per_epoch,
        "spec_parallelism": s.parallelism,
        "shuffle_partitions": s.parallelism,
        "live": str(live),
    }
    full_runs = {
        "off": {"every_epochs": False, "fresh": True, "parallelism": None},
        "every": {"every_epochs": True, "fresh": True, "parallelism": None},
        "every-delta": {"every_epochs": True, "fresh": True, "parallelism": None, "delta": True},
        "peer": {},
    }
    parallelisms = [s.parallelism, *s.rescale_to]
    runs: list[dict[str, Any]] = []
    total = s.rounds * (len(full_runs) + 1 + len(parallelisms))

    def one(variant: str, round_no: int, extra: dict[str, Any]) -> dict[str, Any]:
        n = len(runs) + 1
        load, others = loadavg(), other_spark_jvms()
        console.print(
            f"[{n}/{total}] round {round_no + 1}: [bold]{variant}[/bold] "
            f"(load {load}, other Spark JVMs {others}) ...",
            end=" ",
        )
        task = {**base, **extra, "variant": variant}
        result = run_worker(task, work / f"r{round_no}-{variant}.log", s)
        result.update(round=round_no, variant=variant, loadavg_1m=load, other_spark_jvms=others)
        result["with_session_s"] = round(result["run_s"] + result["session_s"], 3)
        runs.append(result)
        console.print(f"{result['run_s']:.1f} s")
        return result

    for r in range(s.rounds):
        for variant in rotated(list(full_runs), r):
            one(variant, r, full_runs[variant])
        crash = one(
            "crash",
            r,
            {"every_epochs": True, "fresh": True, "parallelism": None}
            | {"crash_after_epochs": s.crash_after_epochs},
        )
        if not crash["crashed"]:
            raise RuntimeError("the crash run did not crash")
        shutil.rmtree(snapshot, ignore_errors=True)
        os.replace(live, snapshot)  # metastore.db (+ WAL), checkpoints/, sink/, pipeline.yaml
        for p in rotated([str(p) for p in parallelisms], r):
            shutil.rmtree(live, ignore_errors=True)
            shutil.copytree(snapshot, live, symlinks=True)  # same absolute paths as the crash
            one(f"restore-p{p}", r, {"fresh": False, "parallelism": int(p)})
        shutil.rmtree(snapshot, ignore_errors=True)
    shutil.rmtree(live, ignore_errors=True)
    return runs


# ============================================================================ figures


def figures(s: Settings, runs: list[dict[str, Any]]) -> dict[str, Any]:
    by_variant: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_variant.setdefault(r["variant"], []).append(r)
    out: dict[str, Any] = {}
    for variant, rs in by_variant.items():
        out[variant] = {
            "runs_s": [r["run_s"] for r in rs],
            "median_s": round(statistics.median(r["run_s"] for r in rs), 3),
            "cpu_s": [r["cpu_s"] for r in rs],
            "median_cpu_s": round(statistics.median(r["cpu_s"] for r in rs), 2),
        }
        phases = sorted({k for r in rs for k in r.get("phases_s", {})})
        if phases:
            out[variant]["median_phases_s"] = {
                k: round(statistics.median(r["phases_s"].get(k, 0.0) for r in rs), 3)
                for k in phases
            }
    return out


def ratio(
    runs: list[dict[str, Any]], num: str, den: str, target: float, key: str = "run_s"
) -> dict[str, Any]:
    """Median over medians, plus the same ratio within each round (paired, less drift)."""

    def of(variant: str) -> dict[int, float]:
        return {r["round"]: r[key] for r in runs if r["variant"] == variant}

    a, b = of(num), of(den)
    value = statistics.median(a.values()) / statistics.median(b.values())
    paired = [round(a[k] / b[k], 3) for k in sorted(a) if k in b]
    return {
        "numerator": num,
        "denominator": den,
        "value": round(value, 3),
        "paired_by_round": paired,
        "target_max": target,
        "pass": value <= target,
    }


def ratios(s: Settings, runs: list[dict[str, Any]]) -> dict[str, Any]:
    same = f"restore-p{s.parallelism}"
    out: dict[str, Any] = {
        "checkpoint_overhead": ratio(runs, "every", "off", TARGETS["checkpoint_overhead"]),
        "vs_structured_streaming": ratio(runs, "every", "peer", TARGETS["vs_structured_streaming"]),
        "recovery": ratio(runs, same, "every", TARGETS["recovery"]),
    }
    for p in s.rescale_to:
        out[f"rescaled_restore_{s.parallelism}_to_{p}"] = ratio(
            runs, f"restore-p{p}", same, TARGETS["rescaled_restore"]
        )
    # informational: the same ratios in CPU seconds (less sensitive to other work on a shared
    # machine), and in wall seconds including the Spark session's start-up (a real restart)
    out["delta_sink_cost_per_checkpoint"] = sink_cost.cost_ratio(runs)
    for extra, key in (("cpu", "cpu_s"), ("including_session_start", "with_session_s")):
        out[extra] = {
            name: ratio(runs, r["numerator"], r["denominator"], r["target_max"], key)["value"]
            for name, r in out.items()
            if "pass" in r
        }
    return out


def checks(s: Settings, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every finished run must produce every key once and count every event once."""
    keys = {r["output_keys"] for r in runs if "output_keys" in r}
    events = {r["output_events"] for r in runs if "output_events" in r}
    ok = len(keys) == 1 and events == {s.events}
    if not ok:
        console.print(f"[red]output mismatch: keys {keys}, events {events}[/red]")
    codes = sorted({r.get("code", "?") for r in runs})
    if len(codes) > 1:
        console.print(f"[yellow]the measured code changed during the run: {codes}[/yellow]")
    return {
        "distinct_keys": sorted(keys),
        "events_counted": sorted(events),
        "consistent": ok,
        "code_versions": codes,
    }


# ============================================================================ machine


def machine_info() -> dict[str, Any]:
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gb": _memory_gb(),
        "java": _java_version(),
        "packages": {
            p: importlib_metadata.version(p) for p in ("pyspark", "pyarrow", "sqlalchemy")
        },
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }


def loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def other_spark_jvms() -> int:
    """Spark driver JVMs on the machine (called between our workers: all are someone else's)."""
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"org.apache.spark.deploy.SparkSubmit" in cmdline:
            count += 1
    return count


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU of ``root`` and its live descendants, plus their reaped children."""
    ticks = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after "pid (comm)": state ppid ... utime(12) stime(13) cutime(14) cstime(15)
        ppid = int(fields[1])
        stats[int(entry.name)] = (ppid, sum(int(x) for x in fields[11:15]) / ticks)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo.extend(children.get(pid, []))
    return total


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    return None


def _java_version() -> str | None:
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else "java"
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stderr.splitlines()[0] if out.stderr else None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


# ============================================================================ report

DEFINITIONS = {
    "off": "our runtime, checkpoint.every_epochs and interval unset: no checkpoint during the "
    "epochs; the runtime's one forced final checkpoint (it commits the sink) still runs",
    "every": "our runtime, checkpoint.every_epochs: 1 (retained 1): a checkpoint at every epoch "
    "boundary, each committing that epoch's staged changelog",
    "every-delta": "'every' with sink format: delta (mode: upsert, a local table)",
    "sink_s_per_checkpoint": "seconds in the sink's stage, commit and publish_final over the run, "
    "divided by its checkpoints",
    "delta_sink_cost_per_checkpoint": "sink_s_per_checkpoint of every-delta / every, per round "
    "(paired), with median, min, max and stdev",
    "peer": "Spark Structured Streaming: readStream parquet (schema given), maxFilesPerTrigger = "
    "files per epoch, groupBy(user).agg(count, sum, avg, min, max), RocksDBStateStoreProvider, "
    "trigger(availableNow=True), update mode, foreachBatch -> parquet per micro-batch",
    "crash": "'every' with crash_after_epochs = 80 % of the epochs (SimulatedCrash)",
    "restore-p<N>": "restart from a copy of the crashed run's metastore, checkpoints and sink with "
    "restore=latest at parallelism N, to the end (final table published)",
    "run_s": "wall seconds from after the Spark session is up to the job's end (session start-up "
    "is recorded apart as session_s)",
    "cpu_s": "CPU seconds of the worker process tree (driver JVM, Python workers) over run_s",
    "with_session_s": "run_s + session_s: what a restart costs end to end, JVM start included",
    "ratio": "median(numerator runs) / median(denominator runs); paired_by_round: the same per "
    "round (variants of a round run back to back)",
}


def verdicts(r: dict[str, Any]) -> dict[str, bool]:
    return {k: v["pass"] for k, v in r.items() if isinstance(v, dict) and "pass" in v}


def print_summary(report: dict[str, Any]) -> None:
    s, f = report["settings"], report["figures"]
    title = (
        f"Spark pipeline: {s['events']:,} events, {report['checks']['distinct_keys']} keys, "
        f"{s['epochs']} epochs, parallelism {s['parallelism']}, {s['rounds']} round(s)"
        + (" (quick)" if s["quick"] else "")
    )
    table = Table(title=title)
    for col in ("variant", "median s", "runs s", "median CPU s"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for variant, v in f.items():
        table.add_row(
            variant,
            f"{v['median_s']:.1f}",
            " ".join(f"{x:.1f}" for x in v["runs_s"]),
            f"{v['median_cpu_s']:.1f}",
        )
    console.print(table)
    table = Table(title="Ratios (medians)")
    for col in ("ratio", "value", "per round", "CPU", "target", ""):
        table.add_column(col, justify="left" if col == "ratio" else "right")
    cpu = report["ratios"]["cpu"]
    for name, r in report["ratios"].items():
        if "pass" not in r:
            continue
        mark = "[green]pass[/green]" if r["pass"] else "[red]MISS[/red]"
        table.add_row(
            f"{name} ({r['numerator']} / {r['denominator']})",
            f"{r['value']:.2f}x",
            " ".join(f"{x:.2f}" for x in r["paired_by_round"]),
            f"{cpu[name]:.2f}x",
            f"<= {r['target_max']}x",
            mark,
        )
    console.print(table)
    cost = report["ratios"].get("delta_sink_cost_per_checkpoint")
    if cost:
        per = cost["sink_s_per_checkpoint"]
        console.print(
            f"Delta sink cost per checkpoint vs Parquet: {cost['median']:.2f}x (per round "
            f"{' '.join(f'{x:.2f}' for x in cost['paired_by_round'])}; min {cost['min']:.2f}, max "
            f"{cost['max']:.2f}); {per['every-delta']:.3f} s vs {per['every']:.3f} s"
        )
    m = report["machine"]
    console.print(
        f"[dim]{m['cpu_count']} CPUs ({m['cpu_model']}), Python {m['python']}, "
        f"Spark {m['packages']['pyspark']}, {m['java']}; load {m['loadavg_1m_before']} -> "
        f"{m['loadavg_1m_after']}, other Spark JVMs seen: {m['other_spark_jvms_max']}[/dim]"
    )


def write_report(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)


# ============================================================================ main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="small data, one round (development)")
    p.add_argument("--events", type=int, help="events (default 5,000,000; quick 200,000)")
    p.add_argument("--keys", type=int, help="keys parameter (default 510,000; quick 20,000)")
    p.add_argument("--epochs", type=int, default=20, help="epochs (default 20)")
    p.add_argument("--files-per-epoch", type=int, default=1, help="input files per epoch")
    p.add_argument("--seed", type=int, default=0, help="data seed")
    p.add_argument("--parallelism", type=int, default=4, help="parallelism of the full runs")
    p.add_argument(
        "--rescale-to",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[2, 8],
        metavar="N,N,...",
        help="parallelisms of the rescaled restores (default 2,8)",
    )
    p.add_argument("--rounds", type=int, help="runs of each variant (default 3; quick 1)")
    p.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    p.add_argument("--driver-memory", help="spark.driver.memory (default: Spark's, as ckpt run)")
    p.add_argument("--data-dir", type=Path, default=DATA_ROOT, help="cache of generated data")
    p.add_argument("--keep-work", action="store_true", help="keep the work directory and logs")
    p.add_argument("--output", type=Path, default=RESULTS, help="JSON results file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(json.loads(args.worker))
        return 0
    s = make_settings(args)
    started = datetime.now(UTC)
    load_before = loadavg()
    data = ensure_data(s, args.data_dir)
    WORK_ROOT.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="spark-bench-", dir=WORK_ROOT))
    try:
        runs = measure(s, data, work)
    except BaseException:
        console.print(f"[red]failed; logs kept in {work}[/red]")
        raise
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    r = ratios(s, runs)
    report: dict[str, Any] = {
        "benchmark": "spark",
        "generated_at": started.isoformat(),
        "duration_s": round((datetime.now(UTC) - started).total_seconds(), 1),
        "settings": {**asdict(s), "files": s.files, "shuffle_partitions": s.parallelism},
        "data": data,
        "machine": {
            **machine_info(),
            "loadavg_1m_before": load_before,
            "loadavg_1m_after": loadavg(),
            # other work on the machine skews the figures: seen before each run
            "loadavg_1m_max": max((x["loadavg_1m"] or 0) for x in runs),
            "other_spark_jvms_max": max(x["other_spark_jvms"] for x in runs),
        },
        "definitions": DEFINITIONS,
        "targets": TARGETS,
        "figures": figures(s, runs),
        "ratios": r,
        "meets_targets": verdicts(r),
        "checks": checks(s, runs),
        "runs": runs,
    }
    write_report(report, args.output)
    print_summary(report)
    console.print(f"results written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
