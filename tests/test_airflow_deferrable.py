"""Issue 27 under the real scheduler and triggerer with the LocalExecutor, real Spark: the
deferrable, interval-scoped daily pipeline of :mod:`tests.daily_backfill`, backfilled over three
days at once, with a worker, the triggerer and a driver SIGKILLed mid-run. Airflow's database
SQLite (a copy of one migrated once per test process), the checkpoint metastore SQLite.

A LocalExecutor worker is a child of the scheduler that supervises one task at a time: killing
the one that runs a try (and the try's task runner) is the worker dying under the detached
driver. The middle day's full refresh, which no executor changes, runs in the Celery module
only. The in-process tests of the same code paths (serialisation, the verdicts, a lost or
superseded driver) are ``test_deferrable.py``'s; the CeleryExecutor's run of the scenario is
``test_airflow_celery.py``'s.
"""

from __future__ import annotations

import base64
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from checkpointing.coordination.drivers import DriverIdentity
from checkpointing.metastore.engine import Metastore
from demo.local_airflow import LocalAirflow, local_airflow
from tests import daily_backfill as scenario
from tests.airflow_harness import (
    DEADLINE_S,
    Api,
    assert_nothing_left,
    embedded_checkpointing,
    free_port,
    migrate_airflow_db,
    wait_for,
)


@pytest.fixture
def airflow(tmp_path: Path) -> Iterator[LocalAirflow]:
    """api-server, scheduler, dag-processor and triggerer on SQLite and the LocalExecutor (as
    many workers as days); afterwards any detached driver still running is stopped, and no
    process may be left."""
    settings = embedded_checkpointing(tmp_path)
    dags = tmp_path / "dags"
    dags.mkdir()
    scenario.write_daily_pipeline(tmp_path, dags)
    local = local_airflow(
        settings,
        port=free_port(),
        home=tmp_path / "airflow",
        dags=dags,
        extra_env={
            **scenario.AIRFLOW_ENV,
            "AIRFLOW__CORE__PARALLELISM": str(len(scenario.DAYS)),
            # the copied database comes without the airflow.cfg a migration writes: the
            # components, started at once, would each generate their own secrets
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(16),
            "AIRFLOW__API__SECRET_KEY": secrets.token_urlsafe(16),
            "AIRFLOW__CORE__FERNET_KEY": base64.urlsafe_b64encode(os.urandom(32)).decode(),
        },
        migrate_db=migrate_airflow_db,
    )
    local.start()
    try:
        yield local
    finally:
        local.stop()
        scenario.stop_drivers(settings.metastore_url)
    assert_nothing_left(tmp_path)


@pytest.mark.timeout(1200)
def test_a_deferrable_daily_backfill_survives_worker_triggerer_and_driver_kills(
    airflow: LocalAirflow, tmp_path: Path
) -> None:
    assert airflow.wait_until_serving(DEADLINE_S)
    api = Api(airflow.url, airflow.user, airflow.password)
    wait_for(f"the DAG {scenario.DAG_ID}", lambda: api.get(f"/api/v2/dags/{scenario.DAG_ID}"))
    assert api.call("/api/v2/importErrors")["total_entries"] == 0
    scheduler = psutil.Process(airflow.processes["scheduler"].pid)

    def kill_worker(driver: DriverIdentity) -> dict[int, str]:
        """The LocalExecutor worker that started the driver (the scheduler's child among its
        ancestors), with its task runner."""
        worker = next(p for p in psutil.Process(driver.pid).parents() if p.ppid() == scheduler.pid)
        assert "LocalExecutor" in " ".join(worker.cmdline()), worker.cmdline()
        return scenario.kill_sparing([worker], driver)

    metastore = Metastore(airflow.env["CKPT_METASTORE_URL"])
    try:
        scenario.run_scenario(
            scenario.DailyBackfill(airflow, api, metastore, tmp_path),
            task_hosts=lambda: [scheduler],
            kill_worker=kill_worker,
            full_refresh=False,  # the executor plays no part in it: the Celery module runs it
        )
    finally:
        metastore.dispose()
