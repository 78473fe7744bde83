"""The ``ckpt`` command line.

Configuration comes from flags, then ``CKPT_METASTORE_URL`` / ``CKPT_STORAGE_URL``, then the
embedded defaults under ``CKPT_HOME`` (default ``./.ckpt``). Tables are for people, ``--json`` for
scripts. Every error is one clear line on stderr and a non-zero exit code.

One module per group of commands, each command a thin typer declaration over library functions
(Alembic's ``command.py`` style): :mod:`.db`, :mod:`.history`, :mod:`.savepoint`,
:mod:`.inspection`, :mod:`.maintenance`, :mod:`.run`, :mod:`.data`. What they share (consoles,
error handling, the root options) is in :mod:`.common`, the tables in :mod:`.render`. A command
imports what it needs when it runs, so that ``--help`` loads neither SQLAlchemy nor Spark.
To add a command, write it in its group's module and wire it up below. :mod:`.spark_app` is the
file ``spark-submit`` runs: this command line in a Spark driver.

``--help`` and the ``--json`` reads stay fast for scripts that poll them (a test checks what
they import): Rich's console is made on first use, tables are imported only to print one.
"""

from __future__ import annotations

import typer

from checkpointing.cli import data, db, history, inspection, maintenance, run, savepoint
from checkpointing.cli.common import main_options

__all__ = ["app", "main"]

app = typer.Typer(
    help="Flink-style checkpoints for Airflow-orchestrated PySpark batch pipelines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.callback()(main_options)

db_app = typer.Typer(help="Create, migrate and inspect the metastore schema.", no_args_is_help=True)
db_app.command("upgrade")(db.upgrade)
db_app.command("current")(db.current)
db_app.command("ddl")(db.ddl)
driver_scope_app = typer.Typer(
    help="Narrow what each Spark driver can write (PostgreSQL roles, docs/cluster.md).",
    no_args_is_help=True,
)
driver_scope_app.command("enable")(db.driver_scope_enable)
driver_scope_app.command("status")(db.driver_scope_status)
driver_scope_app.command("expire")(db.driver_scope_expire)
db_app.add_typer(driver_scope_app, name="driver-scope")
app.add_typer(db_app, name="db")

# in this order in `ckpt --help`
app.command("jobs")(history.jobs)
app.command("list")(history.list_checkpoints)
app.command("show")(history.show)
app.command("restores")(history.restores)
app.command("summary")(history.summary)
app.command("discard")(history.discard)
app.command("restore-plan")(inspection.restore_plan)
app.command("inspect")(inspection.inspect)
app.command("savepoint")(savepoint.savepoint)
app.command("requests")(history.requests)
app.command("savepoints")(maintenance.savepoints)
app.command("gc")(maintenance.gc)
app.command("run")(run.run)
app.command("generate-data")(data.generate_data)


def main() -> None:
    app()
