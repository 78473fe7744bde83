"""The detached Spark driver of a deferrable try, seen from Airflow's processes: where its log
goes, whether it still lives (the failure callback's question: re-attach or restore), and how
it is stopped (the trigger's ``on_kill``, a retry that cannot re-attach)."""

from __future__ import annotations

import os
import signal
import stat
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from checkpointing.coordination.drivers import (
    Outcome,
    judge,
    process_alive,
    read_state,
    signal_driver,
)

if TYPE_CHECKING:
    from checkpointing.coordination.drivers import AttemptVerdict, DriverIdentity
    from checkpointing.metastore.engine import Metastore

#: seconds a stopped driver gets between SIGTERM and SIGKILL
STOP_GRACE_S = 10.0
#: seconds a driver that recorded FAILED gets to exit by itself (and write its error) before it
#: is stopped
EXIT_GRACE_S = 30.0


def driver_log_path(job_id: str, attempt: str) -> Path:
    """Where a detached driver's output goes: ``CKPT_HOME/logs/drivers/<job>/<attempt>.log``
    (the job's storage may be S3; the log is written by spark-submit on this host)."""
    from checkpointing.config import ckpt_home

    return ckpt_home() / "logs" / "drivers" / job_id / f"{attempt}.log"


#: bytes read from the end of a driver's log for the task log: a bound whatever the file is
LOG_TAIL_BYTES = 64 << 10


def read_log_tail(job_id: str, attempt: str, lines: int, max_bytes: int = LOG_TAIL_BYTES) -> str:
    """The last ``lines`` lines of ``attempt``'s driver log, at most ``max_bytes`` read from its
    end. The path is :func:`driver_log_path`'s, from the ids (never the job row's, which any
    driver can write); a symlink anywhere below ``CKPT_HOME/logs/drivers``, a device, a FIFO
    or any other non-regular file is refused (:class:`OSError`), unread."""
    from checkpointing.ids import validate_id

    path = driver_log_path(validate_id(job_id, "job id"), validate_id(attempt, "attempt id"))
    root = path.parents[1]  # CKPT_HOME/logs/drivers (CKPT_HOME itself may be a link)
    expected = os.path.join(os.path.realpath(root), job_id, path.name)
    if os.path.realpath(path) != expected:
        raise OSError(f"{path} resolves elsewhere (a symlink): refused")
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file: refused")
        start = max(0, info.st_size - max_bytes)
        os.lseek(fd, start, os.SEEK_SET)
        chunks, left = [], min(info.st_size, max_bytes)
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    text = b"".join(chunks).decode(errors="replace").splitlines()
    if start > 0 and text:
        text = text[1:]  # the first line read is cut
    return "\n".join(text[-lines:])


def stop_driver(driver: DriverIdentity, grace: float = STOP_GRACE_S) -> bool:
    """SIGTERM the driver's session (spark-submit leads it; the Python driver is in it), SIGKILL
    after ``grace`` s. Only on its own host, and only a process that
    :func:`~checkpointing.coordination.drivers.owned_process` takes for the driver (checked
    before each signal); True when it was running here and is now gone."""
    if process_alive(driver) is not True:
        return False
    signal_driver(driver, signal.SIGTERM)
    if not await_exit(driver, grace):
        signal_driver(driver, signal.SIGKILL)
    return True


def await_exit(driver: DriverIdentity, timeout: float = EXIT_GRACE_S) -> bool:
    """Wait up to ``timeout`` s for a driver that recorded its own failure to exit: its error
    is the last thing it writes to its log. True when it is gone (or not on this host)."""
    deadline = time.monotonic() + timeout
    while process_alive(driver) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not process_alive(driver)


def attempt_of_same_run(other: str, attempt: str) -> bool:
    """Whether the attempt ids ``other`` and ``attempt`` are tries of one DAG run."""
    return other.rsplit("-t", 1)[0] == attempt.rsplit("-t", 1)[0]


def await_first_beat(
    metastore: Metastore, job_id: str, driver: DriverIdentity, timeout: timedelta, poll: float
) -> AttemptVerdict | None:
    """Wait for a just-submitted driver's first heartbeat (JVM and Spark session up, the job
    joined): None once it beat, else the verdict that ended the wait (it exited, failed, was
    superseded, or stayed silent for ``timeout`` since its submission)."""
    from checkpointing.clock import SystemClock

    while True:
        alive = process_alive(driver)  # before the row: an exit after FINISHED is a finish
        state = read_state(metastore, job_id)
        beat = state.heartbeat_at
        if beat is not None and beat >= driver.submitted_at:
            return None
        now = SystemClock().now()
        verdict = judge(state, driver.attempt, now, alive=alive, heartbeat_timeout=timeout)
        if verdict is not None:
            return verdict
        time.sleep(max(0.2, min(poll, 1.0)))


def live_driver(metastore: Metastore, job_id: str, failed: str, timeout_s: float) -> bool:
    """Whether the detached driver that the failed try ``failed`` watched is still alive or
    starting (:func:`~checkpointing.coordination.drivers.judge` has no verdict on it: it leads
    the job, beats within ``timeout_s`` or was submitted less than ``timeout_s`` ago, and is not
    found dead on this host), or has finished: the retry re-attaches to it (or takes its
    outcome), so the failure callback must not fail the job."""
    from checkpointing.clock import SystemClock

    state = read_state(metastore, job_id)
    driver = state.driver
    if driver is None or (state.watcher or driver.attempt) != failed:
        return False
    timeout = timedelta(seconds=timeout_s)
    alive = process_alive(driver)
    now = SystemClock().now()
    verdict = judge(state, driver.attempt, now, alive=alive, heartbeat_timeout=timeout)
    return verdict is None or verdict.outcome is Outcome.FINISHED


def acting_coordinator(metastore: Metastore, job_id: str, failed: str) -> str:
    """The coordinator id the failed try acted under: a re-attached try's is its driver's."""
    state = read_state(metastore, job_id)
    if state.driver is not None and state.watcher == failed:
        return state.driver.attempt
    return failed
