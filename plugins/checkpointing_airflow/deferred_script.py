"""``deferrable=True`` for a script (``application="jobs/daily.py"``): the task submits the
script's driver detached and frees its worker slot, as it does for a spec
(:mod:`checkpointing_airflow.deferred`).

What differs is who coordinates. A spec's driver runs epochs that the trigger checkpoints; a
script's ``checkpointed(spark, job=...)`` is its own coordinator (each ``ck.step`` is a
checkpoint it triggers and completes). So the trigger only *watches* the driver
(``coordinates=False``): the job row's verdict (the driver's own FINISHED or FAILED, its
heartbeat, its process) and the job's metrics. It triggers nothing, takes no savepoint request
(the driver takes them at step boundaries) and, once the driver is lost, aborts nothing: the
retry's driver salvages what the dead step's tasks acknowledged.

The try names its attempt id the job's coordinator before the driver starts, as the
non-deferrable script try does (an earlier try's driver that outlived its task is fenced), and a
retry whose previous driver still runs re-attaches to it instead (no restart, no step redone).
A script refused for its configuration fails the try without a retry: a driver that exits with
code 78 before its first heartbeat (the script names another job, say), or one whose run
recorded FAILED with the refusal as the job row's cause (a step refused later: the trigger sees
the row, not the exit code).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn

from checkpointing.coordination.drivers import AttemptVerdict, DriverIdentity, Outcome, read_state
from checkpointing_airflow.attempts import attempt_id, run_started
from checkpointing_airflow.deferred import DeferredSubmit, refuse_cluster_mode
from checkpointing_airflow.detached_driver import EXIT_GRACE_S
from checkpointing_airflow.driver_scope import (
    driver_metastore_url,
    release_driver,
    withheld_variables,
)
from checkpointing_airflow.hooks import open_metastore
from checkpointing_airflow.script_submit import (
    ScriptJob,
    ScriptSubmit,
    failed_line,
    script_job,
    script_parallelism,
)

if TYPE_CHECKING:
    from airflow.sdk import Context

    from checkpointing.metastore.engine import Metastore


class DeferredScript:
    """The deferrable script path of one operator instance (composed, as its parts are)."""

    def __init__(self, operator: Any) -> None:
        self.op = operator
        self.deferred = DeferredSubmit(operator)
        self.script = ScriptSubmit(operator)

    def execute(
        self, context: Context, job: ScriptJob, metastore: Metastore, url: str, storage_url: str
    ) -> NoReturn:
        """Re-attach to a live previous driver, or name this try the coordinator, launch the
        script's driver detached, record it, wait for its first heartbeat and defer."""
        op, ti = self.op, context["ti"]
        attempt = attempt_id(ti.dag_id, ti.run_id, ti.try_number)
        self.deferred.reattach(
            metastore,
            job.job,
            attempt,
            run_started(context),
            lambda found, watcher: self.defer(job, found, watcher, storage_url),
        )
        refuse_cluster_mode(op)  # before the takeover
        self.deferred.stop_previous_driver(metastore, job.job, attempt)
        restore = "latest" if ti.try_number > 1 else str(op.restore)
        parallelism = script_parallelism(op, ti.try_number)
        self.script.name_try(metastore, job, attempt, storage_url)
        driver_url = driver_metastore_url(op, metastore, job.job, attempt, url)
        try:
            self.script.prepare(
                job, attempt, restore, parallelism, driver_url, storage_url, context
            )
            withheld = withheld_variables(op, scoped=driver_url != url)
            driver = self.deferred.launch(
                job.job, attempt, self.script.secrets, parallelism, withheld
            )
        except BaseException:
            release_driver(metastore, job.job, attempt)
            raise
        self.deferred.record(metastore, job.job, driver)
        op.log.info(
            "job %s: try %d runs script %s as coordinator %s, restore %s, parallelism %s: %s",
            job.job,
            ti.try_number,
            job.script,
            attempt,
            restore,
            parallelism if parallelism is not None else "(the script's)",
            driver.describe(),
        )
        self.deferred.await_start(
            metastore, job.job, driver, lambda v: self.fail(context, job, metastore, v)
        )
        op.log.info("job %s: the script's driver is up; deferring to the triggerer", job.job)
        metastore.dispose()
        self.defer(job, driver, attempt, storage_url)

    def defer(self, job: ScriptJob, driver: DriverIdentity, watcher: str, storage: str) -> NoReturn:
        """Hand ``driver`` to a trigger that watches it (the script coordinates itself)."""
        self.deferred.defer(job.job, driver, watcher, storage, None)

    def complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """The trigger's event as the try's outcome (the non-deferrable try's XCom), or the
        failure that retries."""
        op = self.op
        verdict = AttemptVerdict.from_event(event)
        job = script_job(op)
        metastore = open_metastore(op.metastore_url())
        attempt = verdict.attempt  # the driver's: this try's own, or the one it re-attached to
        try:
            self.deferred.replay(context, job, metastore, attempt)
            if verdict.succeeded:
                driver = read_state(metastore, job.job).driver
                ran = driver.parallelism if driver and driver.attempt == attempt else None
                outcome = self.script.outcome(job, metastore, attempt, ran)
                self.deferred.release_role(metastore, job.job, attempt)
                return outcome
            self.fail(context, job, metastore, verdict)
        finally:
            metastore.dispose()

    def fail(
        self, context: Context, job: ScriptJob, metastore: Metastore, verdict: AttemptVerdict
    ) -> NoReturn:
        """End the try on a failed ``verdict``. A script refused for its configuration fails it
        for good, its driver's log tail above: the driver this task launched exited with the
        refusal's exit code before its first heartbeat, or the job row's cause, written by the
        driver's own run, says it was refused."""

        from checkpointing.steps.script import EXIT_REFUSED, REFUSED_CAUSE

        op, try_number = self.op, context["ti"].try_number
        state = read_state(metastore, job.job)
        cause = state.failure_cause or ""
        # the driver this task launched: exiting after its FAILED, or judged gone as it exits
        wait = EXIT_GRACE_S if verdict.outcome is Outcome.FAILED else 5.0
        exited = self.deferred.returncode(wait=wait)
        refused = exited == EXIT_REFUSED or (
            verdict.outcome is Outcome.FAILED and cause.startswith(REFUSED_CAUSE)
        )  # the row's cause: a FAILED verdict is the driver's own run's
        message = None
        if refused:
            message = (
                f"job {job.job}: try {try_number}: the script was refused for its configuration "
                f"(the driver's `error:` line above, exit code {EXIT_REFUSED}); not retried: a "
                "retry would be refused the same way"
            )
        self.deferred.fail(
            metastore,
            job.job,
            verdict,
            lambda error: failed_line(op, job, metastore, try_number, error),
            refused=message,
        )
