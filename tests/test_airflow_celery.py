"""Issue 27's deferrable daily backfill (:mod:`tests.daily_backfill`) under the CeleryExecutor:
two Celery workers of one slot each and a triggerer.

Real parts on loopback, as in a distributed deployment (docs/cluster.md, "Under the
CeleryExecutor"): Redis as the broker (a database number of its own), PostgreSQL as Airflow's
database and as Celery's result backend — through docker-compose.yml's own URLs, drivers, role
and password, only the host and a fresh database changed — and the checkpoint metastore, and two
Celery workers, which Airflow knows by different hostnames. A pipeline task's detached Spark
driver runs on the worker that took the task (client deploy mode).

The worker killed in the scenario is a whole Celery worker (its main process, the pool child
supervising the task, the task runner waiting for the driver's first heartbeat), the driver's
session spared; before it is started again (as a deployment restarts it), the compose file's
healthchecks run against this Airflow: the scheduler's job is alive, the surviving worker answers
the ping, the killed one does not. The retry re-attaches on whichever worker takes it.
"""

from __future__ import annotations

import importlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import psutil
import pytest
import yaml
from sqlalchemy.engine import URL, make_url

from checkpointing.config import Settings
from checkpointing.coordination.drivers import DriverIdentity
from checkpointing.metastore.engine import Metastore
from demo.airflow_env import airflow_command
from demo.local_airflow import LocalAirflow, local_airflow
from tests import daily_backfill as scenario
from tests.airflow_harness import (
    DEADLINE_S,
    REPO,
    Api,
    assert_nothing_left,
    free_port,
    fresh_pg_database,
    wait_for,
)

redis = pytest.importorskip("redis")
pytest.importorskip("airflow.providers.celery")

WORKERS = ("worker-a", "worker-b")
#: the broker: the local Redis, a database number no other test uses (flushed before and after)
BROKER_URL = os.environ.get("CKPT_TEST_REDIS_URL", "redis://127.0.0.1:6379/13")
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
#: Airflow's sync and async engines and Celery's result backend: one database, in compose
COMPOSE_DATABASES = (
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC",
    "AIRFLOW__CELERY__RESULT_BACKEND",
)

pytestmark = pytest.mark.postgres


def _url(url: URL) -> str:
    return url.render_as_string(hide_password=False)


#: the workers' log files, closed when the module's Airflow stops
_WORKER_LOGS: list[IO[bytes]] = []


def start_worker(airflow: LocalAirflow, name: str) -> None:
    """An ``airflow celery worker`` of one slot whose tasks record ``name`` as their hostname,
    its Celery node ``celery@<name>``, in its own process group; stopped with the other
    components."""
    env = {
        **airflow.env,
        "CKPT_TEST_WORKER_HOSTNAME": name,
        "AIRFLOW__CORE__HOSTNAME_CALLABLE": "tests.airflow_harness.worker_hostname",
    }
    log = (airflow.home / "logs" / f"{name}.log").open("ab")
    _WORKER_LOGS.append(log)
    airflow.processes[name] = subprocess.Popen(
        [
            *[airflow_command(), "celery", "worker", "--concurrency", "1"],
            *["--celery-hostname", f"celery@{name}", "--skip-serve-logs"],
            *["--without-mingle", "--without-gossip"],
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def compose_probe(service: str) -> list[str]:
    """The compose service's healthcheck as an argv for this machine (``$$`` is compose's
    escape of ``$``; a ``CMD-SHELL`` probe runs in ``sh -c``)."""
    probe = [str(w) for w in COMPOSE["services"][service]["healthcheck"]["test"]]
    if probe[0] == "CMD-SHELL":
        return ["sh", "-c", " ".join(probe[1:]).replace("$$", "$")]
    assert probe[0] == "CMD", probe
    return probe[1:]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("celery")


@pytest.fixture(scope="module")
def airflow(root: Path) -> Iterator[LocalAirflow]:
    """The local Airflow's components on the CeleryExecutor and PostgreSQL, a triggerer and two
    Celery workers; stopped afterwards (any detached driver too), and then no process of it may
    be left."""
    try:  # say why here, not as a worker that exits at start-up
        importlib.import_module("airflow.providers.celery.executors.celery_executor")
    except ImportError as exc:
        pytest.fail(f"the CeleryExecutor does not import with the installed Celery: {exc}")
    broker = redis.Redis.from_url(BROKER_URL)
    broker.flushdb()
    # Airflow's databases exactly as docker-compose.yml sets them (drivers, role, password): only
    # the host (postgres -> this machine's) and the database (a fresh one) differ
    compose = {k: str(v) for k, v in COMPOSE["x-airflow-common"]["environment"].items()}
    role = make_url(compose[COMPOSE_DATABASES[0]].removeprefix("db+"))
    with (
        fresh_pg_database(
            "celery_airflow", owner=role.username, password=role.password or ""
        ) as airflow_db,
        fresh_pg_database("celery_ckpt") as ckpt_db,
    ):

        def here(value: str) -> str:
            moved = make_url(value.removeprefix("db+")).set(
                host=airflow_db.host, port=airflow_db.port, database=airflow_db.database
            )
            return ("db+" if value.startswith("db+") else "") + _url(moved)

        home = root / "ckpt"
        settings = Settings(
            metastore_url=_url(ckpt_db),
            storage_url=(home / "checkpoints").as_uri(),
            home=home,
        )
        created = Metastore(settings.metastore_url, check_schema=False)
        created.upgrade()
        created.dispose()
        dags = root / "dags"
        dags.mkdir()
        scenario.write_daily_pipeline(root, dags)
        local = local_airflow(
            settings,
            port=free_port(),
            home=root / "airflow",
            dags=dags,
            extra_env={
                **scenario.AIRFLOW_ENV,
                "AIRFLOW__CORE__EXECUTOR": compose["AIRFLOW__CORE__EXECUTOR"],
                **{name: here(compose[name]) for name in COMPOSE_DATABASES},
                "AIRFLOW__CELERY__BROKER_URL": BROKER_URL,
            },
        )
        local.start()
        for name in WORKERS:
            start_worker(local, name)
        try:
            yield local
        finally:
            local.stop(grace=5)  # a Celery worker's warm shutdown: no need to wait it out
            for log in _WORKER_LOGS:
                log.close()
            broker.flushdb()
            broker.close()
            scenario.stop_drivers(settings.metastore_url)
        assert_nothing_left(root)


@pytest.mark.timeout(1200)
def test_a_deferrable_daily_backfill_survives_worker_triggerer_and_driver_kills(
    airflow: LocalAirflow, root: Path
) -> None:
    assert airflow.wait_until_serving(DEADLINE_S)
    api = Api(airflow.url, airflow.user, airflow.password)
    wait_for(f"the DAG {scenario.DAG_ID}", lambda: api.get(f"/api/v2/dags/{scenario.DAG_ID}"))
    assert api.call("/api/v2/importErrors")["total_entries"] == 0

    def workers() -> list[psutil.Process]:
        return [psutil.Process(airflow.processes[name].pid) for name in WORKERS]

    def kill_worker(driver: DriverIdentity) -> dict[int, str]:
        """The Celery worker whose task started the driver, with its whole tree but the
        driver's session; then started again (a deployment's restart)."""
        ancestors = {p.pid for p in psutil.Process(driver.pid).parents()}
        (name,) = [w for w in WORKERS if airflow.processes[w].pid in ancestors]
        killed = scenario.kill_sparing([psutil.Process(airflow.processes[name].pid)], driver)
        airflow.processes[name].wait(30)
        (other,) = set(WORKERS) - {name}
        probes = {
            host: subprocess.Popen(
                compose_probe("airflow-scheduler" if host == "scheduler" else "airflow-worker"),
                env={**airflow.env, "HOSTNAME": host},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for host in ("scheduler", other, name)
        }
        output = {host: p.communicate(timeout=180)[0][-2000:] for host, p in probes.items()}
        answered = {host: p.returncode for host, p in probes.items()}
        assert answered["scheduler"] == 0 and answered[other] == 0, (answered, output)
        assert answered[name] != 0, (answered, output)
        start_worker(airflow, name)
        return killed

    metastore = Metastore(airflow.env["CKPT_METASTORE_URL"])
    try:
        scenario.run_scenario(
            scenario.DailyBackfill(airflow, api, metastore, root),
            task_hosts=workers,
            kill_worker=kill_worker,
        )
    finally:
        metastore.dispose()
