"""``ckpt db upgrade | current | ddl``: the metastore's schema
(:class:`~checkpointing.metastore.engine.Metastore`'s Alembic migrations); ``ckpt db
driver-scope enable | status | expire``: the Spark drivers' own roles on PostgreSQL
(:mod:`checkpointing.metastore.driver_roles`)."""

from __future__ import annotations

import sys
from typing import Annotated, Literal, get_args

import typer

from checkpointing.cli.common import EXIT_SCHEMA, choices, handles_errors, out, state

#: the dialects of the reference DDL (``sql/<dialect>.sql``)
Dialect = Literal["postgresql", "sqlite"]


@handles_errors
def upgrade(
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
) -> None:
    """Create the metastore schema, or migrate it to this version."""
    store = state.metastore(check_schema=False)
    before, after = store.upgrade(revision)
    if before == after:
        out.print(f"metastore {store.display_url} is up to date (revision {after})")
    else:
        out.print(f"metastore {store.display_url}: {before or 'empty'} -> {after}")


@handles_errors
def current() -> None:
    """Show the schema revision of the metastore and the one this version needs."""
    store = state.metastore(check_schema=False, create=False)  # a read: creates nothing
    current, head = store.current_revision(), store.head_revision()
    out.print(f"metastore {store.display_url}: revision {current or 'none'} (this version: {head})")
    if current != head:
        raise typer.Exit(EXIT_SCHEMA)


@handles_errors
def ddl(
    dialect: Annotated[Dialect, choices(get_args(Dialect), "--dialect", help="SQL dialect.")] = (
        "postgresql"
    ),
) -> None:
    """Print the reference DDL (as in sql/) for a dialect."""
    from checkpointing.metastore.engine import reference_ddl

    sys.stdout.write(reference_ddl(dialect))


# ---------------------------------------------------------------- driver scope (PostgreSQL)

#: what a driver reaches with driver scope, said after `enable` and by `status`
_REACH_SCOPED = (
    "each Spark driver logs in as its own role: it reads and writes only its own job's rows "
    "(still every file its storage credentials reach); see docs/cluster.md"
)
_REACH_OPEN = (
    "every Spark driver gets the task's metastore URL: it can read and write every job's rows; "
    "see docs/cluster.md"
)


@handles_errors
def driver_scope_enable(
    group: Annotated[
        str, typer.Option(help="The drivers' NOLOGIN group role (created if missing).")
    ] = "ckpt_driver",
    manager: Annotated[
        str | None,
        typer.Option(
            help="The role the Airflow tasks connect as, when it is not the one running this: "
            "it creates the drivers' roles (given the group WITH ADMIN OPTION)."
        ),
    ] = None,
) -> None:
    """Give each Spark driver a role that reads and writes only its own job's rows (PostgreSQL
    row-level security). Run once, and after every `ckpt db upgrade`, as the tables' owner with
    CREATEROLE; idempotent."""
    from checkpointing.metastore.driver_roles import enable_driver_scope

    store = state.metastore()
    scope = enable_driver_scope(store, group=group, manager=manager)
    out.print(f"metastore {store.display_url}: driver scope enabled (group {scope.group})")
    out.print(_REACH_SCOPED)


@handles_errors
def driver_scope_status() -> None:
    """Whether driver scope is enabled, and the drivers' roles granted now. Exit code 1 when it
    is enabled but incomplete (a table added since: run `enable` again)."""
    from checkpointing.metastore.driver_roles import driver_grants, driver_scope

    store = state.metastore()
    scope = driver_scope(store)
    if scope.group is None:
        out.print(f"metastore {store.display_url} ({store.dialect}): driver scope is off")
        out.print(_REACH_OPEN)
        return
    if scope.missing:
        out.print(
            f"metastore {store.display_url}: driver scope (group {scope.group}) lacks "
            f"{', '.join(scope.missing)}: run `ckpt db driver-scope enable` again"
        )
        raise typer.Exit(1)
    out.print(f"metastore {store.display_url}: driver scope is on (group {scope.group})")
    out.print(_REACH_SCOPED)
    for grant in driver_grants(store):
        out.print(
            f"  {grant.role_name}  job {grant.job_id}  attempt {grant.attempt}  "
            f"valid until {grant.expires_at.isoformat()}"
        )


@handles_errors
def driver_scope_expire() -> None:
    """Drop the drivers' roles past their expiry (tries whose task died before dropping its
    driver's role). Every grant does it too."""
    from checkpointing.metastore.driver_roles import expire_driver_roles

    store = state.metastore()
    dropped = expire_driver_roles(store)
    out.print(
        f"dropped {len(dropped)} expired driver role(s)" + "".join(f"\n  {r}" for r in dropped)
    )
