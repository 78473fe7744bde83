"""Reads have limits (issue 10, §4 "Reads without limits"): a ``_metadata`` or state file is
refused by its size (stat / the GET's Content-Length) before it is read, never read past its bound,
never read at all when it is a device or a FIFO, and the snapshot reader refuses compressed record
batches (the writer never makes them; decoded, a few KiB can claim gigabytes).

Reads that would hang or exhaust memory without the bound run in a child process with a memory
cap and a timeout, so a regression fails the test instead of the machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import boto3
import pyarrow as pa
import pytest

from checkpointing.errors import ConfigError, CorruptSnapshotError
from checkpointing.state.keygroups import KeyGroupRange
from checkpointing.state.metadata import read_metadata
from checkpointing.state.s3_storage import S3CheckpointStorage
from checkpointing.state.snapshot import (
    read_keyed_snapshot,
    read_list_state,
    read_snapshot_info,
    write_keyed_snapshot,
    write_list_state,
)
from checkpointing.state.storage import (
    DEFAULT_MAX_EXTERNAL_METADATA_BYTES,
    DEFAULT_MAX_METADATA_BYTES,
    METADATA_FILE,
    CheckpointStorage,
    FileSystemCheckpointStorage,
)

JOB = "job-1"
CHILD = textwrap.dedent(
    """
    import resource, sys
    from checkpointing.restore import lookup as restore
    from checkpointing.errors import CheckpointingError
    from checkpointing.state.storage import FileSystemCheckpointStorage

    used = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (used + (768 << 20),) * 2)
    storage = FileSystemCheckpointStorage(sys.argv[1])
    try:
        if sys.argv[3] == "-":
            restore.load_external(storage, sys.argv[2])
        else:
            storage.read_bytes(sys.argv[2], size=int(sys.argv[3]))
    except CheckpointingError as exc:
        print(f"refused: {exc}")
    """
)


def _in_child(storage: FileSystemCheckpointStorage, url: str, size: str = "-") -> str:
    """Run the read in a child capped at its current memory + 768 MiB, for 60 s at most."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, storage.base_url, url, size],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=Path(__file__).parent.parent,
    )
    assert done.returncode == 0, done.stderr[-1500:]
    return done.stdout.strip()


@pytest.fixture
def s3_storage(s3_bucket: str) -> S3CheckpointStorage:
    return S3CheckpointStorage(f"s3://{s3_bucket}/base")


@pytest.fixture(params=["file", "s3"])
def any_storage(request: pytest.FixtureRequest) -> CheckpointStorage:
    if request.param == "file":
        local: CheckpointStorage = request.getfixturevalue("storage")
        return local
    remote: CheckpointStorage = request.getfixturevalue("s3_storage")
    return remote


def _put(storage: CheckpointStorage, url: str, data: bytes) -> None:
    """Write behind the storage's back (a planted or damaged file)."""
    if isinstance(storage, FileSystemCheckpointStorage):
        path = storage.path_of(url)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    else:
        assert isinstance(storage, S3CheckpointStorage)
        bucket, key = storage.split(url)
        boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=data)


def _count_s3_body_bytes(storage: CheckpointStorage, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes the storage reads from each GET's body from now on (S3 only; empty for files)."""
    read: list[int] = []
    if not isinstance(storage, S3CheckpointStorage):
        return read
    real = storage.client.get_object

    def get_object(**kwargs: Any) -> Any:
        response = real(**kwargs)
        body, plain = response["Body"], response["Body"].read

        def counting(amt: int | None = None) -> bytes:
            data: bytes = plain(amt)
            read.append(len(data))
            return data

        body.read = counting
        return response

    monkeypatch.setattr(storage.client, "get_object", get_object)
    return read


# ============================================================================ _metadata


def test_a_metadata_file_linked_to_dev_zero_is_refused_unread(
    storage: FileSystemCheckpointStorage,
) -> None:
    """The issue's case: ``ckpt restore-plan --from`` / the API's restore-plan on a
    ``_metadata`` that is a link to ``/dev/zero``."""
    directory = storage.path_of(storage.checkpoint_url(JOB, 1))
    directory.mkdir(parents=True)
    (directory / METADATA_FILE).symlink_to("/dev/zero")
    out = _in_child(storage, str(directory))
    assert out == f"refused: file://{directory}/_metadata: not a regular file; refusing to read it"


def test_a_metadata_fifo_is_refused_without_waiting_for_a_writer(
    storage: FileSystemCheckpointStorage,
) -> None:
    directory = storage.path_of(storage.checkpoint_url(JOB, 1))
    directory.mkdir(parents=True)
    os.mkfifo(directory / METADATA_FILE)
    out = _in_child(storage, str(directory))
    assert out.endswith("_metadata: not a regular file; refusing to read it")


def test_an_oversized_metadata_file_is_refused_before_its_body_is_read(
    any_storage: CheckpointStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert any_storage.max_metadata_bytes == DEFAULT_MAX_METADATA_BYTES == 64 << 20
    any_storage.max_metadata_bytes = 1024
    url = f"{any_storage.checkpoint_url(JOB, 1)}/{METADATA_FILE}"
    _put(any_storage, url, b"{" + b" " * 4094 + b"}")
    body_reads = _count_s3_body_bytes(any_storage, monkeypatch)
    with pytest.raises(CorruptSnapshotError) as err:
        read_metadata(any_storage, url)
    assert str(err.value) == f"{url}: size 4096 bytes is over the read limit of 1024 bytes"
    assert sum(body_reads) == 0
    any_storage.max_metadata_bytes = 4096  # at the limit: read (and then judged as metadata)
    with pytest.raises(CorruptSnapshotError, match=r": not a \S+ file$"):
        read_metadata(any_storage, url)


def test_the_metadata_limit_is_configurable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CKPT_MAX_METADATA_BYTES", "2048")
    assert FileSystemCheckpointStorage(f"file://{tmp_path}").max_metadata_bytes == 2048
    monkeypatch.setenv("CKPT_MAX_METADATA_BYTES", "lots")
    with pytest.raises(ConfigError, match=r"^CKPT_MAX_METADATA_BYTES='lots': expected a"):
        FileSystemCheckpointStorage(f"file://{tmp_path}")


def test_a_metadata_file_given_by_path_has_a_lower_limit(
    any_storage: CheckpointStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28: an external ``_metadata`` (deploy ``from``, ``--restore PATH``) was read and
    parsed up to the 64 MiB cap before anything vouched for it (16 MiB grew memory by 418 MiB).
    By path it is now refused over 4 MiB, unread; the job's own checkpoints keep their cap."""
    from checkpointing.restore.lookup import load_external

    assert any_storage.max_external_metadata_bytes == DEFAULT_MAX_EXTERNAL_METADATA_BYTES
    assert DEFAULT_MAX_EXTERNAL_METADATA_BYTES == 4 << 20
    directory = any_storage.savepoint_url(JOB, 3)
    url = f"{directory}/{METADATA_FILE}"
    size = (4 << 20) + 2
    _put(any_storage, url, b"{" + b" " * (size - 2) + b"}")
    body_reads = _count_s3_body_bytes(any_storage, monkeypatch)
    with pytest.raises(CorruptSnapshotError) as err:
        load_external(any_storage, directory)
    assert str(err.value) == f"{url}: size {size} bytes is over the read limit of {4 << 20} bytes"
    assert sum(body_reads) == 0
    with pytest.raises(CorruptSnapshotError, match=r": not a \S+ file$"):
        read_metadata(any_storage, url)  # a checkpoint of the job's own: read, then judged

    monkeypatch.setenv("CKPT_MAX_EXTERNAL_METADATA_BYTES", "many")
    with pytest.raises(ConfigError, match=r"^CKPT_MAX_EXTERNAL_METADATA_BYTES='many': expected"):
        FileSystemCheckpointStorage("file:///tmp/x")


# ============================================================================ state files


def test_a_state_file_is_bounded_by_its_recorded_size(
    any_storage: CheckpointStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = any_storage.initialize_location_for_checkpoint(JOB, 1).file_url("op", "0")
    _put(any_storage, url, os.urandom(2 << 20))  # 2 MiB where the ack recorded 64 bytes
    body_reads = _count_s3_body_bytes(any_storage, monkeypatch)
    with pytest.raises(CorruptSnapshotError) as err:
        any_storage.read_bytes(url, size=64)
    assert str(err.value) == f"{url}: size {2 << 20} bytes, expected 64"
    assert sum(body_reads) == 0
    with pytest.raises(CorruptSnapshotError, match="over the read limit of 1000 bytes"):
        any_storage.read_bytes(url, max_size=1000)
    assert len(any_storage.read_bytes(url, size=2 << 20)) == 2 << 20


def test_a_state_file_that_is_a_device_is_never_read(
    storage: FileSystemCheckpointStorage,
) -> None:
    url = storage.initialize_location_for_checkpoint(JOB, 1).file_url("op", "0")
    storage.path_of(url).parent.mkdir(parents=True)
    storage.path_of(url).symlink_to("/dev/zero")
    assert _in_child(storage, url, size="64").endswith("0: not a regular file; refusing to read it")


def test_the_executor_reads_restored_state_bounded_by_its_recorded_size(
    storage: FileSystemCheckpointStorage,
) -> None:
    """A restoring executor gets each file's recorded size with its checksum and reads no more
    (before, it read the whole file and checked only the checksum)."""
    from checkpointing.spark.executor import read_subtask_snapshots
    from checkpointing.spark.keys import KEY_GROUP, SUBTASK

    table = pa.table({"key_group": pa.array([1, 1], pa.int32()), "v": [1, 2]})
    data = write_keyed_snapshot(
        table, operator_id="op", key_groups=KeyGroupRange(0, 3), max_parallelism=4
    )
    url = storage.initialize_location_for_checkpoint(JOB, 1).file_url("op", "0")
    info = storage.write_bytes(url, data)
    row = {"part_key": 0, "urls": [url], "checksums": [info.checksum], "start": 0, "end": 3}
    columns = [KEY_GROUP, "v", SUBTASK]
    read = list(read_subtask_snapshots(storage, columns, ["v"], iter([_batch(row, info.size)])))
    assert sum(b.num_rows for b in read) == 2
    with pytest.raises(CorruptSnapshotError, match=f"size {info.size} bytes, expected 16"):
        list(read_subtask_snapshots(storage, columns, ["v"], iter([_batch(row, size=16)])))


def _batch(row: dict[str, Any], size: int) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist(
        [{**row, "sizes": [size]}],
        schema=pa.schema(
            [
                ("part_key", pa.int32()),
                ("urls", pa.list_(pa.string())),
                ("checksums", pa.list_(pa.string())),
                ("sizes", pa.list_(pa.int64())),
                ("start", pa.int32()),
                ("end", pa.int32()),
            ]
        ),
    )


# ============================================================================ compressed batches


def _write_compressed(table: pa.Table, meta: dict[str, str], codec: str) -> tuple[bytes, bytes]:
    """The IPC file of ``table`` with compressed record batches, and the bytes of its batches
    (what a segment's offset, length and sha256 describe)."""
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression=codec)
    with pa.ipc.new_file(sink, table.schema.with_metadata(meta), options=options) as writer:
        for batch in table.to_batches(max_chunksize=1 << 20):
            writer.write_batch(batch)
        end = sink.tell()
    data = sink.getvalue().to_pybytes()
    start = 16 + int.from_bytes(data[12:16], "little")  # magic, then the schema message
    return data, data[start:end]


def _planted(table: pa.Table, meta: dict[str, str], key: str, codec: str) -> bytes:
    """A snapshot laid out as the writer does (index entry ``key`` with offsets and sha256 of
    the batches), except that its record batches are compressed: what a planted file looks
    like. Where the batches land does not depend on the index, so two passes suffice."""
    _, body = _write_compressed(table, {**meta, key: "{}"}, codec)
    entry = {
        "batch": 0,
        "batches": len(table.to_batches(max_chunksize=1 << 20)),
        "rows": table.num_rows,
        "offset": 0,
        "bytes": len(body),
        "sha256": "sha256:" + hashlib.sha256(body).hexdigest(),
    }
    value = json.dumps({"1": entry} if key == "ckpt.index" else entry)
    data, again = _write_compressed(table, {**meta, key: value}, codec)
    assert again == body
    return data


def test_a_compressed_record_batch_is_refused_before_it_is_decompressed() -> None:
    rows = 4_000_000  # 48 MB decoded, a few KiB on disk
    table = pa.table(
        {"key_group": pa.array([1] * rows, pa.int32()), "v": pa.array([0] * rows, pa.int64())}
    )
    meta = {
        "ckpt.format": "keyed-state",
        "ckpt.format_version": "1",
        "ckpt.operator_id": "op",
        "ckpt.max_parallelism": "4",
        "ckpt.key_group_start": "0",
        "ckpt.key_group_end": "3",
    }
    data = _planted(table, meta, "ckpt.index", "zstd")
    assert len(data) < 64 << 10
    assert read_snapshot_info(data).num_rows == rows  # the footer alone is fine
    with pytest.raises(CorruptSnapshotError) as err:
        read_keyed_snapshot(data, path="s3://b/chk-1/op-0")
    assert str(err.value) == (
        "s3://b/chk-1/op-0: key group 1: compressed record batch (never written), refused"
    )


def test_a_compressed_list_state_batch_is_refused() -> None:
    plain = write_list_state([{"path": "a", "epoch": 1}], operator_id="source")
    reader = pa.ipc.open_file(pa.py_buffer(plain))
    meta = {k.decode(): v.decode() for k, v in reader.schema.metadata.items()}
    data = _planted(reader.read_all(), meta, "ckpt.items", "lz4")
    with pytest.raises(CorruptSnapshotError, match="items: compressed record batch"):
        read_list_state(data)
