"""``ckpt db upgrade | current | ddl``: the metastore's schema
(:class:`~checkpointing.metastore.engine.
Metastore`'s Alembic migrations)."""

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
