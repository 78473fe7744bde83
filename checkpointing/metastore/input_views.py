"""Which input a checkpoint's runs consumed, read from the metastore alone (no storage reads).

A pipeline's source keeps its splits as operator list state (:mod:`checkpointing.pipeline.splits`),
and every subtask's acknowledgement carries it (``state_meta.list_state``): one item per split, with
its epoch and its file's identity, ``processed: true`` and the run (attempt) that read it once it
was read. Incremental runs carry the processed items forward, so the latest checkpoint of a job
says which runs read which files. :func:`input_section` groups them by run and by file for
``ckpt show`` and the Checkpoints page (``checkpoint_detail``'s ``input``). The source's state
also records the files of the static tables the runs joined (items with a ``table`` name and no
epoch, :mod:`checkpointing.pipeline.tables`): they are listed apart, as the checkpoint's ``tables``.
The files earlier runs read are one compacted item (only those still listed when the run
started): they show as files processed with no epoch, under no run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from checkpointing.metastore.outcome import acked_state_meta
from checkpointing.pipeline.operator_ids import SOURCE

#: at most this many files are listed in a section (the rest are only counted)
FILE_LIMIT = 1000
#: where an item without an epoch sorts (last)
_NO_EPOCH = 2**62


@dataclass
class _File:
    """What the items of one file say (a file read whole is one item, a large Parquet file one
    item per run of row groups)."""

    path: str
    first_seen: int
    epochs: set[int] = field(default_factory=set)
    attempts: list[str] = field(default_factory=list)
    splits: int = 0
    remaining: int = 0
    size: int | None = None
    etag: str | None = None
    mtime_ns: int | None = None

    def add(self, item: dict[str, Any], epoch: int | None, processed: bool) -> None:
        self.splits += 1
        if epoch is not None:
            self.epochs.add(epoch)
        if not processed:
            self.remaining += 1
        attempt = item.get("attempt")
        if processed and isinstance(attempt, str) and attempt not in self.attempts:
            self.attempts.append(attempt)
        self.size = _int(item.get("size"), self.size)
        self.mtime_ns = _int(item.get("mtime"), self.mtime_ns)
        if isinstance(item.get("etag"), str):
            self.etag = item["etag"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "epochs": sorted(self.epochs),
            "size": self.size,
            "etag": self.etag,
            "mtime": _mtime_iso(self.mtime_ns),
            "attempts": self.attempts,
            "splits": self.splits,
            "remaining_splits": self.remaining,
        }


@dataclass
class _Run:
    attempt: str | None
    #: the files earlier runs read, compacted into one record (their runs are not kept)
    compacted: bool = False
    first_epoch: int | None = None
    last_epoch: int | None = None
    files: set[str] = field(default_factory=set)
    splits: int = 0

    def add(self, path: str, epoch: int | None) -> None:
        self.splits += 1
        self.files.add(path)
        if epoch is not None:
            self.first_epoch = epoch if self.first_epoch is None else min(self.first_epoch, epoch)
            self.last_epoch = epoch if self.last_epoch is None else max(self.last_epoch, epoch)


def _int(value: Any, default: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _mtime_iso(ns: int | None) -> str | None:
    if ns is None:
        return None
    seconds, rest = divmod(ns, 1_000_000_000)
    try:
        return datetime.fromtimestamp(seconds, UTC).replace(microsecond=rest // 1000).isoformat()
    except (OverflowError, OSError, ValueError):
        return None


def _bytes(files: list[_File]) -> int | None:
    """The sum of the files' sizes, or None when no size is known."""
    sizes = [f.size for f in files if f.size is not None]
    return sum(sizes) if sizes else None


def source_items(s: Any, job_id: str, checkpoint_id: int) -> list[dict[str, Any]] | None:
    """Every list-state item of the source's acknowledgements of a checkpoint, subtask by
    subtask; None when no source subtask acknowledged it."""
    rows = acked_state_meta(s, job_id, checkpoint_id, (SOURCE,))
    if not rows:
        return None
    return [
        item
        for _, meta in rows
        for item in (meta or {}).get("list_state") or []
        if isinstance(item, dict)
        and (isinstance(item.get("path"), str) or isinstance(item.get("consumed"), dict))
    ]


def _compacted(items: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int | None]:
    """The items with the compacted record of earlier runs' files (splits.Consumed, an item
    ``{"consumed": {"epochs": N, "files": [[path, size, etag, mtime], ...]}}``) expanded: one
    processed item per file, with no epoch nor run; and N (None: no record)."""
    out: list[dict[str, Any]] = []
    epochs: int | None = None
    for item in items:
        record = item.get("consumed")
        if not isinstance(record, dict):
            out.append(item)
            continue
        epochs = max(epochs or 0, _int(record.get("epochs"), 0) or 0)
        for entry in record.get("files") or []:
            if isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str):
                path, size, etag, mtime = entry
                out.append(
                    {
                        "path": path,
                        "size": size,
                        "etag": etag,
                        "mtime": mtime,
                        "processed": True,
                        "compacted": True,
                    }
                )
    return out, epochs


def _table_file(item: dict[str, Any]) -> dict[str, Any]:
    return {
        "table": item["table"],
        "path": item["path"],
        "size": _int(item.get("size"), None),
        "etag": item["etag"] if isinstance(item.get("etag"), str) else None,
        "mtime": _mtime_iso(_int(item.get("mtime"), None)),
    }


def summarize_items(items: list[dict[str, Any]], file_limit: int = FILE_LIMIT) -> dict[str, Any]:
    """The ``input`` section of the source list-state ``items`` of one checkpoint: the runs that
    read splits (in epoch order), the totals, the files (by first epoch, at most
    ``file_limit`` of them) and the static tables' files (``tables``)."""
    # a table's file (splits.is_table_item; not imported: it would load Arrow into reads)
    items, compacted = _compacted(items)
    tables = [i for i in items if isinstance(i.get("table"), str)]
    items = [i for i in items if not isinstance(i.get("table"), str)]
    files: dict[str, _File] = {}
    runs: dict[str | None, _Run] = {}
    earlier = _Run(None, compacted=True)
    processed_splits = remaining_splits = 0
    processed_epochs: list[int] = []
    remaining_epochs: list[int] = []
    for item in items:
        epoch = _int(item.get("epoch"), None)
        processed = item.get("processed") is True
        path = item["path"]
        entry = files.setdefault(path, _File(path, _NO_EPOCH))
        entry.first_seen = min(entry.first_seen, _NO_EPOCH if epoch is None else epoch)
        entry.add(item, epoch, processed)
        if processed:
            processed_splits += 1
            attempt = item.get("attempt") if isinstance(item.get("attempt"), str) else None
            if item.get("compacted") is True:
                earlier.add(path, None)
            else:
                runs.setdefault(attempt, _Run(attempt)).add(path, epoch)
            if epoch is not None:
                processed_epochs.append(epoch)
        else:
            remaining_splits += 1
            if epoch is not None:
                remaining_epochs.append(epoch)
    ordered = sorted(files.values(), key=lambda f: (f.first_seen, f.path))
    read = [f for f in ordered if f.remaining < f.splits]
    by_epoch = sorted(
        runs.values(), key=lambda r: (r.first_epoch is None, r.first_epoch or 0, r.attempt or "")
    )
    if earlier.splits or compacted:
        if compacted:
            earlier.first_epoch, earlier.last_epoch = 0, compacted - 1
        by_epoch.insert(0, earlier)
    return {
        "runs": [
            {
                "attempt": r.attempt,
                "compacted": r.compacted,
                "first_epoch": r.first_epoch,
                "last_epoch": r.last_epoch,
                "files": len(r.files),
                "splits": r.splits,
                "bytes": _bytes([files[p] for p in r.files]),
            }
            for r in by_epoch
        ],
        "files_processed": len(read),
        "bytes_processed": _bytes(read),
        "splits_processed": processed_splits,
        "splits_remaining": remaining_splits,
        "files_remaining": sum(1 for f in ordered if f.remaining),
        # the first epoch the next run reads (= the epochs this checkpoint covers)
        "next_epoch": (
            min(remaining_epochs)
            if remaining_epochs
            else max(processed_epochs) + 1
            if processed_epochs
            else compacted
        ),
        "files_total": len(ordered),
        "files": [f.to_dict() for f in ordered[:file_limit]],
        "files_omitted": max(0, len(ordered) - file_limit),
        "tables": [_table_file(t) for t in sorted(tables, key=lambda t: (t["table"], t["path"]))],
    }


def input_section(
    s: Any, job_id: str, checkpoint_id: int, file_limit: int = FILE_LIMIT
) -> dict[str, Any] | None:
    """The ``input`` of a checkpoint's detail; None when its source did not acknowledge it."""
    items = source_items(s, job_id, checkpoint_id)
    return None if items is None else summarize_items(items, file_limit)
