"""Entry points that are refused, each for its own reason (tests of the refusals)."""

from __future__ import annotations

from typing import Any

NOT_CALLABLE = 42


def returns_a_dict() -> dict[str, Any]:
    return {"job": "py_events"}


def raises() -> Any:
    raise ValueError("no events configured for this environment")


def one_argument(rows: Any) -> Any:
    return rows
