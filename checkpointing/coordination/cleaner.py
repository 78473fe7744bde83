"""Deleting checkpoint files (Flink's ``CheckpointsCleaner``, and its
``CheckpointCoordinator.discardSubtaskState`` for acks that did not count).

Every deletion of files a metastore row referred to lives here, and each runs *after* the
metastore transaction that released, aborted or refused what it deletes has committed, so a failed
commit never leaves the metastore pointing at deleted files (two deletions stay where they start:
a trigger that failed before its row existed disposes its fresh location, and a user's discard of
a savepoint is :func:`checkpointing.coordination.savepoints.discard_savepoint`'s, which reports a
failed delete to the user):

* the directory of a checkpoint subsumed, discarded or aborted (``dispose``), as its ids give it
  (:meth:`~checkpointing.state.storage.CheckpointStorage.discard_directory`): a row's
  ``storage_location`` is only compared with it, so a row pointing elsewhere (any driver can
  write rows; a savepoint written to a target directory) deletes nothing;
* an aborted checkpoint's ``shared/chk-<id>/``, where only its own new files lie;
* the shared files a released checkpoint left unreferenced (the shared state registry,
  :mod:`checkpointing.coordination.shared_state`, says which), then the directories they emptied;
* the state files of unknown or late acks (``discard_subtask_state``), only where nothing
  recorded can reference them (a refused ack's files are left alone: its handle is not trusted);
* the ``_metadata`` of a checkpoint aborted while it was being completed.

``dispose`` and ``discard_subtask_state`` log a failed deletion instead of failing their
caller (an ack, a completion, a takeover): a leftover file costs space, a failed call the job.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from pydantic import ValidationError
from sqlalchemy import select

from checkpointing.coordination.failure import CheckpointFailureReason
from checkpointing.coordination.pending import AbortedCheckpoint, TaskAck
from checkpointing.coordination.store import Disposal
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint, CheckpointAck
from checkpointing.state.metadata import ChainedFile
from checkpointing.state.storage import (
    CheckpointStorage,
    FileSystemCheckpointStorage,
    RefusedDeleteError,
    StorageLocation,
)
from checkpointing.status import CheckpointStatus, CheckpointType

log = logging.getLogger(__name__)


class CheckpointsCleaner:
    """Deletes one job's checkpoint files once the metastore no longer needs them."""

    def __init__(self, job_id: str, metastore: Metastore, storage: CheckpointStorage) -> None:
        self.job_id = job_id
        self.metastore = metastore
        self.storage = storage

    def dispose(
        self,
        released: Sequence[Disposal] = (),
        aborted: Sequence[AbortedCheckpoint] = (),
    ) -> None:
        """After the commit that released or aborted them: delete the checkpoints' directories;
        for an aborted (never completed) checkpoint also its ``shared/chk-<id>/``, where only its
        own new files lie and nothing can refer to them; for a released one the shared files no
        retained checkpoint refers to any more, then the ``shared/chk-<m>/`` they emptied."""
        gone = [(d.checkpoint_id, d.checkpoint_type, d.storage_location) for d in released]
        gone += [(a.checkpoint_id, a.checkpoint_type, a.storage_location) for a in aborted]
        for checkpoint_id, checkpoint_type, url in gone:
            self._discard(checkpoint_id, directory_kind(checkpoint_type), url)
        for a in aborted:
            self._discard(a.checkpoint_id, "shared", None)
        root = self.storage.shared_url(self.job_id)
        emptied: set[str] = set()
        for handle in (h for d in released for h in d.shared):
            if handle == root or not self.storage.contains(handle, root):
                log.error("job %s: not deleting %s: outside %s", self.job_id, handle, root)
                continue
            try:
                self.storage.delete(handle)
                emptied.add(handle.rsplit("/", 1)[0])
            except Exception:
                log.exception("job %s: could not delete shared state %s", self.job_id, handle)
        for url in sorted(emptied, reverse=True):
            self._remove_empty_dirs(url, root)

    def _discard(self, checkpoint_id: int, kind: str, recorded: str | None) -> None:
        """Delete the directory the ids give (:meth:`CheckpointStorage.discard_directory`):
        a row's ``recorded`` location is compared, never deleted; a refusal is logged there."""
        try:
            self.storage.discard_directory(self.job_id, checkpoint_id, kind, recorded=recorded)
        except RefusedDeleteError:
            pass  # logged, nothing deleted
        except Exception:
            log.exception(
                "job %s: could not delete the %s directory of checkpoint %d",
                self.job_id,
                kind,
                checkpoint_id,
            )

    def discard_metadata(self, location: StorageLocation) -> None:
        """The ``_metadata`` written for a checkpoint that was aborted before its completion
        could be recorded (nothing refers to it)."""
        self.storage.delete(location.metadata_url)

    def discard_subtask_state(self, checkpoint_id: int, acks: Sequence[TaskAck]) -> list[str]:
        """Delete the state files of UNKNOWN/DISCARDED acks (Flink's ``discardSubtaskState``);
        the handles deleted. Only the ack's own file, inside the location or the
        ``shared/chk-<id>/`` of a checkpoint that is pending or was aborted (never completed,
        never after a metadata write of unknown outcome), never its ``_metadata``, and never a
        file a recorded ack references (as its handle or in its chain). A chain entry is never
        deleted here: it is an earlier checkpoint's file, released by the shared state
        registry."""
        handles = [a.state_handle for a in acks if a.state_handle]
        if not handles:
            return []
        job_id, storage = self.job_id, self.storage
        with self.metastore.transaction() as s:
            row = s.get(Checkpoint, (job_id, checkpoint_id))
            # a checkpoint's own files (in its directory or its shared/chk-<id>) can be
            # referenced only by its own acks: nothing else refers to a checkpoint that never
            # completed
            recorded = s.execute(
                select(CheckpointAck.state_handle, CheckpointAck.state_meta).where(
                    CheckpointAck.job_id == job_id, CheckpointAck.checkpoint_id == checkpoint_id
                )
            ).all()
        referenced = {h for h, _ in recorded if h} | {
            f.handle for _, meta in recorded for f in _chain_of(meta)
        }
        if row is None or row.status not in (CheckpointStatus.PENDING, CheckpointStatus.ABORTED):
            return []
        if row.failure_reason == CheckpointFailureReason.FINALIZE_CHECKPOINT_FAILURE:
            return []  # the metadata may exist: delete nothing (see complete_checkpoint)
        # the directory the ids give, not the row's (any driver can write rows): a handle in a
        # location the row names elsewhere is never deleted
        kind = directory_kind(CheckpointType(row.checkpoint_type))
        location = StorageLocation(storage, storage.owned_directory(job_id, checkpoint_id, kind))
        own_shared = storage.shared_checkpoint_url(job_id, checkpoint_id)
        deleted = []
        for handle in handles:
            owned = location.owns(handle) or (
                handle != own_shared and storage.contains(handle, own_shared)
            )
            if handle in referenced or handle == location.metadata_url or not owned:
                log.warning(
                    "job %s: not deleting %s (referenced or outside %s and %s)",
                    job_id,
                    handle,
                    location.url,
                    own_shared,
                )
                continue
            try:
                storage.delete(handle)
                deleted.append(handle)
            except Exception:
                log.exception("job %s: could not delete rejected state %s", job_id, handle)
        return deleted

    def _remove_empty_dirs(self, url: str, root: str) -> None:
        """Remove ``url`` and its parents below ``root`` while they are empty (a local
        filesystem's directories; object stores have none)."""
        if not isinstance(self.storage, FileSystemCheckpointStorage):
            return
        path, stop = self.storage.path_of(url), self.storage.path_of(root)
        while path != stop and stop in path.parents:
            try:
                path.rmdir()  # only ever an empty one
            except FileNotFoundError:
                pass
            except OSError:
                return  # not empty (or not ours to remove): leave it and its parents
            path = path.parent


def directory_kind(checkpoint_type: CheckpointType | str) -> str:
    """The :meth:`CheckpointStorage.owned_directory` kind of a checkpoint type."""
    if CheckpointType(checkpoint_type) is CheckpointType.CHECKPOINT:
        return "checkpoint"
    return "savepoint"


def _chain_of(state_meta: object) -> list[ChainedFile]:
    """The valid chain entries of a recorded ack's ``state_meta``."""
    chain = state_meta.get("chain") if isinstance(state_meta, Mapping) else None
    files = []
    for entry in chain if isinstance(chain, list) else []:
        try:
            files.append(ChainedFile.model_validate(entry))
        except ValidationError:
            continue
    return files
