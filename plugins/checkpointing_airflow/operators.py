"""The operator that runs a checkpointed pipeline with ``spark-submit`` and is, for the job's
lifetime, its checkpoint coordinator (Flink's JobManager role)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk.configuration import conf

from checkpointing.coordination.heartbeat import HEARTBEAT_TIMEOUT
from checkpointing.metastore.jobs import storage_url_for_run
from checkpointing_airflow import try_plan
from checkpointing_airflow.application import spark_application
from checkpointing_airflow.attempts import attempt_id, failed_try_line
from checkpointing_airflow.aws_credentials import storage_environment
from checkpointing_airflow.deferred import DeferredSubmit
from checkpointing_airflow.driver_scope import (
    driver_metastore_url,
    release_driver,
    withheld_environment,
    withheld_variables,
)
from checkpointing_airflow.driver_secrets import (
    is_secret_name,
    mask_url_password,
    process_environment,
)
from checkpointing_airflow.hooks import CheckpointMetastoreHook, open_metastore
from checkpointing_airflow.links import CheckpointsLink
from checkpointing_airflow.spark_submit_internals import submit_target
from checkpointing_airflow.try_plan import truthy

if TYPE_CHECKING:
    from airflow.providers.openlineage.extractors import OperatorLineage
    from airflow.sdk import Context

    from checkpointing.coordination.stats_tracker import CheckpointStatsTracker
    from checkpointing.metastore.engine import Metastore
    from checkpointing.pipeline.spec import PipelineSpec

log = logging.getLogger(__name__)


class CheckpointedSparkSubmitOperator(SparkSubmitOperator):
    """Run a pipeline spec (``ckpt run``) with ``spark-submit``, resuming from its latest
    checkpoint, and coordinate its checkpoints while it runs.

    While the Spark application runs, this task is the job's checkpoint coordinator
    (:func:`checkpointing.coordination.attempt.coordinate_attempt` owns that lifetime): it starts
    periodic checkpointing when the application reports RUNNING and stops it (aborting pending
    checkpoints) when it does not; it triggers queued savepoint and checkpoint requests (from the
    UI, a DAG or the CLI), expires overdue checkpoints and completes fully acknowledged ones whose
    last acknowledging task died. The Spark driver acts under the same coordinator id, so the two
    processes are one coordinator; the driver completes checkpoints when their last ack arrives
    and runs the sink's commit there. If this task's worker dies, the retry takes over
    coordination: the previous coordinator's pending checkpoints are aborted as coordinator
    failover (not counted as failures), and its orphaned driver can no longer trigger any.

    Retries resume: the failure callbacks (:mod:`checkpointing_airflow.callbacks`, installed
    ahead of any ``on_retry_callback`` / ``on_failure_callback`` given) record a
    restore plan for the next try; when Airflow did not run them, the retry computes the same
    plan itself. Each try restores the latest valid checkpoint of this DAG run (falling back past
    a corrupt one), with ``parallelism_on_retry`` subtasks when set.

    The return value (XCom) is the try's outcome, read from the metastore (the driver records it
    there, wherever it runs): ``checkpoints``, ``restored_from``, ``epochs_run`` and
    ``epochs_done`` (counts, as in the logs), ``final_path``; a stop-with-savepoint ends the job
    after the savepoint completes, the task succeeds and ``savepoint_path`` names it. A failed
    try logs one line: how the driver ended (a signal by name), the last completed checkpoint
    and what the retry restores.

    A user's PySpark script whose steps are checkpointed runs instead of a spec when
    ``pipeline`` is omitted: ``application="jobs/daily.py"`` (as for ``SparkSubmitOperator``),
    ``application_args``, and ``job``, the job of its ``checkpointed(spark, job=...)``, which is
    the DAG's id (the API authorises the job's savepoints and restores by that DAG). Every try
    resumes from the job's latest checkpoint (completed steps reused); the spec-only options
    below are refused for it (:mod:`checkpointing_airflow.script_submit`, docs/steps.md). Each
    try names its attempt id the job's coordinator before its driver starts, so an earlier
    try's driver that outlived its task is fenced. Give a script's DAG ``max_active_runs=1``:
    two runs' drivers would each take the one job from the other.

    :param pipeline: path of the pipeline spec (YAML); one naming Python code
        (``pipeline: my_pkg.jobs:build``) is imported here too, and its ``py_files`` are
        passed to spark-submit as ``--py-files``. Omitted: ``application`` is a script.
        (templated)
    :param job: with ``application`` (a script): the job its ``checkpointed(spark, job=...)``
        names; default and only allowed value: the DAG's id (another is refused at parse, or
        before anything is submitted when templated). The driver refuses a script naming
        another job. The Checkpoints page, metrics and retries follow it. (templated)
    :param restore: the first try's restore: ``latest``, ``none``, a checkpoint id, or a
        savepoint path. Retries always resume from this run's latest checkpoint. (templated)
    :param parallelism: the job's parallelism; default: the spec's. (templated)
    :param parallelism_on_retry: retries' parallelism (a rescaled restore); default: the spec's
        ``parallelism_on_retry``, else ``parallelism``. (templated)
    :param metastore_conn_id: the checkpoint metastore connection (else ``CKPT_METASTORE_URL``,
        else the embedded default).
    :param aws_conn_id: AWS connection for S3 checkpoint storage, resolved by the Amazon provider
        (keys, session token, role, profile) once per try and handed to the driver and its
        executors; boto3's standard chain on each of them when it does not exist.
    :param gcp_conn_id: Google Cloud connection for ``gs://`` checkpoint storage (its JSON key),
        resolved once per try as ``aws_conn_id`` is; the machine's own account when it does not
        exist (:mod:`checkpointing_airflow.cloud_credentials`).
    :param azure_conn_id: Azure Blob Storage connection (``wasb``/``adls``) for ``abfs[s]://``
        checkpoint storage, alike.
    :param storage_url: checkpoint storage (``file://``, ``s3://``, ``gs://``, ``abfss://``);
        default: the spec's, else ``CKPT_STORAGE_URL``, else the embedded default. (templated)
    :param fail_first_try_after_epochs: failure drill: the first try crashes after this many
        epochs, so that the retry's resume can be watched (the demo uses it).
    :param coordinator_poll: seconds between coordinator passes while the application runs.
    :param allow_other_job: let ``restore`` be a checkpoint or savepoint path of another job;
        without it such a path fails the task before anything is submitted. (templated)
    :param allow_changed_tables: restore even though a static table (``tables:``) changed
        since the checkpoint; the change is recorded with the restore. (templated)
    :param authorize_restore: every try whose run chose an edit (:meth:`edits`: a ``restore``
        other than ``latest``, a full refresh, ``allow_changed_tables``, another parallelism)
        needs its run's triggering user to be allowed to edit the pipeline's DAG, as the API's
        "Restore from here" does, not only to trigger it
        (:func:`~checkpointing_airflow.permissions.authorize_trigger`). The pipeline DAGs of
        specs set it; a deployment whose auth manager a task cannot ask turns it off in the
        spec DAGs' ``operator_args``.
    :param alerts: Airflow notifiers (any ``BaseNotifier``, or a callable taking the context)
        for checkpoint trouble, restores and savepoints: one or a list hears every alert; a
        mapping names the kinds (``checkpoint_failures``, ``tolerable_failures_exceeded``,
        ``restore_fallback``, ``restore_rescaled``, ``savepoint_completed``,
        ``savepoint_failed``, or ``all``). The context has ``checkpoint_alert`` (its
        ``message`` names the pipeline, the checkpoint, the reason and the Checkpoints page).
        A notifier that raises is logged; it never fails the job.
    :param alert_after_failures: consecutive checkpoint failures that raise
        ``checkpoint_failures`` (once per run of failures).
    :param deferrable: submit a detached driver, free the worker slot while the triggerer
        coordinates it (a script's: watches it); default ``default_deferrable``.
    :param driver_heartbeat_timeout: deferrable: seconds of driver silence that fail the try.
    :param driver_role_ttl: with driver scope enabled on a PostgreSQL metastore (``ckpt db
        driver-scope enable``, docs/cluster.md): seconds the driver's own metastore role is
        valid; default ``execution_timeout``, else 24 hours. Set it above the longest run.

    :param interval_start: a ``scope: interval`` spec's data interval start (ISO 8601; the
        pipeline DAGs pass their run's ``data_interval_start``): the try runs that interval's
        job instance. (templated)
    :param interval_end: the data interval's end (exclusive). (templated)
    :param full_refresh: a ``scope: interval`` job: replace the interval's output (``ckpt run
        --full-refresh``). Every try of the DAG run passes the run's id as the refresh's token,
        so a retry resumes the refresh from its own checkpoints, never from older ones.
        (templated)

    While it runs the task also reports the try's checkpoint metrics through Airflow's
    ``Stats`` (:mod:`checkpointing_airflow.metrics`, names under ``ckpt.``).

    Credentials (the metastore URL, AWS keys, any ``env_vars`` whose name looks like one:
    :mod:`checkpointing_airflow.driver_secrets`) reach the driver through spark-submit's
    process environment only, never as ``--conf`` arguments (which the Spark provider makes of
    ``env_vars`` on YARN and Kubernetes, visible in ``ps``). A deploy mode whose driver runs
    elsewhere (``cluster``) cannot get them that way and is refused with the reason. With
    driver scope enabled on a PostgreSQL metastore, the metastore URL the driver gets is a role
    of its own try's, which reads and writes only this job's rows
    (:mod:`checkpointing_airflow.driver_scope`; docs/cluster.md, "What a driver can reach").
    """

    template_fields: Sequence[str] = (
        *SparkSubmitOperator.template_fields,
        "pipeline",
        "job",
        "restore",
        "parallelism",
        "parallelism_on_retry",
        "storage_url",
        "allow_other_job",
        "allow_changed_tables",
        "interval_start",
        "interval_end",
        "full_refresh",
    )
    ui_color = "#e8f4ea"
    #: "Checkpoints" on its task instances: the pipeline's page in the Checkpoints UI
    operator_extra_links = (CheckpointsLink(),)

    def __init__(
        self,
        *,
        pipeline: str | None = None,
        job: str | None = None,
        restore: str = "latest",
        parallelism: int | str | None = None,
        parallelism_on_retry: int | str | None = None,
        metastore_conn_id: str = CheckpointMetastoreHook.default_conn_name,
        aws_conn_id: str | None = "aws_default",
        gcp_conn_id: str | None = "google_cloud_default",
        azure_conn_id: str | None = "wasb_default",
        storage_url: str | None = None,
        fail_first_try_after_epochs: int | None = None,
        coordinator_poll: float = 1.0,
        allow_other_job: bool | str = False,
        allow_changed_tables: bool | str = False,
        authorize_restore: bool = False,
        interval_start: str | None = None,
        interval_end: str | None = None,
        full_refresh: bool | str = False,
        alerts: Mapping[str, Any] | Sequence[Any] | Any | None = None,
        alert_after_failures: int = 1,
        deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
        driver_heartbeat_timeout: float = HEARTBEAT_TIMEOUT.total_seconds(),
        driver_role_ttl: float | None = None,
        **kwargs: Any,
    ) -> None:
        from checkpointing_airflow.alerts import normalize_alerts
        from checkpointing_airflow.callbacks import job_failed, restore_from_latest

        kwargs["on_retry_callback"] = _with(restore_from_latest, kwargs.get("on_retry_callback"))
        kwargs["on_failure_callback"] = _with(job_failed, kwargs.get("on_failure_callback"))
        if pipeline is not None:
            if job is not None:
                raise ValueError(f"job={job!r}: a spec names its own job; job= is for a script")
            kwargs.setdefault("application", spark_application())
        kwargs.setdefault("name", "ckpt-{{ ti.dag_id }}")
        kwargs.setdefault("durable", False)  # a retry resumes from checkpoints, not the old driver
        super().__init__(**kwargs)
        self.pipeline = pipeline
        self.job = job
        self.restore = restore
        self.parallelism = parallelism
        self.parallelism_on_retry = parallelism_on_retry
        self.metastore_conn_id = metastore_conn_id
        self.aws_conn_id = aws_conn_id
        self.gcp_conn_id = gcp_conn_id
        self.azure_conn_id = azure_conn_id
        self.storage_url = storage_url
        self.fail_first_try_after_epochs = fail_first_try_after_epochs
        self.coordinator_poll = coordinator_poll
        self.allow_other_job = allow_other_job
        self.allow_changed_tables = allow_changed_tables
        self.authorize_restore = authorize_restore
        self.interval_start = interval_start
        self.interval_end = interval_end
        self.full_refresh = full_refresh
        self.alerts = normalize_alerts(alerts)
        self.alert_after_failures = alert_after_failures
        self.deferrable = deferrable
        self.driver_heartbeat_timeout = driver_heartbeat_timeout
        self.driver_role_ttl = driver_role_ttl
        if pipeline is None:
            from checkpointing_airflow.script_submit import refuse_at_parse

            if not job and self.has_dag():  # a script's job is its DAG's id
                self.job = self.dag_id
            refuse_at_parse(self)

    # ------------------------------------------------------------------ what this try runs

    def load_spec(self) -> PipelineSpec:
        from checkpointing.errors import ConfigError
        from checkpointing.pipeline.interval import DataInterval
        from checkpointing.pipeline.spec import load_spec

        if self.pipeline is None:
            raise ConfigError(f"task {self.task_id}: runs the script {self.application}, no spec")
        interval = None
        if self.interval_start not in (None, "") and self.interval_end not in (None, ""):
            interval = DataInterval.parse(str(self.interval_start), str(self.interval_end))
        return load_spec(self.pipeline, interval=interval)

    def metastore_url(self) -> str:
        return CheckpointMetastoreHook(self.metastore_conn_id).get_url()

    def storage_for(self, spec: PipelineSpec) -> str:
        return storage_url_for_run(self.storage_url, spec)

    def parallelism_for(self, spec: PipelineSpec, try_number: int) -> int:
        chosen = self.parallelism_on_retry if try_number > 1 else None
        if try_number > 1 and chosen in (None, ""):
            chosen = spec.parallelism_on_retry
        if chosen in (None, ""):
            chosen = self.parallelism
        return int(chosen) if chosen not in (None, "") else spec.parallelism

    # ------------------------------------------------------------------ execute

    def execute(self, context: Context) -> dict[str, Any]:
        if self.pipeline is None:  # a script: checkpointing_airflow.script_submit
            from checkpointing_airflow.deferred_script import DeferredScript
            from checkpointing_airflow.script_submit import ScriptSubmit

            deferred = DeferredScript(self).execute if self.deferrable else None
            return ScriptSubmit(self).execute(context, deferred)
        spec = self.load_spec()
        storage_url = self.storage_for(spec)
        # this process reads and writes the storage too (restore lookup, retention): once per try
        self._aws_env = self.storage_credentials(storage_url)
        with process_environment(self._aws_env):
            if self.deferrable:  # submits a detached driver and defers: never returns here
                DeferredSubmit(self).execute(context, spec, storage_url)
            return self._execute(context, spec, storage_url)

    def _execute(self, context: Context, spec: PipelineSpec, storage_url: str) -> dict[str, Any]:
        from airflow.sdk.log import mask_secret

        ti = context["ti"]
        url = self.metastore_url()
        mask_secret(url)
        metastore = open_metastore(url)
        attempt = attempt_id(ti.dag_id, ti.run_id, ti.try_number)
        try:
            self._coordinate(context, spec, metastore, url, storage_url, attempt)
        finally:
            if (alerting := getattr(self, "_alerting", None)) is not None:
                alerting.close()  # the try's last alerts are sent before the task ends
        return self._outcome(spec, metastore, attempt)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """The deferred try's outcome, or the failure the callbacks retry from."""
        if self.pipeline is None:  # a script: checkpointing_airflow.deferred_script
            from checkpointing_airflow.deferred_script import DeferredScript

            return DeferredScript(self).complete(context, event)
        return DeferredSubmit(self).complete(context, event)

    def _coordinate(
        self,
        context: Context,
        spec: PipelineSpec,
        metastore: Metastore,
        url: str,
        storage_url: str,
        attempt: str,
    ) -> None:
        """Plan the try, then run it under ``coordinate_attempt`` (the coordinator loop, the
        stats tracker) with spark-submit."""
        from checkpointing.coordination.attempt import coordinate_attempt
        from checkpointing.restore.recovery import pipeline_plan
        from checkpointing.state.storage import CheckpointStorage

        ti = context["ti"]
        restore, parallelism = self.plan_try(context, spec, metastore, storage_url)
        with coordinate_attempt(
            spec.job,
            metastore,
            CheckpointStorage.from_url(storage_url),
            spec.checkpoint.config(),
            attempt=attempt,
            tasks=pipeline_plan(attempt, parallelism, spec.max_parallelism),
            poll=self.coordinator_poll,
            failover_reason=f"try {ti.try_number} ({attempt}) failed",
            stats_tracker=self.stats_tracker(context, spec, metastore, attempt),
        ):
            self.log.info(
                "job %s: try %d as coordinator %s, restore %s, parallelism %d",
                spec.job,
                ti.try_number,
                attempt,
                restore,
                parallelism,
            )
            # with driver scope: the driver's own role, dropped once spark-submit (and with it
            # the driver, in client mode) has ended
            driver_url = driver_metastore_url(self, metastore, spec.job, attempt, url)
            withheld = withheld_variables(self, scoped=driver_url != url)
            try:
                plan = (restore, parallelism, attempt, ti.try_number)
                secrets = self.prepare_application(spec, *plan, driver_url, storage_url, context)
                with withheld_environment(withheld):
                    self.submit(context, spec, metastore, secrets)
            finally:
                if driver_url != url:
                    release_driver(metastore, spec.job, attempt)

    def prepare_application(
        self,
        spec: PipelineSpec,
        restore: str,
        parallelism: int,
        attempt: str,
        try_number: int,
        metastore_url: str,
        storage_url: str,
        context: Context | None = None,
    ) -> dict[str, str]:
        """The try's ``ckpt run`` arguments and files, then :meth:`prepare_submit`."""
        self.application_args = self._application_args(
            spec, restore, parallelism, attempt, try_number
        )
        self.conf = {"spark.pyspark.python": sys.executable, **(self.conf or {})}
        self.py_files = _with_py_files(self.py_files, spec.py_files)
        return self.prepare_submit(self._driver_env(metastore_url, storage_url), context)

    def stats_tracker(
        self,
        context: Context,
        spec: PipelineSpec,
        metastore: Metastore,
        attempt: str,
        *,
        metrics: bool = True,
    ) -> CheckpointStatsTracker:
        """What watches this try's checkpoints and restore: metrics (unless ``metrics`` is False:
        a deferred try's trigger sent them), alerts to the notifiers, the try's lineage facet."""
        from checkpointing.coordination.stats_tracker import CheckpointStatsTracker
        from checkpointing_airflow.alerts import CheckpointAlerts
        from checkpointing_airflow.lineage import TryLineage
        from checkpointing_airflow.links import checkpoints_page
        from checkpointing_airflow.metrics import CheckpointMetrics

        self._lineage = TryLineage(attempt)
        listeners: list[Any] = [*([CheckpointMetrics(spec.job)] if metrics else []), self._lineage]
        if self.alerts:
            page = checkpoints_page(spec.job)
            self._alerting = CheckpointAlerts(spec.job, self.alerts, context, page)
            listeners.append(self._alerting)
        threshold = self.alert_after_failures
        return CheckpointStatsTracker(
            spec.job, metastore, attempt, listeners, failure_alert_threshold=threshold
        )

    # ------------------------------------------------------------------ OpenLineage

    def get_openlineage_facets_on_start(self) -> OperatorLineage:
        """The OpenLineage provider's START event: the spec's input datasets and sink."""
        from airflow.providers.openlineage.extractors import OperatorLineage

        from checkpointing_airflow.lineage import operator_lineage

        if self.pipeline is None:  # a script's datasets are its own: only the facet is ours
            return OperatorLineage()
        return operator_lineage(self.load_spec())

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> OperatorLineage:
        """COMPLETE: the datasets and the ``checkpointing`` run facet (what the try restored,
        epochs redone, parallelism, its checkpoints)."""
        from checkpointing_airflow.lineage import TryLineage, operator_lineage

        ti = task_instance
        watched = getattr(self, "_lineage", None) or TryLineage(
            attempt_id(ti.dag_id, ti.run_id, ti.try_number)
        )
        if self.pipeline is None:
            from airflow.providers.openlineage.extractors import OperatorLineage

            return OperatorLineage(run_facets={"checkpointing": watched.facet()})
        return operator_lineage(self.load_spec(), watched.facet())

    def get_openlineage_facets_on_failure(self, task_instance: Any) -> OperatorLineage:
        """FAIL: as COMPLETE, up to where the try failed."""
        return self.get_openlineage_facets_on_complete(task_instance)

    def plan_try(
        self, context: Context, spec: PipelineSpec, metastore: Metastore, storage_url: str
    ) -> tuple[str, int]:
        """What this try restores and its parallelism, once its run may choose them
        (:func:`checkpointing_airflow.try_plan.plan_try`)."""
        return try_plan.plan_try(self, context, spec, metastore, storage_url)

    def submit(
        self, context: Context, spec: PipelineSpec, metastore: Metastore, secrets: Mapping[str, str]
    ) -> None:
        """Run spark-submit (the provider's ``execute``) with ``secrets`` in its process
        environment only; a failed try logs one line saying how it ended and what comes next."""
        try:
            with process_environment(secrets):  # spark-submit inherits them, nothing else
                super().execute(context)
        except BaseException as exc:
            try_number = context["ti"].try_number
            self.log.error("%s", failed_try_line(self, spec, metastore, try_number, exc))
            raise

    def _application_args(
        self, spec: PipelineSpec, restore: str, parallelism: int, attempt: str, try_number: int
    ) -> list[str]:
        """``ckpt run``'s arguments for the driver: the attempt id is its coordinator id too."""
        args = [
            "run",
            str(spec.spec_path),
            "--restore",
            restore,
            "--parallelism",
            str(parallelism),
            "--attempt",
            attempt,
            "--coordinator-id",
            attempt,
        ]
        if truthy(self.allow_other_job):
            args.append("--allow-other-job")
        if truthy(self.allow_changed_tables):
            args.append("--allow-changed-tables")
        if spec.interval is not None:
            args += ["--interval-start", spec.interval.start.isoformat()]
            args += ["--interval-end", spec.interval.end.isoformat()]
        if truthy(self.full_refresh):  # the token plan_try took: the same on every try
            args += ["--full-refresh", "--refresh-token", self._refresh_token]
        if self.fail_first_try_after_epochs and try_number == 1:
            args += ["--fail-after-epochs", str(self.fail_first_try_after_epochs)]
        return args

    def prepare_submit(
        self, env: Mapping[str, str], context: Context | None = None
    ) -> dict[str, str]:
        """Mask every credential of the driver's environment ``env`` (by variable name), keep
        the credentials out of ``env_vars`` (the provider turns those into ``--conf``
        arguments on YARN and Kubernetes) and build the spark-submit hook; returns the
        credentials, for spark-submit's own process environment. Refuses (the task fails for
        good) a deploy mode whose driver does not run here. With the try's ``context``,
        OpenLineage's parent-job properties go into ``conf`` first
        (:func:`~checkpointing_airflow.lineage.lineage_parent`)."""
        from airflow.sdk.exceptions import AirflowFailException
        from airflow.sdk.log import mask_secret

        secrets = {k: v for k, v in env.items() if is_secret_name(k) and v}
        for name, value in env.items():
            if name in secrets:
                mask_secret(value)
                if name == "CKPT_METASTORE_URL":
                    mask_url_password(value, mask_secret)
            else:
                mask_secret(value, name)  # Airflow's own rule for sensitive names
        self.env_vars = {k: v for k, v in env.items() if k not in secrets}
        if context is not None:
            from checkpointing_airflow.lineage import lineage_parent

            self.conf = lineage_parent(self, context)
        self._hook = self._get_hook()  # the provider's execute submits with this hook
        deploy_mode, master = submit_target(self._hook)
        if secrets and deploy_mode == "cluster":
            raise AirflowFailException(
                f"deploy mode cluster (master {master}): the driver would run "
                f"on the cluster and need {', '.join(sorted(secrets))}, which spark-submit can "
                "only pass there as --conf arguments, visible in the process list and the Spark "
                "UI; refused: use deploy mode client"
            )
        return secrets

    def _driver_env(self, metastore_url: str, storage_url: str) -> dict[str, str]:
        """The driver's configuration goes by environment, never on the command line (which
        spark-submit and Airflow log): the metastore URL may hold a password."""
        from checkpointing.config import ckpt_home

        venv_bin = str(Path(sys.executable).parent)
        env = {
            # the spec's ${CKPT_HOME} resolves on the driver as it did here
            "CKPT_HOME": str(ckpt_home()),
            "CKPT_METASTORE_URL": metastore_url,
            "CKPT_STORAGE_URL": storage_url,
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
            "PATH": venv_bin + os.pathsep + os.environ.get("PATH", ""),
            **self._storage_env(storage_url),
        }
        if roots := os.environ.get("CKPT_STORAGE_ROOTS"):  # a savepoint's target checks them
            env["CKPT_STORAGE_ROOTS"] = roots
        return {**env, **{k: str(v) for k, v in (self.env_vars or {}).items()}}

    def _storage_env(self, storage_url: str) -> dict[str, str]:
        """The try's storage credentials, resolved once in ``execute`` (else now)."""
        env = getattr(self, "_aws_env", None)
        return self.storage_credentials(storage_url) if env is None else env

    def storage_credentials(self, storage_url: str) -> dict[str, str]:
        """The storage's credentials from this task's AWS, Google Cloud or Azure connection."""
        return storage_environment(
            self.aws_conn_id,
            storage_url,
            gcp_conn_id=getattr(self, "gcp_conn_id", None),
            azure_conn_id=getattr(self, "azure_conn_id", None),
        )

    def _outcome(self, spec: PipelineSpec, metastore: Metastore, attempt: str) -> dict[str, Any]:
        """The try's outcome (its XCom), from the metastore: the driver may have run elsewhere."""
        from checkpointing.metastore.outcome import attempt_outcome

        outcome = attempt_outcome(metastore, spec.job, attempt).to_dict()

        finished = outcome["status"] == "FINISHED" and not outcome["savepoint_path"]
        outcome["final_path"] = spec.final_location() if finished else None
        if outcome["savepoint_path"]:
            self.log.info("job %s stopped with savepoint %s", spec.job, outcome["savepoint_path"])
        self.log.info(
            "job %s: try ran %s epochs, %s epochs done, checkpoints %s",
            spec.job,
            outcome["epochs_run"],
            outcome["epochs_done"],
            outcome["checkpoints"],
        )
        return outcome


def _with(ours: Any, theirs: Any) -> list[Any]:
    """Our callback first, then the user's (one or a list)."""
    extra = [] if theirs is None else list(theirs) if isinstance(theirs, list | tuple) else [theirs]
    return [ours, *(c for c in extra if c is not ours)]


def _with_py_files(given: str | None, spec_files: Sequence[str]) -> str | None:
    """``--py-files``: the operator's own (comma-separated), then the spec's, once each: the
    executors import a Python pipeline's code from them (the driver from the spec's too)."""
    files = [f for f in (given or "").split(",") if f.strip()]
    files += [f for f in spec_files if f not in files]
    return ",".join(files) or None
