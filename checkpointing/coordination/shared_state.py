"""The shared state registry (Flink's ``SharedStateRegistry``), kept in the SQL metastore.

An incremental checkpoint N writes its new state files under ``<job>/shared/chk-N/`` and builds
on files that earlier checkpoints wrote there. Each completed checkpoint registers every shared
file it uses, one ``ckpt_shared_state`` row per checkpoint and file: a file's reference count is
its number of rows. When a checkpoint leaves the retained set (subsumed, discarded) its rows go,
and a file left with none is returned, for the cleaner to delete after the commit. So a file is
deleted only when no retained checkpoint can restore from it.

Savepoints are self-contained and never registered. Every function runs in the caller's
transaction, which holds the job row lock (completion, shutdown), so one job's registrations and
releases never interleave.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session

from checkpointing.coordination.pending import CHUNK
from checkpointing.errors import SharedStateError
from checkpointing.metastore.models import Checkpoint, SharedStateRef
from checkpointing.state.metadata import CheckpointMetadata
from checkpointing.state.storage import CheckpointStorage
from checkpointing.status import CheckpointStatus


@dataclass(frozen=True)
class SharedDirs:
    """Where a checkpoint's shared state may lie: the job's ``shared/`` directory, and in it the
    checkpoint's own ``shared/chk-<id>/`` (its new files; every other shared file is reused)."""

    job: str
    checkpoint: str

    @classmethod
    def of(cls, storage: CheckpointStorage, job_id: str, checkpoint_id: int) -> SharedDirs:
        return cls(storage.shared_url(job_id), storage.shared_checkpoint_url(job_id, checkpoint_id))


def within(url: str, root: str) -> bool:
    """Whether ``url`` is ``root`` or below it. A URL with a ``.`` or ``..`` part is below
    nothing: a recorded handle must not climb out of the directory it names."""
    parts = url.partition("://")[2 if "://" in url else 0].split("/")
    if "." in parts[1:] or ".." in parts or "\\" in url:
        return False
    root = root.rstrip("/")
    return url == root or url.startswith(root + "/")


def checkpointed_size(metadata: CheckpointMetadata, location: str, dirs: SharedDirs) -> int:
    """Bytes the checkpoint wrote itself (Flink's checkpointed data size): its files in its own
    directory or its own ``shared/chk-<id>/``, not the shared files it reuses."""
    return sum(
        f.size
        for f in metadata.files()
        if within(f.handle, location) or within(f.handle, dirs.checkpoint)
    )


def register(
    session: Session,
    job_id: str,
    checkpoint_id: int,
    metadata: CheckpointMetadata,
    dirs: SharedDirs,
    *,
    savepoint: bool = False,
) -> int:
    """Record that completed checkpoint ``checkpoint_id`` uses each of its shared files; return
    how many. Run before anything is subsumed in the same transaction, so that a file the new
    checkpoint still uses is never released.

    A reused file (shared, but not under the checkpoint's own ``shared/chk-<id>/``) must be
    registered already, with the same size, by another completed checkpoint of the job: else it
    may be deleted already (its checkpoint was subsumed while this one was pending), and the
    completion is refused with :class:`SharedStateError`. A savepoint must be self-contained: a
    shared file in it is refused too (nothing would keep the file for it)."""
    shared = [f for f in metadata.files() if within(f.handle, dirs.job)]
    kind = "savepoint" if savepoint else "checkpoint"
    if savepoint:
        if shared:
            raise SharedStateError(
                f"job {job_id}: savepoint {checkpoint_id} must be self-contained but refers to "
                f"shared state file {shared[0].handle}"
            )
        return 0
    reused = [f for f in shared if not within(f.handle, dirs.checkpoint)]
    known = registered_sizes(session, job_id, [f.handle for f in reused], but=checkpoint_id)
    for f in reused:
        size = known.get(f.handle)
        if size is None:
            raise SharedStateError(
                f"job {job_id}: {kind} {checkpoint_id} refers to shared state file {f.handle}, "
                "which no retained checkpoint of the job registered (it may be deleted already)"
            )
        if size != f.size:
            raise SharedStateError(
                f"job {job_id}: {kind} {checkpoint_id} refers to shared state file {f.handle} "
                f"as {f.size} bytes; it was registered with {size} bytes"
            )
    if shared:
        session.execute(
            insert(SharedStateRef),
            [
                {
                    "job_id": job_id,
                    "checkpoint_id": checkpoint_id,
                    "handle": f.handle,
                    "size": f.size,
                }
                for f in shared
            ],
        )
    return len(shared)


def registered_sizes(
    session: Session, job_id: str, handles: Sequence[str], *, but: int | None = None
) -> dict[str, int]:
    """Size of each of ``handles`` that a COMPLETED checkpoint of the job (other than ``but``)
    registered; a handle nobody registered is absent."""
    sizes: dict[str, int] = {}
    for chunk in _chunks(sorted(set(handles))):
        query = (
            select(SharedStateRef.handle, SharedStateRef.size)
            .join(
                Checkpoint,
                (Checkpoint.job_id == SharedStateRef.job_id)
                & (Checkpoint.checkpoint_id == SharedStateRef.checkpoint_id),
            )
            .where(
                SharedStateRef.job_id == job_id,
                SharedStateRef.handle.in_(chunk),
                Checkpoint.status == CheckpointStatus.COMPLETED,
            )
        )
        if but is not None:
            query = query.where(SharedStateRef.checkpoint_id != but)
        sizes.update({handle: size for handle, size in session.execute(query)})
    return sizes


def release(session: Session, job_id: str, checkpoint_ids: Collection[int]) -> list[str]:
    """Drop the references of checkpoints leaving the retained set; return the shared files no
    checkpoint refers to any more, sorted: the caller deletes them after the commit."""
    ids = sorted(set(checkpoint_ids))
    if not ids:
        return []
    mine = SharedStateRef.job_id == job_id
    handles = set(
        session.scalars(
            select(SharedStateRef.handle).where(mine, SharedStateRef.checkpoint_id.in_(ids))
        )
    )
    if not handles:
        return []
    session.execute(delete(SharedStateRef).where(mine, SharedStateRef.checkpoint_id.in_(ids)))
    still: set[str] = set()
    for chunk in _chunks(sorted(handles)):
        still.update(
            session.scalars(
                select(SharedStateRef.handle).where(mine, SharedStateRef.handle.in_(chunk))
            )
        )
    return sorted(handles - still)


def reference_counts(session: Session, job_id: str) -> dict[str, int]:
    """Every registered shared file of the job and how many checkpoints use it."""
    rows = session.execute(
        select(SharedStateRef.handle, func.count())
        .where(SharedStateRef.job_id == job_id)
        .group_by(SharedStateRef.handle)
    )
    return {handle: count for handle, count in rows}


def _chunks(items: Sequence[str]) -> Iterator[Sequence[str]]:
    for start in range(0, len(items), CHUNK):
        yield items[start : start + CHUNK]
