"""Pipeline input on object storage (``s3://bucket/prefix/*.parquet``, ``s3a://`` alike,
``gs://``, ``abfs[s]://``), read through Arrow.

The driver lists the objects a source glob matches and reads Parquet footers to plan splits; the
executors read their splits. Both go through this one module, so that the driver and every
executor find the same endpoint and credentials: boto3's conventions, from the environment
(``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
``AWS_SESSION_TOKEN``, ``AWS_REGION`` or ``AWS_DEFAULT_REGION``), which the driver hands on to
its executors (:mod:`checkpointing.spark.executor_env`). No Hadoop S3 jars are needed: Spark's
own file reader never sees these URLs.

The listing uses boto3 because Arrow's does not give ETags: an object's identity is its key,
size and ETag, so a checkpoint can tell a replaced object from the one it was taken over.

GCS and Azure go through gcsfs and adlfs (:mod:`checkpointing.state.cloud_filesystems`: their
own environment variables), listed with ETags by :mod:`checkpointing.state.buckets` and read by
Arrow through fsspec. ``s3a://`` (what Spark users type) is S3: its objects are named ``s3://``.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from checkpointing.state.buckets import (
    ObjectStoreError,
    bucket_for,
    endpoint_url,
    store_error,
)
from checkpointing.state.buckets import ns as _ns
from checkpointing.state.buckets import s3_client as _client
from checkpointing.state.buckets import s3_error as _listing_error

if TYPE_CHECKING:
    import pyarrow
    import pyarrow.fs
    import pyarrow.parquet

#: the URL schemes read through this module (anything else with ``://``: not supported)
SCHEMES = ("s3", "s3a", "gs", "abfs", "abfss")
__all__ = ["ObjectStoreError", "_client", "_listing_error", "_ns", "endpoint_url"]


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: ``url`` (``s3://bucket/key``), its ``size`` and ``etag`` (unquoted),
    and when it was last written (``modified``, ns since the epoch; for ``source.max_file_age``,
    not part of its identity)."""

    url: str
    size: int
    etag: str
    modified: int | None = field(default=None, compare=False)


def is_object_url(path: str) -> bool:
    """Whether ``path`` is on an object store (not a local path or ``file://`` URL)."""
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.lower() in SCHEMES


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/key`` → ``(bucket, key)`` (an Azure URL's bucket is its authority:
    ``container`` or ``container@account.dfs.core.windows.net``); :class:`ObjectStoreError`
    when not of that form."""
    scheme, sep, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if not sep or scheme.lower() not in SCHEMES or not bucket or not key:
        raise ObjectStoreError(f"{url!r}: {expected_form(url, 'key')}")
    return bucket, key


def expected_form(url: str, rest: str) -> str:
    """``expected gs://bucket/<rest>``: the form a refused object URL should have, in the
    scheme the user typed (``s3`` when it has none of ours)."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    bucket = "container" if scheme in ("abfs", "abfss") else "bucket"
    return f"expected {scheme if scheme in SCHEMES else 's3'}://{bucket}/{rest}"


def scheme_of(url: str) -> str:
    """The store's scheme of an object URL: ``s3a`` is ``s3``."""
    scheme = url.partition("://")[0].lower()
    return "s3" if scheme == "s3a" else scheme


def canonical_url(url: str) -> str:
    """``url`` as this project names it: ``s3a://`` becomes ``s3://`` (the same objects)."""
    if url[:6].lower() == "s3a://":
        return "s3://" + url[6:]
    return url


def s3_options(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """:class:`pyarrow.fs.S3FileSystem` arguments from boto3's environment variables (Arrow's
    own defaults otherwise: its SDK's credential chain and region)."""
    env = os.environ if environ is None else environ
    options: dict[str, Any] = {}
    endpoint = endpoint_url(env)
    if endpoint:
        parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        options["endpoint_override"] = parts.netloc
        options["scheme"] = parts.scheme
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        options["region"] = region
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        options["access_key"] = env["AWS_ACCESS_KEY_ID"]
        options["secret_key"] = env["AWS_SECRET_ACCESS_KEY"]
        if env.get("AWS_SESSION_TOKEN"):
            options["session_token"] = env["AWS_SESSION_TOKEN"]
    return options


def filesystem_for(url: str) -> tuple[pyarrow.fs.FileSystem, str]:
    """The Arrow filesystem that reads ``url`` and the path to give it (``bucket/key``)."""
    from pyarrow import fs

    bucket, key = split_url(url)
    scheme = scheme_of(url)
    if scheme == "s3":
        return fs.S3FileSystem(**s3_options()), f"{bucket}/{key}"
    from checkpointing.state.cloud_filesystems import container_and_account

    name, _ = container_and_account(bucket)
    return _fsspec_arrow(scheme, bucket, _environment_key()), f"{name}/{key}"


def _environment_key() -> tuple[Any, ...]:
    """What a cached filesystem depends on: the process (a forked executor builds its own)
    and the credentials' variables."""
    from checkpointing.state.cloud_filesystems import AZURE_VARIABLES, GCS_VARIABLES

    names = (*GCS_VARIABLES, *AZURE_VARIABLES, "GOOGLE_APPLICATION_CREDENTIALS")
    return (os.getpid(), *(os.environ.get(n) for n in names))


@functools.lru_cache(maxsize=16)
def _fsspec_arrow(scheme: str, authority: str, _key: tuple[Any, ...]) -> pyarrow.fs.FileSystem:
    """gcsfs or adlfs as an Arrow filesystem (one per process, store and credentials)."""
    from pyarrow import fs

    from checkpointing.state.cloud_filesystems import filesystem

    return fs.PyFileSystem(fs.FSSpecHandler(filesystem(scheme, authority)))


def open_object(url: str) -> pyarrow.NativeFile:
    """``url`` opened for random access (a Parquet reader fetches only the ranges it needs)."""
    filesystem, path = filesystem_for(url)
    return filesystem.open_input_file(path)


def read_footer(url: str) -> pyarrow.parquet.FileMetaData:
    """The Parquet footer of ``url`` (a ranged read: no data pages)."""
    import pyarrow.parquet as pq

    with open_object(url) as file:
        return pq.ParquetFile(file).metadata


def read_schema(url: str) -> pyarrow.Schema:
    """The Arrow schema in the Parquet footer of ``url``."""
    return read_footer(url).schema.to_arrow_schema()


def list_objects(pattern: str) -> list[ObjectInfo]:
    """The objects whose keys match the glob in ``pattern`` (``*``, ``?`` and ``[..]`` within a
    path segment, as a local glob), sorted by key. Lists only the prefix before the first
    wildcard. :class:`ObjectStoreError` names the URL and the reason: no such bucket, no
    credentials, access denied, endpoint unreachable."""
    bucket, key_pattern = split_url(pattern)
    prefix = _fixed_prefix(key_pattern)
    try:
        store = bucket_for(scheme_of(pattern), bucket)
        found = [
            ObjectInfo(store.url(o.key), o.size, o.etag, o.modified)
            for o in store.list(prefix)
            if _matches(o.key, key_pattern)
        ]
    except Exception as exc:
        raise store_error(pattern, bucket, exc) from None
    return sorted(found, key=lambda o: o.url)


def _fixed_prefix(key_pattern: str) -> str:
    """The part of a key glob before its first wildcard (what to list)."""
    for i, char in enumerate(key_pattern):
        if char in "*?[":
            return key_pattern[:i]
    return key_pattern


def _matches(key: str, key_pattern: str) -> bool:
    """A local glob's rule on a key: each ``/``-separated segment matches its own pattern."""
    if not glob.has_magic(key_pattern):
        return key == key_pattern
    keys, patterns = key.split("/"), key_pattern.split("/")
    return len(keys) == len(patterns) and all(
        fnmatch.fnmatchcase(k, p) for k, p in zip(keys, patterns, strict=True)
    )
