"""Checkpoint storage: where snapshots and ``_metadata`` files live (Flink's ``CheckpointStorage``).

Two backends behind one interface: the local filesystem (``file:///…``, here) and S3 through boto3
(``s3://bucket/prefix``, :mod:`checkpointing.state.s3_storage`: boto3's standard credential
chain; ``AWS_ENDPOINT_URL`` points it at MinIO or any S3-compatible endpoint). Layout under the
base URL::

    <base>/<job>/chk-<id>/_metadata        completed checkpoint's metadata
    <base>/<job>/chk-<id>/<files>           task-owned (exclusive) state of that checkpoint
    <base>/<job>/savepoints/savepoint-<id>/ savepoints (self-contained, never deleted by us)
    <base>/<job>/shared/                    room for shared (incremental) state

Every write is published atomically (temp file + rename; one S3 PUT or a completed multipart
upload) and returns a SHA-256 checksum that reads verify. Every URL handed to a read is checked
to lie under the base (or an explicit savepoint target), so ids from shared storage or task
processes cannot reach outside it; a job row's ``storage_url`` becomes a storage only through
:meth:`CheckpointStorage.from_job_row`, inside the configured roots. A checkpoint's or
savepoint's directory is deleted only by :meth:`CheckpointStorage.discard_directory`, which
derives it from ids (never from a metastore row, which any driver can write) and refuses
anything not strictly below the job's directory.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import logging
import os
import shutil
import stat
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from checkpointing.errors import (
    ConfigError,
    CorruptSnapshotError,
    InvalidIdError,
    StorageError,
)
from checkpointing.ids import validate_checkpoint_id, validate_id
from checkpointing.state.storage_roots import DisallowedStorageError, require_allowed

log = logging.getLogger(__name__)

CHECKSUM_ALGO = "sha256"
METADATA_FILE = "_metadata"
#: the largest ``_metadata`` read: real ones are kilobytes to a few MiB, and an unbounded read of
#: a planted file (a link to ``/dev/zero``) would exhaust the reader's memory
DEFAULT_MAX_METADATA_BYTES = 64 << 20
#: environment variable overriding :data:`DEFAULT_MAX_METADATA_BYTES` (bytes, a positive integer)
MAX_METADATA_BYTES_ENV = "CKPT_MAX_METADATA_BYTES"
#: the largest ``_metadata`` read by path (a deploy's ``from``, ``--restore PATH``): nothing has
#: vouched for it yet (no metastore checksum), and parsed JSON takes ~25 times its size in memory
DEFAULT_MAX_EXTERNAL_METADATA_BYTES = 4 << 20
#: environment variable overriding :data:`DEFAULT_MAX_EXTERNAL_METADATA_BYTES`
MAX_EXTERNAL_METADATA_BYTES_ENV = "CKPT_MAX_EXTERNAL_METADATA_BYTES"
_CHUNK = 1 << 20


def checksum_of(data: bytes) -> str:
    return f"{CHECKSUM_ALGO}:{hashlib.sha256(data).hexdigest()}"


@dataclass(frozen=True)
class FileInfo:
    url: str
    size: int
    checksum: str


class CheckpointStorage(ABC):
    """Base URL plus the layout; backends implement the byte-level operations."""

    scheme: str

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        #: reads of a ``_metadata`` file without a known size stop here (see :meth:`read_bytes`)
        self.max_metadata_bytes = max_metadata_bytes()
        self.max_external_metadata_bytes = max_metadata_bytes(external=True)

    @staticmethod
    def from_url(url: str) -> CheckpointStorage:
        """``file:///abs/dir``, a plain absolute path, ``s3://bucket/prefix`` (``s3a://``
        alike), ``gs://bucket/prefix`` or ``abfs[s]://container/prefix``."""
        if url.startswith(("s3://", "s3a://")):
            # loaded by name (as fsspec loads its backends): the base imports no backend's SDK
            s3_storage = importlib.import_module("checkpointing.state.s3_storage")
            return s3_storage.S3CheckpointStorage(url)
        if url.startswith(("gs://", "abfs://", "abfss://")):
            object_storage = importlib.import_module("checkpointing.state.object_storage")
            return object_storage.ObjectCheckpointStorage(url)
        if url.startswith("file://") or url.startswith("/"):
            return FileSystemCheckpointStorage(url)
        raise ConfigError(
            f"storage URL {url!r}: expected file:///absolute/path or s3://bucket/prefix "
            "(or gs://bucket/prefix, abfss://container@account.dfs.core.windows.net/prefix)"
        )

    @staticmethod
    def from_job_row(job_id: str, storage_url: str) -> CheckpointStorage:
        """The storage a job's metastore row names (its ``storage_url``), for a process that
        deletes or reads on the job's behalf (the API server, ``ckpt gc``/``inspect``): any
        driver can write that row, so the URL must equal an allowed root (below one, a base
        ``<root>/Y`` would nest in job ``Y``'s directory and its gc would take ``Y``'s
        ``shared/chk-*`` for orphans: :func:`~checkpointing.state.storage_roots.require_allowed`),
        else
        :class:`~checkpointing.state.storage_roots.DisallowedStorageError`. The one way a
        row's URL becomes a storage."""
        validate_id(job_id, "job id")
        require_allowed(storage_url, job_id=job_id, field="storage_url", exact=True)
        return CheckpointStorage.from_url(storage_url)

    # ------------------------------------------------------------------ layout

    def job_url(self, job_id: str) -> str:
        return f"{self.base_url}/{validate_id(job_id, 'job id')}"

    def checkpoint_url(self, job_id: str, checkpoint_id: int) -> str:
        return f"{self.job_url(job_id)}/chk-{validate_checkpoint_id(checkpoint_id)}"

    def savepoint_url(self, job_id: str, checkpoint_id: int) -> str:
        return (
            f"{self.job_url(job_id)}/savepoints/savepoint-{validate_checkpoint_id(checkpoint_id)}"
        )

    def shared_url(self, job_id: str) -> str:
        return f"{self.job_url(job_id)}/shared"

    def shared_checkpoint_url(self, job_id: str, checkpoint_id: int) -> str:
        """Where checkpoint ``checkpoint_id`` writes its incremental state: under ``shared/``,
        because later checkpoints reference those files after this one is subsumed."""
        return f"{self.shared_url(job_id)}/chk-{validate_checkpoint_id(checkpoint_id)}"

    def initialize_location_for_checkpoint(
        self, job_id: str, checkpoint_id: int
    ) -> StorageLocation:
        location = StorageLocation(self, self.checkpoint_url(job_id, checkpoint_id))
        self.make_dirs(location.url)
        return location

    def initialize_location_for_savepoint(
        self, job_id: str, checkpoint_id: int, target: str | None = None
    ) -> StorageLocation:
        """A savepoint goes under the job's ``savepoints/`` or into ``target`` (a directory URL
        of the same storage; the ``savepoint-<id>`` directory in it must not exist yet or be
        empty, so a failed savepoint never disposes of another job's files)."""
        if target:
            url = self.check_target(target)
            url = f"{url}/savepoint-{validate_checkpoint_id(checkpoint_id)}"
            if self.list_files(url):
                raise StorageError(f"savepoint directory {url} already exists and is not empty")
        else:
            url = self.savepoint_url(job_id, checkpoint_id)
        location = StorageLocation(self, url, extra_root=url)
        self.make_dirs(url)
        return location

    def check_target(self, target: str) -> str:
        """Validate a user-supplied directory URL (savepoint target): same scheme, normalised."""
        target = target.rstrip("/")
        other = CheckpointStorage.from_url(target)
        if type(other) is not type(self):
            raise InvalidIdError(
                f"savepoint target {target!r} must use the job's storage ({self.scheme})"
            )
        check_normalised(target)
        return other.base_url  # a plain absolute path becomes a file:// URL

    def location_for(
        self, url: str, *, job_id: str | None = None, checkpoint_id: int | None = None
    ) -> StorageLocation:
        """The location of an existing checkpoint or savepoint directory (for reads and writes;
        deletes go through :meth:`discard_directory`). Never the base itself or a directory
        above it; outside the base, only inside an allowed storage root
        (:func:`~checkpointing.state.storage_roots.require_allowed`): ``url`` may come from a
        metastore row, which any driver can write. With ids, ``url`` must also be where they
        put it: ``chk-<id>``, ``savepoints/savepoint-<id>`` or a target's ``savepoint-<id>``
        (else :class:`DisallowedStorageError`, nothing written)."""
        url = url.rstrip("/")
        check_normalised(url)
        if url == self.base_url or self.base_url.startswith(url + "/"):
            raise InvalidIdError(f"{url!r} is checkpoint storage {self.base_url!r} or above it")
        who = "checkpoint location"
        if job_id is not None and checkpoint_id is not None:
            who = f"checkpoint {checkpoint_id}'s storage_location"
            derived = {
                self.checkpoint_url(job_id, checkpoint_id),
                self.savepoint_url(job_id, checkpoint_id),
            }
            if url not in derived and url.rsplit("/", 1)[-1] != f"savepoint-{checkpoint_id}":
                raise DisallowedStorageError(
                    f"job {job_id!r}: {who} {url!r} is not where its ids put it (chk-"
                    f"{checkpoint_id}, savepoints/savepoint-{checkpoint_id} or a target's "
                    f"savepoint-{checkpoint_id}): nothing written or read there"
                )
        if self.contains(url):
            return StorageLocation(self, url)
        require_allowed(url, job_id=job_id, field=who)
        return StorageLocation(self, url, extra_root=url)

    def owned_directory(self, job_id: str, checkpoint_id: int, kind: str) -> str:
        """The directory of ``job_id``'s checkpoint ``checkpoint_id`` of ``kind``
        (``checkpoint``: ``chk-<id>``, ``savepoint``: ``savepoints/savepoint-<id>``,
        ``shared``: ``shared/chk-<id>``), from ids and this storage's own layout only;
        :class:`RefusedDeleteError` unless it lies strictly below the job's directory."""
        layouts = {
            "checkpoint": self.checkpoint_url,
            "savepoint": self.savepoint_url,
            "shared": self.shared_checkpoint_url,
        }
        if kind not in layouts:
            raise ValueError(f"unknown directory kind {kind!r}")
        url = layouts[kind](job_id, checkpoint_id)
        job = self.job_url(job_id)
        if url == job or not url.startswith(job + "/") or not self.contains(url, job):
            raise RefusedDeleteError(f"{url!r} is not strictly below the job's directory {job!r}")
        return url

    def deletable_directory(
        self, job_id: str, checkpoint_id: int, kind: str, *, recorded: str | None = None
    ) -> str:
        """:meth:`owned_directory`, once ``recorded`` (a location read from a metastore row,
        which any driver can write) is the same: when they differ (a forged row, or a
        savepoint written to a target directory of its own) or the ids give nothing strictly
        below the job's directory, one line is logged and :class:`RefusedDeleteError` raised."""
        try:
            url = self.owned_directory(job_id, checkpoint_id, kind)
            if recorded is not None and recorded.rstrip("/") != url:
                raise RefusedDeleteError(
                    f"the metastore records {recorded!r}, not {url!r} as the ids give it"
                )
        except (RefusedDeleteError, InvalidIdError) as exc:
            log.error(
                "job %s: not deleting the %s directory of checkpoint %s: %s",
                job_id,
                kind,
                checkpoint_id,
                exc,
            )
            if isinstance(exc, RefusedDeleteError):
                raise
            raise RefusedDeleteError(str(exc)) from None
        return url

    def discard_directory(
        self, job_id: str, checkpoint_id: int, kind: str, *, recorded: str | None = None
    ) -> str:
        """Delete the directory the ids give (:meth:`deletable_directory`; ``recorded`` is
        compared with it, never deleted) and return it; refused: nothing deleted."""
        url = self.deletable_directory(job_id, checkpoint_id, kind, recorded=recorded)
        self.delete_tree(url)
        return url

    def contains(self, url: str, root: str | None = None) -> bool:
        root = (root or self.base_url).rstrip("/")
        try:
            check_normalised(url)
        except InvalidIdError:
            return False
        return url == root or url.startswith(root + "/")

    def require_within(self, url: str, *roots: str | None) -> str:
        """Refuse any URL outside the base and the given roots (e.g. a savepoint directory)."""
        for root in (self.base_url, *roots):
            if root and self.contains(url, root):
                return url
        raise InvalidIdError(f"{url!r} is outside checkpoint storage {self.base_url!r}")

    # ------------------------------------------------------------------ bytes

    def write_bytes(self, url: str, data: bytes, *, overwrite: bool = True) -> FileInfo:
        """Publish ``data`` at ``url`` atomically; with ``overwrite=False`` an existing file is an
        error (Flink's ``NO_OVERWRITE`` for metadata)."""
        self._write(url, io.BytesIO(data), len(data), overwrite=overwrite)
        return FileInfo(url, len(data), checksum_of(data))

    def read_bytes(
        self,
        url: str,
        *,
        checksum: str | None = None,
        size: int | None = None,
        max_size: int | None = None,
    ) -> bytes:
        """Read a whole file; verify ``size`` and ``checksum`` when given.

        The read is bounded before anything is buffered: by ``size`` (the size a metadata file
        or an ack recorded), else by ``max_size``, else, for a ``_metadata`` file, by
        :attr:`max_metadata_bytes`. A file whose stat/HEAD size is over the bound is refused
        unread, and reading stops one byte past it (a file growing meanwhile). Devices, FIFOs
        and other non-regular files are never read.
        """
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise CorruptSnapshotError(url, f"invalid recorded size {size!r}")
        limit = size if size is not None else max_size
        if limit is None and url.rsplit("/", 1)[-1] == METADATA_FILE:
            limit = self.max_metadata_bytes
        try:
            data = self._read(url, limit)
        except TooBigError as exc:
            if size is not None:  # say what was expected, as for any size mismatch
                raise CorruptSnapshotError(url, f"size {exc.size} bytes, expected {size}") from None
            raise
        if size is None and limit is not None and len(data) > limit:
            raise TooBigError(url, len(data), limit)
        if size is not None and len(data) != size:
            raise CorruptSnapshotError(url, f"size {len(data)} bytes, expected {size}")
        if checksum is not None and checksum_of(data) != checksum:
            raise CorruptSnapshotError(url, "checksum mismatch")
        return data

    def copy_file(self, source: str, target: str, *, size: int, checksum: str | None) -> None:
        """``source``'s bytes at the new file ``target`` (an existing one is an error), as
        recorded (``size``, ``checksum``). An object store copies server-side
        (:meth:`_server_copy`: no byte through this process, the copy checked by its size; the
        checksum is checked where the copy is read, as every restore does); elsewhere the bytes
        go through this process's memory, verified before they are written."""
        if self._server_copy(source, target):
            copied = self.size_of(target)
            if copied != size:
                self.delete(target)  # this call's own copy: not left behind
                raise CorruptSnapshotError(target, f"size {copied} bytes, expected {size}")
            return
        data = self.read_bytes(source, checksum=checksum, size=size)
        self.write_bytes(target, data, overwrite=False)

    def _server_copy(self, source: str, target: str) -> bool:
        """Copy ``source`` to the new ``target`` inside the store, if it can (False: it cannot,
        the caller copies the bytes); an existing ``target`` is a :class:`StorageError`."""
        return False

    @abstractmethod
    def _write(self, url: str, stream: IO[bytes], size: int, *, overwrite: bool) -> None: ...

    @abstractmethod
    def _read(self, url: str, limit: int | None) -> bytes:
        """The file's bytes: :class:`TooBigError` when its size is over ``limit``, and never
        more than ``limit + 1`` bytes read (the caller's size check refuses those)."""

    @abstractmethod
    def size_of(self, url: str) -> int | None:
        """Size in bytes, or None when the file does not exist."""

    @abstractmethod
    def make_dirs(self, url: str) -> None: ...

    @abstractmethod
    def delete(self, url: str) -> None:
        """Delete one file; missing is fine."""

    @abstractmethod
    def delete_tree(self, url: str) -> None:
        """Delete a directory and everything below it; missing is fine."""

    @abstractmethod
    def list_files(self, url: str) -> list[str]:
        """URLs of the files below a directory URL (recursive), sorted."""

    def exists(self, url: str) -> bool:
        return self.size_of(url) is not None


class StorageLocation:
    """A checkpoint's or savepoint's directory (Flink's ``CheckpointStorageLocation``)."""

    def __init__(self, storage: CheckpointStorage, url: str, extra_root: str | None = None) -> None:
        self.storage = storage
        self.url = url
        self._extra_root = extra_root
        storage.require_within(url, extra_root)

    @property
    def reference(self) -> str:
        return self.url

    @property
    def metadata_url(self) -> str:
        return f"{self.url}/{METADATA_FILE}"

    def file_url(self, *parts: str) -> str:
        """URL of a file inside this location; each part is a validated id."""
        return "/".join([self.url, *(validate_id(p, "file name") for p in parts)])

    def owns(self, url: str) -> bool:
        return self.storage.contains(url, self.url)

    def dispose_on_failure(self) -> None:
        """Delete everything written for a checkpoint that will never complete."""
        self.storage.delete_tree(self.url)


def max_metadata_bytes(*, external: bool = False) -> int:
    """The ``_metadata`` read limit: :data:`MAX_METADATA_BYTES_ENV` or the default; for one
    read by path (``external``), :data:`MAX_EXTERNAL_METADATA_BYTES_ENV` or its default."""
    env = MAX_EXTERNAL_METADATA_BYTES_ENV if external else MAX_METADATA_BYTES_ENV
    default = DEFAULT_MAX_EXTERNAL_METADATA_BYTES if external else DEFAULT_MAX_METADATA_BYTES
    text = os.environ.get(env, "").strip()
    if not text:
        return default
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{env}={text!r}: expected a positive number of bytes")
    return int(text)


class RefusedDeleteError(StorageError):
    """A delete whose target is not what the ids derive, or not strictly below the job's
    directory: nothing was deleted."""


class TooBigError(CorruptSnapshotError):
    """A file is larger than its read may be (names the file, its size and the limit)."""

    def __init__(self, url: str, size: int, limit: int) -> None:
        super().__init__(url, f"size {size} bytes is over the read limit of {limit} bytes")
        self.size = size
        self.limit = limit


def read_at_most(stream: Any, limit: int | None) -> bytes:
    """Read ``stream`` to its end, but never more than ``limit + 1`` bytes."""
    if limit is None:
        return bytes(stream.read())
    chunks, left = [], limit + 1
    while left > 0:
        chunk = stream.read(min(left, _CHUNK))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def check_normalised(url: str) -> None:
    _scheme, sep, rest = url.partition("://")
    path = rest if sep else url
    if any(ord(c) < 32 or ord(c) == 127 for c in url):
        raise InvalidIdError(f"{url!r} contains control characters")
    parts = path.split("/")
    if ".." in parts or "." in parts[1:] or "\\" in path:
        raise InvalidIdError(f"{url!r} is not a normalised path (no '.', '..' or backslashes)")


# ============================================================================ local filesystem


class FileSystemCheckpointStorage(CheckpointStorage):
    scheme = "file"

    def __init__(self, base_url: str) -> None:
        path = base_url.removeprefix("file://")
        if not path.startswith("/"):
            raise ConfigError(f"storage URL {base_url!r}: a file:// URL needs an absolute path")
        path = os.path.normpath(path)
        super().__init__("file://" + path)
        #: the base as it resolved when this storage was made (and its roots checked): a delete
        #: refuses a base that resolves elsewhere by then (a symlink swapped in)
        self._real_base = os.path.realpath(path)

    def path_of(self, url: str) -> Path:
        if not url.startswith("file:///"):
            raise InvalidIdError(f"{url!r} is not a file:// URL with an absolute path")
        check_normalised(url)
        return Path(url.removeprefix("file://"))

    def _write(self, url: str, stream: IO[bytes], size: int, *, overwrite: bool) -> None:
        path = self.path_of(url)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.inprogress")
        try:
            with open(tmp, "wb") as fh:
                shutil.copyfileobj(stream, fh, 1 << 20)
                fh.flush()
                os.fsync(fh.fileno())
            if overwrite:
                os.replace(tmp, path)
            else:
                try:
                    os.link(tmp, path)  # fails if path exists: never clobber
                except FileExistsError:
                    raise StorageError(f"{url} already exists; refusing to overwrite") from None
            fsync_dir(path.parent)
        except OSError as exc:
            raise StorageError(f"cannot write {url}: {exc}") from exc
        finally:
            tmp.unlink(missing_ok=True)

    def _read(self, url: str, limit: int | None) -> bytes:
        path = self.path_of(url)
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer (no effect on regular files)
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise CorruptSnapshotError(url, "file is missing") from None
        except OSError as exc:
            raise StorageError(f"cannot read {url}: {exc}") from exc
        with os.fdopen(fd, "rb", buffering=0) as fh:
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):
                    raise CorruptSnapshotError(url, "not a regular file; refusing to read it")
                if limit is not None and info.st_size > limit:
                    raise TooBigError(url, info.st_size, limit)
                return read_at_most(fh, limit)
            except OSError as exc:
                raise StorageError(f"cannot read {url}: {exc}") from exc

    def size_of(self, url: str) -> int | None:
        try:
            return self.path_of(url).stat().st_size
        except FileNotFoundError:
            return None

    def make_dirs(self, url: str) -> None:
        self.path_of(url).mkdir(parents=True, exist_ok=True)

    def delete(self, url: str) -> None:
        try:
            self._deletable(url).unlink(missing_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot delete {url}: {exc}") from exc

    def delete_tree(self, url: str) -> None:
        try:
            shutil.rmtree(self._deletable(url))  # never follows a symlink below the path
        except FileNotFoundError:
            pass
        except OSError as exc:  # e.g. permissions: say so, never leave it silently half-deleted
            raise StorageError(f"cannot delete {url}: {exc}") from exc

    def _deletable(self, url: str) -> Path:
        """The path of ``url``, once no component below the base is a symlink: "inside the
        base" is checked on URLs, and with ``base/job`` a symlink to another folder a delete of
        ``base/job/chk-7`` would remove that folder's ``chk-7``. The base itself may be a
        symlink, but must resolve where it did when this storage was made (a row's base was
        checked against the roots then); a path outside the base (a savepoint target) is the
        user's own."""
        path = self.path_of(url)
        base = Path(self.base_url.removeprefix("file://"))
        try:
            below = path.relative_to(base)
        except ValueError:
            return path
        if os.path.realpath(base) != self._real_base:
            raise StorageError(
                f"cannot delete {url}: checkpoint storage {self.base_url} now resolves to "
                f"{os.path.realpath(base)}, not {self._real_base} (a symlink swapped in); refused"
            )
        real = Path(os.path.realpath(path))
        if real != Path(self._real_base) / below:
            raise StorageError(
                f"cannot delete {url}: it resolves to {real}, outside checkpoint storage "
                f"{self.base_url} (a symlink below the base); refused"
            )
        return path

    def list_files(self, url: str) -> list[str]:
        root = self.path_of(url)
        if not root.is_dir():
            return []
        return sorted(
            "file://" + str(p) for p in root.rglob("*") if p.is_file() and not _is_temp(p.name)
        )


def _is_temp(name: str) -> bool:
    """In-progress writes: ``.<name>.<uuid>.inprogress`` (ids never start with a dot)."""
    return name.startswith(".") and name.endswith(".inprogress")


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
