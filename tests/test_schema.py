"""The reference DDL in sql/, the Alembic migrations and the models must describe one schema."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, text

from checkpointing.errors import SchemaOutdated
from checkpointing.metastore.engine import Metastore, reference_ddl
from checkpointing.metastore.models import Base

SQL = Path(__file__).resolve().parent.parent / "sql"


def _diff(url: str, schema: str | None = None) -> list[object]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            if schema:
                conn.execute(text(f'SET search_path TO "{schema}"'))
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(ctx, Base.metadata))
    finally:
        engine.dispose()


@pytest.mark.parametrize("dialect", ["postgresql", "sqlite"])
def test_reference_ddl_matches_models(dialect: str) -> None:
    committed = (SQL / f"{dialect}.sql").read_text()
    assert committed == reference_ddl(dialect), f"sql/{dialect}.sql is stale: run `make ddl`"


def test_schema_revision_constant_is_the_alembic_head() -> None:
    from alembic.script import ScriptDirectory

    from checkpointing.metastore.engine import _alembic_config

    assert ScriptDirectory.from_config(_alembic_config(None)).get_current_head() == (
        Metastore.head_revision()
    )


def test_migrations_match_models(metastore_url: str) -> None:
    """After `ckpt db upgrade` the live schema equals the models (no autogenerate diff)."""
    assert _diff(Metastore(metastore_url).url.render_as_string(hide_password=False)) == []


def test_reference_ddl_creates_the_migrated_schema_sqlite(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ddl.db'}"
    engine = create_engine(url)
    with engine.connect() as conn:
        conn.connection.driver_connection.executescript((SQL / "sqlite.sql").read_text())  # type: ignore[union-attr]
    engine.dispose()
    assert _diff(url) == []
    Metastore(url).check_schema()  # the DDL's alembic_version stamp is the head revision


def test_reference_ddl_creates_the_migrated_schema_postgresql(pg_url: str) -> None:
    schema = f"ddl_{uuid.uuid4().hex[:8]}"
    engine = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
            conn.execute(text(f'SET search_path TO "{schema}"'))
            conn.exec_driver_sql((SQL / "postgresql.sql").read_text())
        assert _diff(pg_url, schema) == []
    finally:
        with engine.connect() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        engine.dispose()


def test_unmigrated_and_older_schemas_are_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'm.db'}"
    with pytest.raises(SchemaOutdated, match="run `ckpt db upgrade`"):
        Metastore(url)
    store = Metastore(url, check_schema=False)
    assert store.upgrade() == (None, Metastore.head_revision())
    Metastore(url).check_schema()
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '0000'"))
    with pytest.raises(SchemaOutdated, match=r"is at revision 0000.*run `ckpt db upgrade`"):
        Metastore(url)


def test_upgrade_from_0001_keeps_the_data(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    store = Metastore(url, check_schema=False)
    store.upgrade("0001")
    with store.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO ckpt_jobs (job_id, status, storage_url, timeout_ms, min_pause_ms,"
                " max_concurrent, tolerable_failures, retained, retention,"
                " prefer_checkpoint_for_recovery, next_checkpoint_id, periodic_scheduling,"
                " consecutive_failures, created_at, updated_at) VALUES ('old-job', 'RUNNING',"
                " 'file:///tmp/x', 600000, 0, 1, 0, 1, 'retain_on_failure', 0, 7, 0, 0,"
                " '2026-01-01 00:00:00', '2026-01-01 00:00:00')"
            )
        )
    with pytest.raises(SchemaOutdated, match="is at revision 0001"):
        Metastore(url)
    assert store.upgrade() == ("0001", Metastore.head_revision())
    from checkpointing.metastore.views import list_jobs

    [job] = list_jobs(Metastore(url))
    assert (job["job_id"], job["status"]) == ("old-job", "RUNNING")
    assert _diff(url) == []


def test_a_reader_on_sqlite_takes_no_write_lock(tmp_path: Path, metastore_url: str) -> None:
    """``Metastore.reading()`` (the watchers' polls): on SQLite a plain BEGIN, so a reader
    neither waits for a writer holding the lock nor makes one wait; it sees the last commit.
    ``transaction()`` still takes the write lock up front (a second writer waits its turn)."""
    import threading
    import time
    from datetime import UTC, datetime

    from checkpointing.metastore import jobs
    from checkpointing.metastore.models import Job

    store = Metastore(metastore_url)
    with store.transaction() as s:
        now = datetime.now(UTC)
        s.add(
            Job(
                job_id="reader-job",
                storage_url="file:///x",
                timeout_ms=1,
                retention="x",
                created_at=now,
                updated_at=now,
            )
        )
        s.flush()
        jobs.update_job(s, "reader-job", coordinator_id="c1")
    holding, release = threading.Event(), threading.Event()

    def writer() -> None:
        with store.transaction() as s:
            jobs.update_job(s, "reader-job", coordinator_id="c2")
            holding.set()
            release.wait(10)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert holding.wait(10)
        started = time.monotonic()
        with store.reading() as s:
            job = s.get(Job, "reader-job")
            assert job is not None and job.coordinator_id == "c1"  # the last commit
        assert time.monotonic() - started < 2  # did not queue behind the writer
    finally:
        release.set()
        thread.join()
    with store.reading() as s:
        assert s.get(Job, "reader-job").coordinator_id == "c2"
    store.dispose()
