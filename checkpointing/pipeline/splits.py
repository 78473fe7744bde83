"""Input splits: the units of work the source hands out, epoch by epoch (Flink's source splits).

A split is a whole file, or — for a Parquet file larger than ``source.max_split_bytes`` — a run of
consecutive row groups of it, so one big file spreads over several epochs instead of making one
huge epoch. Splits are planned on the driver from file sizes and Parquet footers only (no data is
read), in a deterministic order: the same files and settings always give the same splits and
epochs, which is what lets a checkpoint name the splits still to read. Epochs are cut by count
(``source.splits_per_epoch``) or by work (``source.epoch_bytes``: consecutive splits up to that
many bytes, from the same sizes), so many small files need not mean many tiny epochs.

The source's operator list state is Flink's ``PendingSplitsCheckpoint`` of a file source: the
splits still to read (:meth:`InputSplit.to_state`), the splits the run processed
(:func:`processed_item`), each with its epoch and its file's identity (an object's size and ETag,
a local file's size and mtime), and the files earlier runs read, compacted into one item
(:class:`Consumed`: path and identity, no epochs) that keeps only the files still listed — so the
state stays the size of the input listed plus one run's splits, however many runs went before.
It is dealt round-robin over the source's subtasks on restore; :func:`resume` turns it back into
the epochs to run, with any file that arrived since as new epochs after them (incremental runs: a
finished job's final checkpoint is the next run's starting point).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from checkpointing.pipeline.spec import SourceSpec, SpecError
from checkpointing.state.object_store import ObjectInfo, is_object_url, read_footer

#: the list-state flag of a split already processed (the rest are still to read)
PROCESSED = "processed"
#: the list-state key of a static table's file (:mod:`checkpointing.pipeline.tables`): not a split
TABLE = "table"
#: the list-state key of the compacted record of earlier runs' files (:class:`Consumed`)
CONSUMED = "consumed"


class SplitError(SpecError):
    """The source's files cannot be split as asked (names the field or the file)."""


@dataclass(frozen=True)
class InputSplit:
    """``path`` (a local path or an object's URL), and for a part of a Parquet file its row
    groups ``[start, end)`` with their rows; ``row_groups is None`` is the whole file. A split
    also carries its file's identity as listed — an object's ``size`` and ``etag``, a local
    file's ``size`` and ``mtime`` (ns): they are in the source's state, so a restore over a
    replaced file no longer matches the checkpoint. ``nbytes`` is a row-group run's compressed
    bytes from the footer, for ``epoch_bytes``: planning's measure of work, not the split's
    identity (not in the state, not compared)."""

    path: str
    row_groups: tuple[int, int] | None = None
    rows: int | None = None
    size: int | None = None
    etag: str | None = None
    mtime: int | None = None
    nbytes: int | None = field(default=None, compare=False)

    @property
    def planned_bytes(self) -> int | None:
        """The work this split is planned as: a run's bytes, a whole file's size (None: not
        known, e.g. an old checkpoint's split without its size)."""
        if self.row_groups is None:
            return self.size
        return self.nbytes

    def to_state(self, epoch: int) -> dict[str, Any]:
        """The list-state item of this split, read in ``epoch``."""
        item: dict[str, Any] = {"path": self.path, "epoch": epoch}
        if self.row_groups is not None:
            item["row_groups"] = list(self.row_groups)
        if self.size is not None:
            item["size"] = self.size
        if self.etag is not None:
            item["etag"] = self.etag
        if self.mtime is not None:
            item["mtime"] = self.mtime
        return item

    @classmethod
    def from_state(cls, item: dict[str, Any]) -> InputSplit:
        groups = item.get("row_groups")
        size, etag, mtime = item.get("size"), item.get("etag"), item.get("mtime")
        return cls(
            str(item["path"]),
            None if groups is None else (int(groups[0]), int(groups[1])),
            size=None if size is None else int(size),
            etag=None if etag is None else str(etag),
            mtime=None if mtime is None else int(mtime),
        )

    def identity(self) -> tuple[int | None, str | None, int | None]:
        """What tells this file's version apart: (size, ETag, mtime)."""
        return self.size, self.etag, self.mtime

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
            size = _identity(file)["size"]
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
    """A file's identity for its splits: an object's size and ETag, a local file's size and
    mtime (what a replaced file changes)."""
    if isinstance(file, ObjectInfo):
        return {"size": file.size, "etag": file.etag}
    try:
        stat = os.stat(file)
    except OSError as exc:
        raise SplitError(f"source.path: cannot read {file}: {exc.strerror or exc}") from None
    return {"size": stat.st_size, "mtime": stat.st_mtime_ns}


def _runs(
    file: str | ObjectInfo, groups: Sequence[tuple[int, int]], limit: int
) -> Iterable[InputSplit]:
    path, identity = _path(file), _identity(file)
    start, size, rows = 0, 0, 0
    for i, (group_bytes, group_rows) in enumerate(groups):
        if i > start and size + group_bytes > limit:
            yield InputSplit(path, (start, i), rows, **identity, nbytes=size)
            start, size, rows = i, 0, 0
        size += group_bytes
        rows += group_rows
    if start < len(groups):
        yield InputSplit(path, (start, len(groups)), rows, **identity, nbytes=size)


def parquet_rows(splits: Sequence[InputSplit]) -> int | None:
    """Rows of an epoch's Parquet splits from their footers (no data read), for the rows/s
    progress; not known for whole objects (their footers are read on the executors, not twice)
    or an unreadable footer."""
    if any(s.rows is None and is_object_url(s.path) for s in splits):
        return None

    def rows(split: InputSplit) -> int:
        if split.rows is not None:
            return split.rows
        footer = pq.ParquetFile(split.path).metadata
        if split.row_groups is None:
            return footer.num_rows
        return sum(footer.row_group(i).num_rows for i in range(*split.row_groups))

    try:
        return sum(rows(s) for s in splits)
    except (OSError, pa.ArrowException):
        return None


def epochs_of(splits: Sequence[InputSplit], per_epoch: int) -> list[list[InputSplit]]:
    """``per_epoch`` consecutive splits per epoch."""
    return [list(splits[i : i + per_epoch]) for i in range(0, len(splits), per_epoch)]


def epochs_by_bytes(splits: Sequence[InputSplit], epoch_bytes: int) -> list[list[InputSplit]]:
    """Consecutive splits in one epoch until the next would take it past ``epoch_bytes``: an
    epoch has at least one split, and a bigger split is an epoch alone. A split of unknown size
    counts as a whole epoch's worth (as one split per epoch would). Greedy, so planning again
    from an epoch boundary gives the same epochs after it."""
    epochs: list[list[InputSplit]] = []
    current: list[InputSplit] = []
    filled = 0
    for split in splits:
        size = split.planned_bytes
        size = epoch_bytes if size is None else size
        if current and filled + size > epoch_bytes:
            epochs.append(current)
            current, filled = [], 0
        current.append(split)
        filled += size
    if current:
        epochs.append(current)
    return epochs


def plan_epochs(
    splits: Sequence[InputSplit], splits_per_epoch: int, epoch_bytes: int | None
) -> list[list[InputSplit]]:
    """The epochs of ``splits`` as the source asks: by bytes with ``epoch_bytes`` (the spec
    refuses it beside ``splits_per_epoch``), else ``splits_per_epoch`` splits each."""
    if epoch_bytes is not None:
        return epochs_by_bytes(splits, epoch_bytes)
    return epochs_of(splits, splits_per_epoch)


def describe_epochs(epochs: Sequence[Sequence[InputSplit]], source: SourceSpec) -> str:
    """How the run's epochs were planned, for its log: ``20 splits (441 MiB) in 10 epochs of
    ~44 MiB (source.epoch_bytes 50MiB)`` or ``… in 20 epochs of 1 split (source.splits_per_epoch
    1)``. Epochs compacted away (empty: earlier runs') are only counted, ``after 9 compacted
    epochs``."""
    compacted = sum(1 for e in epochs if not e)
    epochs = [e for e in epochs if e]
    splits = [s for e in epochs for s in e]
    sizes = [s.planned_bytes for s in splits]
    known = None if None in sizes else sum(s for s in sizes if s is not None)
    total = "" if known is None else f" ({_human(known)})"
    head = f"{len(splits)} split{_s(len(splits))}{total} in {len(epochs)} epoch{_s(len(epochs))}"
    if compacted:
        head += f" after {compacted} compacted epoch{_s(compacted)}"
    if source.epoch_bytes is not None:
        mean = "" if known is None or not epochs else f" of ~{_human(known // len(epochs))}"
        return f"{head}{mean} (source.epoch_bytes {_human(source.epoch_bytes, exact=True)})"
    counts = sorted({len(e) for e in epochs}) or [0]
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    per = f"{n} split{_s(counts[-1])}"
    return f"{head} of {per} (source.splits_per_epoch {source.splits_per_epoch})"


def _s(n: int) -> str:
    return "" if n == 1 else "s"


def _human(n: int, exact: bool = False) -> str:
    """Bytes in binary units (``441 MiB``); ``exact``: a setting as a spec writes it
    (``50MiB``, or its bytes when no unit divides it)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if exact and n % scale == 0:
            return f"{n // scale}{unit}"
        if not exact and n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value >= 10 else f"{value:.1f} {unit}"
    return f"{n}B" if exact else f"{n} B"


# ---------------------------------------------------------------------- the source's state


def processed_item(split: InputSplit, epoch: int, attempt: str | None = None) -> dict[str, Any]:
    """The list-state item of a split already processed, in ``epoch``, by ``attempt`` (the run
    that read it): the next run does not read its file again."""
    item = {**split.to_state(epoch), PROCESSED: True}
    if attempt is not None:
        item["attempt"] = attempt
    return item


def is_processed(item: dict[str, Any]) -> bool:
    return item.get(PROCESSED) is True


def is_table_item(item: dict[str, Any]) -> bool:
    """A static table's file recorded in the source's state (no epoch): never a split."""
    return isinstance(item.get(TABLE), str)


def is_consumed_item(item: dict[str, Any]) -> bool:
    """The compacted record of the files read before the run that wrote the checkpoint."""
    return isinstance(item.get(CONSUMED), dict)


def split_items(items: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items of the source's state that are splits (read or to read), not table files nor
    the compacted record of earlier runs' files."""
    return [dict(i) for i in items if not is_table_item(dict(i)) and not is_consumed_item(i)]


def has_progress(items: Iterable[dict[str, Any]]) -> bool:
    """Does the source's state record what was read (processed splits, or earlier runs' files
    compacted)? Checkpoints older than that are resumed by planning the input anew."""
    return any(is_processed(i) or is_consumed_item(i) for i in items)


@dataclass(frozen=True)
class Consumed:
    """The files read before a run, compacted (Structured Streaming's compacted file log): the
    epochs before ``epochs`` are done, and each file still listed that they read, by path, with
    its identity (size, ETag, mtime). A file that has gone since (e.g. expired by a lifecycle
    rule) is forgotten: it no longer blocks a run, and is not read again. ``watermark``: the
    newest write time (ns) of the files read so far, Spark's latest file timestamp, from which
    ``source.max_file_age`` counts (it never goes back, so a file too old stays too old)."""

    epochs: int = 0
    files: dict[str, tuple[int | None, str | None, int | None]] = field(default_factory=dict)
    watermark: int | None = None

    def to_item(self) -> dict[str, Any]:
        """The one list-state item of this record: ``{"consumed": {"epochs": N, "files":
        [[path, size, etag, mtime], ...], "watermark": ns}}`` (sorted by path)."""
        files = [[path, *identity] for path, identity in sorted(self.files.items())]
        record: dict[str, Any] = {"epochs": self.epochs, "files": files}
        if self.watermark is not None:
            record["watermark"] = self.watermark
        return {CONSUMED: record}

    def describe(self) -> str:
        """For ``ckpt inspect``: ``62 files read in epochs 0-399 (compacted)``."""
        span = "no epochs" if not self.epochs else f"epochs 0-{self.epochs - 1}"
        return f"{len(self.files)} file{_s(len(self.files))} read in {span} (compacted)"

    @classmethod
    def from_items(cls, items: Iterable[dict[str, Any]]) -> Consumed:
        """The record in a source state (none: an empty one, epochs 0)."""
        epochs, files, watermark = 0, {}, None
        for item in items:
            if not is_consumed_item(item):
                continue
            record = item[CONSUMED]
            epochs = max(epochs, int(record.get("epochs", 0)))
            if record.get("watermark") is not None:
                watermark = max(watermark or 0, int(record["watermark"]))
            for path, size, etag, mtime in record.get("files") or []:
                files[str(path)] = (
                    None if size is None else int(size),
                    None if etag is None else str(etag),
                    None if mtime is None else int(mtime),
                )
        return cls(epochs, files, watermark)


@dataclass(frozen=True)
class Resume:
    """Where a run resumes its input: ``epochs`` (the compacted ones empty, then the last run's
    as they were, then the splits still to read and the new files), and ``consumed``: the files
    read before ``consumed.epochs`` that are still listed (with the changed files ignored, in
    their new version) — the record this run's checkpoints carry."""

    epochs: list[list[InputSplit]]
    consumed: Consumed
    #: files read earlier that are gone now (forgotten), and changed ones (ignored/reprocessed)
    gone: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    #: ``source.max_file_age``: files read earlier forgotten now as too old, and every listed
    #: file too old that is not read (the forgotten ones, and late ones never read)
    aged: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def resume(
    items: Sequence[dict[str, Any]],
    files: Sequence[str | ObjectInfo],
    source_format: str,
    max_split_bytes: int | None,
    splits_per_epoch: int,
    checkpoint_id: int,
    epoch_bytes: int | None = None,
    on_changed: str = "refuse",
    max_file_age: timedelta | None = None,
) -> Resume:
    """A run restored from a checkpoint whose source state is ``items`` (earlier runs' files
    compacted, splits processed by the last run, each with its epoch, and splits still to
    read), over the input ``files`` listed now.

    A file read earlier that is gone now is forgotten (an expired input never blocks a run);
    one that has changed (size, ETag or mtime) is refused by name (a :class:`SplitError`: its
    rows would be lost or counted twice), unless ``on_changed`` (``source.on_changed_input``)
    says ``ignore`` (keep what was read) or ``reprocess`` (read it again as new input). A file
    partly read — row groups of it still to read — must be there unchanged whatever the
    setting. The processed epochs come back as they were (the compacted ones empty); after
    them come the unread row groups of a partly read file (as recorded), then every other file
    as listed now: not yet read, its current version is what counts (a fixed malformed file,
    new files since the last run). The epochs after the checkpoint are planned anew, by the
    rule the spec gives now (:func:`plan_epochs`): the sink discards what it staged for them on
    restore. Work is in the files listed and the last run's splits, not in all runs ever.

    ``max_file_age`` (``source.max_file_age``, Spark's ``maxFileAge``) bounds the record when
    the input never expires: a file last written more than that before the newest file read so
    far (the record's watermark) is forgotten if read (unless partly read) and skipped if not,
    so the record holds only the files of that window. An empty start reads every file, as
    Spark's first batch does."""
    earlier = Consumed.from_items(items)
    items = split_items(items)
    groups = _row_groups(items)
    done: dict[int, list[InputSplit]] = {}
    read: dict[str, tuple[int | None, str | None, int | None]] = dict(earlier.files)
    for item in items:
        if is_processed(item):
            split = _with_bytes(InputSplit.from_state(item), groups)
            done.setdefault(int(item["epoch"]), []).append(split)
    for epoch in sorted(done):
        for split in done[epoch]:
            read[split.path] = split.identity()
    base = earlier.epochs
    if sorted(done) != list(range(base, base + len(done))):
        raise SplitError(
            f"source: checkpoint {checkpoint_id} has no processed splits for some epochs "
            f"(it has epochs {sorted(done)[:5]}... after {base} compacted): its source state "
            "is incomplete"
        )
    partial = {str(i["path"]) for i in items if not is_processed(i) and str(i["path"]) in read}
    listed = {_path(f): f for f in files}
    watermark = _watermark(earlier.watermark, (listed[p] for p in read if p in listed))
    too_old = _too_old(watermark, max_file_age)
    kept: dict[str, tuple[int | None, str | None, int | None]] = {}
    gone: list[str] = []
    changed: list[str] = []
    aged: list[str] = []
    for path, then in sorted(read.items()):
        file = listed.get(path)
        if file is not None and path not in partial and too_old(file):
            aged.append(path)  # forgotten: skipped below as too old, as long as it stays so
            continue
        if file is None:
            if path in partial:
                raise SplitError(
                    f"source: {path} was partly read by checkpoint {checkpoint_id} and is gone "
                    "before its remaining row groups were read; put the file back to finish "
                    "it, or use a new job"
                )
            gone.append(path)
            continue
        now = InputSplit(path, **_identity(file)).identity()
        if any(a is not None and a != b for a, b in zip(then, now, strict=True)):
            if path in partial or on_changed == "refuse":
                how = (
                    "restore with the input it was taken with, or use a new job"
                    if path in partial
                    else "put the version read back, or set source.on_changed_input"
                )
                raise SplitError(
                    f"source: {path} was read by checkpoint {checkpoint_id} and has changed "
                    f"since (size, etag, mtime {_show(then)} then, {_show(now)} now); {how}"
                )
            changed.append(path)
            if on_changed == "reprocess":
                continue  # planned again below as a new file
        kept[path] = now
    unread = sorted(
        (_with_bytes(InputSplit.from_state(i), groups) for i in items if _unread_of(i, partial)),
        key=_order,
    )
    new = [f for f in files if _path(f) not in kept]
    skipped = [_path(f) for f in new if too_old(f)]
    rest = plan_splits([f for f in new if not too_old(f)], source_format, max_split_bytes)
    epochs: list[list[InputSplit]] = [[] for _ in range(base)]
    epochs += [sorted(done[e], key=_order) for e in sorted(done)]
    consumed = Consumed(len(epochs), kept, watermark)
    epochs += plan_epochs(unread + rest, splits_per_epoch, epoch_bytes)
    return Resume(epochs, consumed, gone, changed, aged, skipped)


def modified_ns(file: str | ObjectInfo) -> int | None:
    """When ``file`` was last written (ns): an object's listed time, a local file's mtime."""
    if isinstance(file, ObjectInfo):
        return file.modified
    try:
        return os.stat(file).st_mtime_ns
    except OSError:
        return None


def _watermark(recorded: int | None, read: Iterable[str | ObjectInfo]) -> int | None:
    """The newest write time of the files read so far: the record's, or a read file's now."""
    times = [t for t in map(modified_ns, read) if t is not None]
    if recorded is not None:
        times.append(recorded)
    return max(times, default=None)


def _too_old(watermark: int | None, max_age: timedelta | None) -> Callable[[Any], bool]:
    """Is a listed file older than ``max_age`` before ``watermark`` (never, when unset)?"""
    if watermark is None or max_age is None:
        return lambda _file: False
    limit = watermark - int(max_age.total_seconds() * 1e9)

    def too_old(file: str | ObjectInfo) -> bool:
        when = modified_ns(file)
        return when is not None and when < limit

    return too_old


def source_state(
    epochs: Sequence[Sequence[InputSplit]],
    first_epoch: int,
    consumed: Consumed | None,
    read_by: dict[int, str],
    attempt: str | None,
) -> list[dict[str, Any]]:
    """The source's list state (Flink's ``PendingSplitsCheckpoint``) at ``first_epoch``: the
    files read before the run, compacted (``consumed``; None: none, every processed split is
    an item, as for an empty start), the splits this run processed before ``first_epoch``
    (each with the run that read it) and those still to read."""
    head = [] if consumed is None else [consumed.to_item()]
    since = 0 if consumed is None else consumed.epochs
    processed = [
        processed_item(s, e, read_by.get(e, attempt))
        for e in range(since, min(first_epoch, len(epochs)))
        for s in epochs[e]
    ]
    remaining = [s.to_state(e) for e in range(first_epoch, len(epochs)) for s in epochs[e]]
    return head + processed + remaining


def schema_splits(
    epochs: Sequence[Sequence[InputSplit]], at: int, files: Sequence[str | ObjectInfo]
) -> list[InputSplit]:
    """Splits to learn the input's schema from: epoch ``at``'s, else the latest earlier epoch
    whose files are all still listed, else the first file listed (the epochs read earlier may
    be compacted, or their files expired)."""
    listed = {_path(f) for f in files}
    for e in range(min(at, len(epochs) - 1), -1, -1):
        if epochs[e] and all(s.path in listed for s in epochs[e]):
            return list(epochs[e])
    return [InputSplit(_path(files[0]), **_identity(files[0]))]


def _unread_of(item: dict[str, Any], partial: set[str]) -> bool:
    """A split still to read of a file the checkpoint has partly read."""
    return not is_processed(item) and str(item["path"]) in partial


def _row_groups(items: Sequence[dict[str, Any]]) -> dict[str, int]:
    """The row groups of each file the state has in runs: the file's runs, read or not, are
    all in the state, so the last one's end is its number of row groups."""
    ends: dict[str, int] = {}
    for item in items:
        groups = item.get("row_groups")
        if groups is not None:
            path = str(item["path"])
            ends[path] = max(ends.get(path, 0), int(groups[1]))
    return ends


def _with_bytes(split: InputSplit, row_groups: dict[str, int]) -> InputSplit:
    """A row-group run from the state, with its bytes (for ``epoch_bytes``) estimated without
    reading the footer again: its share of its file's size by row groups."""
    if split.row_groups is None or split.size is None:
        return split
    start, end = split.row_groups
    total = max(row_groups.get(split.path, end), 1)
    return replace(split, nbytes=split.size * (end - start) // total)


def _order(split: InputSplit) -> tuple[str, int]:
    return split.path, -1 if split.row_groups is None else split.row_groups[0]


def _show(identity: tuple[int | None, str | None, int | None]) -> str:
    return "/".join("-" if v is None else str(v) for v in identity)
