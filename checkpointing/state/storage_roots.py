"""The storage roots a metastore row may point into (issue 38: derive, don't trust).

A job row's ``storage_url`` and a savepoint request's ``target_location`` can be written by any
Spark driver that has the metastore URL. The API server, ``ckpt gc``, ``ckpt inspect`` and a
job's coordinator act on them (delete, read, write), so a row must never choose *which* tree:
a job's ``storage_url`` must be one of the configured roots (below one, it would nest in
another job's directory), and a target or a checkpoint's location one of them or below one
(:func:`checkpointing.config.configured_storage_roots`: ``CKPT_STORAGE_URL`` or the default,
and ``CKPT_STORAGE_ROOTS``). Below that base, a job's own directories are still derived from
ids (:meth:`CheckpointStorage.owned_directory`).

URLs are compared as parsed paths, never as strings: the scheme and the bucket must match,
path components one by one (``s3://bkt/a`` does not hold ``s3://bkt/ab``), and a URL with
``.``, ``..``, a backslash or a control character is refused, not resolved. A local root also
holds a path only once symlinks are resolved (a link below a root does not lead out of it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from checkpointing.config import ENV_STORAGE_ROOTS, ENV_STORAGE_URL, configured_storage_roots
from checkpointing.errors import ConfigError, StorageError

#: the longest row value quoted in a refusal (a row's column holds up to 2 KiB)
_SHOWN = 160


class DisallowedStorageError(StorageError):
    """A URL read from a metastore row lies outside every allowed storage root: nothing was
    read, written or deleted."""


@dataclass(frozen=True)
class StoragePlace:
    """A storage URL taken apart: ``scheme``, ``bucket`` (empty for local files), and the path
    components below it."""

    scheme: str
    bucket: str
    parts: tuple[str, ...]

    @property
    def local_path(self) -> Path:
        return Path("/", *self.parts)

    def within(self, root: StoragePlace) -> bool:
        """Equal to ``root`` or below it, component by component (and, for local files, once
        symlinks are resolved)."""
        if (self.scheme, self.bucket) != (root.scheme, root.bucket):
            return False
        if self.parts[: len(root.parts)] != root.parts:
            return False
        if self.scheme == "file":
            real = Path(os.path.realpath(self.local_path))
            return real.is_relative_to(os.path.realpath(root.local_path))
        return True


def parse_place(url: str) -> StoragePlace:
    """``file:///abs``, an absolute path, or ``scheme://bucket/prefix``; :class:`ValueError`
    saying what is wrong with anything else, or with a path that is not normalised."""
    if any(ord(c) < 32 or ord(c) == 127 for c in url) or "\\" in url:
        raise ValueError("contains a control character or a backslash")
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "file", url
        if not url.startswith("/"):
            raise ValueError("expected file:///absolute/path or scheme://bucket/prefix")
    elif scheme == "file" and not rest.startswith("/"):
        raise ValueError("a file:// URL needs an absolute path")
    scheme = "s3" if scheme == "s3a" else scheme  # one store (CheckpointStorage.from_url)
    bucket, path = ("", rest) if scheme == "file" else rest.partition("/")[::2]
    if scheme != "file" and (not bucket or not scheme.isalnum() or scheme != scheme.lower()):
        raise ValueError("expected file:///absolute/path or scheme://bucket/prefix")
    raw = path.rstrip("/").split("/") if path.rstrip("/") else []
    parts = tuple(p for p in raw if p) if scheme == "file" else tuple(raw)
    # local paths collapse '//' as the filesystem does; an object key's '//' is another key
    if "" in parts or "." in parts or ".." in parts:
        raise ValueError("is not a normalised path (no '.', '..' or empty components)")
    return StoragePlace(scheme, bucket, parts)


def allowed_roots() -> list[tuple[str, StoragePlace]]:
    """The configured roots, parsed; an entry that is no storage URL is a
    :class:`ConfigError` naming the setting and the entry."""
    roots = []
    for i, root in enumerate(configured_storage_roots()):
        setting = ENV_STORAGE_URL if i == 0 else ENV_STORAGE_ROOTS
        try:
            place = parse_place(root)
        except ValueError as exc:
            raise ConfigError(f"{setting}: {root!r} {exc}") from None
        if place.scheme == "file" and not place.parts:
            raise ConfigError(f"{setting}: {root!r} is the filesystem's root: name a directory")
        roots.append((root.rstrip("/"), place))
    return roots


def require_allowed(url: str, *, job_id: str | None, field: str, exact: bool = False) -> str:
    """``url`` (``field`` of job ``job_id``'s row) once it is an allowed root or strictly
    below one (with ``exact``, once it *is* one: a job's storage base); else one line naming
    the job, the field and the roots (:class:`DisallowedStorageError`)."""
    roots = allowed_roots()
    who = f"job {job_id!r}: {field}" if job_id is not None else field
    try:
        place = parse_place(url)
    except ValueError as exc:
        raise DisallowedStorageError(f"{who} {_shown(url)} {exc}") from None
    inside = [name for name, root in roots if place.within(root)]
    if inside and not exact:
        return url
    if exact:
        if any(place == root and place.within(root) for _, root in roots):
            return url
        if inside:  # '<root>/Y' nests in job Y's directory: Y's files would be its orphans
            raise DisallowedStorageError(
                f"{who} {_shown(url)} is below checkpoint storage root {inside[0]}, not one: "
                f"a job's storage must be a root itself; add it to {ENV_STORAGE_ROOTS} if it "
                "is yours"
            )
    raise DisallowedStorageError(
        f"{who} {_shown(url)} is not under an allowed checkpoint storage root "
        f"({', '.join(r for r, _ in roots)}); add its root to {ENV_STORAGE_ROOTS} if it is yours"
    )


def _shown(value: str) -> str:
    shown = repr(value)  # one line: a newline in the row shows as \n
    return shown if len(shown) <= _SHOWN else shown[: _SHOWN - 4] + "...'"
