"""A metastore row never chooses which storage tree is read, written or deleted (issue 38, M1
and M3): a job row's ``storage_url`` is used by ``ckpt gc``/``inspect``/``discard``/
``restore-plan`` only inside the configured storage roots (``CKPT_STORAGE_URL`` or the
default, and ``CKPT_STORAGE_ROOTS``), and a savepoint request's ``target_location`` is refused
outside them when the request is made and again when the job's coordinator takes it (a row a
driver inserted itself). The API server's actions: ``test_checkpoint_api.py``."""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import insert, select, update
from typer.testing import CliRunner

from checkpointing.cli import app
from checkpointing.clock import ManualClock
from checkpointing.errors import ConfigError, StorageError
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint, CheckpointRequest, Job
from checkpointing.state.storage import CheckpointStorage, FileSystemCheckpointStorage
from checkpointing.state.storage_roots import DisallowedStorageError, require_allowed
from checkpointing.status import CheckpointType
from tests.helpers import JOB, ack_all, complete, new_coordinator


@pytest.fixture
def roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The default storage ``<tmp>/ckpt`` and the extra roots ``<tmp>/more`` and
    ``s3://bkt/teams/a``."""
    monkeypatch.setenv("CKPT_STORAGE_URL", f"file://{tmp_path / 'ckpt'}")
    monkeypatch.setenv("CKPT_STORAGE_ROOTS", f" {tmp_path / 'more'}/ ,s3://bkt/teams/a,")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "more").mkdir()
    (tmp_path / "ckpt" / "link").symlink_to("/")
    return tmp_path


@pytest.mark.parametrize(
    "url",
    [
        "file://{t}/ckpt",
        "file://{t}/ckpt/",
        "file://{t}/ckpt/team/x",
        "{t}/ckpt/x",
        "file://{t}//ckpt//x",
        "file://{t}/more",
        "file://{t}/more/y",
        "s3://bkt/teams/a",
        "s3://bkt/teams/a/pipelines",
        "s3a://bkt/teams/a/pipelines",  # Hadoop's name for the same store
    ],
)
def test_a_url_in_an_allowed_root_is_taken(roots: Path, url: str) -> None:
    url = url.format(t=roots)
    assert require_allowed(url, job_id=JOB, field="storage_url") == url


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("file:///opt/airflow", "not under an allowed"),
        ("file:///", "not under an allowed"),
        ("file://{t}", "not under an allowed"),  # above a root
        ("file://{t}/ckpt-evil", "not under an allowed"),  # a sibling with the root's prefix
        ("file://{t}/ckpt/../../etc", "not a normalised path"),
        ("file://{t}/ckpt/./x", "not a normalised path"),
        ("file://{t}/ckpt/link/etc", "not under an allowed"),  # a symlink out of the root
        ("file://{t}/ckpt/x\n", "control character"),
        ("s3://bkt/teams", "not under an allowed"),
        ("s3://bkt/teams/ab", "not under an allowed"),
        ("s3://bkt/teams/a//x", "not a normalised path"),
        ("s3://other/teams/a", "not under an allowed"),
        ("gs://bkt/teams/a", "not under an allowed"),
        ("file://host/x", "absolute path"),
        ("relative/x", "expected file:///absolute/path"),
    ],
)
def test_a_url_outside_every_root_is_refused_in_one_line(roots: Path, url: str, why: str) -> None:
    url = url.format(t=roots)
    with pytest.raises(DisallowedStorageError) as refused:
        CheckpointStorage.from_job_row(JOB, url)
    message = str(refused.value)
    assert message.startswith(f"job {JOB!r}: storage_url ") and why in message, message
    assert len(message.splitlines()) == 1


def test_a_bad_root_setting_is_named(roots: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for value, why in [("s3://bkt/a,relative", "'relative' expected"), ("/", "filesystem's")]:
        monkeypatch.setenv("CKPT_STORAGE_ROOTS", value)
        with pytest.raises(ConfigError, match=f"CKPT_STORAGE_ROOTS: .*{why}"):
            require_allowed(f"file://{roots}/ckpt/x", job_id=JOB, field="storage_url")


# ============================================================================ the CLI (M1)


def _forge(metastore: Metastore, storage_url: str, location: tuple[int, str] | None = None) -> None:
    """What pipeline code with the metastore URL can do to its own job's rows."""
    with metastore.transaction() as s:
        s.execute(update(Job).where(Job.job_id == JOB).values(storage_url=storage_url))
        if location is not None:
            checkpoint_id, url = location
            s.execute(
                update(Checkpoint)
                .where(Checkpoint.job_id == JOB, Checkpoint.checkpoint_id == checkpoint_id)
                .values(storage_location=url)
            )


@pytest.fixture
def cli_env(
    tmp_path: Path, storage: FileSystemCheckpointStorage
) -> Iterator[dict[str, str | None]]:
    """The CLI's environment: no ``CKPT_STORAGE_URL`` (so the job row's ``storage_url`` is
    the storage), a ``CKPT_HOME`` of its own, and the job's storage an allowed root."""
    yield {
        "CKPT_STORAGE_URL": None,
        "CKPT_HOME": str(tmp_path / "home"),
        "CKPT_STORAGE_ROOTS": storage.base_url,
    }


def _ckpt(metastore: Metastore, env: dict[str, str | None], *args: str):  # type: ignore[no-untyped-def]
    url = metastore.url.render_as_string(hide_password=False)
    return CliRunner().invoke(app, ["--metastore-url", url, *args], env=env)


def test_gc_never_deletes_under_a_storage_url_outside_the_roots(
    sqlite_metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
    tmp_path: Path,
    cli_env: dict[str, str | None],
) -> None:
    """A job row pointed at another tree with the job's layout in it (another team's storage,
    say): ``ckpt gc`` refuses in one line and deletes nothing there; under an allowed root
    the same gc deletes the orphan."""
    coord = new_coordinator(sqlite_metastore, storage, clock)
    complete(coord)
    complete(coord)  # checkpoint 1 subsumed: a file under chk-1/ is an orphan
    victim = tmp_path / "victim"
    precious = victim / JOB / "chk-1" / "precious"
    precious.parent.mkdir(parents=True)
    precious.write_text("theirs")
    _forge(sqlite_metastore, f"file://{victim}")

    refused = _ckpt(sqlite_metastore, cli_env, "gc", JOB, "--force", "--grace", "0s")
    assert refused.exit_code == 1, refused.output
    line = f"job '{JOB}': storage_url 'file://{victim}' is not under an allowed checkpoint"
    assert line in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    assert precious.read_text() == "theirs"

    # the same tree, once an operator names it a root: gc runs there (the orphan goes)
    allowed = {**cli_env, "CKPT_STORAGE_ROOTS": f"{storage.base_url},file://{victim}"}
    done = _ckpt(sqlite_metastore, allowed, "gc", JOB, "--force", "--grace", "0s")
    assert done.exit_code == 0, done.output
    assert not precious.exists()


def test_discard_inspect_and_restore_plan_refuse_a_storage_url_outside_the_roots(
    sqlite_metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
    tmp_path: Path,
    cli_env: dict[str, str | None],
) -> None:
    """Scenario B of issue 38 through the CLI: the job's own completed savepoint, its row and
    the job row pointed at a tree that has the same layout (``<job>/savepoints/savepoint-<id>``):
    ``ckpt discard`` deletes nothing there, and no read goes there either."""
    coord = new_coordinator(sqlite_metastore, storage, clock)
    complete(coord)
    done = ack_all(coord, coord.trigger_savepoint()).completed
    assert done is not None
    sid = done.checkpoint_id
    victim = tmp_path / "victim"
    precious = victim / JOB / "savepoints" / f"savepoint-{sid}" / "precious"
    precious.parent.mkdir(parents=True)
    precious.write_text("theirs")
    listed = _ckpt(sqlite_metastore, cli_env, "inspect", JOB, "1")
    assert listed.exit_code == 0, listed.output  # the job's own storage: an allowed root

    _forge(sqlite_metastore, f"file://{victim}", (sid, f"file://{precious.parent}"))
    line = f"job '{JOB}': storage_url 'file://{victim}' is not under an allowed checkpoint"
    for args in (
        ["discard", JOB, str(sid), "--yes"],
        ["inspect", JOB, "1"],
        ["restore-plan", JOB, "--parallelism", "2"],
    ):
        refused = _ckpt(sqlite_metastore, cli_env, *args)
        assert refused.exit_code == 1, (args, refused.output)
        assert line in refused.stderr, (args, refused.stderr)
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert precious.read_text() == "theirs"
    with sqlite_metastore.reading() as s:
        assert s.get(Checkpoint, (JOB, sid)).status == "COMPLETED"  # type: ignore[union-attr]


def test_a_coordinator_given_no_storage_takes_the_rows_only_inside_the_roots(
    sqlite_metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from checkpointing.coordination.coordinator import CheckpointCoordinator

    monkeypatch.setenv("CKPT_STORAGE_URL", storage.base_url)
    complete(new_coordinator(sqlite_metastore, storage, clock))
    joined = CheckpointCoordinator(JOB, sqlite_metastore, None, None, clock=clock)
    assert joined.storage.base_url == storage.base_url
    _forge(sqlite_metastore, f"file://{tmp_path / 'victim'}")
    with pytest.raises(DisallowedStorageError, match=f"job '{JOB}': storage_url 'file://"):
        CheckpointCoordinator(JOB, sqlite_metastore, None, None, clock=clock)


# ============================================================================ targets (M3)


def test_a_savepoint_target_outside_the_roots_is_refused_when_requested(
    sqlite_metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CKPT_STORAGE_URL", storage.base_url)
    monkeypatch.setenv("CKPT_STORAGE_ROOTS", f"file://{tmp_path / 'targets'}")
    coord = new_coordinator(sqlite_metastore, storage, clock)
    victim = tmp_path / "victim"
    with pytest.raises(DisallowedStorageError) as refused:
        coord.request(CheckpointType.SAVEPOINT, requested_by="t", target=f"file://{victim}")
    assert str(refused.value) == (
        f"job {JOB!r}: target_location 'file://{victim}' is not under an allowed checkpoint "
        f"storage root ({storage.base_url}, file://{tmp_path / 'targets'}); add its root to "
        "CKPT_STORAGE_ROOTS if it is yours"
    )
    with sqlite_metastore.reading() as s:
        assert s.scalars(select(CheckpointRequest)).all() == []
    # a target in a root: queued, taken, written there
    target = f"file://{tmp_path / 'targets' / 'release-1'}"
    coord.request(CheckpointType.SAVEPOINT, requested_by="t", target=target)
    [pending] = coord.process_requests()
    assert pending.location == f"{target}/savepoint-{pending.checkpoint_id}"
    assert ack_all(coord, pending).completed is not None
    assert (tmp_path / "targets" / "release-1" / f"savepoint-{pending.checkpoint_id}").is_dir()
    assert not victim.exists()


def test_a_queued_target_a_driver_inserted_steers_no_write(
    sqlite_metastore: Metastore,
    storage: FileSystemCheckpointStorage,
    clock: ManualClock,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A request row inserted directly (any driver can) with a target on the coordinator's
    host: the coordinator fails the request in one line, writes and deletes nothing there,
    and takes the next request as usual."""
    monkeypatch.setenv("CKPT_STORAGE_URL", storage.base_url)
    monkeypatch.delenv("CKPT_STORAGE_ROOTS", raising=False)
    coord = new_coordinator(sqlite_metastore, storage, clock)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("theirs")
    with sqlite_metastore.transaction() as s:
        for target in (f"file://{victim}", f"{storage.base_url}/../victim"):
            s.execute(
                insert(CheckpointRequest).values(
                    job_id=JOB,
                    checkpoint_type="SAVEPOINT",
                    forced=True,
                    periodic=False,
                    priority=3,
                    requested_by="forged",
                    requested_at=datetime.now(UTC),
                    target_location=target,
                    status="QUEUED",
                )
            )
    with caplog.at_level("ERROR"):
        assert coord.process_requests() == []
    with sqlite_metastore.reading() as s:
        rows = s.scalars(select(CheckpointRequest).order_by(CheckpointRequest.request_id)).all()
        assert [(r.status, r.checkpoint_id) for r in rows] == [("FAILED", None)] * 2
        assert f"job {JOB!r}: target_location 'file://{victim}' is not under" in rows[0].message
        assert "not a normalised path" in rows[1].message
        assert s.scalars(select(Checkpoint)).all() == []  # no savepoint was even triggered
    assert sorted(os.listdir(victim)) == ["keep"]
    assert len([r for r in caplog.records if "target_location" in r.getMessage()]) == 2

    coord.request(CheckpointType.SAVEPOINT, requested_by="t")  # the job's own: as usual
    [pending] = coord.process_requests()
    assert pending.location == storage.savepoint_url(JOB, pending.checkpoint_id)


# ============================================================================ a job's base


def test_a_job_rows_storage_url_must_be_a_root_not_below_one(roots: Path) -> None:
    """A job row's ``storage_url`` is taken only when it *is* a root: ``<root>/Y`` lies in job
    ``Y``'s directory of the storage at ``<root>``, and a job with that base would take ``Y``'s
    ``shared/chk-*`` for its own orphans (its gc deletes them). A savepoint target may still
    lie below a root (``test_a_url_in_an_allowed_root_is_taken``)."""
    for url, base in (
        (f"file://{roots}/ckpt", f"file://{roots}/ckpt"),
        (f"file://{roots}/more/", f"file://{roots}/more"),
        ("s3a://bkt/teams/a", "s3://bkt/teams/a"),  # Hadoop's name for the same store
    ):
        assert CheckpointStorage.from_job_row(JOB, url).base_url == base
    for url in (f"file://{roots}/ckpt/shared", "s3://bkt/teams/a/x"):
        with pytest.raises(DisallowedStorageError) as info:
            CheckpointStorage.from_job_row(JOB, url)
        assert str(info.value).startswith(f"job {JOB!r}: storage_url {url!r} is below ")
        assert "a job's storage must be a root itself" in str(info.value)
    with pytest.raises(DisallowedStorageError, match="is not under an allowed"):
        CheckpointStorage.from_job_row(JOB, "file:///opt/airflow")


def test_a_delete_refuses_a_base_swapped_for_a_symlink(tmp_path: Path) -> None:
    """The base was checked against the roots when the storage was made; a symlink swapped in
    for it afterwards leads the delete nowhere (local storage)."""
    base, victim = tmp_path / "ckpt", tmp_path / "victim"
    (base / JOB / "chk-1").mkdir(parents=True)
    (victim / JOB / "chk-1").mkdir(parents=True)
    (victim / JOB / "chk-1" / "precious").write_text("theirs")
    storage = FileSystemCheckpointStorage(f"file://{base}")
    base.rename(tmp_path / "moved")
    base.symlink_to(victim)
    with pytest.raises(StorageError, match="a symlink swapped in"):
        storage.discard_directory(JOB, 1, "checkpoint")
    assert (victim / JOB / "chk-1" / "precious").read_text() == "theirs"
