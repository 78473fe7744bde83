"""Validation of identifiers that become parts of storage paths.

Job ids, operator ids and attempt ids come from specs, the CLI and task processes, and they end
up inside file and S3 paths. Anything that could escape the job's directory is refused here.
"""

from __future__ import annotations

import re

from checkpointing.errors import InvalidIdError

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: the pattern of a path-safe id (job, attempt, operator), for JSON schemas and UI forms; ``..``
#: is refused on top of it
ID_PATTERN = _ID.pattern
_CHECKPOINT_ID = re.compile(r"[1-9][0-9]{0,18}", re.ASCII)
_MAX_ID = 2**63 - 1


def validate_id(value: object, field: str) -> str:
    """Return ``value`` if it is a safe single path segment, else raise naming ``field``."""
    if not isinstance(value, str):
        raise InvalidIdError(f"{field} must be a string, got {type(value).__name__}")
    if not _ID.fullmatch(value) or ".." in value:
        raise InvalidIdError(
            f"invalid {field} {value!r}: use 1-128 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit, without '..'"
        )
    return value


def validate_checkpoint_id(value: object, field: str = "checkpoint id") -> int:
    """Checkpoint ids are positive integers that fit a BIGINT (Flink's ``long``)."""
    if isinstance(value, str) and _CHECKPOINT_ID.fullmatch(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_ID:
        raise InvalidIdError(f"invalid {field} {value!r}: expected a positive integer")
    return value
