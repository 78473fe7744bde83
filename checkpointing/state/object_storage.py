"""Checkpoint storage on Google Cloud Storage (``gs://bucket/prefix``) and Azure Blob Storage /
ADLS Gen2 (``abfs[s]://container[@account.dfs.core.windows.net]/prefix``), through gcsfs and
adlfs (:mod:`checkpointing.state.buckets`; credentials from their own environment variables:
:mod:`checkpointing.state.cloud_filesystems`). Loaded by :meth:`CheckpointStorage.from_url` by
name, so that local storage never imports either. S3 has its own class
(:mod:`checkpointing.state.s3_storage`: multipart uploads and boto3's error codes).

Each write is one upload (the object appears whole or not at all); ``overwrite=False`` is a
conditional create where the store has one (GCS ``ifGenerationMatch=0``, Azure
``If-None-Match: *``).
"""

from __future__ import annotations

from typing import IO, Any

from checkpointing.errors import ConfigError, CorruptSnapshotError, InvalidIdError, StorageError
from checkpointing.state.buckets import Bucket, Listed, TooBig, bucket_for, store_error
from checkpointing.state.object_store import split_url
from checkpointing.state.storage import CheckpointStorage, TooBigError, check_normalised

#: the schemes this class serves
SCHEMES = ("gs", "abfs", "abfss")


class ObjectCheckpointStorage(CheckpointStorage):
    """GCS or Azure; see the module docstring."""

    def __init__(self, base_url: str, bucket: Bucket | None = None) -> None:
        super().__init__(base_url)
        scheme, _, rest = self.base_url.partition("://")
        authority = rest.partition("/")[0]
        if scheme not in SCHEMES or not authority:
            raise ConfigError(f"storage URL {base_url!r}: expected {scheme}://bucket/prefix")
        self.scheme = scheme
        self._authority = authority
        self._bucket = bucket

    def __getstate__(self) -> dict[str, Any]:
        # Spark ships storage objects to executors: they build their own client there
        return {**self.__dict__, "_bucket": None}

    @property
    def bucket(self) -> Bucket:
        if self._bucket is None:
            self._bucket = bucket_for(self.scheme, self._authority)
        return self._bucket

    def key(self, url: str) -> str:
        """The object key of ``url``, which must be of this storage's bucket."""
        prefix = f"{self.scheme}://{self._authority}/"
        if not url.startswith(prefix):
            raise InvalidIdError(f"{url!r} is not a {prefix} URL")
        check_normalised(url)
        return split_url(url)[1]

    def _fail(self, action: str, url: str, exc: BaseException) -> Exception:
        error = store_error(url, self._authority, exc)
        if error is not exc:
            return StorageError(str(error))
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        return StorageError(f"cannot {action} {url}: {first}")

    def _write(self, url: str, stream: IO[bytes], size: int, *, overwrite: bool) -> None:
        key = self.key(url)
        try:
            if overwrite:
                self.bucket.put(key, stream.read())
                return
            created = self.bucket.put_new(key, stream.read())
        except Exception as exc:
            raise self._fail("write", url, exc) from exc
        if not created:
            raise StorageError(f"{url} already exists; refusing to overwrite")

    def _server_copy(self, source: str, target: str) -> bool:
        """The store's own copy inside the bucket, after checking ``target`` is new."""
        source_key, key = self.key(source), self.key(target)
        if self.exists(target):
            raise StorageError(f"{target} already exists; refusing to overwrite")
        try:
            self.bucket.copy(source_key, key)
        except Exception as exc:
            raise self._fail("copy", source, exc) from exc
        return True

    def _read(self, url: str, limit: int | None) -> bytes:
        key = self.key(url)
        try:
            data = self.bucket.get(key, limit)
        except TooBig as exc:
            raise TooBigError(url, exc.size, limit or 0) from None
        except Exception as exc:
            raise self._fail("read", url, exc) from exc
        if data is None:
            raise CorruptSnapshotError(url, "file is missing")
        return data

    def size_of(self, url: str) -> int | None:
        key = self.key(url)
        try:
            return self.bucket.size(key)
        except Exception as exc:
            raise self._fail("stat", url, exc) from exc

    def make_dirs(self, url: str) -> None:
        """Object stores have no directories."""

    def delete(self, url: str) -> None:
        key = self.key(url)
        try:
            self.bucket.delete([key])
        except Exception as exc:
            raise self._fail("delete", url, exc) from exc

    def delete_tree(self, url: str) -> None:
        prefix = self.key(url.rstrip("/") + "/x")[:-1]
        try:
            self.bucket.delete([o.key for o in self.bucket.list(prefix)])
        except Exception as exc:
            raise self._fail("delete", url, exc) from exc

    def list_files(self, url: str) -> list[str]:
        return sorted(self.bucket.url(o.key) for o in self.listed(url))

    def listed(self, url: str) -> list[Listed]:
        """The objects below directory ``url``, with their sizes and modification times."""
        prefix = self.key(url.rstrip("/") + "/x")[:-1]
        try:
            return self.bucket.list(prefix)
        except Exception as exc:
            raise self._fail("list", url, exc) from exc
