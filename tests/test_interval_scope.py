"""Interval-scoped pipelines (issue 27): a ``scope: interval`` spec is a template over the run's
data interval (``${DS}`` … in its paths) and each interval is its own job instance, with its own
checkpoints and its own sink directory; an unbound template, a path that does not name the
interval and an interval given to an incremental spec are refused in one line before anything is
written. On Spark: three daily intervals, the middle one crashed and resumed within itself, each
interval's output equal to pandas over its own files only."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from typer.testing import CliRunner

from checkpointing.cli import app
from checkpointing.errors import SpecError
from checkpointing.pipeline.interval import DataInterval, pipeline_of
from checkpointing.pipeline.spec import load_spec
from tests import oracle

SPEC = """
job: daily
scope: interval
source: {format: parquet, path: "in/date=${DS}/*.parquet"}
key: [user]
aggregations: {n: count()}
sink: {path: "out/date=${DS}"}
"""


INCREMENTAL = (
    SPEC.replace("scope: interval\n", "")
    .replace("date=${DS}/*", "*")
    .replace("out/date=${DS}", "out")
)


def write(tmp_path: Path, text: str = SPEC) -> Path:
    path = tmp_path / "daily.yaml"
    path.write_text(text)
    return path


def day(d: int) -> DataInterval:
    return DataInterval.parse(f"2026-11-{d:02d}", f"2026-11-{d + 1:02d}")


def test_a_template_binds_to_each_interval_as_its_own_job_instance(tmp_path: Path) -> None:
    template = load_spec(write(tmp_path))
    assert template.job == "daily" and template.interval is None
    assert template.source.path.endswith("in/date=${DS}/*.parquet")  # kept: not bound
    with pytest.raises(SpecError, match="scope: interval: a run needs its data interval") as e:
        template.check_runnable()
    assert "\n" not in str(e.value)

    bound = load_spec(write(tmp_path), interval=day(25))
    bound.check_runnable()
    assert bound.job == "daily.20261125T000000" and bound.interval == day(25)
    assert bound.source.path.endswith("in/date=2026-11-25/*.parquet")
    assert bound.sink.path.endswith("out/date=2026-11-25")
    hourly = DataInterval.parse("2026-11-25T13:00:00+01:00", "2026-11-25T14:00:00+01:00")
    assert hourly.start == datetime(2026, 11, 25, 12, tzinfo=UTC)  # in UTC
    assert hourly.variables() == {
        "DS": "2026-11-25",
        "DS_NODASH": "20261125",
        "TS_NODASH": "20261125T120000",
        "DATA_INTERVAL_START": "2026-11-25T12:00:00+00:00",
        "DATA_INTERVAL_END": "2026-11-25T13:00:00+00:00",
    }


@pytest.mark.parametrize(
    ("text", "interval", "message"),
    [
        (SPEC.replace("date=${DS}/*", "*"), day(25), "source.path: a scope: interval spec names"),
        (SPEC.replace("out/date=${DS}", "out"), day(25), "sink.path: a scope: interval spec names"),
        (INCREMENTAL, day(25), "scope: a data interval was given"),
        (
            SPEC.replace(
                '{path: "out/date=${DS}"}', '{format: iceberg, path: "w/${DS}", table: a.b}'
            ),
            day(25),
            "scope: interval: an Iceberg sink is one table",
        ),
        (SPEC.replace("scope: interval", "scope: hourly"), None, "scope: Input should be"),
        (SPEC.replace("scope: interval\n", ""), None, "source.path: names the data interval"),
    ],
)
def test_bad_interval_specs_are_refused_in_one_line(
    tmp_path: Path, text: str, interval: DataInterval | None, message: str
) -> None:
    with pytest.raises(SpecError, match=message) as refused:
        load_spec(write(tmp_path, text), interval=interval)
    assert "\n" not in str(refused.value)


def test_an_instance_is_authorised_as_its_pipeline_and_no_spec_may_look_like_one(
    tmp_path: Path,
) -> None:
    """The API and the generic DAGs ask the auth manager about the DAG of ``pipeline_of(job)``:
    an interval's instance is its pipeline's; so a spec's job may not end like an instance."""
    assert pipeline_of("daily.20261125T000000") == "daily"
    assert pipeline_of("daily") == "daily" and pipeline_of("a.b.c") == "a.b.c"
    assert pipeline_of("x.2026112T000000") == "x.2026112T000000"  # not an instance's suffix
    with pytest.raises(SpecError, match="ends like an interval's job instance") as refused:
        load_spec(write(tmp_path, INCREMENTAL.replace("job: daily", "job: x.20261125T000000")))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("year", [1, 5, 999, 1000, 2026, 9999])
def test_an_instance_of_any_year_is_its_pipelines(year: int) -> None:
    """Issue 38: ``strftime``'s ``%Y`` writes the year 999 as ``999``, and ``x.9990101T000000``
    was no instance of ``x`` (its permissions were not its pipeline's)."""
    interval = DataInterval(
        datetime(year, 1, 2, 3, 4, 5, tzinfo=UTC), datetime(year, 1, 3, tzinfo=UTC)
    )
    job = interval.job_id("daily")
    assert job == f"daily.{year:04d}0102T030405"
    assert pipeline_of(job) == "daily"
    values = interval.variables()
    assert values["DS"] == f"{year:04d}-01-02" and values["DS_NODASH"] == f"{year:04d}0102"
    assert values["TS_NODASH"] == job.rsplit(".", 1)[1]
    assert values["DATA_INTERVAL_START"].startswith(values["DS"])
    assert DataInterval.parse(values["DATA_INTERVAL_START"], values["DATA_INTERVAL_END"]) == (
        interval
    )


def test_the_dag_of_an_interval_spec_passes_each_run_its_interval(tmp_path: Path) -> None:
    """The factory's DAG: runs at once and catchup as the spec says, the trigger form's **Full
    refresh** switch, and the operator given the run's interval (Airflow 3: the point of
    ``run_after`` when a run has none). An incremental spec may not ask for more runs at once."""
    from checkpointing_airflow.dag_factory import build_pipeline_dag
    from checkpointing_airflow.pipeline_dag import INTERVAL_END, INTERVAL_START

    text = SPEC + "schedule: '@daily'\nmax_active_runs: 3\ncatchup: true\n"
    dag = build_pipeline_dag(load_spec(write(tmp_path, text)))
    assert (dag.dag_id, dag.max_active_runs, dag.catchup) == ("daily", 3, True)
    assert dag.params["full_refresh"] is False
    task = dag.get_task("run")
    assert (task.interval_start, task.interval_end) == (INTERVAL_START, INTERVAL_END)
    assert task.full_refresh == "{{ params.full_refresh }}"
    assert {"interval_start", "interval_end", "full_refresh"} <= set(task.template_fields)
    incremental = build_pipeline_dag(load_spec(write(tmp_path, INCREMENTAL)))
    assert incremental.max_active_runs == 1 and "full_refresh" not in incremental.params
    with pytest.raises(SpecError, match="max_active_runs and catchup: only a scope: interval"):
        load_spec(write(tmp_path, INCREMENTAL + "max_active_runs: 2\n"))


def test_bad_intervals_are_refused_in_one_line() -> None:
    for start, end, message in [
        ("yesterday", "2026-11-26", "start 'yesterday' is not an ISO 8601"),
        ("2026-11-26", "2026-11-25", "the end 2026-11-25 is before the start"),
    ]:
        with pytest.raises(SpecError, match=message):
            DataInterval.parse(start, end)


def test_the_cli_refuses_an_unbound_template_before_writing_anything(tmp_path: Path) -> None:
    home = tmp_path / "home"
    spec = write(tmp_path)
    runner = CliRunner()
    env = {"CKPT_HOME": str(home)}
    for args, message in [
        ([], "scope: interval: a run needs its data interval"),
        (["--interval-start", "2026-11-25"], "--interval-start: give the data interval's start"),
        (["--interval-start", "x", "--interval-end", "y"], "start 'x' is not an ISO 8601"),
    ]:
        result = runner.invoke(app, ["run", str(spec), *args], env=env)
        assert result.exit_code != 0, result.output
        assert message in result.output and len(result.output.strip().splitlines()) == 1
    assert not home.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("metastore_url", ["sqlite"], indirect=True)
def test_three_daily_intervals_each_its_own_job_one_crashed_and_resumed(
    spark: Any, tmp_path: Path, metastore_url: str
) -> None:
    from checkpointing.metastore import jobs, views
    from checkpointing.metastore.engine import Metastore
    from checkpointing.spark.runtime import SimulatedCrash
    from checkpointing.state.storage import FileSystemCheckpointStorage
    from tests.spark_pipeline import assert_matches_pandas, make_spec, run, tables, write_events

    files = sorted(write_events(tmp_path / "events").glob("*.parquet"))
    for d in range(3):  # two files land in each day's folder
        folder = tmp_path / "in" / f"date=2026-11-{24 + d}"
        folder.mkdir(parents=True)
        for f in files[2 * d : 2 * d + 2]:
            shutil.copy(f, folder / f.name)
    source = f'{{format: parquet, path: "{tmp_path}/in/date=${{DS}}/*.parquet"}}'
    sink = f'{{path: "{tmp_path}/out/date=${{DS}}", changelog: true}}'
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")

    def spec(d: int) -> Any:
        return make_spec(
            tmp_path, "daily", source, sink=sink, interval=day(24 + d), scope="interval"
        )

    assert run(spark, spec(0), metastore, storage).epochs_run == [0, 1]
    with pytest.raises(SimulatedCrash):  # the middle interval dies after its first epoch
        run(spark, spec(1), metastore, storage, crash_after_epochs=1)
    assert run(spark, spec(2), metastore, storage).epochs_run == [0, 1]
    resumed = run(spark, spec(1), metastore, storage)  # its retry resumes within the interval
    assert resumed.restored_from is not None and resumed.epochs_run == [1]
    again = run(spark, spec(0), metastore, storage)  # a finished interval: nothing to redo
    assert again.epochs_run == []

    # a late file lands in the middle interval's folder: a full refresh replaces its output
    # (exactly: not beside the old one). Without a token a try refreshes anew; the retry of a
    # refresh with its token (the DAG run's) resumes from the refresh's own checkpoint, never
    # from the checkpoints before it
    middle = "daily.20261125T000000"
    shutil.copy(files[0], tmp_path / "in" / "date=2026-11-25" / "late.parquet")
    with pytest.raises(SimulatedCrash):
        run(spark, spec(1), metastore, storage, full_refresh=True, crash_after_epochs=1)
    refresh = {"full_refresh": True, "refresh_token": "run-7"}
    with pytest.raises(SimulatedCrash):
        run(spark, spec(1), metastore, storage, crash_after_epochs=2, **refresh)
    restores = views.list_restores(metastore, middle)
    # each try reset the sink: the second removed the epoch the first had committed
    assert restores[0]["assignment"]["full_refresh"]["epochs_removed"] == 1
    floor = restores[0]["assignment"]["full_refresh"]["from"]
    retried = run(spark, spec(1), metastore, storage, **refresh)
    assert retried.restored_from is not None and retried.restored_from >= floor
    assert retried.epochs_run == [2]
    assert views.list_restores(metastore, middle)[0]["assignment"]["full_refresh"]["resumed"]
    assert run(spark, spec(1), metastore, storage).epochs_run == []  # latest: the refresh's
    incremental = make_spec(tmp_path, "inc", f'{{format: parquet, path: "{tmp_path}/in/*/*"}}')
    with pytest.raises(SpecError, match="--full-refresh: job inc is scope: incremental"):
        run(spark, incremental, metastore, storage, full_refresh=True)
    before = views.list_restores(metastore, middle)
    with pytest.raises(SpecError, match="--full-refresh starts empty: it takes no --restore 1"):
        run(spark, spec(1), metastore, storage, full_refresh=True, restore="1")
    assert views.list_restores(metastore, middle) == before  # refused before any record

    ids = [f"daily.202611{24 + d}T000000" for d in range(3)]
    assert all(jobs.get_job(metastore, i) is not None for i in ids)
    assert jobs.get_job(metastore, "daily") is None  # no job of the template itself
    for d in range(3):
        final, changelog = tables(spark, spec(d))
        read = files[2 * d : 2 * d + 2] + ([files[0]] if d == 1 else [])
        assert_matches_pandas(final, [pd.read_parquet(f) for f in read])
        assert sorted(set(changelog.epoch)) == list(range(len(read)))
        assert len(changelog) == sum(pd.read_parquet(f).user.nunique() for f in read)
        assert (tmp_path / "out" / f"date=2026-11-{24 + d}").is_dir()


@pytest.mark.parametrize("metastore_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("kind", ["delta", "s3-parquet"])
def test_a_full_refresh_resets_a_delta_table_and_an_s3_parquet_prefix(
    spark: Any, tmp_path: Path, metastore_url: str, kind: str, request: pytest.FixtureRequest
) -> None:
    """One interval written, a late file landed, then a full refresh: the Delta table is
    brought back to its creation by a RESTORE (its history kept) and written again; the S3
    prefix loses its pointer, manifests and objects, then is written again. Either way the
    output equals pandas over the interval's files, each epoch once."""
    from checkpointing.metastore.engine import Metastore
    from checkpointing.sinks import s3_parquet
    from checkpointing.state.storage import FileSystemCheckpointStorage
    from tests.delta_helpers import delta_log, read_table
    from tests.spark_pipeline import AGGS, make_spec, run, write_events

    files = sorted(write_events(tmp_path / "events").glob("*.parquet"))
    folder = tmp_path / "in" / "date=2026-11-25"
    folder.mkdir(parents=True)
    shutil.copy(files[0], folder / files[0].name)
    if kind == "delta":
        url = f"{tmp_path}/out/date=${{DS}}"
        sink = f'{{format: delta, path: "{url}"}}'
    else:
        request.getfixturevalue("executors_see_s3")
        bucket = request.getfixturevalue("s3_bucket")
        url = f"s3://{bucket}/out/date=${{DS}}"
        sink = f'{{path: "{url}", changelog: true}}'
    url = url.replace("${DS}", "2026-11-25")
    source = f'{{format: parquet, path: "{tmp_path}/in/date=${{DS}}/*.parquet"}}'
    spec = make_spec(tmp_path, "daily", source, sink=sink, interval=day(25), scope="interval")
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    assert run(spark, spec, metastore, storage).epochs_run == [0]
    shutil.copy(files[1], folder / "late.parquet")
    assert run(spark, spec, metastore, storage, full_refresh=True).epochs_run == [0, 1]

    expected = oracle.expected_aggregates(
        pd.concat(pd.read_parquet(f) for f in files[:2]), ["user"], AGGS
    )
    if kind == "delta":
        table = read_table(url, ["user"])
        operations = [
            a["commitInfo"].get("operation") for c in delta_log(url) for a in c if "commitInfo" in a
        ]
        assert "RESTORE" in operations  # back to its creation, the history kept
    else:
        table = s3_parquet.read_final(url).to_pandas().sort_values("user").reset_index(drop=True)
        assert [m["epoch"] for m in s3_parquet.committed_manifests(url)] == [0, 1]
    pd.testing.assert_frame_equal(
        table[expected.columns.tolist()], expected, check_dtype=False, check_exact=False
    )


def test_a_refresh_token_holds_for_every_try_of_a_run_and_changes_with_each_clear() -> None:
    """A retry resumes its run's refresh (the same token); a refresh backfill clears the run
    again, and that refresh is a new one (a new token: reset again, not resumed)."""
    from types import SimpleNamespace

    from checkpointing_airflow.attempts import refresh_token

    def token(try_number: int, clears: int) -> str:
        ti = SimpleNamespace(dag_id="daily", run_id="backfill__2026-11-21", try_number=try_number)
        return refresh_token({"ti": ti, "dag_run": SimpleNamespace(clear_number=clears)})

    assert token(1, 0) == token(2, 0)
    assert token(3, 1) == token(4, 1) != token(1, 0)
    assert token(5, 2) not in (token(1, 0), token(3, 1))
