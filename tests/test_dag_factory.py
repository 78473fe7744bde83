"""Pipelines deployed as DAGs (issue 3): the DAG factory, and the savepoint and deploy DAGs.

The central test runs the real thing: Airflow's dag-processor parses a DAGs folder with good
specs, a broken one and one without a DAG file. The broken spec is an import error that names the
spec file and the field, and every other pipeline is a live DAG (test g). The rest builds the
DAGs in-process and runs their task logic against a SQLite metastore.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from checkpointing import ids
from checkpointing.clock import ManualClock
from checkpointing.config import format_duration
from checkpointing.errors import CheckpointingError
from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline.spec import SpecError, load_spec
from checkpointing.restore.lookup import find_latest_valid
from checkpointing.state.storage import FileSystemCheckpointStorage
from checkpointing.status import JobStatus
from checkpointing_airflow import dag_factory, maintenance_dag
from checkpointing_airflow.dag_factory import (
    DAG_FILE,
    DeployError,
    pipeline_problems,
    plan_deploy,
    sync_dag_files,
)
from tests.entry_points import package_zip
from tests.helpers import ack_all, complete, new_coordinator, statuses

ROOT = Path(__file__).resolve().parents[1]
needs_airflow = pytest.mark.skipif(
    importlib.util.find_spec("airflow") is None, reason="Apache Airflow is not installed"
)


def write_spec(directory: Path, name: str, **fields: Any) -> Path:
    """A valid spec ``<name>.yaml`` (job ``name`` unless given), with ``fields`` on top."""
    spec = {
        "job": name,
        "source": {"format": "parquet", "path": "data/*.parquet"},
        "key": ["origin"],
        "aggregations": {"flights": "count()", "distance": "sum(distance)"},
        "sink": {"path": f"out/{name}"},
        **fields,
    }
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def write_python_spec(directory: Path, name: str, entry: str, code: Path) -> Path:
    """A Python pipeline's spec ``<name>.yaml``: the entry point, its code, a deployment."""
    spec = {"job": "py_events", "pipeline": entry, "py_files": [str(code)], "retries": 1}
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _airflow_env(home: Path, dags: Path) -> dict[str, str]:
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        # the machine is shared and loaded: parsing must not time out
        "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "300",
        "AIRFLOW__DAG_PROCESSOR__DAG_FILE_PROCESSOR_TIMEOUT": "300",
        # `airflow dags test` triggers as `dag_test`: the savepoint and deploy DAGs check that
        # the triggering user may edit the pipeline's DAG
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,dag_test:user",
    }


@pytest.fixture(scope="session")
def airflow_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Airflow configured for this session before it is first imported here: its own home and
    database, this project's plugins."""
    home = tmp_path_factory.mktemp("airflow-home")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in _airflow_env(home, home / "dags").items():
            mp.setenv(key, value)
        yield home


@pytest.fixture
def metastore(sqlite_metastore: Metastore) -> Metastore:
    """SQLite only: these tests exercise the logic above the metastore, not its backends."""
    return sqlite_metastore


# ============================================================================ real Airflow (g)

_CLI = r"""
import contextlib, io, json, sys
from airflow.cli import cli_parser
from airflow.models.dag import DagModel
from airflow.models.taskinstance import TaskInstance
from airflow.utils.session import create_session
from sqlalchemy import select

parser = cli_parser.get_parser()
out = {}
for name, argv in [
    ("migrate", ["db", "migrate"]),
    ("dag_processor", ["dag-processor", "--num-runs", "1"]),
    ("dags", ["dags", "list", "--output", "json"]),
    ("import_errors", ["dags", "list-import-errors", "--output", "json"]),
    ("local_import_errors", ["dags", "list-import-errors", "--local", "--output", "json"]),
    *[(f"test_{dag_id}", ["dags", "test", dag_id, "--conf", json.dumps(conf)])
      for dag_id, conf in json.loads(sys.argv[1]).items()],
]:
    buffer = io.StringIO()
    args = parser.parse_args(argv)
    with contextlib.redirect_stdout(buffer):
        try:
            args.func(args)
        except SystemExit:  # `dags list*` exit 1 when there are import errors, failed runs too
            pass
    out[name] = buffer.getvalue()
with create_session() as session:
    out["dag_models"] = [
        {"dag_id": d.dag_id, "fileloc": d.relative_fileloc, "is_stale": d.is_stale,
         "has_import_errors": d.has_import_errors}
        for d in session.scalars(select(DagModel))
    ]
    out["task_instances"] = {
        f"{ti.dag_id}.{ti.task_id}": [ti.state, ti.try_number]
        for ti in session.scalars(select(TaskInstance))
    }
print("@@RESULT@@" + json.dumps(out))
"""

#: the trigger forms of the runs `airflow dags test` makes
_RUNS = {
    "checkpoint_savepoint": {"pipeline": "good_a", "stop": True},
    "checkpoint_deploy": {"pipeline": "good_a", "from": "/nowhere/savepoint-9"},
    # the maintenance DAG of good_a (FINISHED): its gc runs in the worker's way
    "good_a__maintenance": {},
}


def _json_table(text: str) -> list[dict[str, Any]]:
    """The JSON table an `airflow … --output json` command printed among its log lines."""
    for line in reversed(text.splitlines()):
        if line.startswith("["):
            return json.loads(line)
    raise AssertionError(f"no JSON output in:\n{text}")


@pytest.fixture(scope="session")
def parsed_by_airflow(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """This project's dags/ plus two good specs, a broken one and one without a DAG file,
    parsed by Airflow's dag-processor into a fresh database; then a savepoint of the finished
    job ``good_a`` and a deploy from a path that is no savepoint, run by ``airflow dags test``
    (one process, once per session)."""
    if importlib.util.find_spec("airflow") is None:
        pytest.skip("Apache Airflow is not installed")
    base = tmp_path_factory.mktemp("airflow-parse")
    dags = base / "dags"
    shutil.copytree(ROOT / "dags", dags, ignore=shutil.ignore_patterns("__pycache__"))
    pipelines = dags / "pipelines"
    write_spec(
        pipelines, "good_a", schedule="@daily", tags=["team-a"], maintenance={"schedule": "@weekly"}
    )
    write_spec(pipelines, "good_b", schedule="0 3 * * *", retries=5)
    write_spec(pipelines, "broken", checkpoint={"retaind": 3})
    # Python pipelines (issue 24): the code's zip outside the DAGs folder (Airflow would parse a
    # .zip in it as packaged DAGs); one entry point builds a Pipeline, one returns a dict
    code = package_zip(base)
    write_python_spec(pipelines, "py_good", "ckpt_example.jobs:build", code)
    write_python_spec(pipelines, "py_broken", "ckpt_example.broken:returns_a_dict", code)
    sync_dag_files(pipelines)
    write_spec(pipelines, "lonely")  # after sync: no DAG file
    metastore_url = f"sqlite:///{base / 'metastore.db'}"
    Metastore(metastore_url, check_schema=False).upgrade()
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{base / 'checkpoints'}")
    finished = new_coordinator(metastore, storage, ManualClock(), job_id="good_a")
    finished.activate()
    finished.job_status_changed(JobStatus.FINISHED)
    metastore.dispose()
    env = {
        **os.environ,
        **_airflow_env(base / "home", dags),
        # no `checkpoint_metastore` connection: the hook falls back to CKPT_METASTORE_URL
        "CKPT_METASTORE_URL": metastore_url,
        "CKPT_STORAGE_URL": storage.base_url,
    }
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _CLI, json.dumps(_RUNS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("@@RESULT@@", 1)[1])
    result["seconds"] = time.monotonic() - started
    result["dags_folder"] = str(dags)
    return result


@needs_airflow
def test_g_a_broken_pipeline_yaml_does_not_break_the_other_dags(
    parsed_by_airflow: dict[str, Any],
) -> None:
    errors = {e["filepath"]: e["error"] for e in _json_table(parsed_by_airflow["import_errors"])}
    # exactly three files failed: the broken specs' DAG files and the directory check
    assert set(errors) == {
        "pipelines/broken.py",
        "pipelines/py_broken.py",
        "checkpoint_pipelines.py",
    }, errors
    assert (
        "pipelines/broken.yaml: checkpoint.retaind: unknown field (did you mean 'retained'?)"
        in errors["pipelines/broken.py"]
    )
    # a Python pipeline whose entry point returns no Pipeline: its file, the field, the reason
    assert (
        "pipelines/py_broken.yaml: pipeline: ckpt_example.broken:returns_a_dict() returned a "
        "dict, not a checkpointing.spark.Pipeline" in errors["pipelines/py_broken.py"]
    )
    assert "pipelines/lonely.yaml: no DAG file lonely.py" in errors["checkpoint_pipelines.py"]
    assert "good_a" not in errors["pipelines/broken.py"]

    # every other DAG was serialized and is live: an import error marks the DAGs of its own
    # file stale, and here it has no other DAG to hide
    listed = {d["dag_id"]: d["fileloc"] for d in _json_table(parsed_by_airflow["dags"])}
    folder = parsed_by_airflow["dags_folder"]
    assert listed == {
        "good_a": f"{folder}/pipelines/good_a.py",
        # the maintenance section's DAG, registered with the spec's own DAG file
        "good_a__maintenance": f"{folder}/pipelines/good_a.py",
        "good_b": f"{folder}/pipelines/good_b.py",
        "py_events": f"{folder}/pipelines/py_good.py",
        "nycflights13_routes": f"{folder}/pipelines/nycflights13.py",
        "nycflights13_seat_miles": f"{folder}/pipelines/nycflights13_seat_miles.py",
        "checkpoint_savepoint": f"{folder}/checkpoint_savepoint.py",
        "checkpoint_deploy": f"{folder}/checkpoint_deploy.py",
    }
    models = {m["dag_id"]: m for m in parsed_by_airflow["dag_models"]}
    assert set(models) == set(listed)
    assert all(not m["is_stale"] and not m["has_import_errors"] for m in models.values()), models

    # a plain DagBag (`--local`, what `airflow dags test` and the workers see) agrees
    local = _json_table(parsed_by_airflow["local_import_errors"])
    assert sorted(Path(e["filepath"]).name for e in local) == [
        "broken.py",
        "checkpoint_pipelines.py",
        "py_broken.py",
    ]


@needs_airflow
def test_a_savepoint_of_a_stopped_job_and_a_deploy_from_no_savepoint_fail_before_any_work(
    parsed_by_airflow: dict[str, Any],
) -> None:
    states = parsed_by_airflow["task_instances"]
    # the savepoint fails at once, once (no retries), saying why
    assert states["checkpoint_savepoint.savepoint"] == ["failed", 1]
    assert (
        "AirflowFailException: job 'good_a' is not running (status FINISHED)"
        in parsed_by_airflow["test_checkpoint_savepoint"]
    )
    # the deploy's check refuses the path; nothing is submitted
    assert states["checkpoint_deploy.check"] == ["failed", 1]
    assert states["checkpoint_deploy.run"][0] == "upstream_failed"
    assert (
        "AirflowFailException: file:///nowhere/savepoint-9/_metadata"
        in parsed_by_airflow["test_checkpoint_deploy"]
    )
    # good_a's maintenance DAG, found in good_a.py by the task runner, collected its (empty) garbage
    assert states["good_a__maintenance.gc"] == ["success", 1], states


# ============================================================================ pipeline DAGs


@needs_airflow
def test_a_spec_becomes_a_dag_named_after_its_job_with_its_deployment_fields(
    airflow_home: Path, tmp_path: Path
) -> None:
    from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator

    spec_file = write_spec(
        tmp_path,
        "routes",
        job="daily_routes",
        schedule="0 3 * * *",
        retries=4,
        retry_delay="2m",
        parallelism=3,
        max_parallelism=64,
        parallelism_on_retry=2,
        owner="data-eng",
        tags=["flights", "checkpointing"],
        alerts={
            "after_failures": 2,
            "notifiers": [
                {
                    "notifier": "airflow.providers.smtp.notifications.smtp.SmtpNotifier",
                    "args": {"to": "oncall@example.com", "subject": "{{ checkpoint_alert }}"},
                    "on": ["checkpoint_failures", "restore_fallback"],
                }
            ],
        },
    )
    assert sync_dag_files(tmp_path) == ([tmp_path / "routes.py"], [])
    spec = load_spec(spec_file)

    dag = dag_factory.pipeline_dag(tmp_path / "routes.py")

    assert dag.dag_id == "daily_routes"
    assert set(dag.tags) == {"checkpointing", "flights"}
    assert dag.schedule == "0 3 * * *"
    assert (dag.max_active_runs, dag.catchup) == (1, False)
    assert "`distance = sum(distance)`" in dag.doc_md and str(spec.spec_path) in dag.doc_md
    assert dag.params["restore"] == "latest" and dag.params["parallelism"] == 3
    assert dag.params.get_param("parallelism").schema["maximum"] == 64
    (run,) = dag.tasks
    assert isinstance(run, CheckpointedSparkSubmitOperator) and run.task_id == "run"
    assert (run.retries, run.retry_delay, run.owner) == (4, timedelta(minutes=2), "data-eng")
    assert run.pipeline == str(spec.spec_path)
    assert run.parallelism_on_retry == 2
    assert run.metastore_conn_id == "checkpoint_metastore"
    assert run._conn_id == "spark_default"  # SparkSubmitOperator's Spark connection
    # the spec's alerts: Airflow notifiers built from their import path, by alert kind
    assert run.alert_after_failures == 2
    assert set(run.alerts) == {"checkpoint_failures", "restore_fallback"}
    (smtp,) = run.alerts["checkpoint_failures"]
    assert type(smtp).__name__ == "SmtpNotifier" and smtp.to == "oncall@example.com"
    # the pipeline's sink is the task's Asset outlet (data-aware scheduling downstream)
    (outlet,) = run.outlets
    assert outlet.uri == (tmp_path / spec.sink.path).resolve().as_uri()
    assert outlet.extra == {"pipeline": "daily_routes", "format": "parquet"}

    # the trigger form's values reach the operator as it reads them
    env = dag.get_template_env()
    assert env.from_string(run.restore).render(params={"restore": "7"}) == "7"
    run.parallelism = env.from_string(run.parallelism).render(params={"parallelism": 5})
    assert (run.parallelism_for(spec, 1), run.parallelism_for(spec, 2)) == (5, 2)

    # operator arguments on top of the spec (what `make demo` builds its DAG with)
    drill = dag_factory.pipeline_dag(
        tmp_path / "routes.py",
        operator_args={"fail_first_try_after_epochs": 3, "conf": {"spark.ui.enabled": "false"}},
    )
    (run,) = drill.tasks
    assert run.fail_first_try_after_epochs == 3 and run.retries == 4
    assert run.conf == {"spark.ui.enabled": "false"}

    # a Python pipeline (issue 24): the DAG of the job its code builds, documented as code
    code = package_zip(tmp_path)
    write_python_spec(tmp_path, "py", "ckpt_example.jobs:build", code)
    sync_dag_files(tmp_path)
    python = dag_factory.pipeline_dag(tmp_path / "py.py")
    assert python.dag_id == "py_events" and python.params["parallelism"] == 2
    assert "`ckpt_example.jobs:build` (Python pipeline; stages `AggregationStage(" in python.doc_md
    assert python.description.endswith("Python pipeline ckpt_example.jobs:build by user → out")
    assert str(code) in python.doc_md
    (run,) = python.tasks
    assert run.retries == 1 and run.pipeline == str(tmp_path / "py.yaml")

    # a pipeline with static tables: the trigger form can accept a restore over changed ones
    assert "allow_changed_tables" not in dag.params
    seat_miles = dag_factory.pipeline_dag(
        ROOT / "dags" / "pipelines" / "nycflights13_seat_miles.py"
    )
    assert seat_miles.params["allow_changed_tables"] is False
    (run,) = seat_miles.tasks
    rendered = env.from_string(run.allow_changed_tables)
    assert rendered.render(params={"allow_changed_tables": True}) == "True"


@needs_airflow
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"schedule": "61 * * * *"}, r"routes\.yaml: schedule: .*out of range.*'61 \* \* \* \*'"),
        ({"schedule": "every day"}, r"routes\.yaml: schedule: .*'every day'"),
        ({"tags": ["t" * 101]}, r"routes\.yaml: tags: 't+' is longer than 100 characters"),
        ({"retrys": 3}, r"routes\.yaml: retrys: unknown field \(did you mean 'retries'\?\)"),
        ({"retry_delay": "soon"}, r"routes\.yaml: retry_delay: expected a duration"),
        ({"owner": 7}, r"routes\.yaml: owner: Input should be a valid string"),
        (
            {"maintenance": {"keep_history": "soon"}},
            r"routes\.yaml: maintenance\.keep_history: expected a duration",
        ),
        (
            {"maintenance": {"scheduel": "@daily"}},
            r"routes\.yaml: maintenance\.scheduel: unknown field \(did you mean 'schedule'\?\)",
        ),
        (
            {"maintenance": {"schedule": "61 * * * *"}},
            r"routes\.yaml: maintenance\.schedule: .*out of range.*'61 \* \* \* \*'",
        ),
        (
            {"alerts": {"notifiers": [{"notifier": "no_such.module.Notifier"}]}},
            r"routes\.yaml: alerts\.notifiers: ModuleNotFoundError: No module named 'no_such'",
        ),
        (
            {"alerts": {"notifiers": [{"notifier": "a.B", "on": ["checkpoint_failure"]}]}},
            r"routes\.yaml: alerts\.notifiers\.0\.on: .*unknown alert kind\(s\) \['checkpoint_fail",
        ),
        (
            {"maintenance": {"vacuum_sink": True}},
            r"routes\.yaml: maintenance\.vacuum_sink: only a format: delta sink is vacuumed",
        ),
    ],
)
def test_a_bad_deployment_field_is_an_error_naming_the_file_and_the_field(
    airflow_home: Path, tmp_path: Path, fields: dict[str, Any], message: str
) -> None:
    write_spec(tmp_path, "routes", **fields)
    with pytest.raises(SpecError, match=message):
        dag_factory.pipeline_dag(tmp_path / "routes.py")


@needs_airflow
def test_a_maintenance_section_adds_a_gc_dag_that_prunes_the_pipelines_old_history(
    airflow_home: Path, metastore: Metastore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from airflow.sdk.exceptions import AirflowSkipException

    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'checkpoints'}")
    maintenance = {"schedule": "0 4 * * 0", "keep_history": "7d", "grace": "1h"}
    write_spec(
        tmp_path,
        "routes",
        storage=storage.base_url,
        owner="data-eng",
        tags=["flights"],
        maintenance=maintenance,
    )
    sync_dag_files(tmp_path)
    spec = load_spec(tmp_path / "routes.yaml")
    assert spec.maintenance is not None and spec.maintenance.keep_history == timedelta(days=7)

    dag = dag_factory.build_maintenance_dag(spec)
    assert dag.dag_id == dag_factory.maintenance_dag_id("routes") == "routes__maintenance"
    assert dag.schedule == "0 4 * * 0" and (dag.max_active_runs, dag.catchup) == (1, False)
    assert set(dag.tags) == {"checkpointing", "flights"}
    (gc,) = dag.tasks
    assert (gc.task_id, gc.owner, gc.retries) == ("gc", "data-eng", 0)
    assert f"older than {format_duration(timedelta(days=7))}" in dag.doc_md
    # the pipeline's own DAG is what it was
    pipeline = dag_factory.pipeline_dag(tmp_path / "routes.py")
    assert pipeline.dag_id == "routes" and [t.task_id for t in pipeline.tasks] == ["run"]
    assert pipeline.schedule is None

    with pytest.raises(AirflowSkipException, match="never ran"):
        dag_factory.collect_garbage(spec, metastore)
    now = datetime.now(UTC)
    job = new_coordinator(
        metastore, storage, ManualClock(now - timedelta(days=40)), job_id="routes", retained=1
    )
    job.activate()
    job.job_status_changed(JobStatus.RUNNING)
    for _ in range(3):
        complete(job)
    late = storage.write_bytes(f"{storage.job_url('routes')}/chk-1/late-ack", b"x" * 100).url
    with pytest.raises(AirflowSkipException, match="RUNNING"):
        dag_factory.collect_garbage(spec, metastore)
    assert set(statuses(metastore, "routes")) == {1, 2, 3} and storage.exists(late)

    job.job_status_changed(JobStatus.FINISHED)
    caplog.set_level(logging.INFO, logger="checkpointing_airflow.maintenance_dag")
    plan = dag_factory.collect_garbage(spec, metastore, clock=ManualClock(now + timedelta(hours=2)))
    assert plan.checkpoints == [1, 2] and not plan.errors
    assert statuses(metastore, "routes") == {3: "COMPLETED"}
    assert not storage.exists(late) and plan.orphan_bytes == 100
    assert "job routes: deleted 2 checkpoint row(s)" in caplog.text
    assert "1 orphan file(s) (100 bytes)" in caplog.text
    assert find_latest_valid(metastore, storage, "routes").checkpoint_id == 3
    assert maintenance_dag.summary(plan)["orphan_bytes"] == 100


def test_every_spec_needs_its_own_dag_file_and_a_job_id_of_its_own(tmp_path: Path) -> None:
    write_spec(tmp_path, "a")
    write_spec(tmp_path, "b", job="same")
    write_spec(tmp_path, "c", job="same")
    (tmp_path / "d.yml").write_text("job: d\n")
    write_spec(tmp_path, "e", maintenance={})  # its DAG e__maintenance
    write_spec(tmp_path, "f", job="e__maintenance")
    (tmp_path / "gone.py").write_text(DAG_FILE)  # generated, its spec deleted
    (tmp_path / "custom.py").write_text("# someone's own DAG file\n")

    problems = "\n".join(pipeline_problems(tmp_path))
    assert f"{tmp_path}/a.yaml: no DAG file a.py next to it" in problems
    assert f"{tmp_path}: job: 'same' is the job of b.yaml, c.yaml" in problems
    assert f"{tmp_path}/d.yml: a pipeline spec must end in .yaml" in problems
    assert "job: 'e__maintenance' of f.yaml is the maintenance DAG's id of e.yaml" in problems
    with pytest.raises(dag_factory.PipelineSetError, match=r"a\.yaml: no DAG file"):
        dag_factory.raise_for_pipeline_problems(tmp_path)

    written, deleted = sync_dag_files(tmp_path)
    assert [p.name for p in written] == ["a.py", "b.py", "c.py", "e.py", "f.py"]
    assert deleted == [tmp_path / "gone.py"]  # an edited DAG file is never deleted
    assert (tmp_path / "custom.py").exists() and (tmp_path / "a.py").read_text() == DAG_FILE
    assert "no DAG file" not in "\n".join(pipeline_problems(tmp_path))


def test_the_projects_pipelines_each_have_their_dag_file(capsys: pytest.CaptureFixture) -> None:
    pipelines = ROOT / "dags" / "pipelines"
    assert pipeline_problems(pipelines) == []
    for spec in dag_factory.spec_files(pipelines):
        assert spec.with_suffix(".py").read_text() == DAG_FILE, spec
    assert dag_factory.main(["check", str(pipelines)]) == 0
    assert "ok nycflights13.yaml: DAG nycflights13_routes" in capsys.readouterr().out


def test_the_check_command_names_a_broken_spec(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    write_spec(tmp_path, "routes", parallelism=0)
    assert dag_factory.main(["sync", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert f"wrote {tmp_path}/routes.py" in captured.out
    assert "routes.yaml: parallelism: Input should be greater than or equal to 1" in captured.err


# ============================================================================ savepoints


@needs_airflow
def test_the_savepoint_dag_asks_for_the_pipeline_stop_and_timeout(
    airflow_home: Path, tmp_path: Path
) -> None:
    write_spec(tmp_path, "a", job="job_a")
    write_spec(tmp_path, "b", job="job_b")
    (tmp_path / "broken.yaml").write_text("job: [\n")

    dag = dag_factory.build_savepoint_dag(tmp_path)

    assert dag.dag_id == "checkpoint_savepoint" and dag.schedule is None
    pipeline = dag.params.get_param("pipeline").schema
    assert pipeline["examples"] == ["job_a", "job_b"]  # proposals; the task refuses others
    assert pipeline["pattern"] == dag_factory.JOB_ID_PATTERN == ids._ID.pattern  # same ids
    assert dag.params["stop"] is False and dag.params.get_param("stop").schema["type"] == "boolean"
    assert dag.params["timeout"] == 600
    (task,) = dag.tasks
    assert (task.task_id, task.retries) == ("savepoint", 0)


@needs_airflow
def test_a_savepoint_of_a_job_that_is_not_running_fails_at_once_with_the_reason(
    airflow_home: Path, metastore: Metastore, tmp_path: Path
) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'checkpoints'}")
    idle = new_coordinator(metastore, storage, ManualClock(), job_id="idle")
    idle.activate()
    idle.job_status_changed(JobStatus.FINISHED)
    for job, reason in [("idle", "job 'idle' is not running"), ("nope", "unknown job 'nope'")]:
        started = time.monotonic()
        with pytest.raises(AirflowFailException, match=reason):
            dag_factory.savepoint_from_params(
                {"pipeline": job, "stop": False, "timeout": 600},
                metastore=metastore,
                requested_by="airflow:test",
            )
        assert time.monotonic() - started < 30  # no waiting for a job that cannot answer


@needs_airflow
def test_a_savepoint_of_a_running_job_returns_its_path(
    airflow_home: Path, metastore: Metastore, tmp_path: Path
) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'checkpoints'}")
    jobs = {name: new_coordinator(metastore, storage, ManualClock(), job_id=name) for name in "ab"}
    for job in jobs.values():
        job.activate()
        job.job_status_changed(JobStatus.RUNNING)
    with pytest.raises(
        AirflowFailException, match=r"request 1 of job 'a' is still QUEUED after 0\.3 s"
    ):
        dag_factory.savepoint_from_params(
            {"pipeline": "a", "timeout": 0.3}, metastore=metastore, requested_by="t", poll=0.05
        )

    done = threading.Event()
    failures: list[BaseException] = []

    def epoch_boundaries(job: Any) -> None:  # the running job takes queued requests
        try:
            while not done.is_set():
                for pending in job.process_requests():
                    ack_all(job, pending)
                time.sleep(0.05)
        except BaseException as exc:
            failures.append(exc)
            raise

    worker = threading.Thread(target=epoch_boundaries, args=(jobs["b"],))
    worker.start()
    try:
        state = dag_factory.savepoint_from_params(
            {"pipeline": "b", "stop": True, "timeout": 120},
            metastore=metastore,
            requested_by="airflow:checkpoint_savepoint/manual__1",
            poll=0.05,
        )
    finally:
        done.set()
        worker.join()
    assert not failures
    assert state.succeeded and state.checkpoint_type == "SAVEPOINT_THEN_STOP"
    assert state.savepoint_path == storage.savepoint_url("b", state.checkpoint_id)
    assert state.requested_by == "airflow:checkpoint_savepoint/manual__1"


# ============================================================================ deploys


@pytest.fixture
def savepoint(metastore: Metastore, tmp_path: Path) -> tuple[Any, str]:
    """Job ``live`` (max parallelism 16), still running, with a completed savepoint."""
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'checkpoints'}")
    job = new_coordinator(metastore, storage, ManualClock(), job_id="live")
    job.activate()
    job.job_status_changed(JobStatus.RUNNING)
    return job, complete(job, savepoint=True).location


def test_a_deploy_is_checked_before_anything_is_submitted(
    metastore: Metastore, tmp_path: Path, savepoint: tuple[Any, str]
) -> None:
    job, path = savepoint
    specs = tmp_path / "pipelines"
    specs.mkdir()
    pipelines = {
        "live": write_spec(specs, "live", max_parallelism=16),
        "live_wide": write_spec(specs, "live_wide", job="live", max_parallelism=128),
    }
    storage_url = job.storage.base_url

    def deploy(pipeline: str = "live", source: str = path, parallelism: int | None = 3) -> Any:
        return plan_deploy(
            pipelines, pipeline, source, parallelism, metastore=metastore, storage_url=storage_url
        )

    with pytest.raises(DeployError, match="job live is running: stop it first"):
        deploy()
    job.job_status_changed(JobStatus.FINISHED)

    plan = deploy()
    assert {k: plan[k] for k in ("job", "pipeline", "restore", "parallelism")} == {
        "job": "live",
        "pipeline": str(pipelines["live"]),
        "restore": path,
        "parallelism": 3,
    }
    assert f"SAVEPOINT 1 of job live ({path}/_metadata), reassigned to 3" in plan["starts_from"]
    assert deploy(source=path.removeprefix("file://"))["restore"] == path  # a plain path
    assert deploy(source="latest", parallelism=None)["parallelism"] == 2  # the spec's
    assert "savepoint 1" in deploy(source="latest")["starts_from"].lower()

    refusals = [
        (dict(pipeline="nope"), r"pipeline: unknown pipeline 'nope' \(known: live, live_wide\)"),
        (dict(parallelism=17), r"parallelism: 17 is outside 1\.\.16"),
        (dict(pipeline="live_wide"), "max parallelism 16, the spec 128"),
        (dict(source="yesterday"), "from: expected 'latest' or a savepoint path"),
        (dict(source=f"{tmp_path}/not-a-savepoint"), "not-a-savepoint/_metadata"),
        (dict(source="/elsewhere/../etc"), "not a normalised path"),
    ]
    for kwargs, message in refusals:
        with pytest.raises(CheckpointingError, match=message):
            deploy(**kwargs)

    fresh = write_spec(specs, "fresh")
    assert (
        "empty state"
        in plan_deploy(
            {"fresh": fresh}, "fresh", "latest", None, metastore=metastore, storage_url=storage_url
        )["starts_from"]
    )


@needs_airflow
def test_the_deploy_dag_checks_then_runs_what_it_checked(
    airflow_home: Path, metastore: Metastore, tmp_path: Path
) -> None:
    from airflow.sdk import XComArg
    from airflow.sdk.exceptions import AirflowFailException

    write_spec(tmp_path, "b", job="job_b")
    write_spec(tmp_path, "a", job="job_a")

    dag = dag_factory.build_deploy_dag(tmp_path)

    assert dag.dag_id == "checkpoint_deploy"
    assert dag.params.get_param("pipeline").schema["enum"] == ["job_a", "job_b"]
    assert dag.params["from"] == "latest" and dag.params["parallelism"] is None
    check, run = dag.get_task("check"), dag.get_task("run")
    assert check.retries == 0 and run.upstream_task_ids == {"check"}
    for field in ("pipeline", "restore", "parallelism"):
        value = getattr(run, field)
        assert isinstance(value, XComArg) and value.operator is check and value.key == field
    assert run.retries == 2  # the spec default; retries resume from the latest checkpoint

    with pytest.raises(AirflowFailException, match="pipeline: unknown pipeline 'job_c'"):
        dag_factory.deploy_plan_from_params(
            {"pipeline": "job_c", "from": "latest", "parallelism": None},
            pipelines=dag_factory.known_pipelines(tmp_path),
            metastore=metastore,
        )
