"""abfs:// end to end against Azurite on loopback (a real HTTP endpoint): a job whose input,
checkpoint storage and Parquet sink are all on Azure Blob Storage, SIGKILLed and resumed at
another parallelism, equals pandas (:func:`tests.cloud_emulators.killed_rescaled_case`); the
checkpoint storage's own operations; a missing container refused in one line naming the URL."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cloud_emulators import (
    fixture_azure_env,
    fixture_azurite_endpoint,
    killed_rescaled_case,
    missing_bucket_refusal,
    new_bucket,
    storage_round_trip,
)

#: the session's emulator and this test's environment (pytest finds fixtures imported here)
__all__ = ["fixture_azure_env", "fixture_azurite_endpoint"]


@pytest.mark.timeout(600)
def test_abfs_job_killed_then_rescaled_equals_pandas(
    azure_env: dict[str, str], tmp_path: Path
) -> None:
    killed_rescaled_case(f"abfs://{new_bucket('abfs')}/lake", azure_env, tmp_path)


@pytest.mark.usefixtures("azure_env")
def test_abfs_checkpoint_storage_round_trip() -> None:
    storage_round_trip(f"abfs://{new_bucket('abfs')}/ckpt")


@pytest.mark.usefixtures("azure_env")
def test_abfs_missing_container_is_one_line() -> None:
    assert missing_bucket_refusal("abfs") == (
        "abfs://no-such-bucket-ckpt/in/*.parquet: container 'no-such-bucket-ckpt' does not exist"
    )
