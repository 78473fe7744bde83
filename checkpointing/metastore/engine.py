"""Connection to the SQL metastore: SQLite (embedded default) or PostgreSQL.

SQLite runs in WAL mode with a busy timeout, and every transaction starts with
``BEGIN IMMEDIATE``: writers queue for the lock up front instead of failing with
"database is locked" when a reader tries to upgrade. A read-only transaction
(:meth:`Metastore.reading`: watchers polling every second) starts with a plain ``BEGIN``: in WAL
mode it reads a snapshot without taking the write lock, so it never queues behind the driver's
acks nor holds them up. PostgreSQL uses psycopg 3.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from checkpointing.config import normalize_url, safe_url
from checkpointing.errors import MetastoreUnavailable, SchemaOutdated

log = logging.getLogger(__name__)

MIGRATIONS = Path(__file__).with_name("migrations")
#: The Alembic head this code needs; a test checks it against the migrations directory. Kept as a
#: constant so that everyday commands check the schema without importing Alembic.
SCHEMA_REVISION = "0008"
SQLITE_BUSY_TIMEOUT_S = 60


class Metastore:
    """An engine plus transaction helpers and schema checks."""

    def __init__(
        self,
        url: str | URL,
        *,
        check_schema: bool = True,
        create: bool | None = None,
        **engine_kwargs: Any,
    ) -> None:
        """``create``: may an embedded (SQLite) metastore's file and directories be created
        (default: only when the schema is not checked, i.e. to create or migrate it). A read
        against a SQLite file that does not exist creates nothing: the schema check says so."""
        self.url = normalize_url(url)
        self.create = not check_schema if create is None else create
        self.engine = _create_engine(self.url, create=self.create, **engine_kwargs)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        if check_schema:
            self.check_schema()

    @property
    def display_url(self) -> str:
        """The URL with any password masked: safe for logs and messages."""
        return safe_url(self.url)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """One transaction: commit on success, roll back on error."""
        with self._unavailable_is_clear(), self._sessions.begin() as session:
            yield session

    @contextmanager
    def reading(self) -> Iterator[Session]:
        """One read-only transaction (rolled back at the end). On SQLite it takes no write lock;
        a write in it may fail with "database is locked" rather than wait: use
        :meth:`transaction` for anything that writes."""
        with self._unavailable_is_clear(), self.engine.connect() as conn:
            conn = conn.execution_options(ckpt_read_only=True)
            with Session(bind=conn, expire_on_commit=False) as s:
                s.begin()
                yield s  # closing the session rolls the transaction back

    @contextmanager
    def session(self, *, autocommit: bool = False) -> Iterator[Session]:
        """A session on one pooled connection, for several short transactions in a row
        (``with session.begin(): …``): one checkout and one liveness check instead of one each.

        ``autocommit`` (PostgreSQL only; ignored on SQLite, whose writers need ``BEGIN
        IMMEDIATE``): each statement is its own transaction, saving the BEGIN and COMMIT round
        trips — only for callers whose every transaction is a single statement."""
        with self._unavailable_is_clear(), self.engine.connect() as conn:
            if autocommit and self.dialect == "postgresql":
                conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            with Session(bind=conn, expire_on_commit=False) as s:
                yield s

    @contextmanager
    def _unavailable_is_clear(self) -> Iterator[None]:
        """A lost or refused connection becomes :class:`MetastoreUnavailable` (URL masked)."""
        try:
            yield
        except OperationalError as exc:
            if _is_connection_error(exc):
                raise MetastoreUnavailable(
                    f"cannot reach the metastore at {self.display_url}: {_first_line(exc)}"
                ) from exc
            raise

    def dispose(self) -> None:
        self.engine.dispose()

    # ---------------------------------------------------------------- schema

    @property
    def missing(self) -> bool:
        """An embedded (SQLite) metastore whose file does not exist (yet)."""
        db = self.url.database
        return (
            self.url.get_backend_name() == "sqlite"
            and bool(db)
            and db != ":memory:"
            and not self.url.query.get("uri")
            and not Path(db).exists()
        )

    def current_revision(self) -> str | None:
        if self.missing and not self.create:  # connecting would create the file
            return None
        try:
            with self.engine.connect() as conn:
                if not inspect(conn).has_table("alembic_version"):
                    return None
                return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        except (OperationalError, DBAPIError) as exc:
            raise MetastoreUnavailable(
                f"cannot reach the metastore at {self.display_url}: {_first_line(exc)}"
            ) from exc

    @staticmethod
    def head_revision() -> str:
        return SCHEMA_REVISION

    def check_schema(self) -> None:
        """Refuse to work against a missing or older schema (``ckpt db upgrade`` fixes it)."""
        current, head = self.current_revision(), self.head_revision()
        if current != head:
            if self.missing and not self.create:
                raise SchemaOutdated(
                    f"there is no metastore at {self.display_url} (is CKPT_HOME or the metastore "
                    "URL mistyped?): run `ckpt db upgrade` to create one"
                )
            state = (
                "has no checkpointing schema" if current is None else f"is at revision {current}"
            )
            raise SchemaOutdated(
                f"the metastore at {self.display_url} {state}, this version needs {head}: "
                "run `ckpt db upgrade`"
            )

    def ensure_schema(self) -> None:
        """Create or migrate an embedded metastore's schema unless it is current already: a
        step job or script starting checks one row instead of importing and running Alembic
        (half a second, every run)."""
        if self.missing or self.current_revision() != self.head_revision():
            self.upgrade()

    def upgrade(self, revision: str = "head") -> tuple[str | None, str]:
        """Create or migrate the schema; returns (before, after) revisions."""
        if self.missing:  # creating it is what an upgrade is for
            Path(str(self.url.database)).parent.mkdir(parents=True, exist_ok=True)
        self.create = True
        before = self.current_revision()
        with _quiet_alembic(), self.engine.begin() as conn:
            from alembic import command  # its import logs too (plugin set-up)

            command.upgrade(_alembic_config(conn), revision)
        return before, self.current_revision() or ""


@contextmanager
def _quiet_alembic() -> Iterator[None]:
    """Alembic's INFO lines (``Context impl``, ``Running upgrade …``) kept out of callers' logs
    (an Airflow task's, a Spark driver's): its warnings and errors still show, and a failed
    migration raises. ``ckpt db upgrade`` reports the revisions itself."""
    logger = logging.getLogger("alembic")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def _alembic_config(connection: Any) -> Any:
    from alembic.config import Config as AlembicConfig

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = connection
    return cfg


def _create_engine(url: URL, *, create: bool = True, **kwargs: Any) -> Engine:
    if url.get_backend_name() == "sqlite":
        if create and url.database and url.database != ":memory:":
            Path(url.database).parent.mkdir(parents=True, exist_ok=True)
        connect_args = {"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False}
        engine = create_engine(url, connect_args=connect_args, **kwargs)
        _configure_sqlite(engine)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("connect_args", {"connect_timeout": 10})
    return create_engine(url, **kwargs)


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_S * 1000}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        read_only = conn.get_execution_options().get("ckpt_read_only", False)
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")


def _is_connection_error(exc: DBAPIError) -> bool:
    return bool(exc.connection_invalidated) or "connect" in str(exc.orig).lower()


def _first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    return str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__


def reference_ddl(dialect_name: str) -> str:
    """The schema as plain DDL for ``dialect_name`` (what ``sql/<dialect>.sql`` holds), compiled
    from the models; a test keeps it, the models and the migrations in step."""
    from sqlalchemy.dialects import postgresql, sqlite
    from sqlalchemy.schema import CreateIndex, CreateTable

    from checkpointing.metastore.models import Base

    dialect = {"postgresql": postgresql.dialect(), "sqlite": sqlite.dialect()}[dialect_name]
    head = Metastore.head_revision()
    parts = [
        f"-- Reference DDL of the checkpoint metastore for {dialect_name}, revision {head}.\n"
        "-- Generated from checkpointing/metastore/models.py by `make ddl`; `ckpt db upgrade`\n"
        "-- (Alembic) is the supported way to create or migrate a metastore. A test fails when\n"
        "-- they drift.\n"
    ]
    for table in Base.metadata.sorted_tables:
        parts.append(str(CreateTable(table).compile(dialect=dialect)).strip() + ";\n")
        for index in sorted(table.indexes, key=lambda i: i.name or ""):
            parts.append(str(CreateIndex(index).compile(dialect=dialect)).strip() + ";\n")
    parts.append(
        "CREATE TABLE alembic_version (\n\tversion_num VARCHAR(32) NOT NULL,\n"
        "\tCONSTRAINT alembic_version_pkc PRIMARY KEY (version_num)\n);\n"
        f"INSERT INTO alembic_version (version_num) VALUES ('{head}');\n"
    )
    text = "\n".join(parts)
    return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"
