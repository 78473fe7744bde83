"""Real GCS and Azure endpoints on loopback for the gs:// and abfs:// tests: Google's
``gcp-storage-emulator`` (the dev dependency) and Microsoft's Azurite (npm, installed by
``make azurite`` into ``.tools/azurite``), one process each per test session, over HTTP.

Import the fixtures into a test module (``from tests.cloud_emulators import fixture_gcs_env,
fixture_gcs_endpoint``): pytest finds them there, by their names (``gcs_env``). Also the chaos
case both stores run (:func:`killed_rescaled_case`): a keyed
job whose input, checkpoint storage and Parquet sink are all on the store, SIGKILLed at a seeded
random moment, resumed at another parallelism, its final table equal to pandas'.
"""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pytest

from tests.ckpt_process import CKPT, ckpt_env, kill_at_a_random_moment
from tests.spark_pipeline import AGGS, EPOCHS, assert_matches_pandas, write_events

REPO = Path(__file__).resolve().parents[1]
AZURITE = REPO / ".tools" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
#: Azurite's well-known development account (public, documented by Microsoft)
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _serve(command: list[str], port: int, what: str) -> Iterator[None]:
    """Run ``command`` until its port answers; stop it after the session."""
    log = open(os.devnull, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"{what} exited (rc {proc.returncode}) before it listened")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"{what} did not listen on 127.0.0.1:{port} within 60 s")
                time.sleep(0.1)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(name="gcs_endpoint", scope="session")
def fixture_gcs_endpoint() -> Iterator[str]:
    """gcp-storage-emulator on loopback (in memory): its URL."""
    port = _free_port()
    command = [sys.executable, "-m", "gcp_storage_emulator", "start"]
    command += ["--host", "127.0.0.1", "--port", str(port), "--in-memory"]
    with _serve(command, port, "gcp-storage-emulator"):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(name="azurite_endpoint", scope="session")
def fixture_azurite_endpoint() -> Iterator[str]:
    """Azurite's Blob service on loopback (in memory): its account's URL."""
    if not AZURITE.exists():
        pytest.fail(f"Azurite is not installed at {AZURITE}: run `make azurite` (needs npm)")
    port = _free_port()
    command = [str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(port)]
    command += ["--inMemoryPersistence", "--disableTelemetry", "--skipApiVersionCheck", "--loose"]
    with _serve(command, port, "Azurite"):
        yield f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"


def gcs_variables(endpoint: str) -> dict[str, str]:
    return {"STORAGE_EMULATOR_HOST": endpoint, "GOOGLE_CLOUD_PROJECT": "ckpt-test"}


def azure_variables(endpoint: str) -> dict[str, str]:
    connection = (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
        f"AccountKey={AZURITE_KEY};BlobEndpoint={endpoint};"
    )
    return {"AZURE_STORAGE_CONNECTION_STRING": connection}


def _set(variables: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    return variables


@pytest.fixture(name="gcs_env")
def fixture_gcs_env(gcs_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This test's process pointed at the emulator through gcsfs's own variables."""
    return _set(gcs_variables(gcs_endpoint), monkeypatch)


@pytest.fixture(name="azure_env")
def fixture_azure_env(azurite_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This test's process pointed at Azurite through adlfs's own variables."""
    return _set(azure_variables(azurite_endpoint), monkeypatch)


def new_bucket(scheme: str) -> str:
    """A fresh bucket (GCS) or container (Azure) in the current environment's store."""
    from checkpointing.state.buckets import FsspecBucket

    name = f"ckpt{uuid.uuid4().hex[:10]}"
    FsspecBucket(scheme, name).fs.mkdir(name)
    return name


# ============================================================================ the chaos case


def killed_rescaled_case(
    base: str, env: dict[str, str], tmp_path: Path, sink_format: str = "parquet"
) -> None:
    """The S3 chaos case on another store: input ``base/in/*.parquet``, checkpoint storage
    ``base/ckpt`` and the Parquet sink ``base/out``; ``ckpt run`` SIGKILLed at a seeded random
    moment, resumed at parallelism 2 from the store's checkpoint; the final table (read back
    through the sink's pointer) equals pandas' over every input row, each epoch committed
    once, nothing staged, and the checkpoints are on the store. ``sink_format="delta"``: the
    sink is an upsert Delta table at ``base/out`` instead, read back with delta-rs, each
    checkpoint's app transaction in its log once."""
    from checkpointing.sinks import s3_parquet
    from checkpointing.state.buckets import bucket_for
    from checkpointing.state.object_store import split_url

    seed = int(os.environ.get("CKPT_TEST_SEED") or random.randrange(10_000))
    print(f"seed {seed} (rerun with CKPT_TEST_SEED={seed})")
    events = write_events(tmp_path / "events")
    files = sorted(events.glob("*.parquet"))
    authority, key = split_url(f"{base}/x")
    prefix = key.removesuffix("x")  # the keys of ``base/``
    bucket = bucket_for(base.split("://")[0], authority)
    for f in files:
        bucket.put(f"{prefix}in/{f.name}", f.read_bytes())
    job = "cloud"
    aggs = "\n".join(f"  {k}: {f}({c or ''})" for k, (f, c) in AGGS.items())
    sink = f'{{path: "{base}/out", changelog: true}}'
    if sink_format == "delta":
        sink = f'{{path: "{base}/out", format: delta}}'
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"""
job: {job}
source: {{format: parquet, path: "{base}/in/*.parquet", splits_per_epoch: 1}}
key: user
aggregations:
{aggs}
sink: {sink}
storage: "{base}/ckpt"
parallelism: 3
max_parallelism: 16
checkpoint: {{every_epochs: 1, retained: 2}}
"""
    )
    run_env = ckpt_env(tmp_path / "home") | env
    done = kill_at_a_random_moment(spec, run_env, random.Random(seed), job)
    resumed = subprocess.run(
        [CKPT, "run", str(spec), "--parallelism", "2"],
        env=run_env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert resumed.returncode == 0, f"seed {seed}: {resumed.stderr[-2000:]}"
    ran = re.search(r"finished: (\d+) of (\d+) epochs run", resumed.stdout)
    assert ran is not None and int(ran[2]) == EPOCHS, (seed, resumed.stdout[-2000:])
    assert int(ran[1]) <= EPOCHS - done + 1, (seed, done, ran[0])  # resumed, not rerun

    if sink_format == "delta":
        _check_delta_table(f"{base}/out", job, files, seed)
    else:
        final = s3_parquet.read_final(f"{base}/out").to_pandas()
        final = final.sort_values("user").reset_index(drop=True)
        assert_matches_pandas(final, [pd.read_parquet(f) for f in files])
        manifests = s3_parquet.committed_manifests(f"{base}/out")
        assert [m["epoch"] for m in manifests] == list(range(EPOCHS)), seed  # each epoch once
    keys = [o.key for o in bucket.list("")]
    assert not [k for k in keys if "/_staging/" in k], seed  # nothing left staged
    ours = [k for k in keys if k.startswith(f"{prefix}ckpt/{job}/")]
    metadata = [k for k in ours if k.endswith("/_metadata")]
    assert metadata, keys  # the checkpoints are on the store


def _check_delta_table(url: str, job: str, files: list[Path], seed: int) -> None:
    """The Delta table at ``url`` read with delta-rs equals pandas' aggregates over ``files``;
    each checkpoint's app transaction is in its log once, the last one at the last epoch."""
    from tests.delta_helpers import delta_log, read_table, txn_counts

    assert_matches_pandas(read_table(url, ["user"]), [pd.read_parquet(f) for f in files])
    counts = txn_counts(url, job)
    assert counts and set(counts.values()) == {1}, (seed, counts)
    infos = [next(a["commitInfo"] for a in c if "commitInfo" in a) for c in delta_log(url)]
    assert int(infos[-1]["ckptEpoch"]) == EPOCHS - 1, (seed, infos[-1])


def storage_round_trip(base: str) -> None:
    """Checkpoint storage at ``base``: a write read back with its checksum, a corrupted read
    refused, the checkpoint's directory discarded as its ids give it."""
    from checkpointing.errors import CorruptSnapshotError
    from checkpointing.state.storage import CheckpointStorage

    storage = CheckpointStorage.from_url(base)
    location = storage.initialize_location_for_checkpoint("job", 7)
    info = storage.write_bytes(location.file_url("a"), b"state")
    assert storage.read_bytes(info.url, checksum=info.checksum, size=5) == b"state"
    assert storage.list_files(storage.job_url("job")) == [f"{base}/job/chk-7/a"]
    with pytest.raises(CorruptSnapshotError, match="checksum mismatch"):
        storage.read_bytes(info.url, checksum="sha256:" + "0" * 64)
    # a step savepoint's copy: the store's own (server-side), refused onto an existing file
    from checkpointing.errors import StorageError

    copy = storage.savepoint_url("job", 8) + "/a"
    storage.copy_file(info.url, copy, size=5, checksum=info.checksum)
    assert storage.read_bytes(copy, checksum=info.checksum, size=5) == b"state"
    with pytest.raises(StorageError, match="already exists"):
        storage.copy_file(info.url, copy, size=5, checksum=info.checksum)
    storage.delete(copy)
    from checkpointing.state.inventory import list_stored

    (stored,) = list_stored(storage, storage.job_url("job"))  # what gc sweeps
    assert (stored.url, stored.size, stored.modified_at.year >= 2024) == (info.url, 5, True)
    assert storage.discard_directory("job", 7, "checkpoint") == f"{base}/job/chk-7"
    assert storage.list_files(storage.job_url("job")) == [] and storage.size_of(info.url) is None


def missing_bucket_refusal(scheme: str) -> str:
    """The one-line refusal of a source glob in a bucket (container) that does not exist."""
    from checkpointing.state.object_store import ObjectStoreError, list_objects

    with pytest.raises(ObjectStoreError) as err:
        list_objects(f"{scheme}://no-such-bucket-ckpt/in/*.parquet")
    return str(err.value)
