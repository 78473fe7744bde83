"""Acks describe their state files (key-group range and sizes, list-state items); the
descriptions reach ``_metadata``, from which a rescaled restore is planned without opening any
state file."""

from __future__ import annotations

import json

import pytest

from checkpointing.clock import ManualClock
from checkpointing.coordination.pending import TaskAck
from checkpointing.metastore.engine import Metastore
from checkpointing.restore.assignment import plan_restore, snapshots_from_metadata
from checkpointing.restore.lookup import find_latest_valid
from checkpointing.state.keygroups import KeyGroupRange, key_group_range
from checkpointing.state.metadata import CheckpointMetadata, read_metadata
from checkpointing.state.storage import FileSystemCheckpointStorage
from tests.helpers import make_plan, new_coordinator, snapshot

MAX_P = 16


def test_state_descriptors_flow_from_acks_to_a_rescaled_restore_plan(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    plan = make_plan({"agg": 4, "source": 2})  # max_parallelism 16 in the helpers
    coord = new_coordinator(metastore, storage, clock, plan=plan)
    pending = coord.trigger_checkpoint()
    acks = []
    for task in pending.tasks:
        ack = snapshot(storage, pending, task)
        if task.operator_id == "agg":
            r = key_group_range(MAX_P, 4, task.subtask_index)
            meta = {"key_groups": [r.start, r.end], "group_bytes": {g: 10 * g for g in r}}
        else:
            meta = {"list_state": [{"path": f"day-{task.subtask_index}-{i}", "offset": 0}
                                   for i in range(3)]}  # fmt: skip
        acks.append(TaskAck(ack.attempt_id, ack.state_handle, ack.state_size, ack.checksum,
                            state_meta=meta))  # fmt: skip
    completed = coord.receive_acknowledge(pending.checkpoint_id, acks).completed
    assert completed is not None

    metadata = read_metadata(storage, completed.metadata_path)
    agg = next(op for op in metadata.operators if op.operator_id == "agg")
    assert [s.key_groups for s in agg.subtasks] == [(0, 3), (4, 7), (8, 11), (12, 15)]
    assert agg.subtasks[1].group_bytes == {4: 40, 5: 50, 6: 60, 7: 70}

    decision = find_latest_valid(metastore, storage, "job-a")
    assert decision.metadata == metadata
    restore = plan_restore(
        snapshots_from_metadata(metadata),
        ["agg", "source"],
        new_parallelism={"agg": 3, "source": 1},
        max_parallelism=MAX_P,
    )
    agg_plan = restore.operator("agg")
    assert [s.key_groups for s in agg_plan.subtasks] == [
        KeyGroupRange(0, 5),
        KeyGroupRange(6, 10),
        KeyGroupRange(11, 15),
    ]
    first = agg_plan.subtasks[0]
    assert [(r.key_groups, r.size) for r in first.reads] == [
        (KeyGroupRange(0, 3), 0 + 10 + 20 + 30),
        (KeyGroupRange(4, 5), 40 + 50),
    ]
    assert sum(s.size for s in agg_plan.subtasks) == sum(10 * g for g in range(MAX_P))
    [source] = restore.operator("source").subtasks
    assert len(source.list_state) == 6  # both old subtasks' splits, dealt to the one new one
    json.dumps(restore.to_dict())


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"key_group": [0, 3]}, "Extra inputs are not permitted"),
        ({"key_groups": [4, 2]}, "is not a range"),
        ({"key_groups": [0, 3], "group_bytes": {9: 1}}, "outside the range"),
        ({"group_bytes": {1: 1}}, "group_bytes needs key_groups"),
        ({"key_groups": [0, 3], "group_bytes": {1: -5}}, "must not be negative"),
    ],
)
def test_bad_state_descriptors_are_refused_when_acking(meta: dict, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=message):
        TaskAck("a-0", "file:///x", 1, None, state_meta=meta)


def test_version_1_metadata_is_still_readable() -> None:
    from checkpointing.state.metadata import _digest

    body = {
        "job_id": "j",
        "checkpoint_id": 1,
        "checkpoint_type": "CHECKPOINT",
        "trigger_at": "2026-01-01T00:00:00+00:00",
        "completed_at": "2026-01-01T00:00:01+00:00",
        "operators": [
            {
                "operator_id": "agg",
                "parallelism": 1,
                "max_parallelism": 8,
                "subtasks": [
                    {
                        "subtask_index": 0,
                        "attempt_id": "a",
                        "handle": "file:///s",
                        "size": 3,
                        "checksum": None,
                    }
                ],
            }
        ],
    }
    doc = {"format": "ckpt-metadata", "version": 1, "checksum": _digest(body), "body": body}
    metadata = CheckpointMetadata.from_bytes(json.dumps(doc).encode(), "file:///old/_metadata")
    assert metadata.operators[0].subtasks[0].key_groups is None
    assert list(snapshots_from_metadata(metadata)[0].keyed) == []
