"""Orphan files in a job's checkpoint storage: files the project wrote that no checkpoint or
savepoint refers to any more (a write whose outcome was unknown, a killed executor's late
write, a deletion that failed), for ``ckpt gc``.

Only the names the project itself creates under the job's directory are considered (see
:class:`~checkpointing.state.storage.CheckpointStorage`'s layout), anything else is left alone:

* ``chk-<id>/…``: kept while checkpoint ``<id>`` is PENDING or COMPLETED, or SUBSUMED with its
  files kept (``discard_on_subsumed`` off); orphaned once it is aborted, discarded or subsumed,
  or when it has no row and its id was handed out already (a trigger that failed before its
  row);
* ``shared/chk-<id>/…``: kept while a checkpoint registers the file in the shared state registry
  (:mod:`checkpointing.coordination.shared_state`) or checkpoint ``<id>`` is PENDING or kept;
  every file a completed checkpoint restores from is registered;
* ``savepoints/savepoint-<id>/…``: kept while savepoint ``<id>`` is PENDING or COMPLETED.

An id not handed out yet (at or above the job's next checkpoint id) is in flight and kept, and so
is any file modified after the grace cutoff: a write under way is never deleted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select

from checkpointing.errors import CheckpointingError
from checkpointing.metastore import jobs
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint, SharedStateRef
from checkpointing.state.inventory import list_stored, remove_empty_dirs
from checkpointing.state.storage import CheckpointStorage
from checkpointing.status import CheckpointStatus

_OWNED = re.compile(r"^(chk|shared/chk|savepoints/savepoint)-([0-9]+)/.")
_LIVE = (CheckpointStatus.PENDING, CheckpointStatus.COMPLETED)


@dataclass(frozen=True)
class OrphanFile:
    url: str
    size: int
    modified_at: datetime

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "size": self.size, "modified_at": self.modified_at.isoformat()}


def find_orphans(
    metastore: Metastore, storage: CheckpointStorage, job_id: str, cutoff: datetime
) -> list[OrphanFile]:
    """The job's orphan files modified before ``cutoff``, sorted by URL. The storage is listed
    before the metastore is read, so a file a checkpoint registers meanwhile is seen as
    referenced."""
    root = storage.job_url(job_id)
    files = [f for f in list_stored(storage, root) if f.modified_at < cutoff]
    with metastore.transaction() as s:
        job = jobs.job_row(s, job_id)
        next_id = job.next_checkpoint_id
        rows = {
            cid: (status, keep)
            for cid, status, keep in s.execute(
                select(
                    Checkpoint.checkpoint_id, Checkpoint.status, Checkpoint.discard_on_subsumed
                ).where(Checkpoint.job_id == job_id)
            )
        }
        registered = set(
            s.scalars(select(SharedStateRef.handle).where(SharedStateRef.job_id == job_id))
        )
    orphans = []
    for f in files:
        match = _OWNED.match(f.url[len(root) + 1 :])
        if match is None:
            continue
        kind, checkpoint_id = match.group(1), int(match.group(2))
        if checkpoint_id >= next_id:
            continue  # in flight
        status, discard_on_subsumed = rows.get(checkpoint_id, (None, True))
        live = status in _LIVE or (status == CheckpointStatus.SUBSUMED and not discard_on_subsumed)
        if kind == "savepoints/savepoint":
            live = status in _LIVE
        elif kind == "shared/chk":
            live = (
                f.url in registered
                or status == CheckpointStatus.PENDING
                or (status == CheckpointStatus.SUBSUMED and not discard_on_subsumed)
            )
        if not live:
            orphans.append(OrphanFile(f.url, f.size, f.modified_at))
    return orphans


def delete_orphans(
    metastore: Metastore, storage: CheckpointStorage, job_id: str, files: list[OrphanFile]
) -> list[str]:
    """Delete ``files`` (found by :func:`find_orphans`), then the local directories they
    emptied; return what could not be deleted. Each file is checked again first, against a
    fresh read of the metastore: a file referenced meanwhile stays."""
    if not files:
        return []
    cutoff = max(f.modified_at for f in files)
    still = {f.url for f in find_orphans(metastore, storage, job_id, _after(cutoff))}
    root = storage.job_url(job_id)
    errors, emptied = [], set()
    for f in files:
        if f.url not in still:
            continue
        try:
            storage.delete(f.url)
            emptied.add(f.url.rsplit("/", 1)[0])
        except CheckpointingError as exc:
            errors.append(f"{f.url}: {exc}")
    remove_empty_dirs(storage, emptied, root, keep=(f"{root}/shared", f"{root}/savepoints"))
    return errors


def _after(when: datetime) -> datetime:
    return when + timedelta(microseconds=1)
