"""The variables a spec's paths may use: ``${CKPT_HOME}`` always, and a ``scope: interval`` spec's
data-interval placeholders (:mod:`checkpointing.pipeline.interval`). Only these: never the whole
environment, whose secrets would end up in paths and logs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from checkpointing.errors import SpecError
from checkpointing.pipeline.interval import VARIABLES, DataInterval, Scope, uses_interval

#: ``${NAME}`` in a path field; ``$`` otherwise is a plain character
_VARIABLE = re.compile(r"\$\{([^}]*)\}")
#: the fields where the variables may be used: the paths
PATH_FIELDS = (("source", "path"), ("sink", "path"), ("sink", "catalog"), ("storage",))


def path_variables(
    raw: dict[str, Any], path: Path, home: Path | str, interval: DataInterval | None
) -> tuple[dict[str, str], tuple[str, ...]]:
    """The variables a spec's paths may use, and those kept as written (an unbound interval
    spec's placeholders). ``scope: interval`` needs its source and sink paths to name the
    interval; an interval given to any other spec is refused."""
    variables = {"CKPT_HOME": str(home)}
    scope = raw.get("scope", Scope.INCREMENTAL.value)
    if scope not in {s.value for s in Scope}:
        return variables, VARIABLES  # the spec's validation names the bad scope
    if scope != Scope.INTERVAL.value:
        for section in ("source", "sink"):
            value = raw.get(section)
            if isinstance(value, dict) and uses_interval(value.get("path")):
                raise SpecError(
                    f"{path}: {section}.path: names the data interval, which only a scope: "
                    "interval spec has (add scope: interval)"
                )
        if interval is not None:
            raise SpecError(
                f"{path}: scope: a data interval was given, but the spec's scope is "
                f"{raw.get('scope', 'incremental')} (set scope: interval and name the interval "
                "in source.path and sink.path, e.g. ${DS})"
            )
        return variables, ()
    for section in ("source", "sink"):
        value = raw.get(section)
        if isinstance(value, dict) and not uses_interval(value.get("path")):
            raise SpecError(
                f"{path}: {section}.path: a scope: interval spec names the data interval in "
                f"it (one of {', '.join('${' + v + '}' for v in VARIABLES)}), so that each "
                "interval reads and writes its own"
            )
    if interval is None:
        return variables, VARIABLES
    return {**variables, **interval.variables()}, ()


def expand_path_variables(
    raw: dict[str, Any], variables: dict[str, str], *, keep: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``raw`` with ``${NAME}`` replaced in its path fields (:data:`PATH_FIELDS`), from
    ``variables`` only: never from the whole environment, whose secrets would end up in paths
    and logs. An unknown name is a :class:`ValueError` naming the field; those in ``keep`` stay
    as written."""
    raw = dict(raw)
    tables = raw.get("tables")
    if isinstance(tables, dict):  # tables.<name>.path, like the source's
        raw["tables"] = {
            name: (
                {**t, "path": _expand(t["path"], variables, f"tables.{name}.path", keep)}
                if isinstance(t, dict) and isinstance(t.get("path"), str) and "${" in t["path"]
                else t
            )
            for name, t in tables.items()
        }
    for where in PATH_FIELDS:
        parent: Any = raw
        for name in where[:-1]:
            if not isinstance(parent.get(name), dict):
                break
            parent[name] = parent = dict(parent[name])
        else:
            value = parent.get(where[-1])
            if isinstance(value, str) and "${" in value:
                parent[where[-1]] = _expand(value, variables, ".".join(where), keep)
    return raw


def _expand(value: str, variables: dict[str, str], field: str, keep: tuple[str, ...]) -> str:
    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in keep:
            return match.group(0)
        if name not in variables:
            known = ", ".join(f"${{{v}}}" for v in sorted(variables))
            raise ValueError(f"{field}: unknown variable ${{{name}}} (a path may use {known})")
        return variables[name]

    return _VARIABLE.sub(one, value)


#: the interval an unbound template's paths are checked with (their shape, not their data)
SAMPLE_INTERVAL = DataInterval.parse("2000-01-01", "2000-01-02")


def as_sample(spec: Any) -> Any:
    """A template spec with its source and sink paths bound to :data:`SAMPLE_INTERVAL`, for the
    checks a path's shape decides (the sink's characters, the sink not inside the input)."""
    values = SAMPLE_INTERVAL.variables()
    source = spec.source.model_copy(update={"path": _expand(spec.source.path, values, "", ())})
    sink = spec.sink.model_copy(update={"path": _expand(spec.sink.path, values, "", ())})
    return spec.model_copy(update={"source": source, "sink": sink})
