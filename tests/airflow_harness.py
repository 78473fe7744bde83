"""A real Airflow for tests: its own AIRFLOW_HOME and metadata database (SQLite or PostgreSQL),
this project's plugins, a DAGs folder of the test's own, and ``airflow dags test`` runs in
subprocesses (so that a test can kill one)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import psutil
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import IntegrityError, ProgrammingError

from demo.airflow_env import REPO, airflow_command, airflow_env, migrate
from tests import oracle
from tests.helpers import free_port

__all__ = [
    "AIRFLOW",
    "CKPT",
    "DEADLINE_S",
    "PG_ADMIN_URL",
    "REPO",
    "AirflowHome",
    "Api",
    "assert_exactly_once",
    "assert_nothing_left",
    "described",
    "embedded_checkpointing",
    "free_port",
    "freeze",
    "fresh_pg_database",
    "gone",
    "heartbeat_env",
    "make_airflow_home",
    "migrate_airflow_db",
    "tree_of",
    "wait_for",
    "worker_hostname",
]

AIRFLOW = airflow_command()
CKPT = str(Path(sys.executable).with_name("ckpt"))


@dataclass
class AirflowHome:
    home: Path
    dags: Path
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 600, **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run(
            [AIRFLOW, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **kwargs,
        )

    def dags_test(
        self, dag_id: str, conf: dict[str, Any] | None = None, *, timeout: float = 900
    ) -> subprocess.CompletedProcess:
        args = ["dags", "test", dag_id]
        if conf is not None:
            args += ["--conf", json.dumps(conf)]
        return self.run(*args, timeout=timeout)

    def write_dag(self, name: str, source: str) -> Path:
        path = self.dags / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        return path


#: the aggregations of the Airflow tests' pipelines (over ``datasets.generate_events``)
AGGS: dict[str, tuple[str, str | None]] = {
    "n": ("count", None),
    "total": ("sum", "amount"),
    "avg_amount": ("avg", "amount"),
}


def write_events_spec(
    path: Path, job: str, events: Path, out: Path, *, checkpoint: str, **fields: object
) -> Path:
    """A pipeline spec at ``path``: job ``job`` aggregating :data:`AGGS` per user over the
    Parquet files in ``events`` into the sink ``out``, parallelism 2 of 16 key groups, the
    ``checkpoint`` section given as YAML flow text; ``fields`` are further top-level fields."""
    aggs = ", ".join(f"{k}: {f}({c or ''})" for k, (f, c) in AGGS.items())
    extra = "\n".join(f"{k}: {v}" for k, v in fields.items())
    path.write_text(
        f"""
job: {job}
source: {{format: parquet, path: "{events}/*.parquet", splits_per_epoch: 1}}
key: user
aggregations: {{{aggs}}}
sink: {{path: "{out}", changelog: true}}
parallelism: 2
max_parallelism: 16
checkpoint: {checkpoint}
{extra}
"""
    )
    return path


#: SQLite databases that ``airflow db migrate`` created in this test process, by the settings
#: that shape the schema (the auth manager's tables): each new SQLite home gets a copy
_MIGRATED_SQLITE: dict[str, Path] = {}


def migrate_airflow_db(env: Mapping[str, str]) -> None:
    """``airflow db migrate`` for the Airflow of ``env``. A SQLite database is a copy of one that
    ``airflow db migrate`` created once per test process with the same settings (what it
    writes holds no path of the home: the schema, the default pool, the log templates), so
    each test's Airflow starts from a really migrated database without paying the migration
    again; any other database is migrated."""
    url = make_url(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
    if not url.drivername.startswith("sqlite") or not url.database:
        migrate(env)
        return
    key = env.get("AIRFLOW__CORE__AUTH_MANAGER", "")
    template = _MIGRATED_SQLITE.get(key)
    if template is None:
        root = Path(tempfile.mkdtemp(prefix="ckpt-tests-airflow-migrated-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        template = root / "airflow.db"
        migrate(
            {
                **env,
                "AIRFLOW_HOME": str(root),
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{template}",
            }
        )
        _MIGRATED_SQLITE[key] = template
    target = Path(url.database)
    target.parent.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(template)) as src, closing(sqlite3.connect(target)) as dst:
        src.backup(dst)


def embedded_checkpointing(root: Path) -> Any:
    """``root/ckpt``: an embedded metastore (its schema created) and file checkpoint storage, as
    a local Airflow scenario's settings."""
    from checkpointing.config import Settings
    from checkpointing.metastore.engine import Metastore

    home = root / "ckpt"
    home.mkdir()
    settings = Settings(
        metastore_url=f"sqlite:///{home / 'metastore.db'}",
        storage_url=(home / "checkpoints").as_uri(),
        home=home,
    )
    created = Metastore(settings.metastore_url, check_schema=False)
    created.upgrade()
    created.dispose()
    return settings


def make_airflow_home(root: Path, database_url: str, ckpt_home: Path) -> AirflowHome:
    """Create and migrate an Airflow home whose metadata database is ``database_url``."""
    home, dags = root / "airflow", root / "dags"
    dags.mkdir(parents=True, exist_ok=True)
    env = airflow_env(home, dags, ckpt_home=ckpt_home, database_url=database_url)
    # `airflow dags test` triggers as `dag_test`: the savepoint and deploy DAGs check that the
    # triggering user may edit the pipeline's DAG (SimpleAuthManager's users)
    env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"] = "admin:admin,dag_test:user"
    migrate_airflow_db(env)
    return AirflowHome(home, dags, env)


def assert_exactly_once(
    out: Path, events: Path, aggregations: dict[str, tuple[str, str | None]]
) -> None:
    """The sink ``out`` of a pipeline over ``events`` (one file per epoch, keyed by ``user``)
    equals an uninterrupted run's: the final table is the independent pandas aggregation of
    every event, every epoch's changelog is committed once with exactly the keys of its file,
    and nothing is left in progress."""
    frames = [pd.read_parquet(p) for p in sorted(events.glob("*.parquet"))]
    final = pd.read_parquet(out / "final").sort_values("user").reset_index(drop=True)
    expected = oracle.expected_aggregates(pd.concat(frames), ["user"], aggregations)
    pd.testing.assert_frame_equal(
        final[expected.columns.tolist()], expected, check_dtype=False, check_exact=False
    )
    committed = sorted(int(p.name.split("=")[1]) for p in (out / "changelog").glob("epoch=*"))
    assert committed == list(range(len(frames)))
    for epoch, frame in enumerate(frames):
        got = pd.read_parquet(out / "changelog" / f"epoch={epoch}")
        assert sorted(got.user) == sorted(frame.user.unique()), f"epoch {epoch}"
    assert not list(out.rglob("*.inprogress"))


#: the local PostgreSQL's admin URL (trust auth on loopback), as the metastore tests use it
PG_ADMIN_URL = os.environ.get("CKPT_TEST_PG_URL", "postgresql+psycopg://127.0.0.1:5432/test")


@contextmanager
def fresh_pg_database(
    prefix: str, *, owner: str | None = None, password: str = ""
) -> Iterator[URL]:
    """A new database on the local PostgreSQL, dropped (with its connections) on exit; its URL
    on 127.0.0.1 with the admin's driver. ``owner`` (created if missing, a LOGIN role with
    ``password``) owns it and is the URL's user, as a deployment's role would."""
    admin_url = make_url(PG_ADMIN_URL)
    name = f"{prefix}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            if (
                owner
                and not conn.execute(
                    text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": owner}
                ).first()
            ):
                with contextlib.suppress(ProgrammingError, IntegrityError):  # a racing test
                    conn.execute(text(f"CREATE ROLE \"{owner}\" LOGIN PASSWORD '{password}'"))
            conn.execute(text(f'CREATE DATABASE "{name}"' + (f' OWNER "{owner}"' if owner else "")))
        url = admin_url.set(database=name)
        yield url.set(username=owner, password=password or None) if owner else url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


# ============================================================================ a running Airflow

#: per wait of the running-Airflow tests (their whole run takes a few minutes on 2 cores)
DEADLINE_S = 300


def heartbeat_env(timeout_s: int) -> dict[str, str]:
    """Airflow settings that fail a task whose supervisor stopped heartbeating within about
    ``timeout_s`` (a live one heartbeats every 2 s), and re-parse DAG files every 5 s."""
    return {
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": str(timeout_s),
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL": "2",
        "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL": "2",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
    }


def worker_hostname() -> str:
    """``[core] hostname_callable`` of a test's Celery workers: each its own name, although
    they share this machine (Airflow records it as the task instance's hostname)."""
    return os.environ["CKPT_TEST_WORKER_HOSTNAME"]


def wait_for(
    what: str, found: Callable[[], Any], timeout: float = DEADLINE_S, every: float = 0.2
) -> Any:
    """Poll ``found`` every ``every`` s until it returns something truthy; fail after
    ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (value := found()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)
    return value


class Api:
    """Airflow's REST API at ``url`` with a user's login (``POST /auth/token``)."""

    def __init__(self, url: str, user: str, password: str) -> None:
        self.url = url
        body = {"username": user, "password": password}
        self.token = self.call("/auth/token", body, auth=False)["access_token"]

    def call(self, path: str, body: dict[str, Any] | None = None, *, auth: bool = True) -> Any:
        headers = {"Content-Type": "application/json"}
        if auth:
            headers["Authorization"] = f"Bearer {self.token}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{self.url}{path}", data, headers)
        with urllib.request.urlopen(request, timeout=30) as r:
            return json.loads(r.read())

    def get(self, path: str) -> Any:
        """GET, or None on 404 (not there yet)."""
        try:
            return self.call(path)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise


def leftovers(root: Path) -> list[psutil.Process]:
    """Processes of a test's Airflow: its home in their environment or the test's directory
    on their command line (Spark drivers, spark-submit, task runners, components)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if proc.pid == os.getpid():
            continue
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            home = proc.environ().get("AIRFLOW_HOME", "")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if str(root) in cmdline or home.startswith(str(root)):
            found.append(proc)
    return found


def assert_nothing_left(root: Path, grace: float = 30) -> None:
    deadline = time.monotonic() + grace
    while (left := leftovers(root)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, [" ".join(p.cmdline()) for p in left]


def tree_of(roots: list[psutil.Process]) -> list[psutil.Process]:
    """``roots`` and all their descendants (those still there)."""
    tree: dict[int, psutil.Process] = {}
    for root in roots:
        try:
            for p in [root, *root.children(recursive=True)]:
                tree[p.pid] = p
        except psutil.NoSuchProcess:
            continue
    return list(tree.values())


def freeze(tree: Callable[[], list[psutil.Process]]) -> list[psutil.Process]:
    """SIGSTOP every process of ``tree()``, until no new process appears in it."""
    stopped: dict[int, psutil.Process] = {}
    while new := [p for p in tree() if p.pid not in stopped]:
        for p in new:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.suspend()
            stopped[p.pid] = p
    return list(stopped.values())


def described(proc: psutil.Process) -> tuple[int, str]:
    """Parent pid and command line ("" for a zombie: a child that exited, not yet reaped)."""
    try:
        return proc.ppid(), " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return -1, ""


def gone(proc: psutil.Process) -> bool:
    """Dead (a zombie counts: nothing runs in it any more)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
