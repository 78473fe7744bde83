"""Column and table names in a spec: identifiers Spark SQL, Parquet, Delta and Iceberg all take
unquoted, compared without case as Spark does (``spark.sql.caseSensitive`` off)."""

from __future__ import annotations

import re
from typing import Any

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def is_identifier(name: object) -> bool:
    """Is ``name`` a plain identifier (a letter or ``_``, then letters, digits and ``_``)?"""
    return isinstance(name, str) and _IDENT.match(name) is not None


def as_list(value: Any) -> Any:
    """One column written alone (``key: user``) is a list of one."""
    return [value] if isinstance(value, str) else value


def check_columns(names: list[str], what: str) -> list[str]:
    """``names`` are identifiers and none repeats (ignoring case); a :class:`ValueError` naming
    the bad one otherwise (``what``: ``key`` or ``partition``, for the message)."""
    for name in names:
        if not is_identifier(name):
            raise ValueError(f"{name!r} is not a column name")
    if len({n.lower() for n in names}) != len(names):
        raise ValueError(f"{what} columns repeat")
    return names
