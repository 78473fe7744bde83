"""The measured runs of ``bench/spark_bench.py``, each in a child process: a fresh JVM and Spark
session (``local[2]``, shuffle partitions = parallelism), so no run inherits another's JIT
warm-up, cached blocks or garbage. Only the workers import pyspark.

* ``work_ours`` runs our runtime (``PipelineRun``, subclassed to time its phases: per call, not
  only totals) from a spec written here, then reads what each checkpoint cost from the run's
  metastore (``checkpoint_costs``).
* ``work_peer`` runs Spark Structured Streaming over the same files: RocksDB state store, with or
  without changelog checkpointing.

A run is timed from after the session is up to the job's end (``run_s``), and as a whole process
from its spawn to the job's end and the session's stop (``process_s``: Python start, imports, JVM
and session start included, the bench's output check left out; as the plain job W is timed);
CPU seconds are those of the worker's process tree over ``run_s``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sink_cost
from machine import tree_cpu_seconds
from plain_job import session_conf, w_aggregates
from spark_workload import AGGREGATIONS, BENCH, JOB, ROOT

ENTRY = BENCH / "spark_bench.py"
ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
CHANGELOG = "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled"


def run_worker(
    task: dict[str, Any], log_path: Path, driver_memory: str | None = None
) -> dict[str, Any]:
    """Run ``task`` in a child process (``spark_bench.py --worker``); its result."""
    result_path = log_path.with_suffix(".json")
    task = {**task, "result_path": str(result_path)}
    spawned = time.time()
    with log_path.open("w") as log:
        proc = subprocess.run(
            [sys.executable, str(ENTRY), "--worker", json.dumps(task)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=submit_env(driver_memory),
            check=False,
        )
    exited = time.time()
    if proc.returncode != 0 or not result_path.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"worker {task['variant']} failed ({proc.returncode}):\n{tail}")
    result = json.loads(result_path.read_text())
    # the whole process as a user's: spawn (Python start, imports, JVM) to the job's end and
    # the session's stop (the bench's own output check between them left out)
    result["process_s"] = round(result.pop("ended_at") - spawned, 3)
    result["exit_s"] = round(exited - spawned, 3)
    return result


def submit_env(driver_memory: str | None) -> dict[str, str]:
    """The environment of every measured process: no console progress bars (they would only
    fill the log), and the driver's memory when given (else Spark's default, as ``ckpt run``)."""
    submit = ["--conf", "spark.ui.showConsoleProgress=false"]
    if driver_memory:
        submit += ["--driver-memory", driver_memory]
    return {**os.environ, "PYSPARK_SUBMIT_ARGS": " ".join([*submit, "pyspark-shell"])}


def worker_main(task: dict[str, Any]) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    from checkpointing.spark.session import spark_session

    started = time.perf_counter()
    spark = spark_session(f"bench-{task['variant']}", task["master"])
    spark.sparkContext.setLogLevel("WARN")
    spark.conf.set("spark.sql.shuffle.partitions", str(task["shuffle_partitions"]))
    session_s = time.perf_counter() - started
    conf = session_conf(spark)  # before a run sets its own SQL settings
    body = work_peer if task.get("peer") else work_ours
    try:
        result = body(spark, task)
    finally:
        stop_started = time.perf_counter()
        spark.stop()
        stop_s = time.perf_counter() - stop_started
    # the job's end and the session's stop, less the output check and the bench's reads between
    result["ended_at"] += stop_s
    result["stop_s"] = round(stop_s, 3)
    result["session_s"] = round(session_s, 3)
    result["session_conf"] = conf
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
    out["ended_at"] = time.time()  # the job's end, for the parent's process_s
    out["run_s"] = round(time.perf_counter() - t0, 3)
    out["cpu_s"] = round(tree_cpu_seconds(os.getpid()) - cpu0, 2)


# ============================================================================ our runtime


def write_spec(live: Path, task: dict[str, Any]) -> None:
    # checkpoint.incremental is applied to the loaded spec (work_ours), not written here: the
    # spec file loader may not accept the field yet
    checkpoint: dict[str, Any] = {"every_epochs": 1} if task["every_epochs"] else {}
    source: dict[str, Any] = {"format": "parquet", "path": f"{task['data']}/*.parquet"}
    if task.get("epoch_fraction"):  # epochs by work: that fraction of the input each
        total = sum(p.stat().st_size for p in Path(task["data"]).glob("*.parquet"))
        source["epoch_bytes"] = math.ceil(total / task["epoch_fraction"] * 1.1)
    else:
        source["splits_per_epoch"] = task["files_per_epoch"]
    spec = {
        "job": JOB,
        "source": source,
        "key": "user",
        "aggregations": AGGREGATIONS,
        # the final table only, as W writes (the state merged lazily); the changelog when asked
        "sink": {"path": str(live / "sink")}
        | ({"format": "delta"} if task.get("delta") else {})
        | ({} if task.get("delta") or task.get("sink_changelog") else {"changelog": False}),
        "parallelism": task["spec_parallelism"],
        "checkpoint": checkpoint,
    }
    (live / "pipeline.yaml").write_text(json.dumps(spec, indent=1))  # JSON is YAML


def work_ours(spark: Any, task: dict[str, Any]) -> dict[str, Any]:
    from checkpointing.metastore.engine import Metastore
    from checkpointing.pipeline.spec import load_spec
    from checkpointing.spark.preflight import RunOptions
    from checkpointing.spark.restarts import run_with_restarts
    from checkpointing.spark.runtime import PipelineRun, SimulatedCrash
    from checkpointing.state.storage import FileSystemCheckpointStorage

    live = Path(task["live"])
    metastore_url = f"sqlite:///{live / 'metastore.db'}"
    if task["fresh"]:
        shutil.rmtree(live, ignore_errors=True)
        live.mkdir(parents=True)
        Metastore(metastore_url, check_schema=False).upgrade()
        write_spec(live, task)
    spec = load_spec(live / "pipeline.yaml")
    if task.get("incremental") is not None:
        checkpoint = spec.checkpoint.model_copy(update={"incremental": task["incremental"]})
        spec = spec.model_copy(update={"checkpoint": checkpoint})
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{live / 'checkpoints'}")
    options = RunOptions(
        restore="latest" if not task["fresh"] else "none",
        parallelism=task["parallelism"],
        crash_after_epochs=task.get("crash_after_epochs"),
        fail_task_after_epochs=task.get("fail_task_after_epochs"),
    )
    epochs_ms: list[int] = []
    started: list[Any] = []
    sink_s: dict[str, float] = {}

    def start(opts: RunOptions) -> Any:  # each attempt timed; the warm variant has two
        started.append(
            timed_run_class(PipelineRun)(
                spec, spark, metastore, storage, opts, on_epoch=lambda _e, ms: epochs_ms.append(ms)
            )
        )
        sink_s.update(sink_cost.time_sink(started[-1].sink))
        return started[-1]

    crashed = False
    with measured() as m:
        try:
            result = run_with_restarts(start, options, attempts=spec.restarts)
        except SimulatedCrash:
            crashed = True
    run = started[-1]
    out: dict[str, Any] = {
        **m,
        "phases_s": {k: round(sum(v), 3) for k, v in run.bench_calls.items()},
        "phase_calls": {k: len(v) for k, v in run.bench_calls.items()},
        "phase_calls_s": {k: [round(x, 3) for x in v] for k, v in run.bench_calls.items()},
        "epochs_ms": epochs_ms,
        "crashed": crashed,
        "sink_s": {k: round(v, 3) for k, v in sink_s.items()},
        "incremental": spec.checkpoint.incremental,
    }
    costs = checkpoint_costs(metastore, run.bench_snapshots())
    for c in costs["checkpoints"]:
        c["restored"] = c["checkpoint_id"] == run.result.restored_from
    out["checkpoint_costs"] = costs
    if not task["fresh"]:
        restored = next((c for c in costs["checkpoints"] if c["restored"]), None)
        out["restored_state_bytes"] = restored["state_size"] if restored else None
    if not crashed:
        delta = spec.sink.format == "delta"
        keys, events = sink_cost.output_counts(spark, result.final_path, delta)
        out.update(
            restarts=result.restarts,
            epochs_run=len(result.epochs_run),
            restored_from=result.restored_from,
            restore_phases_s={k: round(v, 3) for k, v in result.restore_phases.items()},
            checkpoints=len(result.checkpoints),
            output_keys=keys,
            output_events=events,
            sink_s_per_checkpoint=round(sum(sink_s.values()) / max(1, len(result.checkpoints)), 4),
        )
    metastore.dispose()
    return out


def timed_run_class(base: type) -> type:
    """``base`` with its phases timed: seconds of every call per phase (nested phases overlap:
    ``finish`` includes its forced checkpoint's ``barrier`` and ``snapshot``), and per
    checkpoint its epoch and snapshot seconds. A phase the runtime does not have is simply never
    called. The attributes are prefixed ``bench_`` to stay clear of the runtime's own.

    With asynchronous snapshots (the runtime's ``_stage_write`` returns the keyed state's write,
    run on a background thread, and ``_complete_inflight`` waits for it at the next boundary),
    ``sync_s`` is the driver's synchronous part (``_snapshot`` less its wait for the previous
    write), ``write_s`` the background write (the stage writes, timed on their thread) and
    ``snapshot_s`` their sum; with synchronous snapshots ``snapshot_s`` is the ``_snapshot``
    call."""

    class TimedRun(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.bench_calls: dict[str, list[float]] = {}
            self.bench_checkpoints: dict[int, dict[str, Any]] = {}
            self.bench_waited = 0.0
            super().__init__(*args, **kwargs)

        @contextmanager
        def _bench_phase(self, name: str) -> Iterator[None]:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.bench_calls.setdefault(name, []).append(time.perf_counter() - t0)

        def _restore(self, *a: Any, **k: Any) -> Any:
            with self._bench_phase("restore"):
                return super()._restore(*a, **k)

        def _process(self, *a: Any, **k: Any) -> Any:
            with self._bench_phase("process"):
                return super()._process(*a, **k)

        def _barrier(self, *a: Any, **k: Any) -> Any:
            with self._bench_phase("barrier"):
                return super()._barrier(*a, **k)

        def _complete_inflight(self, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                with self._bench_phase("await_write"):
                    return super()._complete_inflight(*a, **k)
            finally:
                self.bench_waited += time.perf_counter() - t0

        def _snapshot(self, *a: Any, **k: Any) -> Any:
            # (checkpoint_id, location_url, epoch, ...): only the first three are read here
            checkpoint_id = a[0] if a else k.get("checkpoint_id")
            epoch = a[2] if len(a) > 2 else k.get("epoch")
            record = self.bench_checkpoints.setdefault(checkpoint_id, {"write_s": None})
            record["epoch"] = epoch
            t0, waited0 = time.perf_counter(), self.bench_waited
            try:
                with self._bench_phase("snapshot"):
                    return super()._snapshot(*a, **k)
            finally:
                total = time.perf_counter() - t0
                record["call_s"] = round(total, 4)
                record["sync_s"] = round(total - (self.bench_waited - waited0), 4)

        def _stage_write(self, s: Any, checkpoint_id: int, *a: Any, **k: Any) -> Any:
            write = super()._stage_write(s, checkpoint_id, *a, **k)
            record = self.bench_checkpoints.setdefault(checkpoint_id, {"write_s": None})

            def timed() -> Any:
                t0 = time.perf_counter()
                try:
                    return write()
                finally:
                    record["write_s"] = (record["write_s"] or 0.0) + time.perf_counter() - t0

            return timed

        def _finish(self, *a: Any, **k: Any) -> Any:
            with self._bench_phase("finish"):
                return super()._finish(*a, **k)

        def bench_snapshots(self) -> dict[int, dict[str, Any]]:
            out = {}
            for cid, r in self.bench_checkpoints.items():
                write = r.get("write_s")
                sync = r.get("sync_s")
                snapshot = r.get("call_s") if write is None else (sync or 0.0) + write
                out[cid] = {
                    "epoch": r.get("epoch"),
                    "snapshot_s": None if snapshot is None else round(snapshot, 4),
                    "sync_s": sync,
                    "write_s": None if write is None else round(write, 4),
                }
            return out

    return TimedRun


SNAPSHOT_FIELDS = ("epoch", "snapshot_s", "sync_s", "write_s")


def checkpoint_costs(metastore: Any, snapshots: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per checkpoint of the job, from the metastore's tables (reflected, so a column the
    runtime has not yet got reads as null): status, ``state_size`` (the full state's bytes),
    ``checkpointed_size`` (bytes that checkpoint wrote), its acks' sizes and sync/async
    milliseconds, the changed key groups the keyed acks report (``state_meta.changed_groups``),
    and the snapshot seconds this run timed (``snapshots``, from ``TimedRun.bench_snapshots``;
    null for checkpoints of an earlier run)."""
    from sqlalchemy import MetaData, Table, select

    meta = MetaData()
    engine = metastore.engine
    checkpoints = Table("ckpt_checkpoints", meta, autoload_with=engine)
    acks = Table("ckpt_checkpoint_acks", meta, autoload_with=engine)
    columns = {"checkpoint_id", "checkpoint_type", "status", "state_size", "checkpointed_size"}
    with engine.connect() as conn:
        rows = conn.execute(
            select(*(c for c in checkpoints.c if c.name in columns))
            .where(checkpoints.c.job_id == JOB)
            .order_by(checkpoints.c.checkpoint_id)
        ).all()
        ack_rows = conn.execute(select(acks).where(acks.c.job_id == JOB)).all()
    by_checkpoint: dict[int, list[Any]] = {}
    for a in ack_rows:
        by_checkpoint.setdefault(a.checkpoint_id, []).append(a._mapping)
    out = []
    for r in rows:
        m = r._mapping
        mine = by_checkpoint.get(m["checkpoint_id"], [])
        metas = [_json(a.get("state_meta")) for a in mine]
        changed = [
            x["changed_groups"] for x in metas if isinstance(x, dict) and "changed_groups" in x
        ]
        out.append(
            {
                "checkpoint_id": m["checkpoint_id"],
                "type": m.get("checkpoint_type"),
                "status": m.get("status"),
                "state_size": m.get("state_size"),
                "checkpointed_size": m.get("checkpointed_size"),
                "acks": len(mine),
                "acks_state_size": sum(a.get("state_size") or 0 for a in mine) if mine else None,
                "max_sync_ms": max((a.get("sync_ms") or 0 for a in mine), default=None),
                "max_async_ms": max((a.get("async_ms") or 0 for a in mine), default=None),
                "changed_groups": sum(changed) if changed else None,
                "restored": False,
                **snapshots.get(m["checkpoint_id"], dict.fromkeys(SNAPSHOT_FIELDS)),
            }
        )
    return {
        "has_checkpointed_size": "checkpointed_size" in checkpoints.c,
        "checkpoints": out,
    }


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return value


# ============================================================================ the peer


def work_peer(spark: Any, task: dict[str, Any]) -> dict[str, Any]:
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    live = Path(task["live"])
    shutil.rmtree(live, ignore_errors=True)
    live.mkdir(parents=True)
    out_dir, checkpoint_dir = live / "sink", live / "streaming-checkpoint"
    spark.conf.set("spark.sql.streaming.stateStore.providerClass", ROCKSDB)
    spark.conf.set(CHANGELOG, "true" if task.get("changelog") else "false")
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
            .agg(*w_aggregates())
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
        "changelog_checkpointing": spark.conf.get(CHANGELOG, "false"),
    }
