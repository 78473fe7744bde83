"""``checkpoint_deploy``: start a pipeline (its current spec and code) from a savepoint or its
latest checkpoint, possibly at a new parallelism: the upgrade flow. ``check`` validates
everything it can (:func:`plan_deploy`) before ``run`` submits anything.

Airflow is imported inside the functions, so the module imports without it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpointing.errors import CheckpointingError
from checkpointing.pipeline.spec import PipelineSpec, load_spec
from checkpointing_airflow.dag_defaults import (
    DEPLOY_DAG_ID,
    JOB_ID_PATTERN,
    METASTORE_CONN_ID,
    SAVEPOINT_DAG_ID,
    SPARK_CONN_ID,
    START_DATE,
    TAG,
)
from checkpointing_airflow.dag_files import known_pipelines
from checkpointing_airflow.permissions import authorize_run, authorize_source

if TYPE_CHECKING:
    from airflow.sdk import DAG

    from checkpointing.metastore.engine import Metastore

log = logging.getLogger(__name__)


class DeployError(CheckpointingError):
    """A deploy that would fail or do harm: refused before anything is submitted."""


def build_deploy_dag(
    pipelines_dir: str | Path,
    *,
    metastore_conn_id: str = METASTORE_CONN_ID,
    spark_conn_id: str = SPARK_CONN_ID,
    check_permissions: bool = True,
    trust_other_job: bool = False,
) -> DAG:
    """``checkpoint_deploy``: start a pipeline of ``pipelines_dir`` (its current spec and code)
    from a savepoint or its latest checkpoint, possibly at a new parallelism. ``check``
    validates everything it can before ``run`` submits anything, starting with the triggering
    user's permission to edit the pipeline's own DAG (:func:`authorize_trigger`; off with
    ``check_permissions=False``). A savepoint of another job is refused unless the run asks for
    it (``allow_other_job``) and that user may read the other job's DAG (:func:`authorize_source`);
    without the permission checks nobody vouches for that, so such a deploy is refused unless the
    deployment says it trusts every user of this DAG with every job's state
    (``trust_other_job=True``)."""
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
            "pipeline's savepoint** is on and the user may read that pipeline's DAG, and a user "
            "who may not edit the pipeline's own DAG. "
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
                    "pipeline); recorded with the restore, and only for a user who may read "
                    "that job's DAG. Off: such a path is refused."
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

            def authorize_source(source_job: str, source: str) -> None:
                _authorize_other_job(
                    context["dag_run"],
                    source_job,
                    source,
                    jobs=list(known_pipelines(pipelines_dir)),
                    check_permissions=check_permissions,
                    trust_other_job=trust_other_job,
                )

            try:
                plan = deploy_plan_from_params(
                    params,
                    pipelines=known_pipelines(pipelines_dir),
                    metastore=metastore,
                    authorize_source=authorize_source,
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
            # a cleared or retried run acts on the same restore: its user is asked again
            authorize_restore=check_permissions,
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
    authorize_source: Callable[[str, str], None] | None = None,
) -> dict[str, Any]:
    """Validate a deploy without running it: the spec loads, the job is not running, the
    savepoint verifies (``_metadata`` and file sizes), it is the job's own unless
    ``allow_other_job``, and its state can be assigned to ``parallelism`` subtasks under the
    spec's max parallelism. Another job's savepoint goes to ``authorize_source`` (its job id and
    path) as soon as its ``_metadata`` names the job, before anything else is checked of it.

    ``storage_url`` defaults as for the operator: the spec's ``storage``, else
    ``CKPT_STORAGE_URL``, else the embedded default."""
    from checkpointing.metastore.jobs import job_status, storage_url_for_run
    from checkpointing.restore import lookup as restore
    from checkpointing.state.storage import CheckpointStorage
    from checkpointing.status import JobStatus

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
    status = job_status(metastore, spec.job)
    if status == JobStatus.RUNNING:
        raise DeployError(
            f"job {spec.job} is running: stop it first with the {SAVEPOINT_DAG_ID} DAG "
            "(stop on) and deploy from that savepoint"
        )
    storage = CheckpointStorage.from_url(storage_url_for_run(storage_url, spec))
    source = str(source).strip()
    if source.startswith("/"):  # a local savepoint given as a plain path: the URL it is known by
        source = Path(source).as_uri()
    from_job: str | None = None
    if source == "latest":
        if status is None:
            starts = "empty state (the job has no checkpoints yet)"
        else:
            decision = restore.find_latest_valid(metastore, storage, spec.job, deep=False)
            starts = decision.describe()
    elif "/" in source or source.isdigit():
        if allow_other_job and authorize_source is not None and "/" in source:
            found = restore.load_external(
                storage, source, deep=False, job_id=spec.job, allow_other_job=True
            )
            if found.from_job_id is not None:
                authorize_source(found.from_job_id, source)
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
        from_job = preview.decision.from_job_id
        if from_job is not None:
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
        "from_job": from_job,
        "starts_from": starts,
    }


def deploy_plan_from_params(
    params: Mapping[str, Any],
    *,
    pipelines: Mapping[str, Path],
    metastore: Metastore,
    authorize_source: Callable[[str, str], None] | None = None,
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
            authorize_source=authorize_source,
        )
    except CheckpointingError as exc:
        raise AirflowFailException(str(exc)) from None


def _authorize_other_job(
    dag_run: Any,
    source_job: str,
    source: str,
    *,
    jobs: list[str],
    check_permissions: bool,
    trust_other_job: bool,
) -> None:
    """Another job's state (``source``, of job ``source_job``) would flow into this job's sink:
    the triggering user must be allowed to read that job (:func:`authorize_source`); where
    users are not checked, only a deployment that trusts every user of the deploy DAG
    (``trust_other_job``) lets it through."""
    from airflow.sdk.exceptions import AirflowFailException

    if check_permissions:
        authorize_source(dag_run, source_job, jobs=jobs)
    elif not trust_other_job:
        raise AirflowFailException(
            f"from: {source} is job {source_job}'s state and this deploy DAG does not "
            "check users (check_permissions=False), so nobody vouches that the triggering user "
            f"may read job {source_job}: refused (build_deploy_dag(..., trust_other_job=True) "
            "to allow it)"
        )


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
