"""Exceptions users see. Each message names the field, file or id concerned."""

from __future__ import annotations


class CheckpointingError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigError(CheckpointingError, ValueError):
    """Invalid checkpoint configuration (names the field and the value)."""


class SpecError(ConfigError):
    """A pipeline spec is invalid; the message names the file and the field."""


class InvalidIdError(CheckpointingError, ValueError):
    """An id that would become a path part is unsafe or malformed."""


class MetastoreUnavailable(CheckpointingError):
    """The metastore cannot be reached; nothing was written."""


class SchemaOutdated(CheckpointingError):
    """The metastore schema is missing or older than this code: run ``ckpt db upgrade``."""


class UnknownJobError(CheckpointingError, LookupError):
    """No job with that id in the metastore."""


class UnknownCheckpointError(CheckpointingError, LookupError):
    """No checkpoint with that id for the job."""


class StorageError(CheckpointingError):
    """A snapshot storage operation failed."""


class CorruptSnapshotError(StorageError):
    """A file in checkpoint storage is missing, truncated or fails its checksum (names the path)."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class OutcomeUnknownError(StorageError):
    """A write may or may not have happened (e.g. a timeout after the request was sent).

    Flink's ``PossibleInconsistentStateException``: whoever sees it must not delete anything.
    """


class NoCheckpointError(CheckpointingError, LookupError):
    """Strict restore asked for a checkpoint and the job has no valid one."""


class SharedStateError(CheckpointingError):
    """A completing checkpoint refers to a shared state file that no retained checkpoint of its
    job registered (it may be deleted already): the checkpoint cannot complete (names both)."""


class SparkJvmError(CheckpointingError):
    """A Spark JVM ended the run: the driver's exited or could not be reached, or an executor
    was lost (names which JVM, what the run was doing, and why if known)."""


class SparkMemoryError(SparkJvmError):
    """A Spark JVM ran out of memory: names which (the driver, an executor), what the run was
    doing, and the setting to raise."""
