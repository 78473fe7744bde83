"""The ``_metadata`` file: round trip, rejection of every kind of corrupt file (always a
``CorruptSnapshotError`` naming the path, never a half-loaded object), and handle verification."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pickle
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from checkpointing.errors import CorruptSnapshotError
from checkpointing.state.metadata import (
    CheckpointMetadata,
    OperatorState,
    SubtaskStateHandle,
    read_metadata,
    verify_handles,
)
from checkpointing.state.s3_storage import S3CheckpointStorage
from checkpointing.state.storage import (
    CheckpointStorage,
    FileSystemCheckpointStorage,
    StorageLocation,
)

JOB = "job-1"
TRIGGER = datetime(2024, 5, 17, 12, 0, 0, 123000, tzinfo=UTC)


@pytest.fixture(params=["file", "s3"])
def any_storage(request: pytest.FixtureRequest) -> CheckpointStorage:
    """The local ``storage`` fixture, or S3 storage at ``s3://<fresh bucket>/base``."""
    if request.param == "file":
        local: CheckpointStorage = request.getfixturevalue("storage")
        return local
    bucket: str = request.getfixturevalue("s3_bucket")
    return S3CheckpointStorage(f"s3://{bucket}/base")


def make_checkpoint(
    storage: CheckpointStorage, checkpoint_id: int = 3
) -> tuple[StorageLocation, CheckpointMetadata]:
    """A checkpoint with real state files: two operators, one subtask stateless."""
    location = storage.initialize_location_for_checkpoint(JOB, checkpoint_id)
    files = {
        ("source", 0): os.urandom(100),
        ("source", 1): os.urandom(250),
        ("agg", 0): os.urandom(1000),
    }
    infos = {
        key: storage.write_bytes(location.file_url(*map(str, key)), v) for key, v in files.items()
    }

    def subtask(op: str, index: int) -> SubtaskStateHandle:
        info = infos.get((op, index))
        return SubtaskStateHandle(
            subtask_index=index,
            attempt_id=f"{op}-{index}-attempt-0",
            handle=info.url if info else None,
            size=info.size if info else 0,
            checksum=info.checksum if info else None,
        )

    metadata = CheckpointMetadata(
        job_id=JOB,
        checkpoint_id=checkpoint_id,
        checkpoint_type="CHECKPOINT",
        trigger_at=TRIGGER,
        completed_at=TRIGGER + timedelta(seconds=2),
        operators=[
            OperatorState(
                operator_id="source",
                parallelism=2,
                max_parallelism=128,
                subtasks=[subtask("source", 0), subtask("source", 1)],
            ),
            OperatorState(
                operator_id="agg",
                parallelism=2,
                max_parallelism=128,
                subtasks=[subtask("agg", 0), subtask("agg", 1)],  # agg/1 is stateless
            ),
        ],
    )
    return location, metadata


def canonical_digest(body: Any) -> str:
    """The documented checksum: SHA-256 of the body as compact, key-sorted JSON."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(canonical).hexdigest()


def envelope(metadata: CheckpointMetadata) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(metadata.to_bytes())
    return doc


def resealed(doc: dict[str, Any]) -> bytes:
    """The document with its checksum recomputed, as a forger or a buggy writer would."""
    doc = copy.deepcopy(doc)
    doc["checksum"] = canonical_digest(doc["body"])
    return json.dumps(doc).encode()


# ============================================================================ round trip


def test_to_bytes_format(storage: FileSystemCheckpointStorage) -> None:
    _location, metadata = make_checkpoint(storage)
    doc = envelope(metadata)
    assert set(doc) == {"format", "version", "checksum", "body"}
    assert doc["format"] == "ckpt-metadata"
    assert doc["version"] == 2
    assert doc["checksum"] == canonical_digest(doc["body"])
    assert doc["body"]["job_id"] == JOB
    assert doc["body"]["checkpoint_id"] == 3
    assert datetime.fromisoformat(doc["body"]["trigger_at"]) == TRIGGER
    assert b"\x80" not in metadata.to_bytes()  # JSON text, not pickle


def test_round_trip_through_bytes(storage: FileSystemCheckpointStorage) -> None:
    _location, metadata = make_checkpoint(storage)
    data = metadata.to_bytes()
    loaded = CheckpointMetadata.from_bytes(data, "somewhere/_metadata")
    assert loaded == metadata
    assert loaded.trigger_at == TRIGGER
    assert loaded.trigger_at.utcoffset() == timedelta(0)
    assert loaded.operators[1].subtasks[1].handle is None
    assert loaded.to_bytes() == data  # stable: a re-written file is byte-identical


def test_naive_datetimes_round_trip(storage: FileSystemCheckpointStorage) -> None:
    _location, metadata = make_checkpoint(storage)
    naive = metadata.model_copy(
        update={"trigger_at": datetime(2024, 1, 1), "completed_at": datetime(2024, 1, 1, 0, 1)}
    )
    assert CheckpointMetadata.from_bytes(naive.to_bytes(), "p") == naive


def test_read_metadata_from_storage(any_storage: CheckpointStorage) -> None:
    location, metadata = make_checkpoint(any_storage)
    info = any_storage.write_bytes(location.metadata_url, metadata.to_bytes(), overwrite=False)
    assert read_metadata(any_storage, location.metadata_url) == metadata
    assert read_metadata(any_storage, location.metadata_url, info.checksum) == metadata
    # the metastore's file checksum is checked too
    other = "sha256:" + "0" * 64
    with pytest.raises(CorruptSnapshotError) as err:
        read_metadata(any_storage, location.metadata_url, other)
    assert err.value.path == location.metadata_url


def test_read_metadata_of_a_missing_file(any_storage: CheckpointStorage) -> None:
    url = any_storage.initialize_location_for_checkpoint(JOB, 1).metadata_url
    with pytest.raises(CorruptSnapshotError, match="file is missing") as err:
        read_metadata(any_storage, url)
    assert err.value.path == url


def test_state_size_and_handles(storage: FileSystemCheckpointStorage) -> None:
    _location, metadata = make_checkpoint(storage)
    assert metadata.state_size == 100 + 250 + 1000
    handles = metadata.handles()
    assert [(h.attempt_id, h.size) for h in handles] == [
        ("source-0-attempt-0", 100),
        ("source-1-attempt-0", 250),
        ("agg-0-attempt-0", 1000),
    ]  # operator order, stateless subtask left out
    assert all(h.handle and h.checksum for h in handles)
    empty = metadata.model_copy(update={"operators": []})
    assert empty.state_size == 0
    assert empty.handles() == []


# ============================================================================ corrupt files


def _edit_body(edit: Callable[[dict[str, Any]], None], *, reseal: bool) -> Callable[[bytes], bytes]:
    def corrupt(data: bytes) -> bytes:
        doc = json.loads(data)
        edit(doc["body"])
        return resealed(doc) if reseal else json.dumps(doc).encode()

    return corrupt


def _edit_doc(edit: Callable[[dict[str, Any]], None]) -> Callable[[bytes], bytes]:
    def corrupt(data: bytes) -> bytes:
        doc = json.loads(data)
        edit(doc)
        return json.dumps(doc).encode()

    return corrupt


def _set(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    return lambda d: d.__setitem__(key, value)


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda d: d.__delitem__(key)


def _set_subtask(key: str, value: object) -> Callable[[dict[str, Any]], None]:
    return lambda body: body["operators"][0]["subtasks"][0].__setitem__(key, value)


class _Exploit:
    """Unpickling this would create a file: proof that nobody unpickles ``_metadata``."""

    sentinel = ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (Path(self.sentinel), "pwned"))


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "empty": lambda d: b"",
    "truncated-half": lambda d: d[: len(d) // 2],
    "truncated-last-byte": lambda d: d[:-1],
    "not-json": lambda d: b"this is not json",
    "invalid-utf8": lambda d: b"\xff\xfe\xfa" + d,
    "nul-bytes": lambda d: b"\x00" * len(d),
    "json-array": lambda d: b"[1, 2, 3]",
    "json-string": lambda d: b'"ckpt-metadata"',
    "json-null": lambda d: b"null",
    "huge-integer": lambda d: b"1" * 5000,
    "deeply-nested": lambda d: b"[" * 100_000,
    "wrong-format": _edit_doc(_set("format", "flink-metadata")),
    "missing-format": _edit_doc(_drop("format")),
    "version-3": _edit_doc(_set("version", 3)),
    "version-0": _edit_doc(_set("version", 0)),
    "version-string": _edit_doc(_set("version", "1")),
    "version-true": _edit_doc(_set("version", True)),
    "version-float": _edit_doc(_set("version", 1.0)),
    "missing-version": _edit_doc(_drop("version")),
    "missing-checksum": _edit_doc(_drop("checksum")),
    "checksum-null": _edit_doc(_set("checksum", None)),
    "checksum-other": _edit_doc(_set("checksum", "sha256:" + "0" * 64)),
    "missing-body": _edit_doc(_drop("body")),
    "body-list": _edit_doc(_set("body", [])),
    "body-null": _edit_doc(_set("body", None)),
    "extra-envelope-field": _edit_doc(_set("signed_by", "mallory")),
    "edited-size": _edit_body(_set_subtask("size", 1), reseal=False),
    "edited-handle": _edit_body(_set_subtask("handle", "file:///etc/passwd"), reseal=False),
    "edited-checkpoint-id": _edit_body(_set("checkpoint_id", 4), reseal=False),
    "dropped-operator": _edit_body(lambda b: b["operators"].pop(), reseal=False),
    "resealed-missing-field": _edit_body(_drop("operators"), reseal=True),
    "resealed-checkpoint-id-0": _edit_body(_set("checkpoint_id", 0), reseal=True),
    "resealed-checkpoint-id-text": _edit_body(_set("checkpoint_id", "three"), reseal=True),
    "resealed-bad-date": _edit_body(_set("trigger_at", "yesterday"), reseal=True),
    "resealed-operators-dict": _edit_body(_set("operators", {}), reseal=True),
    "resealed-negative-size": _edit_body(_set_subtask("size", -1), reseal=True),
    "resealed-parallelism-0": _edit_body(
        lambda b: b["operators"][0].__setitem__("parallelism", 0), reseal=True
    ),
    "resealed-handle-number": _edit_body(_set_subtask("handle", 12), reseal=True),
    "resealed-extra-body-field": _edit_body(_set("note", "unknown"), reseal=True),
    "resealed-extra-subtask-field": _edit_body(_set_subtask("offset", 7), reseal=True),
    "resealed-empty-body": _edit_body(lambda b: b.clear(), reseal=True),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_metadata_is_rejected_with_its_path(
    storage: FileSystemCheckpointStorage, corruption: str
) -> None:
    location, metadata = make_checkpoint(storage)
    data = CORRUPTIONS[corruption](metadata.to_bytes())
    assert data != metadata.to_bytes()
    storage.write_bytes(location.metadata_url, data)

    with pytest.raises(CorruptSnapshotError) as err:
        read_metadata(storage, location.metadata_url)
    assert err.value.path == location.metadata_url
    assert str(err.value).startswith(f"{location.metadata_url}: ")
    with pytest.raises(CorruptSnapshotError) as err:
        CheckpointMetadata.from_bytes(data, "the/path/_metadata")
    assert err.value.path == "the/path/_metadata"


@pytest.mark.parametrize("protocol", [0, pickle.HIGHEST_PROTOCOL])
def test_a_pickle_payload_is_never_unpickled(
    storage: FileSystemCheckpointStorage, tmp_path: Path, protocol: int
) -> None:
    location, metadata = make_checkpoint(storage)
    sentinel = tmp_path / "pwned"
    _Exploit.sentinel = str(sentinel)
    payload = pickle.dumps(_Exploit(), protocol=protocol)
    assert not sentinel.exists()
    storage.write_bytes(location.metadata_url, payload)

    with pytest.raises(CorruptSnapshotError) as err:
        read_metadata(storage, location.metadata_url)
    assert err.value.path == location.metadata_url
    assert not sentinel.exists()
    # a pickled CheckpointMetadata is no better
    storage.write_bytes(location.metadata_url, pickle.dumps(metadata, protocol=protocol))
    with pytest.raises(CorruptSnapshotError):
        read_metadata(storage, location.metadata_url)


def test_corrupt_metadata_on_both_backends(any_storage: CheckpointStorage) -> None:
    location, metadata = make_checkpoint(any_storage)
    any_storage.write_bytes(location.metadata_url, metadata.to_bytes()[:-10])
    with pytest.raises(CorruptSnapshotError, match="not valid metadata JSON") as err:
        read_metadata(any_storage, location.metadata_url)
    assert err.value.path == location.metadata_url


def test_whitespace_outside_the_body_is_harmless(storage: FileSystemCheckpointStorage) -> None:
    """The checksum covers the canonical body, so re-indenting a valid file keeps it valid."""
    _location, metadata = make_checkpoint(storage)
    reformatted = json.dumps(envelope(metadata), indent=4).encode()
    assert CheckpointMetadata.from_bytes(reformatted, "p") == metadata


# ============================================================================ verify_handles


@pytest.mark.parametrize("deep", [True, False], ids=["deep", "shallow"])
def test_verify_handles_accepts_intact_files(
    any_storage: CheckpointStorage, deep: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of the three state files is checked once (read and checksummed when deep, its size
    asked otherwise), the stateless subtask's absent handle not at all, and nothing fails."""
    _location, metadata = make_checkpoint(any_storage)
    files = {h.handle: h.size for h in metadata.files()}
    assert len(files) == 3 and None not in files  # the stateless subtask has no file
    seen: list[tuple[str, str, int | None]] = []
    read, size_of = any_storage.read_bytes, any_storage.size_of

    def counting_read(url: str, **kwargs: Any) -> bytes:
        data = read(url, **kwargs)
        seen.append(("read", url, kwargs.get("size")))
        assert kwargs.get("checksum") is not None  # verified, not just read
        return data

    def counting_size(url: str) -> int | None:
        seen.append(("size", url, None))
        return size_of(url)

    monkeypatch.setattr(any_storage, "read_bytes", counting_read)
    monkeypatch.setattr(any_storage, "size_of", counting_size)
    verify_handles(any_storage, metadata, deep=deep)
    if deep:
        assert sorted(seen) == sorted(("read", url, size) for url, size in files.items())
    else:
        assert sorted(seen) == sorted(("size", url, None) for url in files)


def _handle(metadata: CheckpointMetadata, attempt_id: str) -> SubtaskStateHandle:
    return next(h for h in metadata.handles() if h.attempt_id == attempt_id)


def test_verify_handles_flipped_byte_deep_only(any_storage: CheckpointStorage) -> None:
    _location, metadata = make_checkpoint(any_storage)
    victim = _handle(metadata, "source-1-attempt-0")
    assert victim.handle is not None
    data = bytearray(any_storage.read_bytes(victim.handle))
    data[17] ^= 0x80
    any_storage.write_bytes(victim.handle, bytes(data))

    with pytest.raises(CorruptSnapshotError, match="checksum mismatch") as err:
        verify_handles(any_storage, metadata, deep=True)
    assert err.value.path == victim.handle
    verify_handles(any_storage, metadata, deep=False)  # same size: shallow cannot tell


def test_verify_handles_truncated_file(any_storage: CheckpointStorage) -> None:
    _location, metadata = make_checkpoint(any_storage)
    victim = _handle(metadata, "agg-0-attempt-0")
    assert victim.handle is not None
    any_storage.write_bytes(victim.handle, any_storage.read_bytes(victim.handle)[:999])
    for deep in (True, False):
        with pytest.raises(CorruptSnapshotError, match="size 999 bytes, expected 1000") as err:
            verify_handles(any_storage, metadata, deep=deep)
        assert err.value.path == victim.handle


def test_verify_handles_missing_file(any_storage: CheckpointStorage) -> None:
    _location, metadata = make_checkpoint(any_storage)
    victim = _handle(metadata, "source-0-attempt-0")
    assert victim.handle is not None
    any_storage.delete(victim.handle)
    for deep in (True, False):
        with pytest.raises(CorruptSnapshotError, match="file is missing") as err:
            verify_handles(any_storage, metadata, deep=deep)
        assert err.value.path == victim.handle


def test_verify_handles_without_recorded_checksum_checks_size(
    storage: FileSystemCheckpointStorage,
) -> None:
    location = storage.initialize_location_for_checkpoint(JOB, 1)
    info = storage.write_bytes(location.file_url("op", "0"), b"abcd")
    metadata = CheckpointMetadata(
        job_id=JOB,
        checkpoint_id=1,
        checkpoint_type="CHECKPOINT",
        trigger_at=TRIGGER,
        completed_at=TRIGGER,
        operators=[
            OperatorState(
                operator_id="op",
                parallelism=1,
                max_parallelism=1,
                subtasks=[
                    SubtaskStateHandle(
                        subtask_index=0, attempt_id="a", handle=info.url, size=4, checksum=None
                    )
                ],
            )
        ],
    )
    storage.write_bytes(info.url, b"abce")  # same size, no checksum to catch it
    verify_handles(storage, metadata, deep=True)
    storage.write_bytes(info.url, b"abc")
    with pytest.raises(CorruptSnapshotError, match="size 3 bytes, expected 4"):
        verify_handles(storage, metadata, deep=True)
