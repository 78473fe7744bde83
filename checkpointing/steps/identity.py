"""A step's identity: the fingerprint its checkpoint is reused under.

A completed step is read back instead of recomputed only when nothing that decides its rows has
changed: its logical plan (Spark's canonicalized analyzed plan, which has no expression ids; the
analyzed plan with its expression ids taken out, which keeps the column names; and its output
schema; not ``DataFrame.semanticHash()``, which differs between two sessions), the versions of
the files it reads (path, size, modification time) and the fingerprints of the steps it reads.
Any of them changed, the step and (through the last) every step downstream of it get a new
fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from checkpointing.ids import validate_id

#: time functions Spark folds into a literal per query (deterministic inside one run, never
#: across runs): a plan holding one is non-deterministic for a rerun
_TIME_FUNCTIONS = re.compile(
    r"\b(current_timestamp|current_date|now|localtimestamp|current_timezone|"
    r"unix_timestamp\(\))",
    re.IGNORECASE,
)
_EXPR_ID = re.compile(r"#\d+")
_SEED = re.compile(r"\b(rand|randn|random|uniform|randstr)\(-?\d+\)")
#: ``uuid(Some(<seed>))``, ``shuffle(…, Some(<seed>))``: a long number (not ``splits=Some(2)``)
_SOME_SEED = re.compile(r"Some\(-?\d{6,}\)")
#: plan nodes whose rows depend on which rows come first, unless a Sort decides it
_ORDER_DEPENDENT = re.compile(r"^\W*(GlobalLimit|LocalLimit|Tail|Offset)\b")


@dataclass(frozen=True)
class InputFile:
    """One file a step reads that no step wrote, as the file system lists it."""

    path: str
    size: int
    mtime_ms: int


@dataclass(frozen=True)
class StepIdentity:
    """What a step's checkpoint is reused under (:func:`fingerprint` of these)."""

    name: str
    plan: str
    #: the analyzed plan without expression ids (:func:`without_ids`)
    named_plan: str
    schema: str
    inputs: tuple[InputFile, ...]
    #: upstream step name -> its fingerprint
    upstream: tuple[tuple[str, str], ...]
    #: chained into its readers (a checkpoint of its plan, not its rows): toggling it is a change
    chained: bool = False
    #: ``ck.write``'s step: its files become the published table, written in Spark's defaults
    published: bool = False

    @property
    def fingerprint(self) -> str:
        return fingerprint(self)


def step_name(name: object) -> str:
    """A step's name names its operator and its directory: a path-safe id, refused here (one
    line naming it) before anything runs."""
    return validate_id(name, "step name")


def operator_id(name: str) -> str:
    """The operator id of a step's subtasks in its checkpoint."""
    return validate_id(f"step-{name}", "step operator id")


def fingerprint(identity: StepIdentity) -> str:
    """SHA-256 of the identity's canonical JSON (inputs sorted by path, upstream by name)."""
    body = {
        "name": identity.name,
        "plan": identity.plan,
        "named_plan": identity.named_plan,
        "schema": identity.schema,
        "inputs": sorted([f.path, f.size, f.mtime_ms] for f in identity.inputs),
        "upstream": sorted([n, fp] for n, fp in identity.upstream),
        **({"chained": True} if identity.chained else {}),
        **({"published": True} if identity.published else {}),
    }
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(canonical).hexdigest()


def without_ids(plan: str) -> str:
    """A plan's text without the expression ids Spark numbers per session (``amount#12L``)."""
    return without_seeds(_EXPR_ID.sub("", plan))


def without_seeds(plan: str) -> str:
    """A plan's text without the seeds Spark draws for ``rand()``, ``uuid()``, ``shuffle()``…
    when a DataFrame is built: a rerun of a non-deterministic step finds its checkpoint (and
    reuses it whole) instead of a new fingerprint every run."""
    return _SOME_SEED.sub("Some(seed)", _SEED.sub(r"\1(seed)", plan))


def nondeterminism(deterministic: bool, analyzed: str, optimized: str) -> str | None:
    """Why a plan's rows may differ between two runs, or None. ``deterministic`` is Spark's own
    flag of the analyzed plan (``rand()``, ``uuid()``, ``shuffle()``…); the time functions are
    folded per query, so they are found in the plan's text; a limit (or offset, tail) over
    anything but a sort keeps whichever rows come first."""
    if not deterministic:
        return "its plan is non-deterministic (rand(), uuid(), shuffle() or a similar expression)"
    found = _TIME_FUNCTIONS.search(analyzed)
    if found:
        return f"its plan reads the clock ({found.group(1).rstrip('()')}())"
    lines = optimized.splitlines()
    for i, line in enumerate(lines):
        if _ORDER_DEPENDENT.match(line):
            below = _first_child(lines, i)
            if below is not None and not _ORDER_DEPENDENT.match(below) and "Sort " not in below:
                return "it takes a limit of rows in no defined order (a limit without a sort)"
    return None


def _first_child(lines: Sequence[str], i: int) -> str | None:
    """The line of the first node below line ``i`` of a tree string, skipping limits."""
    for line in lines[i + 1 :]:
        if not _ORDER_DEPENDENT.match(line):
            return line
    return None
