"""The Delta sink on abfss:// against Azurite (a real HTTP endpoint on loopback).

Azurite ignores List Blobs' ``startFrom``, which object_store >= 0.13 sends to list a Delta log
from a version on: every older commit came back and delta-rs's second commit on an existing
table failed with "Invalid table version". A path-style ``BlobEndpoint`` (Azurite's) now turns
on object_store's emulator mode, which lists everything and filters itself; a real Azure
endpoint keeps the options it had. Here: those options; the sink's own log calls (create,
commits through ``create_write_transaction``, a restore) equal to pandas; and the chaos case
(SIGKILL, resume at another parallelism) with a Delta sink, equal to pandas.
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from checkpointing.sinks import delta_log as dl
from checkpointing.sinks.delta_files import DataFile, filesystem
from checkpointing.state.cloud_filesystems import (
    OBJECT_STORE_EMULATOR_VARIABLE,
    delta_options,
)
from tests.cloud_emulators import (
    AZURITE_ACCOUNT,
    AZURITE_KEY,
    fixture_azure_env,
    fixture_azurite_endpoint,
    killed_rescaled_case,
    new_bucket,
)
from tests.delta_helpers import read_table, txn_counts

#: the session's emulator and this test's environment (pytest finds fixtures imported here)
__all__ = ["fixture_azure_env", "fixture_azurite_endpoint"]

JOB = "azdelta"


@pytest.fixture(name="delta_azure_env")
def fixture_delta_azure_env(
    azure_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> dict[str, str]:
    """Azurite's environment; the variable delta_options sets for object_store is unset after."""
    monkeypatch.delenv(OBJECT_STORE_EMULATOR_VARIABLE, raising=False)
    return azure_env


def test_emulator_mode_only_for_a_path_style_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OBJECT_STORE_EMULATOR_VARIABLE, raising=False)
    real = f"AccountName=acct;AccountKey={AZURITE_KEY};BlobEndpoint=https://acct.blob.core.usgovcloudapi.net/;"
    options = delta_options("abfss", "c", {"AZURE_STORAGE_CONNECTION_STRING": real})
    assert options == {
        "azure_storage_account_name": "acct",
        "azure_storage_account_key": AZURITE_KEY,
        "azure_storage_endpoint": "https://acct.blob.core.usgovcloudapi.net",
    }
    plain = {"AZURE_STORAGE_ACCOUNT_NAME": "acct", "AZURE_STORAGE_SAS_TOKEN": "sv=1&sig=x"}
    assert delta_options("abfss", "c", plain) == {
        "azure_storage_account_name": "acct",
        "azure_storage_sas_key": "sv=1&sig=x",
    }
    assert OBJECT_STORE_EMULATOR_VARIABLE not in os.environ  # production: the process untouched

    azurite = f"AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
    azurite += f"BlobEndpoint=http://127.0.0.1:10123/{AZURITE_ACCOUNT};"
    options = delta_options("abfss", "c", {"AZURE_STORAGE_CONNECTION_STRING": azurite})
    assert options == {
        "azure_storage_account_name": AZURITE_ACCOUNT,
        "azure_storage_account_key": AZURITE_KEY,
        "azure_storage_use_emulator": "true",
        "allow_http": "true",
    }
    assert os.environ[OBJECT_STORE_EMULATOR_VARIABLE] == "http://127.0.0.1:10123"


def _write(url: str, name: str, frame: pd.DataFrame, epoch: int) -> DataFile:
    """A data file in the table root, written through the sink's own Arrow filesystem."""
    fs, root = filesystem(url)
    table = pa.Table.from_pandas(frame, preserve_index=False)
    with fs.open_output_stream(f"{root}/{name}") as out:
        pq.write_table(table, out)
    size = fs.get_file_info(f"{root}/{name}").size
    return DataFile(epoch, 0, name, int(size), table.num_rows)


@pytest.mark.usefixtures("delta_azure_env")
def test_sink_log_commits_and_restore_on_abfss_equal_pandas() -> None:
    """create, three commits (the third replacing a file), then a RESTORE to checkpoint 2:
    the commits after the first were the ones Azurite used to fail."""
    url = dl.table_url(f"abfss://{new_bucket('abfs')}@{AZURITE_ACCOUNT}.dfs.core.windows.net/t")
    frames = [
        pd.DataFrame({"user": [f"u{e}{i}" for i in range(4)], "n": [e] * 4}) for e in range(3)
    ]
    schema = pa.Schema.from_pandas(frames[0], preserve_index=False)
    dl.create_table(url, JOB, "changelog", schema, 0)
    files = [_write(url, f"e{e}.parquet", f, e) for e, f in enumerate(frames)]
    for checkpoint, (epoch, file) in enumerate(enumerate(files[:2]), start=1):
        table = dl.open_table(url)
        assert table is not None
        dl.commit_files(
            table, url, job=JOB, checkpoint_id=checkpoint, epoch=epoch, epochs=[epoch],
            adds=[file], removes={}, schema=schema,
        )  # fmt: skip
    table = dl.open_table(url)
    assert table is not None
    dl.commit_files(
        table, url, job=JOB, checkpoint_id=3, epoch=2, epochs=[2],
        adds=[files[2]], removes={files[0].path: files[0].size}, schema=schema,
    )  # fmt: skip
    assert table.version() == 3
    _assert_rows(url, pd.concat(frames[1:]))
    assert txn_counts(url, JOB) == {1: 1, 2: 1, 3: 1}

    dl.restore_table(table, url, JOB, dl.state_for_checkpoint(table, 2))
    _assert_rows(url, pd.concat(frames[:2]))
    assert dl.current_state(table).checkpoint_id == 2


def _assert_rows(url: str, want: pd.DataFrame) -> None:
    got = read_table(url, ["user"])
    want = want.sort_values("user").reset_index(drop=True)
    pd.testing.assert_frame_equal(got[want.columns.tolist()], want, check_dtype=False)


@pytest.mark.timeout(600)
def test_abfss_delta_job_killed_then_rescaled_equals_pandas(
    delta_azure_env: dict[str, str], tmp_path: Path
) -> None:
    base = f"abfss://{new_bucket('abfs')}@{AZURITE_ACCOUNT}.dfs.core.windows.net/lake"
    killed_rescaled_case(base, delta_azure_env, tmp_path, sink_format="delta")
