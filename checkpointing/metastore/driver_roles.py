"""Driver scope on PostgreSQL: each Spark driver logs in with its own role, which can read and
write only its own job's rows.

Without it every driver gets the metastore URL the Airflow task uses, so any pipeline's code
can write any job's rows, and the coordinator, the triggerer, the API server and gc act on
them. With it (issue 38):

* :func:`enable_driver_scope`, run once by the role that owns the tables (with CREATEROLE):
  a NOLOGIN group role (``ckpt_driver``), the SQL function ``ckpt_driver_job()`` (``SECURITY
  DEFINER``: the job granted to the connected role, read from ``ckpt_driver_grants``, which the
  drivers themselves cannot read), row-level security on every table with a ``job_id``: a
  permissive policy that keeps every role seeing and writing all rows as before, and a
  restrictive one for the group's members that narrows reads and writes to that job; the
  privileges a driver needs (no TRUNCATE, which bypasses row security), and on the job table
  only reads and updates of the columns it keeps up to date: never ``storage_url`` (where the
  API server and gc read and delete), and no insert or delete of a job row;
* :func:`grant_driver`, per try: a LOGIN role for one job and attempt, member of the group, with
  a random password (sent to the server only as a SCRAM verifier, so never in its logs) and
  ``VALID UNTIL``; the URL the driver gets;
* :func:`revoke_driver` once the driver is gone, :func:`expire_driver_roles` for the roles of
  tries that never got that far (a killed worker).

A role past its expiry sees no row even over a connection it still holds (the function checks
the time), and cannot log in with a password. The core imports neither Airflow nor Spark.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, delete, insert, select, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError

from checkpointing.errors import CheckpointingError
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Base, DriverGrant, Job

#: the NOLOGIN group role every driver role is a member of (cluster-wide, like every role)
DRIVER_GROUP = "ckpt_driver"
#: prefix of the per-attempt login roles
ROLE_PREFIX = "ckpt_drv_"
FUNCTION = "ckpt_driver_job"
#: the permissive policy (every role, every row: as without row security)
ALL_ROWS = "ckpt_all_rows"
#: the restrictive policy of the group's members (their own job's rows only)
OWN_JOB = "ckpt_driver_own_job"
DEFAULT_TTL = timedelta(hours=24)
#: what a driver may do on its job's tables (never TRUNCATE: it ignores row security)
TABLE_PRIVILEGES = "SELECT, INSERT, UPDATE, DELETE"
#: the job row's columns no driver may change: which job it is, and where its checkpoints live
#: (the API server and gc read and delete there); a driver neither inserts nor deletes a job
#: row either (the task registers the job before the driver starts), so it cannot re-create
#: its own row with another ``storage_url``
JOB_FIXED_COLUMNS = frozenset({"job_id", "storage_url", "created_at"})


class DriverScopeError(CheckpointingError):
    """Driver scope cannot be set up or used here (not PostgreSQL, incomplete, no privilege)."""


@dataclass(frozen=True)
class DriverScope:
    """What :func:`enable_driver_scope` set up in this metastore."""

    #: the group role the policies name; None: never enabled
    group: str | None
    #: tables (or the function) lacking their part: enabled once, then a new table came
    missing: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return self.group is not None and not self.missing


def scoped_tables() -> list[str]:
    """Every table with a ``job_id`` (from the models), except the grants themselves."""
    return [
        t.name
        for t in Base.metadata.sorted_tables
        if "job_id" in t.c and t.name != DriverGrant.__tablename__
    ]


def driver_role_name(database: str, job_id: str, attempt: str) -> str:
    """A valid identifier (lower case, 41 chars) for one attempt of one job in one database:
    roles are cluster-wide, so the database takes part."""
    digest = hashlib.sha256(f"{database}\0{job_id}\0{attempt}".encode()).hexdigest()[:32]
    return ROLE_PREFIX + digest


def driver_scope(metastore: Metastore) -> DriverScope:
    """What is set up; ``group`` None on SQLite or when never enabled."""
    if metastore.dialect != "postgresql":
        return DriverScope(None)
    tables = scoped_tables()
    with metastore.engine.connect() as conn:
        policies: dict[tuple[str, str], list[str]] = {
            (r.tablename, r.policyname): list(r.roles)
            for r in conn.execute(
                text(
                    "SELECT tablename, policyname, roles FROM pg_policies "
                    "WHERE schemaname = current_schema() AND policyname IN (:a, :o)"
                ),
                {"a": ALL_ROWS, "o": OWN_JOB},
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
        function = conn.execute(
            text("SELECT to_regprocedure(quote_ident(current_schema()) || :f)"),
            {"f": f".{FUNCTION}()"},
        ).scalar()
    # enabled once a table names the group (a scope missing a part is reported, not ignored:
    # the operator then refuses rather than hand a driver the task's own URL)
    groups = [policies[(t, OWN_JOB)] for t in tables if policies.get((t, OWN_JOB))]
    if not groups:
        return DriverScope(None)
    group = groups[0][0]
    missing = [
        t
        for t in tables
        if t not in secured
        or (t, ALL_ROWS) not in policies
        or policies.get((t, OWN_JOB)) != [group]
    ]
    if function is None:
        missing.append(f"{FUNCTION}()")
    if _job_row_open(metastore, group):  # enabled by an older version, or widened by hand
        missing.append(f"{Job.__tablename__}'s column privileges")
    return DriverScope(group, tuple(missing))


def _job_row_open(metastore: Metastore, group: str) -> bool:
    """Whether ``group`` may insert or delete job rows, or change one of
    :data:`JOB_FIXED_COLUMNS`."""
    checks = " OR ".join(
        [
            "has_table_privilege(:g, :t, 'INSERT')",
            "has_table_privilege(:g, :t, 'DELETE')",
            *(f"has_column_privilege(:g, :t, '{c}', 'UPDATE')" for c in sorted(JOB_FIXED_COLUMNS)),
        ]
    )
    with metastore.engine.connect() as conn:
        table = f"{_schema(conn)}.{Job.__tablename__}"
        return bool(conn.execute(text(f"SELECT {checks}"), {"g": group, "t": table}).scalar())


def driver_scope_enabled(metastore: Metastore) -> bool:
    """PostgreSQL with the whole set-up of :func:`enable_driver_scope` present."""
    return driver_scope(metastore).enabled


def enable_driver_scope(
    metastore: Metastore, *, group: str = DRIVER_GROUP, manager: str | None = None
) -> DriverScope:
    """Set up (or repair, after a migration added a table) driver scope; idempotent, one
    transaction. Run by the tables' owner with CREATEROLE. ``manager``: another role that
    grants the drivers' roles (the Airflow tasks' metastore role, when not the owner), given
    the group WITH ADMIN OPTION."""
    if metastore.dialect != "postgresql":
        raise DriverScopeError(
            f"driver scope needs PostgreSQL (row-level security and roles); the metastore at "
            f"{metastore.display_url} is {metastore.dialect}: every driver can write every job"
        )
    q = _quoter(metastore)
    with metastore.engine.begin() as conn:
        schema = q(conn.execute(text("SELECT current_schema()")).scalar_one())
        role = conn.execute(
            text("SELECT rolcanlogin FROM pg_roles WHERE rolname = :r"), {"r": group}
        ).first()
        if role is None:
            conn.execute(text(f"CREATE ROLE {q(group)} NOLOGIN"))
        elif role.rolcanlogin:
            raise DriverScopeError(f"role {group!r} can log in: it cannot be the drivers' group")
        if manager:
            conn.execute(text(f"GRANT {q(group)} TO {q(manager)} WITH ADMIN OPTION"))
        grants = f"{schema}.{DriverGrant.__tablename__}"
        conn.execute(
            text(
                f"CREATE OR REPLACE FUNCTION {schema}.{FUNCTION}() RETURNS varchar "
                "LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS "
                f"$$ SELECT g.job_id FROM {grants} AS g "
                "WHERE g.role_name = session_user::text AND g.expires_at > now() $$"
            )
        )
        conn.execute(text(f"REVOKE ALL ON FUNCTION {schema}.{FUNCTION}() FROM PUBLIC"))
        conn.execute(text(f"GRANT EXECUTE ON FUNCTION {schema}.{FUNCTION}() TO {q(group)}"))
        conn.execute(text(f"GRANT USAGE ON SCHEMA {schema} TO {q(group)}"))
        conn.execute(text(f"REVOKE ALL ON {grants} FROM {q(group)}"))
        conn.execute(text(f"GRANT SELECT ON {schema}.alembic_version TO {q(group)}"))
        own = f"job_id = (SELECT {schema}.{FUNCTION}())"
        for table in scoped_tables():
            name = f"{schema}.{q(table)}"
            conn.execute(text(f"ALTER TABLE {name} ENABLE ROW LEVEL SECURITY"))
            conn.execute(text(f"DROP POLICY IF EXISTS {ALL_ROWS} ON {name}"))
            conn.execute(text(f"DROP POLICY IF EXISTS {OWN_JOB} ON {name}"))
            conn.execute(
                text(
                    f"CREATE POLICY {ALL_ROWS} ON {name} AS PERMISSIVE FOR ALL TO PUBLIC "
                    "USING (true) WITH CHECK (true)"
                )
            )
            conn.execute(
                text(
                    f"CREATE POLICY {OWN_JOB} ON {name} AS RESTRICTIVE FOR ALL TO {q(group)} "
                    f"USING ({own}) WITH CHECK ({own})"
                )
            )
            conn.execute(text(f"REVOKE ALL ON {name} FROM {q(group)}"))  # columns' too
            conn.execute(text(f"GRANT {_privileges(table, q)} ON {name} TO {q(group)}"))
            for (sequence,) in conn.execute(
                text(
                    "SELECT pg_get_serial_sequence(:t, a.attname) FROM pg_attribute AS a "
                    "WHERE a.attrelid = CAST(:t AS regclass) AND a.attnum > 0 "
                    "AND NOT a.attisdropped AND pg_get_serial_sequence(:t, a.attname) IS NOT NULL"
                ),
                {"t": name},
            ):
                conn.execute(text(f"GRANT USAGE, SELECT ON SEQUENCE {sequence} TO {q(group)}"))
    return driver_scope(metastore)


def grant_driver(
    metastore: Metastore,
    job_id: str,
    attempt: str,
    ttl: timedelta = DEFAULT_TTL,
    *,
    now: datetime | None = None,
) -> URL:
    """A login role for ``attempt`` of ``job_id`` (a new password if it exists), valid for
    ``ttl``; returns the metastore URL with its user and password (a secret: mask it). Expired
    roles of other attempts are dropped first."""
    scope = driver_scope(metastore)
    if not scope.enabled:
        raise DriverScopeError(_not_enabled(metastore, scope))
    assert scope.group is not None
    now = now or datetime.now(UTC)
    expires = now + ttl
    password = secrets.token_urlsafe(32)  # URL-safe: no quoting in the URL
    q = _quoter(metastore)
    with metastore.engine.begin() as conn:
        _expire(conn, now, q)
        database = conn.execute(text("SELECT current_database()")).scalar_one()
        role = driver_role_name(database, job_id, attempt)
        grant = conn.execute(select(DriverGrant).where(DriverGrant.role_name == role)).first()
        exists = conn.execute(text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": role})
        if exists.first() is not None and grant is None:
            raise DriverScopeError(f"role {role} exists but was not granted here: not reused")
        verifier = _verifier(conn, role, password)
        until = expires.astimezone(UTC).isoformat()
        if grant is None:
            _password_ddl(
                conn,
                f"CREATE ROLE {q(role)} LOGIN INHERIT PASSWORD '{verifier}' "
                f"VALID UNTIL '{until}' IN ROLE {q(scope.group)}",
                f"cannot create the driver's role {role}",
            )
        else:
            _password_ddl(
                conn,
                f"ALTER ROLE {q(role)} LOGIN PASSWORD '{verifier}' VALID UNTIL '{until}'",
                f"cannot renew the driver's role {role}",
            )
            conn.execute(delete(DriverGrant).where(DriverGrant.role_name == role))
        conn.execute(
            insert(DriverGrant).values(
                role_name=role, job_id=job_id, attempt=attempt, expires_at=expires
            )
        )
    return metastore.url.set(username=role, password=password)


def revoke_driver(metastore: Metastore, job_id: str, attempt: str) -> bool:
    """Drop the role of ``attempt`` of ``job_id`` and its grant (only once its driver is gone:
    a session still open loses every privilege at once). False when there was none."""
    if metastore.dialect != "postgresql":
        return False
    q = _quoter(metastore)
    with metastore.engine.begin() as conn:
        database = conn.execute(text("SELECT current_database()")).scalar_one()
        role = driver_role_name(database, job_id, attempt)
        found = conn.execute(delete(DriverGrant).where(DriverGrant.role_name == role)).rowcount
        if found:
            conn.execute(text(f"DROP ROLE IF EXISTS {q(role)}"))
    return bool(found)


def has_grant(metastore: Metastore, job_id: str, attempt: str) -> bool:
    """Whether ``attempt`` of ``job_id`` has a role of its own (never on SQLite)."""
    if metastore.dialect != "postgresql":
        return False
    with metastore.engine.connect() as conn:
        database = conn.execute(text("SELECT current_database()")).scalar_one()
        role = driver_role_name(database, job_id, attempt)
        found = conn.execute(select(DriverGrant.role_name).where(DriverGrant.role_name == role))
        return found.first() is not None


def expire_driver_roles(metastore: Metastore, now: datetime | None = None) -> list[str]:
    """Drop the roles (and grants) past their expiry; returns their names."""
    if metastore.dialect != "postgresql":
        return []
    with metastore.engine.begin() as conn:
        return _expire(conn, now or datetime.now(UTC), _quoter(metastore))


def driver_grants(metastore: Metastore) -> list[DriverGrant]:
    """The roles granted now (for ``ckpt db driver-scope status``)."""
    with metastore.reading() as s:
        return list(s.scalars(select(DriverGrant).order_by(DriverGrant.expires_at)))


def _expire(conn: Connection, now: datetime, q: Any) -> list[str]:
    expired = list(
        conn.execute(
            delete(DriverGrant)
            .where(DriverGrant.expires_at <= now)
            .returning(DriverGrant.role_name)
        ).scalars()
    )
    for role in expired:
        conn.execute(text(f"DROP ROLE IF EXISTS {q(role)}"))
    return expired


def _password_ddl(conn: Connection, sql: str, what: str) -> None:
    """A statement holding a password verifier: sent as is (no bind parameters in DDL), and
    never echoed in an error (SQLAlchemy's would show the statement)."""
    try:
        conn.exec_driver_sql(sql)
    except DBAPIError as exc:
        detail = str(exc.orig).strip().splitlines()[0] if str(exc.orig).strip() else "error"
        raise DriverScopeError(f"{what}: {detail}") from None


def _verifier(conn: Connection, role: str, password: str) -> str:
    """The password as the server stores it (SCRAM, or what ``password_encryption`` says),
    computed by libpq here: the plain password never reaches the server or its logs."""
    dbapi = conn.connection.dbapi_connection
    pgconn = getattr(dbapi, "pgconn", None)  # psycopg 3
    if pgconn is None:
        raise DriverScopeError("driver scope needs the psycopg (3) driver")
    value = pgconn.encrypt_password(password.encode(), role.encode(), None)
    verifier = bytes(value).decode()
    if "'" in verifier or "\\" in verifier:  # never: SCRAM and md5 verifiers are base64/hex
        raise DriverScopeError("unexpected password verifier")
    return verifier


def _privileges(table: str, q: Any) -> str:
    """What the drivers' group is granted on ``table``: on the job table, reading and updating
    the columns a driver keeps up to date (never :data:`JOB_FIXED_COLUMNS`), else
    :data:`TABLE_PRIVILEGES`."""
    if table != Job.__tablename__:
        return TABLE_PRIVILEGES
    columns = [c.name for c in Job.__table__.columns if c.name not in JOB_FIXED_COLUMNS]
    return f"SELECT, UPDATE ({', '.join(q(c) for c in columns)})"


def _schema(conn: Connection) -> str:
    """The current schema, quoted for a regclass name."""
    return str(conn.execute(text("SELECT quote_ident(current_schema())")).scalar_one())


def _quoter(metastore: Metastore) -> Any:
    return metastore.engine.dialect.identifier_preparer.quote


def _not_enabled(metastore: Metastore, scope: DriverScope) -> str:
    if scope.group is None:
        return f"driver scope is not enabled in the metastore at {metastore.display_url}"
    return (
        f"driver scope in the metastore at {metastore.display_url} lacks "
        f"{', '.join(scope.missing)}: run `ckpt db driver-scope enable` again"
    )
