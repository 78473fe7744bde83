"""The machine a benchmark runs on, for ``bench/spark_bench.py`` and ``bench/ack_bench.py``: what
it is (CPU, memory, Java, package versions, git commit), how busy it is (load average, other Spark
driver JVMs — the machine is shared, and other work skews the figures) and the CPU seconds of a
process tree."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def machine_info() -> dict[str, Any]:
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "memory_gb": memory_gb(),
        "java": _java_version(),
        "packages": {p: _version(p) for p in ("pyspark", "pyarrow", "sqlalchemy", "matplotlib")},
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
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


#: a run is flagged as taken under load when the 1-min load average before it exceeds this
LOAD_LIMIT = 0.5
#: the share of all cores' time busy (user, system, I/O wait, …) in the seconds before a run
#: above which it counts as taken under load: measured, not the 1-min load average, which
#: still holds the bench's own previous run for a minute after it ended
BUSY_LIMIT = 0.10
BUSY_WINDOW_S = 3.0


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores since boot, from /proc/stat (I/O wait counts busy:
    a disk still writing the previous run's files is load too)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3]
    return sum(fields) - idle, sum(fields)


def cpu_busy(window_s: float = BUSY_WINDOW_S) -> float | None:
    """The share of all cores' time that was busy over the next ``window_s`` seconds."""
    before = _cpu_times()
    time.sleep(window_s)
    after = _cpu_times()
    if before is None or after is None or after[1] == before[1]:
        return None
    return round((after[0] - before[0]) / (after[1] - before[1]), 3)


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out.setdefault(ppid, []).append(int(entry.name))
    return out


def tree_pids(root: int) -> set[int]:
    """``root`` and its live descendants."""
    children, out, todo = _children(), set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children.get(pid, []))
    return out


def rss_bytes(pids: set[int]) -> int:
    """Resident memory of these processes (VmRSS summed; a process gone meanwhile counts 0)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
    return total


def java_pids() -> set[int]:
    """Every JVM on the machine (a process whose command is ``java``)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if comm == "java":
            out.add(int(entry.name))
    return out


class Watch:
    """Samples a child's process tree while it runs (a thread, every ``interval`` seconds): its
    peak resident memory (the tree's RSS summed: driver JVM, Python, its workers) and the most
    JVMs seen at once that are not in the tree (someone else's work on the machine)."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        import threading

        self.pid, self.interval = pid, interval
        self.peak_rss = 0
        self.other_java_max = 0
        #: every JVM seen in the tree: the run's own still, once its Python parent has exited
        #: and it is re-parented while it shuts down (else counted as someone else's)
        self.own_java: set[int] = set()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        pids = tree_pids(self.pid)
        self.peak_rss = max(self.peak_rss, rss_bytes(pids))
        java = java_pids()
        self.own_java |= java & pids
        self.other_java_max = max(self.other_java_max, len(java - pids - self.own_java))
        self.samples += 1


def load_flags(run: dict[str, Any]) -> list[str]:
    """Why a run's figures may be skewed by other work: the reasons, empty when none. Uses the
    run's ``cpu_busy_before`` (else, for older records, ``loadavg_1m``), ``other_spark_jvms``
    and ``other_java_start`` / ``_max`` / ``_end`` (JVMs that were not the run's, before, during
    and after it)."""
    out = []
    busy = run.get("cpu_busy_before")
    load = run.get("loadavg_1m")
    if busy is not None:  # measured just before the run (the load average lags a minute)
        if busy > BUSY_LIMIT:
            out.append(f"{busy:.0%} of the cores busy before the run (> {BUSY_LIMIT:.0%})")
    elif load is not None and load > LOAD_LIMIT:  # runs recorded before the busy share was
        out.append(f"1-min load {load} > {LOAD_LIMIT} before the run")
    others = max(
        run.get(k) or 0
        for k in ("other_spark_jvms", "other_java_start", "other_java_max", "other_java_end")
    )
    if others:
        out.append(f"{others} other JVM(s) running")
    return out


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


def _version(package: str) -> str | None:
    try:
        return importlib_metadata.version(package)
    except importlib_metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_gb() -> float | None:
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


def git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
