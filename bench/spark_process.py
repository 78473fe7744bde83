"""The variants of ``bench/spark_bench.py`` that run as a user starts them, a whole process each
(Python start, imports, JVM start included), timed from the parent:

* ``plain`` — W, the plain Spark batch job (``plain_job.py``): the anchor every variant is
  measured against (issue 23).
* ``every-cli`` — ``ckpt run pipeline.yaml`` with a checkpoint every epoch (the spec of
  ``every``), ``CKPT_HOME`` the run's directory (embedded metastore created by the first run, as
  a user's): what ``every`` costs with the command's imports, preflight and progress.

``process_s`` is from the child's spawn to its job's end and its Spark session's stop, the same
span as our instrumented workers' (``spark_workers.run_worker``, which leave out their own output
checks): W records it after ``spark.stop()``; ``ckpt run`` prints its ``job <id> finished`` line
right after its session stopped, timed here as it arrives. ``exit_s`` is spawn to exit. The
output is counted here with pyarrow, after the timing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from machine import Watch
from spark_workers import code_fingerprint, submit_env, write_spec
from spark_workload import BENCH, JOB, ROOT

PLAIN_JOB = BENCH / "plain_job.py"
DESIGN_JOB = BENCH / "design_job.py"
EPOCH_LINE = re.compile(rf"job {re.escape(JOB)}: epoch \d+/\d+ done in (\d+) ms")


def run_process(
    task: dict[str, Any], log_path: Path, driver_memory: str | None = None
) -> dict[str, Any]:
    """Run a whole-process variant (``task["process"]``: ``plain``, ``design`` or ``cli``); its
    result, with the process tree's peak resident memory and the JVMs seen that were not its own.

    ``cli`` with ``kill_after_epochs`` is killed (SIGKILL to its process group: Python and JVM)
    as soon as it prints that epoch's line — a real crash; ``keep_live`` keeps its directory for
    the resume (``fresh: false``: ``ckpt run`` again on the same directory, restore latest)."""
    live = Path(task["live"])
    if task.get("fresh", True):
        shutil.rmtree(live, ignore_errors=True)
        live.mkdir(parents=True)
    result_path = live / "result.json"
    result_path.unlink(missing_ok=True)
    env = submit_env(driver_memory)
    partitions = str(task["shuffle_partitions"])
    spark_args = ["--master", task["master"], "--shuffle-partitions", partitions]
    if task["process"] in ("plain", "design"):
        out_dir = live / "sink"
        job = PLAIN_JOB if task["process"] == "plain" else DESIGN_JOB
        cmd = [
            sys.executable, str(job), task["data"], str(out_dir), *spark_args,
            "--result-json", str(result_path),
        ]  # fmt: skip
        if task["process"] == "design":
            cmd += ["--work", str(live / "chk"), "--files-per-epoch", str(task["files_per_epoch"])]
    else:
        if task.get("fresh", True):
            write_spec(live, task)
        out_dir = live / "sink" / "final"
        env["CKPT_HOME"] = str(live)  # metastore.db and checkpoints/ under it, as our workers'
        for name in ("CKPT_METASTORE_URL", "CKPT_STORAGE_URL"):
            env.pop(name, None)
        env["PYTHONUNBUFFERED"] = "1"  # its lines arrive as printed (timed here)
        cmd = [
            *ckpt_command(), "run", str(live / "pipeline.yaml"), "--master", task["master"],
        ]  # fmt: skip
    # what the run imported (the work tree may change during a long run); W and the design
    # import none of it
    code = code_fingerprint() if task["process"] == "cli" else f"none (plain Spark: {cmd[1]})"
    kill_after = task.get("kill_after_epochs")
    spawned = time.time()
    finished: float | None = None
    killed: float | None = None
    epochs_ms: list[int] = []
    with (
        log_path.open("w") as log,
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            text=True,
            start_new_session=True,  # its own process group: a crash kills the JVM too
        ) as proc,
        Watch(proc.pid) as watch,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:  # ckpt run's last line: "job <id> finished: ..."
            if finished is None and line.startswith(f"job {JOB} "):
                finished = time.time()
            elif m := EPOCH_LINE.match(line):  # "job <id>: epoch 3/20 done in 5123 ms ..."
                epochs_ms.append(int(m.group(1)))
                if kill_after and len(epochs_ms) >= kill_after and killed is None:
                    killed = time.time()
                    os.killpg(proc.pid, signal.SIGKILL)
            log.write(line)
    exited = time.time()
    if killed is not None:
        return {
            "crashed": True,
            "killed_after_epochs": len(epochs_ms),
            "epochs_ms": epochs_ms,
            "process_s": round(killed - spawned, 3),
            "exit_s": round(exited - spawned, 3),
            "peak_rss_bytes": watch.peak_rss,
            "other_java_max": watch.other_java_max,
            "own_java_pids": sorted(watch.own_java),
            "code": code,
            "command": [Path(c).name if os.sep in c else c for c in cmd],
        }
    if proc.returncode != 0 or (task["process"] != "cli" and not result_path.exists()):
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"{task['variant']} failed ({proc.returncode}):\n{tail}")
    if task["process"] != "cli":
        result = json.loads(result_path.read_text())
        ended = result.pop("ended_at")
    else:  # the line after the run returned and its session stopped; else the exit
        ended = finished or exited
        result = {"run_s": None, "cpu_s": None, "session_s": None, "epochs_ms": epochs_ms}
        result["ended_by"] = "finished line"
        if finished is None:
            result["ended_by"] = "exit (no 'job ... finished' line seen)"
    if task["process"] == "design":
        committed = sorted(live.glob("chk/epoch-*/_COMMITTED"))
        result["design_epochs_committed"] = len(committed)
    result.update(
        process_s=round(ended - spawned, 3),
        exit_s=round(exited - spawned, 3),
        peak_rss_bytes=watch.peak_rss,
        other_java_max=watch.other_java_max,
        own_java_pids=sorted(watch.own_java),
        rss_samples=watch.samples,
        **output_check(out_dir),
        code=code,
        command=[Path(c).name if os.sep in c else c for c in cmd],
    )
    if not task.get("keep_live"):
        shutil.rmtree(live, ignore_errors=True)
    return result


def ckpt_command() -> list[str]:
    """``ckpt`` as installed beside this interpreter (the console script a user runs)."""
    script = Path(sys.executable).with_name("ckpt")
    return [str(script)] if script.exists() else [sys.executable, "-m", "checkpointing.cli"]


def output_check(directory: Path) -> dict[str, Any]:
    """The output table's keys and counted events, a digest of its exact content and a
    projection of its averages, equal for equal tables whoever wrote them. The digest: rows
    sorted by key; ``n``, ``min_q``, ``max_q`` exact; ``total`` to the cent (the amounts have two
    decimals: sums added in another order differ far below that). ``avg_amount`` can't be
    rounded safely (averages of cents often end in a 5 at any precision, where 1e-13 flips the
    rounding), so it is summed with fixed pseudo-random weights per sorted row
    (``avg_projection``), compared between runs within 1e-9 relative (``spark_stats.checks``):
    sums in another order differ about 1e-13, a wrong average (e.g. one counting null amounts)
    by far more."""
    import hashlib

    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    columns = ["user", "n", "total", "avg_amount", "min_q", "max_q"]
    t = pq.read_table(directory.resolve(), columns=columns).sort_by("user")
    digest = hashlib.sha256()
    users = t.column("user").cast(pa.string()).combine_chunks()
    lengths = pc.fill_null(pc.binary_length(users), -1).to_numpy().astype(np.int64)
    digest.update(lengths.tobytes())
    digest.update("".join(users.fill_null("").to_pylist()).encode())
    for name in ("n", "min_q", "max_q"):
        digest.update(pc.fill_null(t.column(name).cast(pa.int64()), -1).to_numpy().tobytes())
    total = pc.fill_null(t.column("total").cast(pa.float64()), -1.0).to_numpy()
    digest.update(np.rint(total * 100).astype(np.int64).tobytes())
    avg = pc.fill_null(t.column("avg_amount").cast(pa.float64()), -1.0).to_numpy()
    weights = ((np.arange(len(avg), dtype=np.int64) * 2654435761) % 1000 + 1) / 1000.0
    return {
        "output_keys": t.num_rows,
        "output_events": int(pc.sum(t.column("n")).as_py() or 0),
        "output_digest": digest.hexdigest()[:16],
        "avg_projection": float(np.dot(avg, weights)),
    }
