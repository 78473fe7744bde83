"""Flink 1.15+ semantics: the min pause holds back periodic triggers only (a manual checkpoint is
triggered at once, Flink's ``CheckpointRequestDecider``), and a decline carries its reason from
``CheckpointFailureReason``, so a task that is not ready or closing declines without failing the
job. (A savepoint subsuming nothing: ``test_completion``.)"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from checkpointing.cli import app
from checkpointing.clock import ManualClock
from checkpointing.coordination.failure import (
    CheckpointException,
    CheckpointFailureReason,
    TolerableFailuresExceeded,
)
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.views import checkpoint_detail, list_checkpoints
from checkpointing.state.storage import FileSystemCheckpointStorage
from checkpointing.status import CheckpointStatus, RequestStatus
from tests.helpers import (
    JOB,
    ack_all,
    checkpoint_row,
    complete,
    failures_count,
    job_row,
    new_coordinator,
    request_rows,
)

R = CheckpointFailureReason


def test_min_pause_holds_back_periodic_triggers_only(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    coord = new_coordinator(metastore, storage, clock, interval="1h", min_pause="1m")
    coord.start_scheduler()
    complete(coord)  # the min pause now runs for a minute

    with pytest.raises(CheckpointException) as refused:
        coord.trigger_checkpoint(periodic=True)
    assert refused.value.reason is R.MINIMUM_TIME_BETWEEN_CHECKPOINTS
    manual = coord.trigger_checkpoint()  # at once
    assert checkpoint_row(metastore, manual.checkpoint_id).periodic is False

    # a periodic trigger meanwhile is queued (max_concurrent 1); once a slot frees, the queued
    # periodic request still waits for the min pause after the manual one's completion
    with pytest.raises(CheckpointException) as refused:
        coord.trigger_checkpoint(periodic=True)
    assert refused.value.reason is R.TOO_MANY_CONCURRENT_CHECKPOINTS
    assert ack_all(coord, manual).completed is not None
    assert [(r.periodic, r.status) for r in request_rows(metastore)] == [
        (True, RequestStatus.QUEUED)
    ]
    clock.advance(60)
    (periodic,) = coord.process_requests()
    assert checkpoint_row(metastore, periodic.checkpoint_id).periodic is True
    assert failures_count(metastore) == 0


@pytest.mark.parametrize(
    "reason",
    [
        R.CHECKPOINT_DECLINED_TASK_NOT_READY,
        R.CHECKPOINT_DECLINED_TASK_CLOSING,
        R.CHECKPOINT_DECLINED_SUBSUMED,
        R.CHECKPOINT_DECLINED_ON_CANCELLATION_BARRIER,
        R.CHECKPOINT_DECLINED_INPUT_END_OF_STREAM,
    ],
)
def test_a_decline_that_is_no_failure_never_fails_the_job_and_shows_its_reason(
    reason: CheckpointFailureReason,
    metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
) -> None:
    failures: list[TolerableFailuresExceeded] = []
    coord = new_coordinator(metastore, storage, clock, tolerable_failures=0, failures=failures)
    for _ in range(3):
        pending = coord.trigger_checkpoint()
        task = pending.tasks[1]
        assert coord.receive_decline(pending.checkpoint_id, task.attempt_id, reason, "restoring")
        row = checkpoint_row(metastore, pending.checkpoint_id)
        assert (row.status, row.failure_reason) == (CheckpointStatus.ABORTED, reason)
        assert row.failure_message is not None and task.attempt_id in row.failure_message
    assert failures == [] and failures_count(metastore) == 0
    assert job_row(metastore).failure_cause is None

    # the read model (API, UI) and the CLI show the reason
    assert {c["failure_reason"] for c in list_checkpoints(metastore, JOB)} == {reason.value}
    assert checkpoint_detail(metastore, JOB, 1)["failure_reason"] == reason.value
    url = metastore.url.render_as_string(hide_password=False)
    listed = CliRunner().invoke(app, ["--metastore-url", url, "list", JOB, "--json"])
    assert listed.exit_code == 0, listed.output
    assert {r["failure_reason"] for r in json.loads(listed.stdout)} == {reason.value}
    shown = CliRunner().invoke(app, ["--metastore-url", url, "show", JOB, "1"])
    assert shown.exit_code == 0, shown.output
    assert reason.value in shown.stdout.replace("\n", "")


def test_a_failed_snapshot_declines_with_a_counted_reason_and_others_are_refused(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    failures: list[TolerableFailuresExceeded] = []
    coord = new_coordinator(metastore, storage, clock, tolerable_failures=0, failures=failures)
    pending = coord.trigger_checkpoint()
    attempt = pending.tasks[0].attempt_id
    with pytest.raises(ValueError, match="decline reason 'JOB_TERMINATED' is not one of"):
        coord.receive_decline(pending.checkpoint_id, attempt, R.JOB_TERMINATED)
    assert checkpoint_row(metastore, pending.checkpoint_id).status == CheckpointStatus.PENDING

    assert coord.receive_decline(pending.checkpoint_id, attempt, R.CHECKPOINT_ASYNC_EXCEPTION)
    row = checkpoint_row(metastore, pending.checkpoint_id)
    assert row.failure_reason == R.CHECKPOINT_ASYNC_EXCEPTION
    assert failures_count(metastore) == 1 and len(failures) == 1
