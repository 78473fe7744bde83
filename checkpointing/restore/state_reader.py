"""Read the state inside a completed checkpoint or savepoint (Flink's State Processor API,
``SavepointReader``): the rows of an operator's keyed state, one key's row, or the items of its
operator list state — for debugging a job's state without running it.

Everything read is verified the way a restore verifies it: the ``_metadata`` against the
metastore's checksum, every handle inside the checkpoint's directory (a ``_metadata`` from shared
storage must not steer reads elsewhere), each file read against its recorded size and SHA-256, and
each key group's segment against its own checksum. A key lookup reads only the file that holds
the key's key group, and decodes only that group.

Keyed state (as the Spark runtime writes it) is a table of the key columns, the operator's state
columns (partial aggregates ``__<kind>_<name>``, see :data:`PARTIAL_COLUMN`) and ``key_group``.
The key columns are taken from the snapshot schema's ``key_columns`` metadata (a JSON list) when
the writer recorded it, else they are the columns that are neither ``key_group`` nor partial
aggregates; a caller can name them. Either way a key lookup checks that they reproduce the key
group stored with every row it reads, so a wrong guess is an error, never a silently wrong answer.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal

import pyarrow as pa

from checkpointing.errors import CheckpointingError, CorruptSnapshotError
from checkpointing.metastore import jobs
from checkpointing.metastore.engine import Metastore
from checkpointing.restore import lookup as restore
from checkpointing.state.incremental import merge_chain
from checkpointing.state.keygroups import KeyGroupRange, KeyValue, key_group_for
from checkpointing.state.metadata import (
    PARQUET,
    ChainedFile,
    OperatorState,
    SubtaskStateHandle,
)
from checkpointing.state.parquet_runs import read_run, run_schema
from checkpointing.state.snapshot import (
    KEY_GROUP_COLUMN,
    SnapshotInfo,
    read_keyed_snapshot,
    read_list_state,
    read_snapshot_info,
)
from checkpointing.state.storage import CheckpointStorage

#: schema metadata key (outside the reserved ``ckpt.`` prefix) naming the key columns, in order
KEY_COLUMNS_METADATA = "key_columns"
#: the partial-aggregate columns of :class:`checkpointing.spark.aggregations.AggregationPlan`
PARTIAL_COLUMN = re.compile(r"__(?:cnt|sum|min|max|set|hll|maxby|minby|mom)_.+")
#: values of a distinct set shown by :func:`describe_value`
SHOWN_SET_VALUES = 5

StateKind = Literal["keyed", "list", "empty"]


class UnknownOperatorError(CheckpointingError, LookupError):
    """The checkpoint has no state for that operator (the message lists those it has)."""


class StateReadError(CheckpointingError, ValueError):
    """A request the state cannot answer: a bad key, a key on list state, unknown key columns."""


@dataclass(frozen=True)
class OperatorSummary:
    """One operator's state in a checkpoint, from ``_metadata`` alone."""

    operator_id: str
    kind: StateKind
    parallelism: int
    max_parallelism: int
    files: int
    bytes: int
    list_items: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "operator_id": self.operator_id,
            "kind": self.kind,
            "parallelism": self.parallelism,
            "max_parallelism": self.max_parallelism,
            "files": self.files,
            "bytes": self.bytes,
            "list_items": self.list_items,
        }


@dataclass(frozen=True)
class StateView:
    """State read from one operator of a checkpoint.

    Keyed state: ``rows`` hold the key columns, the state columns and ``key_group``, in key-group
    order; with ``key`` only that key's row (none when the checkpoint has no state for it), and
    ``key_group`` is the key's group. List state: ``rows`` are ``{"subtask": i, "item": {…}}`` in
    subtask order. ``truncated``: more rows exist than ``limit`` let through.
    """

    job_id: str
    checkpoint_id: int
    checkpoint_type: str
    operator_id: str
    kind: StateKind
    parallelism: int
    max_parallelism: int
    columns: list[str]
    rows: list[dict[str, Any]]
    truncated: bool = False
    key_columns: list[str] | None = None
    key: list[Any] | None = None
    key_group: int | None = None
    files_read: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly: dates as ISO text, decimals as strings."""
        return {
            "job_id": self.job_id,
            "checkpoint_id": self.checkpoint_id,
            "checkpoint_type": self.checkpoint_type,
            "operator_id": self.operator_id,
            "kind": self.kind,
            "parallelism": self.parallelism,
            "max_parallelism": self.max_parallelism,
            "key_columns": self.key_columns,
            "key": _jsonable(self.key),
            "key_group": self.key_group,
            "columns": self.columns,
            "rows": _jsonable(self.rows),
            "truncated": self.truncated,
            "files_read": self.files_read,
        }


class CheckpointReader:
    """A completed checkpoint or savepoint of a job, opened for reading its state.

    Opening verifies the ``_metadata`` and that every state file exists with its size inside the
    checkpoint's directory; file contents are verified as they are read.
    """

    def __init__(self, storage: CheckpointStorage, decision: restore.RestoreDecision) -> None:
        if decision.metadata is None or decision.checkpoint_id is None:
            raise ValueError("a checkpoint reader needs a checkpoint")
        self.storage = storage
        self.decision = decision
        self.metadata = decision.metadata
        self._files: dict[str, bytes] = {}

    @classmethod
    def open(
        cls, metastore: Metastore, storage: CheckpointStorage, job_id: str, checkpoint_id: int
    ) -> CheckpointReader:
        jobs.require_job(metastore, job_id)
        decision = restore.load_checkpoint(metastore, storage, job_id, checkpoint_id, deep=False)
        return cls(storage, decision)

    # ------------------------------------------------------------------ operators

    def operators(self) -> list[OperatorSummary]:
        return [
            OperatorSummary(
                operator_id=op.operator_id,
                kind=_kind(op),
                parallelism=op.parallelism,
                max_parallelism=op.max_parallelism,
                files=sum(len(s.files()) for s in op.subtasks),
                bytes=sum(f.size for s in op.subtasks for f in s.files()),
                list_items=sum(len(s.list_state or ()) for s in op.subtasks),
            )
            for op in sorted(self.metadata.operators, key=lambda o: o.operator_id)
        ]

    def operator(self, operator_id: str) -> OperatorState:
        for op in self.metadata.operators:
            if op.operator_id == operator_id:
                return op
        present = ", ".join(sorted(o.operator_id for o in self.metadata.operators)) or "none"
        raise UnknownOperatorError(
            f"checkpoint {self.decision.checkpoint_id} of job {self.decision.job_id} has no "
            f"operator {operator_id!r}; its operators: {present}"
        )

    # ------------------------------------------------------------------ reading

    def read(
        self,
        operator_id: str,
        *,
        key: Sequence[KeyValue] | None = None,
        key_columns: Sequence[str] | None = None,
        limit: int | None = None,
    ) -> StateView:
        """An operator's state: every row (up to ``limit``), or with ``key`` that key's row.

        ``key`` gives one value per key column, in order; strings are cast to the column's type
        in the snapshot (``"42"`` for an integer column, ``"2013-01-01"`` for a date).
        """
        if limit is not None and limit < 1:
            raise StateReadError(f"limit must be at least 1, got {limit}")
        op = self.operator(operator_id)
        kind = _kind(op)
        if key is not None:
            if kind == "list":
                raise StateReadError(
                    f"operator {operator_id!r} has operator list state, not keyed state: a key "
                    "selects nothing in it (leave the key out to see its items)"
                )
            return self._lookup(op, list(key), key_columns)
        if kind == "list":
            return self._read_list(op, limit)
        return self._read_keyed(op, key_columns, limit)

    def _view(self, op: OperatorState, kind: StateKind, **fields: Any) -> StateView:
        assert self.decision.checkpoint_id is not None
        return StateView(
            job_id=self.decision.job_id,
            checkpoint_id=self.decision.checkpoint_id,
            checkpoint_type=self.decision.checkpoint_type or "CHECKPOINT",
            operator_id=op.operator_id,
            kind=kind,
            parallelism=op.parallelism,
            max_parallelism=op.max_parallelism,
            **fields,
        )

    def _read_list(self, op: OperatorState, limit: int | None) -> StateView:
        rows: list[dict[str, Any]] = []
        columns: dict[str, None] = {}
        files = []
        for s in sorted(op.subtasks, key=lambda s: s.subtask_index):
            items = s.list_state
            if items is None and s.handle:  # list state written to a file, not into the ack
                items = read_list_state(self._bytes(s), path=s.handle)
                files.append(s.handle)
            for item in items or ():
                columns.update(dict.fromkeys(item))
                rows.append({"subtask": s.subtask_index, "item": dict(item)})
        shown = rows if limit is None else rows[:limit]
        return self._view(
            op,
            "list",
            columns=list(columns),
            rows=shown,
            truncated=len(shown) < len(rows),
            files_read=files,
        )

    def _read_keyed(
        self, op: OperatorState, key_columns: Sequence[str] | None, limit: int | None
    ) -> StateView:
        handles = _keyed_handles(op)
        rows: list[dict[str, Any]] = []
        schema: pa.Schema | None = None
        files = []
        truncated = False
        for n, h in enumerate(handles):
            if limit is not None and len(rows) >= limit:
                truncated = any(x.group_bytes for x in handles[n:])
                break
            table = self._keyed_table(op, h)
            files.extend(f.handle for f in h.files())
            schema = table.schema
            want = table.num_rows if limit is None else min(table.num_rows, limit - len(rows))
            truncated = want < table.num_rows
            rows.extend(table.slice(0, want).to_pylist())
        if schema is None:
            return self._view(op, "empty" if not handles else "keyed", columns=[], rows=[])
        keys = _key_columns(schema, key_columns)
        columns = _ordered_columns(schema, keys)
        return self._view(
            op,
            "keyed",
            columns=columns,
            rows=[{c: r[c] for c in columns} for r in rows],
            truncated=truncated,
            key_columns=keys,
            files_read=files,
        )

    def _lookup(
        self, op: OperatorState, key: list[KeyValue], key_columns: Sequence[str] | None
    ) -> StateView:
        handles = _keyed_handles(op)
        if any(h.file_format == PARQUET for h in handles):
            return self._lookup_run(op, handles, key, key_columns)
        non_empty = [h for h in handles if h.group_bytes]
        if not non_empty:  # no file tells the key's column types: nothing to look up
            return self._view(
                op, "empty", columns=[], rows=[], key=key, key_columns=list(key_columns or [])
            )

        def holder_of(group: int) -> SubtaskStateHandle | None:
            """The file with the group's rows; None when no key of the group has state."""
            return next((h for h in non_empty if group in (h.group_bytes or {})), None)

        # The key's group picks the file, and depends on the key columns' types, which only a
        # file's schema tells. Start from the file the key's text points at (right whenever the
        # value is written as the state stores it: "42", "2013-01-01"), else the smallest.
        try:
            guess = holder_of(key_group_for(key, op.max_parallelism))
        except TypeError:
            guess = None
        first = guess or min(non_empty, key=lambda h: h.size)
        files = [first.files()[0].handle]
        schema = self._snapshot_info(op, first).schema
        keys, values, group = _typed_key(op, schema, key, key_columns)
        columns = _ordered_columns(schema, keys)
        rows: list[dict[str, Any]] = []
        holder = holder_of(group)
        if holder is not None:
            files.extend(f.handle for f in holder.files() if f.handle not in files)
            table = self._keyed_table(op, holder, KeyGroupRange(group, group))
            for row in table.to_pylist():
                stored = [row[c] for c in keys]
                hashed = key_group_for(stored, op.max_parallelism)
                if hashed != group:
                    raise StateReadError(
                        f"({', '.join(keys)}) is not the key of operator {op.operator_id!r}: a "
                        f"row stored in key group {group} of {holder.handle} has {stored!r} "
                        f"there, which hashes to key group {hashed}; name the key columns, in "
                        "order"
                    )
                if stored == values:
                    rows.append({c: row[c] for c in columns})
        return self._view(
            op,
            "keyed",
            columns=columns,
            rows=rows,
            key_columns=keys,
            key=values,
            key_group=group,
            files_read=files,
        )

    def _lookup_run(
        self,
        op: OperatorState,
        handles: list[SubtaskStateHandle],
        key: list[KeyValue],
        key_columns: Sequence[str] | None,
    ) -> StateView:
        """One key's state in Parquet runs: the run's schema types the key, its group picks
        the subtask, whose runs are read filtered to that one group."""
        first = handles[0].files()[0]
        schema = run_schema(self._bytes(first), path=first.handle)
        keys, values, group = _typed_key(op, schema, key, key_columns)
        holder = next(h for h in handles if group in KeyGroupRange(*(h.key_groups or (0, -1))))
        table = self._keyed_table(op, holder, KeyGroupRange(group, group))
        columns = _ordered_columns(schema, keys)
        rows = [
            {c: r[c] for c in columns} for r in table.to_pylist() if [r[c] for c in keys] == values
        ]
        return self._view(
            op,
            "keyed",
            columns=columns,
            rows=rows,
            key_columns=keys,
            key=values,
            key_group=group,
            files_read=[f.handle for f in holder.files()],
        )

    # ------------------------------------------------------------------ files

    def _bytes(self, handle: SubtaskStateHandle | ChainedFile) -> bytes:
        """A state file's bytes, verified against the size and checksum in ``_metadata``."""
        assert handle.handle is not None
        data = self._files.get(handle.handle)
        if data is None:
            data = self.storage.read_bytes(
                handle.handle, size=handle.size, checksum=handle.checksum
            )
            self._files[handle.handle] = data
        return data

    def _snapshot_info(
        self, op: OperatorState, handle: SubtaskStateHandle, file: ChainedFile | None = None
    ) -> SnapshotInfo:
        """A keyed file's footer (the subtask's first file, or ``file`` of its chain), checked
        against what ``_metadata`` says the subtask's files hold."""
        assert handle.handle is not None and handle.key_groups is not None
        file = file or handle.files()[0]
        info = read_snapshot_info(self._bytes(file), path=file.handle)
        expected = KeyGroupRange(*handle.key_groups)
        if info.max_parallelism != op.max_parallelism or info.key_groups != expected:
            raise CorruptSnapshotError(
                file.handle,
                f"holds key groups {info.key_groups.start}-{info.key_groups.end} of "
                f"{info.max_parallelism}, _metadata says {expected.start}-{expected.end} of "
                f"{op.max_parallelism}",
            )
        return info

    def _keyed_table(
        self, op: OperatorState, handle: SubtaskStateHandle, groups: KeyGroupRange | None = None
    ) -> pa.Table:
        """A subtask's state (in ``groups``): its one file, or its chain merged (the last row
        of a key wins, or partial aggregates combined: ``chain_merge``), as a restore reads it."""
        tables = []
        if handle.file_format == PARQUET:  # runs: the subtask's key groups of each
            assert handle.key_groups is not None
            mine = groups or KeyGroupRange(*handle.key_groups)
            tables = [read_run(self._bytes(f), mine, path=f.handle) for f in handle.files()]
            schema = tables[0].schema
        for f in handle.files() if handle.file_format != PARQUET else ():
            schema = self._snapshot_info(op, handle, f).schema
            tables.append(read_keyed_snapshot(self._bytes(f), groups, path=f.handle))
        try:
            return merge_chain(tables, _key_columns(schema, None), handle.chain_merge)
        except ValueError as exc:
            raise CheckpointingError(
                f"operator {op.operator_id!r} subtask {handle.subtask_index}: {exc}"
            ) from None


def inspect_state(
    metastore: Metastore,
    storage: CheckpointStorage,
    job_id: str,
    checkpoint_id: int,
    operator_id: str,
    *,
    key: Sequence[KeyValue] | None = None,
    key_columns: Sequence[str] | None = None,
    limit: int | None = None,
) -> StateView:
    """One operator's state in a completed checkpoint or savepoint (see
    :meth:`CheckpointReader.read`); what the UI's REST API calls."""
    reader = CheckpointReader.open(metastore, storage, job_id, checkpoint_id)
    return reader.read(operator_id, key=key, key_columns=key_columns, limit=limit)


# ----------------------------------------------------------------------------- internals


def _kind(op: OperatorState) -> StateKind:
    if any(s.key_groups is not None for s in op.subtasks):
        return "keyed"
    if any(s.list_state is not None or s.handle for s in op.subtasks):
        return "list"
    return "empty"


def _typed_key(
    op: OperatorState, schema: pa.Schema, key: list[KeyValue], key_columns: Sequence[str] | None
) -> tuple[list[str], list[KeyValue], int]:
    """The key columns, ``key``'s values typed as the state stores them, and their key group."""
    keys = _key_columns(schema, key_columns)
    if len(key) != len(keys):
        raise StateReadError(
            f"operator {op.operator_id!r} is keyed by {len(keys)} column(s) "
            f"({', '.join(keys)}); give one key value per column, in that order "
            f"(got {len(key)})"
        )
    values = [_cast(v, schema.field(c)) for v, c in zip(key, keys, strict=True)]
    try:
        return keys, values, key_group_for(values, op.max_parallelism)
    except TypeError as exc:
        raise StateReadError(f"key {key!r}: {exc}") from None


def _keyed_handles(op: OperatorState) -> list[SubtaskStateHandle]:
    """The subtasks' keyed snapshot files, in key-group order."""
    handles = [s for s in op.subtasks if s.handle and s.key_groups is not None]
    return sorted(handles, key=lambda s: tuple(s.key_groups or ()))


def _key_columns(schema: pa.Schema, given: Sequence[str] | None) -> list[str]:
    """The key columns: as given, as recorded in the schema, or all that are not state."""
    names = [f.name for f in schema if f.name != KEY_GROUP_COLUMN]
    if given:
        keys = list(given)
    elif KEY_COLUMNS_METADATA.encode() in (schema.metadata or {}):
        raw = schema.metadata[KEY_COLUMNS_METADATA.encode()]
        try:
            keys = json.loads(raw)
        except ValueError:
            keys = None
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise StateReadError(f"snapshot metadata {KEY_COLUMNS_METADATA!r} is not a list")
    else:
        keys = [n for n in names if not PARTIAL_COLUMN.fullmatch(n)]
    unknown = [k for k in keys if k not in names]
    if unknown or not keys or len(set(keys)) != len(keys):
        raise StateReadError(
            f"key columns {keys} are not columns of the state ({', '.join(names)})"
        )
    return keys


def _ordered_columns(schema: pa.Schema, keys: list[str]) -> list[str]:
    state = [f.name for f in schema if f.name != KEY_GROUP_COLUMN and f.name not in keys]
    return [*keys, *state, KEY_GROUP_COLUMN]


def _cast(value: KeyValue, f: pa.Field) -> KeyValue:
    """A key value as the column's type, the way the state stores it."""
    if value is None:
        return None
    try:
        scalar = pa.scalar(value) if not isinstance(value, str) else pa.scalar(value, pa.string())
        cast = scalar.cast(f.type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise StateReadError(
            f"key column {f.name!r} is {f.type}: cannot read {value!r} as {f.type} ({exc})"
        ) from None
    result: KeyValue = cast.as_py()
    return result


def describe_value(column: str, value: Any) -> str:
    """A state value for people: a distinct set as its size and first values, an HLL sketch as
    its size and precision (its estimate needs DataSketches, i.e. Spark), a max_by/min_by pair
    as ``order=…, value=…``, moments as ``n, mean, M2``; anything else as text."""
    if value is None:
        return "null"
    kind = column[2:].split("_", 1)[0] if PARTIAL_COLUMN.fullmatch(column) else None
    if kind == "set" and isinstance(value, list):
        shown = ", ".join(_text(v) for v in value[:SHOWN_SET_VALUES])
        more = (
            f", … (+{len(value) - SHOWN_SET_VALUES} more)" if len(value) > SHOWN_SET_VALUES else ""
        )
        return f"{len(value)} distinct: {shown}{more}" if value else "0 distinct"
    if kind == "hll" and isinstance(value, bytes | bytearray):
        # DataSketches HLL preamble: byte 2 the family (7), byte 3 log2 of the register count
        lg_k = f"lgK {value[3]}, " if len(value) > 3 and value[2] == 7 else ""
        return f"HLL sketch ({lg_k}{len(value)} bytes)"
    if kind in ("maxby", "minby") and isinstance(value, dict):
        return f"order={_text(value.get('order'))}, value={_text(value.get('value'))}"
    if kind == "mom" and isinstance(value, dict):
        return f"n={value.get('n')}, mean={_text(value.get('mean'))}, M2={_text(value.get('m2'))}"
    return _text(value)


def _text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:.10g}"
    if isinstance(value, bytes | bytearray):
        return "0x" + bytes(value).hex()
    return str(value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dt.date | dt.datetime | dt.time):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, bytes):
        return value.hex()
    return value
