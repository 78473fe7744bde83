"""``make airflow`` (``python -m demo airflow``): a local Airflow 3 with this project's DAGs and
plugins, and the user's own DAG folders (``--dags DIR``).

Its four components (api-server, scheduler, dag-processor, triggerer) run as child processes on
embedded defaults: home ``CKPT_HOME/airflow``, SQLite, the LocalExecutor, Airflow's
SimpleAuthManager with one admin user, on 127.0.0.1 only. ``airflow standalone`` does much the
same, but prints the login only the first time and mixes every component's log into one stream;
here each component logs to its own file and the URL and login are printed every time.

The caller's ``AIRFLOW__*`` settings (and ``AIRFLOW_CONN_*``/``AIRFLOW_VAR_*``) reach the
components over the launcher's defaults, except those it must own (:data:`OWNED`). Airflow runs
only as subprocesses here: this module imports nothing of it.
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.text import Text

from checkpointing.cli.common import waiting
from checkpointing.config import Settings
from demo.airflow_env import DAGS, airflow_command, airflow_env, migrate

COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
USER = "admin"
SIMPLE_AUTH_MANAGER = (
    "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
)
#: what the caller's environment may set for the components (user's value wins)
PASSED_THROUGH = ("AIRFLOW__", "AIRFLOW_CONN_", "AIRFLOW_VAR_")
#: settings the launcher owns, whatever the caller's environment says: the DAGs folder (``--dags``
#: adds folders) and the plugins (this project's), the database it migrates, the address it
#: checks, prints and serves on (``--port``), and the login it prints
OWNED = frozenset(
    {
        "AIRFLOW__CORE__DAGS_FOLDER",
        "AIRFLOW__CORE__PLUGINS_FOLDER",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC",
        "AIRFLOW__API__HOST",
        "AIRFLOW__API__PORT",
        "AIRFLOW__API__BASE_URL",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL",
        "AIRFLOW__CORE__AUTH_MANAGER",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE",
    }
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

    def start(
        self,
        say: Callable[[str], None] = lambda _what: None,
        components: Sequence[str] = COMPONENTS,
    ) -> None:
        """Start every component (or only ``components``, e.g. no triggerer where nothing
        defers) in its own process group (so that stopping one stops the workers and Spark
        drivers it started too), each logging to ``logs/<component>.log``."""
        logs = self.home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for name in components:
            say(f"starting {name}…")
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
        self,
        timeout: float,
        interrupted: Callable[[], bool] = lambda: False,
        say: Callable[[str], None] = lambda _what: None,
    ) -> bool:
        """Until the API server answers its health check (True) or ``interrupted()`` (False);
        raise if a component dies first or time runs out. ``say`` is told what is awaited."""
        deadline = time.monotonic() + timeout
        while not interrupted():
            say(f"waiting for {self.url}/api/v2/monitor/health")
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
            time.sleep(0.25)
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


def dags_folder(home: Path, extra: Sequence[Path]) -> Path:
    """The one DAGs folder Airflow has: this project's ``dags/`` alone, or, with user folders,
    ``home/dags`` holding a symlink to each (``project`` and the folders' names, made unique).

    Symlinks rather than Airflow 3's DAG bundles: one ``dags-folder`` bundle is what this
    project's DAGs, the checkpoint API and ``airflow dags test`` know; Airflow's file discovery
    follows symlinks (with loop detection) and each folder's ``.airflowignore`` still applies
    inside it. The folder is rebuilt at every start; anything in it but symlinks is refused."""
    if not extra:
        return DAGS
    folder = home / "dags"
    folder.mkdir(parents=True, exist_ok=True)
    for entry in folder.iterdir():
        if not entry.is_symlink():
            raise RuntimeError(f"{folder} is made by the launcher and holds {entry.name}: move it")
        entry.unlink()
    names: set[str] = set()
    for name, target in [("project", DAGS), *((p.name or "dags", p) for p in extra)]:
        unique, n = name, 1
        while unique in names:
            n += 1
            unique = f"{name}-{n}"
        names.add(unique)
        (folder / unique).symlink_to(target.resolve(), target_is_directory=True)
    return folder


def passed_through(environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The caller's Airflow settings for the components, and the names of those the launcher
    owns (ignored; also their ``_CMD``/``_SECRET`` forms, which Airflow would read instead)."""
    given = {k: v for k, v in environ.items() if k.startswith(PASSED_THROUGH)}
    owned = sorted(k for k in given if k.removesuffix("_CMD").removesuffix("_SECRET") in OWNED)
    return {k: v for k, v in given.items() if k not in owned}, owned


def local_airflow(
    settings: Settings,
    *,
    port: int = 8080,
    home: Path | None = None,
    dags: Path = DAGS,
    user_dags: Sequence[Path] = (),
    extra_env: Mapping[str, str] | None = None,
    user_env: Mapping[str, str] | None = None,
    migrate_db: Callable[[Mapping[str, str]], None] = migrate,
) -> LocalAirflow:
    """Configure (not start) the local Airflow: its environment, its admin password (generated
    once, kept in ``home/passwords.json``) and its metadata database (migrated).

    :param dags: the DAGs folder (default: this project's ``dags/``).
    :param user_dags: more DAG folders (``--dags``): served with this project's ``dags/``
        through :func:`dags_folder`, each on the ``PYTHONPATH`` (as Airflow puts its DAGs folder)
        so that their DAGs import their own modules.
    :param extra_env: more environment on top of the defaults, e.g. ``AIRFLOW__SCHEDULER__*``
        settings of a test.
    :param user_env: the caller's environment, whose Airflow settings win over the defaults
        except :data:`OWNED` ones (see :func:`passed_through`).
    :param migrate_db: creates or upgrades the metadata database of an environment (the tests
        copy a database migrated once instead)."""
    home = home or settings.home / "airflow"
    url = f"http://127.0.0.1:{port}"
    if user_dags:
        dags = dags_folder(home, user_dags)
    env = airflow_env(home, dags, ckpt_home=settings.home)
    if user_dags:
        env["PYTHONPATH"] = os.pathsep.join(
            [env["PYTHONPATH"], *(str(p.resolve()) for p in user_dags)]
        )
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
    env.update(passed_through(user_env or {})[0])
    known: dict[str, Any] = json.loads(passwords.read_text()) if passwords.exists() else {}
    if USER not in known:
        known[USER] = secrets.token_urlsafe(12)
        passwords.write_text(json.dumps(known) + "\n")
        passwords.chmod(0o600)
    migrate_db(env)
    return LocalAirflow(home=home, url=url, user=USER, password=str(known[USER]), env=env)


def run_local_airflow(
    settings: Settings,
    console: Console,
    *,
    port: int = 8080,
    ready_timeout: float = 300,
    user_dags: Sequence[Path] = (),
) -> int:
    """Start the local Airflow, print its URL and login, and run until interrupted (Ctrl-C or
    SIGTERM) or until a component dies; then stop every component. Returns the exit code.
    What it waits for is shown as it waits (a spinner on a terminal)."""
    console.print(Text.assemble(("airflow", "bold"), f"  {settings.home / 'airflow'} (SQLite)"))
    for folder in (DAGS, *user_dags):
        console.print(Text.assemble(("DAGs", "bold"), f"     {folder}"))
    passed, ignored = passed_through(os.environ)
    if passed:
        console.print(f"from your environment: {', '.join(sorted(passed))}", soft_wrap=True)
    if ignored:
        console.print(
            Text.assemble(("ignored", "yellow"), f": {', '.join(ignored)} (set by the launcher)"),
            soft_wrap=True,
        )
    with socket.socket() as probe:  # say so now, not as an api-server crash in its log
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the api-server does
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            raise RuntimeError(
                f"port {port} on 127.0.0.1 is in use: choose another one "
                "(make airflow AIRFLOW_PORT=8081, or python -m demo airflow --port 8081)"
            ) from None
    with waiting(console) as say:
        say("migrating Airflow's database (airflow db migrate)…")
        airflow = local_airflow(settings, port=port, user_dags=user_dags, user_env=os.environ)
    stopping: list[int] = []

    def stop_on(signum: int, _frame: Any) -> None:
        stopping.append(signum)

    previous = {s: signal.signal(s, stop_on) for s in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        console.print(f"Airflow's components log to {airflow.home / 'logs'}")
        with waiting(console) as say:
            airflow.start(say)
            up = airflow.wait_until_serving(
                ready_timeout, interrupted=lambda: bool(stopping), say=say
            )
        if up:
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
