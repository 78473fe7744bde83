"""Vacuuming a job's Delta sink table (``ckpt gc --vacuum-sink TABLE``): the sink's own data
files that no version a retained checkpoint or savepoint may restore still needs.

A restore from checkpoint C brings the table back to the version C committed
(:func:`checkpointing.sinks.delta_log.state_for_checkpoint`, then ``RESTORE``), so every version
from the oldest one a COMPLETED checkpoint or savepoint maps to up to the current one must stay
readable: the files of that oldest version and every file a later commit adds (a ``RESTORE``'s
re-adds included) are kept. What goes is the rest of the files the log ever added that are the
sink's own and the job's (:data:`checkpointing.sinks.delta_files.FILE_NAME`): files removed by
commits no retained checkpoint can go back to. A file the log never added (staged for a commit
that has not happened yet, or a retried task's leftover) is never touched here: the sink's
recovery decides about those. The log itself is left whole (time travel to a vacuumed version
then fails on its missing files, as after Delta's ``VACUUM``). Only a table whose every commit is
this job's sink's is vacuumed; anything else is refused naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from checkpointing.coordination import store
from checkpointing.metastore.engine import Metastore


@dataclass(frozen=True)
class SinkFile:
    """A data file of the sink's table a vacuum deletes (relative to the table's root)."""

    table: str
    name: str
    size: int

    def to_dict(self) -> dict[str, Any]:
        return {"table": self.table, "name": self.name, "size": self.size}


def plan_vacuum(metastore: Metastore, job_id: str, table_url: str) -> list[SinkFile]:
    """The sink's files of ``table_url`` no retained checkpoint or savepoint of the job needs."""
    from checkpointing.sinks import delta_files, delta_log

    table = delta_log.check_location(table_url, job_id)  # another job's or writer's: refused
    if table is None:
        return []
    with metastore.transaction() as s:
        retained = [c.checkpoint_id for c in store.completed(s, job_id)]
    current = table.version()
    oldest = min(
        [delta_log.state_for_checkpoint(table, cid).version for cid in retained] + [current]
    )
    logged = delta_log.referenced_files(table_url, table)
    needed = _later_adds(table_url, oldest)
    table.load_as_version(oldest)
    needed |= set(delta_log.current_files(table))
    own = delta_files.list_own_files(table_url, job_id)
    return [
        SinkFile(table_url, name, size)
        for name, size in sorted(own.items())
        if name in logged and name not in needed
    ]


def vacuum(job_id: str, files: list[SinkFile]) -> list[str]:
    """Delete ``files`` (from :func:`plan_vacuum`); return what could not be deleted."""
    from checkpointing.sinks import delta_files

    errors = []
    for table_url in sorted({f.table for f in files}):
        names = [f.name for f in files if f.table == table_url]
        try:
            delta_files.delete_own_files(table_url, job_id, names)
        except OSError as exc:
            errors.append(f"{table_url}: {exc}")
    return errors


def _later_adds(url: str, after: int) -> set[str]:
    """Every file a JSON commit of a version above ``after`` adds."""
    from checkpointing.sinks.delta_log import log_adds

    return log_adds(url, after)
