"""GCS and Azure credentials for the Spark driver and its executors, from Airflow connections,
as :mod:`checkpointing_airflow.aws_credentials` resolves S3's: once per try, on the worker, into
the variables gcsfs, adlfs and delta-rs read (:mod:`checkpointing.state.cloud_filesystems`),
which reach spark-submit through its process environment (never its command line) and are
masked in the task's log. The connection's fields are read directly (``airflow.sdk``'s
``Connection``), so neither the Google nor the Azure provider is needed:

* a Google Cloud connection (``google_cloud_platform``, default ``google_cloud_default``): its
  extra's ``keyfile_dict`` (the JSON key) or ``key_path`` (a key file on the worker, read here)
  becomes ``GOOGLE_SERVICE_ACCOUNT_KEY``; ``project`` becomes ``GOOGLE_CLOUD_PROJECT``. No key:
  nothing (the machine's own account, as on Dataproc and Composer).
* an Azure Blob Storage connection (``wasb``, default ``wasb_default``; ``adls`` alike): its
  extra's ``connection_string``; else ``login`` (the account) with ``password`` (its key), or
  the extra's ``sas_token``; with the extra's ``tenant_id``: a service principal (``login`` the
  client id, ``password`` its secret, the account from ``host`` or the extra's
  ``account_name``).

Nothing is resolved for storage on another store, or when the connection does not exist.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from checkpointing.state.cloud_filesystems import AZURE_SCHEMES, GCS_SCHEMES

#: the variables that hold a secret (masked in the task's log)
SECRET_VARIABLES = (
    "GOOGLE_SERVICE_ACCOUNT_KEY",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_CLIENT_SECRET",
)


def cloud_environment(
    storage_url: str, *, gcp_conn_id: str | None = None, azure_conn_id: str | None = None
) -> dict[str, str]:
    """The variables for a run whose checkpoints go to ``storage_url`` (``gs://`` or
    ``abfs[s]://``), from the matching connection; the secrets among them masked."""
    scheme = storage_url.partition("://")[0].lower()
    if scheme in GCS_SCHEMES and gcp_conn_id:
        env = _gcp(_connection(gcp_conn_id), gcp_conn_id)
    elif scheme in AZURE_SCHEMES and azure_conn_id:
        env = _azure(_connection(azure_conn_id))
    else:
        return {}
    if env:
        from airflow.sdk.log import mask_secret

        for name in SECRET_VARIABLES:
            if env.get(name):
                mask_secret(env[name])
    return env


def _connection(conn_id: str) -> Any:
    """The connection, or None when there is none."""
    from airflow.sdk import Connection
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        return Connection.get(conn_id)
    except AirflowNotFoundException:
        return None


def _extra(conn: Any, name: str, prefix: str) -> Any:
    """An extra field, bare or with the provider's old ``extra__<type>__`` prefix."""
    extra = conn.extra_dejson or {}
    return extra.get(name) or extra.get(f"extra__{prefix}__{name}")


def _gcp(conn: Any, conn_id: str) -> dict[str, str]:
    from checkpointing.errors import ConfigError

    if conn is None:
        return {}
    env: dict[str, str] = {}
    key = _extra(conn, "keyfile_dict", "google_cloud_platform")
    path = _extra(conn, "key_path", "google_cloud_platform")
    if key:
        text = key if isinstance(key, str) else json.dumps(key)
    elif path:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(
                f"Google Cloud connection {conn_id!r}: cannot read its key_path ({exc.strerror})"
            ) from None
    else:
        text = ""
    if text:
        try:
            json.loads(text)
        except ValueError:
            raise ConfigError(
                f"Google Cloud connection {conn_id!r}: its key is not a JSON key"
            ) from None
        env["GOOGLE_SERVICE_ACCOUNT_KEY"] = text
    project = _extra(conn, "project", "google_cloud_platform")
    if project:
        env["GOOGLE_CLOUD_PROJECT"] = str(project)
    return env


def _azure(conn: Any) -> dict[str, str]:
    if conn is None:
        return {}
    connection_string = _extra(conn, "connection_string", "wasb")
    if connection_string:
        return {"AZURE_STORAGE_CONNECTION_STRING": str(connection_string)}
    env: dict[str, str] = {}
    tenant = _extra(conn, "tenant_id", "wasb")
    host = str(conn.host or "").removeprefix("https://").removeprefix("http://")
    account = _extra(conn, "account_name", "wasb") or host.split(".", 1)[0]
    if tenant:
        env["AZURE_STORAGE_TENANT_ID"] = str(tenant)
        if conn.login:
            env["AZURE_STORAGE_CLIENT_ID"] = str(conn.login)
        if conn.password:
            env["AZURE_STORAGE_CLIENT_SECRET"] = str(conn.password)
    else:
        account = conn.login or account
        sas = _extra(conn, "sas_token", "wasb")
        if sas:
            env["AZURE_STORAGE_SAS_TOKEN"] = str(sas)
        elif conn.password:
            env["AZURE_STORAGE_ACCOUNT_KEY"] = str(conn.password)
    if account:
        env["AZURE_STORAGE_ACCOUNT_NAME"] = str(account)
    return env
