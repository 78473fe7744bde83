"""S3 checkpoint storage through boto3 (``s3://bucket/prefix``; ``s3a://`` names the same
objects and becomes ``s3://``): boto3's standard credential
chain; ``AWS_ENDPOINT_URL`` points it at MinIO or any S3-compatible endpoint. Loaded by
:meth:`CheckpointStorage.from_url` by name, so that local storage never imports boto3."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

from checkpointing.errors import (
    ConfigError,
    CorruptSnapshotError,
    InvalidIdError,
    OutcomeUnknownError,
    StorageError,
)
from checkpointing.state.storage import (
    CheckpointStorage,
    TooBigError,
    check_normalised,
    read_at_most,
)


class S3CheckpointStorage(CheckpointStorage):
    """S3 through boto3. Credentials and endpoint come from boto3's standard chain
    (``AWS_ACCESS_KEY_ID``…, profiles, instance roles; ``AWS_ENDPOINT_URL`` for MinIO)."""

    scheme = "s3"
    #: above this size, a managed multipart upload (atomic once completed) replaces one PUT
    MULTIPART_THRESHOLD = 64 << 20

    def __init__(self, base_url: str, client: Any = None) -> None:
        if base_url.startswith("s3a://"):  # Spark's name for the same objects
            base_url = "s3://" + base_url.removeprefix("s3a://")
        super().__init__(base_url)
        bucket, _, _ = base_url.removeprefix("s3://").partition("/")
        if not bucket:
            raise ConfigError(f"storage URL {base_url!r}: expected s3://bucket/prefix")
        self._client = client

    def __getstate__(self) -> dict[str, Any]:
        # Spark ships storage objects to executors: they build their own client there.
        return {**self.__dict__, "_client": None}

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            self._client = boto3.client(
                "s3", config=Config(retries={"mode": "standard", "max_attempts": 5})
            )
        return self._client

    @staticmethod
    def split(url: str) -> tuple[str, str]:
        if not url.startswith("s3://"):
            raise InvalidIdError(f"{url!r} is not an s3:// URL")
        check_normalised(url)
        bucket, _, key = url.removeprefix("s3://").partition("/")
        return bucket, key

    def _write(self, url: str, stream: IO[bytes], size: int, *, overwrite: bool) -> None:
        from botocore.exceptions import ClientError

        bucket, key = self.split(url)
        try:
            if size > self.MULTIPART_THRESHOLD:
                if not overwrite and self.exists(url):
                    raise StorageError(f"{url} already exists; refusing to overwrite")
                self.client.upload_fileobj(stream, bucket, key)
            elif overwrite:
                self.client.put_object(Bucket=bucket, Key=key, Body=stream.read())
            else:
                self.client.put_object(Bucket=bucket, Key=key, Body=stream.read(), IfNoneMatch="*")
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise StorageError(f"{url} already exists; refusing to overwrite") from None
            raise StorageError(f"cannot write {url}: {code or exc}") from exc
        except Exception as exc:
            raise _classify_s3_error(url, exc) from exc

    def _server_copy(self, source: str, target: str) -> bool:
        """S3's copy (managed: multipart above 5 GB), after checking ``target`` is new."""
        from botocore.exceptions import ClientError

        from_bucket, from_key = self.split(source)
        bucket, key = self.split(target)
        if self.exists(target):
            raise StorageError(f"{target} already exists; refusing to overwrite")
        try:
            self.client.copy({"Bucket": from_bucket, "Key": from_key}, bucket, key)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("NoSuchKey", "404"):
                raise CorruptSnapshotError(source, "file is missing") from None
            raise StorageError(f"cannot copy {source} to {target}: {code or exc}") from exc
        except Exception as exc:
            raise _classify_s3_error(target, exc) from exc
        return True

    def _read(self, url: str, limit: int | None) -> bytes:
        bucket, key = self.split(url)
        with s3_errors("read", url, missing=CorruptSnapshotError(url, "file is missing")):
            response = self.client.get_object(Bucket=bucket, Key=key)
            body = response["Body"]
            try:
                # the response's Content-Length is the object's size: refuse before the body
                length = response.get("ContentLength")
                if limit is not None and isinstance(length, int) and length > limit:
                    raise TooBigError(url, length, limit)
                return read_at_most(body, limit)
            finally:
                body.close()
        raise AssertionError("unreachable")  # s3_errors re-raises a missing object

    def size_of(self, url: str) -> int | None:
        bucket, key = self.split(url)
        with s3_errors("stat", url, missing=None):
            return int(self.client.head_object(Bucket=bucket, Key=key)["ContentLength"])
        return None  # missing

    def make_dirs(self, url: str) -> None:
        """S3 has no directories."""

    def delete(self, url: str) -> None:
        bucket, key = self.split(url)
        with s3_errors("delete", url):
            self.client.delete_object(Bucket=bucket, Key=key)

    def delete_tree(self, url: str) -> None:
        bucket, prefix = self.split(url.rstrip("/") + "/")
        with s3_errors("delete", url):
            for keys in self._pages(bucket, prefix):
                if not keys:
                    continue
                response = self.client.delete_objects(
                    Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True}
                )
                failed = response.get("Errors") or []
                if failed:
                    first = failed[0]
                    raise StorageError(
                        f"cannot delete {len(failed)} object(s) under {url}, e.g. "
                        f"s3://{bucket}/{first.get('Key')}: {first.get('Code')}"
                    )

    def list_files(self, url: str) -> list[str]:
        bucket, prefix = self.split(url.rstrip("/") + "/")
        with s3_errors("list", url):
            keys = [k for page in self._pages(bucket, prefix) for k in page]
        return sorted(f"s3://{bucket}/{k}" for k in keys)

    def _pages(self, bucket: str, prefix: str) -> Iterator[list[str]]:
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            yield [obj["Key"] for obj in page.get("Contents", [])]


_MISSING = ("NoSuchKey", "404", "NotFound")
_RAISE = object()


@contextmanager
def s3_errors(action: str, url: str, missing: object = _RAISE) -> Iterator[None]:
    """botocore errors become :class:`StorageError` naming the URL; a missing object raises
    ``missing`` when it is an exception, or is swallowed when it is None."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code in _MISSING and missing is not _RAISE:
            if isinstance(missing, BaseException):
                raise missing from None
            return
        raise StorageError(f"cannot {action} {url}: {code or exc}") from exc
    except BotoCoreError as exc:
        raise StorageError(f"cannot {action} {url}: {exc}") from exc


def _classify_s3_error(url: str, exc: Exception) -> StorageError:
    """A timeout or dropped connection *after* the request went out leaves the write's outcome
    unknown; failures to connect at all are plain failures."""
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError, ReadTimeoutError

    if isinstance(exc, StorageError):
        return exc
    if isinstance(exc, EndpointConnectionError):
        return StorageError(f"cannot write {url}: {exc}")
    if isinstance(exc, ReadTimeoutError | ConnectionClosedError):
        return OutcomeUnknownError(f"write of {url} may or may not have happened: {exc}")
    return StorageError(f"cannot write {url}: {exc}")
