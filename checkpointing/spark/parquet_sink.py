"""Exactly-once two-phase-commit Parquet sink on a local directory (Flink's
``TwoPhaseCommitSinkFunction``): output is *staged* per epoch when it is produced and *committed*
only when a checkpoint covering it completes (``notifyCheckpointComplete``), never at snapshot time.

Layout under the sink directory ``<path>``::

    <path>/_ckpt_sink                   marker: the directory is this sink's (records the job)
    <path>/_staging/epoch-<e>/          staged (pre-committed) output of epoch e, complete
    <path>/changelog/epoch=<e>/         committed output of epoch e (Spark partition discovery;
                                        with ``partition_by``: ``epoch=<e>/col=value/…``)
    <path>/final-<token>/               a published final table (with its own _ckpt_sink)
    <path>/final -> final-<token>       relative symlink to the current final table
    <path>/**/.<name>.<uuid>.inprogress being written (or a symlink being swapped in)
    <path>/**/.<name>.<uuid>.discarded  being deleted

Every visible name appears only whole: Spark writes into a hidden ``.inprogress`` directory, the
files are fsynced, then one ``rename`` publishes it. A staged epoch is committed by renaming it
into ``changelog/``; anything to delete is first renamed to a hidden ``.discarded`` name. The final
table is swapped in by ``os.replace`` of a temporary symlink over ``final``, so a reader of
``<path>/final`` always finds a complete table once the first publish has happened.

The sink deletes only what it created (:mod:`checkpointing.sinks.guard`): the directory is
claimed with the ``_ckpt_sink`` marker on the first write, a directory with other content and no
marker (or another job's marker) is refused, and an old ``final-*`` entry is removed only when it
carries the marker the sink put into every final table it published.

Commit protocol as the runtime uses it: :meth:`TwoPhaseCommitSink.stage` each epoch's changelog
rows; :meth:`~TwoPhaseCommitSink.commit` ``(E)`` once a checkpoint covering epochs <= E completed;
:meth:`~TwoPhaseCommitSink.recover` ``(E)`` on restore (commits what a completed checkpoint covered
but whose commit never ran, discards staged epochs > E, sweeps temp leftovers);
:meth:`~TwoPhaseCommitSink.publish_final` at the end. Commits are idempotent and the first commit
of an epoch wins: re-staging an already committed epoch (e.g. recomputed after a restore from an
older checkpoint) never adds its rows twice; the recomputed copy is dropped.

Limits:

* Local filesystem only (a path or ``file:///`` URL). S3 and other object stores are out of scope
  (they have no atomic directory rename); their URLs are refused with :class:`ConfigError`.
* The directory must be visible at the same path to the driver and every executor (local mode,
  or a shared POSIX mount with atomic rename), and all of ``<path>`` on one filesystem.
* One writer at a time (the runtime's driver). :meth:`recover` deletes temp leftovers, so it must
  not run while another process stages or publishes into the same directory.
* A reader that resolved ``final`` to an older version may lose its files when a later publish
  removes that version after the swap; it must resolve ``final`` again and retry.
* Replacing a staged epoch renames the old copy away before the new one moves in; a crash in
  between leaves that epoch unstaged. Only uncommitted epochs are re-staged, and a restore from a
  checkpoint that does not cover them discards them anyway, so nothing committed is affected.
* All epochs must share one schema; a DataFrame may not have its own ``epoch`` column (that name
  is the partition column of the changelog).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from checkpointing.errors import InvalidIdError, StorageError
from checkpointing.ids import validate_id
from checkpointing.pipeline.spec import EPOCH_COLUMN
from checkpointing.sinks.guard import (
    check_owner,
    claim,
    local_sink_path,
    read_marker,
    write_marker,
)
from checkpointing.state.storage import fsync_dir

STAGING_DIR = "_staging"
CHANGELOG_DIR = "changelog"
FINAL_LINK = "final"

_MAX_EPOCH = 2**63 - 1
_NUMBER = r"(0|[1-9][0-9]{0,18})"
_STAGED = re.compile(rf"epoch-{_NUMBER}", re.ASCII)
_COMMITTED = re.compile(rf"{EPOCH_COLUMN}={_NUMBER}", re.ASCII)
#: the sink's own temp names (:func:`_hidden`): nothing else is swept
_TEMP = re.compile(r"\..+\.[0-9a-f]{32}\.(inprogress|discarded)", re.ASCII | re.DOTALL)


def validate_epoch(value: object, field: str = "epoch") -> int:
    """Epochs are non-negative integers that fit a BIGINT; they become path parts."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_EPOCH:
        raise InvalidIdError(f"invalid {field} {value!r}: expected a non-negative integer")
    return value


class TwoPhaseCommitSink:
    """Stage per epoch, commit on checkpoint completion, publish a final table; see the module
    docstring for the layout and the limits."""

    def __init__(
        self, path: str | Path, job: str | None = None, partition_by: Sequence[str] = ()
    ) -> None:
        """``job``: the job writing (the runtime's); then a directory with foreign content or
        another job's marker is refused here, before anything is written. Without it the sink
        only reads, or writes as no particular job. ``partition_by``: columns whose values
        name Hive-style ``col=value/`` directories in every epoch and in the final table."""
        self.path = local_sink_path(path)
        self.job = job
        self.partition_by = list(partition_by)
        self.staging_dir = self.path / STAGING_DIR
        self.changelog_dir = self.path / CHANGELOG_DIR
        self.final_link = self.path / FINAL_LINK
        self._claimed = False
        if job is not None:
            check_owner(self.path, job)

    def __repr__(self) -> str:
        return f"TwoPhaseCommitSink({str(self.path)!r})"

    # ------------------------------------------------------------------ layout

    def staged_path(self, epoch: int) -> Path:
        return self.staging_dir / f"epoch-{validate_epoch(epoch)}"

    def committed_path(self, epoch: int) -> Path:
        return self.changelog_dir / f"{EPOCH_COLUMN}={validate_epoch(epoch)}"

    def staged_epochs(self) -> list[int]:
        """Epochs staged and not yet committed or discarded, ascending."""
        return _epochs_in(self.staging_dir, _STAGED)

    def committed_epochs(self) -> list[int]:
        """Epochs in the changelog, ascending."""
        return _epochs_in(self.changelog_dir, _COMMITTED)

    def snapshot_state(self, up_to_epoch: int) -> list[dict[str, Any]]:
        """The sink's list state: the staged epochs ``<= up_to_epoch`` (their data is in
        ``_staging/``, found again by epoch on restore)."""
        return [{"epoch": e} for e in self.staged_epochs() if e <= up_to_epoch]

    def recovery_detail(self) -> dict[str, Any] | None:
        return None

    # ------------------------------------------------------------------ phase one

    def stage(self, epoch: int, df: DataFrame) -> None:
        """Write ``df`` as epoch ``epoch``'s staged output, replacing an older staged copy.

        The epoch becomes visible (``staged_epochs``) only once whole; if the write fails, its
        temp directory is removed, an older staged copy stays as it was, and the error propagates.
        """
        epoch = validate_epoch(epoch)
        _check_no_epoch_column(df)
        self._claim()
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        target = self.staged_path(epoch)
        tmp = self.staging_dir / f".{target.name}.{uuid.uuid4().hex}.inprogress"
        _write_parquet(df, tmp, self.partition_by)
        replaced: Path | None = None
        try:
            if target.exists() or target.is_symlink():
                replaced = _hidden(target, ".discarded")
                os.rename(target, replaced)
            os.rename(tmp, target)
            fsync_dir(self.staging_dir)
        except OSError as exc:
            if replaced is not None and not target.exists():
                _rename_quietly(replaced, target)  # put the older staged copy back
            _remove_quietly(tmp)
            raise StorageError(f"cannot stage epoch {epoch} at {target}: {exc}") from exc
        if replaced is not None:
            _remove(replaced)

    # ------------------------------------------------------------------ phase two

    def commit(self, up_to_epoch: int, checkpoint_id: int | None = None) -> list[int]:
        """Commit every staged epoch <= ``up_to_epoch`` (rename into ``changelog/``), ascending.

        Idempotent: an epoch already committed is skipped and its staged copy removed, so a commit
        interrupted halfway (a crash between two renames) is finished by calling it again.
        Returns the epochs committed by this call.
        """
        up_to = validate_epoch(up_to_epoch, "up_to_epoch")
        self._claim()
        committed: list[int] = []
        for epoch in self.staged_epochs():
            if epoch > up_to:
                break
            staged, dest = self.staged_path(epoch), self.committed_path(epoch)
            if dest.exists():
                self._discard(staged)
                continue
            try:
                self.changelog_dir.mkdir(parents=True, exist_ok=True)
                os.rename(staged, dest)
                fsync_dir(self.changelog_dir)
                fsync_dir(self.staging_dir)
            except OSError as exc:
                raise StorageError(f"cannot commit epoch {epoch} to {dest}: {exc}") from exc
            committed.append(epoch)
        return committed

    def recover(
        self,
        checkpoint_epoch: int | None,
        *,
        checkpoint_id: int | None = None,
        state: Sequence[dict[str, Any]] = (),
    ) -> tuple[list[int], list[int]]:
        """Bring the sink in line with a restore from a checkpoint covering epochs <= E.

        Commits staged epochs <= E (their checkpoint completed but the commit never ran), discards
        staged epochs > E (they will be recomputed) and removes temp leftovers of interrupted
        writes and publishes. ``None`` (no checkpoint) discards every staged epoch. Committed
        epochs are never touched. Returns ``(committed now, discarded)``. The staged data is
        found by epoch, so ``checkpoint_id`` and the list ``state`` are not needed here.
        """
        limit = None if checkpoint_epoch is None else validate_epoch(checkpoint_epoch)
        self._claim()
        committed = [] if limit is None else self.commit(limit)
        discarded: list[int] = []
        for epoch in self.staged_epochs():
            if limit is None or epoch > limit:
                self._discard(self.staged_path(epoch))
                discarded.append(epoch)
        self._sweep()
        return committed, discarded

    # ------------------------------------------------------------------ final table

    def publish_final(
        self,
        df: DataFrame,
        token: str,
        files: Sequence[Path] | None = None,
        guard: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
    ) -> str:
        """Write ``df`` as ``final-<token>`` and point ``final`` at it atomically; older
        ``final-*`` tables are removed after the swap. Returns the new table's directory.
        ``files``: Parquet files holding exactly ``df``'s rows (a checkpointed step's), linked
        into the new table instead of writing it again (copied across file systems).

        The token is an idempotency key: if ``final`` already points at ``final-<token>``, nothing
        is written (only older tables are cleaned up). If the write fails, ``final`` is untouched.
        ``guard``: held around the swap (the caller's fencing: a coordinator superseded before
        or while it is entered swaps nothing, and none takes over until the swap is done).
        """
        token = validate_id(token, "final token")
        self._claim()
        name = f"final-{token}"
        target = self.path / name
        if self.final_link.exists() and not self.final_link.is_symlink():
            raise StorageError(
                f"{self.final_link} exists and is not a symlink; refusing to replace"
            )
        current = self._final_target()
        if current is not None and not _is_final_name(current):
            raise StorageError(f"{self.final_link} points at {current!r}; refusing to replace")
        if current == name and target.is_dir():
            self._remove_finals_except(name)
            return str(target)
        if (target.exists() or target.is_symlink()) and not _published_here(target):
            raise StorageError(f"{target} was not published by this sink; refusing to replace")
        tmp = _hidden(target, ".inprogress")
        if files is not None and not self.partition_by:
            _link_parquet(files, tmp)
        else:
            _write_parquet(df, tmp, self.partition_by)
        try:
            write_marker(tmp, {"job": self.job, "token": token})
        except StorageError:
            _remove_quietly(tmp)
            raise
        try:
            if target.exists() or target.is_symlink():
                self._discard(target)  # an earlier attempt of ours that never became current
            with guard() if guard is not None else contextlib.nullcontext():
                os.rename(tmp, target)
                fsync_dir(self.path)
                link = _hidden(self.final_link, ".inprogress")
                os.symlink(name, link)  # relative: the directory can be moved as a whole
                try:
                    os.replace(link, self.final_link)
                except OSError:
                    _remove_quietly(link)
                    raise
                fsync_dir(self.path)
        except OSError as exc:
            _remove_quietly(tmp)
            raise StorageError(f"cannot publish final table {target}: {exc}") from exc
        except BaseException:
            _remove_quietly(tmp)  # refused by the guard: nothing of it stays
            raise
        self._remove_finals_except(name)
        return str(target)

    def reset(self) -> list[int]:
        """:meth:`checkpointing.sinks.protocol.Sink.reset`: the ``final`` link first (readers
        then see no final table), the final tables, the changelog's epochs newest first and the
        staged ones; only in a directory this job claimed."""
        self._claim()
        target = self._final_target()
        if target is not None:
            if not _is_final_name(target):
                raise StorageError(f"{self.final_link} points at {target!r}; refusing to remove")
            os.unlink(self.final_link)
            fsync_dir(self.path)
        self._remove_finals_except(None)
        epochs = self.committed_epochs()
        for epoch in reversed(epochs):
            self._discard(self.committed_path(epoch))
        for epoch in self.staged_epochs():
            self._discard(self.staged_path(epoch))
        self._sweep()
        return epochs

    # ------------------------------------------------------------------ reading

    def read_changelog(self, spark: SparkSession) -> DataFrame:
        """Every committed epoch's rows, once each, with a BIGINT ``epoch`` column."""
        epochs = self.committed_epochs()
        if not epochs:
            raise StorageError(f"no committed epochs under {self.changelog_dir}")
        paths = [_uri(self.committed_path(e)) for e in epochs]
        df = spark.read.option("basePath", _uri(self.changelog_dir)).parquet(*paths)
        return df.withColumn(EPOCH_COLUMN, F.col(EPOCH_COLUMN).cast("bigint"))

    def read_final(self, spark: SparkSession) -> DataFrame:
        """The current final table (the version ``final`` points at when this is called)."""
        name = self._final_target()
        if name is None or not (self.path / name).is_dir():
            raise StorageError(f"no final table published under {self.path}")
        if not _is_final_name(name):
            raise StorageError(f"{self.final_link} points at {name!r}, not at a final-<token>")
        return spark.read.parquet(_uri(self.path / name))

    # ------------------------------------------------------------------ internals

    def _claim(self) -> None:
        """Claim the directory (marker) before the first write; refused if it is not ours."""
        if not self._claimed:
            claim(self.path, self.job)
            self._claimed = True

    def _final_target(self) -> str | None:
        try:
            return os.readlink(self.final_link)
        except OSError:  # missing, or not a symlink
            return None

    def _discard(self, path: Path) -> None:
        """Make ``path`` invisible in one rename, then delete it."""
        trash = _hidden(path, ".discarded")
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StorageError(f"cannot delete {path}: {exc}") from exc
        _remove(trash)

    def _remove_finals_except(self, keep: str | None) -> None:
        if not self.path.is_dir():
            return
        for entry in sorted(self.path.iterdir()):
            if entry.name != keep and _is_final_name(entry.name) and _published_here(entry):
                self._discard(entry)

    def _sweep(self) -> None:
        """Remove temp leftovers of interrupted writes, and final tables ``final`` does not point
        at (published but never swapped in, or not yet cleaned up after a swap)."""
        for directory in (self.staging_dir, self.changelog_dir, self.path):
            if not directory.is_dir():
                continue
            for entry in directory.iterdir():
                if _TEMP.fullmatch(entry.name):
                    _remove(entry)
        current = self._final_target()
        if current is None or _is_final_name(current):  # never guess around a foreign link
            self._remove_finals_except(current)


# ============================================================================ helpers


def _published_here(entry: Path) -> bool:
    """A ``final-<token>`` directory this sink published: a real directory whose marker names
    that token (a user's ``final-report.txt`` or ``final-2024/`` is never one)."""
    if entry.is_symlink() or not entry.is_dir():
        return False
    marker = read_marker(entry)
    return marker is not None and f"final-{marker.get('token')}" == entry.name


def _check_no_epoch_column(df: DataFrame) -> None:
    clash = [f.name for f in df.schema.fields if f.name.lower() == EPOCH_COLUMN]
    if clash:
        raise ValueError(
            f"the sink adds the {EPOCH_COLUMN!r} partition column; the DataFrame already has "
            f"column {clash[0]!r} (rename it)"
        )


def _epochs_in(directory: Path, pattern: re.Pattern[str]) -> list[int]:
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    epochs = []
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match and entry.is_dir(follow_symlinks=False) and int(match[1]) <= _MAX_EPOCH:
            epochs.append(int(match[1]))
    return sorted(epochs)


def _is_final_name(name: str) -> bool:
    if not name.startswith("final-"):
        return False
    try:
        validate_id(name.removeprefix("final-"), "final token")
    except InvalidIdError:
        return False
    return True


def _uri(path: Path) -> str:
    # Not Path.as_uri(): Hadoop's Path would keep its %-escapes literally.
    return "file://" + str(path)


def _hidden(path: Path, suffix: str) -> Path:
    return path.with_name(f".{path.name}.{uuid.uuid4().hex}{suffix}")


def _write_parquet(df: DataFrame, dest: Path, partition_by: Sequence[str] = ()) -> None:
    """Spark writes ``dest`` (a fresh hidden directory), Hive-style partitioned by
    ``partition_by``; the files are fsynced so a later rename publishes durable data. On any
    failure ``dest`` is removed and the error propagates."""
    try:
        writer = df.write.mode("errorifexists")
        if partition_by:
            writer = writer.partitionBy(*partition_by)
        writer.parquet(_uri(dest))
        _fsync_tree(dest)
    except BaseException:
        _remove_quietly(dest)
        raise


def _link_parquet(files: Sequence[Path], dest: Path) -> None:
    """``dest`` (a fresh hidden directory) holding ``files`` under their own names: hard links
    (the files are immutable; a checkpoint's later release leaves the table's link), else
    copies; fsynced as :func:`_write_parquet`'s. On any failure ``dest`` is removed."""
    try:
        dest.mkdir()
        for f in files:
            if f.is_symlink():  # a step's own files are regular files
                raise StorageError(f"{f} is a symbolic link, not a step's file")
            try:
                os.link(f, dest / f.name, follow_symlinks=False)
            except OSError as exc:  # another file system, or links not supported
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EMLINK):
                    raise
                shutil.copyfile(f, dest / f.name)
        (dest / "_SUCCESS").touch()  # as Spark's writer marks a table it wrote
        _fsync_tree(dest)
    except BaseException:
        _remove_quietly(dest)
        raise


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def _remove(path: Path) -> None:
    """Delete a file, symlink or directory tree; missing is fine, other failures are raised."""
    try:
        if path.is_symlink() or path.is_file():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise StorageError(f"cannot delete {path}: {exc}") from exc


def _remove_quietly(path: Path) -> None:
    """Best-effort cleanup while another error is already propagating (``recover`` sweeps)."""
    with contextlib.suppress(StorageError):
        _remove(path)


def _rename_quietly(src: Path, dst: Path) -> None:
    with contextlib.suppress(OSError):
        os.rename(src, dst)
