"""Issue 10 §4: the generic DAGs act only for users who may edit the target pipeline, a restore
from another job's state must be asked for, and credentials stay off spark-submit's command line.

- ``checkpoint_savepoint`` and ``checkpoint_deploy`` run by ``airflow dags test`` (real Airflow,
  SQLite) for a triggering user whose role may trigger nothing but read: both refuse before any
  work, saying who may not edit what; the permission check itself against Airflow's real
  SimpleAuthManager, including multi-team users;
- a restore from another job's savepoint through the deploy's check and ``ckpt restore-plan``:
  refused unless asked for, and then recorded in the decision (SQLite and PostgreSQL);
- the operator on YARN: spark-submit (a stand-in script on ``PATH`` that records its argv and
  environment) gets the metastore URL and the AWS keys in its environment, never as ``--conf``;
  cluster deploy mode is refused; every credential is masked by its variable's name.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from checkpointing.cli import app as ckpt_app
from checkpointing.clock import ManualClock
from checkpointing.metastore.engine import Metastore
from checkpointing.restore.lookup import ForeignSnapshotError, preview_restore, record_restore
from checkpointing.state.storage import FileSystemCheckpointStorage
from checkpointing.status import JobStatus
from tests.airflow_harness import migrate_airflow_db
from tests.helpers import complete, new_coordinator, restore_rows

ROOT = Path(__file__).resolve().parents[1]
needs_airflow = pytest.mark.skipif(
    importlib.util.find_spec("airflow") is None, reason="Apache Airflow is not installed"
)


def write_spec(directory: Path, job: str, **fields: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    spec = {
        "job": job,
        "source": {"format": "parquet", "path": "data/*.parquet"},
        "key": ["origin"],
        "aggregations": {"flights": "count()"},
        "sink": {"path": f"out/{job}"},
        "max_parallelism": 16,
        **fields,
    }
    path = directory / f"{job}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def airflow_env(home: Path, dags: Path, users: str) -> dict[str, str]:
    return {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "300",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": users,
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "plugins"), str(ROOT)]),
    }


@pytest.fixture(scope="module")
def airflow_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Airflow configured in this process: its own home, SimpleAuthManager with the users each
    test sets."""
    home = tmp_path_factory.mktemp("airflow-permissions")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in airflow_env(home, home / "dags", "admin:admin").items():
            mp.setenv(key, value)
        yield home


@pytest.fixture
def two_jobs(metastore: Metastore, tmp_path: Path) -> tuple[FileSystemCheckpointStorage, str]:
    return seed_two_jobs(metastore, tmp_path)


def seed_two_jobs(metastore: Metastore, tmp_path: Path) -> tuple[FileSystemCheckpointStorage, str]:
    """Jobs ``mine`` (a checkpoint) and ``theirs`` (a savepoint), both FINISHED, in one storage;
    returns the storage and the path of ``theirs``'s savepoint."""
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'checkpoints'}")
    clock = ManualClock()
    for job in ("mine", "theirs"):
        coordinator = new_coordinator(metastore, storage, clock, job_id=job)
        coordinator.activate()
        coordinator.job_status_changed(JobStatus.RUNNING)
        completed = complete(coordinator, savepoint=job == "theirs")
        coordinator.job_status_changed(JobStatus.FINISHED)
    return storage, completed.location


# ============================================================================ the generic DAGs

_DAGS_TEST = r"""
import contextlib, io, json, sys
from airflow.cli import cli_parser
from airflow.models.taskinstance import TaskInstance
from airflow.utils.session import create_session
from sqlalchemy import select

parser = cli_parser.get_parser()
out = {}
for name, argv in [
    (dag_id, ["dags", "test", dag_id, "--conf", json.dumps(conf)])
    for dag_id, conf in json.loads(sys.argv[1]).items()
]:
    buffer = io.StringIO()
    args = parser.parse_args(argv)
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        try:
            args.func(args)
        except SystemExit:
            pass
    out[name] = buffer.getvalue()
with create_session() as session:
    out["task_instances"] = {
        f"{ti.dag_id}.{ti.task_id}": ti.state for ti in session.scalars(select(TaskInstance))
    }
print("@@RESULT@@" + json.dumps(out))
"""


@needs_airflow
def test_the_generic_dags_refuse_a_user_who_may_not_edit_the_pipeline(tmp_path: Path) -> None:
    """``airflow dags test`` triggers as user ``dag_test``; here a viewer, who may trigger
    nothing in a real deployment but stands for a user allowed to trigger the generic DAGs and
    not to edit the pipeline. Before the check, the savepoint went ahead (and failed only
    because the job is not running) and the deploy's check passed and submitted the job.
    SQLite only: what is tested is Airflow's side."""
    url = f"sqlite:///{tmp_path / 'metastore.db'}"
    Metastore(url, check_schema=False).upgrade()
    metastore = Metastore(url)
    storage, _ = seed_two_jobs(metastore, tmp_path)
    dags = tmp_path / "dags"
    for name in ("checkpoint_savepoint.py", "checkpoint_deploy.py"):
        dags.mkdir(exist_ok=True)
        shutil.copy(ROOT / "dags" / name, dags / name)
    write_spec(dags / "pipelines", "mine")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "CKPT_"))},
        **airflow_env(tmp_path / "home", dags, "admin:admin,dag_test:viewer"),
        "CKPT_METASTORE_URL": url,
        "CKPT_STORAGE_URL": storage.base_url,
    }
    migrate_airflow_db(env)  # `airflow db migrate`'s database (a copy, see there)
    runs = {
        "checkpoint_savepoint": {"pipeline": "mine", "stop": True},
        "checkpoint_deploy": {"pipeline": "mine", "from": "latest"},
    }
    proc = subprocess.run(
        [sys.executable, "-c", _DAGS_TEST, json.dumps(runs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.split("@@RESULT@@", 1)[1])
    refused = "user 'dag_test' may not edit the DAG mine"
    assert refused in out["checkpoint_savepoint"], out["checkpoint_savepoint"][-3000:]
    assert "is not running" not in out["checkpoint_savepoint"]  # refused before the metastore
    assert refused in out["checkpoint_deploy"], out["checkpoint_deploy"][-3000:]
    states = out["task_instances"]
    assert states["checkpoint_savepoint.savepoint"] == "failed"
    assert states["checkpoint_deploy.check"] == "failed"
    assert states["checkpoint_deploy.run"] == "upstream_failed"  # nothing submitted
    assert restore_rows(metastore, "mine") == []
    metastore.dispose()


@needs_airflow
def test_the_permission_check_asks_the_auth_manager_for_the_triggering_user(
    airflow_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from checkpointing_airflow.permissions import (
        PermissionRefused,
        authorize_run,
        authorize_trigger,
    )

    monkeypatch.setenv(
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS",
        "ada:admin,uma:user,vic:viewer,nobody:,alice:user:team_a",
    )
    monkeypatch.setenv("AIRFLOW__CORE__MULTI_TEAM", "True")
    assert authorize_trigger("ada", "routes") == "ada"
    assert authorize_trigger("uma", "routes") == "uma"
    assert authorize_trigger("alice", "routes", team_name="team_a") == "alice"
    refusals = [
        ("vic", None, "user 'vic' may not edit the DAG routes"),
        ("nobody", None, "user 'nobody' may not edit"),
        ("mallory", None, "user 'mallory' may not edit"),  # unknown to the auth manager
        ("alice", "team_b", "user 'alice' may not edit"),  # another team's pipeline
        (None, None, "the run has no triggering user"),
        ("", None, "the run has no triggering user"),
    ]
    for user, team, message in refusals:
        with pytest.raises(PermissionRefused, match=message):
            authorize_trigger(user, "routes", team_name=team)

    class Run:  # what the task SDK's DagRun carries for the check
        triggering_user_name = "uma"
        team_name = None

    authorize_run(Run(), "routes", jobs=["routes"])
    with pytest.raises(AirflowFailException, match=r"unknown pipeline 'other' \(known: routes\)"):
        authorize_run(Run(), "other", jobs=["routes"])  # only the specs of the DAG's folder
    Run.triggering_user_name = "vic"
    with pytest.raises(AirflowFailException, match="user 'vic' may not edit the DAG routes"):
        authorize_run(Run(), "routes", jobs=["routes"])

    # the compose sandbox: every visitor is an admin
    monkeypatch.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS", "True")
    assert authorize_trigger("Anonymous", "routes") == "Anonymous"
    # an auth manager whose users a task cannot look up (FAB, Keycloak): refused, not guessed
    monkeypatch.setenv(
        "AIRFLOW__CORE__AUTH_MANAGER",
        "airflow.api_fastapi.auth.managers.base_auth_manager.BaseAuthManager",
    )
    with pytest.raises(PermissionRefused, match="BaseAuthManager cannot be asked from a task"):
        authorize_trigger("ada", "routes")


@needs_airflow
def test_a_pipeline_dags_chosen_restore_needs_the_edit_right_as_in_the_api(
    airflow_home: Path,
    metastore: Metastore,
    two_jobs: tuple[FileSystemCheckpointStorage, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 28: the pipeline DAG's **Restore from** was gated by the trigger right alone, while
    the API's "Restore from here" needs edit. A try (what ``execute`` asks before any
    coordinator or spark-submit) now asks the auth manager for edit when the restore is chosen
    (not ``latest``); a viewer's run is refused, an editor's goes ahead. Issue 38: so does every
    retry, and so do the other edits (parallelism, allow_changed_tables, full refresh)."""
    from airflow.sdk.exceptions import AirflowFailException

    from checkpointing.pipeline.spec import load_spec
    from checkpointing_airflow.pipeline_dag import build_pipeline_dag

    storage, _ = two_jobs
    spec = load_spec(
        write_spec(tmp_path / "pipelines", "mine", storage=storage.base_url, parallelism=1)
    )
    monkeypatch.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS", "uma:user,vic:viewer")
    (run,) = build_pipeline_dag(spec).tasks
    assert run.authorize_restore is True
    run.parallelism = 1  # as rendered from the trigger form

    class Ti:
        dag_id, run_id, try_number = "mine", "manual__1", 1

    class DagRun:
        triggering_user_name: str | None = "vic"
        team_name = None

    context: Any = {"ti": Ti(), "dag_run": DagRun()}
    for chosen in ("1", "none"):
        run.restore = chosen
        match = rf"^restore '{chosen}': user 'vic' may not edit the DAG mine"
        with pytest.raises(AirflowFailException, match=match):
            run.plan_try(context, spec, metastore, storage.base_url)
    run.restore = "latest"  # what a scheduled run or a plain trigger restores: no edit needed
    assert run.plan_try(context, spec, metastore, storage.base_url) == ("latest", 1)
    DagRun.triggering_user_name = None
    run.restore = "1"
    with pytest.raises(AirflowFailException, match="the run has no triggering user"):
        run.plan_try(context, spec, metastore, storage.base_url)
    DagRun.triggering_user_name = "uma"
    assert run.plan_try(context, spec, metastore, storage.base_url) == ("1", 1)
    # issue 38: every try asks again, and every edit the API keeps for editors is one here too
    DagRun.triggering_user_name = "vic"
    Ti.try_number = 2  # a retry (or a cleared task): its plan would fall back to restore "1"
    with pytest.raises(AirflowFailException, match=r"^restore '1': user 'vic' may not edit"):
        run.plan_try(context, spec, metastore, storage.base_url)
    run.restore = "latest"
    for field, value, said in (
        ("parallelism", 3, r"parallelism 3 \(the spec's: 1\)"),
        ("allow_changed_tables", "True", "allow_changed_tables"),
        ("full_refresh", "true", "full refresh"),
    ):
        before = getattr(run, field)
        setattr(run, field, value)
        for try_number in (1, 2):
            Ti.try_number = try_number
            with pytest.raises(AirflowFailException, match=rf"^{said}: user 'vic' may not edit"):
                run.plan_try(context, spec, metastore, storage.base_url)
        setattr(run, field, before)
    assert restore_rows(metastore, "mine") == []  # refused before any restore was planned
    Ti.try_number = 2  # the run's own choices (latest, the spec's parallelism) need no edit:
    # the retry restores the job's latest checkpoint
    assert run.plan_try(context, spec, metastore, storage.base_url) == ("1", 1)
    Ti.try_number = 1
    # a deployment whose auth manager a task cannot ask turns the check off explicitly
    (unchecked,) = build_pipeline_dag(spec, operator_args={"authorize_restore": False}).tasks
    unchecked.restore, unchecked.parallelism = "1", 1
    DagRun.triggering_user_name = "vic"
    assert unchecked.plan_try(context, spec, metastore, storage.base_url) == ("1", 1)


@needs_airflow
def test_a_retry_takes_a_recorded_plan_only_at_the_parallelism_its_run_chose(
    airflow_home: Path,
    metastore: Metastore,
    two_jobs: tuple[FileSystemCheckpointStorage, str],
    tmp_path: Path,
) -> None:
    """Review of issue 38: a retry took the parallelism of any PLANNED restore row for its
    attempt id, which a driver may write. A row whose parallelism is not what the run's
    rendered fields give is not the failure callback's: the retry computes its own plan."""
    from datetime import UTC, datetime

    from checkpointing.metastore.models import RestoreEvent
    from checkpointing.pipeline.spec import load_spec
    from checkpointing_airflow.attempts import attempt_id
    from checkpointing_airflow.pipeline_dag import build_pipeline_dag

    storage, _ = two_jobs
    spec = load_spec(
        write_spec(tmp_path / "pipelines", "mine", storage=storage.base_url, parallelism=1)
    )
    (run,) = build_pipeline_dag(spec).tasks
    run.parallelism, run.restore = 1, "latest"  # as rendered from a plain trigger

    class Ti:
        dag_id, run_id, try_number = "mine", "manual__1", 2

    class DagRun:
        triggering_user_name: str | None = None
        team_name = None

    planted = attempt_id(Ti.dag_id, Ti.run_id, 2)
    with metastore.transaction() as s:  # what a driver of the job could write
        s.add(
            RestoreEvent(
                job_id="mine",
                attempt=planted,
                checkpoint_id=None,
                parallelism=7,
                status="PLANNED",
                created_at=datetime.now(UTC),
            )
        )
    context: Any = {"ti": Ti(), "dag_run": DagRun()}
    assert run.plan_try(context, spec, metastore, storage.base_url) == ("1", 1)


# ============================================================================ another job's state


def test_a_restore_from_another_jobs_savepoint_must_be_asked_for_and_is_recorded(
    metastore: Metastore, two_jobs: tuple[FileSystemCheckpointStorage, str]
) -> None:
    storage, theirs = two_jobs
    with pytest.raises(ForeignSnapshotError, match="of job theirs, not of job mine"):
        preview_restore(metastore, storage, "mine", parallelism=2, source=theirs)
    # its own savepoint path is no problem
    preview = preview_restore(
        metastore, storage, "theirs", parallelism=2, source=theirs, deep=False
    )
    assert preview.decision.from_job_id is None

    allowed = preview_restore(
        metastore, storage, "mine", parallelism=2, source=theirs, allow_other_job=True
    )
    decision = allowed.decision
    assert (decision.job_id, decision.from_job_id) == ("mine", "theirs")
    assert "of another job, theirs" in decision.describe()
    assert allowed.to_dict()["from_job_id"] == "theirs"
    record_restore(metastore, decision, attempt="a1", parallelism=2)
    (row,) = restore_rows(metastore, "mine")
    assert "of another job, theirs" in (row.message or "")


def test_ckpt_restore_plan_refuses_another_jobs_savepoint_unless_allowed(
    metastore: Metastore, two_jobs: tuple[FileSystemCheckpointStorage, str]
) -> None:
    storage, theirs = two_jobs
    runner = CliRunner()
    base = ["--metastore-url", metastore.url, "--storage-url", storage.base_url]
    plan = ["restore-plan", "mine", "--parallelism", "2", "--restore", theirs]
    refused = runner.invoke(ckpt_app, [*base, *plan])
    assert refused.exit_code != 0
    assert "of job theirs, not of job mine" in refused.output
    assert "--allow-other-job" in refused.output
    allowed = runner.invoke(ckpt_app, [*base, *plan, "--allow-other-job", "--json"])
    assert allowed.exit_code == 0, allowed.output
    assert json.loads(allowed.output)["from_job_id"] == "theirs"
    assert restore_rows(metastore, "mine") == []  # a dry run


@needs_airflow
def test_the_deploy_check_refuses_another_jobs_savepoint_unless_allowed(
    airflow_home: Path,
    metastore: Metastore,
    two_jobs: tuple[FileSystemCheckpointStorage, str],
    tmp_path: Path,
) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from checkpointing_airflow import dag_factory

    storage, theirs = two_jobs
    pipelines = {"mine": write_spec(tmp_path / "pipelines", "mine", storage=storage.base_url)}
    params = {"pipeline": "mine", "from": theirs, "parallelism": 2}
    with pytest.raises(AirflowFailException, match="of job theirs, not of job mine"):
        dag_factory.deploy_plan_from_params(params, pipelines=pipelines, metastore=metastore)
    plan = dag_factory.deploy_plan_from_params(
        {**params, "allow_other_job": True}, pipelines=pipelines, metastore=metastore
    )
    assert plan["allow_other_job"] is True
    assert plan["starts_from"].endswith("(another job's: allowed explicitly)")

    dag = dag_factory.build_deploy_dag(tmp_path / "pipelines")
    assert dag.params["allow_other_job"] is False
    assert dag.get_task("run").allow_other_job.key == "allow_other_job"  # what check decided
    # issue 38: a cleared or retried deploy acts on the same restore: every try asks again
    assert dag.get_task("run").authorize_restore is True
    unchecked = dag_factory.build_deploy_dag(tmp_path / "pipelines", check_permissions=False)
    assert unchecked.get_task("run").authorize_restore is False


@needs_airflow
def test_a_deploy_from_another_jobs_state_needs_the_right_to_read_that_job(
    airflow_home: Path,
    metastore: Metastore,
    two_jobs: tuple[FileSystemCheckpointStorage, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 28: ``allow_other_job`` let a user who may edit ``mine`` start it from ``theirs``'s
    savepoint without any right on ``theirs``: its state then flowed into ``mine``'s sink. The
    deploy's check (the code its ``check`` task runs) now asks the auth manager whether the
    triggering user may read the source job, in its team, as soon as the ``_metadata`` names
    that job; where users are not checked, only an explicit trust setting lets it through."""
    from airflow.sdk.exceptions import AirflowFailException

    from checkpointing_airflow import dag_factory
    from checkpointing_airflow.deploy_dag import _authorize_other_job

    storage, theirs = two_jobs
    pipelines = {"mine": write_spec(tmp_path / "pipelines", "mine", storage=storage.base_url)}
    params = {"pipeline": "mine", "from": theirs, "parallelism": 2, "allow_other_job": True}
    monkeypatch.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS", "uma:user,nobody:")

    class Run:
        triggering_user_name: str | None = "uma"
        team_name: str | None = None

    def deploy(jobs: list[str], **options: bool) -> dict[str, Any]:
        """The deploy's check for a run of ``Run``, as its ``check`` task wires it."""
        options = {"check_permissions": True, "trust_other_job": False, **options}

        def authorize(source_job: str, source: str) -> None:
            _authorize_other_job(Run(), source_job, source, jobs=jobs, **options)

        return dag_factory.deploy_plan_from_params(
            params, pipelines=pipelines, metastore=metastore, authorize_source=authorize
        )

    assert deploy(["mine"])["from_job"] == "theirs"  # uma may read every DAG
    Run.triggering_user_name = "nobody"  # may read no DAG
    with pytest.raises(AirflowFailException, match="user 'nobody' may not read the DAG theirs"):
        deploy(["mine"])
    Run.triggering_user_name = None
    with pytest.raises(AirflowFailException, match=r"no triggering user.*read the DAG theirs"):
        deploy(["mine"])
    own = dag_factory.deploy_plan_from_params(  # its own state: no right on another job asked
        {"pipeline": "mine", "from": "latest"},
        pipelines=pipelines,
        metastore=metastore,
        authorize_source=lambda *_: pytest.fail("asked for its own state"),
    )
    assert own["from_job"] is None

    # multi-team: alice may edit team_a's mine; theirs is not of this folder, so its team (and
    # her right on it) is unknown: refused; a source among the folder's pipelines is her team's
    monkeypatch.setenv("AIRFLOW__CORE__MULTI_TEAM", "True")
    monkeypatch.setenv("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS", "alice:user:team_a")
    Run.triggering_user_name, Run.team_name = "alice", "team_a"
    with pytest.raises(AirflowFailException, match="job theirs is not a pipeline of this DAG's"):
        deploy(["mine"])
    assert deploy(["mine", "theirs"])["from_job"] == "theirs"
    Run.team_name = "team_b"
    with pytest.raises(AirflowFailException, match="user 'alice' may not read the DAG theirs"):
        deploy(["mine", "theirs"])

    # no user checks (check_permissions=False): refused unless the deployment trusts its users
    with pytest.raises(AirflowFailException, match=r"nobody vouches.*trust_other_job=True"):
        deploy(["mine"], check_permissions=False)
    assert deploy(["mine"], check_permissions=False, trust_other_job=True)["from_job"] == "theirs"


@needs_airflow
def test_secret_looking_variable_names_stay_off_the_command_line() -> None:
    """Issue 28: these names held credentials and went to spark-submit as ``--conf …Env.X=…``
    on YARN and Kubernetes; URLs, DSNs and connection strings embed them."""
    from checkpointing_airflow.driver_secrets import is_secret_name

    secret = [
        "DATABASE_URL",
        "SENTRY_DSN",
        "APIKEY",
        "DB_PWD",
        "AZURE_STORAGE_CONNECTION_STRING",
        "PGPASSFILE",
        "PGPASSWORD",
        "REDIS_URI",
        "MONGO_CONN",
        "GITHUB_TOKEN",
        "MY_SECRET",
        "GOOGLE_APPLICATION_CREDENTIALS",
        "SSH_PRIVATE_KEY",
        "AWS_SECRET_ACCESS_KEY",
        "CKPT_METASTORE_URL",
        "AZURE_SAS",
        "BASIC_AUTH",
    ]
    assert [n for n in secret if not is_secret_name(n)] == []
    plain = ["LOG_LEVEL", "PATH", "JAVA_HOME", "SPARK_HOME", "PYSPARK_PYTHON", "TZ", "LANG"]
    assert [n for n in plain if is_secret_name(n)] == []


# ============================================================================ spark-submit

FAKE_SPARK_SUBMIT = """#!{python}
import json, os, sys
with open(os.environ["FAKE_SPARK_SUBMIT_OUT"], "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": dict(os.environ)}}, f)
"""


def install_fake_spark_submit(bin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in ``spark-submit`` first on PATH, writing its argv and environment to the file
    returned (nothing runs)."""
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "spark-submit"
    fake.write_text(FAKE_SPARK_SUBMIT.format(python=sys.executable))
    fake.chmod(0o755)
    out = bin_dir.parent / "submitted.json"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SPARK_SUBMIT_OUT", str(out))
    return out


@needs_airflow
def test_credentials_reach_the_driver_by_environment_never_on_the_command_line(
    airflow_home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On YARN (Kubernetes takes the same path in the provider, with ``driverEnv``)."""
    from airflow.sdk._shared.secrets_masker import redact
    from airflow.sdk.exceptions import AirflowFailException

    from checkpointing_airflow import driver_secrets
    from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator

    password, aws_secret = "pw-7c1e9b2a", "wJalrXUtnFEMIK7MDENGbPxRfiCYEXAMPLEKEY"
    url = f"postgresql+psycopg://ckpt:{password}@db.internal:5432/ckpt"
    for mode in ("client", "cluster"):
        monkeypatch.setenv(
            f"AIRFLOW_CONN_SPARK_{mode.upper()}",
            json.dumps({"conn_type": "spark", "host": "yarn", "extra": {"deploy-mode": mode}}),
        )
    monkeypatch.setenv(
        "AIRFLOW_CONN_AWS_TEST",
        json.dumps({"conn_type": "aws", "login": "AKIAEXAMPLE12345", "password": aws_secret}),
    )
    bin_dir = tmp_path / "bin"
    install_fake_spark_submit(bin_dir, monkeypatch)

    op = CheckpointedSparkSubmitOperator(
        task_id="run",
        pipeline="spec.yaml",
        conn_id="spark_client",
        aws_conn_id="aws_test",
        # PATH: the stand-in spark-submit first
        env_vars={
            "MY_API_TOKEN": "tok-5f2d8c1e0a",
            "LOG_LEVEL": "INFO",
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        },
    )
    env = op._driver_env(url, "s3://bucket/prefix")
    secrets = op.prepare_submit(env)
    assert set(secrets) == {
        "CKPT_METASTORE_URL",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "MY_API_TOKEN",
    }
    assert "CKPT_METASTORE_URL" not in (op.env_vars or {})
    assert op.env_vars["LOG_LEVEL"] == "INFO"  # the rest still goes the provider's way
    with driver_secrets.process_environment(secrets):
        op._hook.submit(op.application)
    submitted = json.loads((tmp_path / "submitted.json").read_text())
    command_line = " ".join(submitted["argv"])
    for value in (url, password, aws_secret, "AKIAEXAMPLE12345", "tok-5f2d8c1e0a"):
        assert value not in command_line
    assert "LOG_LEVEL=INFO" in command_line  # not a secret: the provider's --conf
    for name, value in secrets.items():
        assert submitted["env"][name] == value  # spark-submit, hence the driver, has them
    assert "CKPT_METASTORE_URL" not in os.environ  # only for spark-submit's start

    # masked by the variable's name, whatever the value looks like
    logged = f"connect {url} with {aws_secret} and tok-5f2d8c1e0a; password {password}"
    masked = str(redact(logged))
    for value in (aws_secret, "tok-5f2d8c1e0a", password):
        assert value not in masked, masked

    cluster = CheckpointedSparkSubmitOperator(
        task_id="run", pipeline="spec.yaml", conn_id="spark_cluster", aws_conn_id="aws_test"
    )
    with pytest.raises(AirflowFailException, match=r"deploy mode cluster .* deploy mode client"):
        cluster.prepare_submit(cluster._driver_env(url, "s3://bucket/prefix"))


@needs_airflow
def test_a_pipeline_dag_restores_another_jobs_savepoint_only_when_allowed(
    airflow_home: Path,
    metastore: Metastore,
    two_jobs: tuple[FileSystemCheckpointStorage, str],
    tmp_path: Path,
) -> None:
    """The operator's own **Restore from** path: checked before anything is submitted."""
    from airflow.sdk.exceptions import AirflowFailException

    from checkpointing.pipeline.spec import load_spec
    from checkpointing_airflow import try_plan
    from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator

    storage, theirs = two_jobs
    spec = load_spec(write_spec(tmp_path / "pipelines", "mine"))
    refusing = CheckpointedSparkSubmitOperator(task_id="run", pipeline=str(spec.spec_path))
    with pytest.raises(AirflowFailException, match="of job theirs, not of job mine"):
        try_plan.refuse_other_jobs_state(refusing, spec, storage.base_url, theirs)
    try_plan.refuse_other_jobs_state(refusing, spec, storage.base_url, "latest")  # not a path
    allowing = CheckpointedSparkSubmitOperator(
        task_id="run",
        pipeline=str(spec.spec_path),
        allow_other_job="True",  # a rendered template
    )
    try_plan.refuse_other_jobs_state(allowing, spec, storage.base_url, theirs)
