"""Key groups and their assignment to subtasks (Flink's ``KeyGroupRangeAssignment``)."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys

import pytest

from checkpointing.state.keygroups import (
    KeyGroupRange,
    canonical_key,
    key_group_for,
    key_group_range,
    subtask_for_key_group,
)

#: Pinned values: a change here would silently reshuffle every job's keyed state on restore.
GOLDEN = [
    (("JFK", "LAX"), 57, 11065),
    (("EWR", "ORD"), 98, 28130),
    ((1,), 35, 14243),
    ((None,), 29, 18717),
    (("",), 81, 16465),
    (("ü",), 126, 20094),
]


@pytest.mark.parametrize(("key", "kg128", "kg32768"), GOLDEN)
def test_key_groups_are_pinned(key: tuple[object, ...], kg128: int, kg32768: int) -> None:
    assert key_group_for(key, 128) == kg128  # type: ignore[arg-type]
    assert key_group_for(key, 32768) == kg32768  # type: ignore[arg-type]


def test_key_groups_do_not_depend_on_the_process_hash_seed() -> None:
    code = (
        "from checkpointing.state.keygroups import key_group_for;"
        "print([key_group_for(k, 128) for k in [('JFK','LAX'), ('x',), (7, 'y')]])"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("0", "1", "12345")
    }
    assert len(outputs) == 1


def test_canonical_encoding_separates_columns_and_nulls() -> None:
    assert canonical_key(["a:b", "c"]) != canonical_key(["a", "b:c"])
    assert canonical_key([None]) != canonical_key(["N"])
    assert canonical_key(["1"]) == canonical_key([1])  # text form is the canonical form
    assert canonical_key([True, dt.date(2013, 1, 2)]) == b"4:true10:2013-01-02"


@pytest.mark.parametrize("bad", [1.5, dt.datetime(2013, 1, 1), b"bytes", [1]])
def test_unsupported_key_types_are_refused(bad: object) -> None:
    with pytest.raises(TypeError):
        key_group_for([bad], 128)  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("max_parallelism", "parallelism"),
    [(m, p) for m in (1, 7, 128, 1000) for p in (1, 2, 3, 4, 7) if p <= m],
)
def test_ranges_partition_all_key_groups(max_parallelism: int, parallelism: int) -> None:
    ranges = [key_group_range(max_parallelism, parallelism, i) for i in range(parallelism)]
    covered = [kg for r in ranges for kg in r]
    assert covered == list(range(max_parallelism))  # contiguous, in order, no overlap
    for i, r in enumerate(ranges):
        for kg in r:
            assert subtask_for_key_group(max_parallelism, parallelism, kg) == i


def test_ranges_match_flink() -> None:
    assert [key_group_range(128, 3, i) for i in range(3)] == [
        KeyGroupRange(0, 42),
        KeyGroupRange(43, 85),
        KeyGroupRange(86, 127),
    ]
    assert key_group_range(10, 4, 1) == KeyGroupRange(3, 4)  # ceil(10/4)=3, floor(19/4)=4


def test_range_helpers() -> None:
    r = KeyGroupRange(3, 9)
    assert len(r) == 7 and 3 in r and 10 not in r
    assert r.intersection(KeyGroupRange(8, 20)) == KeyGroupRange(8, 9)
    assert len(r.intersection(KeyGroupRange(10, 20))) == 0


@pytest.mark.parametrize(
    ("max_p", "p", "i", "message"),
    [
        (128, 0, 0, "parallelism must be in"),
        (4, 5, 0, "parallelism must be in"),
        (0, 1, 0, "max_parallelism must be in"),
        (128, 2, 2, "subtask 2 out of range"),
    ],
)
def test_bad_parallelism(max_p: int, p: int, i: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        key_group_range(max_p, p, i)
