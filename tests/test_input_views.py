"""The input a checkpoint's runs consumed (``checkpoint_detail``'s ``input``), read back from
source acknowledgements the coordinator recorded, on SQLite and PostgreSQL."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from checkpointing.clock import ManualClock
from checkpointing.errors import UnknownCheckpointError
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.outcome import epochs_done
from checkpointing.metastore.views import checkpoint_detail, consumed_input
from checkpointing.pipeline.splits import InputSplit, processed_item
from checkpointing.state.storage import FileSystemCheckpointStorage
from tests.helpers import JOB, complete, new_coordinator, snapshot

#: a local CSV (size and mtime), an object read as two row-group splits by two runs, and an
#: object still to read; mtime 1_700_000_000.123456789 s is 2023-11-14 22:13:20.123456 UTC
LOCAL = {"path": "/data/in/a.csv", "size": 100, "mtime": 1_700_000_000_123_456_789}
BIG = InputSplit("s3://bucket/in/big.parquet", size=5000, etag="etag-big")
NEW = InputSplit("s3://bucket/in/new.parquet", size=70, etag="etag-new")


def source_state() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The list state of the source's two subtasks, as the runtime writes it."""
    first = [
        {**LOCAL, "epoch": 0, "processed": True, "attempt": "run-1"},
        processed_item(InputSplit(BIG.path, (0, 2), size=5000, etag="etag-big"), 1, "run-1"),
    ]
    second = [
        processed_item(InputSplit(BIG.path, (2, 4), size=5000, etag="etag-big"), 2, "run-2"),
        NEW.to_state(3),
    ]
    return first, second


def checkpoint_with_source_state(
    metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    extra: list[dict[str, Any]] | None = None,
) -> int:
    """A completed checkpoint of job ``JOB`` (two source subtasks, one sink) whose source
    acks carry :func:`source_state` (and ``extra`` items in the second subtask's), through the
    coordinator's real ack path."""
    coordinator = new_coordinator(metastore, storage, ManualClock())
    coordinator.activate()
    complete(coordinator)  # checkpoint 1: no list state
    pending = coordinator.trigger_checkpoint()
    first, second = source_state()
    lists = iter([first, second + (extra or [])])
    acks = []
    for task in pending.tasks:
        ack = snapshot(storage, pending, task)
        if task.operator_id == "source":
            ack = replace(ack, state_meta={"list_state": next(lists)})
        acks.append(ack)
    assert coordinator.receive_acknowledge(pending.checkpoint_id, acks).completed is not None
    return pending.checkpoint_id


def test_runs_totals_and_files_of_a_checkpoint(
    metastore: Metastore, storage: FileSystemCheckpointStorage
) -> None:
    cid = checkpoint_with_source_state(metastore, storage)
    section = consumed_input(metastore, JOB, cid)
    assert section is not None
    assert section["runs"] == [
        {
            "attempt": "run-1",
            "compacted": False,
            "first_epoch": 0,
            "last_epoch": 1,
            "files": 2,
            "splits": 2,
            "bytes": 5100,
        },
        {
            "attempt": "run-2",
            "compacted": False,
            "first_epoch": 2,
            "last_epoch": 2,
            "files": 1,
            "splits": 1,
            "bytes": 5000,
        },
    ]
    assert (section["files_processed"], section["bytes_processed"]) == (2, 5100)
    assert (section["splits_processed"], section["splits_remaining"]) == (3, 1)
    assert (section["files_remaining"], section["files_total"], section["files_omitted"]) == (
        1,
        3,
        0,
    )
    local, big, new = section["files"]
    assert local == {
        "path": "/data/in/a.csv",
        "epochs": [0],
        "size": 100,
        "etag": None,
        "mtime": "2023-11-14T22:13:20.123456+00:00",
        "attempts": ["run-1"],
        "splits": 1,
        "remaining_splits": 0,
    }
    assert (big["epochs"], big["attempts"], big["splits"], big["etag"]) == (
        [1, 2],
        ["run-1", "run-2"],
        2,
        "etag-big",
    )
    assert (new["path"], new["attempts"], new["remaining_splits"]) == (NEW.path, [], 1)
    # the next run starts where the outcome (the operator's XCom) says the checkpoint ends
    with metastore.transaction() as s:
        assert section["next_epoch"] == epochs_done(s, JOB, cid) == 3
    # the detail carries the same section; the checkpoint without list state an empty one
    assert checkpoint_detail(metastore, JOB, cid)["input"] == section
    empty = checkpoint_detail(metastore, JOB, 1)["input"]
    assert empty is not None and empty["runs"] == [] and empty["files_total"] == 0
    assert empty["next_epoch"] is None


def test_static_tables_files_are_listed_apart_and_never_counted_as_input(
    metastore: Metastore, storage: FileSystemCheckpointStorage
) -> None:
    """The files of the static tables the runs joined are items of the source's state without
    an epoch: the section lists them as ``tables``; the files, runs and epochs are as without
    them, and so is the outcome's count of epochs done."""
    plain = consumed_input(metastore, JOB, checkpoint_with_source_state(metastore, storage))
    planes = {"table": "planes", "path": "s3://bucket/planes.parquet", "size": 9, "etag": "p1"}
    codes = {"table": "codes", "path": "/data/codes.csv", "size": 4, "mtime": LOCAL["mtime"]}
    cid = checkpoint_with_source_state(metastore, storage, [planes, codes])
    section = consumed_input(metastore, JOB, cid)
    assert plain is not None and section is not None
    assert section["tables"] == [
        {**codes, "etag": None, "mtime": "2023-11-14T22:13:20.123456+00:00"},
        {**planes, "mtime": None},
    ]
    assert plain["tables"] == []
    assert {k: v for k, v in section.items() if k != "tables"} == {
        k: v for k, v in plain.items() if k != "tables"
    }
    with metastore.transaction() as s:
        assert epochs_done(s, JOB, cid) == 3


def test_the_file_list_is_capped_and_the_rest_counted(
    metastore: Metastore, storage: FileSystemCheckpointStorage
) -> None:
    cid = checkpoint_with_source_state(metastore, storage)
    section = consumed_input(metastore, JOB, cid, file_limit=2)
    assert section is not None
    assert [f["path"] for f in section["files"]] == [LOCAL["path"], BIG.path]  # by first epoch
    assert (section["files_total"], section["files_omitted"]) == (3, 1)
    assert section["files_processed"] == 2  # totals count every file, listed or not


def test_no_source_acknowledgement_is_no_input_section(
    metastore: Metastore, storage: FileSystemCheckpointStorage
) -> None:
    coordinator = new_coordinator(metastore, storage, ManualClock())
    coordinator.activate()
    pending = coordinator.trigger_checkpoint()  # pending: nothing acked yet
    assert checkpoint_detail(metastore, JOB, pending.checkpoint_id)["input"] is None
    sink_only = new_coordinator(
        metastore,
        storage,
        ManualClock(),
        job_id="sink-only",
        plan=[t for t in pending.tasks if t.operator_id == "sink"],
    )
    sink_only.activate()
    done = complete(sink_only)
    assert consumed_input(metastore, "sink-only", done.checkpoint_id) is None
    with pytest.raises(UnknownCheckpointError, match="has no checkpoint 99"):
        consumed_input(metastore, JOB, 99)
