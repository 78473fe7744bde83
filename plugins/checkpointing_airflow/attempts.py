"""Attempt ids: one try of one DAG run of a pipeline, ``<run>-<hash>-t<try>``.

The operator builds the id of its try (it is the coordinator id of the job while the try runs,
and part of task and file names); the failure callbacks build the failed try's id and read a
later try's id back. Both do it here."""

from __future__ import annotations

import hashlib
import re
from typing import Any

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def attempt_id(dag_id: str, run_id: str, try_number: int) -> str:
    """A safe, unique id for one try of one DAG run (it becomes part of task and file names)."""
    digest = hashlib.sha256(f"{dag_id}\0{run_id}".encode()).hexdigest()[:8]
    readable = _UNSAFE.sub("-", run_id).strip("-._")[:48] or "run"
    return f"{readable}-{digest}-t{try_number}"


def later_try(coordinator_id: str | None, failed: str, try_number: int) -> str | None:
    """``coordinator_id`` when it is the attempt id of a later try of the same DAG run as
    ``failed`` (the attempt id of try ``try_number``), else None."""
    run = failed.removesuffix(f"-t{try_number}")
    if coordinator_id is None or not coordinator_id.startswith(f"{run}-t"):
        return None
    later = coordinator_id.removeprefix(f"{run}-t")
    return coordinator_id if later.isdigit() and int(later) > try_number else None


def run_started(context: Any) -> Any:
    """When the try's DAG run started (restores pick checkpoints completed since), or None."""
    dag_run = context.get("dag_run")
    return getattr(dag_run, "start_date", None) if dag_run is not None else None
