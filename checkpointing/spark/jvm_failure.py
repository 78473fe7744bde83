"""A Spark JVM that died or ran out of memory, said in one line: which JVM, where the run was,
and what to raise — instead of the ``Connection refused`` the next Py4J call gets.

What is known is read, not guessed: the driver JVM this process launched is pyspark's gateway
process (``spark-submit`` execs ``java``), so its exit code is at hand once it is gone; the JVM
is started with ``-XX:+ExitOnOutOfMemoryError`` (exit code 3, whichever thread ran out), and
Spark's own handler of an uncaught ``OutOfMemoryError`` exits with 52. An
executor's failure is in the job's abort message: a task lost to an ``OutOfMemoryError``, or an
executor lost with its exit code (52; 137 and 143: killed, typically by its container's memory
limit). The memory settings are read when the run starts: a dead JVM cannot be asked."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from py4j.protocol import Py4JNetworkError
from pyspark import SparkContext
from pyspark.sql import SparkSession

from checkpointing.errors import SparkJvmError, SparkMemoryError
from checkpointing.pipeline.spec import PipelineSpec

#: HotSpot's exit code under ``-XX:+ExitOnOutOfMemoryError``
EXIT_ON_OOM = 3
#: Spark's ``SparkExitCode.OOM``: its uncaught-exception handler on an ``OutOfMemoryError``
SPARK_OOM_EXIT = 52
#: an executor killed from outside: SIGKILL (the kernel's or a container's OOM killer) and
#: SIGTERM (YARN stopping a container over its memory limit)
KILLED_EXITS = {137: "SIGKILL", 143: "SIGTERM"}
#: the driver JVM's options an administrator sets; ``spark.driver.extraJavaOptions`` (and
#: ``--driver-java-options``) stay the user's
DRIVER_DEFAULT_JAVA_OPTIONS = "spark.driver.defaultJavaOptions"
EXIT_ON_OOM_FLAG = "-XX:+ExitOnOutOfMemoryError"
#: how long a driver JVM that stopped answering gets to exit (Spark's handler runs shutdown
#: hooks first) before its exit code is read
EXIT_GRACE_SECONDS = 10.0

_OOM = re.compile(r"((?:[\w$]+\.)*[\w$]*OutOfMemoryError)(?::[ \t]*([^\n;]*))?")
_LOST_TASK = re.compile(
    r"Lost task \S+ in stage \S+ \(TID \d+\) \((?P<host>[^\s)]+) executor (?P<executor>[^\s)]+)\):"
    r" (?P<reason>[^\n]*)"
)
_EXECUTOR_LOST = re.compile(
    r"ExecutorLostFailure \(executor (?P<executor>[^\s)]+) exited[^)]*\)"
    r"(?: Reason: (?P<reason>[^\n]*))?"
)
_EXIT_CODE = re.compile(r"(?:exit(?:ed with)? code|exit status:?)\s*(-?\d+)", re.IGNORECASE)
_MEMORY_LIMIT = re.compile(r"memory limit|OOMKilled|container OOM", re.IGNORECASE)


def with_exit_on_oom(options: str | None) -> str:
    """``options`` (JVM options, e.g. the administrator's) with ``-XX:+ExitOnOutOfMemoryError``
    appended: a JVM out of heap in any thread then exits at once, with code 3, instead of
    going on half-broken (an out-of-memory scheduler thread leaves a run waiting forever)."""
    options = (options or "").strip()
    return (
        options if EXIT_ON_OOM_FLAG in options.split() else f"{options} {EXIT_ON_OOM_FLAG}".strip()
    )


def spark_defaults(key: str) -> str | None:
    """``key``'s value in the ``spark-defaults.conf`` that ``spark-submit`` reads (in
    ``SPARK_CONF_DIR``, else ``SPARK_HOME/conf``), if any: a ``--conf`` given for it replaces
    that value, so whoever adds to it must start from it."""
    conf_dir = os.environ.get("SPARK_CONF_DIR")
    if conf_dir is None:
        home = os.environ.get("SPARK_HOME")
        if home is None:
            import pyspark

            home = str(Path(pyspark.__file__).parent)
        conf_dir = os.path.join(home, "conf")
    try:
        lines = Path(conf_dir, "spark-defaults.conf").read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in lines:
        found = re.match(r"\s*([^\s=:#!]+)\s*[=:\s]\s*(.*?)\s*$", line)
        if found and found[1] == key:
            return found[2]
    return None


def driver_process() -> subprocess.Popen[bytes] | None:
    """The driver JVM's process (pyspark's gateway) when this process launched it; None under
    spark-submit (whose JVM launched this process) or before any session."""
    return getattr(SparkContext._gateway, "proc", None)


def driver_exited() -> bool:
    """The driver JVM this process launched has exited: there is nothing left to ask or stop."""
    proc = driver_process()
    return proc is not None and proc.poll() is not None


@dataclass(frozen=True)
class MemorySettings:
    """The memory settings a failure names, as the session has them."""

    #: local mode: the driver JVM runs every task too
    local: bool
    driver: str
    executor: str
    overhead: str

    @classmethod
    def of(cls, spark: SparkSession) -> MemorySettings:
        sc = spark.sparkContext
        conf = sc.getConf()

        def setting(key: str, env: str, default: str) -> str:
            value = conf.get(key) or os.environ.get(env)
            return value if value else f"{default}, the default"

        return cls(
            local=sc.master.startswith("local"),
            driver=setting("spark.driver.memory", "SPARK_DRIVER_MEMORY", "1g"),
            executor=setting("spark.executor.memory", "SPARK_EXECUTOR_MEMORY", "1g"),
            overhead=conf.get("spark.executor.memoryOverhead")
            or "default: 10 % of spark.executor.memory, at least 384m",
        )


class JvmWatch:
    """Tells a run's failure caused by a Spark JVM — the driver's exit, an executor's loss, an
    ``OutOfMemoryError`` anywhere — from the rest, and words it."""

    def __init__(
        self,
        spec: PipelineSpec,
        memory: MemorySettings,
        driver: subprocess.Popen[bytes] | None = None,
    ) -> None:
        """``driver``: the driver JVM's process, when this process launched it."""
        self.spec = spec
        self.memory = memory
        self.driver = driver

    @classmethod
    def of(cls, spark: SparkSession, spec: PipelineSpec) -> JvmWatch:
        """The watch of ``spark``'s JVMs, its settings read now (while the JVM answers)."""
        return cls(spec, MemorySettings.of(spark), driver_process())

    def failure(self, exc: BaseException, where: str, *, in_epoch: bool) -> SparkJvmError | None:
        """The one-line error for ``exc`` if a Spark JVM caused it, else None. ``where``: what
        the run was doing (e.g. ``in epoch 4 while merging …``); ``in_epoch``: an epoch's
        input was being processed (lowering it is advice then)."""
        chain = list(exception_chain(exc))
        text = "\n".join(_text(e) for e in chain)
        lost = any(isinstance(e, (ConnectionError, Py4JNetworkError)) for e in chain)
        oom = _OOM.search(text)
        job = f"job {self.spec.job}"
        # a driver's OutOfMemoryError ends its JVM, after Spark's shutdown hooks (exit code 52)
        local_oom = self.memory.local and oom is not None and oom[1].startswith("java.lang.")
        code = self._driver_exit(wait=lost or local_oom)
        if code is not None:
            if code in (EXIT_ON_OOM, SPARK_OOM_EXIT) or oom:
                kind = _kind(oom) if oom else _exit_reason(code)
                return self._driver_oom(kind, where, in_epoch)
            return SparkJvmError(
                f"{job}: the Spark driver JVM {_ended(code)} {where}; its log above says why"
            )
        for task in _LOST_TASK.finditer(text):
            executor, host, reason = task["executor"], task["host"], task["reason"]
            if found := _OOM.search(reason):
                if executor == "driver":
                    return self._driver_oom(_kind(found), where, in_epoch)
                return SparkMemoryError(
                    f"{job}: Spark executor {executor} on {host} ran out of memory "
                    f"({_kind(found)}) {where}; raise spark.executor.memory "
                    f"(now {self.memory.executor}){self._input_advice(in_epoch)}"
                )
        for gone in _EXECUTOR_LOST.finditer(text):
            if (error := self._executor_lost(gone, where, in_epoch)) is not None:
                return error
        if oom:  # no task named: the driver's own call ran out (e.g. collecting a result)
            return self._driver_oom(_kind(oom), where, in_epoch)
        if lost and self.driver is None:  # launched by spark-submit: its exit code says why
            return SparkJvmError(
                f"{job}: lost the Spark driver JVM {where} ({_first_line(chain)}); "
                f"spark-submit's exit code says why (3 or 52: out of memory, raise "
                f"spark.driver.memory, now {self.memory.driver})"
            )
        return None

    def _driver_exit(self, *, wait: bool) -> int | None:
        """The driver JVM's exit code once it has exited (given a moment when ``wait``), else
        None (running, or not this process's)."""
        if self.driver is None:
            return None
        try:
            return self.driver.wait(EXIT_GRACE_SECONDS) if wait else self.driver.poll()
        except subprocess.TimeoutExpired:
            return None

    def _driver_oom(self, kind: str, where: str, in_epoch: bool) -> SparkMemoryError:
        return SparkMemoryError(
            f"job {self.spec.job}: the Spark driver JVM ran out of memory ({kind}) {where}; raise "
            f"spark.driver.memory (now {self.memory.driver}){self._input_advice(in_epoch)}"
        )

    def _executor_lost(
        self, gone: re.Match[str], where: str, in_epoch: bool
    ) -> SparkJvmError | None:
        """An executor lost for memory: Spark's handler's exit (52), or killed (137, 143) with
        or without a memory limit named; another loss is left to the message as it is."""
        reason = gone["reason"] or ""
        found = _EXIT_CODE.search(reason)
        code = int(found[1]) if found else None
        memory_limit = bool(_MEMORY_LIMIT.search(reason))
        if code != SPARK_OOM_EXIT and code not in KILLED_EXITS and not memory_limit:
            return None
        head = f"job {self.spec.job}: Spark executor {gone['executor']}"
        advice = self._input_advice(in_epoch)
        if code == SPARK_OOM_EXIT:
            return SparkMemoryError(
                f"{head} ran out of memory ({_exit_reason(code)}) {where}; raise "
                f"spark.executor.memory (now {self.memory.executor}){advice}"
            )
        why = reason.strip()[:300] or f"exit code {code}"
        if code in KILLED_EXITS:
            why += f" ({KILLED_EXITS[code]}: typically its container's memory limit)"
        return SparkMemoryError(
            f"{head} was killed {where}: {why}; raise spark.executor.memoryOverhead "
            f"(now {self.memory.overhead}) or spark.executor.memory "
            f"(now {self.memory.executor}){advice}"
        )

    def _input_advice(self, in_epoch: bool) -> str:
        """Less input per epoch, when an epoch was running and the spec can give less."""
        source = self.spec.source
        if not in_epoch:
            return ""
        if source.epoch_bytes is not None:
            return (
                f" or lower the input per epoch (source.epoch_bytes, now "
                f"{source.epoch_bytes.human_readable()})"
            )
        if source.splits_per_epoch > 1:
            return (
                f" or lower the input per epoch (source.splits_per_epoch, now "
                f"{source.splits_per_epoch})"
            )
        if source.format.value == "parquet":
            size = source.max_split_bytes
            now = "whole files" if size is None else size.human_readable()
            return f" or split the input files by row groups (source.max_split_bytes, now {now})"
        return ""


def exception_chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and its causes (or the exceptions it was raised while handling)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _text(exc: BaseException) -> str:
    """``str(exc)``: a Py4J error's asks the JVM, which may be gone."""
    try:
        return str(exc)
    except Exception:
        return type(exc).__name__


def _first_line(chain: list[BaseException]) -> str:
    for exc in chain:
        if isinstance(exc, ConnectionError):
            return _text(exc)
    lines = _text(chain[0]).strip().splitlines()
    return lines[0] if lines else type(chain[0]).__name__


def _kind(oom: re.Match[str]) -> str:
    """``java.lang.OutOfMemoryError: Java heap space``, as the JVM said it."""
    detail = (oom[2] or "").strip()
    return f"{oom[1]}: {detail[:160]}" if detail else oom[1]


def _exit_reason(code: int) -> str:
    if code == EXIT_ON_OOM:
        return f"java.lang.OutOfMemoryError, exit code {code} under {EXIT_ON_OOM_FLAG}"
    return f"java.lang.OutOfMemoryError, exit code {code} from Spark's handler of an uncaught one"


def _ended(code: int) -> str:
    """How a process ended, from its Popen return code."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        if -code == signal.SIGKILL:  # the kernel's OOM killer's signal: worth saying
            return f"was killed by {name} (as the kernel's OOM killer does when memory runs out)"
        return f"was killed by {name}"
    return f"exited with code {code}"
