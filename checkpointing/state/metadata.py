"""The ``_metadata`` file of a completed checkpoint (Flink's ``CheckpointMetadata``).

JSON, never pickle: it comes from shared storage. The file carries a SHA-256 of its canonical
body, so a reader can tell a corrupt file from a valid one without the metastore; it is parsed and
checked in full before anything is returned, so a corrupt file is reported with its path and never
half-loaded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from datetime import datetime
from types import MappingProxyType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from checkpointing.errors import CorruptSnapshotError
from checkpointing.state.storage import CheckpointStorage

FORMAT = "ckpt-metadata"
VERSION = 2
#: versions this code reads (1: before state descriptors; their fields default to None)
READABLE_VERSIONS = (1, 2)
_ENVELOPE = {"format", "version", "checksum", "body"}
#: ``file_format`` of keyed state written by Spark as key-group-sorted Parquet runs
PARQUET = "parquet"


class ChainedFile(BaseModel):
    """An earlier state file an incremental snapshot builds on (Flink's shared state handle):
    written by an earlier checkpoint under the job's ``shared/`` directory, referenced here."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    handle: str = Field(min_length=1, max_length=2048)
    size: int = Field(ge=0)
    checksum: str | None


#: the longest chain of files one subtask's incremental state may span (a bound on what an
#: ack may send; the runtime materialises a full snapshot long before)
MAX_CHAIN = 64


class StateDescriptor(BaseModel):
    """What a state file holds, sent with the task's ack and kept in ``_metadata``, so that a
    restore can be planned without opening the files."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: keyed state: the inclusive key-group range the file covers, and bytes per non-empty group
    key_groups: tuple[int, int] | None = None
    group_bytes: dict[int, int] | None = None
    #: operator list state (e.g. source splits), redistributed round-robin on rescale
    list_state: list[dict[str, Any]] | None = None
    #: incremental keyed state: the files before this one, oldest first (a full snapshot, then
    #: the changes after it); the subtask's state is their rows then this file's, the last
    #: row of a key winning. ``group_bytes`` counts the bytes of every file.
    chain: list[ChainedFile] | None = Field(default=None, max_length=MAX_CHAIN)
    #: how the chain's files combine (:mod:`checkpointing.state.incremental`): ``replace`` (None:
    #: the last row of a key wins) or ``aggregate`` (each file after the first holds partial
    #: aggregates, merged by the stage's aggregation)
    chain_merge: Literal["replace", "aggregate"] | None = None
    #: key groups this snapshot wrote (all non-empty ones for a full snapshot): informational
    changed_groups: int | None = Field(default=None, ge=0)
    #: the files' format: None, the Arrow snapshot of :mod:`checkpointing.state.snapshot` (a
    #: file per subtask, indexed by key group); ``parquet``, key-group-sorted Parquet runs
    #: written by Spark, a file possibly holding other subtasks' key groups too (read filtered
    #: to ``key_groups``: :mod:`checkpointing.spark.keyed_runs`)
    file_format: Literal["parquet"] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> StateDescriptor:
        if self.key_groups is not None:
            start, end = self.key_groups
            if start < 0 or end < start - 1:
                raise ValueError(f"key_groups {list(self.key_groups)} is not a range")
            outside = [g for g in self.group_bytes or {} if not start <= g <= end]
            if outside:
                raise ValueError(f"group_bytes has key groups {outside[:5]} outside the range")
        elif self.group_bytes:
            raise ValueError("group_bytes needs key_groups")
        if any(n < 0 for n in (self.group_bytes or {}).values()):
            raise ValueError("group_bytes must not be negative")
        if self.chain and self.key_groups is None:
            raise ValueError("chain needs key_groups")
        if self.chain_merge is not None and self.key_groups is None:
            raise ValueError("chain_merge needs key_groups")
        if self.file_format is not None and self.key_groups is None:
            raise ValueError("file_format needs key_groups")
        return self


class SubtaskStateHandle(StateDescriptor):
    subtask_index: int = Field(ge=0)
    attempt_id: str
    #: URL of the subtask's snapshot file; None for a stateless subtask
    handle: str | None
    size: int = Field(ge=0)
    checksum: str | None

    def files(self) -> list[ChainedFile]:
        """Every file of the subtask's state, oldest first: the chain, then its own handle."""
        if self.handle is None:
            return []
        return [
            *(self.chain or []),
            ChainedFile(handle=self.handle, size=self.size, checksum=self.checksum),
        ]


class OperatorState(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    operator_id: str
    parallelism: int = Field(ge=1)
    max_parallelism: int = Field(ge=1)
    subtasks: list[SubtaskStateHandle]


class CheckpointMetadata(BaseModel):
    """Everything needed to restore from a checkpoint without the metastore."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str
    checkpoint_id: int = Field(ge=1)
    checkpoint_type: str
    trigger_at: datetime
    completed_at: datetime
    operators: list[OperatorState]

    @property
    def state_size(self) -> int:
        """Bytes of every file the state spans, shared ones included (Flink's full size)."""
        return sum(f.size for f in self.files())

    def list_items(self, operator_id: str) -> list[dict[str, Any]]:
        """Every list-state item of ``operator_id``, over all its subtasks."""
        return [
            dict(item)
            for op in self.operators
            if op.operator_id == operator_id
            for s in op.subtasks
            for item in (s.list_state or [])
        ]

    def handles(self) -> list[SubtaskStateHandle]:
        return [s for op in self.operators for s in op.subtasks if s.handle]

    def files(self) -> list[ChainedFile]:
        """Every state file, each once: the subtasks' handles and the chains they build on."""
        unique = {f.handle: f for s in self.handles() for f in s.files()}
        return list(unique.values())

    def to_bytes(self) -> bytes:
        body = self.model_dump(mode="json")
        return json.dumps(
            {"format": FORMAT, "version": VERSION, "checksum": _digest(body), "body": body},
            indent=1,
            sort_keys=True,
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes, path: str) -> CheckpointMetadata:
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError) as exc:  # JSON/Unicode errors, huge ints, deep nesting
            raise CorruptSnapshotError(path, f"not valid metadata JSON ({exc})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise CorruptSnapshotError(path, f"not a {FORMAT} file")
        version = doc.get("version")
        if type(version) is not int or version not in READABLE_VERSIONS:  # not True, not 1.0
            raise CorruptSnapshotError(path, f"unsupported metadata version {version!r}")
        if set(doc) != _ENVELOPE:
            raise CorruptSnapshotError(path, f"unexpected fields {sorted(set(doc) - _ENVELOPE)}")
        body = doc.get("body")
        if not isinstance(body, dict) or doc.get("checksum") != _digest(body):
            raise CorruptSnapshotError(path, "metadata checksum mismatch")
        try:
            return cls.model_validate(body)
        except ValidationError as exc:
            raise CorruptSnapshotError(
                path, f"invalid metadata: {exc.errors()[0]['msg']}"
            ) from None


def _digest(body: dict[str, object]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(canonical).hexdigest()


def read_metadata(
    storage: CheckpointStorage,
    url: str,
    checksum: str | None = None,
    *,
    max_size: int | None = None,
) -> CheckpointMetadata:
    """Load and verify a ``_metadata`` file (and its file checksum, when the metastore has one);
    ``max_size`` lowers the read limit (a file given by path, which nothing vouches for)."""
    data = storage.read_bytes(url, checksum=checksum, max_size=max_size)
    return CheckpointMetadata.from_bytes(data, url)


def verify_handles(
    storage: CheckpointStorage,
    metadata: CheckpointMetadata,
    *,
    deep: bool = True,
    roots: tuple[str, ...] = (),
    known_bad: Mapping[str, str] = MappingProxyType({}),
) -> None:
    """Check every state file exists with its recorded size, and (``deep``) its checksum.

    ``known_bad``: files already found unusable (url -> why), e.g. a corrupt shared file while
    verifying a newer checkpoint that uses it too: refused without reading them again.

    With ``roots``, every handle must lie under one of them (the checkpoint's directory, the
    job's shared state): a ``_metadata`` from shared storage must not steer reads elsewhere.
    """
    for h in metadata.files():
        if h.handle in known_bad:
            raise CorruptSnapshotError(h.handle, known_bad[h.handle])
        if roots and not any(storage.contains(h.handle, root) for root in roots):
            raise CorruptSnapshotError(h.handle, "state handle outside the checkpoint's directory")
        if deep:
            storage.read_bytes(h.handle, size=h.size, checksum=h.checksum)
            continue
        size = storage.size_of(h.handle)
        if size is None:
            raise CorruptSnapshotError(h.handle, "file is missing")
        if size != h.size:
            raise CorruptSnapshotError(h.handle, f"size {size} bytes, expected {h.size}")


def subtask_handle(
    subtask_index: int,
    attempt_id: str,
    handle: str | None,
    size: int,
    checksum: str | None,
    state_meta: Mapping[str, Any] | None,
) -> SubtaskStateHandle:
    """The ``_metadata`` entry of one acked subtask: built once when the ack arrives (to refuse
    what would not fit) and again at completion from the recorded ack, the same way."""
    if state_meta is not None and not isinstance(state_meta, Mapping):
        raise ValueError("state_meta must be a JSON object")
    # a descriptor only: no key of its own may stand in for the handle, size or attempt
    descriptor = StateDescriptor.model_validate(state_meta or {})
    return SubtaskStateHandle.model_validate(
        {
            **descriptor.model_dump(exclude_unset=True),
            "subtask_index": subtask_index,
            "attempt_id": attempt_id,
            "handle": handle,
            "size": size,
            "checksum": checksum,
        }
    )
