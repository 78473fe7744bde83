"""GCS and Azure credentials from Airflow connections (``gcp_conn_id``, ``azure_conn_id``), as
``aws_conn_id`` works: read on the worker from the connection's fields (no Google or Azure
provider), handed on as gcsfs's, adlfs's and delta-rs's own variables, masked in the task's log;
an Azure connection's credentials reach Azurite (a real HTTP endpoint) and nothing else does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from checkpointing.errors import StorageError
from checkpointing.state.storage import CheckpointStorage
from tests.cloud_emulators import (
    AZURITE_ACCOUNT,
    AZURITE_KEY,
    azure_variables,
    fixture_azurite_endpoint,
    new_bucket,
)
from tests.test_pipeline_permissions import airflow_home, needs_airflow

#: the session's Azurite and an Airflow home (fixtures, found here by pytest)
__all__ = ["airflow_home", "fixture_azurite_endpoint"]

KEY = {"type": "service_account", "project_id": "p-1", "private_key": "-----BEGIN k3y-9f2c"}
VARIABLES = ("AZURE_STORAGE_CONNECTION_STRING", "STORAGE_EMULATOR_HOST")


@needs_airflow
@pytest.mark.usefixtures("airflow_home")
def test_google_connection_gives_the_key_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk._shared.secrets_masker import redact

    from checkpointing_airflow.aws_credentials import storage_environment

    extra = {"keyfile_dict": json.dumps(KEY), "project": "p-1"}
    conn = {"conn_type": "google_cloud_platform", "extra": extra}
    monkeypatch.setenv("AIRFLOW_CONN_GCP_TEST", json.dumps(conn))
    env = storage_environment("aws_default", "gs://bkt/ckpt", gcp_conn_id="gcp_test")
    assert json.loads(env["GOOGLE_SERVICE_ACCOUNT_KEY"]) == KEY
    assert env["GOOGLE_CLOUD_PROJECT"] == "p-1"
    assert "k3y-9f2c" not in str(redact(f"driver env: {env}"))
    # other storage, or no such connection: nothing (the machine's own account)
    assert storage_environment(None, "file:///tmp/x", gcp_conn_id="gcp_test") == {}
    assert storage_environment(None, "gs://bkt/ckpt", gcp_conn_id="no_such_conn") == {}
    assert (
        storage_environment(None, "abfss://c@a.dfs.core.windows.net/x", gcp_conn_id="gcp_test")
        == {}
    )


@needs_airflow
@pytest.mark.usefixtures("airflow_home")
def test_azure_connection_reaches_azurite_and_a_wrong_key_does_not(
    azurite_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from airflow.sdk._shared.secrets_masker import redact

    from checkpointing_airflow.aws_credentials import storage_environment
    from checkpointing_airflow.driver_secrets import process_environment

    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with process_environment(azure_variables(azurite_endpoint)):
        container = new_bucket("abfs")
    url = f"abfs://{container}/ckpt"
    for conn_id, key in [("wasb_good", AZURITE_KEY), ("wasb_bad", AZURITE_KEY[::-1])]:
        connection = azure_variables(azurite_endpoint)["AZURE_STORAGE_CONNECTION_STRING"]
        extra = {"connection_string": connection.replace(AZURITE_KEY, key)}
        conn = {"conn_type": "wasb", "login": AZURITE_ACCOUNT, "extra": extra}
        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))

    env = storage_environment("aws_default", url, azure_conn_id="wasb_good")
    assert set(env) == {"AZURE_STORAGE_CONNECTION_STRING"}
    assert AZURITE_KEY not in str(redact(f"driver env: {env}"))
    with process_environment(env):
        storage = CheckpointStorage.from_url(url)
        info = storage.write_bytes(storage.checkpoint_url("job", 1) + "/_metadata", b"{}")
        assert storage.read_bytes(info.url) == b"{}"

    bad = storage_environment("aws_default", url, azure_conn_id="wasb_bad")
    with process_environment(bad), pytest.raises(StorageError) as err:
        CheckpointStorage.from_url(url).read_bytes(info.url)
    assert "\n" not in str(err.value) and info.url in str(err.value)
    assert AZURITE_KEY[::-1] not in str(err.value)  # never a credential in the message


@needs_airflow
@pytest.mark.usefixtures("airflow_home")
def test_azure_account_key_and_service_principal_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from checkpointing_airflow.aws_credentials import storage_environment

    keyed = {"conn_type": "wasb", "login": "acct", "password": "k-7e1"}
    principal = {
        "conn_type": "wasb",
        "host": "https://acct2.blob.core.windows.net",
        "login": "client-1",
        "password": "s-3d9",
        "extra": {"tenant_id": "tenant-1"},
    }
    monkeypatch.setenv("AIRFLOW_CONN_WASB_KEYED", json.dumps(keyed))
    monkeypatch.setenv("AIRFLOW_CONN_WASB_SP", json.dumps(principal))
    url = "abfss://c@acct.dfs.core.windows.net/ckpt"
    assert storage_environment(None, url, azure_conn_id="wasb_keyed") == {
        "AZURE_STORAGE_ACCOUNT_NAME": "acct",
        "AZURE_STORAGE_ACCOUNT_KEY": "k-7e1",
    }
    assert storage_environment(None, url, azure_conn_id="wasb_sp") == {
        "AZURE_STORAGE_ACCOUNT_NAME": "acct2",
        "AZURE_STORAGE_TENANT_ID": "tenant-1",
        "AZURE_STORAGE_CLIENT_ID": "client-1",
        "AZURE_STORAGE_CLIENT_SECRET": "s-3d9",
    }
