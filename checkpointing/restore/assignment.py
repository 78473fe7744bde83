"""Which new subtask restores which state (Flink's ``StateAssignmentOperation``).

Pure planning: no Spark, no I/O. The inputs describe a checkpoint's state independently of
storage — per operator, the old subtasks' keyed handles (each with its key-group range and the
bytes of every non-empty key group in it) and their operator list state items (e.g. source
splits). The output, a :class:`StateAssignment`, tells each subtask of the new job:

* **keyed state** — its key-group range under the new parallelism
  (:func:`checkpointing.state.keygroups.key_group_range`) and, for every old handle whose range
  intersects it, the intersection and the bytes of the groups in it: each new subtask reads only
  its own key groups. The number of key groups (``max_parallelism``) cannot change, and no
  operator can run with more subtasks than key groups;
* **operator list state** — Flink's split-distribute (unchanged parallelism keeps every item in
  place; otherwise all items, pooled in old-subtask order, are dealt round-robin) or union (every
  subtask gets every item).

State of an operator the new job no longer has is an error unless ``allow_non_restored_state``
(then the plan lists it as skipped); an operator of the job without state starts empty (listed).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, pairwise
from types import MappingProxyType
from typing import Any, Literal

from checkpointing.errors import CheckpointingError
from checkpointing.state.keygroups import (
    DEFAULT_MAX_PARALLELISM,
    UPPER_BOUND_MAX_PARALLELISM,
    KeyGroupRange,
    key_group_range,
)
from checkpointing.state.metadata import CheckpointMetadata

ListStateMode = Literal["split", "union"]
LIST_STATE_MODES: tuple[str, ...] = ("split", "union")

ListItem = Mapping[str, object]


class StateAssignmentError(CheckpointingError):
    """A checkpoint's state cannot be assigned to the new job (names the operator)."""


# --------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class KeyedStateHandle:
    """One old subtask's keyed snapshot: its key-group range and the bytes of each non-empty group.

    ``group_bytes`` is copied into a read-only mapping sorted by key group; every group in it must
    lie in ``key_groups``.
    """

    url: str
    key_groups: KeyGroupRange
    group_bytes: Mapping[int, int] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for group, size in self.group_bytes.items():
            if type(group) is not int or group not in self.key_groups:
                raise StateAssignmentError(
                    f"handle {self.url}: key group {group!r} is outside its range "
                    f"{_fmt_range(self.key_groups)}"
                )
            if type(size) is not int or size < 0:
                raise StateAssignmentError(
                    f"handle {self.url}: key group {group} has invalid size {size!r}"
                )
        frozen = MappingProxyType(dict(sorted(self.group_bytes.items())))
        object.__setattr__(self, "group_bytes", frozen)

    @property
    def size(self) -> int:
        return sum(self.group_bytes.values())

    def bytes_in(self, key_groups: KeyGroupRange) -> int:
        """Bytes of this handle's groups that lie in ``key_groups``."""
        return sum(s for g, s in self.group_bytes.items() if g in key_groups)


@dataclass(frozen=True)
class OperatorSnapshot:
    """One operator's state in a checkpoint.

    ``list_state[i]`` holds the operator list state items of old subtask ``i`` (None: the operator
    has no list state); ``list_mode`` is how they are redistributed (``"split"`` or ``"union"``).
    Sequences are copied into tuples.
    """

    operator_id: str
    parallelism: int
    max_parallelism: int
    keyed: Sequence[KeyedStateHandle] = ()
    list_state: Sequence[Sequence[ListItem]] | None = field(default=None, hash=False)
    list_mode: ListStateMode = "split"

    def __post_init__(self) -> None:
        object.__setattr__(self, "keyed", tuple(self.keyed))
        if self.list_state is not None:
            object.__setattr__(self, "list_state", tuple(tuple(s) for s in self.list_state))

    @property
    def size(self) -> int:
        """Bytes of keyed state."""
        return sum(h.size for h in self.keyed)


# -------------------------------------------------------------------------------------- outputs


@dataclass(frozen=True)
class HandleRead:
    """Part of an old keyed handle a new subtask reads: the groups in ``key_groups``, ``size``
    bytes."""

    url: str
    key_groups: KeyGroupRange
    size: int

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "key_groups": _range_dict(self.key_groups), "size": self.size}


@dataclass(frozen=True)
class SubtaskKeyedAssignment:
    """The keyed state of one new subtask: its key-group range and the handle parts to read."""

    subtask_index: int
    key_groups: KeyGroupRange
    reads: tuple[HandleRead, ...]

    @property
    def size(self) -> int:
        return sum(r.size for r in self.reads)


@dataclass(frozen=True)
class SubtaskRestore:
    """Everything one new subtask of an operator restores."""

    subtask_index: int
    key_groups: KeyGroupRange
    reads: tuple[HandleRead, ...]
    list_state: tuple[ListItem, ...] = field(hash=False)

    @property
    def size(self) -> int:
        return sum(r.size for r in self.reads)

    def to_dict(self) -> dict[str, Any]:
        return {
            "subtask_index": self.subtask_index,
            "key_groups": _range_dict(self.key_groups),
            "size": self.size,
            "reads": [r.to_dict() for r in self.reads],
            "list_state": [dict(item) for item in self.list_state],
        }


@dataclass(frozen=True)
class OperatorRestore:
    """One operator of the new job; ``old_parallelism`` is None when it starts with empty state."""

    operator_id: str
    old_parallelism: int | None
    parallelism: int
    max_parallelism: int
    list_mode: ListStateMode | None
    subtasks: tuple[SubtaskRestore, ...]

    @property
    def starts_empty(self) -> bool:
        return self.old_parallelism is None

    @property
    def size(self) -> int:
        return sum(s.size for s in self.subtasks)

    @property
    def handle_urls(self) -> tuple[str, ...]:
        """The old handles read by any subtask, in key-group order."""
        return tuple(dict.fromkeys(r.url for s in self.subtasks for r in s.reads))

    def to_dict(self) -> dict[str, Any]:
        return {
            "operator_id": self.operator_id,
            "starts_empty": self.starts_empty,
            "old_parallelism": self.old_parallelism,
            "parallelism": self.parallelism,
            "max_parallelism": self.max_parallelism,
            "list_mode": self.list_mode,
            "size": self.size,
            "subtasks": [s.to_dict() for s in self.subtasks],
        }


@dataclass(frozen=True)
class SkippedOperator:
    """State of an operator the new job no longer has, left unrestored."""

    operator_id: str
    parallelism: int
    max_parallelism: int
    handles: int
    size: int
    list_items: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "operator_id": self.operator_id,
            "parallelism": self.parallelism,
            "max_parallelism": self.max_parallelism,
            "handles": self.handles,
            "size": self.size,
            "list_items": self.list_items,
        }


@dataclass(frozen=True)
class StateAssignment:
    """Per operator of the new job and per new subtask: what to restore. Operators by id."""

    operators: tuple[OperatorRestore, ...]
    skipped: tuple[SkippedOperator, ...] = ()

    def operator(self, operator_id: str) -> OperatorRestore:
        for op in self.operators:
            if op.operator_id == operator_id:
                return op
        raise KeyError(operator_id)

    @property
    def restored(self) -> tuple[str, ...]:
        return tuple(op.operator_id for op in self.operators if not op.starts_empty)

    @property
    def started_empty(self) -> tuple[str, ...]:
        return tuple(op.operator_id for op in self.operators if op.starts_empty)

    @property
    def size(self) -> int:
        return sum(op.size for op in self.operators)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly (as long as the list state items are JSON values)."""
        return {
            "operators": [op.to_dict() for op in self.operators],
            "restored": list(self.restored),
            "started_empty": list(self.started_empty),
            "skipped": [s.to_dict() for s in self.skipped],
            "size": self.size,
        }

    def describe(self) -> str:
        lines = [
            f"restore plan: {len(self.restored)} operator(s) restored, "
            f"{len(self.started_empty)} starting empty, {len(self.skipped)} skipped; "
            f"{self.size} bytes of keyed state"
        ]
        for op in self.operators:
            if op.starts_empty:
                lines.append(
                    f"  {op.operator_id}: no state in the checkpoint, starts empty with "
                    f"parallelism {op.parallelism} (max {op.max_parallelism})"
                )
                continue
            items = sum(len(s.list_state) for s in op.subtasks)
            lines.append(
                f"  {op.operator_id}: parallelism {op.old_parallelism} -> {op.parallelism} "
                f"(max {op.max_parallelism}), {op.size} bytes from {len(op.handle_urls)} "
                f"handle(s), {items} list item(s) ({op.list_mode})"
            )
            for s in op.subtasks:
                lines.append(
                    f"    subtask {s.subtask_index}: key groups {_fmt_range(s.key_groups)}, "
                    f"{s.size} bytes from {len(s.reads)} handle(s), "
                    f"{len(s.list_state)} list item(s)"
                )
        for sk in self.skipped:
            lines.append(
                f"  {sk.operator_id}: not in the job, state skipped ({sk.size} bytes in "
                f"{sk.handles} handle(s), {sk.list_items} list item(s))"
            )
        return "\n".join(lines)


# ------------------------------------------------------------------------------------ assignment


def assign_keyed(
    handles: Sequence[KeyedStateHandle], max_parallelism: int, new_parallelism: int
) -> list[SubtaskKeyedAssignment]:
    """Each new subtask's key-group range and the parts of the old handles it must read.

    New subtask ``i`` gets ``key_group_range(max_parallelism, new_parallelism, i)`` and, for every
    old handle whose range intersects it (in key-group order), the intersection and its bytes.
    Handles must lie within ``[0, max_parallelism)`` and must not overlap.
    """
    _check_parallelism(new_parallelism, max_parallelism, "")
    ordered = _check_handles(handles, max_parallelism, "")
    ends = [h.key_groups.end for h in ordered]
    prefix = [_Prefix(h) for h in ordered]
    out = []
    for i in range(new_parallelism):
        mine = key_group_range(max_parallelism, new_parallelism, i)
        reads = []
        # first handle ending at or after my start; handles are sorted and disjoint
        for j in range(bisect_left(ends, mine.start), len(ordered)):
            h = ordered[j]
            if h.key_groups.start > mine.end:
                break
            part = h.key_groups.intersection(mine)
            reads.append(HandleRead(h.url, part, prefix[j].bytes_in(part)))
        out.append(SubtaskKeyedAssignment(i, mine, tuple(reads)))
    return out


def assign_list_state(
    items_per_old_subtask: Sequence[Sequence[ListItem]],
    new_parallelism: int,
    mode: ListStateMode = "split",
) -> list[tuple[ListItem, ...]]:
    """Operator list state items per new subtask.

    ``"split"`` (Flink's split-distribute): with unchanged parallelism every subtask keeps its
    items; otherwise all items, pooled in old-subtask order, are dealt round-robin (item ``k`` of
    the pool goes to subtask ``k % new_parallelism``). ``"union"``: every subtask gets all items.
    """
    if mode not in LIST_STATE_MODES:
        raise StateAssignmentError(
            f"unknown list state mode {mode!r}; use one of {', '.join(LIST_STATE_MODES)}"
        )
    if type(new_parallelism) is not int or new_parallelism < 1:
        raise StateAssignmentError(f"new parallelism must be at least 1, got {new_parallelism!r}")
    pooled = tuple(item for items in items_per_old_subtask for item in items)
    if mode == "union":
        return [pooled for _ in range(new_parallelism)]
    if len(items_per_old_subtask) == new_parallelism:
        return [tuple(items) for items in items_per_old_subtask]
    return [pooled[i::new_parallelism] for i in range(new_parallelism)]


def plan_restore(
    operators: Sequence[OperatorSnapshot],
    job_operators: Collection[str],
    *,
    new_parallelism: Mapping[str, int] | int,
    max_parallelism: Mapping[str, int] | int,
    allow_non_restored_state: bool = False,
) -> StateAssignment:
    """Assign a checkpoint's state to the operators of the new job.

    ``job_operators``: the operator ids of the new job (a mapping's keys are used).
    ``new_parallelism`` / ``max_parallelism``: one value for every operator, or per operator id.
    A per-operator ``new_parallelism`` must name every operator of the job. A per-operator
    ``max_parallelism`` that leaves an operator out takes the checkpoint's value for it (Flink
    adopts the stored max parallelism when none is configured), or
    :data:`~checkpointing.state.keygroups.DEFAULT_MAX_PARALLELISM` for an operator without state.

    Raises :class:`StateAssignmentError` when the max parallelism of an operator with state
    changed, when a new parallelism exceeds the max parallelism, when the checkpoint has state for
    an operator the job no longer has (unless ``allow_non_restored_state``: then it is skipped and
    listed), or when a snapshot is inconsistent (overlapping or out-of-range key groups, list
    state for a different number of subtasks).
    """
    job = list(dict.fromkeys(job_operators))
    snapshots: dict[str, OperatorSnapshot] = {}
    for snap in operators:
        if snap.operator_id in snapshots:
            raise StateAssignmentError(
                f"operator {snap.operator_id!r}: the checkpoint has its state twice"
            )
        snapshots[snap.operator_id] = snap

    for name, given in (("new_parallelism", new_parallelism), ("max_parallelism", max_parallelism)):
        if isinstance(given, Mapping):
            unknown = sorted(set(given) - set(job))
            if unknown:
                raise StateAssignmentError(
                    f"{name} names operator(s) not in the job: {', '.join(map(repr, unknown))}"
                )

    not_in_job = sorted(set(snapshots) - set(job))
    if not_in_job and not allow_non_restored_state:
        raise StateAssignmentError(
            "cannot map checkpoint state to the new job: operator(s) "
            f"{', '.join(map(repr, not_in_job))} are not in the job; remove them from the "
            "checkpoint, or set allow_non_restored_state to skip their state"
        )

    planned = []
    for op_id in sorted(job):
        snap = snapshots.get(op_id)
        new_p = _resolve(new_parallelism, op_id, None, "new_parallelism")
        default_max = snap.max_parallelism if snap is not None else DEFAULT_MAX_PARALLELISM
        max_p = _resolve(max_parallelism, op_id, default_max, "max_parallelism")
        where = f"operator {op_id!r}: "
        if type(max_p) is not int or not 1 <= max_p <= UPPER_BOUND_MAX_PARALLELISM:
            raise StateAssignmentError(
                f"{where}max_parallelism must be in [1, {UPPER_BOUND_MAX_PARALLELISM}], "
                f"got {max_p!r}"
            )
        if snap is not None and snap.max_parallelism != max_p:
            raise StateAssignmentError(
                f"{where}max_parallelism changed from {snap.max_parallelism} to {max_p}; "
                "state cannot be rescaled across a different number of key groups (restore "
                f"with max_parallelism {snap.max_parallelism}, or start the operator empty)"
            )
        _check_parallelism(new_p, max_p, where)
        planned.append(_plan_operator(op_id, snap, new_p, max_p, where))

    skipped = tuple(
        SkippedOperator(
            operator_id=s.operator_id,
            parallelism=s.parallelism,
            max_parallelism=s.max_parallelism,
            handles=len(s.keyed),
            size=s.size,
            list_items=sum(len(items) for items in s.list_state or ()),
        )
        for s in (snapshots[op_id] for op_id in not_in_job)
    )
    return StateAssignment(operators=tuple(planned), skipped=skipped)


# ------------------------------------------------------------------------------------- internals


class _Prefix:
    """Bytes of a handle's groups in any range, by bisection over cumulative sizes."""

    def __init__(self, handle: KeyedStateHandle) -> None:
        self.groups = list(handle.group_bytes)  # sorted
        self.cumulative = [0, *accumulate(handle.group_bytes.values())]

    def bytes_in(self, r: KeyGroupRange) -> int:
        lo = bisect_left(self.groups, r.start)
        hi = bisect_right(self.groups, r.end)
        return self.cumulative[hi] - self.cumulative[lo] if hi > lo else 0


def _plan_operator(
    op_id: str, snap: OperatorSnapshot | None, new_p: int, max_p: int, where: str
) -> OperatorRestore:
    if snap is None:
        subtasks = tuple(
            SubtaskRestore(i, key_group_range(max_p, new_p, i), (), ()) for i in range(new_p)
        )
        return OperatorRestore(op_id, None, new_p, max_p, None, subtasks)
    if type(snap.parallelism) is not int or not 1 <= snap.parallelism <= snap.max_parallelism:
        raise StateAssignmentError(
            f"{where}checkpointed parallelism {snap.parallelism!r} is not in "
            f"[1, max_parallelism={snap.max_parallelism}]"
        )
    _check_handles(snap.keyed, max_p, where)
    if snap.list_mode not in LIST_STATE_MODES:
        raise StateAssignmentError(
            f"{where}unknown list state mode {snap.list_mode!r}; use one of "
            f"{', '.join(LIST_STATE_MODES)}"
        )
    keyed = assign_keyed(snap.keyed, max_p, new_p)
    if snap.list_state is None:
        lists: list[tuple[ListItem, ...]] = [() for _ in range(new_p)]
        mode: ListStateMode | None = None
    else:
        if len(snap.list_state) != snap.parallelism:
            raise StateAssignmentError(
                f"{where}list state has {len(snap.list_state)} subtask(s) but the checkpoint's "
                f"parallelism is {snap.parallelism}"
            )
        for i, items in enumerate(snap.list_state):
            for item in items:
                if not isinstance(item, Mapping):
                    raise StateAssignmentError(
                        f"{where}list state item of subtask {i} is not a mapping: {item!r}"
                    )
        lists = assign_list_state(snap.list_state, new_p, snap.list_mode)
        mode = snap.list_mode
    subtasks = tuple(
        SubtaskRestore(k.subtask_index, k.key_groups, k.reads, items)
        for k, items in zip(keyed, lists, strict=True)
    )
    return OperatorRestore(op_id, snap.parallelism, new_p, max_p, mode, subtasks)


def _check_parallelism(new_p: object, max_p: int, where: str) -> None:
    if type(new_p) is not int or new_p < 1:
        raise StateAssignmentError(f"{where}new parallelism must be at least 1, got {new_p!r}")
    if new_p > max_p:
        raise StateAssignmentError(
            f"{where}new parallelism {new_p} exceeds max_parallelism {max_p}: every subtask "
            "needs at least one key group"
        )


def _check_handles(
    handles: Sequence[KeyedStateHandle], max_p: int, where: str
) -> list[KeyedStateHandle]:
    """The handles with a non-empty range, by range; raises if one is outside or two overlap."""
    ordered = sorted((h for h in handles if len(h.key_groups)), key=lambda h: h.key_groups)
    for h in ordered:
        if h.key_groups.start < 0 or h.key_groups.end >= max_p:
            raise StateAssignmentError(
                f"{where}handle {h.url} covers key groups {_fmt_range(h.key_groups)}, outside "
                f"0-{max_p - 1} (max_parallelism {max_p})"
            )
    for a, b in pairwise(ordered):
        if b.key_groups.start <= a.key_groups.end:
            raise StateAssignmentError(
                f"{where}handles {a.url} ({_fmt_range(a.key_groups)}) and {b.url} "
                f"({_fmt_range(b.key_groups)}) overlap"
            )
    return ordered


def _resolve(given: Mapping[str, int] | int, op_id: str, default: int | None, name: str) -> int:
    if not isinstance(given, Mapping):
        return given
    if op_id in given:
        return given[op_id]
    if default is None:
        raise StateAssignmentError(f"operator {op_id!r}: no {name} given")
    return default


def _fmt_range(r: KeyGroupRange) -> str:
    return f"{r.start}-{r.end}" if len(r) else "(empty)"


def _range_dict(r: KeyGroupRange) -> dict[str, int]:
    return {"start": r.start, "end": r.end}


def snapshots_from_metadata(metadata: CheckpointMetadata) -> list[OperatorSnapshot]:
    """The operators' state as recorded in a checkpoint's ``_metadata`` (no state file is
    opened): keyed handles with their key-group ranges and sizes, and list-state items."""
    snapshots = []
    for op in metadata.operators:
        keyed = [
            KeyedStateHandle(s.handle, KeyGroupRange(*s.key_groups), s.group_bytes or {})
            for s in op.subtasks
            if s.handle and s.key_groups is not None
        ]
        has_lists = any(s.list_state is not None for s in op.subtasks)
        lists = [list(s.list_state or []) for s in op.subtasks] if has_lists else None
        snapshots.append(
            OperatorSnapshot(op.operator_id, op.parallelism, op.max_parallelism, keyed, lists)
        )
    return snapshots
