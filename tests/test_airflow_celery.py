"""(e) The coordinator's worker killed mid-run, under the CeleryExecutor: the retry runs on the
other worker and resumes coordination. (It replaced the same scenario under the LocalExecutor:
the checkpointing behaviour it checks is the same, and this deployment is the one users grow into;
``make airflow``'s launcher keeps its own test, ``test_local_airflow.py``.)

Real parts on loopback, as in a distributed deployment (docs/cluster.md, "Under the
CeleryExecutor"): Redis as the broker (a database number of its own), PostgreSQL as Airflow's
database and as Celery's result backend — through docker-compose.yml's own URLs, drivers, role
and password, only the host and a fresh database changed — and the checkpoint metastore, and two
Celery workers of one slot each, which Airflow knows by different hostnames. The pipeline task's
Spark driver runs on the worker that took the task (client deploy mode).

While a checkpoint of try 1 is pending, the worker running it is SIGKILLed with its whole process
tree (the Celery worker, its pool child supervising the task, the task runner hosting the
coordinator, ``spark-submit``, the driver). The scheduler notices the missing heartbeats and
queues try 2, which only the other worker can take: it becomes the coordinator, restores the
latest completed checkpoint from the metastore and the shared checkpoint storage, and the output
is exactly-once. The compose file's healthchecks of the scheduler and the Celery worker are run
against this Airflow too.

(f) The same deployment (a triggerer added) runs issue 27's deferrable, interval-scoped pipeline:
a backfill of three days at once, a worker killed while a task waits for its driver (the retry
re-attaches), a driver killed (the retry restores), the triggerer killed and restarted, then a
full refresh of one day whose driver is killed (the retry resumes the refresh); see the test's
docstring. The deferrable pipeline under the LocalExecutor, with a triggerer restart, is
``test_airflow_deferrable.py``'s.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import psutil
import pytest
import yaml
from sqlalchemy.engine import URL, make_url

from checkpointing.config import Settings
from checkpointing.coordination.drivers import DriverIdentity, process_alive, read_state
from checkpointing.metastore import views
from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline import datasets
from demo.airflow_env import airflow_command
from demo.local_airflow import LocalAirflow, local_airflow
from tests.airflow_harness import (
    DEADLINE_S,
    KILLED_TASK_DAG,
    REPO,
    Api,
    assert_nothing_left,
    assert_retry_resumed,
    free_port,
    fresh_pg_database,
    heartbeat_env,
    kill_component,
    kill_while_pending,
    tree_of,
    wait_for,
    write_events_spec,
)
from tests.daily_backfill import (
    DAILY,
    DAYS,
    DailyBackfill,
    instance_of,
    stop_detached_drivers,
    write_backfill_dag,
)
from tests.helpers import checkpoint_rows

redis = pytest.importorskip("redis")
pytest.importorskip("airflow.providers.celery")

JOB = "killed_celery_worker"
TASK = "run"
FILES = 8
HEARTBEAT_TIMEOUT_S = 20
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

#: (f) epochs of each day: the first day's try 1 is the one killed, and its driver must outlive
#: the scheduler's heartbeat timeout and the retry's queueing, so it has the most; the middle
#: day's refresh must still run when its first checkpoint is seen
DAY_FILES = {DAYS[0]: 12, DAYS[1]: 8, DAYS[2]: 4}


#: the logs of workers a test restarted, closed with the others
_WORKER_LOGS: list[IO[bytes]] = []


def _url(url: URL) -> str:
    return url.render_as_string(hide_password=False)


def start_worker(airflow: LocalAirflow, name: str) -> IO[bytes]:
    """An ``airflow celery worker`` of one slot whose tasks record ``name`` as their hostname,
    its Celery node ``celery@<name>``, in its own process group; stopped with the other
    components. Returns its log file, for the caller to close."""
    env = {
        **airflow.env,
        "CKPT_TEST_WORKER_HOSTNAME": name,
        "AIRFLOW__CORE__HOSTNAME_CALLABLE": "tests.airflow_harness.worker_hostname",
    }
    log = (airflow.home / "logs" / f"{name}.log").open("ab")
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
    return log


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
    """The local Airflow's components on the CeleryExecutor and PostgreSQL (a triggerer
    included), and two Celery workers, serving both scenarios' DAGs; stopped afterwards (and the
    deferred scenario's detached drivers), and then no process of it may be left."""
    tmp_path = root
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

        home = tmp_path / "ckpt"
        settings = Settings(
            metastore_url=_url(ckpt_db),
            storage_url=(home / "checkpoints").as_uri(),
            home=home,
        )
        created = Metastore(settings.metastore_url, check_schema=False)
        created.upgrade()
        created.dispose()
        events = tmp_path / "events"
        datasets.generate_events(events, events=4_000, keys=100, files=FILES, seed=5)
        spec = write_events_spec(
            tmp_path / f"{JOB}.yaml",
            JOB,
            events,
            tmp_path / "out",
            checkpoint="{every_epochs: 1, retained: 2, tolerable_failures: 0}",
        )
        dags = tmp_path / "dags"
        dags.mkdir()
        (dags / f"{JOB}.py").write_text(KILLED_TASK_DAG.format(job=JOB, task=TASK, spec=str(spec)))
        write_backfill_dag(tmp_path, dags, DAY_FILES)
        local = local_airflow(
            settings,
            port=free_port(),
            home=tmp_path / "airflow",
            dags=dags,
            extra_env={
                **heartbeat_env(HEARTBEAT_TIMEOUT_S),
                # runs only when asked for (triggered, backfilled): the daily DAG's latest
                # interval would otherwise be scheduled at once
                "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",
                "AIRFLOW__CORE__EXECUTOR": compose["AIRFLOW__CORE__EXECUTOR"],
                **{name: here(compose[name]) for name in COMPOSE_DATABASES},
                "AIRFLOW__CELERY__BROKER_URL": BROKER_URL,
            },
        )
        local.start()
        logs = [start_worker(local, name) for name in WORKERS]
        try:
            assert local.wait_until_serving(DEADLINE_S)
            yield local
        finally:
            local.stop()
            stop_detached_drivers(settings.metastore_url)
            for log in [*logs, *_WORKER_LOGS]:
                log.close()
            broker.flushdb()
            broker.close()
        assert_nothing_left(tmp_path)


@pytest.mark.timeout(600)
def test_a_killed_celery_worker_is_retried_on_the_other_worker_which_resumes_coordination(
    airflow: LocalAirflow, root: Path
) -> None:
    from checkpointing_airflow.operators import attempt_id

    api = Api(airflow.url, airflow.user, airflow.password)
    metastore = Metastore(airflow.env["CKPT_METASTORE_URL"])

    wait_for(f"the DAG {JOB}", lambda: api.get(f"/api/v2/dags/{JOB}"))
    assert api.call("/api/v2/importErrors")["total_entries"] == 0
    run_id = api.call(f"/api/v2/dags/{JOB}/dagRuns", {"logical_date": None})["dag_run_id"]
    ti_path = f"/api/v2/dags/{JOB}/dagRuns/{urllib.parse.quote(run_id, safe='')}/taskInstances"

    def running_ti() -> dict[str, Any] | None:
        ti = api.get(f"{ti_path}/{TASK}")
        assert ti is None or ti["state"] not in ("success", "failed"), ti
        return ti if ti and ti["state"] == "running" and ti["try_number"] == 1 else None

    worker = wait_for("try 1 to run", running_ti)["hostname"]
    assert worker in WORKERS
    (other,) = set(WORKERS) - {worker}
    first, second = (attempt_id(JOB, run_id, n) for n in (1, 2))

    # --- SIGKILL the worker running try 1, with its whole process tree, while a checkpoint is
    # pending: the Celery worker, its pool child (the task's supervisor), the task runner (the
    # coordinator), spark-submit and the driver
    main = psutil.Process(airflow.processes[worker].pid)
    killed = kill_while_pending(metastore, JOB, first, second, lambda: tree_of([main]))
    assert main.pid in killed.processes
    assert len(killed.processes) >= 4, killed.processes
    assert airflow.processes[other].poll() is None  # the other worker is untouched

    # the compose healthchecks, for real, while the scheduler waits for try 1's heartbeat: the
    # scheduler's job is alive on this host, the surviving worker answers the ping, the killed
    # one does not
    probes = {
        name: subprocess.Popen(
            compose_probe("airflow-scheduler" if name == "scheduler" else "airflow-worker"),
            env={**airflow.env, "HOSTNAME": name},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in ("scheduler", other, worker)
    }
    output = {name: p.communicate(timeout=180)[0][-2000:] for name, p in probes.items()}
    answered = {name: p.returncode for name, p in probes.items()}
    assert answered["scheduler"] == 0 and answered[other] == 0, (answered, output)
    assert answered[worker] != 0, (answered, output)

    # --- the retry ran on the other worker and resumed from the latest completed checkpoint
    tries = assert_retry_resumed(
        api, metastore, job=JOB, task=TASK, run_id=run_id, killed=killed, files=FILES, root=root
    )
    assert tries[1]["hostname"] == worker and tries[2]["hostname"] == other, tries
    assert airflow.processes[other].poll() is None
    metastore.dispose()


@pytest.mark.timeout(900)
def test_a_deferred_backfill_runs_three_intervals_at_once_re_attaches_and_refreshes_one(
    airflow: LocalAirflow, root: Path
) -> None:
    """(f) Issue 27 under the CeleryExecutor: a backfill of three days of a deferrable
    ``scope: interval`` pipeline. Each day is its own job instance, and their drivers run at
    once (each task frees its worker slot once its driver is up).

    - The worker running the first day's try 1 is SIGKILLed while the task waits for its driver
      (the driver, in its own session, lives on) and restarted: the failure callback leaves the
      job alone and try 2 re-attaches to that driver (no new driver, no restore, no epoch
      redone).
    - The last day's driver is SIGKILLed after a checkpoint: the trigger finds it gone and the
      retry restores the latest completed checkpoint.
    - The triggerer is SIGKILLed (with its trigger runner) while days are deferred and
      restarted: the new one takes their triggers over.
    - Each day's output equals pandas over that day's files only.
    - One of the middle day's files is rewritten and that day is backfilled again with **Full
      refresh** (reprocessing its completed run), whose driver is SIGKILLed after the refresh's
      first checkpoint: the retry resumes the refresh from it (not reset again). The day's
      output becomes pandas over its current files; the other days' output is untouched."""
    from checkpointing_airflow.attempts import attempt_id

    for name in WORKERS:  # (e) killed one of them
        if airflow.processes[name].poll() is not None:
            _WORKER_LOGS.append(start_worker(airflow, name))
    api = Api(airflow.url, airflow.user, airflow.password)
    metastore = Metastore(airflow.env["CKPT_METASTORE_URL"])
    backfill = DailyBackfill(api, metastore, root, DAY_FILES)
    backfill.start()
    run_of, ti_of, outcome_of = backfill.run_of, backfill.ti_of, backfill.outcome_of

    # --- SIGKILL the worker running the first day's try 1 while the task waits for its driver:
    # the worker's own processes only (the detached driver leads a session of its own); the
    # worker is restarted, as after a deploy
    day = DAYS[0]
    first = attempt_id(DAILY, run_of[day], 1)

    def waiting_for_its_driver() -> dict[str, Any] | None:
        ti = ti_of(day)
        assert ti is None or ti["try_number"] in (0, 1), ti
        if not ti or ti["state"] != "running":
            assert ti is None or ti["state"] in ("scheduled", "queued", None), ti
            return None
        state = read_state(metastore, instance_of(day))
        driver = state.driver
        if driver is None or (state.heartbeat_at or driver.submitted_at) > driver.submitted_at:
            assert driver is None, "the driver was up before the test saw it"
            return None
        return ti

    worker = wait_for("the task waiting for its driver", waiting_for_its_driver)["hostname"]
    waiting = read_state(metastore, instance_of(day)).driver
    assert waiting is not None
    kill_component(airflow, worker, spare={waiting.pid})
    _WORKER_LOGS.append(start_worker(airflow, worker))
    driver = read_state(metastore, instance_of(day)).driver
    assert driver is not None and driver.attempt == first and process_alive(driver), driver

    # --- SIGKILL the last day's driver (its whole session) after a checkpoint, while its task
    # is deferred: the trigger finds it gone, the try fails and its retry restores
    last = DAYS[2]
    lost = attempt_id(DAILY, run_of[last], 1)

    def deferred_after_a_checkpoint() -> DriverIdentity | None:
        state = read_state(metastore, instance_of(last))
        assert state.status != "FINISHED", "the last day ended before its driver was killed"
        ti = ti_of(last)
        done = [c for c in checkpoint_rows(metastore, instance_of(last)) if c.completed_at]
        if not done or not ti or ti["state"] != "deferred" or state.driver is None:
            return None
        return state.driver

    victim = wait_for("the last day's driver after a checkpoint", deferred_after_a_checkpoint)
    assert victim.attempt == lost
    os.killpg(victim.pid, signal.SIGKILL)

    # --- SIGKILL the triggerer (with its trigger runner) while days are deferred, and restart
    # it: the new triggerer takes their triggers over from the metastore
    def deferred_triggers() -> dict[str, int] | None:
        found = {
            d: ti["trigger"]["triggerer_id"]
            for d in DAYS
            if (ti := ti_of(d))
            and ti["state"] == "deferred"
            and (ti.get("trigger") or {}).get("triggerer_id")
        }
        return found or None

    before = wait_for("a deferred day", deferred_triggers)
    kill_component(airflow, "triggerer")
    airflow.start(components=("triggerer",))

    def taken_over() -> bool:
        now = deferred_triggers() or {}
        return any(owner not in before.values() for owner in now.values())

    wait_for("the restarted triggerer to take a trigger over", taken_over)

    # --- every day's run succeeds; their drivers ran at once
    backfill.wait_succeeded()

    # the killed day: try 2 re-attached to try 1's driver, nothing restored or redone
    assert backfill.tries_of(day) == [1, 2]
    outcome = outcome_of(day)
    assert outcome["attempt"] == first and outcome["restored_from"] is None, outcome
    assert outcome["epochs_run"] == DAY_FILES[day] == outcome["epochs_done"], outcome
    killed_day = instance_of(day)
    assert read_state(metastore, killed_day).driver == driver  # never another driver
    assert {c.coordinator_id for c in checkpoint_rows(metastore, killed_day)} == {first}
    assert [r["attempt"] for r in views.list_restores(metastore, killed_day)] in ([], [first])
    # the last day: try 2 restored try 1's latest completed checkpoint and redid what followed
    latest = backfill.latest_completed(last, lost)
    retry = attempt_id(DAILY, run_of[last], 2)
    restored = [
        r
        for r in views.list_restores(metastore, instance_of(last))
        if r["attempt"] == retry and r["status"] == "RESTORED"
    ]
    assert [r["checkpoint_id"] for r in restored] == [latest], restored
    outcome = outcome_of(last)
    assert outcome["attempt"] == retry and outcome["restored_from"] == latest, outcome
    assert outcome["epochs_run"] == DAY_FILES[last] - latest, outcome
    backfill.assert_each_day_exactly_once()

    # --- a full refresh of the middle day (one of its files rewritten since), its driver
    # SIGKILLed after the refresh's first checkpoint: the retry resumes the refresh
    middle = DAYS[1]
    backfill.refresh(middle)
    refreshing, resuming = (attempt_id(DAILY, run_of[middle], n) for n in (2, 3))

    def refresh_checkpointed() -> DriverIdentity | None:
        state = read_state(metastore, instance_of(middle))
        driver = state.driver
        if driver is None or driver.attempt != refreshing:
            return None
        ended = state.status == "FINISHED" and (state.updated_at or driver.submitted_at) >= (
            driver.submitted_at
        )  # the row keeps the day's first run's FINISHED until the new driver runs
        assert not ended, "the refresh ended before its driver was killed"
        rows = checkpoint_rows(metastore, instance_of(middle))
        done = [c for c in rows if c.completed_at and c.coordinator_id == refreshing]
        return driver if done else None

    victim = wait_for("the refresh's first checkpoint", refresh_checkpointed)
    os.killpg(victim.pid, signal.SIGKILL)
    restores = backfill.assert_refreshed(middle)
    began = restores[refreshing]["assignment"]["full_refresh"]
    resumed = restores[resuming]
    assert resumed["assignment"]["full_refresh"]["resumed"] is True, resumed
    latest = backfill.latest_completed(middle, refreshing)
    assert resumed["checkpoint_id"] == latest >= began["from"], (resumed, began)
    outcome = outcome_of(middle)
    assert outcome["restored_from"] == latest, outcome
    assert outcome["epochs_done"] == DAY_FILES[middle] > outcome["epochs_run"], outcome
    metastore.dispose()
