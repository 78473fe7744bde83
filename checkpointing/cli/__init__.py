"""The ``ckpt`` command line.

Configuration comes from flags, then ``CKPT_METASTORE_URL`` / ``CKPT_STORAGE_URL``, then the
embedded defaults under ``CKPT_HOME`` (default ``./.ckpt``). Tables are for people, ``--json`` for
scripts. Every error is one clear line on stderr and a non-zero exit code.

One module per group of commands, each command a thin typer declaration over library functions
(Alembic's ``command.py`` style): :mod:`.db`, :mod:`.history`, :mod:`.savepoint`,
:mod:`.inspection`, :mod:`.maintenance`, :mod:`.run`, :mod:`.validate`, :mod:`.data`. What they
share (consoles, error handling, the root options) is in :mod:`.common`, the tables in
:mod:`.render`, the checks ``run`` and ``validate`` make before Spark in :mod:`.preflight`, and
how the command line is parsed and its usage shown (the root options on every command, one-line
usage errors) in :mod:`.usage`. A command imports what it needs when it runs, so that ``--help``
loads neither SQLAlchemy nor Spark. To add a command, write it in its group's module and wire it
up below with :func:`command`. :mod:`.spark_app` is the
file ``spark-submit`` runs: this command line in a Spark driver.

``--help`` and the ``--json`` reads stay fast for scripts that poll them (a test checks what
they import): Rich's console is made on first use, tables are imported only to print one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

from checkpointing.cli import data, db, history, inspection, maintenance, run, savepoint, validate
from checkpointing.cli.common import main_options
from checkpointing.cli.usage import Command, Group, RootGroup

__all__ = ["app", "main"]

app = typer.Typer(
    cls=RootGroup,
    help="Flink-style checkpoints for Airflow-orchestrated PySpark batch pipelines.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.callback()(main_options)


def command(
    group: typer.Typer, name: str, fn: Callable[..., Any], panel: str | None = None, **kw: Any
) -> None:
    """Wire up ``fn`` as ``group``'s command ``name`` (the root options accepted there too)."""
    group.command(name, cls=Command, rich_help_panel=panel, **kw)(fn)


def alias(group: typer.Typer, old: str, new: str, fn: Callable[..., Any]) -> None:
    """An old spelling that still works (scripts, DAGs), out of the help; it says on stderr
    that it is old."""
    group.command(old, cls=Command, hidden=True, deprecated=f"Use 'ckpt {new}'.")(fn)  # type: ignore[arg-type]


db_app = typer.Typer(
    cls=Group, help="Create, migrate and inspect the metastore schema.", no_args_is_help=True
)
command(db_app, "upgrade", db.upgrade)
command(db_app, "current", db.current)
command(db_app, "ddl", db.ddl)
driver_scope_app = typer.Typer(
    cls=Group,
    help="Narrow what each Spark driver can write (PostgreSQL roles, docs/cluster.md).",
    no_args_is_help=True,
)
command(driver_scope_app, "enable", db.driver_scope_enable)
command(driver_scope_app, "status", db.driver_scope_status)
command(driver_scope_app, "expire", db.driver_scope_expire)
db_app.add_typer(driver_scope_app, name="driver-scope")

# in this order in `ckpt --help`, by panel
PIPELINES, HISTORY, SAVEPOINTS, STATE, HOUSEKEEPING = (
    "Pipelines",
    "Checkpoint history",
    "Savepoints",
    "Looking inside checkpoints",
    "Housekeeping",
)
command(app, "run", run.run, PIPELINES, context_settings={"allow_extra_args": True})
command(app, "validate", validate.validate, PIPELINES)
command(app, "generate-data", data.generate_data, PIPELINES)
command(app, "jobs", history.jobs, HISTORY)
command(app, "list", history.list_checkpoints, HISTORY)
command(app, "show", history.show, HISTORY)
command(app, "summary", history.summary, HISTORY)
command(app, "restores", history.restores, HISTORY)
command(app, "requests", history.requests, HISTORY)
command(app, "savepoint", savepoint.savepoint, SAVEPOINTS)
command(app, "list-savepoints", maintenance.list_savepoints, SAVEPOINTS)
command(app, "discard", history.discard, SAVEPOINTS)
command(app, "restore-plan", inspection.restore_plan, STATE)
command(app, "inspect", inspection.inspect, STATE)
command(app, "gc", maintenance.gc, HOUSEKEEPING)
app.add_typer(db_app, name="db", rich_help_panel=HOUSEKEEPING)
alias(app, "savepoints", "list-savepoints", maintenance.list_savepoints)


def main() -> None:
    app(prog_name="ckpt")
