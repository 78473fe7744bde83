"""``make airflow`` (``python -m demo airflow``): a local Airflow 3 with this project's DAGs and
plugins.

Its four components (api-server, scheduler, dag-processor, triggerer) run as child processes on
embedded defaults: home ``CKPT_HOME/airflow``, SQLite, the LocalExecutor, Airflow's
SimpleAuthManager with one admin user, on 127.0.0.1 only. ``airflow standalone`` does much the
same, but prints the login only the first time and mixes every component's log into one stream;
here each component logs to its own file and the URL and login are printed every time.

Airflow runs only as subprocesses here: this module imports nothing of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.text import Text

from checkpointing.config import Settings
from demo.airflow_env import DAGS, airflow_command, airflow_env, migrate

COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
USER = "admin"
SIMPLE_AUTH_MANAGER = (
    "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
)


@dataclass
class LocalAirflow:
    """The running components of a local Airflow, and how to reach it."""

    home: Path
    url: str
    user: str
    password: str
    env: dict[str, str]
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _logs: list[IO[bytes]] = field(default_factory=list)

    def start(self) -> None:
        """Start every component in its own process group (so that stopping one stops the
        workers and Spark drivers it started too), each logging to ``logs/<component>.log``."""
        logs = self.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for name in COMPONENTS:
            log = (logs / f"{name}.log").open("ab")
            self._logs.append(log)
            self.processes[name] = subprocess.Popen(
                [airflow_command(), name],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def dead(self) -> dict[str, int]:
        """Components that have exited, with their exit codes."""
        return {n: p.returncode for n, p in self.processes.items() if p.poll() is not None}

    def wait_until_serving(
        self, timeout: float, interrupted: Callable[[], bool] = lambda: False
    ) -> bool:
        """Until the API server answers its health check (True) or ``interrupted()`` (False);
        raise if a component dies first or time runs out."""
        deadline = time.monotonic() + timeout
        while not interrupted():
            if dead := self.dead():
                raise RuntimeError(f"Airflow components exited: {dead}; see {self.home / 'logs'}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/v2/monitor/health", timeout=5) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the API server did not answer at {self.url} within {timeout:.0f} s; see "
                    f"{self.home / 'logs' / 'api-server.log'}"
                )
            time.sleep(1)
        return False

    def stop(self, grace: float = 30) -> None:
        """SIGTERM every component's process group, SIGKILL what is left after ``grace`` s."""
        for proc in self.processes.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
        for proc in self.processes.values():
            _signal_group(proc, signal.SIGKILL)  # also stragglers whose leader already exited
            proc.wait()
        for log in self._logs:
            log.close()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def local_airflow(
    settings: Settings,
    *,
    port: int = 8080,
    home: Path | None = None,
    dags: Path = DAGS,
    extra_env: Mapping[str, str] | None = None,
) -> LocalAirflow:
    """Configure (not start) the local Airflow: its environment, its admin password (generated
    once, kept in ``home/passwords.json``) and its metadata database (migrated).

    :param dags: the DAGs folder (default: this project's ``dags/``).
    :param extra_env: more environment on top of the defaults, e.g. ``AIRFLOW__SCHEDULER__*``
        settings of a test."""
    home = home or settings.home / "airflow"
    url = f"http://127.0.0.1:{port}"
    env = airflow_env(home, dags, ckpt_home=settings.home)
    passwords = home / "passwords.json"
    env.update(
        {
            "CKPT_METASTORE_URL": settings.metastore_url,
            "CKPT_STORAGE_URL": settings.storage_url,
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(port),
            "AIRFLOW__API__BASE_URL": url,
            "AIRFLOW__API__WORKERS": "1",  # a 2-core machine also runs Spark
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{url}/execution/",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "4",
            # a local Airflow to try things in: the trigger button works at once
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
            "AIRFLOW__CORE__AUTH_MANAGER": SIMPLE_AUTH_MANAGER,
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
        }
    )
    env.update(extra_env or {})
    known: dict[str, Any] = json.loads(passwords.read_text()) if passwords.exists() else {}
    if USER not in known:
        known[USER] = secrets.token_urlsafe(12)
        passwords.write_text(json.dumps(known) + "\n")
        passwords.chmod(0o600)
    migrate(env)
    return LocalAirflow(home=home, url=url, user=USER, password=str(known[USER]), env=env)


def run_local_airflow(
    settings: Settings, console: Console, *, port: int = 8080, ready_timeout: float = 300
) -> int:
    """Start the local Airflow, print its URL and login, and run until interrupted (Ctrl-C or
    SIGTERM) or until a component dies; then stop every component. Returns the exit code."""
    console.print(Text.assemble(("airflow", "bold"), f"  {settings.home / 'airflow'} (SQLite)"))
    console.print(Text.assemble(("DAGs", "bold"), f"     {DAGS}"))
    with socket.socket() as probe:  # say so now, not as an api-server crash in its log
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the api-server does
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            raise RuntimeError(
                f"port {port} on 127.0.0.1 is in use: choose another one "
                "(make airflow AIRFLOW_PORT=8081, or python -m demo airflow --port 8081)"
            ) from None
    airflow = local_airflow(settings, port=port)
    stopping: list[int] = []

    def stop_on(signum: int, _frame: Any) -> None:
        stopping.append(signum)

    previous = {s: signal.signal(s, stop_on) for s in (signal.SIGTERM, signal.SIGINT)}
    airflow.start()
    code = 0
    try:
        console.print(f"starting {', '.join(COMPONENTS)} (logs in {airflow.home / 'logs'}) …")
        if airflow.wait_until_serving(ready_timeout, interrupted=lambda: bool(stopping)):
            console.print(
                Text.assemble(
                    "\n",
                    ("Airflow is up", "bold green"),
                    f": {airflow.url}\n  login: user ",
                    (airflow.user, "bold"),
                    ", password ",
                    (airflow.password, "bold"),
                    f" (kept in {airflow.home / 'passwords.json'})\n"
                    f"  metastore {settings.display_metastore_url},"
                    f" checkpoints {settings.storage_url}\n"
                    "  Ctrl-C stops it.",
                ),
                soft_wrap=True,
            )
        while not stopping:
            if dead := airflow.dead():
                console.print(
                    Text.assemble(
                        (f"Airflow components exited: {dead}", "red"), "; stopping the rest"
                    )
                )
                code = 1
                break
            time.sleep(1)
    except RuntimeError as exc:
        console.print(Text.assemble(("error:", "red"), f" {exc}"), soft_wrap=True)
        code = 1
    finally:
        console.print("stopping Airflow …")
        airflow.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    console.print("stopped")
    return code
