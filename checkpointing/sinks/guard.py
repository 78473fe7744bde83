"""Where a sink may write, and what in its directory it may delete (no Spark here).

The two-phase-commit sink (:mod:`checkpointing.spark.parquet_sink`) renames, replaces and deletes
entries of its directory, so a sink path that is the input, the spec's folder, the checkpoint
storage, a home directory or ``/`` would lose the user's files. Two rules keep it to its own:

* :func:`check_sink_location` refuses such a path before Spark starts and before anything is
  written (the spec loader, the Python API and the runtime call it), naming ``sink.path`` and
  the conflict in one line.
* A sink directory is *claimed* with a marker file :data:`MARKER_FILE` (recording the job) when
  the sink first writes to it, and each final table the sink publishes carries the same marker.
  A directory that already holds anything and no marker is refused (as Spark's ``ErrorIfExists``
  and Delta refuse a non-empty directory that is not theirs), a directory claimed by another job
  is refused, and the sink deletes only entries that carry its marker or that it created
  inside its own ``_staging/`` and ``changelog/`` folders.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pwd
import re
import stat
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from checkpointing.errors import ConfigError, StorageError
from checkpointing.state.storage import fsync_dir

#: the marker file of a claimed sink directory and of each final table the sink published
MARKER_FILE = "_ckpt_sink"
MARKER_FORMAT = "ckpt-sink"
_MARKER_MAX_BYTES = 4096
_MARKER_TEMP = re.compile(rf"\.{MARKER_FILE}\.[0-9a-f]{{32}}\.inprogress", re.ASCII)
#: characters Hadoop paths or Spark's read-side globbing would interpret
_UNSAFE_PATH_CHARS = frozenset("*?[]{}\\:")
FIELD = "sink.path"


# ============================================================================ the path


def local_sink_path(path: str | Path) -> Path:
    """The absolute local directory of a sink path or ``file:///`` URL (not resolved)."""
    if isinstance(path, Path):
        text = str(path)
    elif isinstance(path, str):
        text = path
        if text.startswith("file://"):
            text = text.removeprefix("file://")
            if not text.startswith("/"):
                raise ConfigError(f"sink path {path!r}: a file:// URL needs an absolute path")
        elif "://" in text:
            raise ConfigError(
                f"sink path {path!r}: this parquet sink writes a local directory (path or "
                "file:/// URL); an s3:// prefix is written by the S3 parquet sink"
            )
    else:
        raise ConfigError(f"sink path must be a str or Path, got {type(path).__name__}")
    if not text:
        raise ConfigError("sink path must not be empty")
    if any(ord(c) < 32 or ord(c) == 127 or c in _UNSAFE_PATH_CHARS for c in text):
        raise ConfigError(
            f"sink path {path!r}: control characters and * ? [ ] {{ }} \\ : are not allowed "
            "(Spark would read them as globs or URI syntax)"
        )
    return Path(os.path.abspath(text))


def check_sink_location(
    sink: str | Path,
    *,
    inputs: Iterable[str] = (),
    storage: str | None = None,
    spec_dir: Path | None = None,
    spec_dir_name: str = "the spec's own folder",
) -> Path:
    """Refuse a sink directory that would put the user's files at risk; returns it resolved.

    Refused: a filesystem root; a directory that is, contains or lies inside an input folder
    (``inputs``: source globs) or the local checkpoint storage (``storage``: a path or
    ``file://`` URL); the spec's folder ``spec_dir`` or a folder containing it; a home
    directory or a folder containing one. A subfolder of the spec's folder (``out/routes``) is
    fine. Symlinks are resolved first, so an alias of a refused folder is refused too.
    """
    given = local_sink_path(sink)
    path = Path(os.path.realpath(given))
    shown = str(given) if given == path else f"{given} (= {path})"

    def refuse(conflict: str) -> ConfigError:
        return ConfigError(f"{FIELD}: {shown} {conflict}; use a dedicated output folder")

    if path == Path(path.anchor):
        raise refuse("is a filesystem root")
    # what it is first (the clearest message), then what it lies inside or contains
    folders: list[tuple[Path, str, bool]] = []  # (folder, what, may the sink lie inside it)
    if spec_dir is not None:
        folders.append((Path(os.path.realpath(spec_dir)), spec_dir_name, True))
    root = _local_storage_dir(storage)
    if root is not None:
        folders.append((root, "the checkpoint storage", False))
    for pattern in inputs:
        folder = input_folder(pattern)
        if folder is not None:
            folders.append((folder, "the input folder of source.path", False))
    folders += [(home, "a home directory", True) for home in sorted(_home_dirs())]
    for folder, what, _inside_ok in folders:
        if path == folder:
            raise refuse(f"is {what}")
    for folder, what, inside_ok in folders:
        if not inside_ok and path.is_relative_to(folder):
            raise refuse(f"lies inside {what} ({folder})")
        if folder.is_relative_to(path):
            raise refuse(f"contains {what} ({folder})")
    return path


def check_pipeline_sink(spec: Any, storage: str | None = None) -> Path | str:
    """:func:`check_sink_location` for a :class:`~checkpointing.pipeline.spec.PipelineSpec` (its
    source glob, its ``storage`` or the given storage URL, the folder of its file, else the working
    directory for a Python API job); for a sink on an object store (a Delta table, an Iceberg
    warehouse, or Parquet objects under an ``s3://`` prefix), :func:`check_object_sink` (its URL
    is returned)."""
    storage_url = storage or (spec.storage and spec.resolve(spec.storage))
    sink = spec.resolve(spec.sink.path)
    if "://" in sink and not sink.startswith("file://"):
        return check_object_sink(sink, inputs=[spec.resolve(spec.source.path)], storage=storage_url)
    if spec.spec_path is not None:
        spec_dir, name = Path(spec.spec_path).parent, "the spec's own folder"
    else:
        spec_dir, name = Path.cwd(), "the working directory"
    return check_sink_location(
        sink,
        inputs=[spec.resolve(spec.source.path)],
        storage=storage_url,
        spec_dir=spec_dir,
        spec_dir_name=name,
    )


def check_object_sink(sink: str, *, inputs: Iterable[str] = (), storage: str | None = None) -> str:
    """:func:`check_sink_location` for a table on an object store (``s3://bucket/prefix``):
    refused when it is, contains or lies inside the checkpoint storage or an input prefix (the
    part of a source glob before its first wildcard), or is a whole bucket. Returns the URL
    without a trailing ``/``."""
    from checkpointing.state.object_store import ObjectStoreError, expected_form, split_url

    url = sink.rstrip("/")
    try:
        split_url(url)
    except ObjectStoreError:
        raise ConfigError(f"{FIELD}: {sink!r}: {expected_form(sink, 'prefix/table')}") from None

    def refuse(conflict: str) -> ConfigError:
        return ConfigError(f"{FIELD}: {url} {conflict}; use a dedicated table prefix")

    folders = [(storage.rstrip("/"), "the checkpoint storage")] if storage else []
    folders += [(_object_prefix(p), "the input prefix of source.path") for p in inputs]
    for folder, what in folders:
        if "://" not in folder or folder.split("://")[0] != url.split("://")[0]:
            continue
        if url == folder:
            raise refuse(f"is {what}")
        if url.startswith(folder + "/"):
            raise refuse(f"lies inside {what} ({folder})")
        if folder.startswith(url + "/"):
            raise refuse(f"contains {what} ({folder})")
    return url


def _object_prefix(pattern: str) -> str:
    """The folder-like prefix an object glob reads from (before its first wildcard segment)."""
    parts = pattern.rstrip("/").split("/")
    fixed = list(_until_magic(tuple(parts)))
    if len(fixed) == len(parts):  # a single object: its "folder"
        fixed = fixed[:-1]
    return "/".join(fixed)


def input_folder(pattern: str) -> Path | None:
    """The folder a source glob reads from (resolved): the part before its first wildcard, or
    the parent of a plain file. None for a non-local URL."""
    if "://" in pattern and not pattern.startswith("file://"):
        return None
    parts = Path(os.path.abspath(pattern.removeprefix("file://"))).parts
    fixed = list(_until_magic(parts))  # never empty: parts[0] is the root
    folder = Path(*fixed)
    if len(fixed) == len(parts) and not folder.is_dir():
        folder = folder.parent  # a single file
    return Path(os.path.realpath(folder))


def _until_magic(parts: tuple[str, ...]) -> Iterable[str]:
    for part in parts:
        if glob.has_magic(part):
            return
        yield part


def _local_storage_dir(storage: str | None) -> Path | None:
    if not storage:
        return None
    if storage.startswith("file://"):
        storage = storage.removeprefix("file://")
    elif "://" in storage:
        return None  # S3: cannot overlap a local directory
    return Path(os.path.realpath(storage))


def _home_dirs() -> set[Path]:
    """This user's home and every account's existing home directory, resolved (not ``/``)."""
    homes = {os.path.expanduser("~"), os.environ.get("HOME") or ""}
    with contextlib.suppress(OSError):  # no passwd database: this user's home only
        homes.update(entry.pw_dir for entry in pwd.getpwall())
    found = set()
    for home in homes:
        if home and os.path.isabs(home) and os.path.isdir(home):
            resolved = Path(os.path.realpath(home))
            if resolved != Path(resolved.anchor):
                found.add(resolved)
    return found


# ============================================================================ ownership


def read_marker(directory: Path) -> dict[str, Any] | None:
    """The sink marker in ``directory``: a small regular file (not a symlink) holding this
    format's JSON; None when there is none or it is not one."""
    marker = directory / MARKER_FILE
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MARKER_MAX_BYTES:
            return None
        data = fh.read(_MARKER_MAX_BYTES + 1)
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("format") != MARKER_FORMAT:
        return None
    return doc


def is_marked(directory: Path) -> bool:
    """Whether ``directory`` is a real directory (not a symlink) carrying the sink marker."""
    return directory.is_dir() and not directory.is_symlink() and read_marker(directory) is not None


def check_owner(path: Path, job: str | None) -> None:
    """Read-only: may a sink of ``job`` write into ``path``? Missing or empty: yes. Marked by
    no job or by ``job``: yes. Anything else (foreign content, another job's marker, a file)
    raises :class:`ConfigError` naming ``sink.path``."""
    if path.is_symlink() and not path.exists():
        raise ConfigError(f"{FIELD}: {path} is a dangling symlink")
    if not path.exists():
        return
    if not path.is_dir():
        raise ConfigError(f"{FIELD}: {path} exists and is not a directory")
    marker = read_marker(path)
    if marker is None:
        try:
            # a claim that died before publishing its marker leaves only its temp file
            entries = sorted(e for e in os.listdir(path) if not _MARKER_TEMP.fullmatch(e))
        except OSError as exc:
            raise ConfigError(f"{FIELD}: cannot list {path}: {exc.strerror or exc}") from None
        if entries:
            shown = ", ".join(entries[:3]) + (", …" if len(entries) > 3 else "")
            raise ConfigError(
                f"{FIELD}: {path} is not empty ({shown}) and is not a sink directory (no "
                f"{MARKER_FILE} marker); use a new or empty folder, the sink never writes "
                "into files it did not create"
            )
        return
    owner = marker.get("job")
    if job is not None and owner is not None and owner != job:
        raise ConfigError(
            f"{FIELD}: {path} is the sink of job {owner!r} (its {MARKER_FILE} marker), not of "
            f"job {job!r}; use another sink path"
        )


def claim(path: Path, job: str | None) -> None:
    """Make ``path`` this sink's directory: check it (:func:`check_owner`), create it, and
    write the marker unless it is there. Idempotent; a concurrent claim by another job loses
    (the marker is published without overwriting)."""
    check_owner(path, job)
    if read_marker(path) is not None:
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"cannot create the sink directory {path}: {exc}") from exc
    write_marker(path, {"job": job}, overwrite=False)
    check_owner(path, job)  # lost a race to another claim: refused here


def write_marker(directory: Path, fields: dict[str, Any], *, overwrite: bool = True) -> None:
    """Publish ``directory/_ckpt_sink`` durably (temp file, fsync, link or rename)."""
    doc = {"format": MARKER_FORMAT, "version": 1, **fields}
    data = json.dumps(doc, sort_keys=True).encode()
    target = directory / MARKER_FILE
    tmp = directory / f".{MARKER_FILE}.{uuid.uuid4().hex}.inprogress"
    try:
        with open(tmp, "xb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if overwrite:
            os.replace(tmp, target)
        else:
            # someone else claimed it first: the caller checks whose it is
            with contextlib.suppress(FileExistsError):
                os.link(tmp, target)
        fsync_dir(directory)
    except OSError as exc:
        raise StorageError(f"cannot write {target}: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)
