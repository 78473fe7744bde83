"""Recording a batch of task acks (Flink's ``PendingCheckpoint.acknowledgeTask``).

One transaction per batch, and on PostgreSQL one statement: the checkpoint row is read
``FOR SHARE`` so that an abort waits for in-flight acks, and the acks are inserted with
``ON CONFLICT DO NOTHING ... RETURNING``, so the rows that come back are the SUCCESS ones whatever
races with them (see ``pending``'s module docstring for the whole protocol). Acks are validated
before they get here (``ack_validation``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import cast

from sqlalchemy import String, Table, bindparam, column, select, text
from sqlalchemy.dialects import sqlite
from sqlalchemy.orm import Session

from checkpointing.coordination.pending import CHUNK, AckResult, TaskAck
from checkpointing.metastore.models import Checkpoint, CheckpointAck, CheckpointTask
from checkpointing.status import CheckpointStatus

_checkpoints = cast(Table, Checkpoint.__table__)
_tasks = cast(Table, CheckpointTask.__table__)
_acks = cast(Table, CheckpointAck.__table__)


def acknowledge(
    session: Session, job_id: str, checkpoint_id: int, acks: Sequence[TaskAck], now: datetime
) -> dict[str, AckResult]:
    """Record a batch of acks in one transaction and classify each (Flink's ``acknowledgeTask``).

    An attempt whose ack row this call inserted is SUCCESS, also when the batch repeats it (the
    first of the repeated acks is recorded); a planned attempt whose row was already there, or
    is inserted by a racing caller, is DUPLICATE. On PostgreSQL this is one statement.
    """
    unique: dict[str, TaskAck] = {}
    for ack in acks:
        unique.setdefault(ack.attempt_id, ack)
    attempts = list(unique)
    # a fixed insertion order: two batches sharing attempts cannot deadlock on each other's
    # not-yet-committed rows
    ordered = [unique[a] for a in sorted(attempts)]
    record = _record_pg if session.get_bind().dialect.name == "postgresql" else _record
    row, planned, inserted = record(session, job_id, checkpoint_id, ordered, now)

    if row is None:
        return dict.fromkeys(attempts, AckResult.UNKNOWN)
    status, deadline = row
    if status == CheckpointStatus.ABORTED or (
        status == CheckpointStatus.PENDING and deadline <= now
    ):
        return dict.fromkeys(attempts, AckResult.DISCARDED)
    if status != CheckpointStatus.PENDING:  # completed (or later): every planned task had acked
        return {a: AckResult.DUPLICATE if a in planned else AckResult.UNKNOWN for a in attempts}
    results: dict[str, AckResult] = {}
    for a in attempts:
        if a not in planned:
            results[a] = AckResult.UNKNOWN
        elif a in inserted:
            results[a] = AckResult.SUCCESS
        else:
            results[a] = AckResult.DUPLICATE
    return results


_ACK_COLUMNS = ("state_handle", "state_size", "checksum", "sync_ms", "async_ms", "state_meta")

#: (status, deadline) of the checkpoint, or None; planned attempts; attempts whose ack was inserted
_Recorded = tuple[tuple[str, datetime] | None, set[str], set[str]]


def _record(
    session: Session, job_id: str, checkpoint_id: int, acks: list[TaskAck], now: datetime
) -> _Recorded:
    """Read the checkpoint row ``FOR SHARE`` (SQLite: the transaction already holds the write
    lock), look up which attempts it plans, and — if it is PENDING and not overdue — insert
    their acks with ``ON CONFLICT DO NOTHING ... RETURNING``."""
    row = session.execute(
        select(_checkpoints.c.status, _checkpoints.c.deadline_at)
        .where(_checkpoints.c.job_id == job_id, _checkpoints.c.checkpoint_id == checkpoint_id)
        .with_for_update(read=True)
    ).one_or_none()
    if row is None:
        return None, set(), set()
    attempts = [a.attempt_id for a in acks]
    planned: set[str] = set()
    for i in range(0, len(attempts), CHUNK):
        planned.update(
            session.scalars(
                select(_tasks.c.attempt_id).where(
                    _tasks.c.job_id == job_id,
                    _tasks.c.checkpoint_id == checkpoint_id,
                    _tasks.c.attempt_id.in_(attempts[i : i + CHUNK]),
                )
            )
        )
    status, deadline = row
    inserted: set[str] = set()
    rows = [
        {
            "job_id": job_id,
            "checkpoint_id": checkpoint_id,
            "attempt_id": a.attempt_id,
            **{c: getattr(a, c) for c in _ACK_COLUMNS},
            "acked_at": now,
        }
        for a in acks
        if a.attempt_id in planned
    ]
    if status == CheckpointStatus.PENDING and deadline > now and rows:
        stmt = (
            sqlite.insert(_acks)
            .on_conflict_do_nothing(index_elements=["job_id", "checkpoint_id", "attempt_id"])
            .returning(_acks.c.attempt_id)
        )
        for i in range(0, len(rows), CHUNK):
            inserted.update(session.scalars(stmt, rows[i : i + CHUNK]))
    return (status, deadline), planned, inserted


#: PostgreSQL: ``_record`` in one statement, the batch passed as arrays (a handful of parameters
#: however large the batch). ``cp`` takes the share lock: the insert's one-time filter on it runs
#: before any row is inserted, and under READ COMMITTED a concurrent abort or completion is
#: waited for and its committed row version is the one seen. Rows are inserted in array order.
#: The result is tagged rows, no join (whose plan would hinge on statistics): ``c`` the
#: checkpoint's status and deadline (absent: no such checkpoint), ``p`` each planned attempt of
#: the batch, ``i`` each attempt whose ack was inserted.
_PG_RECORD = (
    text(
        """
        WITH cp AS MATERIALIZED (
            SELECT status, deadline_at
            FROM ckpt_checkpoints
            WHERE job_id = :job_id AND checkpoint_id = :checkpoint_id
            FOR SHARE
        ),
        planned AS MATERIALIZED (
            SELECT attempt_id
            FROM ckpt_checkpoint_tasks
            WHERE job_id = :job_id AND checkpoint_id = :checkpoint_id
              AND attempt_id = ANY(CAST(:attempt_id AS varchar[]))
        ),
        ins AS (
            INSERT INTO ckpt_checkpoint_acks
                (job_id, checkpoint_id, attempt_id, state_handle, state_size, checksum,
                 sync_ms, async_ms, state_meta, acked_at)
            SELECT :job_id, :checkpoint_id, a.attempt_id, a.state_handle, a.state_size,
                   a.checksum, a.sync_ms, a.async_ms, CAST(a.state_meta AS jsonb), :now
            FROM unnest(
                CAST(:attempt_id AS varchar[]), CAST(:state_handle AS varchar[]),
                CAST(:state_size AS bigint[]), CAST(:checksum AS varchar[]),
                CAST(:sync_ms AS integer[]), CAST(:async_ms AS integer[]),
                CAST(:state_meta AS text[])
            ) WITH ORDINALITY
                AS a(attempt_id, state_handle, state_size, checksum, sync_ms, async_ms,
                     state_meta, n)
            WHERE a.attempt_id IN (SELECT attempt_id FROM planned)
              AND EXISTS (
                  SELECT FROM cp WHERE cp.status = :pending AND cp.deadline_at > :now
              )
            ORDER BY a.n
            ON CONFLICT (job_id, checkpoint_id, attempt_id) DO NOTHING
            RETURNING attempt_id
        )
        SELECT 'c' AS tag, CAST(status AS varchar) AS value, deadline_at FROM cp
        UNION ALL
        SELECT 'p', CAST(attempt_id AS varchar), NULL FROM planned
        UNION ALL
        SELECT 'i', CAST(attempt_id AS varchar), NULL FROM ins
        """
    )
    .bindparams(
        bindparam("job_id", type_=_checkpoints.c.job_id.type),
        bindparam("checkpoint_id", type_=_checkpoints.c.checkpoint_id.type),
        bindparam("now", type_=_checkpoints.c.deadline_at.type),
        bindparam("pending", type_=_checkpoints.c.status.type),
    )
    .columns(
        column("tag", String),
        column("value", String),
        column("deadline_at", _checkpoints.c.deadline_at.type),
    )
)


def _record_pg(
    session: Session, job_id: str, checkpoint_id: int, acks: list[TaskAck], now: datetime
) -> _Recorded:
    params: dict[str, object] = {
        "job_id": job_id,
        "checkpoint_id": checkpoint_id,
        "now": now,
        "pending": CheckpointStatus.PENDING.value,
        "attempt_id": [a.attempt_id for a in acks],
        **{c: [getattr(a, c) for a in acks] for c in _ACK_COLUMNS},
        "state_meta": [None if a.state_meta is None else json.dumps(a.state_meta) for a in acks],
    }
    row: tuple[str, datetime] | None = None
    planned: set[str] = set()
    inserted: set[str] = set()
    for tag, value, deadline in session.execute(_PG_RECORD, params):
        if tag == "c":
            row = (value, deadline)
        elif tag == "p":
            planned.add(value)
        else:
            inserted.add(value)
    return row, planned, inserted
