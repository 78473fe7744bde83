"""A spec's aggregations (``aggregations: {name: fn(col)}``): the functions a keyed stage
computes, parsed from their text, with SQL null semantics."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict

from checkpointing.pipeline.columns import is_identifier

_AGG = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\((.*)\)\s*$", re.DOTALL)
#: the aggregation functions by the number of columns they take (``count`` takes 0 or 1)
AGGREGATE_FUNCTIONS: dict[str, tuple[int, ...]] = {
    "count": (0, 1),
    "sum": (1,),
    "min": (1,),
    "max": (1,),
    "avg": (1,),
    "count_distinct": (1,),
    "approx_count_distinct": (1,),
    "max_by": (2,),
    "min_by": (2,),
    "stddev": (1,),
    "variance": (1,),
}
_AGG_USAGE = (
    "use count(), count(col), sum(col), min(col), max(col), avg(col), count_distinct(col), "
    "approx_count_distinct(col), max_by(value, order), min_by(value, order), stddev(col) or "
    "variance(col)"
)


class Aggregation(BaseModel):
    """``count()``, ``count(col)``, ``sum(col)``, ``min(col)``, ``max(col)``, ``avg(col)``,
    ``count_distinct(col)``, ``approx_count_distinct(col)``, ``max_by(value, order)``,
    ``min_by(value, order)``, ``stddev(col)``, ``variance(col)`` — SQL semantics: nulls are
    ignored, and an aggregate over only nulls is null (counts: 0). ``order`` is the second column
    of ``max_by``/``min_by`` (the one compared); ``column`` is the first (the one returned)."""

    model_config = ConfigDict(frozen=True)

    function: Literal[
        "count",
        "sum",
        "min",
        "max",
        "avg",
        "count_distinct",
        "approx_count_distinct",
        "max_by",
        "min_by",
        "stddev",
        "variance",
    ]
    column: str | None
    order: str | None = None

    @classmethod
    def parse(cls, text: str) -> Aggregation:
        """``fn(a)`` or ``fn(a, b)``; an unknown function or a wrong number of columns is a
        :class:`ValueError` saying what the function takes."""
        match = _AGG.match(text) if isinstance(text, str) else None
        function = match.group(1) if match else None
        if match is None or function not in AGGREGATE_FUNCTIONS:
            raise ValueError(f"{text!r} is not an aggregation: {_AGG_USAGE}")
        inner = match.group(2).strip()
        columns = [c.strip() for c in inner.split(",")] if inner else []
        for column in columns:
            if not is_identifier(column):
                raise ValueError(f"{text.strip()}: {column!r} is not a column name")
        arity = AGGREGATE_FUNCTIONS[function]
        if len(columns) not in arity:
            if arity == (2,):
                raise ValueError(
                    f"{text.strip()}: {function} needs two columns, {function}(value, order) "
                    f"(the value of the row with the {function[:3]}imum order), e.g. "
                    f"{function}(carrier, dep_delay)"
                )
            if not columns:
                raise ValueError(f"{function}() needs a column, e.g. {function}(amount)")
            raise ValueError(f"{text.strip()}: {function} takes one column, not {len(columns)}")
        column = columns[0] if columns else None
        order = columns[1] if len(columns) > 1 else None
        return cls(function=function, column=column, order=order)  # type: ignore[arg-type]

    def __str__(self) -> str:
        columns = [c for c in (self.column, self.order) if c is not None]
        return f"{self.function}({', '.join(columns)})"

    @property
    def columns(self) -> list[str]:
        """The input columns it reads (none for ``count()``)."""
        return [c for c in (self.column, self.order) if c is not None]
