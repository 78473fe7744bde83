"""A detached Spark driver and what became of it, from the metastore (and, on its own host, the
process table).

The deferrable Airflow task submits the driver detached from its own process and frees its worker
slot; the checkpoint coordinator then runs elsewhere (Airflow's triggerer) and must tell, from
shared state alone, when the attempt is over: the driver records the job's status (FINISHED,
FAILED) in the job row and stamps its heartbeat there while it runs
(:mod:`checkpointing.coordination.heartbeat`). The task records the driver's identity on the
same row (:func:`record_driver`): which attempt submitted it, its host and pid, its log file and
when, so that a status or heartbeat older than the submission is never taken for this driver's.
:func:`judge` is the one rule that turns the row into an :class:`AttemptVerdict`.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any

from sqlalchemy import update

from checkpointing.coordination.heartbeat import HEARTBEAT_TIMEOUT, driver_alive, driver_starting
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Job
from checkpointing.status import JobStatus, StatusWriter


@dataclass(frozen=True)
class DriverIdentity:
    """Where a detached driver runs: the attempt (its coordinator id) that submitted it, the
    host, spark-submit's pid (the leader of the driver's own session), its log file."""

    attempt: str
    host: str
    pid: int
    log: str | None
    submitted_at: datetime
    #: the attempt's parallelism: the subtasks its checkpoints wait for (a re-attaching
    #: coordinator needs them)
    parallelism: int | None = None

    def describe(self) -> str:
        log = f", log {self.log}" if self.log else ""
        return f"driver of {self.attempt} (pid {self.pid} on {self.host}{log})"


def this_host() -> str:
    return socket.gethostname()


def record_driver(metastore: Metastore, job_id: str, driver: DriverIdentity) -> bool:
    """Record ``driver`` on the job row, watched by its own attempt, if that attempt still leads
    the job (the row names it as coordinator); False when a newer attempt took over meanwhile
    (the driver is superseded). The row's status goes back to CREATED: a FAILED or FINISHED
    read after this is the new driver's own, whatever else touches the row meanwhile (the
    driver's registration moves ``updated_at`` before it reports RUNNING), and names no writer."""
    with metastore.transaction() as s:
        result = s.execute(
            update(Job)
            .where(Job.job_id == job_id, Job.coordinator_id == driver.attempt)
            .values(
                driver_attempt=driver.attempt,
                driver_host=driver.host,
                driver_pid=driver.pid,
                driver_parallelism=driver.parallelism,
                driver_log=driver.log,
                driver_submitted_at=driver.submitted_at,
                driver_watcher=driver.attempt,
                status=JobStatus.CREATED,
                status_by=None,
                failure_cause=None,
            )
        )
        return bool(getattr(result, "rowcount", 0))


@dataclass(frozen=True)
class AttemptState:
    """What the job row says about an attempt's driver (plain values, read in one go)."""

    job_id: str
    coordinator_id: str | None
    status: str | None
    updated_at: datetime | None
    heartbeat_at: datetime | None
    failure_cause: str | None
    driver: DriverIdentity | None
    #: the attempt that coordinates the driver now: its own, or a retry that re-attached
    watcher: str | None = None
    #: who wrote ``status`` (:class:`~checkpointing.status.StatusWriter`)
    status_by: str | None = None


def read_state(metastore: Metastore, job_id: str) -> AttemptState:
    """The job row's coordinator, status, heartbeat and recorded driver."""
    with metastore.reading() as s:
        job = s.get(Job, job_id)
        if job is None:
            return AttemptState(job_id, None, None, None, None, None, None)
        driver = None
        if job.driver_attempt and job.driver_pid is not None and job.driver_submitted_at:
            driver = DriverIdentity(
                job.driver_attempt,
                job.driver_host or "",
                job.driver_pid,
                job.driver_log,
                job.driver_submitted_at,
                job.driver_parallelism,
            )
        return AttemptState(
            job_id,
            job.coordinator_id,
            job.status,
            job.updated_at,
            job.heartbeat_at,
            job.failure_cause,
            driver,
            job.driver_watcher,
            job.status_by,
        )


def owned_process(pid: object, attempt: str) -> bool:
    """Whether ``pid`` is a running process this project may treat, watch and signal as the
    driver of ``attempt``: the one check before every liveness answer and every signal.

    It must be a pid above 1 (``0`` and ``-1`` name process groups, ``1`` is init), ``/proc``
    must be readable here (without it nothing can be checked: not ours), the process must lead
    its own process group (spark-submit is started in a session of its own, which is what
    ``killpg`` reaches) and not be a zombie, and its command line must carry the attempt id as
    an argument (spark-submit's ``--attempt``): a reused pid, a row naming another process or
    this process's own group never count. Anything else is not ours: not alive, never
    signalled."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1 or not attempt:
        return False
    try:
        state = _process_state(pid)
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if os.getpgid(pid) != pid:
            return False
    except (OSError, ValueError):  # no /proc, no such process, not readable
        return False
    if state in (None, "Z", "X"):
        return False
    wanted = attempt.encode()
    return any(arg == wanted or arg.endswith(b"=" + wanted) for arg in cmdline.split(b"\0") if arg)


def signal_driver(driver: DriverIdentity, sig: int) -> bool:
    """Send ``sig`` to the driver's process group, only when :func:`owned_process` says the
    recorded pid is its driver on this host (checked right before the signal); True if sent."""
    if driver.host != this_host() or not owned_process(driver.pid, driver.attempt):
        return False
    try:
        os.killpg(driver.pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


#: the pauses before a process that exists but was not taken for the driver is probed again
#: (a live driver misread once, e.g. while it execs, is not declared gone; a dead one stays so)
REPROBE_PAUSES_S = (0.05, 0.1, 0.2)


def process_alive(driver: DriverIdentity | None) -> bool | None:
    """Whether the driver's process still runs, when this is its host (else None: not known
    here): :func:`owned_process`, so a zombie, a reused pid (a process whose command line does
    not name the driver's attempt), a pid that does not lead its process group, a pid of 0 or 1
    and a host without a readable ``/proc`` all count as gone. A verdict of gone ends a try, so
    a live process (in ``/proc``, not a zombie) must fail the check on every probe of
    :data:`REPROBE_PAUSES_S`."""
    if driver is None or driver.host != this_host():
        return None
    if owned_process(driver.pid, driver.attempt):
        return True
    pid = driver.pid
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1:
        return False
    for pause in REPROBE_PAUSES_S:
        if _gone_for_good(pid):  # no such process, or a zombie: no probe changes that
            return False
        time.sleep(pause)
        if owned_process(driver.pid, driver.attempt):
            return True
    return False


def _gone_for_good(pid: int) -> bool:
    """Whether ``pid`` is no process at all, or one that has exited (a zombie)."""
    try:
        return _process_state(pid) in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, ValueError):  # there, but not readable now: not known to be gone
        return False


def _process_state(pid: int) -> str | None:
    """The state letter of ``/proc/<pid>/stat`` (``R``, ``S``, ``Z``...; None if unparsable);
    raises ``OSError`` when it cannot be read. The command name before it is in parentheses
    and may hold any character, so the state is the first field after the last ``)``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)
    rest = fields[1].split() if len(fields) == 2 else []
    return rest[0] if rest else None


class Outcome(StrEnum):
    """How a deferred attempt ended, as the trigger reports it."""

    FINISHED = "finished"  #: the driver recorded FINISHED (a stop-with-savepoint too)
    FAILED = "failed"  #: the driver recorded FAILED (or CANCELED)
    DRIVER_LOST = "driver_lost"  #: the driver's process is gone or stopped heart-beating
    SUPERSEDED = "superseded"  #: a newer attempt leads the job: this one may do nothing more
    ERROR = "error"  #: the coordination itself could not go on (no job row, no metastore)


@dataclass(frozen=True)
class AttemptVerdict:
    """The end of a deferred attempt: the trigger's event payload (:meth:`to_event`)."""

    outcome: Outcome
    attempt: str
    message: str

    @property
    def succeeded(self) -> bool:
        return self.outcome is Outcome.FINISHED

    def to_event(self) -> dict[str, Any]:
        return {**asdict(self), "outcome": self.outcome.value}

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> AttemptVerdict:
        return cls(Outcome(event["outcome"]), str(event["attempt"]), str(event["message"]))


def judge(
    state: AttemptState,
    attempt: str,
    now: datetime,
    *,
    alive: bool | None,
    heartbeat_timeout: timedelta = HEARTBEAT_TIMEOUT,
    watcher: str | None = None,
) -> AttemptVerdict | None:
    """The verdict on ``attempt`` from its job row (``state``), or None while it runs.

    ``alive``: whether the driver's process runs (:func:`process_alive`, read *before* the row,
    so that a driver that recorded FINISHED and exited is judged by the row). A terminal status
    counts only when the driver's own run wrote it (``status_by``: a failure callback that runs
    late writes FAILED under the same coordinator id; :func:`record_driver` clears the writer),
    a heartbeat only when written after the driver was submitted. A driver that never beat is
    given ``heartbeat_timeout`` from its submission to start. ``watcher``: the attempt that
    coordinates (``attempt`` itself, or a retry re-attached to its driver); once the row names
    another watcher, this one is superseded."""
    job = state.job_id
    if state.status is None:
        return AttemptVerdict(Outcome.ERROR, attempt, f"job {job} is not in the metastore")
    if state.coordinator_id != attempt:
        return AttemptVerdict(
            Outcome.SUPERSEDED,
            attempt,
            f"job {job}: attempt {attempt} was superseded by {state.coordinator_id}",
        )
    if watcher is not None and state.watcher not in (None, watcher):
        return AttemptVerdict(
            Outcome.SUPERSEDED,
            attempt,
            f"job {job}: the driver of {attempt} was re-attached to by {state.watcher}",
        )
    driver = state.driver if state.driver and state.driver.attempt == attempt else None
    since = driver.submitted_at if driver is not None else None
    own = state.status_by == StatusWriter.RUN.of(attempt)  # not a late callback's FAILED
    status = JobStatus(state.status)
    if status is JobStatus.FINISHED and own:
        return AttemptVerdict(Outcome.FINISHED, attempt, f"job {job}: the driver finished")
    if status in (JobStatus.FAILED, JobStatus.CANCELED) and own:
        cause = f": {state.failure_cause}" if state.failure_cause else ""
        return AttemptVerdict(
            Outcome.FAILED, attempt, f"job {job}: the driver recorded {status.value}{cause}"
        )
    if driver is None:
        return None  # nothing to watch yet (the task records it right after the submit)
    where = driver.describe()
    if alive is False:
        return AttemptVerdict(
            Outcome.DRIVER_LOST,
            attempt,
            f"job {job}: the {where} exited without recording an outcome",
        )
    beat = state.heartbeat_at if state.heartbeat_at and state.heartbeat_at >= since else None
    if beat is None and not driver_starting(
        driver.submitted_at, state.heartbeat_at, now, heartbeat_timeout
    ):
        return AttemptVerdict(
            Outcome.DRIVER_LOST,
            attempt,
            f"job {job}: the {where} never heart-beat within {heartbeat_timeout}",
        )
    if beat is not None and driver_alive(beat, now, heartbeat_timeout) is False:
        return AttemptVerdict(
            Outcome.DRIVER_LOST,
            attempt,
            f"job {job}: the {where} stopped heart-beating ({now - beat} since its last beat, "
            f"timeout {heartbeat_timeout})",
        )
    return None


def reattach(
    metastore: Metastore,
    job_id: str,
    driver_attempt: str,
    watcher: str,
    now: datetime,
    heartbeat_timeout: timedelta = HEARTBEAT_TIMEOUT,
    *,
    alive: bool | None = None,
) -> DriverIdentity | None:
    """Make ``watcher`` (a retry) the coordinator of ``driver_attempt``'s driver instead of
    restarting it: in one transaction on the locked job row, only while that attempt still leads
    the job and its driver is recorded, and either the job is RUNNING, the driver's heartbeat
    (written after its submission) within ``heartbeat_timeout`` and its process not found dead
    (``alive``, as :func:`process_alive` says), or the driver already recorded FINISHED (its
    outcome is the retry's: nothing is left to run). The coordinator id stays the driver's (it
    acts under it); the previous watcher is superseded. The driver, or None (restart instead)."""
    from checkpointing.metastore import jobs

    with metastore.transaction() as s:
        job = jobs.lock_job(s, job_id)
        if job is None or job.coordinator_id != driver_attempt:
            return None
        if job.driver_attempt != driver_attempt or job.driver_pid is None:
            return None
        since, beat = job.driver_submitted_at, job.heartbeat_at
        if since is None:
            return None
        own = job.status_by == StatusWriter.RUN.of(driver_attempt)
        finished = job.status == JobStatus.FINISHED and own
        if not finished:
            if alive is False or job.status != JobStatus.RUNNING or beat is None or beat < since:
                return None
            if not driver_alive(beat, now, heartbeat_timeout):
                return None
        job.driver_watcher = watcher
        return DriverIdentity(
            driver_attempt,
            job.driver_host or "",
            job.driver_pid,
            job.driver_log,
            since,
            job.driver_parallelism,
        )
