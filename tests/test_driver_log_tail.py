"""The failed driver's log tail in the task log (issue 38): its path is recomputed from the job
and attempt ids (``CKPT_HOME/logs/drivers/<job>/<attempt>.log``, where the task sent
spark-submit's output), never read from the job row's ``driver_log`` (any driver can write
rows); symlinks and non-regular files (``/dev/zero``, a FIFO) are refused unread, and at most
a bounded number of bytes is read from its end."""

from __future__ import annotations

import logging
import os
import socket
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest

from checkpointing.coordination.drivers import DriverIdentity
from checkpointing_airflow import detached_driver
from checkpointing_airflow.deferred import LOG_TAIL_LINES, DeferredSubmit
from checkpointing_airflow.detached_driver import driver_log_path

JOB, ATTEMPT = "tail_job", "manual__2026-01-01-abcd1234-t1"


class _Operator:
    def __init__(self) -> None:
        self.log = logging.getLogger("test_driver_log_tail")


def _tail(driver: DriverIdentity, caplog: pytest.LogCaptureFixture) -> str:
    """What ``show_log_tail`` puts in the task log (run in a thread: a blocking read fails the
    test instead of hanging it)."""
    caplog.clear()
    tail = DeferredSubmit(_Operator()).show_log_tail
    done = threading.Thread(target=tail, args=(JOB, driver), daemon=True)
    with caplog.at_level(logging.INFO, logger="test_driver_log_tail"):
        done.start()
        done.join(timeout=20)
    assert not done.is_alive(), "the log tail blocked"
    return "\n".join(r.getMessage() for r in caplog.records)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CKPT_HOME", str(tmp_path / "home"))
    return tmp_path


def _driver(log: str | None) -> DriverIdentity:
    return DriverIdentity(ATTEMPT, socket.gethostname(), 4242, log, datetime.now(UTC))


def test_the_tail_is_read_from_the_path_the_ids_give_not_the_rows(
    home: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret = home / "secret.txt"
    secret.write_text("password=hunter2\n")
    log = driver_log_path(JOB, ATTEMPT)
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"spark line {i}\n" for i in range(100)))
    shown = _tail(_driver(str(secret)), caplog)  # the row names another file
    assert "hunter2" not in shown
    assert "spark line 99" in shown and "spark line 60" in shown
    assert "spark line 59" not in shown  # the last LOG_TAIL_LINES lines only
    assert LOG_TAIL_LINES == 40


@pytest.mark.parametrize("kind", ["symlink_to_secret", "symlink_to_dev_zero", "fifo", "dir_link"])
def test_symlinks_and_non_regular_files_are_refused_unread(
    home: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    secret = home / "secret.txt"
    secret.write_text("password=hunter2\n")
    log = driver_log_path(JOB, ATTEMPT)
    log.parent.mkdir(parents=True)
    if kind == "symlink_to_secret":
        log.symlink_to(secret)
    elif kind == "symlink_to_dev_zero":
        log.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(log)
    else:  # the job's log directory is a link to a directory holding a planted log
        planted = home / "planted"
        planted.mkdir()
        (planted / log.name).write_text("password=hunter2\n")
        log.parent.rmdir()
        log.parent.symlink_to(planted, target_is_directory=True)
    shown = _tail(_driver(str(log)), caplog)
    assert "hunter2" not in shown
    assert "is not shown" in shown


def test_at_most_a_bound_is_read_from_the_end(
    home: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = driver_log_path(JOB, ATTEMPT)
    log.parent.mkdir(parents=True)
    with log.open("w") as fh:
        for i in range(400_000):  # ~9 MB
            fh.write(f"spark line {i:07d}\n")
    read = []
    real_read = os.read

    def counting(fd: int, n: int) -> bytes:
        data = real_read(fd, n)
        read.append(len(data))
        return data

    monkeypatch.setattr(os, "read", counting)
    shown = _tail(_driver(None), caplog)  # no log recorded on the row: the ids still give it
    assert "spark line 0399999" in shown and "spark line 0399960" in shown
    assert "spark line 0399959" not in shown
    assert 0 < sum(read) <= detached_driver.LOG_TAIL_BYTES
