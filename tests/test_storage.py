"""Checkpoint storage against the local filesystem and a real S3 endpoint (moto's server).

Whatever both backends share is parametrised over ``file`` and ``s3``. What lands where is checked
with an independent view of the bytes (``os`` for the filesystem, a separate boto3 client for S3),
not only through the storage object under test.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import pytest

from checkpointing.errors import ConfigError, CorruptSnapshotError, InvalidIdError, StorageError
from checkpointing.ids import validate_checkpoint_id, validate_id
from checkpointing.state.s3_storage import S3CheckpointStorage
from checkpointing.state.storage import (
    METADATA_FILE,
    CheckpointStorage,
    FileInfo,
    FileSystemCheckpointStorage,
    StorageLocation,
)
from checkpointing.state.storage_roots import DisallowedStorageError, require_allowed

MiB = 1 << 20
JOB = "job-1"


# ============================================================================ helpers


@pytest.fixture(params=["file", "s3"])
def any_storage(request: pytest.FixtureRequest) -> CheckpointStorage:
    """The local ``storage`` fixture, or S3 storage at ``s3://<fresh bucket>/base``."""
    if request.param == "file":
        local: CheckpointStorage = request.getfixturevalue("storage")
        return local
    bucket: str = request.getfixturevalue("s3_bucket")
    return S3CheckpointStorage(f"s3://{bucket}/base")


@pytest.fixture
def s3_storage(s3_bucket: str) -> S3CheckpointStorage:
    return S3CheckpointStorage(f"s3://{s3_bucket}/base")


def _bucket_of(storage: S3CheckpointStorage) -> str:
    return storage.base_url.removeprefix("s3://").partition("/")[0]


def physical_files(storage: CheckpointStorage) -> set[str]:
    """Every file under the base, relative to it, seen without the storage object (for the local
    backend this includes hidden temp files)."""
    if isinstance(storage, FileSystemCheckpointStorage):
        root = Path(storage.base_url.removeprefix("file://"))
        if not root.exists():
            return set()
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    assert isinstance(storage, S3CheckpointStorage)
    bucket, _, prefix = storage.base_url.removeprefix("s3://").partition("/")
    pages = (
        boto3.client("s3")
        .get_paginator("list_objects_v2")
        .paginate(Bucket=bucket, Prefix=prefix + "/")
    )
    return {
        obj["Key"].removeprefix(prefix + "/") for page in pages for obj in page.get("Contents", [])
    }


def pending_multipart_uploads(storage: S3CheckpointStorage) -> list[Any]:
    uploads: list[Any] = (
        boto3.client("s3").list_multipart_uploads(Bucket=_bucket_of(storage)).get("Uploads", [])
    )
    return uploads


def record_s3_operations(storage: S3CheckpointStorage) -> list[str]:
    """Names of the S3 API operations the storage's (real) client sends from now on."""
    ops: list[str] = []

    def before_call(model: Any, **_: Any) -> None:
        ops.append(model.name)

    storage.client.meta.events.register("before-call.s3.*", before_call)
    return ops


class BrokenStream(io.RawIOBase):
    """A source stream that yields ``good`` bytes, then fails (a dying task, a dropped socket)."""

    def __init__(self, good: int) -> None:
        self._left = good

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._left <= 0:
            raise OSError("source stream broke")
        n = min(len(buffer), self._left)
        buffer[:n] = b"x" * n
        self._left -= n
        return n


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def outside_url(storage: CheckpointStorage, tmp_path: Path) -> str:
    """A normalised directory URL of the same scheme that is not under the storage base."""
    if isinstance(storage, S3CheckpointStorage):
        return f"s3://{_bucket_of(storage)}/elsewhere"
    return f"file://{tmp_path / 'elsewhere'}"


# ============================================================================ layout


def test_layout_urls(any_storage: CheckpointStorage, tmp_path: Path) -> None:
    base = any_storage.base_url
    if isinstance(any_storage, S3CheckpointStorage):
        assert base == f"s3://{_bucket_of(any_storage)}/base"
    else:
        assert base == f"file://{tmp_path}/checkpoints"
    assert any_storage.job_url(JOB) == f"{base}/{JOB}"
    assert any_storage.checkpoint_url(JOB, 7) == f"{base}/{JOB}/chk-7"
    assert any_storage.savepoint_url(JOB, 7) == f"{base}/{JOB}/savepoints/savepoint-7"
    assert any_storage.shared_url(JOB) == f"{base}/{JOB}/shared"


def test_base_url_is_normalised(tmp_path: Path) -> None:
    expected = f"file://{tmp_path}/ckpt"
    assert FileSystemCheckpointStorage(f"file://{tmp_path}/ckpt/").base_url == expected
    assert FileSystemCheckpointStorage(f"{tmp_path}/ckpt").base_url == expected
    assert S3CheckpointStorage("s3://bkt/some/prefix/").base_url == "s3://bkt/some/prefix"


def test_initialize_location_for_checkpoint(any_storage: CheckpointStorage) -> None:
    location = any_storage.initialize_location_for_checkpoint(JOB, 7)
    url = f"{any_storage.base_url}/{JOB}/chk-7"
    assert location.url == location.reference == url
    assert location.metadata_url == f"{url}/{METADATA_FILE}" == f"{url}/_metadata"
    assert location.file_url("op-a", "3.state") == f"{url}/op-a/3.state"
    if isinstance(any_storage, FileSystemCheckpointStorage):
        assert any_storage.path_of(url).is_dir()

    any_storage.write_bytes(location.file_url("op-a", "3.state"), b"state")
    any_storage.write_bytes(location.metadata_url, b"meta", overwrite=False)
    assert physical_files(any_storage) == {f"{JOB}/chk-7/op-a/3.state", f"{JOB}/chk-7/_metadata"}
    assert any_storage.list_files(location.url) == [
        location.metadata_url,
        location.file_url("op-a", "3.state"),
    ]


def test_file_url_only_takes_safe_names(any_storage: CheckpointStorage) -> None:
    location = any_storage.initialize_location_for_checkpoint(JOB, 1)
    for bad in ["..", "a/b", "", ".hidden", "a\\b", "_metadata"]:
        # "_metadata" is not a valid id, so no task file can ever clobber the metadata file
        with pytest.raises(InvalidIdError, match="file name"):
            location.file_url("op", bad)


def test_default_savepoint_location(any_storage: CheckpointStorage) -> None:
    location = any_storage.initialize_location_for_savepoint(JOB, 3)
    assert location.url == f"{any_storage.base_url}/{JOB}/savepoints/savepoint-3"
    assert location.metadata_url == f"{location.url}/_metadata"
    any_storage.write_bytes(location.file_url("x"), b"1")
    assert physical_files(any_storage) == {f"{JOB}/savepoints/savepoint-3/x"}


def test_savepoint_into_target_outside_the_base(
    any_storage: CheckpointStorage, tmp_path: Path
) -> None:
    target = outside_url(any_storage, tmp_path)
    location = any_storage.initialize_location_for_savepoint(JOB, 3, target + "/")
    assert location.url == f"{target}/savepoint-3"
    assert location.owns(location.file_url("op", "0"))
    info = any_storage.write_bytes(location.file_url("op", "0"), b"savepoint state")
    assert any_storage.read_bytes(info.url, checksum=info.checksum) == b"savepoint state"
    # the target is a root for this location only, never for the storage as a whole
    with pytest.raises(InvalidIdError, match="outside checkpoint storage"):
        any_storage.require_within(info.url)
    assert any_storage.require_within(info.url, location.url) == info.url
    assert physical_files(any_storage) == set()


def test_savepoint_target_may_be_a_plain_absolute_path(
    storage: FileSystemCheckpointStorage, tmp_path: Path
) -> None:
    location = storage.initialize_location_for_savepoint(JOB, 4, str(tmp_path / "sp"))
    assert location.url == f"file://{tmp_path}/sp/savepoint-4"
    assert (tmp_path / "sp" / "savepoint-4").is_dir()
    storage.write_bytes(location.metadata_url, b"m", overwrite=False)
    assert (tmp_path / "sp" / "savepoint-4" / "_metadata").read_bytes() == b"m"


def test_savepoint_target_refuses_an_occupied_savepoint_directory(
    any_storage: CheckpointStorage, tmp_path: Path
) -> None:
    """Another job already wrote savepoint-3 into the shared target: refuse, and never touch it
    (a failed savepoint disposes of its whole location)."""
    target = outside_url(any_storage, tmp_path)
    theirs = any_storage.initialize_location_for_savepoint("other-job", 3, target)
    mine = any_storage.write_bytes(theirs.metadata_url, b"their savepoint")
    with pytest.raises(StorageError, match="already exists and is not empty"):
        any_storage.initialize_location_for_savepoint(JOB, 3, target)
    assert any_storage.read_bytes(mine.url, checksum=mine.checksum) == b"their savepoint"
    # another id in the same target is fine
    other = any_storage.initialize_location_for_savepoint(JOB, 4, target)
    assert other.url == f"{target}/savepoint-4"


@pytest.mark.parametrize(
    ("target", "error", "match"),
    [
        ("s3://bkt/savepoints", InvalidIdError, "must use the job's storage"),
        # valid storage since gs:// is one (its roots are checked when it is requested:
        # test_a_gs_target_is_storage_that_must_be_in_a_root), but not the job's
        ("gs://bkt/savepoints", InvalidIdError, "must use the job's storage"),
        ("ftp://bkt/savepoints", ConfigError, "expected file:///absolute/path"),
        ("relative/savepoints", ConfigError, "expected file:///absolute/path"),
        ("file://relative/savepoints", ConfigError, "needs an absolute path"),
        ("file:///tmp/a/../../etc", InvalidIdError, "not a normalised path"),
        ("file:///tmp/./x", InvalidIdError, "not a normalised path"),
    ],
)
def test_local_savepoint_target_validation(
    storage: FileSystemCheckpointStorage, target: str, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        storage.initialize_location_for_savepoint(JOB, 1, target)
    with pytest.raises(error, match=match):
        storage.check_target(target)


@pytest.mark.parametrize(
    ("target", "error", "match"),
    [
        ("file:///tmp/savepoints", InvalidIdError, "must use the job's storage"),
        ("s3:///savepoints", ConfigError, "expected s3://bucket/prefix"),
        ("s3://", ConfigError, "expected file:///absolute/path or s3://bucket/prefix"),
        ("s3://bkt/a/../../x", InvalidIdError, "not a normalised path"),
    ],
)
def test_s3_savepoint_target_validation(
    s3_storage: S3CheckpointStorage, target: str, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        s3_storage.initialize_location_for_savepoint(JOB, 1, target)
    assert physical_files(s3_storage) == set()


def test_a_gs_target_is_storage_that_must_be_in_a_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gs:// is checkpoint storage (commit 920ab30): a gs:// target parses, and is then
    taken only inside an allowed root, as any target is."""
    assert not isinstance(CheckpointStorage.from_url("gs://bkt/sp"), FileSystemCheckpointStorage)
    monkeypatch.setenv("CKPT_STORAGE_URL", f"file://{tmp_path / 'ckpt'}")
    monkeypatch.delenv("CKPT_STORAGE_ROOTS", raising=False)
    with pytest.raises(DisallowedStorageError, match="not under an allowed checkpoint storage"):
        require_allowed("gs://bkt/savepoints", job_id=JOB, field="target_location")
    monkeypatch.setenv("CKPT_STORAGE_ROOTS", "gs://bkt")
    assert require_allowed("gs://bkt/savepoints", job_id=JOB, field="target_location")
    with pytest.raises(DisallowedStorageError, match="not under an allowed checkpoint storage"):
        require_allowed("gs://other/savepoints", job_id=JOB, field="target_location")


def test_location_for(
    any_storage: CheckpointStorage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    created = any_storage.initialize_location_for_checkpoint(JOB, 7)
    location = any_storage.location_for(created.url + "/")
    assert location.url == created.url
    assert location.metadata_url == created.metadata_url
    assert location.owns(f"{created.url}/op/0")

    # an existing savepoint outside the base: only inside an allowed storage root
    outside = outside_url(any_storage, tmp_path) + "/savepoint-9"
    monkeypatch.delenv("CKPT_STORAGE_ROOTS", raising=False)
    with pytest.raises(DisallowedStorageError, match="not under an allowed checkpoint storage"):
        any_storage.location_for(outside)
    monkeypatch.setenv("CKPT_STORAGE_ROOTS", outside_url(any_storage, tmp_path))
    # then allowed, with exactly itself as the extra root
    elsewhere = any_storage.location_for(outside)
    assert elsewhere.url == outside
    assert elsewhere.owns(f"{outside}/op/0")
    assert not elsewhere.owns(f"{outside}-evil/op/0")
    with pytest.raises(InvalidIdError):
        any_storage.require_within(f"{outside}/op/0")

    for bad in [
        f"{any_storage.base_url}/{JOB}/../../escape",
        f"{any_storage.base_url}/{JOB}/./chk-7",
        f"{any_storage.base_url}/{JOB}\\chk-7",
        f"{any_storage.base_url}/{JOB}/chk-7\n",
    ]:
        with pytest.raises(InvalidIdError):
            any_storage.location_for(bad)


def test_storage_location_must_lie_within_a_root(any_storage: CheckpointStorage) -> None:
    elsewhere = (
        "file:///etc"
        if isinstance(any_storage, FileSystemCheckpointStorage)
        else "s3://other-bucket/x"
    )
    with pytest.raises(InvalidIdError, match="outside checkpoint storage"):
        StorageLocation(any_storage, elsewhere)
    assert StorageLocation(any_storage, elsewhere, extra_root=elsewhere).url == elsewhere


def test_owns(any_storage: CheckpointStorage) -> None:
    location = any_storage.initialize_location_for_checkpoint(JOB, 7)
    url = location.url
    assert location.owns(url)
    assert location.owns(f"{url}/_metadata")
    assert location.owns(f"{url}/op/sub/0")
    assert not location.owns(f"{any_storage.base_url}/{JOB}/chk-70/op/0")  # prefix, not child
    assert not location.owns(f"{any_storage.base_url}/{JOB}/chk-8/op/0")
    assert not location.owns(f"{any_storage.base_url}/{JOB}")
    assert not location.owns(f"{url}/../chk-8/op/0")
    assert not location.owns(f"{url}/op\\..\\..\\chk-8")


def test_dispose_on_failure_removes_only_its_own_location(any_storage: CheckpointStorage) -> None:
    doomed = any_storage.initialize_location_for_checkpoint(JOB, 1)
    for parts in [("op-a", "0"), ("op-a", "1"), ("op-b", "nested", "0"), ("top",)]:
        any_storage.write_bytes(doomed.file_url(*parts), b"doomed")
    keep: set[str] = set()
    for checkpoint_id in (10, 2):  # chk-10 shares the "chk-1" prefix
        sibling = any_storage.initialize_location_for_checkpoint(JOB, checkpoint_id)
        any_storage.write_bytes(sibling.file_url("op-a", "0"), b"keep")
        keep.add(f"{JOB}/chk-{checkpoint_id}/op-a/0")
    savepoint = any_storage.initialize_location_for_savepoint(JOB, 1)
    any_storage.write_bytes(savepoint.metadata_url, b"keep")
    any_storage.write_bytes(f"{any_storage.shared_url(JOB)}/blob", b"keep")
    any_storage.write_bytes(f"{any_storage.checkpoint_url('job-2', 1)}/op-a/0", b"keep")
    keep |= {f"{JOB}/savepoints/savepoint-1/_metadata", f"{JOB}/shared/blob", "job-2/chk-1/op-a/0"}
    assert len(physical_files(any_storage)) == len(keep) + 4

    doomed.dispose_on_failure()

    assert physical_files(any_storage) == keep
    assert any_storage.list_files(doomed.url) == []
    if isinstance(any_storage, FileSystemCheckpointStorage):
        assert not any_storage.path_of(doomed.url).exists()
    doomed.dispose_on_failure()  # already gone: fine
    assert physical_files(any_storage) == keep


def test_a_delete_through_a_symlink_below_the_base_is_refused(tmp_path: Path) -> None:
    """Issue 28: with ``base/jobA`` a symlink to another folder, disposing ``jobA``'s chk-7
    deleted ``victim/chk-7``, outside the base ("inside" was checked on the URL's string)."""
    victim = tmp_path / "victim"
    (victim / "chk-7" / "op").mkdir(parents=True)
    (victim / "chk-7" / "op" / "0").write_bytes(b"not ours")
    (victim / "file").write_bytes(b"not ours")
    real_base = tmp_path / "real-base"
    real_base.mkdir()
    (tmp_path / "base").symlink_to(real_base)  # the base itself may be a symlink
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'base'}")
    (real_base / "jobA").symlink_to(victim)

    location = storage.location_for(storage.checkpoint_url("jobA", 7))
    with pytest.raises(StorageError, match=r"jobA/chk-7: it resolves to .*victim/chk-7, outside"):
        location.dispose_on_failure()
    with pytest.raises(StorageError, match="a symlink below the base"):
        storage.delete(f"{storage.job_url('jobA')}/file")
    assert (victim / "chk-7" / "op" / "0").read_bytes() == b"not ours"
    assert (victim / "file").read_bytes() == b"not ours"

    # through the (symlinked) base without a symlink below it: deleted as before
    own = storage.initialize_location_for_checkpoint("jobB", 1)
    storage.write_bytes(own.file_url("op", "0"), b"ours")
    own.dispose_on_failure()
    assert not (real_base / "jobB" / "chk-1").exists()


def test_list_files_is_recursive_and_sorted(any_storage: CheckpointStorage) -> None:
    location = any_storage.initialize_location_for_checkpoint(JOB, 1)
    urls = [location.file_url(*p) for p in [("b",), ("a", "z"), ("a", "b", "c"), ("c",)]]
    for url in urls:
        any_storage.write_bytes(url, b"1")
    assert any_storage.list_files(location.url) == sorted(urls)
    assert any_storage.list_files(location.url + "/a") == sorted(urls[1:3])
    assert any_storage.list_files(any_storage.checkpoint_url(JOB, 2)) == []


# ============================================================================ atomic publish


def test_failed_write_publishes_nothing(any_storage: CheckpointStorage) -> None:
    location = any_storage.initialize_location_for_checkpoint(JOB, 1)
    url = location.file_url("op", "0")
    with pytest.raises(StorageError, match="source stream broke"):
        any_storage._write(url, BrokenStream(good=3 * MiB), 4 * MiB, overwrite=True)
    assert not any_storage.exists(url)
    assert any_storage.size_of(url) is None
    assert any_storage.list_files(location.url) == []
    assert physical_files(any_storage) == set()  # local: no leftover temp file either
    if isinstance(any_storage, FileSystemCheckpointStorage):
        assert list(any_storage.path_of(location.url).rglob("*")) == [
            any_storage.path_of(f"{location.url}/op")
        ]
    with pytest.raises(CorruptSnapshotError, match="file is missing"):
        any_storage.read_bytes(url)


def test_failed_overwrite_keeps_the_previous_version(any_storage: CheckpointStorage) -> None:
    url = any_storage.initialize_location_for_checkpoint(JOB, 1).file_url("op", "0")
    first = any_storage.write_bytes(url, b"version one")
    with pytest.raises(StorageError):
        any_storage._write(url, BrokenStream(good=2 * MiB), 3 * MiB, overwrite=True)
    assert any_storage.read_bytes(url, checksum=first.checksum, size=first.size) == b"version one"
    assert physical_files(any_storage) == {f"{JOB}/chk-1/op/0"}


def test_local_failure_removes_temp_file_for_any_exception(
    storage: FileSystemCheckpointStorage,
) -> None:
    """Not only OSError: whatever the source raises, the temp file is gone."""

    class Exploding(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, buffer: Any) -> int:
            raise RuntimeError("task crashed")

    url = storage.initialize_location_for_checkpoint(JOB, 1).file_url("x")
    with pytest.raises(RuntimeError, match="task crashed"):
        storage._write(url, Exploding(), 10, overwrite=True)
    assert physical_files(storage) == set()


def test_write_without_overwrite_refuses_to_clobber(any_storage: CheckpointStorage) -> None:
    url = any_storage.initialize_location_for_checkpoint(JOB, 1).metadata_url
    first = any_storage.write_bytes(url, b"first", overwrite=False)
    with pytest.raises(StorageError, match="already exists; refusing to overwrite") as err:
        any_storage.write_bytes(url, b"second!", overwrite=False)
    assert url in str(err.value)
    assert any_storage.read_bytes(url, checksum=first.checksum) == b"first"
    assert physical_files(any_storage) == {f"{JOB}/chk-1/_metadata"}  # no temp file left

    second = any_storage.write_bytes(url, b"second!", overwrite=True)
    assert any_storage.read_bytes(url, checksum=second.checksum) == b"second!"
    assert physical_files(any_storage) == {f"{JOB}/chk-1/_metadata"}


def test_s3_no_overwrite_is_a_conditional_put(s3_storage: S3CheckpointStorage) -> None:
    """Not check-then-put: the PUT itself carries ``If-None-Match: *`` (moto enforces it, see
    test_write_without_overwrite_refuses_to_clobber)."""
    sent: list[str | None] = []

    def before_send(request: Any, **_: Any) -> None:
        value = request.headers.get("If-None-Match")
        sent.append(value.decode() if isinstance(value, bytes) else value)

    s3_storage.client.meta.events.register("before-send.s3.PutObject", before_send)
    url = f"{s3_storage.checkpoint_url(JOB, 1)}/_metadata"
    s3_storage.write_bytes(url, b"m", overwrite=False)
    s3_storage.write_bytes(f"{url}-copy", b"m", overwrite=True)
    assert sent == ["*", None]


def test_s3_multipart_upload_publishes_the_whole_object(s3_storage: S3CheckpointStorage) -> None:
    s3_storage.MULTIPART_THRESHOLD = 1024  # this instance only
    assert s3_storage.MULTIPART_THRESHOLD != S3CheckpointStorage.MULTIPART_THRESHOLD
    ops = record_s3_operations(s3_storage)
    data = os.urandom(9 * MiB)  # above boto3's own 8 MiB threshold: a real multipart upload
    url = f"{s3_storage.checkpoint_url(JOB, 1)}/op/0"

    info = s3_storage.write_bytes(url, data)

    assert info == FileInfo(url, len(data), sha256(data))
    assert "CreateMultipartUpload" in ops and "CompleteMultipartUpload" in ops
    assert "PutObject" not in ops
    bucket, key = s3_storage.split(url)
    head = boto3.client("s3").head_object(Bucket=bucket, Key=key)
    assert head["ContentLength"] == len(data)
    assert head["ETag"].strip('"').endswith("-2")  # two parts
    assert s3_storage.read_bytes(url, checksum=info.checksum, size=info.size) == data
    assert pending_multipart_uploads(s3_storage) == []


def test_s3_small_write_through_upload_fileobj(s3_storage: S3CheckpointStorage) -> None:
    s3_storage.MULTIPART_THRESHOLD = 16
    url = f"{s3_storage.checkpoint_url(JOB, 1)}/op/0"
    data = b"0123456789" * 100
    info = s3_storage.write_bytes(url, data)
    assert s3_storage.read_bytes(url, checksum=info.checksum, size=len(data)) == data


def test_s3_failed_multipart_upload_is_aborted(s3_storage: S3CheckpointStorage) -> None:
    s3_storage.MULTIPART_THRESHOLD = 1024
    ops = record_s3_operations(s3_storage)
    url = f"{s3_storage.checkpoint_url(JOB, 1)}/op/0"
    with pytest.raises(StorageError, match="source stream broke"):
        s3_storage._write(url, BrokenStream(good=17 * MiB), 20 * MiB, overwrite=True)
    assert "CreateMultipartUpload" in ops  # it did get as far as a multipart upload
    assert "AbortMultipartUpload" in ops
    assert "CompleteMultipartUpload" not in ops
    assert pending_multipart_uploads(s3_storage) == []
    assert not s3_storage.exists(url)
    assert physical_files(s3_storage) == set()


def test_s3_multipart_without_overwrite_refuses_to_clobber(
    s3_storage: S3CheckpointStorage,
) -> None:
    url = f"{s3_storage.checkpoint_url(JOB, 1)}/_metadata"
    first = s3_storage.write_bytes(url, b"first", overwrite=False)
    s3_storage.MULTIPART_THRESHOLD = 16
    with pytest.raises(StorageError, match="already exists; refusing to overwrite"):
        s3_storage.write_bytes(url, b"y" * 4096, overwrite=False)
    assert s3_storage.read_bytes(url, checksum=first.checksum) == b"first"


def test_local_list_files_hides_temp_files(storage: FileSystemCheckpointStorage) -> None:
    location = storage.initialize_location_for_checkpoint(JOB, 1)
    directory = storage.path_of(location.url)
    (directory / ".0.0123abcd.inprogress").write_bytes(b"half")  # a writer that died mid-write
    storage.write_bytes(location.file_url("0"), b"done")
    assert storage.list_files(location.url) == [location.file_url("0")]


# ============================================================================ checksums


@pytest.mark.parametrize("data", [b"", b"x", os.urandom(3 * MiB + 7)], ids=["empty", "1B", "3MiB"])
def test_write_bytes_returns_checksum_and_size(any_storage: CheckpointStorage, data: bytes) -> None:
    url = any_storage.initialize_location_for_checkpoint(JOB, 1).file_url("op", "0")
    info = any_storage.write_bytes(url, data)
    assert info == FileInfo(url=url, size=len(data), checksum=sha256(data))
    assert any_storage.size_of(url) == len(data)
    assert any_storage.exists(url)
    assert any_storage.read_bytes(url, checksum=info.checksum, size=info.size) == data


def _tamper(storage: CheckpointStorage, url: str, data: bytes) -> None:
    """Replace a file's bytes behind the storage's back."""
    if isinstance(storage, FileSystemCheckpointStorage):
        storage.path_of(url).write_bytes(data)
    else:
        assert isinstance(storage, S3CheckpointStorage)
        bucket, key = storage.split(url)
        boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=data)


def test_read_bytes_detects_a_flipped_byte(any_storage: CheckpointStorage) -> None:
    url = any_storage.initialize_location_for_checkpoint(JOB, 1).file_url("op", "0")
    data = os.urandom(4096)
    info = any_storage.write_bytes(url, data)
    flipped = bytearray(data)
    flipped[1234] ^= 0x01
    _tamper(any_storage, url, bytes(flipped))

    with pytest.raises(CorruptSnapshotError) as err:
        any_storage.read_bytes(url, checksum=info.checksum, size=info.size)
    assert err.value.path == url
    assert str(err.value) == f"{url}: checksum mismatch"
    # a size check alone cannot see a flipped byte
    assert any_storage.read_bytes(url, size=info.size) == bytes(flipped)


def test_read_bytes_detects_truncation(any_storage: CheckpointStorage) -> None:
    url = any_storage.initialize_location_for_checkpoint(JOB, 1).file_url("op", "0")
    data = os.urandom(4096)
    info = any_storage.write_bytes(url, data)
    _tamper(any_storage, url, data[:-1])

    with pytest.raises(CorruptSnapshotError) as err:
        any_storage.read_bytes(url, checksum=info.checksum, size=info.size)
    assert err.value.path == url
    assert str(err.value) == f"{url}: size 4095 bytes, expected 4096"
    with pytest.raises(CorruptSnapshotError, match="checksum mismatch") as err:
        any_storage.read_bytes(url, checksum=info.checksum)
    assert err.value.path == url


def test_read_bytes_of_a_missing_file(any_storage: CheckpointStorage) -> None:
    url = any_storage.initialize_location_for_checkpoint(JOB, 1).file_url("op", "0")
    with pytest.raises(CorruptSnapshotError) as err:
        any_storage.read_bytes(url, checksum=sha256(b""), size=0)
    assert err.value.path == url
    assert str(err.value) == f"{url}: file is missing"
    assert any_storage.size_of(url) is None
    assert not any_storage.exists(url)
    any_storage.delete(url)  # missing is fine


def test_delete_removes_one_file(any_storage: CheckpointStorage) -> None:
    location = any_storage.initialize_location_for_checkpoint(JOB, 1)
    any_storage.write_bytes(location.file_url("a"), b"1")
    any_storage.write_bytes(location.file_url("ab"), b"2")
    any_storage.delete(location.file_url("a"))
    assert physical_files(any_storage) == {f"{JOB}/chk-1/ab"}


# ============================================================================ ids and URLs


@pytest.mark.parametrize("value", ["a", "job-1", "A.b_c-9", "0", "x" * 128])
def test_validate_id_accepts_safe_segments(value: str) -> None:
    assert validate_id(value, "job id") == value


@pytest.mark.parametrize(
    "value",
    [
        "",
        ".",
        "..",
        "a..b",
        "..a",
        "/",
        "a/b",
        "/abs",
        "/etc/passwd",
        "\\",
        "a\\b",
        "C:\\x",
        "a\x00b",
        "a\nb",
        "abc\n",  # a regex ending in "$" alone would let this through
        "a\tb",
        "a\x7f",
        "x" * 129,
        ".hidden",
        "-rf",
        "_x",
        " a",
        "a b",
        "jöb",
        "a:b",
    ],
)
def test_validate_id_rejects_unsafe_segments(value: str) -> None:
    with pytest.raises(InvalidIdError, match="invalid operator id"):
        validate_id(value, "operator id")


@pytest.mark.parametrize("value", [None, 1, b"job", Path("job"), ["job"]])
def test_validate_id_rejects_non_strings(value: object) -> None:
    with pytest.raises(InvalidIdError, match="job id must be a string"):
        validate_id(value, "job id")


@pytest.mark.parametrize(("value", "expected"), [(1, 1), (2**40, 2**40), ("7", 7)])
def test_validate_checkpoint_id_accepts_positive_ints(value: object, expected: int) -> None:
    result = validate_checkpoint_id(value)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(
    "value", [0, -1, True, False, 1.5, 2.0, "0", "-3", "abc", "", None, "../1", "1/2", "0x10"]
)
def test_validate_checkpoint_id_rejects_everything_else(value: object) -> None:
    with pytest.raises(InvalidIdError, match="expected a positive integer"):
        validate_checkpoint_id(value)


def test_layout_refuses_unsafe_ids(any_storage: CheckpointStorage) -> None:
    for job_id in ["..", "../other", "a/b", "", "x" * 129]:
        with pytest.raises(InvalidIdError, match="job id"):
            any_storage.initialize_location_for_checkpoint(job_id, 1)
    for checkpoint_id in [0, -1, True]:
        with pytest.raises(InvalidIdError, match="checkpoint id"):
            any_storage.initialize_location_for_checkpoint(JOB, checkpoint_id)
        with pytest.raises(InvalidIdError, match="checkpoint id"):
            any_storage.initialize_location_for_savepoint(JOB, checkpoint_id)
    assert physical_files(any_storage) == set()
    if isinstance(any_storage, FileSystemCheckpointStorage):
        base = any_storage.path_of(any_storage.base_url)
        assert not base.exists() or list(base.iterdir()) == []


def test_require_within(any_storage: CheckpointStorage, tmp_path: Path) -> None:
    base = any_storage.base_url
    assert any_storage.require_within(base) == base
    assert any_storage.require_within(f"{base}/{JOB}/chk-1/x") == f"{base}/{JOB}/chk-1/x"
    outside = outside_url(any_storage, tmp_path)
    other_scheme = (
        "s3://bkt/base/x" if isinstance(any_storage, FileSystemCheckpointStorage) else "file:///x"
    )
    refused = [
        f"{outside}/x",
        f"{base}-evil/x",  # shares the prefix, not a child
        f"{base}/{JOB}/../../escape",
        f"{base}/{JOB}/./chk-1",
        f"{base}/..",
        f"{base}/{JOB}\\..\\..\\x",
        f"{base}/{JOB}/chk-1/\x00",
        other_scheme,
        base.removeprefix("file://").removeprefix("s3://"),
    ]
    if isinstance(any_storage, FileSystemCheckpointStorage):
        refused += ["file:///etc/passwd", "/etc/passwd"]
    else:
        refused += ["s3://other-bucket/base/x"]
    for url in refused:
        with pytest.raises(InvalidIdError) as err:
            any_storage.require_within(url)
        assert repr(url) in str(err.value)
    # explicit extra roots, and only those
    assert any_storage.require_within(f"{outside}/x", None, outside) == f"{outside}/x"
    with pytest.raises(InvalidIdError):
        any_storage.require_within(f"{outside}/../x", outside)
    with pytest.raises(InvalidIdError):
        any_storage.require_within(f"{outside}-2/x", outside)


def test_local_require_within_etc_only_as_an_explicit_root(
    storage: FileSystemCheckpointStorage,
) -> None:
    with pytest.raises(InvalidIdError, match="outside checkpoint storage"):
        storage.require_within("file:///etc/passwd")
    assert storage.require_within("file:///etc/passwd", "file:///etc") == "file:///etc/passwd"
    assert storage.require_within("file:///etc/passwd", "file:///etc/") == "file:///etc/passwd"
    with pytest.raises(InvalidIdError):
        storage.require_within("file:///etc/passwd", "file:///et")


def test_byte_operations_refuse_non_normalised_urls(
    any_storage: CheckpointStorage, tmp_path: Path
) -> None:
    escape = f"{any_storage.base_url}/{JOB}/../../escape"
    operations: list[Callable[[], object]] = [
        lambda: any_storage.write_bytes(escape, b"x"),
        lambda: any_storage.read_bytes(escape),
        lambda: any_storage.size_of(escape),
        lambda: any_storage.delete(escape),
        lambda: any_storage.delete_tree(escape),
        lambda: any_storage.list_files(escape),
    ]
    for operation in operations:
        with pytest.raises(InvalidIdError, match="not a normalised path"):
            operation()
    assert not (tmp_path / "escape").exists()
    if isinstance(any_storage, S3CheckpointStorage):
        bucket = _bucket_of(any_storage)
        assert boto3.client("s3").list_objects_v2(Bucket=bucket).get("Contents") is None


def test_byte_operations_refuse_the_other_scheme(any_storage: CheckpointStorage) -> None:
    if isinstance(any_storage, FileSystemCheckpointStorage):
        url, match = "s3://bkt/x", "is not a file:// URL"
    else:
        url, match = "file:///tmp/x", "is not an s3:// URL"
    with pytest.raises(InvalidIdError, match=match):
        any_storage.write_bytes(url, b"x")
    with pytest.raises(InvalidIdError, match=match):
        any_storage.read_bytes(url)


def test_from_url_picks_the_backend(tmp_path: Path) -> None:
    s3 = CheckpointStorage.from_url("s3://bkt/prefix/")
    assert isinstance(s3, S3CheckpointStorage)
    assert s3.base_url == "s3://bkt/prefix"
    local = CheckpointStorage.from_url(f"file://{tmp_path}")
    assert isinstance(local, FileSystemCheckpointStorage)
    assert local.base_url == f"file://{tmp_path}"
    plain = CheckpointStorage.from_url(str(tmp_path))
    assert isinstance(plain, FileSystemCheckpointStorage)
    assert plain.base_url == f"file://{tmp_path}"


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("", "expected file:///absolute/path or s3://bucket/prefix"),
        ("hdfs://nn/prefix", "expected file:///absolute/path or s3://bucket/prefix"),
        ("http://host/x", "expected file:///absolute/path or s3://bucket/prefix"),
        ("S3://bkt/prefix", "expected file:///absolute/path or s3://bucket/prefix"),
        ("relative/dir", "expected file:///absolute/path or s3://bucket/prefix"),
        ("./dir", "expected file:///absolute/path or s3://bucket/prefix"),
        ("file://relative/dir", "a file:// URL needs an absolute path"),
        ("file://", "a file:// URL needs an absolute path"),
        ("s3://", "expected s3://bucket/prefix"),
        ("s3:///prefix", "expected s3://bucket/prefix"),
    ],
)
def test_from_url_errors_name_the_url(url: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        CheckpointStorage.from_url(url)
    assert repr(url) in str(err.value)


# ============================================================================ pickling


def test_s3_storage_pickles_without_its_client(s3_storage: S3CheckpointStorage) -> None:
    url = f"{s3_storage.checkpoint_url(JOB, 1)}/op/0"
    info = s3_storage.write_bytes(url, b"from the driver")  # the client now exists
    client = s3_storage.client
    with pytest.raises(Exception, match="pickle"):
        pickle.dumps(client)  # hence __getstate__

    restored = pickle.loads(pickle.dumps(s3_storage))

    assert isinstance(restored, S3CheckpointStorage)
    assert restored.base_url == s3_storage.base_url
    assert restored.__dict__["_client"] is None
    assert s3_storage.client is client  # the original keeps its client
    # a fresh client, built on the "executor" from the standard chain, reaches the endpoint
    assert restored.read_bytes(url, checksum=info.checksum) == b"from the driver"
    assert restored.client is not client
    written = restored.write_bytes(f"{s3_storage.checkpoint_url(JOB, 1)}/op/1", b"from a task")
    assert s3_storage.read_bytes(written.url, checksum=written.checksum) == b"from a task"


def test_s3_storage_with_an_injected_client_pickles(s3_bucket: str) -> None:
    storage = S3CheckpointStorage(f"s3://{s3_bucket}/base", client=boto3.client("s3"))
    restored = pickle.loads(pickle.dumps(storage))
    assert restored.__dict__["_client"] is None
    info = restored.write_bytes(f"{storage.checkpoint_url(JOB, 1)}/x", b"1")
    assert storage.read_bytes(info.url, checksum=info.checksum) == b"1"


def test_local_storage_pickles(storage: FileSystemCheckpointStorage) -> None:
    info = storage.write_bytes(f"{storage.checkpoint_url(JOB, 1)}/x", b"1")
    restored = pickle.loads(pickle.dumps(storage))
    assert restored.base_url == storage.base_url
    assert restored.read_bytes(info.url, checksum=info.checksum) == b"1"


def test_s3_unreachable_endpoint_is_a_storage_error_naming_the_url(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Connection failures never leak as raw botocore exceptions."""
    import boto3
    from botocore.config import Config

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    client = boto3.client(
        "s3",
        endpoint_url="http://127.0.0.1:9",
        region_name="us-east-1",
        config=Config(retries={"max_attempts": 1}, connect_timeout=1, read_timeout=1),
    )
    storage = S3CheckpointStorage("s3://nowhere/base", client=client)
    url = "s3://nowhere/base/job/chk-1/f"
    for call in (
        lambda: storage.read_bytes(url),
        lambda: storage.size_of(url),
        lambda: storage.delete(url),
        lambda: storage.delete_tree("s3://nowhere/base/job"),
        lambda: storage.list_files("s3://nowhere/base/job"),
        lambda: storage.write_bytes(url, b"x"),
    ):
        with pytest.raises(StorageError, match="s3://nowhere/base/job"):
            call()


def test_local_delete_failures_are_reported(tmp_path: Path) -> None:
    storage = FileSystemCheckpointStorage(f"file://{tmp_path}")
    blocker = tmp_path / "job"
    blocker.write_text("a file where a directory is expected")
    with pytest.raises(StorageError, match="cannot delete"):
        storage.delete_tree(f"file://{blocker}/chk-1")
    storage.delete_tree(f"file://{tmp_path}/missing")  # missing is fine


def test_copy_file_is_server_side_on_s3_and_verified_everywhere(
    any_storage: CheckpointStorage,
) -> None:
    """A step savepoint's copy of a step file (issue 39): on S3 the store copies it (CopyObject,
    no GetObject: no byte through the driver), checked by its size; locally through memory,
    checked by its checksum. Either way the copy reads back as the original, an existing target
    is refused, and a copy whose recorded size is wrong is refused."""
    from checkpointing.errors import CorruptSnapshotError, StorageError

    data = bytes(range(256)) * 40
    source = f"{any_storage.checkpoint_url(JOB, 1)}/part-0.parquet"
    info = any_storage.write_bytes(source, data)
    target = f"{any_storage.savepoint_url(JOB, 2)}/part-0.parquet"
    ops = record_s3_operations(any_storage) if isinstance(any_storage, S3CheckpointStorage) else []
    any_storage.copy_file(source, target, size=len(data), checksum=info.checksum)
    if isinstance(any_storage, S3CheckpointStorage):
        assert "CopyObject" in ops and "GetObject" not in ops and "PutObject" not in ops, ops
    assert any_storage.read_bytes(target, size=len(data), checksum=info.checksum) == data
    with pytest.raises(StorageError, match="already exists"):
        any_storage.copy_file(source, target, size=len(data), checksum=info.checksum)
    assert any_storage.read_bytes(target) == data  # untouched
    with pytest.raises(CorruptSnapshotError, match="expected 7"):
        any_storage.copy_file(source, f"{target}-2", size=7, checksum=info.checksum)
    assert not any_storage.exists(f"{target}-2")  # the refused copy is not left behind
