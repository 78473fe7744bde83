"""Input splits: the units of work the source hands out, epoch by epoch (Flink's source splits).

A split is a whole file, or — for a Parquet file larger than ``source.max_split_bytes`` — a run of
consecutive row groups of it, so one big file spreads over several epochs instead of making one
huge epoch. Splits are planned on the driver from file sizes and Parquet footers only (no data is
read), in a deterministic order: the same files and settings always give the same splits and
epochs, which is what lets a checkpoint name the splits still to read.

The source's operator list state is the list of remaining splits (:meth:`InputSplit.to_state`),
dealt round-robin over its subtasks on restore.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow.parquet as pq

from checkpointing.object_store import ObjectInfo, read_footer
from checkpointing.spec import SpecError


class SplitError(SpecError):
    """The source's files cannot be split as asked (names the field or the file)."""


@dataclass(frozen=True)
class InputSplit:
    """``path`` (a local path or an object's URL), and for a part of a Parquet file its row
    groups ``[start, end)`` with their rows; ``row_groups is None`` is the whole file. An
    object's split also carries the object's ``size`` and ``etag`` as listed: they are in the
    source's state, so a restore over a replaced object no longer matches the checkpoint."""

    path: str
    row_groups: tuple[int, int] | None = None
    rows: int | None = None
    size: int | None = None
    etag: str | None = None

    def to_state(self, epoch: int) -> dict[str, Any]:
        """The list-state item of this split, read in ``epoch``."""
        item: dict[str, Any] = {"path": self.path, "epoch": epoch}
        if self.row_groups is not None:
            item["row_groups"] = list(self.row_groups)
        if self.etag is not None:
            item["size"] = self.size
            item["etag"] = self.etag
        return item

    @classmethod
    def from_state(cls, item: dict[str, Any]) -> InputSplit:
        groups = item.get("row_groups")
        size, etag = item.get("size"), item.get("etag")
        return cls(
            str(item["path"]),
            None if groups is None else (int(groups[0]), int(groups[1])),
            size=None if size is None else int(size),
            etag=None if etag is None else str(etag),
        )

    def describe(self) -> str:
        name = os.path.basename(self.path)
        if self.row_groups is None:
            return name
        start, end = self.row_groups
        return f"{name}[row groups {start}-{end - 1}]"


def plan_splits(
    files: Sequence[str | ObjectInfo], source_format: str, max_split_bytes: int | None
) -> list[InputSplit]:
    """The splits of ``files`` (local paths, or listed objects) in order: whole files, except
    Parquet files over ``max_split_bytes``, which become runs of row groups of at most that many
    compressed bytes (at least one row group each)."""
    if max_split_bytes is None:
        return [InputSplit(_path(f), **_identity(f)) for f in files]
    if source_format != "parquet":
        raise SplitError(
            f"source.max_split_bytes: splitting files is supported for parquet only, "
            f"not {source_format} (leave it unset to read whole files)"
        )
    splits: list[InputSplit] = []
    for file in files:
        path = _path(file)
        try:
            size = file.size if isinstance(file, ObjectInfo) else os.path.getsize(path)
            if size <= max_split_bytes:
                splits.append(InputSplit(path, **_identity(file)))
                continue
            if isinstance(file, ObjectInfo):
                metadata = read_footer(path)
            else:
                metadata = pq.ParquetFile(path).metadata
        except (OSError, ValueError) as exc:  # pyarrow's errors derive from these
            raise SplitError(f"{path}: cannot read its Parquet footer: {exc}") from exc
        groups = []
        for i in range(metadata.num_row_groups):
            group = metadata.row_group(i)
            columns = (group.column(c) for c in range(group.num_columns))
            groups.append((sum(c.total_compressed_size for c in columns), group.num_rows))
        splits.extend(_runs(file, groups, max_split_bytes))
    return splits


def _path(file: str | ObjectInfo) -> str:
    return file.url if isinstance(file, ObjectInfo) else file


def _identity(file: str | ObjectInfo) -> dict[str, Any]:
    """An object's size and ETag for its splits; nothing for a local file (as before)."""
    return {"size": file.size, "etag": file.etag} if isinstance(file, ObjectInfo) else {}


def _runs(
    file: str | ObjectInfo, groups: Sequence[tuple[int, int]], limit: int
) -> Iterable[InputSplit]:
    path, identity = _path(file), _identity(file)
    start, size, rows = 0, 0, 0
    for i, (group_bytes, group_rows) in enumerate(groups):
        if i > start and size + group_bytes > limit:
            yield InputSplit(path, (start, i), rows, **identity)
            start, size, rows = i, 0, 0
        size += group_bytes
        rows += group_rows
    if start < len(groups):
        yield InputSplit(path, (start, len(groups)), rows, **identity)


def epochs_of(splits: Sequence[InputSplit], per_epoch: int) -> list[list[InputSplit]]:
    """``per_epoch`` consecutive splits per epoch."""
    return [list(splits[i : i + per_epoch]) for i in range(0, len(splits), per_epoch)]
