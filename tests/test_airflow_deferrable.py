"""The deferrable pipeline task under the real scheduler and triggerer (issue 27), LocalExecutor,
real Spark: one DAG run, one long scenario.

(a) The task submits its detached driver and defers: while the driver runs, the task instance
is DEFERRED and no worker process holds it (every LocalExecutor worker idle, no task runner of
it, the driver in a session of its own, outside the scheduler's process tree).
(b) The triggerer, which runs the try's checkpoint coordinator, is SIGKILLed mid-run (with its
trigger runner) and restarted: the new triggerer takes the trigger over from the metastore
(``[triggerer] triggerer_health_check_threshold`` shortened), and checkpoints complete after it
did; the task stays deferred meanwhile.
(c) The run succeeds on its first try, and the sink's output is exactly-once.

The in-process tests of the same code paths (serialisation, the verdicts, a lost or superseded
driver) are ``test_deferrable.py``'s.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import signal
import urllib.parse
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import pytest

from checkpointing.config import Settings
from checkpointing.coordination.drivers import process_alive, read_state
from checkpointing.coordination.failure import CheckpointFailureReason
from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline import datasets
from demo.local_airflow import LocalAirflow, local_airflow
from tests.airflow_harness import (
    AGGS,
    DEADLINE_S,
    Api,
    assert_exactly_once,
    assert_nothing_left,
    free_port,
    heartbeat_env,
    migrate_airflow_db,
    tree_of,
    wait_for,
    write_events_spec,
)
from tests.helpers import checkpoint_rows

JOB = "deferred_pipeline"
TASK = "run"
FILES = 32

#: the pipeline DAG: one deferrable checkpointed task, no retry (a retry would hide a failure)
DAG = """
import pendulum
from airflow.sdk import DAG

from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator

with DAG({job!r}, schedule=None, start_date=pendulum.datetime(2026, 1, 1), catchup=False):
    CheckpointedSparkSubmitOperator(
        task_id={task!r},
        pipeline={spec!r},
        deferrable=True,
        coordinator_poll=1.0,
        driver_heartbeat_timeout=180,  # a JVM starting on a loaded machine: over 60 s seen
        retries=0,
        conf={{
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1",
        }},
    )
"""


@pytest.fixture
def airflow(tmp_path: Path) -> Iterator[LocalAirflow]:
    """api-server, scheduler, dag-processor and triggerer on SQLite (a copy of a database
    migrated once per test process) and the LocalExecutor; the checkpoint metastore SQLite.
    Afterwards the detached driver is stopped if it still runs, and no process may be left."""
    from checkpointing_airflow.detached_driver import stop_driver

    home = tmp_path / "ckpt"
    home.mkdir()
    settings = Settings(
        metastore_url=f"sqlite:///{home / 'metastore.db'}",
        storage_url=(home / "checkpoints").as_uri(),
        home=home,
    )
    created = Metastore(settings.metastore_url, check_schema=False)
    created.upgrade()
    created.dispose()
    events = tmp_path / "events"
    datasets.generate_events(events, events=16_000, keys=100, files=FILES, seed=7)
    spec = write_events_spec(
        tmp_path / f"{JOB}.yaml",
        JOB,
        events,
        tmp_path / "out",
        checkpoint="{every_epochs: 1, retained: 2, tolerable_failures: 0}",
    )
    dags = tmp_path / "dags"
    dags.mkdir()
    (dags / f"{JOB}.py").write_text(DAG.format(job=JOB, task=TASK, spec=str(spec)))
    local = local_airflow(
        settings,
        port=free_port(),
        home=tmp_path / "airflow",
        dags=dags,
        extra_env={
            **heartbeat_env(60),
            # the copied database comes without the airflow.cfg a migration writes: the
            # components, started at once, would each generate their own secrets
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(16),
            "AIRFLOW__API__SECRET_KEY": secrets.token_urlsafe(16),
            "AIRFLOW__CORE__FERNET_KEY": base64.urlsafe_b64encode(os.urandom(32)).decode(),
            "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "1",
            "AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": "5",
        },
        migrate_db=migrate_airflow_db,
    )
    local.start()
    try:
        yield local
    finally:
        local.stop()
        metastore = Metastore(settings.metastore_url)
        driver = read_state(metastore, JOB).driver
        metastore.dispose()
        if driver is not None:
            stop_driver(driver)  # detached: Airflow's stop leaves it running, by design
    assert_nothing_left(tmp_path)


def _processes_naming(text: str, airflow: LocalAirflow) -> list[str]:
    """Command lines naming ``text`` of the processes of the local Airflow's scheduler (another
    test may run an Airflow of its own meanwhile; a retitled process's environment is gone)."""
    found = []
    for proc in tree_of([psutil.Process(airflow.processes["scheduler"].pid)]):
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(proc.cmdline()).strip()
            if text in cmdline:
                found.append(cmdline)
    return found


@pytest.mark.timeout(600)
def test_a_deferred_run_frees_its_slot_survives_a_triggerer_sigkill_and_is_exactly_once(
    airflow: LocalAirflow, tmp_path: Path
) -> None:
    from checkpointing_airflow.attempts import attempt_id

    assert airflow.wait_until_serving(DEADLINE_S)
    api = Api(airflow.url, airflow.user, airflow.password)
    metastore = Metastore(airflow.env["CKPT_METASTORE_URL"])
    wait_for(f"the DAG {JOB}", lambda: api.get(f"/api/v2/dags/{JOB}"))
    assert api.call("/api/v2/importErrors")["total_entries"] == 0
    run_id = api.call(f"/api/v2/dags/{JOB}/dagRuns", {"logical_date": None})["dag_run_id"]
    run_path = f"/api/v2/dags/{JOB}/dagRuns/{urllib.parse.quote(run_id, safe='')}"
    attempt = attempt_id(JOB, run_id, 1)

    def task_instance() -> dict[str, Any] | None:
        ti = api.get(f"{run_path}/taskInstances/{TASK}")
        assert ti is None or ti["state"] not in ("failed", "up_for_retry"), ti
        return ti

    def completed() -> list[int]:
        return [c.checkpoint_id for c in checkpoint_rows(metastore, JOB) if c.completed_at]

    def deferred_after_a_checkpoint() -> dict[str, Any] | None:
        ti = task_instance()
        if not ti or ti["state"] != "deferred" or not ti.get("trigger"):
            return None
        return ti if completed() else None

    # --- (a) deferred while the driver runs, no worker holding the slot
    ti = wait_for("the task to defer with a checkpoint completed", deferred_after_a_checkpoint)
    driver = read_state(metastore, JOB).driver
    assert driver is not None and driver.attempt == attempt
    assert process_alive(driver), driver
    assert not _processes_naming(f"airflow worker -- {ti['id']}", airflow)  # no task runner
    workers = _processes_naming("airflow worker -- LocalExecutor", airflow)
    assert workers and all(c.endswith("<idle>") for c in workers), workers
    scheduler = psutil.Process(airflow.processes["scheduler"].pid)
    assert driver.pid not in {p.pid for p in tree_of([scheduler])}
    assert os.getsid(driver.pid) == driver.pid  # spark-submit leads a session of its own
    first_triggerer = ti["trigger"]["triggerer_id"]
    assert first_triggerer is not None

    # --- (b) SIGKILL the triggerer with its trigger runner, restart it
    old = airflow.processes["triggerer"]
    for proc in tree_of([psutil.Process(old.pid)]):  # its trigger runner, wherever its group
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(old.pid, signal.SIGKILL)
    old.wait(30)
    killed_at = datetime.now(UTC)
    airflow.start(components=("triggerer",))

    def taken_over() -> dict[str, Any] | None:
        ti = task_instance()
        assert ti is not None and ti["state"] in ("deferred", "scheduled", "queued", "success")
        trigger = ti.get("trigger") or {}
        if ti["state"] == "success":
            pytest.fail("the run ended before the new triggerer took the trigger: more FILES")
        owner = trigger.get("triggerer_id")
        return ti if owner not in (None, first_triggerer) else None

    ti = wait_for("the restarted triggerer to take the trigger", taken_over)
    assert ti["state"] == "deferred", ti
    # the new trigger's first pass found the attempt running and joined its coordination (the
    # triggerer's first connection lookup takes a few seconds: Airflow's in-process API starts)
    logs = airflow.home / "logs" / f"dag_id={JOB}" / f"run_id={run_id}" / f"task_id={TASK}"
    trigger_log = logs / f"attempt=1.log.trigger.{ti['trigger']['triggerer_id']}.log"

    def joined() -> bool:
        return trigger_log.exists() and "(detached driver)" in trigger_log.read_text()

    wait_for("the new trigger to coordinate", joined)
    resumed_at = datetime.now(UTC)
    assert read_state(metastore, JOB).status == "RUNNING"

    def completed_after_resume() -> bool:
        return any(
            c.completed_at is not None and c.completed_at > resumed_at
            for c in checkpoint_rows(metastore, JOB)
        )

    wait_for("a checkpoint completed under the new trigger", completed_after_resume)
    assert process_alive(driver)  # the same driver throughout: never restarted

    # --- (c) the run succeeds on its first try, exactly-once
    def run_ended() -> str | None:
        state = api.call(run_path)["state"]
        return state if state in ("success", "failed") else None

    assert wait_for("the DAG run to end", run_ended) == "success"
    tries = api.call(f"{run_path}/taskInstances/{TASK}/tries")["task_instances"]
    assert [t["try_number"] for t in tries] == [1], tries
    xcom = api.call(f"{run_path}/taskInstances/{TASK}/xcomEntries/return_value?deserialize=true")
    outcome = xcom["value"] if isinstance(xcom["value"], dict) else json.loads(xcom["value"])
    assert outcome["status"] == "FINISHED" and outcome["attempt"] == attempt, outcome
    assert outcome["restored_from"] is None and outcome["epochs_done"] == FILES, outcome
    assert outcome["epochs_run"] == FILES, outcome  # nothing redone
    rows = checkpoint_rows(metastore, JOB)
    assert {c.coordinator_id for c in rows} == {attempt}
    counted = [
        c
        for c in rows
        if c.failure_reason and CheckpointFailureReason(c.failure_reason).counts_as_failure
    ]
    assert not counted, [(c.checkpoint_id, c.failure_reason) for c in counted]
    assert any(c.completed_at and c.completed_at < killed_at for c in rows)
    assert_exactly_once(tmp_path / "out", tmp_path / "events", AGGS)
    metastore.dispose()
