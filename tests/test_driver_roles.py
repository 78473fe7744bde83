"""Issue 38, "narrow what a driver can write": with driver scope enabled on PostgreSQL a Spark
driver logs in as its own per-attempt role and can read and write only its own job's rows.

Against the real local PostgreSQL, in a database of this module's own, owned (as in a
deployment) by a role that is neither superuser nor the API's: the core's code paths a driver
runs (join, job status, heartbeat, trigger, acks, completion with shared state, restore
record, shutdown) work for its own job through the granted URL; the same role reads none of
another job's rows, changes none (0 rows), inserts none (refused); a second, non-owner role
(the API server's) still reads and writes every row; a revoked or expired role cannot log in
(the roles are dropped: the test server trusts every local login, so only a role's absence
keeps it out) and an expired role's open session sees nothing.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, func, insert, select, text, update
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError

from checkpointing.clock import ManualClock
from checkpointing.config import CheckpointConfig
from checkpointing.coordination import shared_state
from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.heartbeat import Heartbeat
from checkpointing.coordination.pending import PendingCheckpoint, TaskAck
from checkpointing.coordination.request_queue import queue_request
from checkpointing.metastore import driver_roles
from checkpointing.metastore.driver_roles import (
    DriverScopeError,
    driver_scope,
    driver_scope_enabled,
    enable_driver_scope,
    expire_driver_roles,
    grant_driver,
    has_grant,
    revoke_driver,
    scoped_tables,
)
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import (
    Checkpoint,
    CheckpointAck,
    CheckpointRequest,
    CheckpointTask,
    DriverGrant,
    Job,
    RestoreEvent,
    SharedStateRef,
)
from checkpointing.restore.lookup import find_latest_valid, record_restore
from checkpointing.state.storage import FileSystemCheckpointStorage
from checkpointing.status import CheckpointStatus, CheckpointType, JobStatus
from tests.airflow_harness import PG_ADMIN_URL, fresh_pg_database
from tests.helpers import JOB, make_plan, new_coordinator

OTHER = "job-b"
#: one keyed operator of two subtasks and a stateless sink (as in test_shared_state)
PLAN = {"agg": 2, "sink": 1}
File = dict[str, Any]
ATTEMPT = "manual__2026-11-28-1a2b3c4d-t1"
#: the rows a job has after ``_seed``: one per table with a ``job_id``
TABLES = {
    "ckpt_jobs": Job,
    "ckpt_checkpoints": Checkpoint,
    "ckpt_checkpoint_tasks": CheckpointTask,
    "ckpt_checkpoint_acks": CheckpointAck,
    "ckpt_shared_state": SharedStateRef,
    "ckpt_requests": CheckpointRequest,
    "ckpt_restores": RestoreEvent,
}


@dataclass
class Scope:
    owner: Metastore  # the tables' owner, with CREATEROLE: runs `enable` and the grants
    api: Metastore  # another role with plain table privileges: the API server, the CLI
    group: str


@pytest.fixture(scope="module")
def scope() -> Iterator[Scope]:
    """A database of this module's own; its owner may create roles; the drivers' group has a
    name of its own (roles are cluster-wide) and every role made here is dropped after."""
    tag = f"{os.getpid()}_{uuid.uuid4().hex[:6]}"
    owner, api, group = f"ckpt_t_owner_{tag}", f"ckpt_t_api_{tag}", f"ckpt_t_drivers_{tag}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE ROLE "{api}" LOGIN'))
    try:
        with fresh_pg_database("ckpt_driver_roles", owner=owner) as url:
            with admin.connect() as conn:
                conn.execute(text(f'ALTER ROLE "{owner}" CREATEROLE'))
            Metastore(url, check_schema=False).upgrade()
            store = Metastore(url)
            with store.engine.begin() as conn:
                for table in [*TABLES, "alembic_version"]:
                    conn.execute(text(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {api}"))
                conn.execute(text(f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {api}"))
            api_store = Metastore(url.set(username=api))
            try:
                yield Scope(store, api_store, group)
            finally:
                with store.engine.connect() as conn:
                    left = list(conn.execute(text("SELECT role_name FROM ckpt_driver_grants")))
                store.dispose()
                api_store.dispose()
                with admin.connect() as conn:  # sessions first: a dropped database ends them
                    conn.execute(
                        text(
                            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                            "WHERE datname = :d AND pid <> pg_backend_pid()"
                        ),
                        {"d": url.database},
                    )
                    for (role,) in left:
                        conn.execute(text(f'DROP ROLE IF EXISTS "{role}"'))
    finally:
        with admin.connect() as conn:
            for role in (group, api, owner):
                conn.execute(text(f'DROP ROLE IF EXISTS "{role}"'))
        admin.dispose()


@pytest.fixture(scope="module")
def enabled(scope: Scope) -> Scope:
    assert not driver_scope_enabled(scope.owner)  # not before it is asked for
    assert driver_scope(scope.owner).group is None
    enable_driver_scope(scope.owner, group=scope.group)
    return scope


def _acks(
    coord: CheckpointCoordinator,
    pending: PendingCheckpoint,
    sizes: tuple[int, int],
    chains: tuple[list[File], list[File]] = ([], []),
) -> tuple[list[TaskAck], list[File]]:
    """Each keyed subtask writes a new file under the checkpoint's ``shared/chk-<id>/`` on top
    of ``chains[i]`` (an incremental checkpoint); the sink acks without state."""
    storage = coord.storage
    assert isinstance(storage, FileSystemCheckpointStorage)
    own = storage.shared_checkpoint_url(coord.job_id, pending.checkpoint_id)
    acks, new = [], []
    for t in pending.tasks:
        if t.operator_id != "agg":
            acks.append(TaskAck(t.attempt_id))
            continue
        i = t.subtask_index
        info = storage.write_bytes(f"{own}/agg-{i}-{t.attempt_id}.arrow", bytes(sizes[i]))
        f = {"handle": info.url, "size": info.size, "checksum": info.checksum}
        meta = {
            "key_groups": [8 * i, 8 * i + 7],
            "group_bytes": {8 * i: f["size"] + sum(c["size"] for c in chains[i])},
            **({"chain": chains[i]} if chains[i] else {}),
        }
        acks.append(TaskAck(t.attempt_id, f["handle"], f["size"], f["checksum"], state_meta=meta))
        new.append(f)
    return acks, new


def _seed(store: Metastore, storage: FileSystemCheckpointStorage, job: str) -> None:
    """A job with a row in every table: a completed incremental checkpoint (tasks, acks, shared
    state), a pending one, a request, a restore."""
    clock = ManualClock()
    coord = new_coordinator(
        store, storage, clock, job_id=job, plan=make_plan(PLAN), retained=2, max_concurrent=3
    )
    coord.activate()
    first = coord.trigger_checkpoint()
    assert coord.receive_acknowledge(first.checkpoint_id, _acks(coord, first, (5, 6))[0]).completed
    pending = coord.trigger_checkpoint()
    acks, _ = _acks(coord, pending, (10, 20))
    coord.receive_acknowledge(pending.checkpoint_id, acks[:1])  # one ack in, still pending
    with store.transaction() as s:
        queue_request(
            s,
            job,
            CheckpointType.SAVEPOINT,
            requested_by="test",
            now=clock.now(),
            from_outside=False,
        )
    record_restore(store, find_latest_valid(store, storage, job), attempt="seed")


def _counts(store: Metastore, job: str) -> dict[str, int]:
    with store.reading() as s:
        return {
            name: s.execute(
                select(func.count()).select_from(model).where(model.job_id == job)
            ).scalar_one()
            for name, model in TABLES.items()
        }


# ============================================================================ set-up


def test_sqlite_has_no_driver_scope(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'm.db'}"
    Metastore(url, check_schema=False).upgrade()
    store = Metastore(url)
    assert not driver_scope_enabled(store)
    with pytest.raises(DriverScopeError, match="needs PostgreSQL"):
        enable_driver_scope(store)
    with pytest.raises(DriverScopeError, match="not enabled"):
        grant_driver(store, JOB, ATTEMPT)
    assert not has_grant(store, JOB, ATTEMPT) and not revoke_driver(store, JOB, ATTEMPT)
    assert expire_driver_roles(store) == []
    store.dispose()


def test_enable_secures_every_table_with_a_job_id_and_is_idempotent(enabled: Scope) -> None:
    store = enabled.owner
    with store.engine.connect() as conn:
        live = {
            r.table_name
            for r in conn.execute(
                text(
                    "SELECT table_name FROM information_schema.columns WHERE column_name = "
                    "'job_id' AND table_schema = current_schema() AND table_name LIKE 'ckpt_%'"
                )
            )
        }
        secured = {
            r.relname
            for r in conn.execute(
                text(
                    "SELECT relname FROM pg_class WHERE relrowsecurity "
                    "AND relnamespace = current_schema()::regnamespace"
                )
            )
        }
    assert set(scoped_tables()) == live - {"ckpt_driver_grants"} == set(TABLES)
    assert secured == set(TABLES)  # the grants table is not the drivers' at all
    assert driver_scope(store) == driver_roles.DriverScope(enabled.group, ())
    assert enable_driver_scope(store, group=enabled.group).enabled  # again: the same
    with store.engine.begin() as conn:  # a table that lost its policy is reported
        conn.execute(text("DROP POLICY ckpt_driver_own_job ON ckpt_restores"))
    assert driver_scope(store).missing == ("ckpt_restores",)
    with pytest.raises(DriverScopeError, match="lacks ckpt_restores"):
        grant_driver(store, JOB, ATTEMPT)
    assert enable_driver_scope(store, group=enabled.group).enabled  # repaired


# ============================================================================ one driver


@pytest.fixture
def driver(enabled: Scope, tmp_path: Path) -> Iterator[tuple[Metastore, Metastore, URL]]:
    """Two seeded jobs, the task's coordinator of JOB activated as ``ATTEMPT`` (as the operator
    does), and a driver metastore on the role granted to ``ATTEMPT`` of JOB."""
    store = enabled.owner
    with store.engine.begin() as conn:
        for table in TABLES:
            conn.execute(text(f"DELETE FROM {table}"))
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'checkpoints'}")
    _seed(store, storage, JOB)
    _seed(store, storage, OTHER)
    CheckpointCoordinator(JOB, store, storage, None, coordinator_id=ATTEMPT).activate()
    url = grant_driver(store, JOB, ATTEMPT)
    mine = Metastore(url)
    try:
        yield store, mine, url
    finally:
        mine.dispose()
        revoke_driver(store, JOB, ATTEMPT)


def test_a_driver_runs_its_own_jobs_checkpoints_with_its_role(
    driver: tuple[Metastore, Metastore, URL], tmp_path: Path
) -> None:
    store, mine, url = driver
    assert url.username != store.url.username and url.password
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'checkpoints'}")
    clock = ManualClock()
    coord = CheckpointCoordinator(
        JOB,
        mine,
        storage,
        None,
        clock=clock,
        coordinator_id=ATTEMPT,
        plan_provider=lambda: make_plan(PLAN),
    )
    coord.join()
    assert coord.job_status_changed(JobStatus.RUNNING)
    with Heartbeat(mine, JOB, ATTEMPT, clock=clock):
        pass
    with store.reading() as s:
        job = s.get(Job, JOB)
        assert job is not None
        assert (job.status, job.heartbeat_at) == (JobStatus.RUNNING, clock.now())

    before = _counts(store, JOB)
    pending = coord.trigger_checkpoint()
    acks, bases = _acks(coord, pending, (100, 200))
    outcome = coord.receive_acknowledge(pending.checkpoint_id, acks)
    assert outcome.completed is not None, outcome
    # incremental on top: the shared files are registered, the older checkpoints subsumed
    chains = ([bases[0]], [bases[1]])
    second = coord.trigger_checkpoint()
    acks, deltas = _acks(coord, second, (10, 20), chains)
    done = coord.receive_acknowledge(second.checkpoint_id, acks).completed
    assert done is not None and done.checkpointed_size == 30
    with store.reading() as s:
        counts = shared_state.reference_counts(s, JOB)
    # the job keeps two checkpoints: the bases are used by both, the deltas by the second
    assert counts == {**{f["handle"]: 2 for f in bases}, **{f["handle"]: 1 for f in deltas}}
    decision = find_latest_valid(mine, storage, JOB)
    assert decision.checkpoint_id == done.checkpoint_id
    restore_id = record_restore(mine, decision, attempt=ATTEMPT)
    with store.reading() as s:
        event = s.get(RestoreEvent, restore_id)
        assert event is not None and (event.job_id, event.attempt) == (JOB, ATTEMPT)
    assert coord.job_status_changed(JobStatus.FINISHED)
    coord.shutdown(JobStatus.FINISHED)
    after = _counts(store, JOB)
    # its two checkpoints, and the savepoint its queued request asked for, triggered after the
    # first completion (the request row changed by the driver too)
    assert after["ckpt_checkpoints"] == before["ckpt_checkpoints"] + 3
    with store.reading() as s:
        request = s.scalars(select(CheckpointRequest).where(CheckpointRequest.job_id == JOB)).one()
        assert request.status != "QUEUED" and request.checkpoint_id is not None
    assert after["ckpt_restores"] == before["ckpt_restores"] + 1
    with store.reading() as s:
        job = s.get(Job, JOB)
        assert job is not None and job.status == JobStatus.FINISHED
        assert s.get(Checkpoint, (JOB, done.checkpoint_id)).status == CheckpointStatus.COMPLETED


def test_a_driver_can_neither_read_nor_change_another_jobs_rows(
    driver: tuple[Metastore, Metastore, URL], enabled: Scope
) -> None:
    store, mine, _ = driver
    theirs = _counts(store, OTHER)
    assert all(theirs.values()), theirs  # the other job has a row in every table
    assert all(_counts(mine, JOB).values())  # its own, all visible to it
    assert not any(_counts(mine, OTHER).values())  # the other job's: none
    with mine.reading() as s:  # not even unfiltered
        assert {r for (r,) in s.execute(select(Job.job_id))} == {JOB}

    now = datetime.now(UTC)
    with mine.transaction() as s:  # every change of another job's rows changes nothing
        for model in TABLES.values():
            # (a job row's job_id is no driver's to write at all: see the next test)
            values = {"status": "FAILED"} if model is Job else {"job_id": OTHER}
            assert (
                s.execute(update(model).where(model.job_id == OTHER).values(**values)).rowcount == 0
            )
        for model in TABLES.values():
            if model is not Job:  # no driver deletes a job row (the next test)
                deleted = s.execute(model.__table__.delete().where(model.job_id == OTHER))
                assert deleted.rowcount == 0
        # nor moves one of its own rows to the other job
        assert (
            s.execute(update(Job).where(Job.job_id == JOB).values(status="CREATED")).rowcount == 1
        )
        with pytest.raises(DBAPIError, match="row-level security"), s.begin_nested():
            s.execute(update(Checkpoint).where(Checkpoint.job_id == JOB).values(job_id=OTHER))
    assert _counts(store, OTHER) == theirs

    # each would be a valid row without driver scope: the other job's pending checkpoint 2
    # (its agg-1 not acked yet), a new plan entry of it, and (Scenario A of issue 38) a PENDING
    # row for another team's job pointing at a whole bucket, and the like
    inserts = {
        "ckpt_checkpoint_acks": insert(CheckpointAck).values(
            job_id=OTHER, checkpoint_id=2, attempt_id="agg-1-a0", acked_at=now
        ),
        "ckpt_checkpoint_tasks": insert(CheckpointTask).values(
            job_id=OTHER,
            checkpoint_id=2,
            attempt_id="extra-0-a0",
            operator_id="extra",
            subtask_index=0,
            parallelism=1,
            max_parallelism=16,
        ),
        "ckpt_checkpoints": insert(Checkpoint).values(
            job_id=OTHER,
            checkpoint_id=99,
            checkpoint_type="CHECKPOINT",
            status="PENDING",
            forced=False,
            discard_on_subsumed=True,
            discard_on_finished=True,
            discard_on_cancelled=True,
            discard_on_failed=True,
            discard_on_suspended=True,
            trigger_at=now,
            deadline_at=now,
            num_tasks=1,
            storage_location="s3://bucket",
        ),
        "ckpt_requests": insert(CheckpointRequest).values(
            job_id=OTHER,
            checkpoint_type="SAVEPOINT",
            priority=3,
            requested_by="x",
            requested_at=now,
            status="QUEUED",
        ),
        "ckpt_restores": insert(RestoreEvent).values(
            job_id=OTHER, attempt="x", status="PLANNED", created_at=now
        ),
        "ckpt_shared_state": insert(SharedStateRef).values(
            job_id=OTHER, checkpoint_id=1, handle="file:///etc", size=1
        ),
        "ckpt_jobs": insert(Job).values(
            job_id="job-c",
            storage_url="file:///",
            timeout_ms=1,
            retention="x",
            created_at=now,
            updated_at=now,
        ),
    }
    assert set(inserts) == set(TABLES)
    for name, statement in inserts.items():
        # no driver inserts a job row at all (the task registers the job)
        refusal = "permission denied" if name == "ckpt_jobs" else "row-level security"
        with pytest.raises(DBAPIError, match=refusal), mine.transaction() as s:
            s.execute(statement)
    assert _counts(store, OTHER) == theirs
    with store.transaction() as s:  # the owner may: the same rows were valid ones
        for name, statement in inserts.items():
            if name != "ckpt_jobs":
                s.execute(statement)
    assert _counts(store, OTHER) == {
        name: count + (name != "ckpt_jobs") for name, count in theirs.items()
    }
    theirs = _counts(store, OTHER)
    with pytest.raises(DBAPIError, match="permission denied"), mine.reading() as s:
        s.execute(text("SELECT * FROM ckpt_driver_grants"))  # nor learns who else is granted
    with pytest.raises(DBAPIError, match="permission denied"), mine.transaction() as s:
        s.execute(text("TRUNCATE ckpt_restores"))

    # the owner and the API server's role still see and write every job's rows
    for other in (store, enabled.api):
        assert _counts(other, OTHER) == theirs
        with other.transaction() as s:
            assert (
                s.execute(update(Job).where(Job.job_id == OTHER).values(status="RUNNING")).rowcount
                == 1
            )
    with enabled.api.reading() as s:
        assert {r for (r,) in s.execute(select(Job.job_id))} == {JOB, OTHER}


def test_a_driver_cannot_move_its_own_jobs_storage(
    driver: tuple[Metastore, Metastore, URL], enabled: Scope, tmp_path: Path
) -> None:
    """Issue 38 (M1): the API server and gc read and delete under a job row's ``storage_url``,
    so a driver may not change it (nor ``job_id``, ``created_at``) on its own row, nor delete
    and re-insert that row with another one; the columns it keeps up to date stay writable.
    A scope enabled before (UPDATE on the whole table) is reported and repaired."""
    store, mine, _ = driver
    with store.reading() as s:
        job = s.get(Job, JOB)
        assert job is not None
        registered, created = job.storage_url, job.created_at
    now = datetime.now(UTC)
    for values in (
        {"storage_url": "file:///opt/airflow"},
        {"job_id": "job-c"},
        {"created_at": now},
        {"storage_url": "file:///opt/airflow", "status": "RUNNING"},
    ):
        with pytest.raises(DBAPIError, match="permission denied"), mine.transaction() as s:
            s.execute(update(Job).where(Job.job_id == JOB).values(**values))
    with pytest.raises(DBAPIError, match="permission denied"), mine.transaction() as s:
        s.execute(Job.__table__.delete().where(Job.job_id == JOB))
    with pytest.raises(DBAPIError, match="permission denied"), mine.transaction() as s:
        s.execute(
            insert(Job).values(
                job_id=JOB,
                storage_url="file:///opt/airflow",
                timeout_ms=1,
                retention="x",
                created_at=now,
                updated_at=now,
            )
        )
    with mine.transaction() as s:  # what it keeps up to date, in its own row
        assert (
            s.execute(
                update(Job)
                .where(Job.job_id == JOB)
                .values(status="RUNNING", heartbeat_at=now, updated_at=now, retained=3)
            ).rowcount
            == 1
        )
    with store.reading() as s:
        job = s.get(Job, JOB)
        assert job is not None
        assert (job.storage_url, job.created_at, job.status) == (registered, created, "RUNNING")

    # enabled by an older version: UPDATE on every column; reported, and repaired by enable
    with store.engine.begin() as conn:
        conn.execute(text(f'GRANT UPDATE ON ckpt_jobs TO "{enabled.group}"'))
    assert driver_scope(store).missing == ("ckpt_jobs's column privileges",)
    with pytest.raises(DriverScopeError, match="lacks ckpt_jobs's column privileges"):
        grant_driver(store, JOB, "another-attempt")
    assert enable_driver_scope(store, group=enabled.group).enabled
    with pytest.raises(DBAPIError, match="permission denied"), mine.transaction() as s:
        s.execute(update(Job).where(Job.job_id == JOB).values(storage_url="file:///opt"))

    # the driver's runtime registers the job's configuration and storage again, as the task
    # did before it: unchanged, so it writes no fixed column; another storage is refused
    config = CheckpointConfig.parse({"retained": 3, "max_concurrent": 3})
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'checkpoints'}")
    CheckpointCoordinator(JOB, mine, storage, config, coordinator_id=ATTEMPT)
    elsewhere = FileSystemCheckpointStorage(f"file://{tmp_path / 'elsewhere'}")
    with pytest.raises(DBAPIError, match="permission denied"):
        CheckpointCoordinator(JOB, mine, elsewhere, config, coordinator_id=ATTEMPT)
    with store.reading() as s:
        assert s.get(Job, JOB).storage_url == registered  # type: ignore[union-attr]


def _login(url: URL) -> None:
    psycopg.connect(
        host=url.host,
        port=url.port,
        dbname=url.database,
        user=url.username,
        password=url.password,
        connect_timeout=5,
    ).close()


def test_a_revoked_or_expired_role_cannot_log_in(enabled: Scope) -> None:
    store = enabled.owner
    with store.engine.begin() as conn:
        for table in TABLES:
            conn.execute(text(f"DELETE FROM {table}"))
    now = datetime.now(UTC)
    url = grant_driver(store, JOB, ATTEMPT, timedelta(hours=1), now=now)
    _login(url)  # granted: it may
    assert has_grant(store, JOB, ATTEMPT) and not has_grant(store, OTHER, ATTEMPT)
    with store.engine.connect() as conn:
        until = conn.execute(
            text("SELECT rolvaliduntil FROM pg_roles WHERE rolname = :r"), {"r": url.username}
        ).scalar_one()
    assert abs(until - (now + timedelta(hours=1))) < timedelta(seconds=1)
    assert revoke_driver(store, JOB, ATTEMPT)
    with pytest.raises(psycopg.OperationalError, match="does not exist"):
        _login(url)
    assert not revoke_driver(store, JOB, ATTEMPT)  # nothing left
    assert not has_grant(store, JOB, ATTEMPT)

    # an expired role: its open session sees no row from then on; gc drops it
    _seed_job(store)
    short = grant_driver(store, JOB, "manual__x-t2", timedelta(hours=1))
    kept = grant_driver(store, JOB, "manual__x-t3", timedelta(hours=1))
    held = Metastore(short)
    with held.reading() as s:
        assert s.execute(select(func.count()).select_from(Job)).scalar_one() == 1
    with store.transaction() as s:  # its hour is over (the server's clock decides, not ours)
        s.execute(
            update(DriverGrant)
            .where(DriverGrant.role_name == short.username)
            .values(expires_at=datetime.now(UTC) - timedelta(minutes=1))
        )
    with held.reading() as s:  # the same pooled connection, a new transaction
        assert s.execute(select(func.count()).select_from(Job)).scalar_one() == 0
    held.dispose()
    assert expire_driver_roles(store) == [short.username]
    with pytest.raises(psycopg.OperationalError, match="does not exist"):
        _login(short)
    _login(kept)  # another attempt's role is untouched
    assert revoke_driver(store, JOB, "manual__x-t3")


def _seed_job(store: Metastore) -> None:
    now = datetime.now(UTC)
    with store.transaction() as s:
        s.execute(
            insert(Job).values(
                job_id=JOB,
                storage_url="file:///tmp/x",
                timeout_ms=1000,
                retention="never_retain",
                created_at=now,
                updated_at=now,
            )
        )


# ============================================================================ the operator

#: a stand-in ``spark-submit``: the "driver" connects with the metastore URL it was given and
#: records who it is, which jobs it sees, and whether it inherited the task's connection
FAKE_SPARK_SUBMIT = """#!{python}
import json, os
from sqlalchemy import create_engine, text
engine = create_engine(os.environ["CKPT_METASTORE_URL"])
with engine.connect() as conn:
    jobs = sorted(r[0] for r in conn.execute(text("SELECT job_id FROM ckpt_jobs")))
    pg = engine.url.drivername.startswith("postgresql")
    user = conn.execute(text("SELECT current_user")).scalar() if pg else None
url = os.environ["CKPT_METASTORE_URL"]
conn = os.environ.get("AIRFLOW_CONN_CHECKPOINT_METASTORE")  # the task's, if it inherited it
with open(os.environ["FAKE_SPARK_SUBMIT_OUT"], "w") as f:
    json.dump({{"jobs": jobs, "user": user, "url": url, "conn": conn}}, f)
"""


def _run_operator_try(
    store: Metastore, task_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    """One non-deferrable try of the operator (its plan and stats tracker stubbed) whose
    spark-submit is the stand-in: what the "driver" got and saw."""
    import json
    import sys
    from types import SimpleNamespace

    import yaml

    from checkpointing_airflow.attempts import attempt_id
    from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "spark-submit"
    fake.write_text(FAKE_SPARK_SUBMIT.format(python=sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "submitted.json"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SPARK_SUBMIT_OUT", str(out))
    # the task's metastore connection, in the worker's environment
    connection = json.dumps({"conn_type": "generic", "extra": {"sqlalchemy_url": task_url}})
    monkeypatch.setenv("AIRFLOW_CONN_CHECKPOINT_METASTORE", connection)
    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_SCOPE",
        json.dumps({"conn_type": "spark", "host": "yarn", "extra": {"deploy-mode": "client"}}),
    )
    spec = tmp_path / f"{JOB}.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "job": JOB,
                "source": {"format": "parquet", "path": "data/*.parquet"},
                "key": ["origin"],
                "aggregations": {"flights": "count()"},
                "sink": {"path": f"out/{JOB}"},
                "max_parallelism": 16,
            }
        )
    )
    op = CheckpointedSparkSubmitOperator(
        task_id="run",
        pipeline=str(spec),
        conn_id="spark_scope",
        aws_conn_id=None,
        env_vars={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},  # the stand-in first
    )
    monkeypatch.setattr(op, "plan_try", lambda *args: ("latest", 1))
    monkeypatch.setattr(op, "stats_tracker", lambda *args, **kwargs: None)
    ti = SimpleNamespace(dag_id="scope", run_id="manual__2026-11-28", try_number=1)
    attempt = attempt_id(ti.dag_id, ti.run_id, ti.try_number)
    storage_url = f"file://{tmp_path / 'checkpoints'}"
    op._coordinate({"ti": ti}, op.load_spec(), store, task_url, storage_url, attempt)
    assert os.environ["AIRFLOW_CONN_CHECKPOINT_METASTORE"] == connection  # the task's, back
    return {**json.loads(out.read_text()), "attempt": attempt, "connection": connection}


def test_the_operators_driver_gets_its_own_role_only_when_scope_is_enabled(
    enabled: Scope, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("airflow", reason="Apache Airflow is not installed")
    store = enabled.owner
    with store.engine.begin() as conn:
        for table in TABLES:
            conn.execute(text(f"DELETE FROM {table}"))
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'other'}")
    _seed(store, storage, OTHER)
    task_url = store.url.render_as_string(hide_password=False)

    got = _run_operator_try(store, task_url, tmp_path, monkeypatch)
    with store.engine.connect() as conn:
        database = conn.execute(text("SELECT current_database()")).scalar_one()
        role = driver_roles.driver_role_name(database, JOB, got["attempt"])
        assert (
            conn.execute(text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role}).first()
            is None
        )
        assert conn.execute(text("SELECT count(*) FROM ckpt_driver_grants")).scalar_one() == 0
    assert got["user"] == role  # its own role: dropped once spark-submit ended (above)
    assert got["url"] != task_url and f"{role}:" in got["url"]
    assert got["jobs"] == [JOB]  # the operator registered JOB; OTHER is there, not for it
    assert got["conn"] is None  # nor does it inherit the task's connection from the worker

    # SQLite (never scoped): the task's own URL, and every job
    sqlite_url = f"sqlite:///{tmp_path / 'm.db'}"
    Metastore(sqlite_url, check_schema=False).upgrade()
    lite = Metastore(sqlite_url)
    _seed(lite, FileSystemCheckpointStorage(f"file://{tmp_path / 'other-lite'}"), OTHER)
    (tmp_path / "submitted.json").unlink()
    got = _run_operator_try(lite, sqlite_url, tmp_path, monkeypatch)
    lite.dispose()
    assert (got["url"], got["user"], got["jobs"]) == (sqlite_url, None, [JOB, OTHER])
    assert got["conn"] == got["connection"]  # inherited, as before


# ============================================================================ the CLI


def test_ckpt_db_driver_scope_says_what_a_driver_reaches(
    enabled: Scope, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from checkpointing.cli import app

    runner = CliRunner()
    pg_url = enabled.owner.url.render_as_string(hide_password=False)
    monkeypatch.setenv("CKPT_METASTORE_URL", pg_url)
    url = grant_driver(enabled.owner, JOB, "manual__cli-t1", timedelta(hours=1))
    try:
        status = runner.invoke(app, ["db", "driver-scope", "status"])
        assert status.exit_code == 0, status.output
        assert f"driver scope is on (group {enabled.group})" in status.output
        assert "only its own job's rows" in status.output
        assert f"{url.username}  job {JOB}  attempt manual__cli-t1" in status.output
        again = runner.invoke(app, ["db", "driver-scope", "enable", "--group", enabled.group])
        assert again.exit_code == 0 and "driver scope enabled" in again.output, again.output
        expired = runner.invoke(app, ["db", "driver-scope", "expire"])
        assert expired.exit_code == 0 and "dropped 0 expired" in expired.output, expired.output
    finally:
        assert revoke_driver(enabled.owner, JOB, "manual__cli-t1")

    lite = f"sqlite:///{tmp_path / 'm.db'}"
    Metastore(lite, check_schema=False).upgrade()
    monkeypatch.setenv("CKPT_METASTORE_URL", lite)
    off = runner.invoke(app, ["db", "driver-scope", "status"])
    assert off.exit_code == 0 and "driver scope is off" in off.output, off.output
    assert "every job's rows" in off.output
    refused = runner.invoke(app, ["db", "driver-scope", "enable"])
    assert refused.exit_code != 0 and "needs PostgreSQL" in refused.output, refused.output


# ============================================================================ the migration


def test_the_downgrade_leaves_the_drivers_group_no_privilege(tmp_path: Path) -> None:
    """Revision 0008's downgrade removes the row security: the drivers' group must lose its
    privileges with it, or a driver role left over would reach every job's rows."""
    from alembic import command

    from checkpointing.metastore.engine import _alembic_config

    group = f"ckpt_t_drivers_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    roles: list[str] = []
    with fresh_pg_database("ckpt_driver_downgrade") as url:
        Metastore(url, check_schema=False).upgrade()
        store = Metastore(url)
        try:
            enable_driver_scope(store, group=group)
            _seed_job(store)
            driver = grant_driver(store, JOB, ATTEMPT)
            roles.append(str(driver.username))
            with store.engine.begin() as conn:
                command.downgrade(_alembic_config(conn), "0007")
            with store.engine.connect() as conn:
                assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == (
                    "0007"
                )
                for table in TABLES:
                    privileges = conn.execute(
                        text(
                            "SELECT has_table_privilege(:g, :t, 'SELECT, INSERT, UPDATE, DELETE'),"
                            " relrowsecurity FROM pg_class WHERE relname = :t"
                        ),
                        {"g": group, "t": table},
                    ).one()
                    assert tuple(privileges) == (False, False), table
            leftover = Metastore(driver, check_schema=False)
            with pytest.raises(DBAPIError, match="permission denied"), leftover.reading() as s:
                s.execute(select(Job.job_id))
            leftover.dispose()
        finally:
            store.dispose()
            admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:
                conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = :d AND pid <> pg_backend_pid()"
                    ),
                    {"d": url.database},
                )
            admin.dispose()
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        for role in [*roles, group]:
            conn.execute(text(f'DROP ROLE IF EXISTS "{role}"'))
    admin.dispose()
