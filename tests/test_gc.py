"""``ckpt gc`` and savepoint housekeeping (issue 25): history built with the coordinator API on
SQLite and PostgreSQL, files on local storage and moto's S3. gc keeps exactly what a restore
needs (a restore after it still verifies), deletes what it should, a dry run deletes nothing, an
active job and bad options are refused before anything is deleted."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from checkpointing.cli import app
from checkpointing.clock import ManualClock
from checkpointing.coordination import heartbeat, shared_state
from checkpointing.coordination.gc import GcOptions, JobActiveError, list_savepoints, run_gc
from checkpointing.coordination.heartbeat import beat
from checkpointing.coordination.pending import TaskAck
from checkpointing.coordination.sink_vacuum import plan_vacuum
from checkpointing.errors import ConfigError, UnknownJobError
from checkpointing.metastore import jobs
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import CheckpointAck, CheckpointTask
from checkpointing.restore.lookup import find_latest_valid, record_restore
from checkpointing.state.s3_storage import S3CheckpointStorage
from checkpointing.state.storage import CheckpointStorage
from checkpointing.status import CheckpointStatus as S
from checkpointing.status import CheckpointType, JobStatus
from tests.helpers import (
    JOB,
    ack_all,
    complete,
    make_plan,
    new_coordinator,
    request_rows,
    restore_rows,
    statuses,
)

DAY = timedelta(days=1)


def _clocks() -> tuple[ManualClock, ManualClock]:
    """The job's clock, 40 days back, and gc's, two hours ahead of the files' real mtimes (so
    that a 1 h grace has passed for every file written now)."""
    now = datetime.now(UTC)
    return ManualClock(now - 40 * DAY), ManualClock(now + timedelta(hours=2))


def _children(metastore: Metastore, ids: list[int]) -> int:
    with metastore.transaction() as s:
        return sum(
            s.scalar(
                select(func.count()).select_from(m).where(m.job_id == JOB, m.checkpoint_id.in_(ids))
            )
            or 0
            for m in (CheckpointTask, CheckpointAck)
        )


def _plant(storage: CheckpointStorage, *names: str) -> dict[str, str]:
    root = storage.job_url(JOB)
    return {n: storage.write_bytes(f"{root}/{n}", b"x" * 100).url for n in names}


def _history(metastore: Metastore, storage: CheckpointStorage, clock: ManualClock) -> Any:
    """Savepoint 1 and checkpoint 2 from requests, checkpoints 3-5, an aborted 6 and two
    restores, 40 days ago; 35 days later checkpoint 7 (subsuming 4 then: recent history)."""
    coord = new_coordinator(metastore, storage, clock, retained=2, max_concurrent=2)
    for kind in (CheckpointType.SAVEPOINT, CheckpointType.CHECKPOINT):
        coord.request(kind, requested_by="test", forced=True)
        [pending] = coord.process_requests()
        assert ack_all(coord, pending).completed is not None
    for _ in range(3):
        complete(coord)
    coord.trigger_checkpoint()
    coord.failover("gone")
    for attempt in ("a1", "a2"):
        decision = find_latest_valid(metastore, storage, JOB)
        record_restore(metastore, decision, attempt=attempt, clock=clock)
    clock.advance(35 * DAY)
    complete(coord)
    return coord


def test_gc_prunes_old_history_and_orphans_and_keeps_what_a_restore_needs(
    metastore: Metastore, storage: CheckpointStorage
) -> None:
    clock, gc_clock = _clocks()
    _history(metastore, storage, clock)
    assert statuses(metastore) == {
        1: S.COMPLETED, 2: S.SUBSUMED, 3: S.SUBSUMED, 4: S.SUBSUMED, 5: S.COMPLETED,
        6: S.ABORTED, 7: S.COMPLETED,
    }  # fmt: skip
    files = _plant(
        storage,
        "chk-3/late-ack",  # a subsumed checkpoint's late write: orphan
        "chk-6/_metadata",  # an aborted one's: orphan
        "shared/chk-2/state.arrow",  # registered by no checkpoint: orphan
        "savepoints/savepoint-4/x",  # no savepoint 4: orphan
        "chk-5/extra",  # inside a retained checkpoint: kept
        "chk-99/in-flight",  # an id not handed out yet: kept
        "notes/readme.txt",  # not a name gc knows: kept
    )
    orphan_names = ("chk-3/late-ack", "chk-6/_metadata", "shared/chk-2/state.arrow")
    orphans = [files[n] for n in (*orphan_names, "savepoints/savepoint-4/x")]
    before = (statuses(metastore), len(request_rows(metastore)), len(restore_rows(metastore)))

    dry = run_gc(metastore, storage, JOB, GcOptions(), dry_run=True, clock=gc_clock)
    assert (dry.checkpoints, dry.tasks, dry.acks) == ([2, 3, 6], 9, 6)
    assert (len(dry.requests), len(dry.restores)) == (1, 1)
    assert sorted(f.url for f in dry.orphans) == sorted(orphans)
    assert dry.orphan_bytes == 400
    after_dry = (statuses(metastore), len(request_rows(metastore)), len(restore_rows(metastore)))
    assert after_dry == before
    assert all(storage.exists(u) for u in files.values())

    done = run_gc(metastore, storage, JOB, GcOptions(), clock=gc_clock)
    assert done.checkpoints == [2, 3, 6] and not done.errors
    assert statuses(metastore) == {1: S.COMPLETED, 4: S.SUBSUMED, 5: S.COMPLETED, 7: S.COMPLETED}
    assert _children(metastore, [2, 3, 6]) == 0 and _children(metastore, [5, 7]) > 0
    # the savepoint's request stays (its checkpoint names it), checkpoint 2's went
    assert [r.checkpoint_id for r in request_rows(metastore)] == [1]
    assert [r.attempt for r in restore_rows(metastore)] == ["a2"]  # the latest stays
    assert not any(storage.exists(u) for u in orphans)
    assert all(storage.exists(files[n]) for n in ("chk-5/extra", "chk-99/in-flight",
                                                  "notes/readme.txt"))  # fmt: skip
    restored = find_latest_valid(metastore, storage, JOB, deep=True, strict=True)
    assert restored.checkpoint_id == 7
    # a second run finds nothing more
    again = run_gc(metastore, storage, JOB, GcOptions(), clock=gc_clock)
    assert (again.checkpoints, again.requests, again.restores, again.orphans) == ([], [], [], [])


def test_a_shared_file_a_retained_checkpoint_builds_on_survives_gc(
    metastore: Metastore, storage: CheckpointStorage
) -> None:
    clock, gc_clock = _clocks()
    coord = new_coordinator(metastore, storage, clock, plan=make_plan({"agg": 1}), retained=1)

    def checkpoint(chain: list[dict[str, Any]]) -> dict[str, Any]:
        pending = coord.trigger_checkpoint()
        [task] = pending.tasks
        own = storage.shared_checkpoint_url(JOB, pending.checkpoint_id)
        info = storage.write_bytes(f"{own}/agg-0.arrow", bytes(50))
        new = {"handle": info.url, "size": info.size, "checksum": info.checksum}
        meta = {"key_groups": [0, 15], "group_bytes": {0: 50 + sum(c["size"] for c in chain)}}
        if chain:
            meta["chain"] = chain
        ack = TaskAck(task.attempt_id, info.url, info.size, info.checksum, state_meta=meta)
        assert coord.receive_acknowledge(pending.checkpoint_id, [ack]).completed is not None
        return new

    first = checkpoint([])
    second = checkpoint([first])  # subsumes 1, keeps building on its file
    junk = _plant(storage, "shared/chk-1/never-registered")["shared/chk-1/never-registered"]
    clock.advance(35 * DAY)

    plan = run_gc(metastore, storage, JOB, GcOptions(), clock=gc_clock)
    assert plan.checkpoints == [1]  # its row goes, its registered file stays
    assert [f.url for f in plan.orphans] == [junk]
    assert storage.exists(first["handle"]) and not storage.exists(junk)
    with metastore.transaction() as s:
        counts = shared_state.reference_counts(s, JOB)
    assert counts == {first["handle"]: 1, second["handle"]: 1}
    assert find_latest_valid(metastore, storage, JOB, deep=True, strict=True).checkpoint_id == 2


def test_the_grace_period_keeps_fresh_files(
    metastore: Metastore, storage: CheckpointStorage
) -> None:
    clock, _ = _clocks()
    coord = new_coordinator(metastore, storage, clock)
    complete(coord)
    complete(coord)
    fresh = _plant(storage, "chk-1/late")["chk-1/late"]
    now = ManualClock(datetime.now(UTC))
    assert (
        run_gc(metastore, storage, JOB, GcOptions(grace=timedelta(hours=1)), clock=now).orphans
        == []
    )
    assert storage.exists(fresh)
    plan = run_gc(metastore, storage, JOB, GcOptions(grace=timedelta(0)), clock=now)
    assert [f.url for f in plan.orphans] == [fresh] and not storage.exists(fresh)


def test_gc_on_s3_deletes_orphans_and_a_restore_still_verifies(
    metastore: Metastore, s3_bucket: str
) -> None:
    storage = S3CheckpointStorage(f"s3://{s3_bucket}/ckpt")
    clock, gc_clock = _clocks()
    coord = new_coordinator(metastore, storage, clock, retained=1)
    for _ in range(3):
        complete(coord)
    files = _plant(storage, "chk-1/late", "shared/chk-2/x", "chk-3/extra", "other/y")
    plan = run_gc(metastore, storage, JOB, GcOptions(), dry_run=True, clock=gc_clock)
    assert sorted(f.url for f in plan.orphans) == sorted(
        [files["chk-1/late"], files["shared/chk-2/x"]]
    )
    assert all(storage.exists(u) for u in files.values())
    run_gc(metastore, storage, JOB, GcOptions(), clock=gc_clock)
    assert [
        storage.exists(files[n]) for n in ("chk-1/late", "shared/chk-2/x", "chk-3/extra", "other/y")
    ] == [False, False, True, True]
    assert find_latest_valid(metastore, storage, JOB, deep=True, strict=True).checkpoint_id == 3


def test_savepoints_are_listed_and_expired_by_count_and_age(
    metastore: Metastore, storage: CheckpointStorage
) -> None:
    clock, gc_clock = _clocks()
    coord = new_coordinator(metastore, storage, clock)
    complete(coord, savepoint=True)  # 1
    clock.advance(20 * DAY)
    complete(coord, savepoint=True)  # 2
    complete(coord)  # 3
    clock.advance(10 * DAY)
    complete(coord, savepoint=True)  # 4
    complete(coord)  # 5
    listed = list_savepoints(metastore, JOB, clock=gc_clock)
    assert [(s.checkpoint_id, s.age.days) for s in listed] == [(4, 10), (2, 20), (1, 40)]
    assert all(s.size > 0 for s in listed)

    result = CliRunner().invoke(
        app, ["--metastore-url", metastore.url.render_as_string(hide_password=False),
              "savepoints", JOB, "--json"]
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert [r["checkpoint_id"] for r in json.loads(result.stdout)] == [4, 2, 1]
    assert json.loads(result.stdout)[2]["age_seconds"] > 40 * 86400
    result = CliRunner().invoke(
        app, ["--metastore-url", metastore.url.render_as_string(hide_password=False),
              "savepoints", JOB]
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "40d" in result.stdout  # by the wall clock
    # the path is never cut: folded over lines (a long path), its pieces join to the whole
    folded = "".join(
        line.split("│")[-2].strip() for line in result.stdout.splitlines() if line.count("│") > 2
    )
    assert all(s.location in folded for s in listed), result.stdout

    by_age = GcOptions(savepoint_max_age=30 * DAY)
    plan = run_gc(metastore, storage, JOB, by_age, dry_run=True, clock=gc_clock)
    assert [s.checkpoint_id for s in plan.savepoints] == [1]
    plan = run_gc(metastore, storage, JOB, GcOptions(keep_savepoints=1), clock=gc_clock)
    assert [s.checkpoint_id for s in plan.savepoints] == [2, 1]
    assert statuses(metastore)[1] == statuses(metastore)[2] == S.DISCARDED
    assert not storage.list_files(listed[2].location) and storage.list_files(listed[0].location)
    # the savepoint a restore would pick now is never expired: savepoint 6, newer than checkpoint 5
    complete(coord, savepoint=True)
    assert find_latest_valid(metastore, storage, JOB).checkpoint_id == 6
    plan = run_gc(metastore, storage, JOB, GcOptions(keep_savepoints=0), clock=gc_clock)
    assert [s.checkpoint_id for s in plan.savepoints] == [4]
    assert [s.checkpoint_id for s in list_savepoints(metastore, JOB)] == [6]


def test_a_driver_heartbeats_while_it_runs_and_a_metastore_outage_does_not_stop_it(
    metastore: Metastore, storage: CheckpointStorage
) -> None:
    """The heartbeat thread stamps the job row on entry and every interval, stops on exit, and
    a beat that fails (the metastore away) is retried at the next one."""
    clock, _ = _clocks()
    coord = new_coordinator(metastore, storage, clock)
    coord.activate()
    stamps: list[datetime] = []
    ticks = iter(range(1_000))
    real_beat = heartbeat.beat

    def flaky(*args: Any) -> bool:
        if next(ticks) == 1:
            raise OSError("metastore away")
        stamps.append(args[-1])
        return real_beat(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(heartbeat, "beat", flaky)
        beating = heartbeat.Heartbeat(
            metastore, JOB, coord.coordinator_id, interval=timedelta(milliseconds=20)
        )
        with beating:
            deadline = time.monotonic() + 10
            while len(stamps) < 4 and time.monotonic() < deadline:
                time.sleep(0.01)
        after = len(stamps)
    assert after >= 4 and stamps == sorted(stamps)
    assert jobs.get_job(metastore, JOB).heartbeat_at == stamps[-1]  # type: ignore[union-attr]
    # stopped with the block: its thread has ended, so no beat can follow (no sleep to wait out)
    assert not beating._thread.is_alive() and len(stamps) == after


def test_an_active_job_unknown_job_and_bad_options_are_refused_before_deleting(
    metastore: Metastore, storage: CheckpointStorage
) -> None:
    clock, gc_clock = _clocks()
    coord = new_coordinator(metastore, storage, clock)
    complete(coord)
    complete(coord)
    orphan = _plant(storage, "chk-1/late")["chk-1/late"]
    coord.activate()
    coord.job_status_changed(JobStatus.RUNNING)
    with pytest.raises(JobActiveError, match="RUNNING"):  # no heartbeat yet: not known dead
        run_gc(metastore, storage, JOB, GcOptions(), clock=gc_clock)
    assert storage.exists(orphan)
    # the driver beats (a superseded one's beat does not count); fresh: still refused
    assert not beat(metastore, JOB, "coord-old", gc_clock.now())
    assert jobs.get_job(metastore, JOB).heartbeat_at is None  # type: ignore[union-attr]
    assert beat(metastore, JOB, coord.coordinator_id, gc_clock.now() - timedelta(minutes=4))
    with pytest.raises(JobActiveError, match="last heartbeat"):
        run_gc(metastore, storage, JOB, GcOptions(), clock=gc_clock)
    assert storage.exists(orphan)
    # its driver stopped beating 6 minutes ago (SIGKILLed: the status stayed RUNNING): dead
    assert beat(metastore, JOB, coord.coordinator_id, gc_clock.now() - timedelta(minutes=6))
    assert run_gc(metastore, storage, JOB, GcOptions(), clock=gc_clock).orphans
    assert not storage.exists(orphan)
    orphan = _plant(storage, "chk-1/late")["chk-1/late"]
    assert beat(metastore, JOB, coord.coordinator_id, gc_clock.now())
    with pytest.raises(UnknownJobError):
        run_gc(metastore, storage, "nope", GcOptions(), clock=gc_clock)
    with pytest.raises(ConfigError, match="--grace must not be negative"):
        GcOptions(grace=-timedelta(hours=1))
    with pytest.raises(ConfigError, match="--keep-savepoints"):
        GcOptions(keep_savepoints=-1)

    url = metastore.url.render_as_string(hide_password=False)
    runner = CliRunner(env={"CKPT_STORAGE_ROOTS": storage.base_url})  # the job row's: allowed
    for args, code, message in [
        (["gc", JOB], 1, "is RUNNING"),
        (["gc", "nope"], 1, "unknown job 'nope'"),
        (["gc", JOB, "--grace", "-1h"], 2, "negative"),
        (["gc", JOB, "--keep-history", "soon"], 2, "--keep-history"),
        (["gc", JOB, "--keep-savepoints", "-1"], 2, "--keep-savepoints"),
    ]:
        result = runner.invoke(app, ["--metastore-url", url, *args])
        assert result.exit_code == code, (args, result.output)
        assert message in result.output, (args, result.output)
    assert storage.exists(orphan)

    gc = ["--metastore-url", url, "gc", JOB, "--force", "--grace", "0s"]
    result = runner.invoke(app, [*gc, "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "would delete 0 savepoint(s) (0 B), 1 orphan file(s) (100 B)" in result.stdout
    assert orphan in result.stdout and storage.exists(orphan)
    result = runner.invoke(app, [*gc, "--json"])
    assert result.exit_code == 0, result.output
    assert [o["url"] for o in json.loads(result.stdout)["orphans"]] == [orphan]
    assert not storage.exists(orphan)


def test_the_jobs_savepoint_retention_is_stored_and_applied_by_gc(
    metastore: Metastore, storage: CheckpointStorage
) -> None:
    from checkpointing.config import CheckpointConfig, SavepointRetention
    from checkpointing.metastore.jobs import require_job

    with pytest.raises(ConfigError, match=r"savepoint_retention\.count"):
        CheckpointConfig.parse({"savepoint_retention": {"count": -1}})
    with pytest.raises(ConfigError, match=r"savepoint_retention\.max_age: must not be negative"):
        CheckpointConfig.parse({"savepoint_retention": {"max_age": "-1d"}})
    clock, gc_clock = _clocks()
    coord = new_coordinator(
        metastore, storage, clock, savepoint_retention={"count": 3, "max_age": "39d"}
    )
    stored = require_job(metastore, JOB).config.savepoint_retention
    assert stored == SavepointRetention(count=3, max_age=39 * DAY)
    for _ in range(4):  # savepoints 1-4, a day apart: 40, 39, 38 and 37 days old (and 2 h)
        complete(coord, savepoint=True)
        clock.advance(DAY)
    complete(coord)  # 5: what a restore picks
    plan = run_gc(metastore, storage, JOB, GcOptions(), clock=gc_clock)
    assert [s.checkpoint_id for s in plan.savepoints] == [2, 1]  # 1 beyond the count, 2 too old
    # an option overrides the configuration for one run
    plan = run_gc(metastore, storage, JOB, GcOptions(keep_savepoints=1), clock=gc_clock)
    assert [s.checkpoint_id for s in plan.savepoints] == [3]
    assert [s.checkpoint_id for s in list_savepoints(metastore, JOB)] == [4]


def test_vacuum_sink_deletes_only_the_sinks_files_no_retained_checkpoint_can_restore(
    metastore: Metastore, storage: CheckpointStorage, tmp_path: Any
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from deltalake import DeltaTable

    from checkpointing.sinks import delta_log
    from checkpointing.sinks.delta_files import DataFile, file_name

    clock, gc_clock = _clocks()
    coord = new_coordinator(metastore, storage, clock, retained=2)
    url = f"file://{tmp_path / 'table'}"
    schema = pa.schema([("k", pa.string()), ("v", pa.int64())])
    table = delta_log.create_table(url, JOB, "upsert", schema, 1)
    names, previous = [], {}
    for epoch in range(4):  # checkpoints 1-4, each rewriting the one bucket file (versions 1-4)
        cid = complete(coord).checkpoint_id
        name = file_name(JOB, epoch, "g", 0)
        pq.write_table(
            pa.table({"k": ["a"], "v": [epoch]}, schema=schema), tmp_path / "table" / name
        )
        size = (tmp_path / "table" / name).stat().st_size
        adds = [DataFile(epoch, 0, name, size, 1)]
        delta_log.commit_files(
            table, url, job=JOB, checkpoint_id=cid, epoch=epoch, epochs=[epoch], adds=adds,
            removes=previous, schema=table.schema(),
        )  # fmt: skip
        names.append(name)
        previous = {name: size}
    staged = file_name(JOB, 4, "g", 0)  # written for a commit still to come: not in the log
    (tmp_path / "table" / staged).write_bytes(b"staged")
    (tmp_path / "table" / "someone-elses.parquet").write_bytes(b"x")

    options = GcOptions(vacuum_sink=url)
    plan = run_gc(metastore, storage, JOB, options, dry_run=True, clock=gc_clock)
    assert [f.name for f in plan.sink_files] == sorted(names[:2]) and plan.sink_bytes > 0
    assert all((tmp_path / "table" / n).exists() for n in names)
    run_gc(metastore, storage, JOB, options, clock=gc_clock)
    kept = sorted(p.name for p in (tmp_path / "table").iterdir() if p.suffix == ".parquet")
    assert kept == sorted([*names[2:], staged, "someone-elses.parquet"])
    # the retained checkpoints' versions still restore: checkpoint 3's is version 3
    state = delta_log.state_for_checkpoint(DeltaTable(url), 3)
    assert state.version == 3
    delta_log.restore_table(DeltaTable(url), url, JOB, state)
    assert DeltaTable(url).to_pyarrow_table().to_pydict() == {"k": ["a"], "v": [2]}
    # another job's table is refused, naming it, before anything is deleted
    with pytest.raises(ConfigError, match="not of job 'job-b'"):
        plan_vacuum(metastore, "job-b", url)


def test_a_starting_detached_driver_and_the_savepoint_it_restores_are_left_alone(
    metastore: Metastore, storage: CheckpointStorage
) -> None:
    """Issue 38: a deploy from savepoint 1 recorded its restore decision and submitted a
    detached driver, which is still starting (status CREATED, no heartbeat): gc refuses the
    job as active, and even forced it keeps savepoint 1, which the driver is about to read."""
    from checkpointing.coordination.drivers import DriverIdentity, record_driver
    from checkpointing.restore.lookup import load_checkpoint

    clock, gc_clock = _clocks()
    coord = new_coordinator(metastore, storage, clock)
    complete(coord, savepoint=True)  # 1
    complete(coord, savepoint=True)  # 2
    complete(coord)  # 3: what a restore of the latest would pick
    record_restore(
        metastore, load_checkpoint(metastore, storage, JOB, 1), attempt="a", parallelism=1
    )
    coord.activate()  # the deploy's try leads the job, and records its driver
    driver = DriverIdentity(coord.coordinator_id, "elsewhere", 4242, None, gc_clock.now())
    assert record_driver(metastore, JOB, driver)
    with pytest.raises(JobActiveError, match="starting its driver"):
        run_gc(metastore, storage, JOB, GcOptions(keep_savepoints=0), clock=gc_clock)
    assert statuses(metastore)[1] == statuses(metastore)[2] == S.COMPLETED
    forced = GcOptions(keep_savepoints=0, force=True)
    assert [
        s.checkpoint_id for s in run_gc(metastore, storage, JOB, forced, clock=gc_clock).savepoints
    ] == [2]
    assert statuses(metastore)[1] == S.COMPLETED and statuses(metastore)[2] == S.DISCARDED
    # a driver that never beat within the heartbeat timeout of its submission is not starting
    later = ManualClock(gc_clock.now() + timedelta(minutes=6))
    assert run_gc(metastore, storage, JOB, GcOptions(), clock=later) is not None


def test_an_attached_try_starting_its_driver_is_left_alone(
    metastore: Metastore, storage: CheckpointStorage
) -> None:
    """Review of issue 38: a try that is not deferrable submits its driver told to restore an
    older savepoint (``--restore``), which the driver records only once it reads it; while it
    starts (the try activated the job: CREATED, no heartbeat), gc refuses the job as active, as
    for a detached driver, instead of discarding that savepoint under it."""
    clock, gc_clock = _clocks()
    coord = new_coordinator(metastore, storage, clock)
    complete(coord, savepoint=True)  # 1: what the try was told to restore
    complete(coord, savepoint=True)  # 2
    restarted = new_coordinator(metastore, storage, gc_clock)
    restarted.activate()  # the try leads the job; its spark-submit starts
    with pytest.raises(JobActiveError, match="starting its driver"):
        run_gc(metastore, storage, JOB, GcOptions(keep_savepoints=0), clock=gc_clock)
    assert statuses(metastore)[1] == statuses(metastore)[2] == S.COMPLETED
    later = ManualClock(gc_clock.now() + timedelta(minutes=6))  # never beat: not starting
    assert run_gc(metastore, storage, JOB, GcOptions(keep_savepoints=0), clock=later) is not None
