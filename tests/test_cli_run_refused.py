"""``ckpt run`` refuses bad input before a Spark session starts and before anything is written:
one line naming the option, file or field, a non-zero exit, the metastore as it was (no job
registered RUNNING then FAILED, no EMPTY restore, a FINISHED job stays FINISHED). On the embedded
default metastore a first run creates the schema itself; a metastore URL the user gives keeps the
explicit ``ckpt db upgrade``. No test here starts Spark: its start is patched to fail."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, update
from typer.testing import CliRunner

from checkpointing.cli import app
from checkpointing.config import CheckpointConfig
from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.errors import CheckpointingError
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint, Job, RestoreEvent
from checkpointing.state.storage import FileSystemCheckpointStorage
from checkpointing.status import JobStatus

SPEC = """
job: etl
source: {format: parquet, path: "SOURCE"}
key: user
aggregations: {n: count()}
sink: {path: "SINK"}
parallelism: 2
max_parallelism: 8
"""


class SparkWouldStart(CheckpointingError):
    pass


@pytest.fixture(autouse=True)
def no_spark(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reaching the Spark session's start is this module's "the input was accepted"."""

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise SparkWouldStart("spark would start here")

    monkeypatch.setattr("checkpointing.spark.session.spark_session", refuse)


def write_spec(tmp_path: Path, source: str = "data/*.parquet", sink: str = "out") -> Path:
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "part-0.parquet").write_bytes(b"")  # only globbed before Spark
    path = tmp_path / "pipeline.yaml"
    path.write_text(SPEC.replace("SOURCE", source).replace("SINK", sink))
    return path


def snapshot(metastore: Metastore) -> dict[str, Any]:
    with metastore.transaction() as s:
        return {
            "jobs": sorted((j.job_id, j.status) for j in s.scalars(select(Job))),
            "checkpoints": s.scalar(select(func.count()).select_from(Checkpoint)),
            "restores": s.scalar(select(func.count()).select_from(RestoreEvent)),
        }


@pytest.fixture
def finished_job(metastore: Metastore, tmp_path: Path) -> Metastore:
    """Job ``etl`` registered and FINISHED (a run refused for bad input must not touch it)."""
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    CheckpointCoordinator("etl", metastore, storage, CheckpointConfig(), plan_provider=list)
    with metastore.transaction() as s:
        s.execute(update(Job).where(Job.job_id == "etl").values(status=JobStatus.FINISHED))
    return metastore


@pytest.mark.parametrize(
    ("spec_args", "args", "code", "expected"),
    [
        ({}, ["--parallelism", "9"], 1, "error: --parallelism 9 exceeds max_parallelism 8"),
        ({"source": "nothing/*.parquet"}, [], 1, "source.path: "),
        ({"sink": "ftp://bucket/out"}, [], 1, "sink.path: 'ftp://bucket/out': expected "),
        ({}, ["--restore", "garbage"], 1, "error: --restore 'garbage': "),
        ({}, ["--restore", "42"], 1, "error: --restore '42': job etl has no checkpoint 42"),
        ({}, ["--restore", "99999999999999999999"], 1, "error: --restore '9999"),
        ({}, ["--attempt", "../x"], 1, "invalid attempt '../x'"),
    ],
)
def test_bad_input_is_refused_before_spark_and_writes_nothing(
    finished_job: Metastore,
    tmp_path: Path,
    spec_args: dict[str, str],
    args: list[str],
    code: int,
    expected: str,
) -> None:
    spec = write_spec(tmp_path, **spec_args)
    before = snapshot(finished_job)
    url = finished_job.url.render_as_string(hide_password=False)
    storage = f"file://{tmp_path / 'ckpt'}"
    result = CliRunner().invoke(
        app, ["--metastore-url", url, "--storage-url", storage, "run", str(spec), *args]
    )
    assert result.exit_code == code, result.output
    assert expected in " ".join(result.output.split()), result.output
    assert "spark would start here" not in result.output
    assert "Traceback" not in result.output
    assert (
        snapshot(finished_job)
        == before
        == {
            "jobs": [("etl", "FINISHED")],
            "checkpoints": 0,
            "restores": 0,
        }
    )
    assert not (tmp_path / "out").exists()


def test_a_valid_run_reaches_spark(finished_job: Metastore, tmp_path: Path) -> None:
    """The checks refuse bad input only: good input gets as far as starting Spark."""
    url = finished_job.url.render_as_string(hide_password=False)
    result = CliRunner().invoke(app, ["--metastore-url", url, "run", str(write_spec(tmp_path))])
    assert result.exit_code == 1 and "spark would start here" in result.stderr


def test_first_run_on_the_embedded_metastore_creates_its_schema(tmp_path: Path) -> None:
    home = tmp_path / "home"
    runner = CliRunner(env={"CKPT_HOME": str(home), "CKPT_METASTORE_URL": None})

    refused = runner.invoke(app, ["run", str(write_spec(tmp_path)), "--parallelism", "9"])
    assert refused.exit_code == 1
    assert not home.exists()  # a refused run creates nothing, not even the metastore

    result = runner.invoke(app, ["run", str(write_spec(tmp_path))])
    assert "spark would start here" in result.stderr, result.output
    store = Metastore(f"sqlite:///{home / 'metastore.db'}")  # checks the schema is at head
    assert store.current_revision() == store.head_revision()
    store.dispose()


def test_a_user_supplied_metastore_still_needs_db_upgrade(tmp_path: Path) -> None:
    db = tmp_path / "fresh.db"
    result = CliRunner(env={"CKPT_METASTORE_URL": None}).invoke(
        app, ["--metastore-url", f"sqlite:///{db}", "run", str(write_spec(tmp_path))]
    )
    assert result.exit_code == 3
    assert "run `ckpt db upgrade`" in result.stderr
    assert (
        not db.exists()
        or sqlite3.connect(db).execute("select name from sqlite_master").fetchall() == []
    )


def test_another_jobs_savepoint_is_refused_unless_allowed(
    metastore: Metastore, tmp_path: Path
) -> None:
    """``--restore PATH`` of another job's savepoint is refused before Spark starts (nothing
    recorded) unless ``--allow-other-job`` asks for it."""
    from tests.test_pipeline_permissions import seed_two_jobs

    storage, theirs = seed_two_jobs(metastore, tmp_path)
    spec = write_spec(tmp_path)
    spec.write_text(spec.read_text().replace("job: etl", "job: mine"))
    base = ["--metastore-url", metastore.url.render_as_string(hide_password=False)]
    base += ["--storage-url", storage.base_url, "run", str(spec), "--restore", theirs]
    before = snapshot(metastore)

    refused = CliRunner().invoke(app, base)
    assert refused.exit_code == 1, refused.output
    message = " ".join(refused.output.split())
    assert "error: --restore" in message and "of job theirs, not of job mine" in message
    assert "spark would start here" not in refused.output
    assert snapshot(metastore) == before

    allowed = CliRunner().invoke(app, [*base, "--allow-other-job"])
    assert "spark would start here" in allowed.output, allowed.output


def test_a_static_table_matching_no_files_is_refused_and_the_flag_is_accepted(
    finished_job: Metastore, tmp_path: Path
) -> None:
    """``tables:`` are listed before Spark starts (a glob matching nothing is refused naming
    the field); ``--allow-changed-tables`` is an option of ``ckpt run``."""
    spec = write_spec(tmp_path)
    text = spec.read_text().replace(
        "key: user",
        "tables: {planes: {format: parquet, path: nothing/*.parquet}}\n"
        "transform: SELECT * FROM input\nkey: user",
    )
    spec.write_text(text)
    before = snapshot(finished_job)
    url = finished_job.url.render_as_string(hide_password=False)
    result = CliRunner().invoke(app, ["--metastore-url", url, "run", str(spec)])
    assert result.exit_code == 1, result.output
    assert f"error: {spec}: tables.planes.path: " in result.stderr  # the file and the field
    assert "nothing/*.parquet' matches no files" in " ".join(result.stderr.split())
    assert snapshot(finished_job) == before
    assert not (tmp_path / "out").exists()

    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "planes.parquet").write_bytes(b"")
    result = CliRunner().invoke(
        app, ["--metastore-url", url, "run", str(spec), "--allow-changed-tables"]
    )
    assert result.exit_code == 1 and "spark would start here" in result.stderr, result.output


def test_with_json_an_error_is_one_json_object_on_stderr(
    finished_job: Metastore, tmp_path: Path
) -> None:
    """``ckpt run --json``: stdout holds the run's summary or nothing; why there is none is a
    JSON object on stderr, refused input and a failed start alike."""
    url = finished_job.url.render_as_string(hide_password=False)
    base = ["--metastore-url", url, "run"]
    refused = CliRunner().invoke(
        app, [*base, str(write_spec(tmp_path, source="no/*.pq")), "--json"]
    )
    assert refused.exit_code == 1 and refused.stdout == ""
    error = json.loads(refused.stderr)
    assert error["exit_code"] == 1
    assert error["error"].startswith(f"{tmp_path / 'pipeline.yaml'}: source.path: "), error

    started = CliRunner().invoke(app, [*base, str(write_spec(tmp_path)), "--json"])
    assert started.exit_code == 1 and started.stdout == ""
    assert json.loads(started.stderr) == {"error": "spark would start here", "exit_code": 1}
    assert snapshot(finished_job)["checkpoints"] == 0
