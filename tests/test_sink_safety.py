"""A sink path can never cost the user files (issue 10, §4 "A sink path can delete the user's
files"): refused locations are reported with ``sink.path`` before Spark starts and before anything
is written, and the sink deletes only entries it created itself (its ``_ckpt_sink`` marker).

What is on disk is checked with ``os``, independently of the sink object.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from checkpointing.errors import CheckpointingError, ConfigError, StorageError
from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline.spec import SpecError, load_spec
from checkpointing.sinks.guard import MARKER_FILE, check_sink_location, read_marker
from checkpointing.state.storage import FileSystemCheckpointStorage

SPEC = """
job: routes
source: {{format: parquet, path: "data/*.parquet"}}
key: user
aggregations: {{n: count()}}
sink: {{path: "{sink}"}}
storage: ckpt
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """``project/`` with ``data/`` (the input, holding a user's ``final-*`` files) and
    ``ckpt/`` (the spec's checkpoint storage)."""
    root = tmp_path / "project"
    (root / "data" / "final-2024").mkdir(parents=True)
    (root / "data" / "events.parquet").write_bytes(b"PAR1")
    (root / "data" / "final-report.txt").write_text("the user's report")
    (root / "data" / "final-2024" / "q1.csv").write_text("1,2")
    (root / "ckpt").mkdir()
    return root


def spec_with_sink(project: Path, sink: str) -> Path:
    path = project / "routes.yaml"
    path.write_text(SPEC.format(sink=sink))
    return path


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# ============================================================================ refused locations


@pytest.mark.parametrize(
    ("sink", "conflict"),
    [
        ("data", "is the input folder of source.path"),
        ("./data/", "is the input folder of source.path"),
        ("data/out", "lies inside the input folder of source.path"),
        (".", "is the spec's own folder"),
        ("..", "contains the spec's own folder"),
        ("/", "is a filesystem root"),
        ("file:///", "is a filesystem root"),
        ("ckpt", "is the checkpoint storage"),
        ("ckpt/routes", "lies inside the checkpoint storage"),
        ("alias", "is the input folder of source.path"),  # a symlink to data/
    ],
)
def test_a_dangerous_sink_path_is_refused_when_the_spec_loads(
    project: Path, sink: str, conflict: str
) -> None:
    (project / "alias").symlink_to(project / "data")
    before = _tree(project)
    with pytest.raises(SpecError) as err:
        load_spec(spec_with_sink(project, sink))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{project / 'routes.yaml'}: sink.path: ")
    assert conflict in message
    assert _tree(project) == before | {"routes.yaml"}  # nothing written, nothing deleted


def test_a_home_directory_or_a_folder_holding_one_is_refused(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "homes" / "alice"
    home.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(SpecError, match=r"sink\.path: .* is a home directory"):
        load_spec(spec_with_sink(project, str(home)))
    with pytest.raises(SpecError, match=r"sink\.path: .* contains a home directory"):
        load_spec(spec_with_sink(project, str(tmp_path / "homes")))
    assert load_spec(spec_with_sink(project, str(home / "out"))).sink.path == str(home / "out")


def test_a_subfolder_beside_the_spec_stays_fine(project: Path) -> None:
    spec = load_spec(spec_with_sink(project, "out/routes"))
    assert spec.resolve(spec.sink.path) == str(project / "out" / "routes")
    assert load_spec(spec_with_sink(project, str(project.parent / "elsewhere")))


def test_the_python_api_refuses_the_input_folder_as_its_sink(project: Path) -> None:
    from checkpointing.spark import AggregationStage, Pipeline
    from checkpointing.spark.aggregations import AggregationPlan

    with pytest.raises(SpecError, match=r"^pipeline api: sink\.path: .* is the input folder"):
        Pipeline(
            job="api",
            source={"format": "parquet", "path": f"{project}/data/*.parquet"},
            key="user",
            sink=str(project / "data"),
            stage=AggregationStage(AggregationPlan(["user"], {"n": "count()"})),
        )


def test_the_run_refuses_a_sink_inside_the_storage_it_is_given(project: Path) -> None:
    """The storage may come from ``CKPT_STORAGE_URL`` rather than the spec: the pre-Spark run
    check compares against the storage the run will use."""
    from checkpointing.spark.preflight import RunOptions, check_run

    spec = load_spec(spec_with_sink(project, "out"))
    storage = FileSystemCheckpointStorage(f"file://{project}/out/checkpoints")
    with pytest.raises(ConfigError, match=r"^sink\.path: .* contains the checkpoint storage"):
        check_run(spec, RunOptions(restore="none"), storage, None)
    assert not (project / "out").exists()


def test_check_sink_location_names_the_field_and_the_conflict(tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    with pytest.raises(ConfigError) as err:
        check_sink_location(tmp_path / "in" / "x", inputs=[f"file://{tmp_path}/in/*.csv"])
    assert str(err.value) == (
        f"sink.path: {tmp_path}/in/x lies inside the input folder of source.path "
        f"({tmp_path}/in); use a dedicated output folder"
    )
    # a single input file: its folder is the input folder
    with pytest.raises(ConfigError, match="is the input folder"):
        check_sink_location(tmp_path / "in", inputs=[str(tmp_path / "in" / "one.parquet")])
    assert check_sink_location(tmp_path / "out", inputs=[f"{tmp_path}/in/*.csv"], storage="s3://b")


# ============================================================================ only its own files


def test_a_folder_with_foreign_files_is_refused_and_left_untouched(
    spark: Any, project: Path
) -> None:
    """The issue's case: ``sink.path: data`` deleted ``final-report.txt`` and ``final-2024/``
    and wrote ``_staging/`` and ``changelog/`` into the input."""
    from checkpointing.spark.parquet_sink import TwoPhaseCommitSink

    data = project / "data"
    before = {p: p.read_bytes() for p in data.rglob("*") if p.is_file()}
    sink = TwoPhaseCommitSink(data)  # without a job: the first write claims, and refuses
    for write in (
        lambda: sink.publish_final(spark.range(3), "run-1"),
        lambda: sink.stage(0, spark.range(3)),
        lambda: sink.recover(None),
        lambda: sink.commit(0),
    ):
        with pytest.raises(ConfigError, match=f"no {MARKER_FILE} marker"):
            write()
    assert {p: p.read_bytes() for p in data.rglob("*") if p.is_file()} == before
    assert sorted(os.listdir(data)) == ["events.parquet", "final-2024", "final-report.txt"]
    # the runtime's sink (with its job) is refused as it is made, before any write
    with pytest.raises(ConfigError, match=r"^sink\.path: .* is not empty \(events\.parquet, "):
        TwoPhaseCommitSink(data, job="routes")


def test_the_sink_deletes_only_final_tables_it_published(spark: Any, tmp_path: Path) -> None:
    from checkpointing.spark.parquet_sink import TwoPhaseCommitSink

    out = tmp_path / "out"
    out.mkdir()  # an empty folder may be claimed
    sink = TwoPhaseCommitSink(out)
    sink.publish_final(spark.range(3), "routes-a1")

    # files the user (or another tool) put there later
    (out / "final-report.txt").write_text("mine")
    (out / "final-2024").mkdir()
    (out / "final-2024" / "q1.csv").write_text("1,2")
    (out / "final-copy").mkdir()  # a directory with a valid token, but no marker of ours
    (out / "final-copy" / "part-0.parquet").write_bytes(b"mine")
    temp_like = out / ".notes.txt.0123abcd.inprogress"
    temp_like.write_text("mine")
    foreign = {"final-report.txt", "final-2024", "final-copy", temp_like.name}

    sink.publish_final(spark.range(5), "routes-a2")
    sink.recover(None)  # sweeps temp leftovers and unswapped final tables: ours only
    names = set(os.listdir(out))
    assert foreign <= names
    assert "final-routes-a1" not in names and os.readlink(out / "final") == "final-routes-a2"
    assert (out / "final-2024" / "q1.csv").read_text() == "1,2"
    assert read_marker(out) == {"format": "ckpt-sink", "version": 1, "job": None}
    assert read_marker(out / "final-routes-a2")["token"] == "routes-a2"  # type: ignore[index]

    # a final-<token> that is not ours is never replaced
    with pytest.raises(StorageError, match="final-copy was not published by this sink"):
        sink.publish_final(spark.range(1), "copy")
    assert (out / "final-copy" / "part-0.parquet").read_bytes() == b"mine"


def test_a_sink_of_another_job_is_refused(spark: Any, tmp_path: Path) -> None:
    from checkpointing.spark.parquet_sink import TwoPhaseCommitSink

    out = tmp_path / "out"
    TwoPhaseCommitSink(out, job="first").stage(0, spark.range(2))
    with pytest.raises(ConfigError, match=r"is the sink of job 'first' .*, not of job 'second'"):
        TwoPhaseCommitSink(out, job="second")
    assert TwoPhaseCommitSink(out, job="first").staged_epochs() == [0]


def test_a_refused_run_registers_nothing(project: Path, tmp_path: Path) -> None:
    """The runtime refuses a foreign sink folder in its constructor: before the coordinator
    registers the job and before the sink writes (no Spark session is needed to get there)."""
    from checkpointing.spark.runtime import PipelineRun

    url = f"sqlite:///{tmp_path / 'metastore.db'}"
    Metastore(url, check_schema=False).upgrade()
    metastore = Metastore(url)
    (project / "out").mkdir()
    (project / "out" / "notes.txt").write_text("mine")
    spec = load_spec(spec_with_sink(project, "out"))
    storage = FileSystemCheckpointStorage(f"file://{project}/ckpt")
    with pytest.raises(CheckpointingError, match="is not empty"):
        PipelineRun(spec, None, metastore, storage)  # type: ignore[arg-type]
    from checkpointing.metastore import views

    assert views.list_jobs(metastore) == []
    assert sorted(os.listdir(project / "out")) == ["notes.txt"]


def test_the_claim_marker_is_written_once_and_whole(tmp_path: Path) -> None:
    from checkpointing.sinks.guard import claim

    out = tmp_path / f"out-{uuid.uuid4().hex[:6]}"
    claim(out, "routes")
    claim(out, "routes")  # idempotent
    assert os.listdir(out) == [MARKER_FILE]
    with pytest.raises(ConfigError, match="sink of job 'routes'"):
        claim(out, "other")
