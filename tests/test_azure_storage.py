"""abfs:// end to end against Azurite on loopback (a real HTTP endpoint): a job whose input,
checkpoint storage and Parquet sink are all on Azure Blob Storage, SIGKILLed and resumed at
another parallelism, equals pandas (:func:`tests.cloud_emulators.killed_rescaled_case`); the
checkpoint storage's own operations; a missing container refused in one line naming the URL."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpointing.state.object_store import list_objects
from checkpointing.state.storage import CheckpointStorage
from tests.cloud_emulators import (
    fixture_azure_env,
    fixture_azurite_endpoint,
    killed_rescaled_case,
    new_bucket,
)

#: the session's emulator and this test's environment (pytest finds fixtures imported here)
__all__ = ["fixture_azure_env", "fixture_azurite_endpoint"]


@pytest.mark.timeout(600)
def test_azure_job_killed_then_rescaled_equals_pandas(
    azure_env: dict[str, str], tmp_path: Path
) -> None:
    killed_rescaled_case(f"abfs://{new_bucket('abfs')}/lake", azure_env, tmp_path)


def test_azure_checkpoint_storage_round_trip(azure_env: dict[str, str]) -> None:
    from checkpointing.errors import CorruptSnapshotError

    base = f"abfs://{new_bucket('abfs')}/ckpt"
    storage = CheckpointStorage.from_url(base)
    location = storage.initialize_location_for_checkpoint("job", 7)
    info = storage.write_bytes(location.file_url("a"), b"state")
    assert storage.read_bytes(info.url, checksum=info.checksum, size=5) == b"state"
    assert storage.list_files(storage.job_url("job")) == [f"{base}/job/chk-7/a"]
    with pytest.raises(CorruptSnapshotError, match="checksum mismatch"):
        storage.read_bytes(info.url, checksum="sha256:" + "0" * 64)
    assert storage.discard_directory("job", 7, "checkpoint") == f"{base}/job/chk-7"
    assert storage.list_files(storage.job_url("job")) == [] and storage.size_of(info.url) is None


def test_azure_missing_bucket_is_one_line(azure_env: dict[str, str]) -> None:
    from checkpointing.state.object_store import ObjectStoreError

    with pytest.raises(ObjectStoreError) as err:
        list_objects("abfs://no-such-container/in/*.parquet")
    assert str(err.value) == (
        "abfs://no-such-container/in/*.parquet: container 'no-such-container' does not exist"
    )
