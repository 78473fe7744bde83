"""Issue 27's scenario under the real scheduler and triggerer, shared by the LocalExecutor
(``test_airflow_deferrable.py``) and the CeleryExecutor (``test_airflow_celery.py``) modules.

A deferrable, ``scope: interval`` daily pipeline is backfilled over three days at once
(``max_active_runs: 3``), each day its own job instance; its epochs are paced by a sleeping
transform while the scenario interferes, then run at full speed. While it runs:

1. the worker of the first day to start is SIGKILLed (every process of it but the driver's
   session) while its driver is still starting: the retry waits for the driver's first
   heartbeat and **re-attaches** to it, or takes its outcome if it finished meanwhile (no second
   spark-submit, no restore, no epoch redone);
2. the triggerer is SIGKILLed (with its trigger runner) while a day is deferred, and restarted:
   the new one takes that day's trigger over from the metastore and coordinates it;
3. that day's driver is then SIGKILLed: its trigger reports the lost driver, and the retry
   **restores** the latest completed checkpoint and redoes only the epochs after it.

Every day's output equals pandas over that day's files alone, exactly once, and the three runs
overlapped. Then a backfill of the middle day with **Full refresh** replaces that day's output
(read again from the start, by a driver of its own), the other days' output untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import urllib.error
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from checkpointing.coordination.drivers import DriverIdentity, process_alive, read_state
from checkpointing.metastore import views
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint
from checkpointing.pipeline import datasets
from demo.local_airflow import LocalAirflow
from tests.airflow_harness import (
    AGGS,
    Api,
    assert_exactly_once,
    described,
    freeze,
    gone,
    heartbeat_env,
    tree_of,
    wait_for,
    write_events_spec,
)
from tests.helpers import checkpoint_rows

DAG_ID = "daily_deferred"
TASK = "run"
DAYS = ("2026-11-20", "2026-11-21", "2026-11-22")
FILES = 12
ROWS_PER_FILE = 40
#: seconds each partition of an epoch's rows sleeps in the transform while the scenario needs the
#: runs to last (a sleep costs no CPU); afterwards 0, and the epochs left run at full speed
PACE_S = 2.5
#: the transform that paces the epochs, reading the pace from a file each time (a Python
#: function: Spark takes its UDF as deterministic, which a transform must be)
PACE = """
import time
from pathlib import Path


def slow(rows, tables):
    def pace(batches):
        time.sleep(float(Path({path!r}).read_text()))
        yield from batches

    return rows.mapInPandas(pace, rows.schema)
"""
#: seconds between the scenario's looks through the REST API (each costs the api-server CPU
#: that the drivers share)
POLL_S = 1.0
#: the scheduler fails a task without heartbeats after about this long
HEARTBEAT_TIMEOUT_S = 20

#: the pipeline's DAG: the spec's own, its task deferrable
DAG = """
from checkpointing.pipeline.spec import load_spec
from checkpointing_airflow.dag_factory import build_pipeline_dag

dag = build_pipeline_dag(
    load_spec({spec!r}),
    operator_args={{
        "deferrable": True,
        "coordinator_poll": 1.0,
        "driver_heartbeat_timeout": 180,  # a JVM starting on a loaded machine: over 60 s seen
        "conf": {{
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1",
        }},
    }},
)
"""

#: the Airflow settings of the scenario: no scheduled run beside the backfills, a dead task or
#: triggerer noticed within seconds
AIRFLOW_ENV = {
    **heartbeat_env(HEARTBEAT_TIMEOUT_S),
    "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",
    "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "1",
    "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "5",
}


def instance_of(day: str) -> str:
    """The day's job instance: ``<job>.<interval start>``."""
    return f"{DAG_ID}.{day.replace('-', '')}T000000"


def write_daily_pipeline(root: Path, dags: Path) -> None:
    """The three days' events under ``root/events/date=<day>``, the spec and its DAG file."""
    for i, day in enumerate(DAYS):
        datasets.generate_events(
            root / "events" / f"date={day}",
            events=FILES * ROWS_PER_FILE,
            keys=40,
            files=FILES,
            seed=20 + i,
        )
    (root / "pace_s").write_text(str(PACE_S))
    (root / "pace.py").write_text(PACE.format(path=str(root / "pace_s")))
    spec = write_events_spec(
        root / f"{DAG_ID}.yaml",
        DAG_ID,
        root / "events" / "date=${DS}",
        root / "out" / "date=${DS}",
        checkpoint="{every_epochs: 1, retained: 2, tolerable_failures: 0}",
        scope="interval",
        schedule="'@daily'",
        max_active_runs=3,
        retries=2,
        retry_delay="2s",
        transform="pace:slow",
        py_files="[pace.py]",
    )
    (dags / f"{DAG_ID}.py").write_text(DAG.format(spec=str(spec)))


def kill_sparing(roots: list[psutil.Process], driver: DriverIdentity) -> dict[int, str]:
    """SIGKILL ``roots`` and their descendants at once (frozen first), except the driver's
    session: a worker dying under a detached driver. Their pids and command lines."""
    frozen = freeze(lambda: [p for p in tree_of(roots) if _session(p) != driver.pid])
    killed = {p.pid: described(p)[1] for p in frozen}
    for p in frozen:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    wait_for("the killed processes to die", lambda: all(map(gone, frozen)), 30)
    return killed


def _session(proc: psutil.Process) -> int | None:
    try:
        return os.getsid(proc.pid)
    except OSError:
        return None


def stop_drivers(metastore_url: str) -> None:
    """Stop the days' detached drivers still running after the test (Airflow's stop leaves
    them running, by design)."""
    from checkpointing_airflow.detached_driver import stop_driver

    metastore = Metastore(metastore_url)
    drivers = [read_state(metastore, instance_of(day)).driver for day in DAYS]
    metastore.dispose()
    for driver in drivers:
        if driver is not None:
            stop_driver(driver)


def restart_triggerer(airflow: LocalAirflow) -> None:
    """SIGKILL the triggerer with its trigger runner (wherever its group), then start one."""
    old = airflow.processes["triggerer"]
    for proc in tree_of([psutil.Process(old.pid)]):
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(old.pid, signal.SIGKILL)
    old.wait(30)
    airflow.start(components=("triggerer",))


@dataclass
class DailyBackfill:
    """The scenario's view of one running Airflow: its API, the checkpoint metastore."""

    airflow: LocalAirflow
    api: Api
    metastore: Metastore
    root: Path
    #: the runs' ids by day, as read
    run_ids: dict[str, str] = field(default_factory=dict)

    # ------------------------------------------------------------------ reading

    def runs(self) -> dict[str, dict[str, Any]]:
        """The DAG's runs by day (their interval's start)."""
        runs = self.api.call(f"/api/v2/dags/{DAG_ID}/dagRuns?limit=50")["dag_runs"]
        found = {r["data_interval_start"][:10]: r for r in runs}
        self.run_ids.update({day: r["dag_run_id"] for day, r in found.items()})
        return found

    def run_id(self, day: str) -> str | None:
        """The day's run id (a run keeps it: read once)."""
        if day not in self.run_ids:
            self.runs()
        return self.run_ids.get(day)

    def run_path(self, day: str) -> str:
        run_id = self.run_id(day) or ""
        return f"/api/v2/dags/{DAG_ID}/dagRuns/{urllib.parse.quote(run_id, safe='')}"

    def ti(self, day: str) -> dict[str, Any] | None:
        if self.run_id(day) is None:
            return None
        return self.api.get(f"{self.run_path(day)}/taskInstances/{TASK}")

    def attempt(self, day: str, try_number: int) -> str:
        from checkpointing_airflow.attempts import attempt_id

        return attempt_id(DAG_ID, self.run_id(day) or "", try_number)

    def tries(self, day: str) -> dict[int, dict[str, Any]]:
        tries = self.api.call(f"{self.run_path(day)}/taskInstances/{TASK}/tries")
        return {t["try_number"]: t for t in tries["task_instances"]}

    def outcome(self, day: str) -> dict[str, Any]:
        path = f"{self.run_path(day)}/taskInstances/{TASK}/xcomEntries/return_value"
        value = self.api.call(f"{path}?deserialize=true")["value"]
        return value if isinstance(value, dict) else json.loads(value)

    def checkpoints(self, day: str) -> list[Checkpoint]:
        return checkpoint_rows(self.metastore, instance_of(day))

    def completed(self, day: str, *, after: datetime | None = None) -> list[int]:
        return [
            c.checkpoint_id
            for c in self.checkpoints(day)
            if c.completed_at and (after is None or c.completed_at > after)
        ]

    def deferred(self, day: str) -> dict[str, Any] | None:
        """The day's task instance while it is deferred to a trigger, else None; a failed or
        retried try fails the test here (only the scenario's kills may fail one)."""
        ti = self.ti(day)
        if not ti or ti["state"] != "deferred" or not (ti.get("trigger") or {}).get("triggerer_id"):
            return None
        return ti

    def trigger_joined(self, day: str, ti: dict[str, Any]) -> bool:
        """The trigger's log: the new triggerer's trigger found the driver running and
        coordinates it (``(detached driver)``)."""
        run_id = self.run_id(day)
        logs = self.airflow.home / "logs" / f"dag_id={DAG_ID}" / f"run_id={run_id}"
        name = f"attempt={ti['try_number']}.log.trigger.{ti['trigger']['triggerer_id']}.log"
        log = logs / f"task_id={TASK}" / name
        return log.exists() and "(detached driver)" in log.read_text()

    # ------------------------------------------------------------------ acting

    def pace(self, seconds: float) -> None:
        """How long each epoch sleeps from now on, in every running driver."""
        (self.root / "pace_s").write_text(str(seconds))

    def backfill(self, first: str, last: str, **body: Any) -> dict[str, Any]:
        """``POST /api/v2/backfills`` over ``first`` … ``last``; again after a 503 (Airflow's
        answer when its SQLite database was locked by another component: nothing created)."""
        request = {
            "dag_id": DAG_ID,
            "from_date": f"{first}T00:00:00Z",
            "to_date": f"{last}T00:00:00Z",
            **body,
        }
        for _ in range(5):
            try:
                return self.api.call("/api/v2/backfills", request)
            except urllib.error.HTTPError as exc:
                if exc.code != 503:
                    raise
            time.sleep(2)
        return self.api.call("/api/v2/backfills", request)

    def await_backfill(self, backfill: dict[str, Any], days: tuple[str, ...]) -> None:
        """Until the backfill is complete and its runs ended: each must have succeeded."""

        def ended() -> dict[str, str] | None:
            done = self.api.call(f"/api/v2/backfills/{backfill['id']}")["completed_at"]
            states = {d: r["state"] for d, r in self.runs().items() if d in days}
            assert "failed" not in states.values(), states
            return states if done and len(states) == len(days) else None

        states = wait_for("the backfill to complete", ended, 600, every=POLL_S)
        assert set(states.values()) == {"success"}, states


def run_scenario(
    d: DailyBackfill,
    *,
    task_hosts: Callable[[], list[psutil.Process]],
    kill_worker: Callable[[DriverIdentity], dict[int, str]],
    full_refresh: bool = True,
) -> None:
    """The module docstring's scenario. ``task_hosts``: the processes that run task instances
    (LocalExecutor: the scheduler; Celery: the workers); ``kill_worker``: SIGKILL the worker
    running the given driver's try, but not the driver; ``full_refresh``: the middle day's
    refresh at the end (it does not depend on the executor: one module runs it)."""
    backfill = d.backfill(DAYS[0], DAYS[-1], max_active_runs=3)

    # --- (1) the worker of the first day to start dies while its driver starts
    def starting() -> tuple[str, DriverIdentity] | None:
        for day in DAYS:
            ti = d.ti(day)
            if not ti or ti["state"] != "running" or ti["try_number"] != 1:
                continue
            state = read_state(d.metastore, instance_of(day))
            driver = state.driver
            if driver is None or driver.attempt != d.attempt(day, 1):
                continue
            beat = state.heartbeat_at
            assert beat is None or beat < driver.submitted_at, f"{day}: the driver is up already"
            return day, driver
        return None

    reattached, driver = wait_for("a day's driver to be starting", starting, every=0.5)
    killed = kill_worker(driver)
    assert process_alive(driver), killed
    assert len(killed) >= 2, killed  # at least the task's supervisor and its task runner
    assert not any("SparkSubmit" in c for c in killed.values()), killed  # its session spared

    # --- (2) the triggerer SIGKILLed while another day is deferred, and restarted
    def deferred_other() -> tuple[str, dict[str, Any]] | None:
        for day in DAYS:
            if day != reattached and (ti := d.deferred(day)):
                return day, ti
        return None

    day, ti = wait_for("another day to defer", deferred_other, every=POLL_S)
    deferred_driver = read_state(d.metastore, instance_of(day)).driver
    assert deferred_driver is not None and process_alive(deferred_driver)

    # no task process holds the deferred day: the driver's parent (the task runner that
    # started it) is gone. Airflow marks the try deferred before its task runner has exited,
    # so this waits for the exit (the driver must outlive it, checked on every poll)
    def released() -> bool:
        assert process_alive(deferred_driver), "the deferred day's driver died"
        hosts = {p.pid for p in tree_of(task_hosts())}
        parent = psutil.Process(deferred_driver.pid).ppid()
        return parent not in hosts and deferred_driver.pid not in hosts

    wait_for("the deferred day's task runner to exit", released, 120, every=0.5)
    old_triggerer = ti["trigger"]["triggerer_id"]
    killed_at = datetime.now(UTC)
    restart_triggerer(d.airflow)

    # --- (3) a day deferred before the restart, whose trigger the new triggerer took over and
    # coordinates, loses its driver after a checkpoint
    def taken_over() -> tuple[str, DriverIdentity] | None:
        for day in DAYS:
            ti = d.deferred(day)
            if day == reattached or not ti or ti["trigger"]["triggerer_id"] == old_triggerer:
                continue
            created = datetime.fromisoformat(ti["trigger"]["created_date"])
            if ti["try_number"] != 1 or created >= killed_at or not d.trigger_joined(day, ti):
                continue
            driver = read_state(d.metastore, instance_of(day)).driver
            if driver is not None and d.completed(day):
                return day, driver
        return None

    lost, lost_driver = wait_for("a day taken over by the new triggerer", taken_over, every=POLL_S)
    os.killpg(lost_driver.pid, signal.SIGKILL)
    wait_for("the driver to die", lambda: process_alive(lost_driver) is False, 30)
    d.pace(0)  # nothing more to interfere with: the epochs left at full speed

    d.await_backfill(backfill, DAYS)
    (untouched,) = set(DAYS) - {reattached, lost}
    runs = d.runs()
    starts = [runs[day]["start_date"] for day in DAYS]
    ends = [runs[day]["end_date"] for day in DAYS]
    assert max(starts) < min(ends), runs  # the three days ran at once

    # (1): the retry re-attached: the driver's own outcome, nothing restored or redone
    tries = d.tries(reattached)
    assert sorted(tries) == [1, 2] and tries[2]["state"] == "success", tries
    first, second = d.attempt(reattached, 1), d.attempt(reattached, 2)
    outcome = d.outcome(reattached)
    assert outcome["attempt"] == first and outcome["restored_from"] is None, outcome
    assert outcome["epochs_run"] == FILES == outcome["epochs_done"], outcome
    state = read_state(d.metastore, instance_of(reattached))
    assert state.driver == driver and state.watcher == second
    restores = views.list_restores(d.metastore, instance_of(reattached))
    assert [r for r in restores if r["attempt"] == second] == [], restores
    logs = Path(driver.log or "").parent
    assert sorted(p.name for p in logs.glob("*.log")) == [f"{first}.log"]  # one spark-submit

    # (3): the retry restored the latest checkpoint its driver completed, redid the rest
    tries = d.tries(lost)
    assert sorted(tries) == [1, 2] and tries[2]["state"] == "success", tries
    first, second = d.attempt(lost, 1), d.attempt(lost, 2)
    latest = max(
        c.checkpoint_id for c in d.checkpoints(lost) if c.coordinator_id == first and c.completed_at
    )
    outcome = d.outcome(lost)
    assert outcome["attempt"] == second and outcome["restored_from"] == latest, outcome
    assert outcome["epochs_run"] == FILES - latest and outcome["epochs_done"] == FILES, outcome
    restores = views.list_restores(d.metastore, instance_of(lost))
    restored = [r for r in restores if r["attempt"] == second and r["status"] == "RESTORED"]
    assert [r["checkpoint_id"] for r in restored] == [latest], restores

    # the task's "Checkpoints" link opens the page of the day's own job instance
    links = d.api.call(f"{d.run_path(reattached)}/taskInstances/{TASK}/links")["extra_links"]
    assert (links["Checkpoints"] or "").endswith(f"?pipeline={instance_of(reattached)}"), links

    assert sorted(d.tries(untouched)) == [1]
    assert d.outcome(untouched)["epochs_run"] == FILES
    for day in DAYS:
        assert_exactly_once(d.root / "out" / f"date={day}", d.root / "events" / f"date={day}", AGGS)

    if full_refresh:
        refresh_middle_day(d)


def refresh_middle_day(d: DailyBackfill) -> None:
    """The full refresh of the middle day: its output replaced once, the other days'
    untouched (a refresh's retry resuming it: test_interval_scope.py, on Spark)."""
    middle = DAYS[1]
    others = {day: _files(d.root / "out" / f"date={day}") for day in DAYS if day != middle}
    before = _files(d.root / "out" / f"date={middle}")
    refreshing = max(d.tries(middle)) + 1  # Airflow clears the run: its next try
    refresh = d.backfill(
        middle, middle, reprocess_behavior="completed", dag_run_conf={"full_refresh": True}
    )
    d.await_backfill(refresh, (middle,))
    tries = d.tries(middle)
    assert max(tries) == refreshing and tries[refreshing]["state"] == "success", tries
    outcome = d.outcome(middle)
    assert outcome["attempt"] == d.attempt(middle, refreshing), outcome  # a driver of its own
    assert outcome["restored_from"] is None and outcome["epochs_run"] == FILES, outcome
    restores = views.list_restores(d.metastore, instance_of(middle))
    reset = [
        r["assignment"]["full_refresh"]
        for r in restores
        if r["attempt"] == outcome["attempt"] and (r["assignment"] or {}).get("full_refresh")
    ]
    assert [r["epochs_removed"] for r in reset] == [FILES], restores  # reset once, then read
    after = _files(d.root / "out" / f"date={middle}")
    assert not set(after.items()) & set(before.items())  # every file written anew
    assert_exactly_once(
        d.root / "out" / f"date={middle}", d.root / "events" / f"date={middle}", AGGS
    )
    assert {day: _files(d.root / "out" / f"date={day}") for day in others} == others


def _files(root: Path) -> dict[str, int]:
    """A sink's data files by relative path (not its ``_`` or ``.`` bookkeeping), with their
    modification times (ns)."""
    found = {}
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if p.is_file() and not any(part.startswith(("_", ".")) for part in rel.parts):
            found[str(rel)] = p.stat().st_mtime_ns
    return found
