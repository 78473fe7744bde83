"""Alembic environment: runs against the connection handed in by ``Metastore.upgrade`` or,
from the ``alembic`` command line, the URL in ``CKPT_METASTORE_URL``."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from checkpointing.config import Settings
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Base

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    store = Metastore(Settings.resolve().metastore_url, check_schema=False)
    with store.engine.begin() as conn:
        _run(conn)
