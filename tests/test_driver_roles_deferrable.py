"""Issue 38, driver scope on the deferrable path (``test_deferrable.py``'s in-process harness: a
stand-in ``spark-submit`` plays a detached driver that joins, reports RUNNING, heart-beats and
finishes through the metastore URL it was given), against a PostgreSQL metastore of this
module's own with driver scope enabled:

- the detached driver gets its own try's role, not the task's URL, and does its whole part
  (join, status, heartbeat, shutdown) with it; the role lives while the driver runs;
- a retry that re-attaches to the running driver grants no second role and revokes nothing
  (neither does try 1's retry callback); the driver's role is dropped only once the outcome
  is read and the driver has exited.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from sqlalchemy import text

from checkpointing.coordination.drivers import process_alive, read_state
from checkpointing.metastore.driver_roles import driver_role_name
from tests.test_driver_roles import TABLES, Scope, enabled, scope  # noqa: F401 (fixtures)

pytest.importorskip("airflow")

from tests.test_deferrable import (
    DAG,
    JOB,
    RUN,
    airflow_in_process,  # noqa: F401 (a fixture)
    defer_try,
    first_event,
    job_row,
    wait_until,
)


def _roles(scoped: Scope) -> set[str]:
    """The drivers' roles granted in the metastore, each checked to exist on the server."""
    with scoped.owner.engine.connect() as conn:
        granted = {r for (r,) in conn.execute(text("SELECT role_name FROM ckpt_driver_grants"))}
        for role in granted:
            assert _exists(scoped, role), role
    return granted


def _exists(scoped: Scope, role: str) -> bool:
    with scoped.owner.engine.connect() as conn:
        found = conn.execute(text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role})
        return found.first() is not None


@pytest.fixture
def scoped_airflow(
    airflow_in_process: Path,  # noqa: F811 (the fixture)
    enabled: Scope,  # noqa: F811 (the fixture)
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[Path, Scope, str]:
    """The deferrable harness on this module's PostgreSQL metastore (driver scope enabled),
    emptied; returns the spec, the scope and the database's name."""
    store = enabled.owner
    with store.engine.begin() as conn:
        for table in TABLES:
            conn.execute(text(f"DELETE FROM {table}"))
        database = conn.execute(text("SELECT current_database()")).scalar_one()
    assert _roles(enabled) == set()
    url = store.url.render_as_string(hide_password=False)
    monkeypatch.setenv("CKPT_METASTORE_URL", url)
    # the task's metastore connection, in the worker's environment (the task and the trigger
    # find the metastore by it)
    connection = {"conn_type": "generic", "extra": {"sqlalchemy_url": url}}
    monkeypatch.setenv("AIRFLOW_CONN_CHECKPOINT_METASTORE", json.dumps(connection))
    return airflow_in_process, enabled, database


def test_a_detached_driver_runs_on_its_own_role_dropped_once_it_is_done(
    scoped_airflow: tuple[Path, Scope, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from checkpointing_airflow.attempts import attempt_id

    spec, scoped, database = scoped_airflow
    attempt = attempt_id(DAG, RUN, 1)
    role = driver_role_name(database, JOB, attempt)
    d = defer_try(spec, tmp_path, monkeypatch, "finish")
    submitted = json.loads(wait_until("the driver's record", d.submitted.read_text))
    given = submitted["env"]["CKPT_METASTORE_URL"]
    assert given.startswith(f"postgresql+psycopg://{role}:")  # its own role, with a password
    assert given not in " ".join(submitted["argv"])
    assert "AIRFLOW_CONN_CHECKPOINT_METASTORE" not in submitted["env"]  # the task's: withheld
    assert "AIRFLOW_CONN_CHECKPOINT_METASTORE" in os.environ  # from the driver only
    # it joined, reported RUNNING and beat through that role (nothing else can log in as it)
    wait_until("RUNNING", lambda: job_row(d.metastore).status == "RUNNING")
    wait_until("a heartbeat", lambda: job_row(d.metastore).heartbeat_at)
    assert _roles(scoped) == {role}

    d.go.touch()
    event = asyncio.run(first_event(d.trigger))
    assert event["outcome"] == "finished", event
    outcome = d.op.execute_complete(d.context, event)
    assert outcome["status"] == "FINISHED" and outcome["attempt"] == attempt
    driver = read_state(d.metastore, JOB).driver
    assert driver is not None and process_alive(driver) is False
    assert _roles(scoped) == set()  # dropped once the outcome was read and the driver exited
    assert not _exists(scoped, role)
    d.metastore.dispose()


def test_a_re_attached_retry_keeps_the_running_drivers_role(
    scoped_airflow: tuple[Path, Scope, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from checkpointing_airflow.attempts import attempt_id
    from checkpointing_airflow.callbacks import restore_from_latest

    spec, scoped, database = scoped_airflow
    first = attempt_id(DAG, RUN, 1)
    role = driver_role_name(database, JOB, first)
    one = defer_try(spec, tmp_path, monkeypatch, "finish")
    wait_until("try 1's driver", lambda: job_row(one.metastore).heartbeat_at)
    restore_from_latest({**one.context, "task": one.op})  # Airflow retries try 1
    assert _roles(scoped) == {role}  # the callback dropped nothing: the driver lives

    one.submitted.unlink()
    two = defer_try(spec, tmp_path, monkeypatch, "finish", try_number=2)
    assert not one.submitted.exists()  # re-attached: no new spark-submit …
    assert _roles(scoped) == {role}  # … no new role, and the driver's kept
    beat = job_row(two.metastore).heartbeat_at
    wait_until("the driver's next beat", lambda: job_row(two.metastore).heartbeat_at != beat, 30)

    two.go.touch()
    event = asyncio.run(first_event(two.trigger))
    assert event["outcome"] == "finished", event
    outcome = two.op.execute_complete(two.context, event)
    assert outcome["status"] == "FINISHED" and outcome["attempt"] == first, outcome
    assert _roles(scoped) == set()  # try 2 read the driver's outcome: the role is gone
    assert not _exists(scoped, role)
    one.metastore.dispose()
    two.metastore.dispose()
