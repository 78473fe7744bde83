"""Google Cloud Storage (``gs://bucket/key``) and Azure Blob Storage / ADLS Gen2
(``abfs[s]://container/key`` or ``abfs[s]://container@account.dfs.core.windows.net/key``) as
fsspec filesystems: gcsfs and adlfs, each configured from its library's own environment
variables, as boto3's are for S3, so that the driver and every executor find the same endpoint
and credentials (the driver hands them on: :mod:`checkpointing.spark.executor_env`):

* GCS: ``GOOGLE_SERVICE_ACCOUNT_KEY`` (a service account's JSON key, the variable delta-rs
  reads too), else ``GOOGLE_APPLICATION_CREDENTIALS`` or the machine's own account (gcsfs's
  default chain: Dataproc's and Composer's metadata server); ``GOOGLE_CLOUD_PROJECT``;
  ``STORAGE_EMULATOR_HOST`` for an emulator (anonymous unless a key is given).
* Azure: ``AZURE_STORAGE_CONNECTION_STRING``, or ``AZURE_STORAGE_ACCOUNT_NAME`` with
  ``AZURE_STORAGE_ACCOUNT_KEY`` or ``AZURE_STORAGE_SAS_TOKEN``, or a service principal
  (``AZURE_STORAGE_CLIENT_ID``/``_SECRET``/``TENANT_ID``); the account of an
  ``…@account.dfs.core.windows.net`` URL wins over ``AZURE_STORAGE_ACCOUNT_NAME``.

Listings are never cached here: a checkpoint compares an object's ETag with the one it read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from checkpointing.errors import ConfigError

GCS_SCHEMES = ("gs",)
AZURE_SCHEMES = ("abfs", "abfss")
#: the variables a driver hands to its executors (and the Airflow operator to the driver)
GCS_VARIABLES = ("GOOGLE_SERVICE_ACCOUNT_KEY", "GOOGLE_CLOUD_PROJECT", "STORAGE_EMULATOR_HOST")
AZURE_VARIABLES = (
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_CLIENT_ID",
    "AZURE_STORAGE_CLIENT_SECRET",
    "AZURE_STORAGE_TENANT_ID",
)


def container_and_account(authority: str) -> tuple[str, str | None]:
    """An ``abfs`` URL's authority: ``container`` or ``container@account.dfs.core.windows.net``
    (or ``.blob.``) → ``(container, account)``."""
    container, at, host = authority.partition("@")
    if not at:
        return container, None
    account = host.split(".", 1)[0]
    if not container or not account:
        raise ConfigError(f"{authority!r}: expected container@account.dfs.core.windows.net")
    return container, account


def filesystem(scheme: str, authority: str, environ: Mapping[str, str] | None = None) -> Any:
    """The fsspec filesystem reaching ``scheme://authority/…`` with this environment's
    credentials; its paths are ``bucket/key`` (``container/key`` on Azure)."""
    env = os.environ if environ is None else environ
    if scheme in GCS_SCHEMES:
        return _gcs(env)
    if scheme in AZURE_SCHEMES:
        return _azure(authority, env)
    raise ConfigError(f"{scheme}:// is not a GCS or Azure URL")


def _gcs(env: Mapping[str, str]) -> Any:
    # the plain filesystem: gcsfs's default one first asks the storage-control gRPC API for
    # the bucket's layout, which an emulator (and an account without that permission) lacks
    from gcsfs.core import GCSFileSystem

    token: Any = None  # gcsfs's chain: GOOGLE_APPLICATION_CREDENTIALS, gcloud, metadata server
    key = env.get("GOOGLE_SERVICE_ACCOUNT_KEY")
    if key:
        try:
            token = json.loads(key)
        except ValueError:
            raise ConfigError("GOOGLE_SERVICE_ACCOUNT_KEY is not a JSON key") from None
    elif env.get("STORAGE_EMULATOR_HOST"):
        token = "anon"
    project = env.get("GOOGLE_CLOUD_PROJECT") or (
        token.get("project_id") if isinstance(token, dict) else None
    )
    return GCSFileSystem(
        token=token,
        project=project or "",
        endpoint_url=env.get("STORAGE_EMULATOR_HOST") or None,
        use_listings_cache=False,
        skip_instance_cache=True,
    )


def _azure(authority: str, env: Mapping[str, str]) -> Any:
    from adlfs import AzureBlobFileSystem

    _, account = container_and_account(authority)
    options: dict[str, Any] = {"use_listings_cache": False, "skip_instance_cache": True}
    if env.get("AZURE_STORAGE_CONNECTION_STRING"):
        options["connection_string"] = env["AZURE_STORAGE_CONNECTION_STRING"]
    else:
        options["account_name"] = account or env.get("AZURE_STORAGE_ACCOUNT_NAME")
        for name, option in [
            ("AZURE_STORAGE_ACCOUNT_KEY", "account_key"),
            ("AZURE_STORAGE_SAS_TOKEN", "sas_token"),
            ("AZURE_STORAGE_CLIENT_ID", "client_id"),
            ("AZURE_STORAGE_CLIENT_SECRET", "client_secret"),
            ("AZURE_STORAGE_TENANT_ID", "tenant_id"),
        ]:
            if env.get(name):
                options[option] = env[name]
        if not options["account_name"]:
            raise ConfigError(
                "no Azure storage account: use abfss://container@ACCOUNT.dfs.core.windows.net/… "
                "or set AZURE_STORAGE_ACCOUNT_NAME (or AZURE_STORAGE_CONNECTION_STRING)"
            )
    return AzureBlobFileSystem(**options)


def connection_string_fields(text: str) -> dict[str, str]:
    """``Key=Value;…`` of an Azure connection string (values may contain ``=``)."""
    fields = {}
    for part in text.split(";"):
        name, eq, value = part.partition("=")
        if eq and name.strip():
            fields[name.strip()] = value.strip()
    return fields


#: delta-rs options that hold a credential (masked in every message)
SECRET_DELTA_OPTIONS = (
    "google_service_account_key",
    "azure_storage_account_key",
    "azure_storage_sas_key",
    "azure_storage_client_secret",
)


def delta_options(scheme: str, authority: str, environ: Mapping[str, str]) -> dict[str, str]:
    """delta-rs (object_store) options reaching the same store as :func:`filesystem`, from the
    same variables: delta-rs has no connection strings and no ``STORAGE_EMULATOR_HOST``. A
    connection string's path-style ``BlobEndpoint`` (Azurite) turns on object_store's emulator
    mode (:func:`_point_object_store_at` says why)."""
    if scheme in GCS_SCHEMES:
        options: dict[str, str] = {}
        emulator = environ.get("STORAGE_EMULATOR_HOST")
        if environ.get("GOOGLE_SERVICE_ACCOUNT_KEY"):
            options["google_service_account_key"] = environ["GOOGLE_SERVICE_ACCOUNT_KEY"]
        elif emulator:  # object_store's way to an emulator: a key naming it, without OAuth
            key = {"gcs_base_url": emulator, "disable_oauth": True}
            key |= {"client_email": "", "private_key": "", "private_key_id": ""}
            options["google_service_account_key"] = json.dumps(key)
        if emulator and emulator.startswith("http://"):
            options["allow_http"] = "true"
        return options
    _, account = container_and_account(authority)
    fields = connection_string_fields(environ.get("AZURE_STORAGE_CONNECTION_STRING", ""))
    options = {}
    name = account or fields.get("AccountName") or environ.get("AZURE_STORAGE_ACCOUNT_NAME")
    if name:
        options["azure_storage_account_name"] = name
    key = fields.get("AccountKey") or environ.get("AZURE_STORAGE_ACCOUNT_KEY")
    sas = fields.get("SharedAccessSignature") or environ.get("AZURE_STORAGE_SAS_TOKEN")
    if key:
        options["azure_storage_account_key"] = key
    elif sas:
        options["azure_storage_sas_key"] = sas
    for variable, option in [
        ("AZURE_STORAGE_CLIENT_ID", "azure_storage_client_id"),
        ("AZURE_STORAGE_CLIENT_SECRET", "azure_storage_client_secret"),
        ("AZURE_STORAGE_TENANT_ID", "azure_storage_tenant_id"),
    ]:
        if environ.get(variable):
            options[option] = environ[variable]
    endpoint = fields.get("BlobEndpoint")
    emulator = _emulator_base(endpoint, name) if endpoint else None
    if emulator:
        options["azure_storage_use_emulator"] = "true"
        _point_object_store_at(emulator)
    elif endpoint:  # a sovereign cloud's endpoint
        options["azure_storage_endpoint"] = endpoint.rstrip("/")
    if endpoint and endpoint.startswith("http://"):
        options["allow_http"] = "true"
    return options


#: where object_store's emulator mode takes the emulator's address from (no option sets it)
OBJECT_STORE_EMULATOR_VARIABLE = "AZURITE_BLOB_STORAGE_URL"


def _emulator_base(endpoint: str, account: str | None) -> str | None:
    """``http://host:port`` of an emulator's path-style Blob endpoint ``…/ACCOUNT`` (Azurite's
    form; Azure's own endpoints name the account in the host and have no path), else None."""
    parts = urlsplit(endpoint.strip())
    if not account or not parts.netloc or parts.path.strip("/") != account:
        return None
    return f"{parts.scheme}://{parts.netloc}"


def _point_object_store_at(base: str) -> None:
    """Name the emulator where object_store looks for it: in emulator mode it reads only this
    process's ``AZURITE_BLOB_STORAGE_URL`` (else 127.0.0.1:10000) and ignores the endpoint
    option. Emulator mode is needed because Azurite ignores List Blobs' ``startFrom``, which
    object_store ≥ 0.13 sends to list a Delta log from a version on (then every older commit
    comes back and delta-rs fails with "Invalid table version"); in emulator mode it lists all
    and filters itself."""
    if os.environ.get(OBJECT_STORE_EMULATOR_VARIABLE) != base:
        os.environ[OBJECT_STORE_EMULATOR_VARIABLE] = base
