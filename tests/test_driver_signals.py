"""Which process a recorded driver pid may name (issue 38): only a process that leads its own
process group, carries the attempt id on its command line and is found in a readable ``/proc``
is watched or signalled as the driver; a pid of 0 (the caller's own process group), 1, -1, a
process of another group, one without the attempt id, or any pid on a host without ``/proc``
is not ours: not alive, never signalled. Real processes throughout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import pytest

from checkpointing.coordination import drivers
from checkpointing.coordination.drivers import (
    DriverIdentity,
    owned_process,
    process_alive,
    this_host,
)
from checkpointing_airflow.detached_driver import stop_driver

ATTEMPT = "fake_dag__manual__2026-01-01-t1"
ROOT = Path(__file__).resolve().parents[1]


def _sleeper(*, session: bool, attempt: str | None = ATTEMPT) -> subprocess.Popen[bytes]:
    """A ``sleep`` whose command line carries ``--attempt <attempt>`` (a Python one: GNU
    ``sleep`` takes no such arguments), in a session of its own or in this process's group."""
    args = [sys.executable, "-c", "import time; time.sleep(60)"]
    if attempt is not None:
        args += ["--attempt", attempt]
    return subprocess.Popen(args, start_new_session=session)


def _identity(pid: int, attempt: str = ATTEMPT) -> DriverIdentity:
    return DriverIdentity(attempt, this_host(), pid, None, datetime.now(UTC))


def _wait_running(process: subprocess.Popen[bytes]) -> None:
    """Until the child has exec'd (its command line is the sleeper's)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if b"time.sleep" in Path(f"/proc/{process.pid}/cmdline").read_bytes():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError("the sleeper did not start")


@pytest.fixture
def sleepers() -> list[subprocess.Popen[bytes]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_the_driver_itself_is_watched_and_stopped(sleepers: list) -> None:
    """The control: a process in its own session naming the attempt is the driver."""
    driver = _sleeper(session=True)
    sleepers.append(driver)
    _wait_running(driver)
    assert owned_process(driver.pid, ATTEMPT)
    assert process_alive(_identity(driver.pid)) is True
    assert not owned_process(driver.pid, ATTEMPT[:-1])  # a prefix of the attempt id is not it
    assert not owned_process(driver.pid, ATTEMPT + "0")
    assert stop_driver(_identity(driver.pid), grace=5) is True
    assert driver.wait(timeout=10) is not None


_EXECS_LATER = """
import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.002)
args = ["-c", "import time; time.sleep(60)", "--attempt", os.environ["ATTEMPT"]]
os.execv(sys.executable, [sys.executable, *args])
"""


def test_a_driver_misread_once_is_not_declared_gone(
    sleepers: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live driver whose command line does not name its attempt at the first probe (here:
    it execs into one that does during the first pause, as spark-submit execs into its JVM) is
    alive: a verdict of gone would end its try. Gone only if every probe says so (the cases
    below)."""
    go = tmp_path / "go"
    process = subprocess.Popen(
        [sys.executable, "-c", _EXECS_LATER, str(go)],
        env={**os.environ, "ATTEMPT": ATTEMPT},
        start_new_session=True,
    )
    sleepers.append(process)
    deadline = time.monotonic() + 10
    while b"os.execv" not in Path(f"/proc/{process.pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.01)
    pauses: list[float] = []

    def pause(seconds: float) -> None:  # the first pause lets the child exec, then returns
        pauses.append(seconds)
        go.touch()
        while not owned_process(process.pid, ATTEMPT):
            assert time.monotonic() < deadline, "the child never exec'd"
            time.sleep(0.01)

    monkeypatch.setattr(drivers, "time", SimpleNamespace(sleep=pause))
    assert not owned_process(process.pid, ATTEMPT)  # the first probe misreads it
    assert process_alive(_identity(process.pid)) is True
    assert pauses == [drivers.REPROBE_PAUSES_S[0]]


def test_an_exited_driver_is_gone_without_a_second_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pid no longer in ``/proc``, and a zombie (exited, not yet reaped), are gone at once."""

    def pause(seconds: float) -> None:
        raise AssertionError("probed again")

    monkeypatch.setattr(drivers, "time", SimpleNamespace(sleep=pause))
    zombie = subprocess.Popen(
        [sys.executable, "-c", "pass", "--attempt", ATTEMPT], start_new_session=True
    )
    deadline = time.monotonic() + 10
    while b" Z " not in Path(f"/proc/{zombie.pid}/stat").read_bytes().rsplit(b")", 1)[1][:3]:
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.01)
    assert process_alive(_identity(zombie.pid)) is False
    zombie.wait()  # reaped: no such process
    assert process_alive(_identity(zombie.pid)) is False


@pytest.mark.parametrize("case", ["other_group", "no_attempt", "other_attempt"])
def test_a_pid_that_is_not_the_drivers_is_never_signalled(sleepers: list, case: str) -> None:
    """A process of another group (this test's, which it shares), or one whose command line
    does not carry the attempt id (this test's own child, too): not alive, not stopped."""
    process = {
        "other_group": lambda: _sleeper(session=False),
        "no_attempt": lambda: _sleeper(session=True, attempt=None),
        "other_attempt": lambda: _sleeper(session=True, attempt="other_dag__run-t1"),
    }[case]()
    sleepers.append(process)
    _wait_running(process)
    identity = _identity(process.pid)
    assert process_alive(identity) is False
    assert stop_driver(identity, grace=0.2) is False
    time.sleep(0.2)
    assert process.poll() is None, "the process was signalled"


def test_without_a_readable_proc_nothing_is_ours(
    sleepers: list, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A host without ``/proc``: nothing can be checked, so even the real driver is not
    signalled (fail closed)."""
    driver = _sleeper(session=True)
    sleepers.append(driver)
    _wait_running(driver)
    real_path = Path

    def no_proc(text: str) -> Path:
        return real_path(str(tmp_path / "no-proc" / text.lstrip("/")))

    monkeypatch.setattr(drivers, "Path", no_proc)
    assert owned_process(driver.pid, ATTEMPT) is False
    assert process_alive(_identity(driver.pid)) is False
    assert stop_driver(_identity(driver.pid), grace=0.2) is False
    time.sleep(0.2)
    assert driver.poll() is None


_CALLER = """
import json, subprocess, sys, time
from datetime import UTC, datetime
from checkpointing.coordination.drivers import DriverIdentity, process_alive, this_host
from checkpointing_airflow.detached_driver import stop_driver

sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
results = {}
for pid in (0, 1, -1):
    driver = DriverIdentity(sys.argv[1], this_host(), pid, None, datetime.now(UTC))
    try:
        results[pid] = [process_alive(driver), stop_driver(driver, grace=0.2)]
    except Exception as exc:
        results[pid] = repr(exc)
time.sleep(0.2)
results["sibling_alive"] = sibling.poll() is None
sibling.kill()
print(json.dumps(results))
"""


def test_pid_0_1_and_minus_1_never_signal_anything() -> None:
    """The caller (a triggerer, a worker) in a process group of its own with a sibling in it,
    as the recorded pid 0 would reach with ``killpg(0, …)``: the caller and its sibling
    survive, and pids 0, 1 and -1 are neither alive nor stopped."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "plugins")])}
    done = subprocess.run(
        [sys.executable, "-c", _CALLER, ATTEMPT],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
        start_new_session=True,  # what a killpg(0) reaches is this group, not pytest's
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results == {
        "0": [False, False],
        "1": [False, False],
        "-1": [False, False],
        "sibling_alive": True,
    }
