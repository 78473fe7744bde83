"""Key groups: the unit of keyed state and of rescaling (Flink's ``KeyGroupRangeAssignment``).

A key goes to key group ``pmod(xxhash64(canonical(key), seed=42), max_parallelism)``; subtask
``i`` of ``p`` owns the contiguous range ``[ceil(i*maxP/p), floor(((i+1)*maxP-1)/p)]``. The number
of key groups (``max_parallelism``) is fixed for the life of a job's state, so a restore with any
parallelism up to it just hands each new subtask a different range.

The canonical encoding makes the hash the same in every process — Python here, the JVM through
Spark's ``xxhash64`` in the Spark runtime — on every run and machine (never Python's salted
``hash()``): each key column becomes ``<length>:<text>`` (``N`` for null), concatenated, UTF-8.
Strings, integers, booleans and dates are supported key types; floating-point keys are refused
(their text forms differ between Python and the JVM).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

DEFAULT_MAX_PARALLELISM = 128
#: Flink's upper bound on max parallelism (key groups are 15-bit in Flink)
UPPER_BOUND_MAX_PARALLELISM = 1 << 15
HASH_SEED = 42

KeyValue = str | int | bool | dt.date | None


@dataclass(frozen=True, order=True)
class KeyGroupRange:
    """Inclusive range of key groups; empty when ``end < start``."""

    start: int
    end: int

    def __len__(self) -> int:
        return max(0, self.end - self.start + 1)

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int) and self.start <= key_group <= self.end

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(self.start, self.end + 1))

    def intersection(self, other: KeyGroupRange) -> KeyGroupRange:
        return KeyGroupRange(max(self.start, other.start), min(self.end, other.end))


def check_parallelism(parallelism: int, max_parallelism: int) -> None:
    if not 1 <= max_parallelism <= UPPER_BOUND_MAX_PARALLELISM:
        raise ValueError(
            f"max_parallelism must be in [1, {UPPER_BOUND_MAX_PARALLELISM}], got {max_parallelism}"
        )
    if not 1 <= parallelism <= max_parallelism:
        raise ValueError(
            f"parallelism must be in [1, max_parallelism={max_parallelism}], got {parallelism}"
        )


def key_group_range(max_parallelism: int, parallelism: int, subtask: int) -> KeyGroupRange:
    """The key groups subtask ``subtask`` of ``parallelism`` owns."""
    check_parallelism(parallelism, max_parallelism)
    if not 0 <= subtask < parallelism:
        raise ValueError(f"subtask {subtask} out of range for parallelism {parallelism}")
    start = (subtask * max_parallelism + parallelism - 1) // parallelism
    end = ((subtask + 1) * max_parallelism - 1) // parallelism
    return KeyGroupRange(start, end)


def subtask_for_key_group(max_parallelism: int, parallelism: int, key_group: int) -> int:
    """The subtask that owns ``key_group`` (the inverse of :func:`key_group_range`)."""
    return key_group * parallelism // max_parallelism


def canonical_key(values: Sequence[KeyValue]) -> bytes:
    parts = []
    for v in values:
        if v is None:
            parts.append("N")
            continue
        if isinstance(v, bool):
            text = "true" if v else "false"
        elif isinstance(v, int | str):
            text = str(v)
        elif isinstance(v, dt.datetime):
            raise TypeError("timestamp keys are not supported; use a date or a string")
        elif isinstance(v, dt.date):
            text = v.isoformat()
        else:
            raise TypeError(f"unsupported key type {type(v).__name__} (use str, int, bool or date)")
        parts.append(f"{len(text)}:{text}")
    return "".join(parts).encode("utf-8")


def key_group_for(values: Sequence[KeyValue], max_parallelism: int) -> int:
    """The key group of a key (one value per key column)."""
    digest = xxhash.xxh64_intdigest(canonical_key(values), seed=HASH_SEED)
    signed = digest - (1 << 64) if digest >= 1 << 63 else digest  # the JVM's signed long
    return signed % max_parallelism  # Python's % is Spark's pmod for a positive divisor
