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
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from spark_workers import code_fingerprint, submit_env, write_spec
from spark_workload import BENCH, JOB, ROOT

PLAIN_JOB = BENCH / "plain_job.py"
EPOCH_LINE = re.compile(rf"job {re.escape(JOB)}: epoch \d+/\d+ done in (\d+) ms")


def run_process(
    task: dict[str, Any], log_path: Path, driver_memory: str | None = None
) -> dict[str, Any]:
    """Run a whole-process variant (``task["process"]``: ``plain`` or ``cli``); its result."""
    live = Path(task["live"])
    shutil.rmtree(live, ignore_errors=True)
    live.mkdir(parents=True)
    result_path = live / "result.json"
    env = submit_env(driver_memory)
    if task["process"] == "plain":
        out_dir = live / "sink"
        cmd = [
            sys.executable, str(PLAIN_JOB), task["data"], str(out_dir),
            "--master", task["master"], "--shuffle-partitions", str(task["shuffle_partitions"]),
            "--result-json", str(result_path),
        ]  # fmt: skip
    else:
        write_spec(live, task)
        out_dir = live / "sink" / "final"
        env["CKPT_HOME"] = str(live)  # metastore.db and checkpoints/ under it, as our workers'
        for name in ("CKPT_METASTORE_URL", "CKPT_STORAGE_URL"):
            env.pop(name, None)
        env["PYTHONUNBUFFERED"] = "1"  # its lines arrive as printed (timed here)
        cmd = [
            *ckpt_command(), "run", str(live / "pipeline.yaml"), "--master", task["master"],
        ]  # fmt: skip
    # what the run imported (the work tree may change during a long run); W imports none of it
    code = "none (plain Spark)" if task["process"] == "plain" else code_fingerprint()
    spawned = time.time()
    finished: float | None = None
    epochs_ms: list[int] = []
    with (
        log_path.open("w") as log,
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=env, text=True
        ) as proc,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:  # ckpt run's last line: "job <id> finished: ..."
            if finished is None and line.startswith(f"job {JOB} "):
                finished = time.time()
            elif m := EPOCH_LINE.match(line):  # "job <id>: epoch 3/20 done in 5123 ms ..."
                epochs_ms.append(int(m.group(1)))
            log.write(line)
    exited = time.time()
    if proc.returncode != 0 or (task["process"] == "plain" and not result_path.exists()):
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"{task['variant']} failed ({proc.returncode}):\n{tail}")
    if task["process"] == "plain":
        result = json.loads(result_path.read_text())
        ended = result.pop("ended_at")
    else:  # the line after the run returned and its session stopped; else the exit
        ended = finished or exited
        result = {"run_s": None, "cpu_s": None, "session_s": None, "epochs_ms": epochs_ms}
        result["ended_by"] = "finished line"
        if finished is None:
            result["ended_by"] = "exit (no 'job ... finished' line seen)"
    keys, events = output_counts(out_dir)
    result.update(
        process_s=round(ended - spawned, 3),
        exit_s=round(exited - spawned, 3),
        output_keys=keys,
        output_events=events,
        code=code,
        command=[Path(c).name if os.sep in c else c for c in cmd],
    )
    shutil.rmtree(live, ignore_errors=True)
    return result


def ckpt_command() -> list[str]:
    """``ckpt`` as installed beside this interpreter (the console script a user runs)."""
    script = Path(sys.executable).with_name("ckpt")
    return [str(script)] if script.exists() else [sys.executable, "-m", "checkpointing.cli"]


def output_counts(directory: Path) -> tuple[int, int]:
    """Keys and counted events of a Parquet table (files named ``_*`` / ``.*`` are skipped)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(directory.resolve(), columns=["n"])
    return table.num_rows, int(pc.sum(table.column("n")).as_py() or 0)
