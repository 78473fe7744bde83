"""``ckpt run`` as a process of its own, SIGKILLed at a seeded random moment: the kill tests of
the Delta sink and of the transform share it."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

CKPT = str(Path(sys.executable).with_name("ckpt"))


def ckpt_env(home: Path) -> dict[str, str]:
    """This environment without ``CKPT_*``, with ``home`` as ``CKPT_HOME``, unbuffered output
    (the epoch lines arrive as they happen) and a quickly starting driver JVM."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env |= {"CKPT_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    env["PYSPARK_SUBMIT_ARGS"] = "--driver-java-options -XX:TieredStopAtLevel=1 pyspark-shell"
    return env


def kill_at_a_random_moment(spec: Path, env: dict[str, str], rng: random.Random, job: str) -> int:
    """``ckpt run spec``, SIGKILLed 2 or 3 epochs in plus a fraction of a warm epoch (the first
    is slow: a cold JVM, so at least three epochs are left to be killed in); returns the epochs
    it reported done."""
    epoch_line = re.compile(rf"job {re.escape(job)}: epoch (\d+)/\d+ done in (\d+) ms")
    after, fraction = rng.randint(2, 3), rng.random()
    proc = subprocess.Popen(
        [CKPT, "run", str(spec)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    epoch_ms: list[int] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if match := epoch_line.search(line):
                epoch_ms.append(int(match[2]))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    try:
        while len(epoch_ms) < after:
            assert proc.poll() is None, f"the job ended (rc {proc.returncode}) first"
            assert time.monotonic() < deadline, f"epoch {after} not reached"
            time.sleep(0.02)
        time.sleep(fraction * min(epoch_ms[1:]) / 1000)  # in the next epoch or its commit
        assert proc.poll() is None, "the job finished before the kill"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        reader.join(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    return len(epoch_ms)
