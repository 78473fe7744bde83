"""gs:// end to end against Google's storage emulator on loopback (a real HTTP endpoint): a job
whose input, checkpoint storage and Parquet sink are all on GCS, SIGKILLed and resumed at
another parallelism, equals pandas (:func:`tests.cloud_emulators.killed_rescaled_case`); the
checkpoint storage's own operations; a missing bucket refused in one line naming the URL."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cloud_emulators import (
    fixture_gcs_endpoint,
    fixture_gcs_env,
    killed_rescaled_case,
    missing_bucket_refusal,
    new_bucket,
    storage_round_trip,
)

#: the session's emulator and this test's environment (pytest finds fixtures imported here)
__all__ = ["fixture_gcs_endpoint", "fixture_gcs_env"]


@pytest.mark.timeout(600)
def test_gs_job_killed_then_rescaled_equals_pandas(gcs_env: dict[str, str], tmp_path: Path) -> None:
    killed_rescaled_case(f"gs://{new_bucket('gs')}/lake", gcs_env, tmp_path)


@pytest.mark.usefixtures("gcs_env")
def test_gs_checkpoint_storage_round_trip() -> None:
    storage_round_trip(f"gs://{new_bucket('gs')}/ckpt")


@pytest.mark.usefixtures("gcs_env")
def test_gs_missing_bucket_is_one_line() -> None:
    assert missing_bucket_refusal("gs") == (
        "gs://no-such-bucket-ckpt/in/*.parquet: bucket 'no-such-bucket-ckpt' does not exist"
    )
