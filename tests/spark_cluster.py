"""A Spark standalone cluster on loopback for the tests, and what a run on it needs.

- :class:`StandaloneCluster`: a master and workers started with the installed pyspark's own
  ``bin/spark-class`` (``SPARK_HOME`` = the pyspark package, which ships Spark's jars), each JVM in
  its own process group. Every process of the cluster — daemons, executors they launch, and the
  executors' Python workers — inherits a marker variable, so teardown finds all of them, even
  those reparented after their parent died.
- :func:`run_driver`: runs one pipeline attempt as a driver in its own process (``python -m
  tests.spark_cluster``), the way a retried Airflow task would submit it. A Python process can
  hold one SparkContext, and the test process already has the local one of the ``spark`` fixture.
- :class:`RecordingS3Storage`: the real S3 storage, which also notes in a local directory which
  process wrote or read each file (its task context and process ancestry), so the test can tell
  an executor's write from the driver's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyspark

from checkpointing.state.s3_storage import S3CheckpointStorage
from checkpointing.state.storage import FileInfo

PYSPARK_HOME = Path(pyspark.__file__).resolve().parent
REPO_ROOT = Path(__file__).resolve().parent.parent
MARKER = "CKPT_TEST_CLUSTER"
#: the driver's exit code when the ``crash_after_epochs`` hook fired
CRASH_EXIT = 17
EXECUTOR_CLASS = "org.apache.spark.executor.CoarseGrainedExecutorBackend"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"
MASTER_CLASS = "org.apache.spark.deploy.master.Master"


def check_installed_spark() -> str:
    """The full pyspark distribution (jars and launch scripts) must be what is imported: a
    slim client (pyspark-client, pyspark-connect) has neither and cannot start a cluster."""
    version = importlib.metadata.version("pyspark")
    if pyspark.__version__ != version:
        raise RuntimeError(f"imported pyspark {pyspark.__version__} is not installed {version}")
    spark_class = PYSPARK_HOME / "bin" / "spark-class"
    core_jars = list((PYSPARK_HOME / "jars").glob("spark-core_*.jar"))
    if not os.access(spark_class, os.X_OK) or not core_jars:
        raise RuntimeError(f"{PYSPARK_HOME} has no executable bin/spark-class or Spark core jar")
    return version


# ============================================================================ processes


def _parent(pid: int) -> int | None:
    """The parent pid of a live process, or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def describe_process(pid: int) -> dict[str, Any]:
    """What a process is, from its command line: a Spark daemon, an executor (with its id), or
    something else (the program's name)."""
    args = _cmdline(pid)
    if EXECUTOR_CLASS in args:
        i = args.index("--executor-id")
        return {"pid": pid, "kind": "executor", "executor_id": args[i + 1]}
    for kind, cls in (("worker", WORKER_CLASS), ("master", MASTER_CLASS)):
        if cls in args:
            return {"pid": pid, "kind": kind}
    if "pyspark.daemon" in args:
        return {"pid": pid, "kind": "python-daemon"}
    return {"pid": pid, "kind": "other", "program": Path(args[0]).name if args else "?"}


def ancestry(pid: int) -> list[dict[str, Any]]:
    """The process and its ancestors up to (not including) init."""
    chain = []
    while pid > 1:
        parent = _parent(pid)
        if parent is None:
            break
        chain.append({**describe_process(pid), "ppid": parent})
        pid = parent
    return chain


def marked_processes(token: str) -> list[int]:
    """Live processes whose environment carries ``MARKER=token``."""
    needle = f"{MARKER}={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(int(entry.name))
    return sorted(found)


def _kill_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ============================================================================ the cluster


@dataclass
class StandaloneCluster:
    """A master and ``workers`` workers on 127.0.0.1, each with ``cores`` cores and ``memory``;
    logs and work directories under ``root``."""

    root: Path
    workers: int = 2
    cores: int = 1
    memory: str = "1g"
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    master_url: str = ""
    webui_url: str = ""
    daemons: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        """The daemons' environment: loopback only, this pyspark as SPARK_HOME, an empty conf
        dir, and no AWS or Spark settings of the caller's (executors get what the application
        sends them, nothing inherited by accident)."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("AWS_", "SPARK_", "PYSPARK_")) and k != "PYTHONPATH"
        }
        conf_dir = self.root / "conf"
        conf_dir.mkdir(parents=True, exist_ok=True)
        env.update(
            SPARK_HOME=str(PYSPARK_HOME),
            SPARK_CONF_DIR=str(conf_dir),
            SPARK_LOCAL_IP="127.0.0.1",
            SPARK_MASTER_HOST="127.0.0.1",
            SPARK_DAEMON_MEMORY="256m",
            SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",
            **{MARKER: self.token},
        )
        return env

    def _spawn(self, name: str, cls: str, *args: str) -> None:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - the child keeps it
        try:
            self.daemons[name] = subprocess.Popen(
                [str(PYSPARK_HOME / "bin" / "spark-class"), cls, *args],
                env=self.env(),
                cwd=self.root,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, killed as one
            )
        finally:
            log.close()

    def start(self, timeout: float = 180) -> None:
        """Start the master, then the workers; return once every worker is registered ALIVE.
        Every port is picked by the JVM that binds it (port 0) and read back from its log, so
        nothing races for a port; the master's REST submission server (fixed port 6066) is off."""
        check_installed_spark()
        self.root.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout
        self._spawn(
            "master", MASTER_CLASS, "--host", "127.0.0.1", "--port", "0", "--webui-port", "0",
        )  # fmt: skip
        port = self._wait_for_port("master", "sparkMaster", deadline)
        self.master_url = f"spark://127.0.0.1:{port}"
        self.webui_url = f"http://127.0.0.1:{self._wait_for_port('master', 'MasterUI', deadline)}"
        for i in range(self.workers):
            work_dir = self.root / f"work-{i}"  # not $SPARK_HOME/work inside the venv
            work_dir.mkdir(exist_ok=True)
            self._spawn(
                f"worker-{i}", WORKER_CLASS, "--host", "127.0.0.1", "--port", "0",
                "--webui-port", "0", "--cores", str(self.cores), "--memory", self.memory,
                "--work-dir", str(work_dir), self.master_url,
            )  # fmt: skip
        while True:
            self._check_alive()
            alive = [w for w in self.state().get("workers", []) if w.get("state") == "ALIVE"]
            if len(alive) == self.workers:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{len(alive)} of {self.workers} workers registered after {timeout:.0f}s:\n"
                    + "\n".join(self.log_tail(n) for n in self.daemons)
                )
            time.sleep(0.5)

    def _check_alive(self) -> None:
        for name, proc in self.daemons.items():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"spark {name} exited with {proc.returncode}:\n{self.log_tail(name)}"
                )

    def _wait_for_port(self, name: str, service: str, deadline: float) -> int:
        pattern = re.compile(rf"started service '{service}' on port (\d+)")
        while True:
            self._check_alive()
            found = pattern.search((self.root / f"{name}.log").read_text(errors="replace"))
            if found:
                return int(found[1])
            if time.monotonic() > deadline:
                raise RuntimeError(f"spark {name} did not start {service}:\n{self.log_tail(name)}")
            time.sleep(0.2)

    def state(self) -> dict[str, Any]:
        """The master's JSON status page (``{}`` while its web UI is not up yet)."""
        try:
            with urllib.request.urlopen(f"{self.webui_url}/json", timeout=5) as response:
                return dict(json.load(response))
        except OSError:
            return {}

    def worker_pids(self) -> set[int]:
        return {p.pid for n, p in self.daemons.items() if n.startswith("worker")}

    def log_tail(self, name: str, lines: int = 40) -> str:
        return f"--- {name}.log\n{_tail(self.root / f'{name}.log', lines)}"

    def processes(self) -> list[int]:
        """Every live process of this cluster (daemons, executors, Python workers)."""
        return marked_processes(self.token)

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM the workers (they stop their executors) and the master, SIGKILL what is left
        after ``timeout``, and wait until no process of the cluster is alive."""
        for name in sorted(self.daemons, reverse=True):  # workers before the master
            _kill_group(self.daemons[name].pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.daemons.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while (left := self.processes()) and time.monotonic() < deadline:
            for pid in left:  # reparented executors or Python workers (own process groups)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)


# ============================================================================ recording storage


class RecordingS3Storage(S3CheckpointStorage):
    """S3 checkpoint storage that, after each successful write or read, drops a JSON note in
    ``record_dir`` (a local directory: the cluster shares this machine's filesystem) saying which
    process did it: its pid, interpreter, Spark task (None outside a task) and ancestry. Bytes
    still go through :class:`S3CheckpointStorage` unchanged."""

    def __init__(self, base_url: str, record_dir: str) -> None:
        super().__init__(base_url)
        self.record_dir = record_dir

    def write_bytes(self, url: str, data: bytes, *, overwrite: bool = True) -> FileInfo:
        info = super().write_bytes(url, data, overwrite=overwrite)
        self._record("write", url)
        return info

    def read_bytes(
        self,
        url: str,
        *,
        checksum: str | None = None,
        size: int | None = None,
        max_size: int | None = None,
    ) -> bytes:
        data = super().read_bytes(url, checksum=checksum, size=size, max_size=max_size)
        self._record("read", url)
        return data

    def _record(self, op: str, url: str) -> None:
        from pyspark import TaskContext

        task = TaskContext.get()
        note = {
            "op": op,
            "url": url,
            "pid": os.getpid(),
            "python": sys.executable,
            "aws_endpoint": os.environ.get("AWS_ENDPOINT_URL"),
            "aws_session_token": bool(os.environ.get("AWS_SESSION_TOKEN")),
            "credentials_on_command_line": _credentials_on_command_line(os.getpid()),
            "task": None
            if task is None
            else {
                "stage": task.stageId(),
                "partition": task.partitionId(),
                "attempt_id": task.taskAttemptId(),
            },
            "ancestry": ancestry(os.getpid()),
        }
        path = Path(self.record_dir) / f"{uuid.uuid4().hex}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(note))
        tmp.rename(path)


class RecordingMotoServer:
    """moto's server on loopback in a process and directory of its own, recording every request
    (headers included) it serves, so a test can see what credentials each request carried."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.recording = root / "moto_recording"
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        env = {**os.environ, "MOTO_RECORDER_FILEPATH": str(self.recording)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            cwd=self.root,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._api("reset-recording")
                self._api("start-recording")
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.2)

    def _api(self, action: str) -> bytes:
        request = urllib.request.Request(f"{self.url}/moto-api/recorder/{action}", method="POST")
        with urllib.request.urlopen(request, timeout=5) as response:
            return bytes(response.read())

    def requests(self) -> list[dict[str, Any]]:
        """Every request recorded so far: method, url, headers (bodies left out)."""
        lines = self.recording.read_text().splitlines() if self.recording.exists() else []
        return [
            {k: v for k, v in json.loads(line).items() if k in ("method", "url", "headers")}
            for line in lines
        ]

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def _credentials_on_command_line(pid: int) -> bool:
    """Whether this process's secret AWS variables appear on its or an ancestor's command line
    (the executor JVM's included)."""
    secrets = [os.environ.get(n) for n in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")]
    pids = [pid, *(p["ppid"] for p in ancestry(pid))]
    args = [a for p in pids for a in _cmdline(p)]
    return any(s and s in a for s in secrets for a in args)


def read_records(record_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(record_dir.glob("*.json"))]


def executor_of(note: dict[str, Any], worker_pids: set[int]) -> str | None:
    """The id of the executor the noted process descends from, if that executor's JVM was
    launched by one of ``worker_pids``; else None."""
    for proc in note["ancestry"]:
        if proc["kind"] == "executor" and proc["ppid"] in worker_pids:
            return str(proc["executor_id"])
    return None


# ============================================================================ the driver


def cluster_conf(event_log: Path | None = None) -> dict[str, str]:
    """Settings for an application on the test cluster: one 1-core executor per worker, waiting
    for both before the first job; this repository on the executors' Python path (for this
    module, which :class:`RecordingS3Storage` is unpickled from); Spark's event log in
    ``event_log`` when given. The S3 endpoint and credentials are not set here: the runtime's
    session hands the driver's own to the executors (``checkpointing.spark.executor_env``)."""
    conf = {
        "spark.executor.cores": "1",
        "spark.executor.memory": "512m",
        "spark.cores.max": "2",
        "spark.scheduler.minRegisteredResourcesRatio": "1.0",
        "spark.scheduler.maxRegisteredResourcesWaitingTime": "120s",
        "spark.sql.shuffle.partitions": "4",
        "spark.executorEnv.PYTHONPATH": str(REPO_ROOT),
    }
    if event_log is not None:
        conf["spark.eventLog.enabled"] = "true"
        conf["spark.eventLog.dir"] = event_log.as_uri()
        conf["spark.eventLog.compress"] = "false"  # plain JSON lines, for the test to read
    return conf


@dataclass
class DriverRun:
    returncode: int
    report: dict[str, Any]
    log: Path

    def describe(self) -> str:
        return f"driver exited with {self.returncode}; log {self.log}:\n{_tail(self.log, 60)}"


def run_driver(
    cluster: StandaloneCluster,
    workdir: Path,
    name: str,
    *,
    spec: Path,
    metastore_url: str,
    storage_url: str,
    record_dir: Path,
    timeout: float = 600,
    **options: Any,
) -> DriverRun:
    """One attempt of the pipeline as a Spark application on ``cluster``, in a driver process of
    its own (killed with its JVM if it outlives ``timeout``). ``options`` are RunOptions."""
    report, log = workdir / f"{name}.json", workdir / f"{name}.log"
    event_log = workdir / f"{name}-events"
    event_log.mkdir()
    args = [
        sys.executable, "-m", "tests.spark_cluster", "--master", cluster.master_url,
        "--spec", str(spec), "--metastore", metastore_url, "--storage", storage_url,
        "--records", str(record_dir), "--report", str(report),
        "--options", json.dumps(options), "--event-log", str(event_log),
    ]  # fmt: skip
    env = {**os.environ, "SPARK_HOME": str(PYSPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1"}
    env[MARKER] = cluster.token  # so the cluster's teardown also finds a stray driver JVM
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args,
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            raise RuntimeError(
                f"driver {name} timed out after {timeout:.0f}s:\n{_tail(log)}"
            ) from None
    data = json.loads(report.read_text()) if report.exists() else {}
    return DriverRun(proc.returncode, data, log)


def main(argv: list[str] | None = None) -> int:
    """The driver: run the pipeline once on ``--master`` and write a JSON report (pid, run
    result, whether the crash hook fired, the S3 listing of the job after each epoch)."""
    from checkpointing.metastore.engine import Metastore
    from checkpointing.pipeline.spec import load_spec
    from checkpointing.spark.preflight import RunOptions
    from checkpointing.spark.runtime import PipelineRun, SimulatedCrash
    from checkpointing.spark.session import spark_session

    parser = argparse.ArgumentParser(prog="python -m tests.spark_cluster")
    for flag in ("--master", "--spec", "--metastore", "--storage", "--records", "--report"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--options", default="{}")
    parser.add_argument("--event-log", type=Path, default=None)
    args = parser.parse_args(argv)

    spec = load_spec(args.spec)
    storage = RecordingS3Storage(args.storage, args.records)
    report: dict[str, Any] = {"pid": os.getpid(), "crashed": False, "listings": {}}

    def on_epoch(epoch: int, _ms: int) -> None:
        report["listings"][str(epoch)] = storage.list_files(storage.job_url(spec.job))

    spark = spark_session(f"ckpt-cluster-{spec.job}", args.master, cluster_conf(args.event_log))
    try:
        report["app_id"] = spark.sparkContext.applicationId
        run = PipelineRun(
            spec,
            spark,
            Metastore(args.metastore),
            storage,
            RunOptions(**json.loads(args.options)),
            on_epoch=on_epoch,
        )
        try:
            report["result"] = asdict(run.run())
        except SimulatedCrash:
            report["crashed"] = True
            report["result"] = asdict(run.result)
    finally:
        Path(args.report).write_text(json.dumps(report))
        spark.stop()
    return CRASH_EXIT if report["crashed"] else 0


if __name__ == "__main__":
    # Re-import under the module's real name: run as ``-m`` this file is ``__main__``, and the
    # executors must unpickle RecordingS3Storage from ``tests.spark_cluster``.
    from tests.spark_cluster import main as _main

    sys.exit(_main())
