"""State reassignment on restore: key-group ranges, handle intersections, list state
redistribution and the restore plan's validation (``checkpointing.restore.assignment``)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from itertools import pairwise

import pytest

from checkpointing.errors import CheckpointingError
from checkpointing.restore.assignment import (
    HandleRead,
    KeyedStateHandle,
    OperatorSnapshot,
    StateAssignment,
    StateAssignmentError,
    assign_keyed,
    assign_list_state,
    plan_restore,
)
from checkpointing.state.keygroups import KeyGroupRange, key_group_range, subtask_for_key_group


def flink_range(max_p: int, p: int, i: int) -> KeyGroupRange:
    """``computeKeyGroupRangeForOperatorIndex``, written out independently of keygroups.py."""
    return KeyGroupRange(math.ceil(i * max_p / p), math.floor(((i + 1) * max_p - 1) / p))


def group_size(g: int) -> int:
    """A made-up size per key group; every fifth group is empty (absent from group_bytes)."""
    return 0 if g % 5 == 3 else 10 + (g * 7919) % 97


def snapshot_handles(max_p: int, p: int, tag: str = "ck1") -> list[KeyedStateHandle]:
    handles = []
    for i in range(p):
        r = key_group_range(max_p, p, i)
        sizes = {g: group_size(g) for g in r if group_size(g)}
        handles.append(KeyedStateHandle(f"file:///ckpt/{tag}/op/{i}.state", r, sizes))
    return handles


def all_group_bytes(handles: Sequence[KeyedStateHandle]) -> dict[int, int]:
    out: dict[int, int] = {}
    for h in handles:
        assert not set(out) & set(h.group_bytes)
        out.update(h.group_bytes)
    return out


def overlaps(a: KeyGroupRange, b: KeyGroupRange) -> bool:
    return len(a.intersection(b)) > 0


def check_keyed_assignment(
    handles: Sequence[KeyedStateHandle], max_p: int, new_p: int
) -> list[KeyedStateHandle]:
    """Assert every invariant of one assignment; return the state each new subtask ends up with."""
    result = assign_keyed(handles, max_p, new_p)
    assert [a.subtask_index for a in result] == list(range(new_p))

    # ranges: Flink's formula, non-empty, contiguous, covering 0..max_p-1
    ranges = [a.key_groups for a in result]
    assert ranges == [flink_range(max_p, new_p, i) for i in range(new_p)]
    assert all(len(r) >= 1 for r in ranges)
    assert ranges[0].start == 0
    assert ranges[-1].end == max_p - 1
    for prev, nxt in pairwise(ranges):
        assert nxt.start == prev.end + 1

    # every key group to exactly one new subtask, the one subtask_for_key_group names
    owners: dict[int, int] = {}
    for a in result:
        for g in a.key_groups:
            assert g not in owners
            owners[g] = a.subtask_index
    assert sorted(owners) == list(range(max_p))
    assert all(owners[g] == subtask_for_key_group(max_p, new_p, g) for g in owners)

    # each subtask reads exactly the old handles overlapping its range, only its own groups
    restored = []
    for a in result:
        expected = sorted(
            (h for h in handles if overlaps(h.key_groups, a.key_groups)),
            key=lambda h: h.key_groups.start,
        )
        assert [r.url for r in a.reads] == [h.url for h in expected]
        sizes: dict[int, int] = {}
        for read, h in zip(a.reads, expected, strict=True):
            assert read.key_groups == h.key_groups.intersection(a.key_groups)
            assert read.key_groups.start in a.key_groups
            assert read.key_groups.end in a.key_groups
            mine = {g: s for g, s in h.group_bytes.items() if g in read.key_groups}
            assert read.size == sum(mine.values()) == h.bytes_in(read.key_groups)
            sizes.update(mine)
        assert a.size == sum(r.size for r in a.reads) == sum(sizes.values())
        restored.append(
            KeyedStateHandle(f"restored/{new_p}/{a.subtask_index}", a.key_groups, sizes)
        )

    # nothing lost, nothing duplicated
    total = sum(h.size for h in handles)
    assert sum(a.size for a in result) == total
    assert all_group_bytes(restored) == all_group_bytes(handles)
    return restored


COMBINATIONS = [
    # (max_p, old_p, new_p)
    (128, 4, 2),
    (128, 2, 7),
    (128, 4, 7),
    (128, 4, 4),  # unchanged
    (128, 7, 7),
    (128, 3, 1),  # down to one
    (128, 1, 128),  # up to max
    (128, 128, 1),
    (128, 128, 128),
    (128, 5, 3),
    (13, 13, 4),
    (13, 4, 13),
    (13, 5, 6),
    (10, 3, 4),
    (7, 3, 7),
    (1, 1, 1),
    (2, 1, 2),
    (100, 33, 34),
    (32768, 96, 100),
]


@pytest.mark.parametrize(("max_p", "old_p", "new_p"), COMBINATIONS)
def test_keyed_assignment_invariants(max_p: int, old_p: int, new_p: int) -> None:
    check_keyed_assignment(snapshot_handles(max_p, old_p), max_p, new_p)


@pytest.mark.parametrize(
    ("max_p", "chain"),
    [
        (128, [4, 2, 7]),
        (128, [4, 2, 7, 7, 1, 128, 3]),
        (13, [4, 2, 7, 13, 5]),
        (7, [1, 7, 2, 3]),
    ],
)
def test_rescaling_chains_keep_every_key_group(max_p: int, chain: list[int]) -> None:
    handles = snapshot_handles(max_p, chain[0])
    original = all_group_bytes(handles)
    for new_p in chain[1:]:
        handles = check_keyed_assignment(handles, max_p, new_p)
        assert len(handles) == new_p
    assert all_group_bytes(handles) == original


@pytest.mark.parametrize(("max_p", "p"), [(128, 4), (128, 7), (13, 13), (1, 1)])
def test_unchanged_parallelism_reads_each_old_handle_whole(max_p: int, p: int) -> None:
    handles = snapshot_handles(max_p, p)
    for a, h in zip(assign_keyed(handles, max_p, p), handles, strict=True):
        assert a.reads == (HandleRead(h.url, h.key_groups, h.size),)


def test_4_to_7_concrete_ranges_and_reads() -> None:
    handles = snapshot_handles(128, 4)  # 0-31, 32-63, 64-95, 96-127
    result = assign_keyed(handles, 128, 7)
    assert [(a.key_groups.start, a.key_groups.end) for a in result] == [
        (0, 18),
        (19, 36),
        (37, 54),
        (55, 73),
        (74, 91),
        (92, 109),
        (110, 127),
    ]
    second = result[1]
    assert [(r.url.rsplit("/", 1)[1], r.key_groups) for r in second.reads] == [
        ("0.state", KeyGroupRange(19, 31)),
        ("1.state", KeyGroupRange(32, 36)),
    ]


def test_missing_and_empty_old_handles() -> None:
    """A stateless old subtask has no handle; a handle may have no non-empty group."""
    r = [key_group_range(128, 4, i) for i in range(4)]
    handles = [
        KeyedStateHandle("a", r[0], {0: 5, 31: 7}),
        KeyedStateHandle("c", r[2], {}),
        KeyedStateHandle("d", r[3], {127: 1}),
        KeyedStateHandle("nothing", KeyGroupRange(5, 4), {}),  # empty range: ignored
    ]
    result = assign_keyed(handles, 128, 2)
    assert [(x.url, x.key_groups, x.size) for x in result[0].reads] == [
        ("a", KeyGroupRange(0, 31), 12)
    ]
    assert [(x.url, x.key_groups, x.size) for x in result[1].reads] == [
        ("c", KeyGroupRange(64, 95), 0),
        ("d", KeyGroupRange(96, 127), 1),
    ]
    assert assign_keyed([], 128, 3)[2].reads == ()


def test_handle_copies_and_sorts_group_bytes() -> None:
    sizes = {9: 3, 2: 1}
    h = KeyedStateHandle("u", KeyGroupRange(0, 9), sizes)
    sizes[5] = 100
    assert dict(h.group_bytes) == {2: 1, 9: 3}
    assert list(h.group_bytes) == [2, 9]
    with pytest.raises(TypeError):
        h.group_bytes[3] = 1  # type: ignore[index]
    assert hash(h) == hash(KeyedStateHandle("u", KeyGroupRange(0, 9), {2: 1, 9: 3}))


@pytest.mark.parametrize(
    ("group_bytes", "message"),
    [
        ({10: 1}, "key group 10 is outside its range 0-9"),
        ({-1: 1}, "key group -1 is outside its range 0-9"),
        ({3: -1}, "key group 3 has invalid size -1"),
        ({3: 1.5}, "key group 3 has invalid size 1.5"),
    ],
)
def test_handle_rejects_groups_outside_its_range(group_bytes: dict[int, int], message: str) -> None:
    with pytest.raises(StateAssignmentError, match=f"handle u: {message}"):
        KeyedStateHandle("u", KeyGroupRange(0, 9), group_bytes)


def test_assign_keyed_rejects_overlapping_or_out_of_range_handles() -> None:
    a = KeyedStateHandle("a", KeyGroupRange(0, 63), {})
    b = KeyedStateHandle("b", KeyGroupRange(60, 127), {})
    with pytest.raises(StateAssignmentError, match=r"handles a \(0-63\) and b \(60-127\) overlap"):
        assign_keyed([b, a], 128, 2)
    c = KeyedStateHandle("c", KeyGroupRange(64, 128), {})
    with pytest.raises(StateAssignmentError, match=r"handle c covers key groups 64-128, outside"):
        assign_keyed([a, c], 128, 2)
    with pytest.raises(StateAssignmentError, match="new parallelism 129 exceeds max_parallelism"):
        assign_keyed([a], 128, 129)
    with pytest.raises(StateAssignmentError, match="new parallelism must be at least 1, got 0"):
        assign_keyed([a], 128, 0)


# --------------------------------------------------------------------------------- list state


def items(*names: str) -> list[dict[str, object]]:
    return [{"split": n} for n in names]


def names(assigned: Sequence[Sequence[object]]) -> list[list[str]]:
    return [[item["split"] for item in sub] for sub in assigned]  # type: ignore[index]


def test_list_state_unchanged_parallelism_keeps_placement() -> None:
    old = [items("a", "b", "c"), items(), items("d")]
    assert names(assign_list_state(old, 3)) == [["a", "b", "c"], [], ["d"]]


def test_list_state_5_items_from_2_subtasks_to_3_deal_round_robin() -> None:
    old = [items("a", "b", "c"), items("d", "e")]
    result = assign_list_state(old, 3)
    assert names(result) == [["a", "d"], ["b", "e"], ["c"]]
    assert assign_list_state(old, 3) == result  # deterministic
    assert result[0][0] is old[0][0]  # items are passed through, not copied


@pytest.mark.parametrize(
    ("new_p", "expected"),
    [
        (1, [["a", "b", "c", "d", "e"]]),
        (2, [["a", "c", "e"], ["b", "d"]]),
        (4, [["a", "e"], ["b"], ["c"], ["d"]]),
        (7, [["a"], ["b"], ["c"], ["d"], ["e"], [], []]),
    ],
)
def test_list_state_split_rescaling(new_p: int, expected: list[list[str]]) -> None:
    old = [items("a", "b"), items(), items("c", "d", "e")]
    assert names(assign_list_state(old, new_p, "split")) == expected


@pytest.mark.parametrize("new_p", [1, 2, 3, 5])
def test_list_state_union_gives_every_subtask_everything(new_p: int) -> None:
    old = [items("a", "b"), items(), items("c")]
    assert names(assign_list_state(old, new_p, "union")) == [["a", "b", "c"]] * new_p


def test_list_state_errors() -> None:
    with pytest.raises(StateAssignmentError, match="unknown list state mode 'broadcast'"):
        assign_list_state([items("a")], 2, "broadcast")  # type: ignore[arg-type]
    with pytest.raises(StateAssignmentError, match="new parallelism must be at least 1"):
        assign_list_state([items("a")], 0)


# -------------------------------------------------------------------------------- restore plan


def checkpoint(
    agg_p: int = 4, source_p: int = 2, max_p: int = 128
) -> tuple[OperatorSnapshot, OperatorSnapshot]:
    splits = [items(*[f"s{i}.{j}" for j in range(i + 2)]) for i in range(source_p)]
    source = OperatorSnapshot("source", source_p, max_p, (), splits)
    agg = OperatorSnapshot("agg", agg_p, max_p, snapshot_handles(max_p, agg_p))
    return source, agg


def test_plan_rescales_keyed_and_list_state() -> None:
    source, agg = checkpoint(agg_p=4, source_p=2)  # source: 2 + 3 = 5 splits
    plan = plan_restore(
        [source, agg],
        {"source": 3, "agg": 7},
        new_parallelism={"source": 3, "agg": 7},
        max_parallelism=128,
    )
    assert [op.operator_id for op in plan.operators] == ["agg", "source"]
    assert plan.restored == ("agg", "source")
    assert plan.started_empty == () and plan.skipped == ()

    p_agg = plan.operator("agg")
    assert (p_agg.old_parallelism, p_agg.parallelism, p_agg.max_parallelism) == (4, 7, 128)
    assert p_agg.list_mode is None
    expected = assign_keyed(agg.keyed, 128, 7)
    assert [(s.key_groups, s.reads) for s in p_agg.subtasks] == [
        (e.key_groups, e.reads) for e in expected
    ]
    assert all(s.list_state == () for s in p_agg.subtasks)
    assert p_agg.size == agg.size == plan.size
    assert p_agg.handle_urls == tuple(h.url for h in agg.keyed)

    p_src = plan.operator("source")
    assert names([s.list_state for s in p_src.subtasks]) == [
        ["s0.0", "s1.1"],
        ["s0.1", "s1.2"],
        ["s1.0"],
    ]
    assert [s.key_groups for s in p_src.subtasks] == [flink_range(128, 3, i) for i in range(3)]
    assert all(s.reads == () for s in p_src.subtasks)
    with pytest.raises(KeyError):
        plan.operator("sink")


def test_plan_with_unchanged_parallelism_restores_in_place() -> None:
    source, agg = checkpoint(agg_p=4, source_p=2)
    plan = plan_restore([source, agg], ["source", "agg"], new_parallelism=4, max_parallelism=128)
    for s, h in zip(plan.operator("agg").subtasks, agg.keyed, strict=True):
        assert s.reads == (HandleRead(h.url, h.key_groups, h.size),)
    # the source's parallelism does change (2 -> 4): 5 splits dealt over 4
    assert names([s.list_state for s in plan.operator("source").subtasks]) == [
        ["s0.0", "s1.2"],
        ["s0.1"],
        ["s1.0"],
        ["s1.1"],
    ]
    plan2 = plan_restore([source, agg], ["source", "agg"], new_parallelism=2, max_parallelism=128)
    assert names([s.list_state for s in plan2.operator("source").subtasks]) == [
        ["s0.0", "s0.1"],
        ["s1.0", "s1.1", "s1.2"],
    ]


def test_plan_union_list_state() -> None:
    src = OperatorSnapshot("source", 2, 128, (), [items("a"), items("b", "c")], list_mode="union")
    plan = plan_restore([src], ["source"], new_parallelism=3, max_parallelism=128)
    op = plan.operator("source")
    assert op.list_mode == "union"
    assert names([s.list_state for s in op.subtasks]) == [["a", "b", "c"]] * 3


def test_max_parallelism_change_is_an_error() -> None:
    source, agg = checkpoint(max_p=128)
    with pytest.raises(
        StateAssignmentError,
        match=(
            r"operator 'agg': max_parallelism changed from 128 to 64; state cannot be rescaled "
            r"across a different number of key groups"
        ),
    ) as exc:
        plan_restore([source, agg], ["source", "agg"], new_parallelism=4, max_parallelism=64)
    assert isinstance(exc.value, CheckpointingError)
    with pytest.raises(StateAssignmentError, match="operator 'source': max_parallelism changed"):
        plan_restore(
            [source, agg],
            ["source", "agg"],
            new_parallelism=4,
            max_parallelism={"agg": 128, "source": 256},
        )


def test_max_parallelism_left_out_adopts_the_checkpoints() -> None:
    source, agg = checkpoint(max_p=13)
    plan = plan_restore(
        [source, agg],
        ["source", "agg", "sink"],
        new_parallelism=5,
        max_parallelism={},
    )
    assert plan.operator("agg").max_parallelism == 13
    assert plan.operator("source").max_parallelism == 13
    assert plan.operator("sink").max_parallelism == 128  # no state: the default
    assert [s.key_groups for s in plan.operator("agg").subtasks] == [
        flink_range(13, 5, i) for i in range(5)
    ]


def test_new_parallelism_above_max_parallelism_is_an_error() -> None:
    source, agg = checkpoint(max_p=13)
    with pytest.raises(
        StateAssignmentError,
        match=r"operator 'agg': new parallelism 14 exceeds max_parallelism 13",
    ):
        plan_restore([source, agg], ["source", "agg"], new_parallelism=14, max_parallelism=13)
    # also for an operator without state
    with pytest.raises(StateAssignmentError, match=r"operator 'sink': new parallelism 9 exceeds"):
        plan_restore([], ["sink"], new_parallelism=9, max_parallelism=8)
    with pytest.raises(StateAssignmentError, match=r"operator 'sink': new parallelism must be at"):
        plan_restore([], ["sink"], new_parallelism=0, max_parallelism=8)
    with pytest.raises(StateAssignmentError, match=r"operator 'sink': max_parallelism must be in"):
        plan_restore([], ["sink"], new_parallelism=1, max_parallelism=40000)


def test_state_for_an_operator_not_in_the_job_is_an_error() -> None:
    source, agg = checkpoint()
    old = OperatorSnapshot("old-filter", 2, 128, snapshot_handles(128, 2, "x"), [items("q"), []])
    with pytest.raises(
        StateAssignmentError,
        match=(
            r"cannot map checkpoint state to the new job: operator\(s\) 'agg', 'old-filter' are "
            r"not in the job; .*allow_non_restored_state"
        ),
    ):
        plan_restore([old, source, agg], ["source"], new_parallelism=2, max_parallelism=128)


def test_allow_non_restored_state_skips_and_lists_it() -> None:
    source, agg = checkpoint()
    old = OperatorSnapshot("old-filter", 2, 64, snapshot_handles(64, 2, "x"), [items("q"), []])
    plan = plan_restore(
        [old, source, agg],
        ["source", "agg", "sink"],
        new_parallelism=3,
        max_parallelism={"source": 128, "agg": 128},
        allow_non_restored_state=True,
    )
    assert plan.restored == ("agg", "source")
    assert plan.started_empty == ("sink",)
    (skipped,) = plan.skipped
    assert skipped.operator_id == "old-filter"
    assert (skipped.parallelism, skipped.max_parallelism) == (2, 64)
    assert (skipped.handles, skipped.size, skipped.list_items) == (2, old.size, 1)
    assert old.size > 0


def test_operators_without_state_start_empty() -> None:
    plan = plan_restore(
        [], {"source": 2, "agg": 3}, new_parallelism={"source": 2, "agg": 3}, max_parallelism=128
    )
    assert plan.started_empty == ("agg", "source")
    assert plan.restored == () and plan.size == 0
    agg = plan.operator("agg")
    assert agg.starts_empty and agg.old_parallelism is None and agg.list_mode is None
    assert [s.key_groups for s in agg.subtasks] == [flink_range(128, 3, i) for i in range(3)]
    assert all(s.reads == () and s.list_state == () for s in agg.subtasks)


def test_parallelism_mappings_must_match_the_job() -> None:
    source, agg = checkpoint()
    with pytest.raises(StateAssignmentError, match=r"operator 'source': no new_parallelism given"):
        plan_restore(
            [source, agg], ["source", "agg"], new_parallelism={"agg": 2}, max_parallelism=128
        )
    with pytest.raises(
        StateAssignmentError, match=r"new_parallelism names operator\(s\) not in the job: 'sikn'"
    ):
        plan_restore(
            [source, agg],
            ["source", "agg"],
            new_parallelism={"agg": 2, "source": 2, "sikn": 1},
            max_parallelism=128,
        )
    with pytest.raises(
        StateAssignmentError, match=r"max_parallelism names operator\(s\) not in the job: 'x'"
    ):
        plan_restore([source, agg], ["source", "agg"], new_parallelism=2, max_parallelism={"x": 4})


def test_inconsistent_snapshots_are_errors() -> None:
    overlapping = OperatorSnapshot(
        "agg",
        2,
        128,
        [
            KeyedStateHandle("a", KeyGroupRange(0, 70), {}),
            KeyedStateHandle("b", KeyGroupRange(64, 127), {}),
        ],
    )
    with pytest.raises(
        StateAssignmentError, match=r"operator 'agg': handles a .* and b .* overlap"
    ):
        plan_restore([overlapping], ["agg"], new_parallelism=2, max_parallelism=128)

    short = OperatorSnapshot("source", 3, 128, (), [items("a"), items("b")])
    with pytest.raises(
        StateAssignmentError,
        match=r"operator 'source': list state has 2 subtask\(s\) but the checkpoint's "
        r"parallelism is 3",
    ):
        plan_restore([short], ["source"], new_parallelism=2, max_parallelism=128)

    bad_items = OperatorSnapshot("source", 1, 128, (), [["not-a-mapping"]])  # type: ignore[list-item]
    with pytest.raises(StateAssignmentError, match="list state item of subtask 0 is not a mapping"):
        plan_restore([bad_items], ["source"], new_parallelism=1, max_parallelism=128)

    bad_p = OperatorSnapshot("agg", 200, 128)
    with pytest.raises(StateAssignmentError, match=r"checkpointed parallelism 200 is not in"):
        plan_restore([bad_p], ["agg"], new_parallelism=2, max_parallelism=128)

    _, agg = checkpoint()
    with pytest.raises(
        StateAssignmentError, match="operator 'agg': the checkpoint has its state twice"
    ):
        plan_restore([agg, agg], ["agg"], new_parallelism=2, max_parallelism=128)


def test_to_dict_is_json_serialisable_and_describe_is_readable() -> None:
    source, agg = checkpoint(agg_p=4, source_p=2)
    old = OperatorSnapshot("old-filter", 1, 128, (), [items("z")])
    plan = plan_restore(
        [source, agg, old],
        ["source", "agg", "sink"],
        new_parallelism={"source": 3, "agg": 7, "sink": 1},
        max_parallelism=128,
        allow_non_restored_state=True,
    )
    doc = plan.to_dict()
    assert json.loads(json.dumps(doc)) == doc
    assert doc["restored"] == ["agg", "source"]
    assert doc["started_empty"] == ["sink"]
    assert [s["operator_id"] for s in doc["skipped"]] == ["old-filter"]
    assert doc["size"] == agg.size
    agg_doc = doc["operators"][0]
    assert agg_doc["operator_id"] == "agg"
    assert agg_doc["old_parallelism"] == 4 and agg_doc["parallelism"] == 7
    assert agg_doc["subtasks"][1]["key_groups"] == {"start": 19, "end": 36}
    assert [r["key_groups"] for r in agg_doc["subtasks"][1]["reads"]] == [
        {"start": 19, "end": 31},
        {"start": 32, "end": 36},
    ]
    assert sum(s["size"] for s in agg_doc["subtasks"]) == agg.size
    by_id = {op["operator_id"]: op for op in doc["operators"]}
    assert list(by_id) == ["agg", "sink", "source"]
    assert by_id["source"]["subtasks"][2]["list_state"] == [{"split": "s1.0"}]
    assert by_id["sink"]["starts_empty"] is True

    text = plan.describe()
    assert text.splitlines()[0] == (
        f"restore plan: 2 operator(s) restored, 1 starting empty, 1 skipped; "
        f"{agg.size} bytes of keyed state"
    )
    assert f"  agg: parallelism 4 -> 7 (max 128), {agg.size} bytes from 4 handle(s)" in text
    assert "    subtask 1: key groups 19-36, " in text
    assert "  sink: no state in the checkpoint, starts empty with parallelism 1" in text
    assert "  old-filter: not in the job, state skipped" in text


def test_plan_is_an_immutable_value() -> None:
    source, agg = checkpoint()
    args = dict(new_parallelism=3, max_parallelism=128)
    a = plan_restore([source, agg], ["source", "agg"], **args)  # type: ignore[arg-type]
    b = plan_restore([source, agg], ["source", "agg"], **args)  # type: ignore[arg-type]
    assert isinstance(a, StateAssignment)
    assert a == b
    with pytest.raises(AttributeError):
        a.operators = ()  # type: ignore[misc]
