"""What lies in checkpoint storage, with sizes and modification times (for garbage collection):
the byte-level listing :class:`~checkpointing.state.storage.CheckpointStorage` does not need
elsewhere, for each backend, in-progress writes included."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from checkpointing.state.object_storage import ObjectCheckpointStorage
from checkpointing.state.s3_storage import S3CheckpointStorage, s3_errors
from checkpointing.state.storage import CheckpointStorage, FileSystemCheckpointStorage


@dataclass(frozen=True)
class StoredFile:
    """One file (object) in checkpoint storage."""

    url: str
    size: int
    modified_at: datetime


def list_stored(storage: CheckpointStorage, url: str) -> list[StoredFile]:
    """Every file below directory ``url``, sorted by URL; nothing for a missing directory."""
    if isinstance(storage, FileSystemCheckpointStorage):
        root = storage.path_of(url)
        if not root.is_dir():
            return []
        found = []
        for p in root.rglob("*"):
            try:
                st = p.stat()
            except FileNotFoundError:  # deleted while listing
                continue
            if p.is_file():
                when = datetime.fromtimestamp(st.st_mtime, UTC)
                found.append(StoredFile("file://" + str(p), st.st_size, when))
        return sorted(found, key=lambda f: f.url)
    if isinstance(storage, S3CheckpointStorage):
        bucket, prefix = storage.split(url.rstrip("/") + "/")
        found = []
        with s3_errors("list", url):
            paginator = storage.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    when = obj["LastModified"]
                    when = when.replace(tzinfo=UTC) if when.tzinfo is None else when
                    found.append(StoredFile(f"s3://{bucket}/{obj['Key']}", obj["Size"], when))
        return sorted(found, key=lambda f: f.url)
    if isinstance(storage, ObjectCheckpointStorage):  # GCS, Azure
        now = datetime.now(UTC)  # an unknown modification time is never old enough to delete
        found = [
            StoredFile(
                storage.bucket.url(o.key),
                o.size,
                now if o.modified is None else datetime.fromtimestamp(o.modified / 1e9, UTC),
            )
            for o in storage.listed(url)
        ]
        return sorted(found, key=lambda f: f.url)
    raise TypeError(f"cannot list {type(storage).__name__}")


def remove_empty_dirs(
    storage: CheckpointStorage, urls: set[str], stop: str, keep: Sequence[str] = ()
) -> None:
    """Remove each of ``urls`` and its parents strictly below ``stop`` while they are empty,
    never one of ``keep`` (a local filesystem's directories; object stores have none)."""
    if not isinstance(storage, FileSystemCheckpointStorage):
        return
    top = storage.path_of(stop)
    kept = {storage.path_of(url) for url in keep}
    for url in sorted(urls, key=len, reverse=True):
        path = storage.path_of(url)
        while path != top and top in path.parents and path not in kept:
            try:
                path.rmdir()  # only ever an empty one
            except FileNotFoundError:
                pass
            except OSError:
                break  # not empty: leave it and its parents
            path = path.parent
