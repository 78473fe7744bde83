"""Reading a pipeline spec file: YAML through the safe loader, duplicate keys refused, and every
problem one line naming the file (never PyYAML's multi-line context dump)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from checkpointing.errors import SpecError


def read_spec_file(path: Path) -> dict[str, Any]:
    """The mapping in ``path``; :class:`SpecError` for a missing, unreadable, non-UTF-8 or
    invalid file, or one whose top level is not a mapping."""
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # safe loader
    except FileNotFoundError:
        raise SpecError(f"{path}: no such pipeline spec") from None
    except IsADirectoryError:
        raise SpecError(f"{path}: is a directory, not a pipeline spec (a YAML file)") from None
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not UTF-8 text (byte {exc.start}): not a pipeline spec") from None
    except OSError as exc:
        raise SpecError(f"{path}: cannot read the pipeline spec: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: {_yaml_problem(exc)}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: a pipeline spec is a mapping (job:, source:, key:, …)")
    return raw


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (the YAML
    spec says keys are unique; PyYAML silently keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<:`` merges may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # unhashable: the base class reports it
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first given on line {first + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: where (line, column) and what, without PyYAML's multi-line context dump."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}not valid YAML: {problem}"
