"""Python pipelines named by a spec (issue 24): ``pipeline: ckpt_example.jobs:build`` and
``transform: ckpt_example.jobs:clean``, the example package under ``tests/entry_points`` shipped
as a zip (``py_files:``, as ``spark-submit --py-files`` ships it).

Every way an entry point can be wrong is refused by ``ckpt run`` in one line naming the file,
the field and the entry point, before Spark starts and before anything is written. Then both
forms run on real Spark through ``run_spec`` (what ``ckpt run`` and the operator's driver run),
the executors importing the package's UDF from the shipped zip, and equal an independent pandas
computation; the Python pipeline also crashes and resumes at another parallelism. Its Airflow
run (the DAG factory, a crash and a rescaled retry) is ``test_airflow_failover``'s scenario."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from typer.testing import CliRunner

from checkpointing.cli import app
from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline import datasets
from checkpointing.pipeline.spec import SpecError, load_spec
from checkpointing.state.storage import FileSystemCheckpointStorage
from tests import oracle
from tests.entry_points import package_zip

AGGS = {"n": ("count", None), "total": ("sum", "amount"), "avg_amount": ("avg", "amount")}
FILES = 4


def write(directory: Path, text: str, name: str = "job.yaml") -> Path:
    path = directory / name
    path.write_text(text)
    return path


PIPELINE = "job: py_events\npipeline: ckpt_example.jobs:build\npy_files: [ckpt_example.zip]\n"
TRANSFORM = """
job: cleaned
source: {format: parquet, path: "events/*.parquet", splits_per_epoch: 1}
key: user
transform: ckpt_example.jobs:clean
py_files: [ckpt_example.zip]
aggregations: {n: count(), total: sum(amount), avg_amount: avg(amount)}
sink: {path: out}
parallelism: 2
max_parallelism: 16
checkpoint: {every_epochs: 1, retained: 2}
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            PIPELINE.replace("ckpt_example.jobs", "no_such_pkg.jobs"),
            "job.yaml: pipeline: no module named 'no_such_pkg' (install its package, or ship it "
            "with py_files:",
        ),
        (
            PIPELINE.replace(":build", ":nope"),
            "job.yaml: pipeline: module ckpt_example.jobs has no attribute 'nope'",
        ),
        (
            PIPELINE.replace("jobs:build", "broken:NOT_CALLABLE"),
            "job.yaml: pipeline: ckpt_example.broken:NOT_CALLABLE is an int, not a function "
            "returning a Pipeline",
        ),
        (
            PIPELINE.replace("jobs:build", "broken:raises"),
            "job.yaml: pipeline: ckpt_example.broken:raises() raised ValueError: no events "
            "configured for this environment",
        ),
        (
            PIPELINE.replace("jobs:build", "broken:returns_a_dict"),
            "job.yaml: pipeline: ckpt_example.broken:returns_a_dict() returned a dict, not a "
            "checkpointing.spark.Pipeline",
        ),
        (
            PIPELINE.replace("py_events", "other"),
            "job.yaml: job: 'other' here but 'py_events' in the Pipeline of pipeline: "
            "ckpt_example.jobs:build; the two must be the same",
        ),
        (
            PIPELINE + "parallelism: 3\n",
            "job.yaml: parallelism: the Pipeline of pipeline: ckpt_example.jobs:build gives it; "
            "a spec with pipeline: holds only job, py_files, schedule,",
        ),
        (
            PIPELINE + "sink: {path: elsewhere}\n",
            "job.yaml: sink: the Pipeline of pipeline: ckpt_example.jobs:build gives it",
        ),
        (PIPELINE.replace("py_events\n", "py_events\nretries: -1\n"), "job.yaml: retries: "),
        (PIPELINE.replace("jobs:build", "jobs"), "job.yaml: pipeline: 'ckpt_example.jobs' is not"),
        (
            PIPELINE.replace("ckpt_example.zip", "missing.zip"),
            "job.yaml: py_files: missing.zip: no such file",
        ),
        (
            TRANSFORM.replace("jobs:clean", "broken:one_argument"),
            "job.yaml: transform: ckpt_example.broken:one_argument(rows: 'Any') -> 'Any' cannot "
            "be called as fn(input, tables) -> DataFrame",
        ),
        (
            TRANSFORM.replace("jobs:clean", "broken:NOT_CALLABLE"),
            "job.yaml: transform: ckpt_example.broken:NOT_CALLABLE is an int, not a function",
        ),
        (
            TRANSFORM.replace("ckpt_example.jobs", "ckpt_example.gone"),
            "job.yaml: transform: no module named 'ckpt_example.gone'",
        ),
    ],
    ids=[
        "no-module",
        "no-attribute",
        "not-callable",
        "build-raises",
        "wrong-type",
        "other-job",
        "conflicting-field",
        "dataflow-field-in-spec",
        "bad-deployment-field",
        "not-an-entry-point",
        "missing-py-file",
        "transform-signature",
        "transform-not-callable",
        "transform-no-module",
    ],
)
def test_a_bad_entry_point_is_refused_in_one_line_before_spark_with_nothing_written(
    tmp_path: Path, text: str, expected: str
) -> None:
    package_zip(tmp_path)
    spec = write(tmp_path, text)
    metastore = tmp_path / "metastore.db"
    result = CliRunner().invoke(
        app,
        ["--metastore-url", f"sqlite:///{metastore}", "--storage-url",
         f"file://{tmp_path / 'ckpt'}", "run", str(spec)],
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    (line,) = [ln for ln in result.output.splitlines() if ln.strip()]  # one line
    assert line.startswith(f"error: {tmp_path}/{expected}"), line
    assert "Traceback" not in result.output
    assert not metastore.exists()  # no job row: the metastore was not even opened
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_example.zip", "job.yaml"]


def test_a_python_pipelines_spec_is_its_pipeline_with_the_deployment_on_top(
    tmp_path: Path,
) -> None:
    package_zip(tmp_path)
    spec = load_spec(
        write(tmp_path, PIPELINE + "schedule: '@daily'\nretries: 1\nparallelism_on_retry: 3\n")
    )
    assert (spec.job, spec.pipeline, spec.parallelism, spec.max_parallelism) == (
        "py_events",
        "ckpt_example.jobs:build",
        2,
        16,
    )
    assert (spec.schedule, spec.retries, spec.parallelism_on_retry) == ("@daily", 1, 3)
    assert spec.py_files == [str(tmp_path / "ckpt_example.zip")]
    assert spec.resolve(spec.sink.path) == str(tmp_path / "out")  # relative to the spec file
    assert spec.code is not None and [type(s).__name__ for s in spec.code.stages] == [
        "AggregationStage"
    ]
    assert spec.code.transform is not None and spec.code.transform.__name__ == "customers"
    # a Pipeline's static tables are read by its Python transform
    with_tables = load_spec(write(tmp_path, PIPELINE.replace(":build", ":build_with_vips")))
    assert list(with_tables.tables) == ["vips"] and with_tables.transform is None
    assert with_tables.code is not None and with_tables.code.transform is not None
    with pytest.raises(SpecError, match="transform: 'a:b:c' is neither a SELECT over input nor"):
        load_spec(write(tmp_path, TRANSFORM.replace("ckpt_example.jobs:clean", "a:b:c")))


# ------------------------------------------------------------------------ on real Spark


@pytest.fixture(scope="module")
def events(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, pd.DataFrame]:
    path = tmp_path_factory.mktemp("entry-events") / "events"
    datasets.generate_events(path, events=3_000, keys=120, files=FILES, seed=5)
    return path, pd.concat(pd.read_parquet(p) for p in sorted(path.glob("*.parquet")))


def job_dir(tmp_path: Path, events: Path, text: str) -> Path:
    """A spec folder as a team lays it out: the spec, its code's zip, ``events/`` beside."""
    (tmp_path / "events").symlink_to(events)
    package_zip(tmp_path)
    return write(tmp_path, text)


def run(spark: Any, spec_path: Path, metastore_url: str, **options: Any) -> Any:
    from checkpointing.spark.pipeline import run_spec
    from checkpointing.spark.preflight import RunOptions

    spec = load_spec(spec_path)
    storage = FileSystemCheckpointStorage(f"file://{spec_path.parent / 'ckpt'}")
    metastore = Metastore(metastore_url)
    try:
        return run_spec(spec, spark, metastore, storage, RunOptions(**options))
    finally:
        metastore.dispose()


def final_table(spark: Any, out: Path) -> pd.DataFrame:
    from checkpointing.spark.parquet_sink import TwoPhaseCommitSink

    final = TwoPhaseCommitSink(str(out)).read_final(spark).toPandas()
    return final.sort_values("user").reset_index(drop=True)


def assert_equals_pandas(final: pd.DataFrame, rows: pd.DataFrame) -> None:
    expected = oracle.expected_aggregates(rows, ["user"], AGGS)
    pd.testing.assert_frame_equal(
        final[expected.columns.tolist()], expected, check_dtype=False, check_exact=False
    )


@pytest.mark.parametrize("metastore_url", ["sqlite"], indirect=True)
def test_a_spec_with_a_transform_function_runs_it_on_every_epoch(
    spark: Any, events: Any, tmp_path: Path, metastore_url: str
) -> None:
    spec = job_dir(tmp_path, events[0], TRANSFORM)
    result = run(spark, spec, metastore_url)
    assert result.epochs_run == list(range(FILES))
    rows = events[1]
    # clean(): the customers' events with an amount (the UDF ran in the executors' workers)
    assert_equals_pandas(final_table(spark, tmp_path / "out"), rows[rows.amount.notna()])


@pytest.mark.parametrize("metastore_url", ["sqlite"], indirect=True)
def test_a_python_pipeline_crashes_and_resumes_rescaled_like_a_spec(
    spark: Any, events: Any, tmp_path: Path, metastore_url: str
) -> None:
    from checkpointing.spark.runtime import SimulatedCrash

    spec = job_dir(tmp_path, events[0], PIPELINE)
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore_url, parallelism=3, crash_after_epochs=2)
    resumed = run(spark, spec, metastore_url)  # the Pipeline's parallelism, 2
    assert resumed.restored_from is not None
    assert resumed.epochs_run == [2, 3]
    assert_equals_pandas(final_table(spark, tmp_path / "out"), events[1])
