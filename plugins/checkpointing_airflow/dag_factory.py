"""DAGs from pipeline specs, and the savepoint and deploy DAGs.

Every ``dags/pipelines/<name>.yaml`` (the spec of :mod:`checkpointing.spec`, with its deployment
fields ``schedule``, ``retries``, ``retry_delay``, ``parallelism_on_retry``, ``owner`` and
``tags``) becomes the DAG ``<job>``. It has one task, ``run``, a
:class:`~checkpointing_airflow.operators.CheckpointedSparkSubmitOperator`.

**Why each spec has its own DAG file.** Airflow parses DAG files one Python file at a time and
records import errors per file. An import error marks every DAG of its file stale
(``airflow.dag_processing.collection._update_import_errors``), and the dag-processor lists only
``.py`` and ``.zip`` files. The DAG importer registry of Airflow 3.3 cannot be extended from
configuration. If one factory file built every pipeline, one broken spec would take down all of
them. So each spec has a DAG file next to it, ``<name>.py``. It holds the same two lines for every
spec (:data:`DAG_FILE`, written by ``python -m checkpointing_airflow.dag_factory sync DIR``). A
broken spec is then an import error of that one file, and the error names the spec file and the
field. ``dags/checkpoint_pipelines.py`` checks the directory as a whole: every spec has a DAG file
and no two specs share a job id.

Airflow is imported inside the functions, so ``sync`` and the checks run without it. This module
is also imported as a top-level module by Airflow's plugin manager, so it has no side effects and
uses only absolute imports.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpointing.config import Settings, format_duration
from checkpointing.errors import CheckpointingError, ConfigError
from checkpointing.spec import PipelineSpec, SpecError, load_spec

if TYPE_CHECKING:
    from airflow.sdk import DAG

    from checkpointing.metastore import Metastore
    from checkpointing.savepoints import RequestState

log = logging.getLogger(__name__)

METASTORE_CONN_ID = "checkpoint_metastore"
SPARK_CONN_ID = "spark_default"
#: every DAG made here carries this tag
TAG = "checkpointing"
SAVEPOINT_DAG_ID = "checkpoint_savepoint"
DEPLOY_DAG_ID = "checkpoint_deploy"
#: start date of scheduled pipelines; ``catchup`` is off, so only the next due run happens
START_DATE = datetime(2025, 1, 1, tzinfo=UTC)
#: a job id (``checkpointing.ids``) as a JSON-schema pattern for the trigger forms
JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
#: Airflow refuses longer tags
MAX_TAG_LENGTH = 100
SPEC_SUFFIX = ".yaml"

#: the DAG file of every spec, ``<name>.py`` next to ``<name>.yaml``
DAG_FILE = '''\
"""The DAG of the pipeline spec next to this file (same name, .yaml).

One DAG file per spec, so that a broken spec is an import error of this file only. Written by
`python -m checkpointing_airflow.dag_factory sync`, the same for every spec.
"""

from checkpointing_airflow.dag_factory import pipeline_dag

dag = pipeline_dag(__file__)
'''


class PipelineSetError(ConfigError):
    """The specs of a pipelines directory do not make a set of DAGs (names the files)."""


class DeployError(CheckpointingError):
    """A deploy that would fail or do harm: refused before anything is submitted."""


class PermissionRefused(CheckpointingError):
    """The user who triggered a savepoint or deploy run may not edit the target pipeline's DAG."""


# ============================================================================ pipeline DAGs


def spec_file_for(dag_file: str | Path) -> Path:
    """The spec a pipeline DAG file builds: the ``.yaml`` with the same name next to it."""
    return Path(dag_file).absolute().with_suffix(SPEC_SUFFIX)


def pipeline_dag(
    dag_file: str | Path,
    *,
    metastore_conn_id: str = METASTORE_CONN_ID,
    spark_conn_id: str = SPARK_CONN_ID,
    operator_args: Mapping[str, Any] | None = None,
) -> DAG:
    """The DAG of the spec next to ``dag_file`` (call it with ``__file__``).

    A broken spec raises :class:`~checkpointing.spec.SpecError` naming the file and the field,
    and Airflow records it as this DAG file's import error."""
    spec = load_spec(spec_file_for(dag_file))
    return build_pipeline_dag(
        spec,
        metastore_conn_id=metastore_conn_id,
        spark_conn_id=spark_conn_id,
        operator_args=operator_args,
    )


def build_pipeline_dag(
    spec: PipelineSpec,
    *,
    metastore_conn_id: str = METASTORE_CONN_ID,
    spark_conn_id: str = SPARK_CONN_ID,
    operator_args: Mapping[str, Any] | None = None,
) -> DAG:
    """DAG ``spec.job`` with the task ``run``. Airflow-level mistakes in the deployment fields
    (a bad cron expression, a tag that is too long) become :class:`SpecError` as well.

    ``operator_args`` go to the task's operator on top of what the spec says, e.g. Spark
    ``conf`` or the failure drill ``fail_first_try_after_epochs`` (``ckpt demo`` uses both)."""
    from airflow.sdk import DAG, Param

    from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator

    check_deployment(spec)
    with DAG(
        dag_id=spec.job,
        description=summary(spec),
        doc_md=describe(spec),
        schedule=spec.schedule,
        start_date=START_DATE,
        catchup=False,
        # two runs of one job would write the same state and sink
        max_active_runs=1,
        tags=list(dict.fromkeys([TAG, *spec.tags])),
        default_args={"owner": spec.owner},
        params={
            "restore": Param(
                "latest",
                type="string",
                minLength=1,
                title="Restore from",
                description=(
                    "latest: resume from the newest valid checkpoint (start empty if there is "
                    "none); none: start empty; a checkpoint id; or a savepoint or checkpoint "
                    "path. Retries always resume from this run's latest checkpoint."
                ),
            ),
            "parallelism": Param(
                spec.parallelism,
                type="integer",
                minimum=1,
                maximum=spec.max_parallelism,
                title="Parallelism",
                description=(
                    f"subtasks of every operator; the spec says {spec.parallelism}. A different "
                    "value rescales the restored state (key groups are reassigned)."
                ),
            ),
        },
    ) as dag:
        CheckpointedSparkSubmitOperator(
            task_id="run",
            pipeline=str(spec.spec_path),
            restore="{{ params.restore }}",
            parallelism="{{ params.parallelism }}",
            parallelism_on_retry=spec.parallelism_on_retry,
            metastore_conn_id=metastore_conn_id,
            conn_id=spark_conn_id,
            retries=spec.retries,
            retry_delay=spec.retry_delay,
            **(operator_args or {}),
        )
    return dag


def check_deployment(spec: PipelineSpec) -> None:
    """What Airflow would refuse in the deployment fields, refused with the file and field."""
    from airflow.sdk import DAG

    where = spec.spec_path or spec.job
    for tag in spec.tags:
        if len(tag) > MAX_TAG_LENGTH:
            raise SpecError(f"{where}: tags: {tag!r} is longer than {MAX_TAG_LENGTH} characters")
    if spec.schedule is None:
        return
    try:  # Airflow checks a cron expression only when it validates the whole DAG
        probe = DAG(
            dag_id=spec.job, schedule=spec.schedule, start_date=START_DATE, max_active_runs=1
        )
        probe.timetable.validate()
    except Exception as exc:
        raise SpecError(
            f"{where}: schedule: {exc} (got {spec.schedule!r}; use a cron expression such as "
            "'0 3 * * *' or a preset such as '@daily')"
        ) from None


def summary(spec: PipelineSpec) -> str:
    """One line for the DAG list."""
    return (
        f"{spec.source.format} {Path(spec.source.path).name} → "
        f"{', '.join(spec.aggregations)} by {', '.join(spec.key)} → {spec.sink.path}"
    )


def describe(spec: PipelineSpec) -> str:
    """The DAG's documentation (Markdown): what the pipeline reads, computes, writes, and how it
    checkpoints, retries and is operated."""
    config = spec.checkpoint.config()
    checkpoints = []
    if spec.checkpoint.every_epochs:
        checkpoints.append(f"every {spec.checkpoint.every_epochs} epoch(s)")
    if config.periodic_interval is not None:
        checkpoints.append(f"every {format_duration(config.periodic_interval)}")
    checkpoints += [
        f"timeout {format_duration(config.timeout)}",
        f"{config.retained} retained",
        config.retention.value,
    ]
    retry_parallelism = spec.parallelism_on_retry or spec.parallelism
    aggregations = ", ".join(f"`{name} = {agg}`" for name, agg in spec.aggregations.items())
    rows = [
        ("spec", f"`{spec.spec_path}`"),
        (
            "source",
            f"{spec.source.format} `{spec.source.path}`, "
            f"{spec.source.splits_per_epoch} file(s) per epoch",
        ),
        ("key", ", ".join(f"`{k}`" for k in spec.key)),
        ("aggregations", aggregations),
        ("sink", f"`{spec.sink.path}` (final table in `final/`, epochs in `changelog/`)"),
        ("parallelism", f"{spec.parallelism} (max parallelism {spec.max_parallelism})"),
        (
            "retries",
            f"{spec.retries}, {format_duration(spec.retry_delay)} apart, each resuming from the "
            f"latest checkpoint at parallelism {retry_parallelism}"
            if spec.retries
            else "none",
        ),
        ("checkpoints", "; ".join(checkpoints)),
        ("storage", f"`{spec.storage}`" if spec.storage else "`CKPT_STORAGE_URL` (or default)"),
        ("schedule", f"`{spec.schedule}`" if spec.schedule else "none (triggered)"),
    ]
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    return (
        f"### Checkpointed pipeline `{spec.job}`\n\n"
        "Runs the pipeline on Spark in epochs with checkpoints at epoch boundaries; a failed "
        "try is retried from the latest completed checkpoint.\n\n"
        f"| | |\n|---|---|\n{table}\n\n"
        "Trigger it with **Restore from** (`latest`, `none`, a checkpoint id or a savepoint "
        "path) and **Parallelism** (rescales the state). Take a savepoint with the "
        f"`{SAVEPOINT_DAG_ID}` DAG; start a new version from one with `{DEPLOY_DAG_ID}`.\n"
    )


# ============================================================================ the directory


def spec_files(directory: str | Path) -> list[Path]:
    """The specs of a pipelines directory, sorted."""
    return sorted(Path(directory).glob(f"*{SPEC_SUFFIX}"))


def known_pipelines(directory: str | Path) -> dict[str, Path]:
    """Job id → spec file, for the specs that load. Broken ones are left out here; their own DAG
    files report them."""
    found: dict[str, Path] = {}
    for path in spec_files(directory):
        try:
            spec = load_spec(path)
        except SpecError:
            continue
        found.setdefault(spec.job, path.absolute())
    return dict(sorted(found.items()))


def pipeline_problems(directory: str | Path) -> list[str]:
    """What keeps the specs of ``directory`` from becoming one DAG each: a spec without a DAG
    file, a ``.yml`` spec, two specs with one job id. Broken specs are left to their DAG files."""
    directory = Path(directory)
    problems = [
        f"{path}: a pipeline spec must end in {SPEC_SUFFIX} (rename it)"
        for path in sorted(directory.glob("*.yml"))
    ]
    jobs: dict[str, list[Path]] = {}
    for path in spec_files(directory):
        if not path.with_suffix(".py").exists():
            problems.append(
                f"{path}: no DAG file {path.stem}.py next to it, so Airflow does not see this "
                f"pipeline; write it with `python -m checkpointing_airflow.dag_factory sync "
                f"{directory}`"
            )
        try:
            jobs.setdefault(load_spec(path).job, []).append(path)
        except SpecError:
            continue
    for job, paths in sorted(jobs.items()):
        if len(paths) > 1:
            names = ", ".join(p.name for p in paths)
            problems.append(f"{directory}: job: {job!r} is the job of {names}: one DAG per job id")
    return problems


def raise_for_pipeline_problems(directory: str | Path) -> None:
    """Fail (an import error of the calling DAG file, which has no DAGs) when the directory's
    specs do not make one DAG each."""
    problems = pipeline_problems(directory)
    if problems:
        raise PipelineSetError("\n".join(problems))


def sync_dag_files(directory: str | Path) -> tuple[list[Path], list[Path]]:
    """Write the DAG file of every spec that has none; delete unchanged generated DAG files whose
    spec is gone. Returns (written, deleted)."""
    directory = Path(directory)
    written = []
    for path in spec_files(directory):
        dag_file = path.with_suffix(".py")
        if not dag_file.exists():
            dag_file.write_text(DAG_FILE)
            written.append(dag_file)
    deleted = []
    for dag_file in sorted(directory.glob("*.py")):
        if not dag_file.with_suffix(SPEC_SUFFIX).exists() and dag_file.read_text() == DAG_FILE:
            dag_file.unlink()
            deleted.append(dag_file)
    return written, deleted


# ============================================================================ savepoints


def build_savepoint_dag(
    pipelines_dir: str | Path,
    *,
    metastore_conn_id: str = METASTORE_CONN_ID,
    check_permissions: bool = True,
) -> DAG:
    """``checkpoint_savepoint``: a savepoint of a running pipeline of ``pipelines_dir``, from
    the trigger form. Airflow checks only the permission to trigger this DAG, so the task checks
    that the run's triggering user may edit the target pipeline's DAG (:func:`authorize_trigger`;
    ``check_permissions=False`` turns that off, see there)."""
    from airflow.sdk import DAG, Param, get_current_context, task

    pipelines_dir = Path(pipelines_dir)
    jobs = list(known_pipelines(pipelines_dir))
    with DAG(
        dag_id=SAVEPOINT_DAG_ID,
        description="Take a savepoint of a running pipeline (optionally stopping it)",
        doc_md=(
            "### Savepoint of a running pipeline\n\n"
            "Queues a savepoint request in the checkpoint metastore; the job takes it at its "
            "next epoch boundary, and this run waits for it. The result (XCom `return_value`) "
            "is the savepoint's path, which the `checkpoint_deploy` DAG (**from**) and "
            "`ckpt run --restore` take. With **stop**, the job ends after the savepoint, "
            "Flink's stop-with-savepoint. A job that is not running fails the run at once, "
            "and so does a user who may not edit the pipeline's own DAG."
        ),
        schedule=None,
        start_date=START_DATE,
        catchup=False,
        tags=[TAG],
        params={
            "pipeline": Param(
                type="string",
                pattern=JOB_ID_PATTERN,
                title="Pipeline",
                description="The job id of the running pipeline.",
                **({"examples": jobs} if jobs else {}),
            ),
            "stop": Param(
                False,
                type="boolean",
                title="Stop after the savepoint",
                description="End the job once the savepoint completes.",
            ),
            "timeout": Param(
                600,
                type="integer",
                minimum=1,
                title="Timeout (seconds)",
                description="How long to wait for the job's next epoch boundary.",
            ),
        },
    ) as dag:

        @task(task_id="savepoint", retries=0)
        def savepoint() -> str | None:
            """The savepoint's path; the whole request state is in the XCom ``request``."""
            from checkpointing_airflow.hooks import CheckpointMetastoreHook

            context = get_current_context()
            ti = context["ti"]
            if check_permissions:
                authorize_run(
                    context["dag_run"],
                    str(context["params"]["pipeline"]),
                    jobs=list(known_pipelines(pipelines_dir)),
                )
            metastore = CheckpointMetastoreHook(metastore_conn_id).get_metastore()
            try:
                state = savepoint_from_params(
                    context["params"],
                    metastore=metastore,
                    requested_by=f"airflow:{ti.dag_id}/{ti.run_id}",
                )
            finally:
                metastore.dispose()
            ti.xcom_push(key="request", value=state.to_dict())
            return state.savepoint_path

        savepoint()
    return dag


def take_savepoint(
    metastore: Metastore,
    job_id: str,
    *,
    stop: bool,
    timeout: float,
    requested_by: str,
    poll: float = 2.0,
) -> RequestState:
    """Request a savepoint of a running job and wait until it completes."""
    from checkpointing import savepoints

    request_id = savepoints.request_savepoint(
        metastore, job_id, stop=stop, requested_by=requested_by[:256]
    )
    log.info(
        "job %s: %ssavepoint request %d queued; waiting up to %g s for its next epoch boundary",
        job_id,
        "stop-with-" if stop else "",
        request_id,
        timeout,
    )
    state = savepoints.wait_for_request(metastore, job_id, request_id, timeout=timeout, poll=poll)
    log.info(
        "job %s: savepoint %s completed: %s", job_id, state.checkpoint_id, state.savepoint_path
    )
    return state


def savepoint_from_params(
    params: Mapping[str, Any], *, metastore: Metastore, requested_by: str, poll: float = 2.0
) -> RequestState:
    """The savepoint task: a job that is not running, unknown, or whose savepoint failed or did
    not come in time fails the task without retries (retrying cannot help), with the reason."""
    from airflow.sdk.exceptions import AirflowFailException

    try:
        return take_savepoint(
            metastore,
            str(params["pipeline"]),
            stop=bool(params.get("stop", False)),
            timeout=float(params.get("timeout", 600)),
            requested_by=requested_by,
            poll=poll,
        )
    except CheckpointingError as exc:
        raise AirflowFailException(str(exc)) from None


# ============================================================================ deploys


def build_deploy_dag(
    pipelines_dir: str | Path,
    *,
    metastore_conn_id: str = METASTORE_CONN_ID,
    spark_conn_id: str = SPARK_CONN_ID,
    check_permissions: bool = True,
) -> DAG:
    """``checkpoint_deploy``: start a pipeline of ``pipelines_dir`` (its current spec and code)
    from a savepoint or its latest checkpoint, possibly at a new parallelism. ``check``
    validates everything it can before ``run`` submits anything, starting with the triggering
    user's permission to edit the pipeline's own DAG (:func:`authorize_trigger`; off with
    ``check_permissions=False``). A savepoint of another job is refused unless the run asks for
    it (``allow_other_job``)."""
    from airflow.sdk import DAG, Param, get_current_context, task

    from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator

    pipelines_dir = Path(pipelines_dir)
    jobs = list(known_pipelines(pipelines_dir))
    defaults = PipelineSpec.model_fields
    with DAG(
        dag_id=DEPLOY_DAG_ID,
        description="Start a pipeline from a savepoint or its latest checkpoint (upgrades)",
        doc_md=(
            "### Deploy a pipeline\n\n"
            "The upgrade flow: take a savepoint with `checkpoint_savepoint` (**stop** on), "
            "change the spec or the code, then start the pipeline here **from** that savepoint, "
            "at the same or a new **parallelism** (the state's key groups are reassigned). "
            "`check` refuses, before anything is submitted, a savepoint that does not verify or "
            "whose state cannot be assigned, a parallelism above the job's max parallelism, and "
            "a job that is still running, a savepoint of another pipeline unless **allow another "
            "pipeline's savepoint** is on, and a user who may not edit the pipeline's own DAG. "
            "`run` then runs the pipeline like its own DAG would, and its retries resume from "
            "the latest checkpoint."
        ),
        schedule=None,
        start_date=START_DATE,
        catchup=False,
        tags=[TAG],
        params={
            "pipeline": Param(
                type="string",
                title="Pipeline",
                description=f"The job id of a pipeline spec in {pipelines_dir}.",
                **({"enum": jobs} if jobs else {"pattern": JOB_ID_PATTERN}),
            ),
            "from": Param(
                "latest",
                type="string",
                minLength=1,
                title="Start from",
                description=(
                    "latest: the job's newest valid checkpoint or savepoint (empty state if it "
                    "has none); or a savepoint path (its directory or its _metadata), e.g. the "
                    "result of checkpoint_savepoint."
                ),
            ),
            "parallelism": Param(
                None,
                type=["null", "integer"],
                minimum=1,
                title="Parallelism",
                description="Empty: the spec's parallelism.",
            ),
            "allow_other_job": Param(
                False,
                type="boolean",
                title="Allow another pipeline's savepoint",
                description=(
                    "Start from a checkpoint or savepoint of another job (e.g. a renamed "
                    "pipeline); recorded with the restore. Off: such a path is refused."
                ),
            ),
        },
    ) as dag:

        @task(task_id="check", retries=0, multiple_outputs=True)
        def check() -> dict[str, Any]:
            """What ``run`` runs: the spec file, the restore source and the parallelism."""
            from checkpointing_airflow.hooks import CheckpointMetastoreHook

            context = get_current_context()
            params = context["params"]
            if check_permissions:
                authorize_run(
                    context["dag_run"],
                    str(params["pipeline"]),
                    jobs=list(known_pipelines(pipelines_dir)),
                )
            metastore = CheckpointMetastoreHook(metastore_conn_id).get_metastore()
            try:
                plan = deploy_plan_from_params(
                    params, pipelines=known_pipelines(pipelines_dir), metastore=metastore
                )
            finally:
                metastore.dispose()
            _refuse_active_runs(context["ti"], plan["job"])
            return plan

        checked = check()
        CheckpointedSparkSubmitOperator(
            task_id="run",
            pipeline=checked["pipeline"],
            restore=checked["restore"],
            parallelism=checked["parallelism"],
            allow_other_job=checked["allow_other_job"],
            metastore_conn_id=metastore_conn_id,
            conn_id=spark_conn_id,
            retries=defaults["retries"].default,
            retry_delay=defaults["retry_delay"].default,
        )
    return dag


def plan_deploy(
    pipelines: Mapping[str, Path],
    pipeline: str,
    source: str,
    parallelism: int | None,
    *,
    metastore: Metastore,
    storage_url: str | None = None,
    allow_other_job: bool = False,
) -> dict[str, Any]:
    """Validate a deploy without running it: the spec loads, the job is not running, the
    savepoint verifies (``_metadata`` and file sizes), it is the job's own unless
    ``allow_other_job``, and its state can be assigned to ``parallelism`` subtasks under the
    spec's max parallelism.

    ``storage_url`` defaults as for the operator: the spec's ``storage``, else
    ``CKPT_STORAGE_URL``, else the embedded default."""
    from checkpointing import restore
    from checkpointing.models import Job
    from checkpointing.properties import JobStatus
    from checkpointing.storage import CheckpointStorage

    path = pipelines.get(pipeline)
    if path is None:
        known = ", ".join(pipelines) or "none"
        raise DeployError(f"pipeline: unknown pipeline {pipeline!r} (known: {known})")
    spec = load_spec(path)
    chosen = spec.parallelism if parallelism is None else int(parallelism)
    if not 1 <= chosen <= spec.max_parallelism:
        raise DeployError(
            f"parallelism: {chosen} is outside 1..{spec.max_parallelism} (the max parallelism "
            f"of job {spec.job}, fixed for the life of its state)"
        )
    with metastore.transaction() as s:
        job = s.get(Job, spec.job)
        status = job.status if job is not None else None
    if status == JobStatus.RUNNING:
        raise DeployError(
            f"job {spec.job} is running: stop it first with the {SAVEPOINT_DAG_ID} DAG "
            "(stop on) and deploy from that savepoint"
        )
    storage_url = (
        storage_url
        or (spec.storage and spec.resolve(spec.storage))
        or Settings.resolve().storage_url
    )
    storage = CheckpointStorage.from_url(storage_url)
    source = str(source).strip()
    if source.startswith("/"):  # a local savepoint given as a plain path: the URL it is known by
        source = Path(source).as_uri()
    if source == "latest":
        if status is None:
            starts = "empty state (the job has no checkpoints yet)"
        else:
            decision = restore.find_latest_valid(metastore, storage, spec.job, deep=False)
            starts = decision.describe()
    elif "/" in source or source.isdigit():
        preview = restore.preview_restore(
            metastore,
            storage,
            spec.job,
            parallelism=chosen,
            source=source,
            deep=False,
            allow_other_job=allow_other_job,
        )
        for op in preview.metadata.operators:
            if op.max_parallelism != spec.max_parallelism:
                raise DeployError(
                    f"from: {source}: operator {op.operator_id!r} has max parallelism "
                    f"{op.max_parallelism}, the spec {spec.max_parallelism}; it is fixed for "
                    "the life of the job's state"
                )
        starts = (
            f"{preview.decision.checkpoint_type or 'checkpoint'} "
            f"{preview.decision.checkpoint_id} of job {preview.metadata.job_id} "
            f"({preview.decision.metadata_path}), reassigned to {chosen} subtask(s)"
        )
        if preview.decision.from_job_id is not None:
            starts += " (another job's: allowed explicitly)"
    else:
        raise DeployError(f"from: expected 'latest' or a savepoint path, got {source!r}")
    log.info("deploy %s from %s at parallelism %d: %s", spec.job, source, chosen, starts)
    return {
        "job": spec.job,
        "pipeline": str(path),
        "restore": source,
        "parallelism": chosen,
        "allow_other_job": bool(allow_other_job),
        "starts_from": starts,
    }


def deploy_plan_from_params(
    params: Mapping[str, Any], *, pipelines: Mapping[str, Path], metastore: Metastore
) -> dict[str, Any]:
    """The deploy's ``check`` task: anything wrong fails it for good, with the reason."""
    from airflow.sdk.exceptions import AirflowFailException

    try:
        return plan_deploy(
            pipelines,
            str(params["pipeline"]),
            str(params.get("from") or "latest"),
            params.get("parallelism"),
            metastore=metastore,
            allow_other_job=bool(params.get("allow_other_job", False)),
        )
    except CheckpointingError as exc:
        raise AirflowFailException(str(exc)) from None


def authorize_trigger(user_name: str | None, job_id: str, *, team_name: str | None = None) -> str:
    """That ``user_name`` (a run's ``triggering_user_name``) may edit (``PUT``) the DAG of
    pipeline ``job_id``, asked of the configured auth manager; returns the name, else raises
    :class:`PermissionRefused`.

    Airflow checks only the permission to trigger the generic savepoint and deploy DAGs, and its
    tasks cannot reach Airflow's database (the task SDK blocks it), so the check is made here with
    what a worker has: the auth manager's configuration. SimpleAuthManager's users and roles are
    configuration, so they are checked; in multi-team mode the pipeline's team is ``team_name``
    (the generic DAGs act only on the specs of their own folder, i.e. their own bundle and team).
    Other auth managers (FAB, Keycloak) keep users in a database or an identity provider that a
    task cannot ask: the run is refused, and a deployment that wants the generic DAGs anyway
    builds them with ``check_permissions=False`` and grants them only to users who may edit
    every pipeline. A run without a triggering user, or by a name the auth manager does not know,
    is refused."""
    from airflow.api_fastapi.app import create_auth_manager, get_auth_manager_cls
    from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager
    from airflow.configuration import conf

    if not user_name:
        raise PermissionRefused(
            f"pipeline {job_id}: the run has no triggering user, so its permission to edit the "
            f"DAG {job_id} cannot be checked; trigger it as a user"
        )
    manager_cls = get_auth_manager_cls()
    if not issubclass(manager_cls, SimpleAuthManager):
        raise PermissionRefused(
            f"pipeline {job_id}: the auth manager {manager_cls.__name__} cannot be asked from a "
            f"task whether user {user_name!r} may edit the DAG {job_id}; trigger the pipeline's "
            "own DAG, or see docs/airflow.md (check_permissions) to use this DAG anyway"
        )
    if conf.getboolean("core", "simple_auth_manager_all_admins", fallback=False):
        return user_name  # every visitor is an admin
    manager = create_auth_manager()
    user = next((u for u in manager.get_users() if u.username == user_name), None)
    allowed = user is not None and manager.is_authorized_dag(
        method="PUT", details=DagDetails(id=job_id, team_name=team_name), user=user
    )
    if not allowed:
        raise PermissionRefused(
            f"user {user_name!r} may not edit the DAG {job_id}: savepoints and deploys of a "
            "pipeline need the permission to edit its own DAG"
        )
    return user_name


def authorize_run(dag_run: Any, job_id: str, *, jobs: list[str]) -> None:
    """The generic DAGs' check, failing the task for good: ``job_id`` is one of the pipelines
    of the DAG's folder (``jobs``) and the run's triggering user may edit its DAG."""
    from airflow.sdk.exceptions import AirflowFailException

    if job_id not in jobs:
        known = ", ".join(jobs) or "none"
        raise AirflowFailException(f"pipeline: unknown pipeline {job_id!r} (known: {known})")
    try:
        user = authorize_trigger(
            getattr(dag_run, "triggering_user_name", None),
            job_id,
            team_name=getattr(dag_run, "team_name", None),
        )
    except PermissionRefused as exc:
        raise AirflowFailException(str(exc)) from None
    log.info("user %r may edit the DAG %s", user, job_id)


def _refuse_active_runs(ti: Any, job_id: str) -> None:
    """The pipeline's own DAG must not run the job at the same time (the metastore says RUNNING
    only once its driver is up, or not at all between a failed try and its retry)."""
    from airflow.sdk.exceptions import AirflowFailException

    try:
        active = ti.get_dr_count(dag_id=job_id, states=["queued", "running"])
    except Exception as exc:  # the DAG may not exist: the job is deployed only from here
        log.info("DAG %s: no run count (%s)", job_id, exc)
        return
    if active:
        raise AirflowFailException(
            f"the DAG {job_id} has {active} queued or running run(s) of this job: wait for them, "
            f"or stop the job with the {SAVEPOINT_DAG_ID} DAG (stop on)"
        )


# ============================================================================ command line


def main(argv: list[str] | None = None) -> int:
    """``python -m checkpointing_airflow.dag_factory sync|check DIR``."""
    parser = argparse.ArgumentParser(prog="python -m checkpointing_airflow.dag_factory")
    parser.add_argument("command", choices=["sync", "check"])
    parser.add_argument("directory", type=Path, nargs="?", default=Path("dags/pipelines"))
    args = parser.parse_args(argv)
    if args.command == "sync":
        written, deleted = sync_dag_files(args.directory)
        for path in written:
            print(f"wrote {path}")
        for path in deleted:
            print(f"deleted {path} (its spec is gone)")
    problems = pipeline_problems(args.directory)
    for spec in spec_files(args.directory):
        try:
            job = load_spec(spec).job
        except SpecError as exc:
            problems.append(str(exc))
            continue
        print(f"ok {spec.name}: DAG {job}")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
