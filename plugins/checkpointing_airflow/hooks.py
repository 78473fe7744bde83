"""Connections, Airflow style: the checkpoint metastore (S3 credentials: aws_credentials)."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowNotFoundException

from checkpointing.config import Settings
from checkpointing.metastore.engine import Metastore

#: Airflow URI schemes → SQLAlchemy drivers the project ships
_SCHEMES = {
    "postgres": "postgresql+psycopg",
    "postgresql": "postgresql+psycopg",
    "sqlite": "sqlite",
}


class CheckpointMetastoreHook(BaseHook):
    """The checkpoint metastore, from the ``checkpoint_metastore`` connection, else
    ``CKPT_METASTORE_URL``, else the embedded SQLite default.

    The connection is a Postgres connection (host, port, schema = database, login, password) or
    carries a full SQLAlchemy URL in its extra: ``{"sqlalchemy_url": "postgresql+psycopg://…"}``.

    :param checkpoint_metastore_conn_id: the Airflow connection id.
    """

    conn_name_attr = "checkpoint_metastore_conn_id"
    default_conn_name = "checkpoint_metastore"
    conn_type = "postgres"
    hook_name = "Checkpoint metastore"

    def __init__(self, checkpoint_metastore_conn_id: str = default_conn_name) -> None:
        super().__init__()
        self.checkpoint_metastore_conn_id = checkpoint_metastore_conn_id

    def get_url(self) -> str:
        try:
            conn = self.get_connection(self.checkpoint_metastore_conn_id)
        except AirflowNotFoundException:
            return Settings.resolve().metastore_url
        return connection_url(conn)

    def get_metastore(self) -> Metastore:
        return open_metastore(self.get_url())


def open_metastore(url: str) -> Metastore:
    """The metastore at ``url``; the embedded default (SQLite under ``CKPT_HOME``) is created or
    migrated on first use, a configured one must be migrated explicitly (``ckpt db upgrade``)."""
    if url == Settings.embedded_metastore_url():
        Metastore(url, check_schema=False).upgrade()
    return Metastore(url)


def mask_metastore_url(url: str) -> None:
    """Register the metastore URL, and its password on its own (it may be quoted without the
    rest), with Airflow's secret masker, as the pipeline's task does."""
    from airflow.sdk.log import mask_secret

    from checkpointing_airflow.driver_secrets import mask_url_password

    mask_secret(url)
    mask_url_password(url, mask_secret)


def connection_url(conn: Any) -> str:
    """A SQLAlchemy URL from an Airflow connection."""
    from sqlalchemy.engine import URL

    extra = conn.extra_dejson or {}
    if extra.get("sqlalchemy_url"):
        return str(extra["sqlalchemy_url"])
    conn_type = (conn.conn_type or "postgres").lower()
    driver = _SCHEMES.get(conn_type)
    if driver is None:
        raise ValueError(
            f"connection {conn.conn_id!r}: type {conn_type!r} is not a metastore "
            "(use postgres, sqlite, or an extra 'sqlalchemy_url')"
        )
    if driver == "sqlite":
        return f"sqlite:///{conn.host or conn.schema}"
    return URL.create(
        driver,
        username=conn.login or None,
        password=conn.password or None,
        host=conn.host or None,
        port=conn.port or None,
        database=conn.schema or None,
    ).render_as_string(hide_password=False)
