"""A bucket (S3, GCS) or container (Azure): the few object operations the Parquet sink, the
checkpoint storage on GCS and Azure, and input listings need, one class per kind of store:
:class:`S3Bucket` through boto3 (ETags, conditional PUTs and server-side copies as S3 has them),
:class:`FsspecBucket` through gcsfs or adlfs (:mod:`checkpointing.state.cloud_filesystems`).

Keys are relative to the bucket. Every operation raises the library's own exception; the caller
turns it into one line naming its URL with :func:`store_error` (a missing bucket, missing
credentials, a denied access or an unreachable endpoint are :class:`ObjectStoreError`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from checkpointing.errors import ConfigError


class ObjectStoreError(ConfigError):
    """The object store refused or could not be reached (the message names the URL)."""


@dataclass(frozen=True)
class Listed:
    """One listed object (``key`` relative to the bucket; a folder ``name/`` has size 0)."""

    key: str
    size: int
    etag: str = ""
    #: ns since the epoch (None: not given)
    modified: int | None = None


class Bucket(ABC):
    """One bucket's objects; ``scheme://authority/`` is how their URLs begin."""

    def __init__(self, scheme: str, authority: str) -> None:
        self.scheme = scheme
        self.authority = authority

    def url(self, key: str) -> str:
        return f"{self.scheme}://{self.authority}/{key}"

    @abstractmethod
    def list(self, prefix: str, *, delimiter: bool = False) -> list[Listed]:
        """The objects whose keys start with ``prefix``; with ``delimiter``: only the level
        below it, folders as ``name/``."""

    @abstractmethod
    def get(self, key: str, limit: int | None = None) -> bytes | None:
        """The object's bytes (None: there is none); :class:`TooBig` over ``limit`` bytes."""

    @abstractmethod
    def size(self, key: str) -> int | None:
        """The object's size (None: there is none)."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """One atomic write: the object appears whole or not at all, replacing an older one."""

    @abstractmethod
    def put_new(self, key: str, data: bytes) -> bool:
        """A write only if there is no such object (False then): conditional where the store
        has it (S3 ``If-None-Match``, GCS ``ifGenerationMatch=0``, Azure ``If-None-Match``)."""

    @abstractmethod
    def copy(self, source: str, dest: str) -> None:
        """A server-side copy, replacing ``dest``."""

    @abstractmethod
    def delete(self, keys: Iterable[str]) -> None:
        """Delete these objects (missing ones are fine)."""


class TooBig(Exception):
    def __init__(self, size: int) -> None:
        super().__init__(f"{size} bytes")
        self.size = size


# ============================================================================ S3


class S3Bucket(Bucket):
    """boto3 (its standard chain; :func:`checkpointing.state.object_store.endpoint_url`)."""

    def __init__(self, authority: str, client: Any = None) -> None:
        super().__init__("s3", authority)
        if client is None:
            client = s3_client()
        self.client = client

    def list(self, prefix: str, *, delimiter: bool = False) -> list[Listed]:
        args: dict[str, Any] = {"Bucket": self.authority, "Prefix": prefix}
        if delimiter:
            args["Delimiter"] = "/"
        found = []
        for page in self.client.get_paginator("list_objects_v2").paginate(**args):
            for item in page.get("Contents", []):
                etag = str(item.get("ETag", "")).strip('"')
                when = ns(item.get("LastModified"))
                found.append(Listed(item["Key"], int(item["Size"]), etag, when))
            found += [Listed(p["Prefix"], 0) for p in page.get("CommonPrefixes", [])]
        return found

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        from botocore.exceptions import ClientError

        try:
            response = self.client.get_object(Bucket=self.authority, Key=key)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise
        size = int(response.get("ContentLength", 0))
        if limit is not None and size > limit:
            response["Body"].close()
            raise TooBig(size)
        return bytes(response["Body"].read())

    def size(self, key: str) -> int | None:
        from botocore.exceptions import ClientError

        try:
            return int(self.client.head_object(Bucket=self.authority, Key=key)["ContentLength"])
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.authority, Key=key, Body=data)

    def put_new(self, key: str, data: bytes) -> bool:
        """An endpoint without conditional writes (``NotImplemented``) gets a plain PUT."""
        from botocore.exceptions import ClientError

        try:
            self.client.put_object(Bucket=self.authority, Key=key, Body=data, IfNoneMatch="*")
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                return False
            if code not in ("NotImplemented", "501"):
                raise
            self.put(key, data)
        return True

    def copy(self, source: str, dest: str) -> None:
        """Multipart for big objects."""
        self.client.copy({"Bucket": self.authority, "Key": source}, self.authority, dest)

    def delete(self, keys: Iterable[str]) -> None:
        from checkpointing.errors import StorageError

        keys = list(keys)
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start : start + 1000]]
            response = self.client.delete_objects(
                Bucket=self.authority, Delete={"Objects": batch, "Quiet": True}
            )
            if response.get("Errors"):
                error = response["Errors"][0]
                raise StorageError(
                    f"cannot delete {self.url(str(error.get('Key')))}: "
                    f"{error.get('Code')} {error.get('Message', '')}".rstrip()
                )


# ============================================================================ GCS and Azure


class FsspecBucket(Bucket):
    """gcsfs or adlfs: their paths are ``bucket/key``."""

    def __init__(self, scheme: str, authority: str, fs: Any = None) -> None:
        from checkpointing.state import cloud_filesystems

        super().__init__(scheme, authority)
        self.name, _ = cloud_filesystems.container_and_account(authority)
        self.fs = fs if fs is not None else cloud_filesystems.filesystem(scheme, authority)

    def _path(self, key: str) -> str:
        return f"{self.name}/{key}"

    def _key(self, path: str) -> str:
        return path.removeprefix(f"{self.name}/")

    def list(self, prefix: str, *, delimiter: bool = False) -> list[Listed]:
        self.fs.invalidate_cache()
        if delimiter:
            folder = prefix.rpartition("/")[0]
            try:
                entries = self.fs.ls(self._path(folder), detail=True)
            except FileNotFoundError:
                self._check_bucket()
                return []
            found = []
            for e in entries:
                key = self._key(e["name"].rstrip("/"))
                if key.startswith(prefix):
                    is_dir = e.get("type") == "directory"
                    found.append(Listed(key + "/", 0) if is_dir else _listed(key, e))
            return found
        folder = prefix.rpartition("/")[0]
        try:
            entries = self.fs.find(self._path(folder), detail=True, withdirs=False)
        except FileNotFoundError:
            self._check_bucket()
            return []
        listed = (_listed(self._key(p), e) for p, e in entries.items())
        found = [o for o in listed if o.key.startswith(prefix) and not o.key.endswith("/")]
        if not found:  # adlfs lists a missing container as empty
            self._check_bucket()
        return found

    def _check_bucket(self) -> None:
        """A listing of a missing bucket and of a missing folder look alike in fsspec."""
        if not self.fs.exists(self.name):
            raise FileNotFoundError(f"bucket {self.name!r} does not exist")

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        size = self.size(key)
        if size is None:
            return None
        if limit is not None and size > limit:
            raise TooBig(size)
        try:
            return bytes(self.fs.cat_file(self._path(key)))
        except FileNotFoundError:
            return None

    def size(self, key: str) -> int | None:
        try:
            info = self.fs.info(self._path(key))
        except FileNotFoundError:
            return None
        return None if info.get("type") == "directory" else int(info["size"])

    def put(self, key: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(key), data)

    def put_new(self, key: str, data: bytes) -> bool:
        try:
            self.fs.pipe_file(self._path(key), data, mode="create")
        except FileExistsError:
            return False
        except Exception as exc:
            if _status(exc) in (409, 412):
                return False
            raise
        return True

    def copy(self, source: str, dest: str) -> None:
        self.fs.cp_file(self._path(source), self._path(dest))

    def delete(self, keys: Iterable[str]) -> None:
        paths = [self._path(k) for k in keys]
        for start in range(0, len(paths), 1000):
            batch = paths[start : start + 1000]
            try:
                self.fs.rm(batch)
            except FileNotFoundError:  # one of them gone already: the rest one by one
                for path in batch:
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.rm_file(path)


def _listed(key: str, entry: dict[str, Any]) -> Listed:
    etag = str(entry.get("etag") or entry.get("md5Hash") or entry.get("generation") or "")
    when = entry.get("mtime") or entry.get("updated") or entry.get("last_modified")
    return Listed(key, int(entry.get("size") or 0), etag.strip('"'), ns(when))


def _status(exc: BaseException) -> int | None:
    """The HTTP status of a gcsfs or Azure SDK error."""
    for name in ("code", "status_code", "status"):
        value = getattr(exc, name, None)
        if isinstance(value, int):
            return value
    return None


# ============================================================================ errors


def store_error(url: str, bucket: str, exc: BaseException) -> BaseException:
    """``exc`` as an :class:`ObjectStoreError` naming ``url`` when the store is missing,
    refuses the credentials or cannot be reached; else ``exc`` itself."""
    if type(exc).__module__.split(".")[0] in ("botocore", "boto3"):
        return s3_error(url, bucket, exc)  # type: ignore[arg-type]
    status = _status(exc)
    name = type(exc).__name__
    what = "container" if url.startswith("abfs") else "bucket"
    if (isinstance(exc, FileNotFoundError) and "does not exist" in str(exc)) or (
        name == "ResourceNotFoundError" and "ContainerNotFound" in str(exc)
    ):
        return ObjectStoreError(f"{url}: {what} {bucket!r} does not exist")
    if isinstance(exc, PermissionError) or status in (401, 403) or "Authentication" in name:
        return ObjectStoreError(f"{url}: access denied: check the credentials")
    if name in ("ServiceRequestError", "ClientConnectorError", "ConnectionError") or (
        isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError)
    ):
        return ObjectStoreError(f"{url}: cannot reach the object store ({name})")
    if "DefaultCredentialsError" in name or "credentials" in str(exc).lower()[:200]:
        return ObjectStoreError(f"{url}: no credentials found ({name})")
    return exc


def bucket_for(scheme: str, authority: str) -> Bucket:
    """The bucket of ``scheme://authority/``."""
    if scheme in ("s3", "s3a"):
        return S3Bucket(authority)
    return FsspecBucket(scheme, authority)


# ============================================================================ S3's conventions


def endpoint_url(environ: Mapping[str, str] | None = None) -> str | None:
    """The S3 endpoint boto3 would use: ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``."""
    env = os.environ if environ is None else environ
    return env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None


def ns(when: Any) -> int | None:
    """A listing's last-modified time (a datetime) in ns since the epoch."""
    if not hasattr(when, "timestamp"):
        return None
    return int(when.timestamp() * 1_000_000) * 1000


def s3_client() -> Any:
    """boto3's S3 client (its own chain reads the variables above), failing fast when the
    endpoint is unreachable: a refused run should say so in seconds, not after minutes. A new
    session each time: boto3's default one keeps the credentials it first found. The sessions
    share botocore's data loader (:func:`_data_loader`), so only the first parses the service
    models: a new session alone re-read them, about 0.2 s per client."""
    import boto3
    import botocore.session
    from botocore.config import Config

    loader = _data_loader()
    core = botocore.session.Session()
    core.register_component("data_loader", loader)
    session = boto3.session.Session(botocore_session=core)
    # each boto3 session appends its data folder to the loader's paths: keep each path once
    loader.search_paths[:] = list(dict.fromkeys(loader.search_paths))
    config = Config(connect_timeout=5, read_timeout=30, retries={"max_attempts": 2})
    return session.client("s3", config=config)


@functools.cache
def _data_loader() -> Any:
    """botocore's loader of its JSON service models and endpoints, made once per process
    (``AWS_DATA_PATH`` as botocore reads it): it caches what it parsed (the models, not
    credentials, which each session resolves anew)."""
    import botocore.loaders

    return botocore.loaders.create_loader(os.environ.get("AWS_DATA_PATH"))


def s3_error(pattern: str, bucket: str, exc: Exception) -> Exception:
    """:func:`store_error` for botocore's errors."""
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        EndpointConnectionError,
        NoCredentialsError,
    )

    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        if code == "NoSuchBucket":
            return ObjectStoreError(f"{pattern}: bucket {bucket!r} does not exist")
        if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
            return ObjectStoreError(f"{pattern}: access denied ({code}): check the credentials")
        return ObjectStoreError(f"{pattern}: cannot list the objects: {code or exc}")
    if isinstance(exc, NoCredentialsError):
        return ObjectStoreError(
            f"{pattern}: no AWS credentials found (set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, a profile, or an instance role)"
        )
    if isinstance(exc, EndpointConnectionError):
        return ObjectStoreError(
            f"{pattern}: cannot reach the S3 endpoint {endpoint_url() or 'of AWS'}"
        )
    if isinstance(exc, BotoCoreError):
        return ObjectStoreError(f"{pattern}: cannot list the objects: {exc}")
    return exc
