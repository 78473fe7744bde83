"""``CheckpointedSparkSubmitOperator(application="jobs/daily.py")`` in the DAG
``daily_revenue``: a user's PySpark script whose steps are checkpointed
(:func:`checkpointing.spark.steps.checkpointed`) deployed as the task, instead of a pipeline spec.
Its job is the DAG's id (``job=`` defaults to it and may be nothing else: the API authorises a
job's savepoints and restores by the DAG of the job's id).

spark-submit runs ``checkpointing/cli/spark_app.py run <script> --restore <r> -- <args>`` (what
``ckpt run script.py`` does), so the script runs inside the spark-submit driver and its
``SparkSession`` picks up spark-submit's master and ``--conf``. Its ``checkpointed(spark,
job=...)`` is the job's coordinator: each ``ck.step`` is a checkpoint it triggers and completes,
and its start takes coordination over from a killed predecessor (after keeping the files the
crashed step's tasks had acknowledged). Before its driver starts, each try names its attempt id
the job's coordinator (:func:`checkpointing.coordination.attempt.name_successor`) and hands it to
the driver (:data:`ENV_COORDINATOR`): an earlier try's driver that outlived its task is refused
from then on, and changes nothing. Two DAG runs at once would do the same to each other: give the
DAG ``max_active_runs=1``. The task therefore runs no coordinator loop of its own
(no periodic checkpoints: a step is the checkpoint); it watches the job by its id as the spec
path does (metrics, alerts, the lineage facet, the Checkpoints page), and every retry resumes
from the job's latest checkpoint: completed steps are read back, not recomputed.

What needs a spec is refused for a script, in one line, before anything is submitted: a restore
other than ``latest``/``none``, ``allow_other_job``, ``allow_changed_tables``, an interval,
``full_refresh``, ``fail_first_try_after_epochs`` and ``authorize_restore``.

``deferrable=True`` submits the driver detached and frees the worker slot; a trigger watches it
(:mod:`checkpointing_airflow.deferred_script`).

``parallelism`` (first try) and ``parallelism_on_retry`` (retries) become the driver's
``spark.default.parallelism`` and ``spark.sql.shuffle.partitions``: the cores a scan's splits
are sized for, and at most the tasks, and checkpoint files, of each wide step (adaptive
execution coalesces its last stage as it would without checkpoints). The executors (cores,
instances) stay what the Spark connection and ``conf`` give; a script that sets these two
options on its own session wins over them.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from checkpointing.steps.script import ENV_COORDINATOR, ENV_JOB, RESTORES
from checkpointing_airflow.application import spark_application
from checkpointing_airflow.attempts import attempt_id, driver_ending
from checkpointing_airflow.try_plan import truthy

if TYPE_CHECKING:
    from airflow.sdk import Context

    from checkpointing.metastore.engine import Metastore

#: the spec-only options, with their "unset" values: a script run refuses any other value
SPEC_ONLY: dict[str, tuple[Any, ...]] = {
    "allow_other_job": (False, None, ""),
    "allow_changed_tables": (False, None, ""),
    "interval_start": (None, ""),
    "interval_end": (None, ""),
    "full_refresh": (False, None, ""),
    "fail_first_try_after_epochs": (None, 0),
    "authorize_restore": (False,),
}


#: spark-submit's ``--conf`` naming the try's attempt id on its command line: how the deferred
#: path tells its detached driver's process from a reused pid
#: (:func:`~checkpointing.coordination.drivers.owned_process`); Spark's UI shows it too
ATTEMPT_CONF = "spark.ckpt.attempt"


#: the operator's attribute keeping the user's script once ``application`` is spark-submit's
#: (Airflow 3 hands the failure callbacks the operator that ran)
SCRIPT_ATTR = "script_application"


@dataclass(frozen=True)
class ScriptJob:
    """What a script's try runs: the job it checkpoints, the script and its arguments."""

    job: str
    script: Path
    args: tuple[str, ...]


def refuse_at_parse(op: Any) -> None:
    """The DAG file's own mistakes, refused when it is parsed (an import error of that file):
    no ``application``, and a ``job`` that is not its DAG's id (when the ``job`` is not a
    template: a rendered one is checked by :func:`script_job`)."""
    if not op.application:
        raise ValueError(f"task {op.task_id}: give pipeline= (a spec) or application= (a script)")
    if not op.job:
        raise ValueError(
            f"task {op.task_id}: job= is required with application= outside a DAG (in one, it "
            "is the DAG's id, the job that the script's checkpointed(spark, job=...) names)"
        )
    if "{{" not in str(op.job):
        check_job_id(op, str(op.job))


def check_job_id(op: Any, job: str) -> str:
    """A script's job: a valid job id, not shaped like an interval's job instance, and the id of
    the task's DAG (the API authorises a job's actions, savepoints and restores, by the DAG
    whose id is the job's), else one line naming it."""
    from checkpointing.pipeline.interval import check_job_name
    from checkpointing.steps.identity import step_name

    job = check_job_name(step_name(job))
    dag_id = op.dag_id if op.has_dag() else None
    if dag_id is not None and job != dag_id:
        raise ValueError(
            f"task {op.task_id}: job={job!r} is not its DAG's id {dag_id!r}: a script's job "
            "is its DAG's (whose permissions guard the job's savepoints and restores); name "
            "the DAG after the job or leave job= out"
        )
    return job


def script_job(op: Any) -> ScriptJob:
    """The try's script job, its rendered fields checked: one line naming the field, raised as
    ``AirflowFailException`` (no retry) before anything is submitted."""
    from airflow.sdk.exceptions import AirflowFailException

    from checkpointing.errors import ConfigError
    from checkpointing.steps.script import check_script

    try:
        refuse_at_parse(op)
        for name, unset in SPEC_ONLY.items():
            value = getattr(op, name, None)
            # a templated switch renders as text: "False" is off
            off = False in unset and isinstance(value, str) and not truthy(value)
            if value not in unset and not off:
                raise ConfigError(f"{name}={value!r}: applies to a pipeline spec, not a script")
        if str(op.restore) not in RESTORES:
            raise ConfigError(
                f"restore={str(op.restore)!r}: a script resumes from 'latest' or starts over "
                "with 'none' (restore plans of checkpoint ids and savepoints need a spec)"
            )
        for name in ("parallelism", "parallelism_on_retry"):
            value = getattr(op, name)
            if value not in (None, "") and (not str(value).isdigit() or int(value) < 1):
                raise ConfigError(f"{name}={value!r}: a positive number of tasks")
        return ScriptJob(
            check_job_id(op, str(op.job)),
            check_script(script_path(op)),
            tuple(str(a) for a in (op.application_args or ())),
        )
    except (ConfigError, ValueError) as exc:
        raise AirflowFailException(f"task {op.task_id}: {exc}") from None


def script_path(op: Any) -> Path:
    """``application``: a relative path is the DAG file's folder's (where the DAG's author put
    it), else as given; once :meth:`ScriptSubmit.prepare` made ``application`` spark-submit's,
    the script it kept (:data:`SCRIPT_ATTR`)."""
    path = Path(str(getattr(op, SCRIPT_ATTR, None) or op.application))
    dag = op.dag if op.has_dag() else None
    fileloc = getattr(dag, "fileloc", None)
    if not path.is_absolute() and fileloc and (Path(fileloc).parent / path).exists():
        return Path(fileloc).parent / path
    return path


def script_parallelism(op: Any, try_number: int) -> int | None:
    """The try's parallelism: ``parallelism_on_retry`` on a retry when set, else
    ``parallelism``; None leaves the script's and the connection's."""
    chosen = op.parallelism_on_retry if try_number > 1 else None
    if chosen in (None, ""):
        chosen = op.parallelism
    return None if chosen in (None, "") else int(chosen)


class ScriptSubmit:
    """The script path of one operator instance (composed into it, as the deferred path is)."""

    def __init__(self, operator: Any) -> None:
        self.op = operator
        self.secrets: dict[str, str] = {}

    def execute(
        self, context: Context, deferred: Callable[..., NoReturn] | None = None
    ) -> dict[str, Any]:
        """The try: every refusal first, then the driver run under this task (or, with
        ``deferred``, :meth:`DeferredScript.execute
        <checkpointing_airflow.deferred_script.DeferredScript.execute>`, launched detached)."""
        from airflow.sdk.log import mask_secret

        from checkpointing.metastore.jobs import storage_url_for_run
        from checkpointing_airflow.driver_secrets import process_environment
        from checkpointing_airflow.hooks import open_metastore

        op = self.op
        job = script_job(op)  # every refusal before anything else
        storage_url = storage_url_for_run(op.storage_url)
        op._aws_env = op.storage_credentials(storage_url)
        url = op.metastore_url()
        mask_secret(url)
        with process_environment(op._aws_env):
            metastore = open_metastore(url)
            try:
                self.refuse_a_specs_job(job, metastore)
                if deferred is not None:  # launches the driver detached and defers
                    deferred(context, job, metastore, url, storage_url)
                return self._run(context, job, metastore, url, storage_url)
            finally:
                if (alerting := getattr(op, "_alerting", None)) is not None:
                    alerting.close()
                metastore.dispose()

    def _run(
        self, context: Context, job: ScriptJob, metastore: Metastore, url: str, storage_url: str
    ) -> dict[str, Any]:
        from checkpointing_airflow.driver_scope import (
            driver_metastore_url,
            release_driver,
            withheld_environment,
            withheld_variables,
        )

        op, ti = self.op, context["ti"]
        attempt = attempt_id(ti.dag_id, ti.run_id, ti.try_number)
        restore = "latest" if ti.try_number > 1 else str(op.restore)
        parallelism = script_parallelism(op, ti.try_number)
        self.name_try(metastore, job, attempt, storage_url)
        op.log.info(
            "job %s: try %d runs script %s, restore %s, parallelism %s",
            job.job,
            ti.try_number,
            job.script,
            restore,
            parallelism if parallelism is not None else "(the script's)",
        )
        tracker = op.stats_tracker(context, job, metastore, attempt)  # type: ignore[arg-type]
        watch = Watch(tracker, float(op.coordinator_poll))
        watch.start()
        driver_url = driver_metastore_url(op, metastore, job.job, attempt, url)
        try:
            self.prepare(job, attempt, restore, parallelism, driver_url, storage_url, context)
            with withheld_environment(withheld_variables(op, scoped=driver_url != url)):
                self.submit(context, job, metastore, parallelism)
        finally:
            watch.stop()
            if driver_url != url:
                release_driver(metastore, job.job, attempt)
        return self.outcome(job, metastore, attempt, parallelism)

    def refuse_a_specs_job(self, job: ScriptJob, metastore: Metastore) -> None:
        """A spec pipeline's job fails the try for good, before it names its coordinator
        (which would fence the spec's) or launches anything
        (:func:`~checkpointing.steps.job_check.refuse_a_specs_job`)."""
        from airflow.sdk.exceptions import AirflowFailException

        from checkpointing.errors import ConfigError
        from checkpointing.steps.job_check import refuse_a_specs_job

        try:
            refuse_a_specs_job(metastore, job.job)
        except ConfigError as exc:
            raise AirflowFailException(f"task {self.op.task_id}: {exc}") from None

    def name_try(
        self, metastore: Metastore, job: ScriptJob, attempt: str, storage_url: str
    ) -> None:
        """Name the try's attempt id the job's coordinator before its driver starts (as the
        spec path's coordinator does): an earlier try's driver that outlived its task is fenced
        from now on, while the pending step it left stays for this try's driver to salvage. A
        new job is registered first (a first try's driver may outlive its task before it
        registered the job)."""
        from checkpointing.coordination.attempt import name_successor
        from checkpointing.steps.plan import step_config

        if name_successor(metastore, job.job, attempt, register=(step_config(), storage_url)):
            self.op.log.info("job %s: coordinator %s named; earlier tries fenced", job.job, attempt)

    def prepare(
        self,
        job: ScriptJob,
        attempt: str,
        restore: str,
        parallelism: int | None,
        metastore_url: str,
        storage_url: str,
        context: Context | None = None,
    ) -> None:
        """spark-submit's application (``ckpt run <script>``), conf and the driver's
        environment (the job it must run in :data:`ENV_JOB`, the coordinator id it acts under
        in :data:`ENV_COORDINATOR`); the credentials for spark-submit's own process environment
        are kept for :meth:`submit`. The user's script stays in :data:`SCRIPT_ATTR`."""
        op = self.op
        setattr(op, SCRIPT_ATTR, str(job.script))
        op.application = spark_application()
        op.application_args = ["run", str(job.script), "--restore", restore, "--", *job.args]
        conf = {"spark.pyspark.python": sys.executable, **(op.conf or {})}
        conf[ATTEMPT_CONF] = attempt
        if parallelism is not None:
            conf["spark.default.parallelism"] = str(parallelism)
            conf["spark.sql.shuffle.partitions"] = str(parallelism)
        op.conf = conf
        op.env_vars = {**(op.env_vars or {}), ENV_JOB: job.job, ENV_COORDINATOR: attempt}
        self.secrets = op.prepare_submit(op._driver_env(metastore_url, storage_url), context)

    def submit(
        self, context: Context, job: ScriptJob, metastore: Metastore, parallelism: int | None
    ) -> None:
        """spark-submit, credentials in its process environment only; a failed try logs one
        line: how the driver ended, the job's last checkpoint and what the retry does."""
        from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
        from airflow.sdk.exceptions import AirflowFailException

        from checkpointing.steps.script import EXIT_REFUSED
        from checkpointing_airflow.driver_secrets import process_environment
        from checkpointing_airflow.spark_submit_internals import submit_returncode

        op = self.op
        try:
            with process_environment(self.secrets):
                SparkSubmitOperator.execute(op, context)
        except BaseException as exc:
            try_number = context["ti"].try_number
            if submit_returncode(getattr(op, "_hook", None)) == EXIT_REFUSED:
                raise AirflowFailException(
                    f"job {job.job}: try {try_number}: the script was refused for its "
                    f"configuration (the driver's `error:` line above, exit code {EXIT_REFUSED}); "
                    "not retried: a retry would be refused the same way"
                ) from exc
            op.log.error("%s", failed_line(op, job, metastore, try_number, exc))
            raise

    def outcome(
        self, job: ScriptJob, metastore: Metastore, attempt: str, parallelism: int | None
    ) -> dict[str, Any]:
        """The try's XCom, from the job row its driver wrote under ``attempt`` (as the spec
        path's ``_outcome``): FINISHED succeeds (a stop-with-savepoint with ``savepoint_path``
        and no ``final_path``), FAILED or a run left RUNNING fails the try (retried); a script
        that ran no ``checkpointed`` of its job under ``attempt`` fails it for good."""
        from airflow.sdk.exceptions import AirflowException, AirflowFailException

        from checkpointing.coordination.drivers import read_state
        from checkpointing.metastore.outcome import attempt_outcome
        from checkpointing.status import JobStatus, StatusWriter

        state = read_state(metastore, job.job)
        if state.coordinator_id not in (None, attempt):
            raise AirflowException(
                f"job {job.job}: try {attempt} was superseded by {state.coordinator_id}"
            )
        if state.coordinator_id is None or state.status_by != StatusWriter.RUN.of(attempt):
            raise AirflowFailException(
                f"job {job.job}: the script {job.script} ended without running "
                f"checkpointed(spark, job={job.job!r}) (does it name another job?)"
            )
        outcome = attempt_outcome(metastore, job.job, attempt).to_dict()
        if outcome["status"] != JobStatus.FINISHED:
            raise AirflowException(
                f"job {job.job}: the script's driver exited with the job {outcome['status']} "
                f"(its checkpointed(spark, job={job.job!r}) did not finish)"
            )
        outcome.update(script=str(job.script), parallelism=parallelism, final_path=None)
        latest = outcome["latest"]
        outcome["last_checkpoint"] = None if latest is None else latest["checkpoint_id"]
        if outcome["savepoint_path"]:
            self.op.log.info("job %s stopped with savepoint %s", job.job, outcome["savepoint_path"])
        self.op.log.info("job %s: script finished; %s", job.job, outcome)
        return outcome


def failed_line(op: Any, job: ScriptJob, metastore: Any, try_number: int, exc: Any) -> str:
    """The one line a failed script try logs."""
    from checkpointing.metastore.outcome import latest_completed
    from checkpointing_airflow.spark_submit_internals import submit_returncode

    try:
        latest = latest_completed(metastore, job.job)
        last = (
            "no completed checkpoint" if latest is None else f"last completed {latest.describe()}"
        )
    except Exception as error:  # the metastore may be what failed
        last = f"last completed checkpoint unknown ({type(error).__name__})"
    ending = driver_ending(submit_returncode(getattr(op, "_hook", None)), exc)
    if (op.retries or 0) >= try_number:
        nxt = script_parallelism(op, try_number + 1)
        shown = "the script's" if nxt is None else str(nxt)
        then = (
            f"the retry (try {try_number + 1}) resumes from the latest checkpoint, reusing its "
            f"completed steps, parallelism {shown}"
        )
    else:
        then = "no retry left"
    return f"job {job.job}: try {try_number}: the Spark driver {ending}; {last}; {then}"


class Watch:
    """Polls the try's stats tracker (metrics, alerts, lineage) while the driver runs: the
    script's ``checkpointed`` coordinates, so no coordinator loop polls it here."""

    def __init__(self, tracker: Any, every: float) -> None:
        self.tracker = tracker
        self.every = max(0.2, every)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="ckpt-script-watch", daemon=True)

    def start(self) -> None:
        self._poll(self.tracker.start)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stopped.wait(self.every):
            self._poll(self.tracker.poll)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()
        self._poll(self.tracker.poll)  # the try's last checkpoints

    @staticmethod
    def _poll(step: Any) -> None:
        import logging

        try:
            step()
        except Exception:  # the try's outcome is the job's, never the watch's
            logging.getLogger(__name__).exception("checkpoint stats tracker failed")


def _latest_completed(task: Any, job: str) -> Any:
    """The job's latest completed checkpoint or savepoint (None: nothing to resume from)."""
    from checkpointing.metastore.outcome import latest_completed
    from checkpointing_airflow.hooks import open_metastore

    metastore = open_metastore(task.metastore_url())
    try:
        return latest_completed(metastore, job)
    finally:
        metastore.dispose()


def _driver_lives(task: Any, job: str, context: Any) -> bool:
    """Whether the failed deferrable try's detached driver lives or finished (its retry
    re-attaches to it)."""
    from checkpointing_airflow.detached_driver import live_driver
    from checkpointing_airflow.hooks import open_metastore

    ti = context["ti"]
    failed = attempt_id(ti.dag_id, ti.run_id, ti.try_number)
    metastore = open_metastore(task.metastore_url())
    try:
        return live_driver(metastore, job, failed, task.driver_heartbeat_timeout)
    finally:
        metastore.dispose()


def script_retry_callback(context: Any, task: Any) -> None:
    """``on_retry_callback`` for a script: nothing to abort or plan (the retry's
    ``checkpointed`` takes over, keeping what the dead step's tasks had acknowledged, and
    restores the latest checkpoint); the log says what it resumes from."""
    import logging

    log = logging.getLogger("checkpointing_airflow.callbacks")
    job = str(task.job)
    if getattr(task, "deferrable", False) and _driver_lives(task, job, context):
        log.warning(
            "failover: job %s: the script's driver still runs (or has finished): the retry "
            "re-attaches to it, no step redone",
            job,
        )
        return
    latest = _latest_completed(task, job)
    nxt = script_parallelism(task, context["ti"].try_number + 1)
    log.warning(
        "failover: job %s: the retry runs the script again from %s, parallelism %s",
        job,
        "nothing" if latest is None else latest.describe(),
        nxt if nxt is not None else "(the script's)",
    )


def script_failed_callback(context: Any, task: Any) -> None:
    """``on_failure_callback`` for a script: the job's checkpoints stay as they are (a pending
    step's acknowledged files too), so that a rerun resumes; the log says how."""
    import logging

    log = logging.getLogger("checkpointing_airflow.callbacks")
    job = str(task.job)
    latest = _latest_completed(task, job)
    script = getattr(task, SCRIPT_ATTR, None) or task.application  # not spark-submit's
    log.error(
        "job %s failed after %d tries; %s: clear the task (or `ckpt run %s --restore latest`) "
        "to resume from it",
        job,
        context["ti"].try_number,
        "no completed checkpoint" if latest is None else f"its latest is {latest.describe()}",
        os.fspath(script),
    )
