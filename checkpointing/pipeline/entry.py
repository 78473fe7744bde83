"""Python entry points in a pipeline spec: ``pipeline: my_pkg.jobs:build`` (a function returning a
:class:`checkpointing.spark.Pipeline`, or such an object) and ``transform: my_pkg.jobs:clean``
(the Python API's ``fn(input, tables) -> DataFrame``).

An entry point is ``module.path:name``: a dotted module path, a colon, an identifier (a SQL
``SELECT`` always has spaces, so a ``transform:`` is one or the other). It is imported with
:func:`importlib.import_module` from the installed packages and ``sys.path``, with the spec's
``py_files`` (``.py``, ``.zip`` or ``.egg`` files, as ``spark-submit --py-files`` takes them)
put first; nothing is evaluated or unpickled. Everything that can go wrong is a
:class:`~checkpointing.pipeline.spec.SpecError` of one line naming the file, the field and the
entry point, raised by :func:`~checkpointing.pipeline.spec.load_spec`: before Spark starts and
before anything is written.

With ``pipeline:`` the spec file holds the deployment (``job``, ``schedule``, ``retries``,
``retry_delay``, ``parallelism_on_retry``, ``owner``, ``tags``, ``py_files``) and the
:class:`Pipeline` the job itself (source, transform, tables, stages, sink, parallelism,
checkpoints, storage, restarts). A field both give must agree (``job`` always is in both).
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from checkpointing.config import describe_validation_error
from checkpointing.errors import SpecError

#: the pipeline spec's model (:class:`checkpointing.pipeline.spec.PipelineSpec`), which imports
#: this module: passed in, never imported here
Spec = Any

#: ``module.path:name``
ENTRY_POINT = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$", re.ASCII)
#: the files ``py_files`` may name (``spark-submit --py-files`` takes these)
PY_FILE_SUFFIXES = (".py", ".zip", ".egg")
#: what a spec file with ``pipeline:`` may hold besides it: the deployment
DEPLOYMENT_FIELDS = (
    "job",
    "py_files",
    "schedule",
    "retries",
    "retry_delay",
    "parallelism_on_retry",
    "owner",
    "tags",
)


def is_entry_point(text: object) -> bool:
    """Whether ``text`` is ``module.path:name`` (and so not SQL)."""
    return isinstance(text, str) and ENTRY_POINT.match(text.strip()) is not None


def check_entry_field(field: str, value: Any) -> Any:
    """The spec's validation of ``transform`` (a SELECT has spaces; without any it must be an
    entry point), ``pipeline`` (an entry point) and ``py_files`` (``.py``/``.zip``/``.egg``)."""
    if field == "transform" and value is not None and len(value.split()) == 1:
        if not is_entry_point(value):
            raise ValueError(
                f"{value.strip()!r} is neither a SELECT over input nor a Python function's entry "
                "point module.path:fn"
            )
    elif field == "pipeline" and value is not None:
        if not is_entry_point(value):
            raise ValueError(
                f"{value!r} is not an entry point: expected module.path:name, e.g. "
                "my_pkg.jobs:build"
            )
        return value.strip()
    elif field == "py_files":
        for name in value:
            if not name.endswith(PY_FILE_SUFFIXES):
                raise ValueError(f"{name!r}: expected a .py, .zip or .egg file")
    return value


class PipelineDefinition:
    """A job defined in code: its spec (without aggregations), the keyed stages it runs and its
    Python transform. :class:`checkpointing.spark.Pipeline` is the implementation; the core
    knows this much of it so that a spec can name one without importing Spark."""

    spec: Spec
    stages: list[Any]
    transform: Callable[..., Any] | None


@dataclass(frozen=True)
class PipelineCode:
    """What a spec's entry points resolved to: the stages of a ``pipeline:`` (empty: the spec's
    aggregations) and the transform function (``transform:`` or the Pipeline's)."""

    stages: tuple[Any, ...] = ()
    transform: Callable[..., Any] | None = None


class EntryPointError(ValueError):
    """An entry point that cannot be used; the message says why (one line)."""


def import_entry(entry: str, py_files: Sequence[str] = ()) -> Any:
    """The object ``entry`` (``module.path:name``) names, its module imported with ``py_files``
    (absolute paths) first on ``sys.path``. :class:`EntryPointError` says why not."""
    entry = entry.strip()
    if not is_entry_point(entry):
        raise EntryPointError(f"{entry!r} is not an entry point: expected module.path:name")
    module_name, name = entry.split(":")
    add_py_files(py_files)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise EntryPointError(
                f"no module named {missing!r} (install its package, or ship it with "
                "py_files: [a .py, .zip or .egg file])"
            ) from None
        raise EntryPointError(f"importing {module_name} failed: {_one_line(exc)}") from None
    except Exception as exc:  # the module's own code failed: say how, in one line
        raise EntryPointError(f"importing {module_name} failed: {_one_line(exc)}") from None
    try:
        return getattr(module, name)
    except AttributeError:
        raise EntryPointError(f"module {module_name} has no attribute {name!r}") from None


def add_py_files(py_files: Sequence[str]) -> None:
    """``py_files`` first on ``sys.path`` (a ``.py`` file: its folder), once each, as
    ``spark-submit --py-files`` puts them on the executors' path."""
    for path in reversed(py_files):
        entry = str(Path(path).parent) if path.endswith(".py") else path
        if entry not in sys.path:
            sys.path.insert(0, entry)


def transform_function(entry: str, py_files: Sequence[str]) -> Callable[..., Any]:
    """The function of ``transform: module:fn``: callable as ``fn(input, tables)``."""
    fn = import_entry(entry, py_files)
    if not callable(fn) or isinstance(fn, type):
        raise EntryPointError(f"{entry} is {_a(fn)}, not a function fn(input, tables) -> DataFrame")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise EntryPointError(
            f"{entry}{_signature(fn)} cannot be called as fn(input, tables) -> DataFrame"
        ) from None
    except ValueError:  # no signature to inspect (a builtin): it is called as it is
        pass
    return fn


def built_pipeline(entry: str, py_files: Sequence[str]) -> PipelineDefinition:
    """The Pipeline ``pipeline: module:build`` names: what ``build()`` returns, or the object."""
    target = import_entry(entry, py_files)
    if not isinstance(target, PipelineDefinition):
        if not callable(target) or isinstance(target, type):
            raise EntryPointError(
                f"{entry} is {_a(target)}, not a function returning a Pipeline (or a Pipeline)"
            )
        try:
            target = target()
        except Exception as exc:
            raise EntryPointError(f"{entry}() raised {_one_line(exc)}") from None
        if not isinstance(target, PipelineDefinition):
            raise EntryPointError(
                f"{entry}() returned {_a(target)}, not a checkpointing.spark.Pipeline"
            )
    return target


def merge_pipeline(
    raw: Mapping[str, Any],
    definition: PipelineDefinition,
    where: str,
    model: type[Spec],
) -> Spec:
    """The job's spec (a ``model``, the spec's class: passed in, as the spec module calls this
    one): the Pipeline's, with the spec file's deployment fields (``raw``, which holds only
    those, ``pipeline`` and ``py_files``) on top; a field both give must agree."""
    entry = raw["pipeline"]
    own = definition.spec
    given = {name: getattr(own, name) for name in own.model_fields_set if name != "spec_path"}
    for name in ("pipeline", "py_files"):
        if name in given:
            raise SpecError(f"{where}: pipeline: {entry}: the Pipeline sets {name}, a spec field")
    try:
        merged = model.model_validate({**given, **raw})
    except ValidationError as exc:
        raise SpecError(describe_validation_error(exc, where).replace("\n", "; ")) from None
    for name in sorted(set(raw) & set(given)):
        ours, theirs = getattr(merged, name), getattr(own, name)
        if ours != theirs:
            fix = (
                "the two must be the same (the DAG is the job)"
                if name == "job"
                else "give it in one place (or the same in both)"
            )
            raise SpecError(
                f"{where}: {name}: {_shown(raw[name])} here but {_shown(theirs)} in the "
                f"Pipeline of pipeline: {entry}; {fix}"
            )
    return merged


def _shown(value: Any) -> str:
    return repr(str(value)) if not isinstance(value, int | list) else repr(value)


def _signature(fn: Any) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _a(value: Any) -> str:
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# ---------------------------------------------------------------------- what load_spec calls


def resolve_py_files(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """``raw`` with ``py_files`` absolute (relative ones are to the spec file's folder); a file
    that is not there is refused, naming it."""
    files = raw.get("py_files")
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return raw  # not a list of names: the model says what is wrong
    resolved = []
    for name in files:
        file = Path(name).expanduser()
        file = file if file.is_absolute() else (path.parent / file).resolve()
        if name.endswith(PY_FILE_SUFFIXES) and not file.is_file():
            raise SpecError(f"{path}: py_files: {name}: no such file ({file})")
        resolved.append(str(file))
    return {**raw, "py_files": resolved}


def python_pipeline(
    raw: dict[str, Any], path: Path, model: type[Spec]
) -> tuple[Spec, PipelineCode]:
    """A spec file with ``pipeline:``: its Pipeline's spec (a ``model``) with the file's
    deployment fields on top, and the Pipeline's stages and transform. One-line
    :class:`SpecError` otherwise."""
    entry = raw["pipeline"]
    if not is_entry_point(entry):
        raise SpecError(
            f"{path}: pipeline: {entry!r} is not an entry point: expected module.path:name, "
            "e.g. my_pkg.jobs:build"
        )
    entry = entry.strip()
    for name in raw:
        if name == "pipeline" or name in DEPLOYMENT_FIELDS:
            continue
        if name in model.model_fields:
            raise SpecError(
                f"{path}: {name}: the Pipeline of pipeline: {entry} gives it; a spec with "
                f"pipeline: holds only {', '.join(DEPLOYMENT_FIELDS)}"
            )
        raise SpecError(
            f"{path}: {name}: unknown field (a spec with pipeline: holds only "
            f"{', '.join(DEPLOYMENT_FIELDS)})"
        )
    if "job" not in raw:
        raise SpecError(f"{path}: job: Field required (the DAG's id; the Pipeline's job too)")
    try:
        definition = built_pipeline(entry, list(raw.get("py_files") or []))
    except EntryPointError as exc:
        raise SpecError(f"{path}: pipeline: {exc}") from None
    spec = merge_pipeline({**raw, "pipeline": entry}, definition, str(path), model)
    return spec, PipelineCode(tuple(definition.stages), definition.transform)


def load_code(spec: Any, path: Path) -> PipelineCode | None:
    """A spec's ``transform: module:fn``, imported and checked; None without one."""
    if not is_entry_point(spec.transform):
        return None
    try:
        fn = transform_function((spec.transform or "").strip(), spec.py_files)
    except EntryPointError as exc:
        raise SpecError(f"{path}: transform: {exc}") from None
    return PipelineCode(transform=fn)
