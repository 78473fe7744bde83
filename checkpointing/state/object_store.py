"""Pipeline input on object storage (``s3://bucket/prefix/*.parquet``), read through Arrow.

The driver lists the objects a source glob matches and reads Parquet footers to plan splits; the
executors read their splits. Both go through this one module, so that the driver and every
executor find the same endpoint and credentials: boto3's conventions, from the environment
(``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/
``AWS_SESSION_TOKEN``, ``AWS_REGION`` or ``AWS_DEFAULT_REGION``), which the driver hands on to
its executors (:mod:`checkpointing.spark.executor_env`). No Hadoop S3 jars are needed: Spark's
own file reader never sees these URLs.

The listing uses boto3 because Arrow's does not give ETags: an object's identity is its key,
size and ETag, so a checkpoint can tell a replaced object from the one it was taken over.
"""

from __future__ import annotations

import fnmatch
import glob
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from checkpointing.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow
    import pyarrow.fs
    import pyarrow.parquet

#: the URL schemes read through this module (anything else with ``://``: not supported)
SCHEMES = ("s3",)


class ObjectStoreError(ConfigError):
    """The object store refused or could not be reached (the message names the URL)."""


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
    """``s3://bucket/key`` → ``(bucket, key)``; :class:`ObjectStoreError` when not of that form."""
    scheme, sep, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if not sep or scheme.lower() not in SCHEMES or not bucket or not key:
        raise ObjectStoreError(f"{url!r}: expected s3://bucket/key")
    return bucket, key


def endpoint_url(environ: Mapping[str, str] | None = None) -> str | None:
    """The S3 endpoint boto3 would use: ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``."""
    env = os.environ if environ is None else environ
    return env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None


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
    return fs.S3FileSystem(**s3_options()), f"{bucket}/{key}"


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


def _ns(when: Any) -> int | None:
    """A listing's ``LastModified`` (a datetime) in ns since the epoch."""
    return None if when is None else int(when.timestamp() * 1_000_000) * 1000


def list_objects(pattern: str) -> list[ObjectInfo]:
    """The objects whose keys match the glob in ``pattern`` (``*``, ``?`` and ``[..]`` within a
    path segment, as a local glob), sorted by key. Lists only the prefix before the first
    wildcard. :class:`ObjectStoreError` names the URL and the reason: no such bucket, no
    credentials, access denied, endpoint unreachable."""
    bucket, key_pattern = split_url(pattern)
    prefix = _fixed_prefix(key_pattern)
    found: list[ObjectInfo] = []
    try:
        pages = _client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for page in pages:
            for item in page.get("Contents", []):
                if _matches(item["Key"], key_pattern):
                    found.append(
                        ObjectInfo(
                            f"s3://{bucket}/{item['Key']}",
                            int(item["Size"]),
                            str(item.get("ETag", "")).strip('"'),
                            _ns(item.get("LastModified")),
                        )
                    )
    except Exception as exc:
        raise _listing_error(pattern, bucket, exc) from None
    return sorted(found, key=lambda o: o.url)


def _client() -> Any:
    """boto3's S3 client (its own chain reads the variables above), failing fast when the
    endpoint is unreachable: a refused run should say so in seconds, not after minutes. A new
    session each time: boto3's default one keeps the credentials it first found."""
    import boto3
    from botocore.config import Config

    config = Config(connect_timeout=5, read_timeout=30, retries={"max_attempts": 2})
    return boto3.session.Session().client("s3", config=config)


def _listing_error(pattern: str, bucket: str, exc: Exception) -> Exception:
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
