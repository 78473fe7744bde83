"""On-disk format of one subtask's state snapshot (Flink's keyed-state ``KeyGroupRangeOffsets``).

A snapshot is an Arrow IPC *file*, so a reader can seek to any record batch. Keyed state is a
table with an int32 ``key_group`` column; the writer sorts it by key group and writes one record
batch per non-empty key group (a large group is split into several consecutive batches). The schema
metadata, written before the batches, describes the file under ``ckpt.*`` keys (UTF-8 strings):

=========================  =================================================================
``ckpt.format``            ``keyed-state`` (or ``list-state`` for operator list state)
``ckpt.format_version``    ``1``
``ckpt.operator_id``       the operator the state belongs to
``ckpt.max_parallelism``   number of key groups of the job's state            (keyed only)
``ckpt.key_group_start``   first key group of the writing subtask's range     (keyed only)
``ckpt.key_group_end``     last key group of that range (inclusive)           (keyed only)
``ckpt.index``             JSON: key group -> segment                         (keyed only)
``ckpt.items``             JSON: the one segment of list items                (list only)
=========================  =================================================================

A *segment* is a contiguous run of record batches: ``{"batch": first batch index, "batches":
count, "rows": rows, "offset": byte offset of its first message relative to the end of the schema
message, "bytes": length of its messages, "sha256": "sha256:<hex>" of exactly those bytes}``.

Because every group carries its own offset and checksum, a rescaled subtask reads and verifies
just the groups it now owns, without touching (or trusting) the rest of the file; the whole-file
checksum stays the storage layer's job. Rows are decoded from the very bytes that were hashed, so
nothing unverified is ever returned, and a corrupt file raises :class:`CorruptSnapshotError` rather
than yielding a partial table. Nothing here pickles or runs code on load.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import astuple, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from checkpointing.errors import CorruptSnapshotError, InvalidIdError, StorageError
from checkpointing.ids import validate_id
from checkpointing.state.ipc_guard import is_compressed_record_batch
from checkpointing.state.keygroups import UPPER_BOUND_MAX_PARALLELISM, KeyGroupRange
from checkpointing.state.storage import CHECKSUM_ALGO

KEYED_STATE_FORMAT = "keyed-state"
LIST_STATE_FORMAT = "list-state"
FORMAT_VERSION = 1
KEY_GROUP_COLUMN = "key_group"
DEFAULT_MAX_ROWS_PER_BATCH = 65536

META_PREFIX = "ckpt."
META_FORMAT = "ckpt.format"
META_VERSION = "ckpt.format_version"
META_OPERATOR_ID = "ckpt.operator_id"
META_MAX_PARALLELISM = "ckpt.max_parallelism"
META_KEY_GROUP_START = "ckpt.key_group_start"
META_KEY_GROUP_END = "ckpt.key_group_end"
META_INDEX = "ckpt.index"
META_ITEMS = "ckpt.items"

DEFAULT_PATH = "<snapshot>"

#: what a snapshot can be read from: its bytes, an Arrow buffer, or a local file path
Source = bytes | bytearray | memoryview | pa.Buffer | str | os.PathLike[str]
ListItem = dict[str, str | int | None]

_FILE_MAGIC = b"ARROW1\x00\x00"
_CONTINUATION = 0xFFFFFFFF
_INT = re.compile(r"0|[1-9][0-9]{0,18}", re.ASCII)
_CHECKSUM = re.compile(rf"{CHECKSUM_ALGO}:[0-9a-f]{{64}}", re.ASCII)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_SEGMENT_FIELDS = {"batch", "batches", "rows", "offset", "bytes", "sha256"}


@dataclass(frozen=True)
class Segment:
    """Where a key group's (or the list items') batches are in the file, and their checksum."""

    first_batch: int
    num_batches: int
    rows: int
    offset: int
    nbytes: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        names = ("batch", "batches", "rows", "offset", "bytes", "sha256")  # in field order
        return dict(zip(names, astuple(self), strict=True))


@dataclass(frozen=True)
class SnapshotInfo:
    """What a keyed-state snapshot holds, read from its footer alone (no batch is touched), so a
    restore can plan which files and groups to fetch before reading any state."""

    operator_id: str
    key_groups: KeyGroupRange
    max_parallelism: int
    #: the state table's schema, without the ``ckpt.*`` metadata
    schema: pa.Schema
    #: non-empty key groups in ascending order
    groups: Mapping[int, Segment]
    format_version: int = FORMAT_VERSION

    @property
    def num_rows(self) -> int:
        return sum(s.rows for s in self.groups.values())

    @property
    def num_bytes(self) -> int:
        """Bytes of all record batches (the file adds schema and footer)."""
        return sum(s.nbytes for s in self.groups.values())


# ============================================================================ writing


def write_keyed_snapshot(
    table: pa.Table,
    *,
    operator_id: str,
    key_groups: KeyGroupRange,
    max_parallelism: int,
    max_rows_per_batch: int = DEFAULT_MAX_ROWS_PER_BATCH,
) -> bytes:
    """Serialise one subtask's keyed state, one key group after another.

    Rows keep their order within a key group. Every row's key group must lie in ``key_groups``
    (the subtask's range): state outside it would be silently lost or duplicated on restore.
    """
    validate_id(operator_id, "operator id")
    _check_positive_int(max_parallelism, "max_parallelism")
    if max_parallelism > UPPER_BOUND_MAX_PARALLELISM:
        raise ValueError(
            f"max_parallelism must be in [1, {UPPER_BOUND_MAX_PARALLELISM}], got {max_parallelism}"
        )
    if not isinstance(key_groups, KeyGroupRange):
        raise TypeError(f"key_groups must be a KeyGroupRange, got {type(key_groups).__name__}")
    if not 0 <= key_groups.start <= key_groups.end < max_parallelism:
        raise ValueError(
            f"key group range {key_groups.start}..{key_groups.end} is empty or not within "
            f"[0, max_parallelism={max_parallelism})"
        )
    _check_positive_int(max_rows_per_batch, "max_rows_per_batch")
    table = _prepare_keyed_table(table, key_groups)

    parts: list[tuple[int, list[pa.RecordBatch]]] = []
    if table.num_rows:
        kg = table.column(KEY_GROUP_COLUMN).to_numpy()
        (changes,) = np.nonzero(np.diff(kg))
        starts = [0, *(int(i) + 1 for i in changes)]
        stops = [*starts[1:], table.num_rows]
        (whole,) = table.combine_chunks().to_batches()
        for start, stop in zip(starts, stops, strict=True):
            batches = [
                whole.slice(s, min(max_rows_per_batch, stop - s))
                for s in range(start, stop, max_rows_per_batch)
            ]
            parts.append((int(kg[start]), batches))

    segments, batches, ends = _plan(parts)
    metadata = {
        META_FORMAT: KEYED_STATE_FORMAT,
        META_VERSION: str(FORMAT_VERSION),
        META_OPERATOR_ID: operator_id,
        META_MAX_PARALLELISM: str(max_parallelism),
        META_KEY_GROUP_START: str(key_groups.start),
        META_KEY_GROUP_END: str(key_groups.end),
        META_INDEX: _dump_json({str(g): s.to_json() for g, s in segments.items()}),
    }
    return _write_file(table.schema, metadata, batches, ends)


def write_list_state(items: list[ListItem], *, operator_id: str) -> bytes:
    """Serialise an operator's list state (e.g. source splits as ``{"path": …, "offset": …}``).

    Every item needs the same keys, and each key holds only strings or only ints (or None), so the
    items come back exactly as given; the redistribution on restore is the caller's business.
    A reader takes at most one item per byte of the file: never more all-None items than that.
    """
    validate_id(operator_id, "operator id")
    if not isinstance(items, list):
        raise TypeError(f"items must be a list of dicts, got {type(items).__name__}")
    names: list[str] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise TypeError(f"item {i} must be a dict, got {type(item).__name__}")
        if i == 0:
            names = list(item)
            if not names:
                raise ValueError("item 0 has no keys; list state items need at least one")
            for name in names:
                if not isinstance(name, str) or not name:
                    raise ValueError(f"item keys must be non-empty strings, got {name!r}")
        elif set(item) != set(names):
            raise ValueError(f"item {i} has keys {sorted(item)}, item 0 has {sorted(names)}")
    arrays = [_list_column(name, [item[name] for item in items]) for name in names]
    table = pa.Table.from_arrays(arrays, names=names)
    batches = table.combine_chunks().to_batches() if table.num_rows else []
    segments, ordered, ends = _plan([(0, batches)] if batches else [])
    segment = segments.get(0) or Segment(0, 0, 0, 0, 0, _checksum([]))
    metadata = {
        META_FORMAT: LIST_STATE_FORMAT,
        META_VERSION: str(FORMAT_VERSION),
        META_OPERATOR_ID: operator_id,
        META_ITEMS: _dump_json(segment.to_json()),
    }
    return _write_file(table.schema, metadata, ordered, ends)


def _check_positive_int(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _prepare_keyed_table(table: pa.Table, key_groups: KeyGroupRange) -> pa.Table:
    """Validate the state table; return it with an int32 ``key_group``, sorted (stably) by it."""
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    if not isinstance(table, pa.Table):
        raise TypeError(f"state must be a pyarrow Table, got {type(table).__name__}")
    reserved = [k for k in (table.schema.metadata or {}) if k.startswith(META_PREFIX.encode())]
    if reserved:
        raise ValueError(f"schema metadata keys {reserved} use the reserved prefix {META_PREFIX!r}")
    _check_no_dictionaries(table.schema)
    indices = table.schema.get_all_field_indices(KEY_GROUP_COLUMN)
    if len(indices) != 1:
        found = "no" if not indices else f"{len(indices)}"
        raise ValueError(
            f"state table needs exactly one {KEY_GROUP_COLUMN!r} column, found {found}"
        )
    (index,) = indices
    field = table.schema.field(index)
    if not pa.types.is_integer(field.type):
        raise ValueError(f"{KEY_GROUP_COLUMN!r} column must be an integer type, got {field.type}")
    column = table.column(index)
    if column.null_count:
        raise ValueError(f"{KEY_GROUP_COLUMN!r} column contains nulls")
    if table.num_rows:
        outside = pc.or_(
            pc.less(column, key_groups.start), pc.greater(column, key_groups.end)
        ).combine_chunks()
        first = pc.index(outside, True).as_py()
        if first >= 0:
            raise ValueError(
                f"row {first} has key group {column[first].as_py()}, outside this subtask's "
                f"range {key_groups.start}..{key_groups.end}"
            )
    if field.type != pa.int32():
        column = column.cast(pa.int32())  # safe: every value lies in [0, 2**15)
        field = pa.field(KEY_GROUP_COLUMN, pa.int32(), field.nullable, field.metadata)
        table = table.set_column(index, field, column)
    if table.num_rows > 1 and np.any(np.diff(table.column(index).to_numpy()) < 0):
        table = table.take(pc.sort_indices(table, sort_keys=[(KEY_GROUP_COLUMN, "ascending")]))
    return table


def _check_no_dictionaries(schema: pa.Schema) -> None:
    """Dictionary batches would sit between our record batches and break the offsets."""

    def walk(t: pa.DataType, name: str) -> None:
        if pa.types.is_dictionary(t):
            raise ValueError(f"column {name!r} is dictionary-encoded; decode it before writing")
        for i in range(t.num_fields):
            walk(t.field(i).type, name)

    for f in schema:
        walk(f.type, f.name)


def _list_column(name: str, values: list[Any]) -> pa.Array:
    kinds = set()
    for v in values:
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, str | int):
            raise ValueError(f"list state key {name!r}: {v!r} is not a str, int or None")
        if isinstance(v, int) and not _INT64_MIN <= v <= _INT64_MAX:
            raise ValueError(f"list state key {name!r}: {v} does not fit a 64-bit integer")
        kinds.add(str if isinstance(v, str) else int)
    if len(kinds) > 1:
        raise ValueError(f"list state key {name!r} mixes strings and integers")
    arrow_type = {str: pa.string(), int: pa.int64()}.get(next(iter(kinds), None), pa.null())
    return pa.array(values, type=arrow_type)


def _plan(
    parts: Sequence[tuple[int, list[pa.RecordBatch]]],
) -> tuple[dict[int, Segment], list[pa.RecordBatch], list[int]]:
    """Each part's segment, computed from its batches' serialised messages before anything is
    written (the index goes into the schema, ahead of the batches); also all batches in order and
    where each one's message must end, relative to the first batch."""
    segments: dict[int, Segment] = {}
    ordered: list[pa.RecordBatch] = []
    ends: list[int] = []
    offset = 0
    for key, batches in parts:
        digest = hashlib.sha256()
        nbytes = 0
        for batch in batches:
            message = batch.serialize()
            digest.update(message)
            nbytes += message.size
            ends.append(offset + nbytes)
        segments[key] = Segment(
            first_batch=len(ordered),
            num_batches=len(batches),
            rows=sum(b.num_rows for b in batches),
            offset=offset,
            nbytes=nbytes,
            sha256=f"{CHECKSUM_ALGO}:{digest.hexdigest()}",
        )
        ordered.extend(batches)
        offset += nbytes
    return segments, ordered, ends


def _write_file(
    schema: pa.Schema, metadata: dict[str, str], batches: list[pa.RecordBatch], ends: list[int]
) -> bytes:
    """Write the IPC file, checking that every batch landed exactly where the index says (so the
    checksums describe the bytes on disk)."""
    schema = schema.with_metadata({**(schema.metadata or {}), **metadata})
    sink = pa.BufferOutputStream()
    positions = []
    with pa.ipc.new_file(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
            positions.append(sink.tell())
    data = sink.getvalue().to_pybytes()
    if batches:
        start = _data_start(data, DEFAULT_PATH)
        if [p - start for p in positions] != ends:
            raise RuntimeError("record batches were not written where the index says")
    return data


def _dump_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=True)


def _checksum(buffers: Sequence[Any]) -> str:
    digest = hashlib.sha256()
    for b in buffers:
        digest.update(b)
    return f"{CHECKSUM_ALGO}:{digest.hexdigest()}"


# ============================================================================ reading


def read_snapshot_info(data_or_file: Source, *, path: str = DEFAULT_PATH) -> SnapshotInfo:
    """Describe a keyed-state snapshot from its schema and footer alone."""
    with _open(data_or_file, path) as snapshot:
        return snapshot.keyed_info()


def read_keyed_snapshot(
    source: Source, key_groups: KeyGroupRange | None = None, *, path: str = DEFAULT_PATH
) -> pa.Table:
    """The rows of the requested key groups (all when None), in key-group order.

    Only the batches of groups in both ``key_groups`` and the file's range are read, each group's
    bytes are checked against its sha256 before they are decoded, and any inconsistency raises
    :class:`CorruptSnapshotError` naming ``path`` (or the file path when reading a file).
    """
    with _open(source, path) as snapshot:
        info = snapshot.keyed_info()
        wanted = info.key_groups if key_groups is None else info.key_groups.intersection(key_groups)
        batches: list[pa.RecordBatch] = []
        for group, segment in info.groups.items():
            if group in wanted:
                batches.extend(snapshot.read_segment(segment, f"key group {group}", group))
        return pa.Table.from_batches(batches, schema=info.schema)


def read_list_state(source: Source, *, path: str = DEFAULT_PATH) -> list[ListItem]:
    """The items written by :func:`write_list_state`, verified against their checksum."""
    with _open(source, path) as snapshot:
        meta = snapshot.check_format(LIST_STATE_FORMAT)
        snapshot.operator_id(meta)
        for f in snapshot.schema:
            if f.type not in (pa.string(), pa.int64(), pa.null()):
                raise snapshot.corrupt(f"list state column {f.name!r} has type {f.type}")
        segment = _parse_segment(_parse_json(meta, META_ITEMS, snapshot), snapshot, "items")
        if segment.first_batch != 0 or segment.offset != 0:
            raise snapshot.corrupt("list state items must start at the first batch")
        if segment.num_batches != snapshot.num_batches:
            raise snapshot.corrupt(
                f"index lists {segment.num_batches} batches, the file has {snapshot.num_batches}"
            )
        batches = snapshot.read_segment(segment, "items", None)
        items: list[ListItem] = pa.Table.from_batches(batches, schema=snapshot.schema).to_pylist()
        return items


class _Snapshot:
    """An opened snapshot file: its footer has been read, its batches not yet."""

    def __init__(self, file: pa.NativeFile, path: str) -> None:
        self.file = file
        self.path = path
        try:
            self.size = file.size()
            reader = pa.ipc.open_file(file)
            schema = reader.schema
            self.num_batches = reader.num_record_batches
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise self.corrupt(f"not an Arrow IPC snapshot file ({exc})") from None
        raw = schema.metadata or {}
        try:
            self.meta = {
                k.decode(): v.decode() for k, v in raw.items() if k.startswith(META_PREFIX.encode())
            }
        except UnicodeDecodeError:
            raise self.corrupt("snapshot metadata is not UTF-8") from None
        user = {k: v for k, v in raw.items() if not k.startswith(META_PREFIX.encode())}
        self.schema = schema.with_metadata(user) if user else schema.remove_metadata()
        self._data_start: int | None = None

    def corrupt(self, reason: str) -> CorruptSnapshotError:
        return CorruptSnapshotError(self.path, reason)

    def check_format(self, expected: str) -> dict[str, str]:
        found = self.meta.get(META_FORMAT)
        if found is None:
            raise self.corrupt(f"not a checkpoint snapshot (no {META_FORMAT} metadata)")
        if found != expected:
            raise self.corrupt(f"format is {found!r}, expected {expected!r}")
        version = self.meta.get(META_VERSION)
        if version != str(FORMAT_VERSION):
            raise self.corrupt(
                f"unsupported {expected} format version {version!r} (this code reads "
                f"{FORMAT_VERSION})"
            )
        return self.meta

    def operator_id(self, meta: Mapping[str, str]) -> str:
        try:
            return validate_id(meta.get(META_OPERATOR_ID), "operator id")
        except InvalidIdError as exc:
            raise self.corrupt(str(exc)) from None

    def int_field(self, meta: Mapping[str, str], key: str, low: int, high: int) -> int:
        text = meta.get(key)
        if text is None or not _INT.fullmatch(text) or not low <= int(text) <= high:
            raise self.corrupt(f"{key} is {text!r}, expected an integer in [{low}, {high}]")
        return int(text)

    def keyed_info(self) -> SnapshotInfo:
        meta = self.check_format(KEYED_STATE_FORMAT)
        operator_id = self.operator_id(meta)
        max_p = self.int_field(meta, META_MAX_PARALLELISM, 1, UPPER_BOUND_MAX_PARALLELISM)
        start = self.int_field(meta, META_KEY_GROUP_START, 0, max_p - 1)
        end = self.int_field(meta, META_KEY_GROUP_END, start, max_p - 1)
        key_groups = KeyGroupRange(start, end)
        indices = self.schema.get_all_field_indices(KEY_GROUP_COLUMN)
        if len(indices) != 1 or self.schema.field(indices[0]).type != pa.int32():
            raise self.corrupt(f"no int32 {KEY_GROUP_COLUMN!r} column")
        index = _parse_json(meta, META_INDEX, self)
        if not isinstance(index, dict):
            raise self.corrupt(f"{META_INDEX} is not a JSON object")
        groups: dict[int, Segment] = {}
        for key, value in index.items():
            if not _INT.fullmatch(key) or int(key) not in key_groups:
                raise self.corrupt(f"{META_INDEX} lists key group {key!r} outside {start}..{end}")
            groups[int(key)] = _parse_segment(value, self, f"key group {key}")
        groups = dict(sorted(groups.items()))
        next_batch = next_offset = 0
        for group, seg in groups.items():
            if seg.rows < 1 or seg.num_batches < 1:
                raise self.corrupt(f"{META_INDEX}: key group {group} is listed but empty")
            if seg.first_batch != next_batch or seg.offset != next_offset:
                raise self.corrupt(f"{META_INDEX}: key group {group} is not where the index says")
            next_batch += seg.num_batches
            next_offset += seg.nbytes
        if next_batch != self.num_batches:
            raise self.corrupt(
                f"{META_INDEX} lists {next_batch} batches, the file has {self.num_batches}"
            )
        return SnapshotInfo(operator_id, key_groups, max_p, self.schema, groups)

    @property
    def data_start(self) -> int:
        if self._data_start is None:
            prefix = self.read_range(0, 16, "the schema message")
            self._data_start = _data_start(prefix, self.path)
        return self._data_start

    def read_range(self, offset: int, nbytes: int, what: str) -> pa.Buffer:
        if offset + nbytes > self.size:
            raise self.corrupt(f"{what} lies beyond the end of the file (truncated?)")
        try:
            self.file.seek(offset)
            data = self.file.read_buffer(nbytes)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise self.corrupt(f"cannot read {what} ({exc})") from None
        if data.size != nbytes:
            raise self.corrupt(f"{what} is truncated")
        return data

    def read_segment(self, segment: Segment, what: str, group: int | None) -> list[pa.RecordBatch]:
        """Read, verify and decode one segment's batches; ``group`` is checked against every row."""
        if not segment.num_batches:
            return []
        raw = self.read_range(self.data_start + segment.offset, segment.nbytes, what)
        if _checksum([raw]) != segment.sha256:
            raise self.corrupt(f"{what}: checksum mismatch")
        batches = []
        try:
            stream = pa.BufferReader(raw)
            for _ in range(segment.num_batches):
                message = pa.ipc.read_message(stream)
                if message.type != "record batch":
                    raise self.corrupt(f"{what}: unexpected {message.type} message")
                if is_compressed_record_batch(message.metadata):  # unbounded once decoded
                    raise self.corrupt(f"{what}: compressed record batch (never written), refused")
                batch = pa.ipc.read_record_batch(message, self.schema)
                batch.validate(full=True)
                batches.append(batch)
            leftover = raw.size - stream.tell()
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise self.corrupt(f"{what}: cannot decode its batches ({exc})") from None
        if leftover:
            raise self.corrupt(f"{what}: {leftover} bytes after its last batch")
        if segment.rows > self.size:  # null-typed columns: rows from no bytes, millions of items
            raise self.corrupt(f"{what}: {segment.rows} rows in a file of {self.size} bytes")
        rows = sum(b.num_rows for b in batches)
        if rows != segment.rows:
            raise self.corrupt(f"{what}: index says {segment.rows} rows, its batches hold {rows}")
        if group is not None:
            for batch in batches:
                kg = batch.column(KEY_GROUP_COLUMN)
                if kg.null_count or pc.min_max(kg).as_py() != {"min": group, "max": group}:
                    raise self.corrupt(f"{what}: its batches hold rows of other key groups")
        return batches


@contextmanager
def _open(source: Source, path: str) -> Iterator[_Snapshot]:
    if isinstance(source, str | os.PathLike):
        local = os.fspath(source)
        if path == DEFAULT_PATH:
            path = local
        try:
            file: pa.NativeFile = pa.OSFile(local, "r")
        except FileNotFoundError:
            raise CorruptSnapshotError(path, "file is missing") from None
        except OSError as exc:
            raise StorageError(f"cannot read {path}: {exc}") from exc
    elif isinstance(source, pa.Buffer):
        file = pa.BufferReader(source)
    elif isinstance(source, bytes | bytearray | memoryview):
        file = pa.BufferReader(pa.py_buffer(source))
    else:
        raise TypeError(f"cannot read a snapshot from {type(source).__name__}")
    with file:
        yield _Snapshot(file, path)


def _data_start(prefix: bytes | pa.Buffer, path: str) -> int:
    """Offset of the first record batch: right after the magic and the schema message (no
    dictionaries are ever written)."""
    head = bytes(memoryview(prefix)[:16])
    if len(head) < 16 or head[:8] != _FILE_MAGIC:
        raise CorruptSnapshotError(path, "bad Arrow file magic")
    continuation, length = struct.unpack("<Ii", head[8:16])
    if continuation != _CONTINUATION or length <= 0 or length % 8:
        raise CorruptSnapshotError(path, "malformed schema message")
    return 16 + length


def _parse_json(meta: Mapping[str, str], key: str, snapshot: _Snapshot) -> Any:
    text = meta.get(key)
    if text is None:
        raise snapshot.corrupt(f"no {key} metadata")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise snapshot.corrupt(f"{key} is not valid JSON ({exc})") from None


def _parse_segment(value: Any, snapshot: _Snapshot, what: str) -> Segment:
    if not isinstance(value, dict) or set(value) != _SEGMENT_FIELDS:
        raise snapshot.corrupt(f"index entry of {what} is malformed")
    numbers = [value[k] for k in ("batch", "batches", "rows", "offset", "bytes")]
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in numbers):
        raise snapshot.corrupt(f"index entry of {what} has invalid numbers")
    checksum = value["sha256"]
    if not isinstance(checksum, str) or not _CHECKSUM.fullmatch(checksum):
        raise snapshot.corrupt(f"index entry of {what} has an invalid sha256")
    return Segment(*numbers, checksum)
