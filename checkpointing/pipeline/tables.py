"""The identity of a pipeline's static tables (``tables:`` in the spec), recorded in every
checkpoint and compared on restore.

A static table is read once per attempt and joined by the transform in every epoch, so the
epochs a checkpoint covers were computed with the table as it was then. A restore over another
version of it (a file added, removed or replaced, a table added to or removed from the spec)
would mix rows joined with the old table and rows joined with the new one, so it is refused,
naming the table and the file, unless the user allows it (``--allow-changed-tables``), in which
case the change is recorded in the restore's decision.

The files are recorded in the **source operator's list state**, beside its splits, as items
``{"table": name, "path": ..., "size": ..., "mtime" | "etag": ...}`` with no ``epoch`` (see
:func:`checkpointing.pipeline.splits.is_table_item`): objects by size and ETag, local files by size
and mtime, as the source's own files. Spark-free: the driver lists, the preflight compares.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Mapping
from typing import Any

from checkpointing.pipeline.spec import PipelineSpec, SpecError
from checkpointing.pipeline.splits import TABLE, is_table_item
from checkpointing.state.object_store import (
    ObjectInfo,
    ObjectStoreError,
    is_object_url,
    list_objects,
)

#: a table's files as listed now: local paths, or objects with their size and ETag
TableFiles = dict[str, list[str] | list[ObjectInfo]]


class TableChangedError(SpecError):
    """A restore's static tables are not the ones its checkpoint was computed with."""


def table_files(spec: PipelineSpec) -> TableFiles:
    """Each table's files, sorted (objects by key); a glob matching nothing, or an object store
    that cannot be listed, is a :class:`SpecError` naming ``tables.<name>.path``."""
    listed: TableFiles = {}
    for name, table in spec.tables.items():
        pattern = spec.resolve(table.path)
        if is_object_url(pattern):
            try:
                objects = list_objects(pattern)
            except ObjectStoreError as exc:
                raise SpecError(f"tables.{name}.path: {exc}") from None
            listed[name] = objects
        else:
            listed[name] = sorted(glob.glob(pattern.removeprefix("file://")))
        if not listed[name]:
            raise SpecError(f"tables.{name}.path: {pattern!r} matches no files")
    return listed


def table_items(files: TableFiles) -> list[dict[str, Any]]:
    """The list-state items of the tables' files (what a checkpoint records)."""
    items: list[dict[str, Any]] = []
    for name, listed in files.items():
        for file in listed:
            if isinstance(file, ObjectInfo):
                items.append({TABLE: name, "path": file.url, "size": file.size, "etag": file.etag})
                continue
            try:
                stat = os.stat(file)
            except OSError as exc:
                raise SpecError(f"tables.{name}.path: cannot read {file}: {exc.strerror}") from None
            items.append(
                {TABLE: name, "path": file, "size": stat.st_size, "mtime": stat.st_mtime_ns}
            )
    return items


def _by_table(items: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    tables: dict[str, dict[str, dict[str, Any]]] = {}
    for item in items:
        if is_table_item(dict(item)):
            tables.setdefault(str(item[TABLE]), {})[str(item["path"])] = dict(item)
    return tables


def _identity(item: Mapping[str, Any]) -> str:
    return "/".join(str(item.get(k, "-")) for k in ("size", "etag", "mtime"))


def table_changes(
    recorded: Iterable[Mapping[str, Any]], current: Iterable[Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """What changed, by table, between the items a checkpoint recorded and those listed now:
    ``{"planes": {"added": [path], "removed": [path], "changed": [path]}}``, or
    ``{"status": "added to the spec" | "removed from the spec"}`` for a whole table."""
    old, new = _by_table(recorded), _by_table(current)
    changes: dict[str, dict[str, Any]] = {}
    for name in sorted(set(old) | set(new)):
        if name not in old:
            changes[name] = {"status": "added to the spec", "files": sorted(new[name])}
        elif name not in new:
            changes[name] = {"status": "removed from the spec", "files": sorted(old[name])}
        else:
            before, now = old[name], new[name]
            diff = {
                "added": sorted(set(now) - set(before)),
                "removed": sorted(set(before) - set(now)),
                "changed": sorted(
                    p for p in set(now) & set(before) if _identity(now[p]) != _identity(before[p])
                ),
            }
            if any(diff.values()):
                changes[name] = {
                    **diff,
                    "identity": {  # size/etag/mtime then and now, of each changed file
                        p: [_identity(before[p]), _identity(now[p])] for p in diff["changed"]
                    },
                }
    return changes


def check_tables(
    recorded: Iterable[Mapping[str, Any]],
    current: Iterable[Mapping[str, Any]],
    checkpoint_id: int,
    *,
    allow_changed: bool = False,
) -> dict[str, dict[str, Any]] | None:
    """Refuse a restore whose tables are not those checkpoint ``checkpoint_id`` recorded
    (:class:`TableChangedError` naming the first table and file), unless ``allow_changed``;
    returns the changes (for the restore's decision), or None when there are none."""
    changes = table_changes(recorded, current)
    if not changes:
        return None
    if allow_changed:
        return changes
    name, change = next(iter(changes.items()))
    status = change.get("status")
    if status == "added to the spec":
        what = f"is not in checkpoint {checkpoint_id} (added to the spec since)"
    elif status == "removed from the spec":
        what = f"was joined by checkpoint {checkpoint_id} and is no longer in the spec"
    elif change["changed"]:
        path = change["changed"][0]
        then, now = change["identity"][path]
        what = (
            f"{path} has changed since checkpoint {checkpoint_id} "
            f"(size/etag/mtime {then} then, {now} now)"
        )
    elif change["added"]:
        what = f"{change['added'][0]} was added since checkpoint {checkpoint_id}"
    else:
        what = f"{change['removed'][0]}, joined by checkpoint {checkpoint_id}, is gone"
    raise TableChangedError(
        f"tables.{name}: {what}; the epochs it covers were joined with the table as it was. "
        "Restore with that table, or pass --allow-changed-tables to join the new one from the "
        "next epoch on"
    )
