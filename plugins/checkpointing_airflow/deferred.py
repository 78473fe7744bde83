"""``deferrable=True`` for the ``CheckpointedSparkSubmitOperator``: the task submits a driver
that does not depend on its process, then frees its worker slot.

A 3-hour pipeline would otherwise hold a worker slot for 3 hours, and a worker restart would kill
its driver (spark-submit's child) and force a restore. Here the task

1. plans the try and takes over the job's coordination (``activate``: a dead predecessor's pending
   checkpoints are aborted as coordinator failover), as the non-deferrable task does;
2. starts ``spark-submit`` in client mode *detached* (its own session, output to a log file
   under ``CKPT_HOME/logs/drivers/``, credentials by environment only, as
   :mod:`~checkpointing_airflow.driver_secrets` has them) and records the driver's identity
   (attempt, host, pid, log, submission time) on the job row, only while its attempt leads;
   it keeps the slot until the driver's first heartbeat, so that a driver failing to start
   fails the try with its log in the task's log (and a task killed meanwhile leaves a recorded
   driver that its retry re-attaches to);
3. defers to :class:`~checkpointing_airflow.triggers.CheckpointCoordinatorTrigger`, the
   try's checkpoint coordinator in the triggerer, which fires when the outcome is in the
   metastore or the driver stops heart-beating;
4. resumes in ``execute_complete``: the try's outcome (the same XCom as without deferral) or an
   ``AirflowException`` saying what happened, which the failure callbacks turn into a retry that
   restores the latest checkpoint.

A retry whose previous try's driver is still alive (recorded, RUNNING, heart-beating, its attempt
still the job's coordinator; one still starting is given the rest of ``driver_heartbeat_timeout``
to beat first), or has finished meanwhile, *re-attaches* to it instead of restarting
(:meth:`reattach`): no
submit, no restore, no epoch redone; it defers to a trigger that coordinates under the driver's
attempt id (the driver acts under it) as the new *watcher*, which supersedes the previous try's
trigger. A previous driver that is not alive enough to re-attach to but still runs on this host
is stopped (two drivers must not write one sink) and the retry restores, as without deferral.

A script (``application=``) defers through the same steps, composed by
:mod:`checkpointing_airflow.deferred_script`: its driver coordinates its own steps, so its
trigger only watches it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from checkpointing.coordination.drivers import (
    AttemptVerdict,
    DriverIdentity,
    Outcome,
    process_alive,
    read_state,
    reattach,
    record_driver,
    this_host,
)
from checkpointing_airflow.attempts import attempt_id, failed_try_line, run_started
from checkpointing_airflow.detached_driver import (
    attempt_of_same_run,
    await_exit,
    await_first_beat,
    driver_log_path,
    read_log_tail,
    stop_driver,
)
from checkpointing_airflow.driver_scope import (
    driver_metastore_url,
    release_driver,
    withheld_variables,
)
from checkpointing_airflow.hooks import open_metastore
from checkpointing_airflow.spark_submit_internals import submit_environment, submit_target

if TYPE_CHECKING:
    from airflow.sdk import Context

    from checkpointing.metastore.engine import Metastore
    from checkpointing.pipeline.spec import PipelineSpec

#: lines of a failed driver's log repeated in the task log
LOG_TAIL_LINES = 40


class DeferredSubmit:
    """The deferrable path of one operator instance (composed into it, not a subclass)."""

    def __init__(self, operator: Any) -> None:
        # the CheckpointedSparkSubmitOperator (which imports this module: not imported here)
        self.op = operator
        #: spark-submit as :meth:`launch` started it, in this task's process only
        self.process: subprocess.Popen[bytes] | None = None

    def execute(self, context: Context, spec: PipelineSpec, storage_url: str) -> NoReturn:
        """Plan, take over coordination, submit the detached driver, record it and defer
        (``spec`` and its ``storage_url`` as the operator's ``execute`` loaded them)."""
        from airflow.sdk.log import mask_secret

        from checkpointing.coordination.coordinator import CheckpointCoordinator
        from checkpointing.state.storage import CheckpointStorage

        op, ti = self.op, context["ti"]
        url = op.metastore_url()
        mask_secret(url)
        metastore = open_metastore(url)
        try:  # disposed however the try ends: deferred, refused or failed
            attempt = attempt_id(ti.dag_id, ti.run_id, ti.try_number)
            # defers when this run's last driver lives or finished
            self.reattach(
                metastore,
                spec.job,
                attempt,
                run_started(context),
                lambda found, watcher: self.defer_spec(spec, found, watcher, storage_url),
            )
            refuse_cluster_mode(op)  # before the takeover
            self.stop_previous_driver(metastore, spec.job, attempt)
            restore, parallelism = op.plan_try(context, spec, metastore, storage_url)
            coordinator = CheckpointCoordinator(
                spec.job,
                metastore,
                CheckpointStorage.from_url(storage_url),
                spec.checkpoint.config(),
                coordinator_id=attempt,
            )
            coordinator.activate()  # a dead predecessor's pending checkpoints: coordinator failover
            # with driver scope: the driver's own role (a re-attached retry, above, needs none: the
            # driver keeps the role it started with)
            driver_url = driver_metastore_url(op, metastore, spec.job, attempt, url)
            secrets = op.prepare_application(
                spec, restore, parallelism, attempt, ti.try_number, driver_url, storage_url, context
            )
            withheld = withheld_variables(op, scoped=driver_url != url)
            try:
                driver = self.launch(spec.job, attempt, secrets, parallelism, withheld)
            except BaseException:
                coordinator.failover(f"try {ti.try_number} ({attempt}): spark-submit did not start")
                release_driver(metastore, spec.job, attempt)
                raise
            self.record(metastore, spec.job, driver)
            op.log.info(
                "job %s: try %d as coordinator %s, restore %s, parallelism %d: %s",
                spec.job,
                ti.try_number,
                attempt,
                restore,
                parallelism,
                driver.describe(),
            )
            self.await_start(
                metastore, spec.job, driver, lambda v: self._fail(context, spec, metastore, v)
            )
            op.log.info("job %s: the driver is up; deferring to the triggerer", spec.job)
            self.defer_spec(spec, driver, attempt, storage_url)
        finally:
            metastore.dispose()

    def record(self, metastore: Metastore, job_id: str, driver: DriverIdentity) -> None:
        """Record the just-launched ``driver`` on the job row while its attempt leads the job;
        else stop it and fail the try for good (another attempt took over)."""
        from airflow.sdk.exceptions import AirflowFailException

        if record_driver(metastore, job_id, driver):
            return
        if stop_driver(driver) or process_alive(driver) is False:
            release_driver(metastore, job_id, driver.attempt)
        raise AirflowFailException(
            f"job {job_id}: another attempt took over before the driver of {driver.attempt} "
            "was recorded; it was stopped"
        )

    def await_start(
        self,
        metastore: Metastore,
        job_id: str,
        driver: DriverIdentity,
        fail: Callable[[AttemptVerdict], NoReturn],
    ) -> None:
        """Hold the slot until the driver's first heartbeat (its Spark session is up and it
        leads the job), so that a driver that fails to start (a bad master, a missing
        ``py_files``, an import error) fails the try here with its log in the task's log, not
        in a trigger's. Returns early when the driver already has an outcome that the trigger
        reports (finished, superseded)."""
        timeout = timedelta(seconds=self.op.driver_heartbeat_timeout)
        verdict = await_first_beat(metastore, job_id, driver, timeout, self.op.coordinator_poll)
        if verdict is not None and verdict.outcome not in (Outcome.FINISHED, Outcome.SUPERSEDED):
            fail(verdict)

    def defer_spec(
        self, spec: PipelineSpec, driver: DriverIdentity, watcher: str, storage_url: str
    ) -> NoReturn:
        """Hand the coordination of a spec's ``driver`` over to the triggerer, as ``watcher``."""
        parallelism = driver.parallelism or self.op.parallelism_for(spec, 1)
        self.defer(spec.job, driver, watcher, storage_url, (parallelism, spec.max_parallelism))

    def defer(
        self,
        job_id: str,
        driver: DriverIdentity,
        watcher: str,
        storage_url: str,
        subtasks: tuple[int, int] | None,
    ) -> NoReturn:
        """Hand ``driver`` over to the triggerer, as ``watcher``: its coordinator, with
        ``subtasks`` (parallelism, max parallelism) that a checkpoint waits for, else (None: a
        script's driver coordinates its own steps) its watcher only."""
        from airflow.sdk.exceptions import AirflowException

        from checkpointing_airflow.triggers import CheckpointCoordinatorTrigger

        op = self.op
        parallelism, max_parallelism = subtasks or (1, 1)
        op.defer(
            trigger=CheckpointCoordinatorTrigger(
                job_id=job_id,
                attempt=driver.attempt,
                parallelism=parallelism,
                max_parallelism=max_parallelism,
                coordinates=subtasks is not None,
                metastore_conn_id=op.metastore_conn_id,
                storage_url=storage_url,
                poll_seconds=op.coordinator_poll,
                heartbeat_timeout_seconds=op.driver_heartbeat_timeout,
                watcher=watcher,
                aws_conn_id=op.aws_conn_id,
            ),
            method_name="execute_complete",
        )
        raise AirflowException("unreachable: defer() raises")  # for type checkers

    def reattach(
        self,
        metastore: Metastore,
        job_id: str,
        attempt: str,
        run_start: datetime | None,
        defer: Callable[[DriverIdentity, str], NoReturn],
    ) -> None:
        """Defer onto the previous try's driver when it still runs or has finished (returns
        otherwise): this retry becomes its watcher; the driver keeps its attempt id, so its
        coordination, checkpoints and outcome stay its own, and nothing is restored or redone.
        Only a driver submitted since the DAG run (last) started counts: a cleared run (a
        refresh backfill) runs anew. ``defer(driver, watcher)`` defers the try onto it."""
        from checkpointing.clock import SystemClock

        state = read_state(metastore, job_id)
        driver = state.driver
        previous = state.watcher or (driver.attempt if driver is not None else None)
        # the same try run again (its task reset after a scheduler restart) re-attaches too:
        # never a second driver under one attempt id, which fencing could not tell apart
        if driver is None or previous is None or not attempt_of_same_run(previous, attempt):
            return
        if run_start is not None and driver.submitted_at < run_start:
            return
        timeout = timedelta(seconds=self.op.driver_heartbeat_timeout)
        alive = process_alive(driver)
        if alive is not False:
            # a try killed while its driver was starting: the driver gets the rest of its
            # start-up time to beat (stopping it would redo every epoch it is about to run)
            await_first_beat(metastore, job_id, driver, timeout, self.op.coordinator_poll)
        now = SystemClock().now()
        found = reattach(metastore, job_id, driver.attempt, attempt, now, timeout, alive=alive)
        if found is None:
            return
        self.op.log.info(
            "job %s: re-attached to the %s (no restore, no epoch redone): this try coordinates "
            "it until its outcome, or takes the outcome it already recorded",
            job_id,
            found.describe(),
        )
        metastore.dispose()
        defer(found, attempt)

    def launch(
        self,
        job_id: str,
        attempt: str,
        secrets: Mapping[str, str],
        parallelism: int | None,
        withheld: Sequence[str] = (),
    ) -> DriverIdentity:
        """``spark-submit`` in its own session (a worker restart or the task's end does not
        stop it), its output to the driver's log file, credentials only in its environment
        (``withheld``: variables of this process's environment it does not inherit)."""
        from checkpointing.clock import SystemClock

        op = self.op
        command = op._hook._build_spark_submit_command(op.application)  # logs it, masked
        env = {**os.environ, **submit_environment(op._hook), **secrets}
        env = {name: value for name, value in env.items() if name not in withheld}
        log_path = driver_log_path(job_id, attempt)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        submitted_at = SystemClock().now()
        with log_path.open("ab") as out:
            process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        self.process = process
        return DriverIdentity(
            attempt, this_host(), process.pid, str(log_path), submitted_at, parallelism
        )

    def stop_previous_driver(self, metastore: Metastore, job_id: str, attempt: str) -> None:
        """A previous try's detached driver still running here (its try's task died, e.g. the
        triggerer lost it): stop it before this try takes over and submits its own."""
        driver = read_state(metastore, job_id).driver
        # this very try's driver too (its try run again, the driver alive but not re-attached
        # to): never two drivers under one attempt id, which fencing could not tell apart
        if driver is None or not attempt_of_same_run(driver.attempt, attempt):
            return
        if stop_driver(driver):
            self.op.log.warning("job %s: stopped the %s", job_id, driver.describe())
            release_driver(metastore, job_id, driver.attempt)

    def complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """The trigger's event as the try's outcome (its XCom), or the failure that retries."""
        op = self.op
        verdict = AttemptVerdict.from_event(event)
        spec = op.load_spec()
        metastore = open_metastore(op.metastore_url())
        attempt = verdict.attempt  # the driver's: this try's own, or the one it re-attached to
        try:
            self.replay(context, spec, metastore, attempt)
            if verdict.succeeded:
                outcome = op._outcome(spec, metastore, attempt)
                self.release_role(metastore, spec.job, attempt)
                return outcome
            self._fail(context, spec, metastore, verdict)
        finally:
            metastore.dispose()

    def release_role(self, metastore: Metastore, job_id: str, attempt: str) -> None:
        """Drop the role of ``attempt``'s driver once its outcome is read and its process is
        known gone (it runs on this host and exited). Elsewhere, or still running, its role
        stays until it expires: dropping it would cut a live driver off mid-write. Without a
        role (no driver scope) nothing is waited for."""
        from checkpointing.metastore.driver_roles import has_grant

        driver = read_state(metastore, job_id).driver
        if driver is None or driver.attempt != attempt or not has_grant(metastore, job_id, attempt):
            return
        await_exit(driver)
        if process_alive(driver) is False:
            release_driver(metastore, job_id, attempt)

    def replay(self, context: Context, watched: Any, metastore: Metastore, attempt: str) -> None:
        """The alerts and the OpenLineage run facet of what happened while deferred (they need
        the task's context, which the triggerer has not): the attempt's restore, checkpoints and
        savepoints, reported once now. Metrics are not: the trigger sent them as they came.
        ``watched``: what the operator's ``stats_tracker`` watches (a spec, a script's job)."""
        op = self.op
        op._alerting = None
        tracker = op.stats_tracker(context, watched, metastore, attempt, metrics=False)
        try:
            tracker.replay()
        except Exception:  # the outcome matters more than its report
            op.log.exception("job %s: the deferred try's events could not be read", watched.job)
        finally:
            if op._alerting is not None:
                op._alerting.close()

    def _fail(
        self, context: Context, spec: PipelineSpec, metastore: Metastore, verdict: AttemptVerdict
    ) -> NoReturn:
        op = self.op
        self.fail(
            metastore,
            spec.job,
            verdict,
            lambda e: failed_try_line(op, spec, metastore, context["ti"].try_number, e),
        )

    def fail(
        self,
        metastore: Metastore,
        job_id: str,
        verdict: AttemptVerdict,
        failed_line: Callable[[BaseException], str],
        refused: str | None = None,
    ) -> NoReturn:
        """End the try on a failed ``verdict``: the driver's log tail in the task's log, the
        driver stopped if it still runs here, then ``failed_line`` of the exception that
        retries (none when superseded: another attempt leads, not ours to retry; none when
        ``refused`` says why a retry would fail the same way)."""
        from airflow.sdk.exceptions import AirflowException, AirflowFailException

        op = self.op
        driver = read_state(metastore, job_id).driver
        if driver is not None and driver.attempt == verdict.attempt:
            if verdict.outcome is Outcome.FAILED:
                await_exit(driver)  # it is exiting: its error comes last in its log
            self.show_log_tail(job_id, driver)
            if verdict.outcome is not Outcome.SUPERSEDED and stop_driver(driver):
                op.log.warning("job %s: stopped the %s", job_id, driver.describe())
            if verdict.outcome is not Outcome.SUPERSEDED and process_alive(driver) is False:
                release_driver(metastore, job_id, driver.attempt)
        if refused is not None:
            raise AirflowFailException(refused)
        error = AirflowException(verdict.message)
        op.log.error("%s", failed_line(error))
        if verdict.outcome is Outcome.SUPERSEDED:
            raise AirflowFailException(verdict.message)
        raise error

    def returncode(self, wait: float = 0.0) -> int | None:
        """The exit code of the driver this task launched, waiting up to ``wait`` s for it to
        exit (a driver judged gone may still be exiting: its command line goes first); None
        when it runs on, or this task launched none."""
        if self.process is None:
            return None
        try:
            return self.process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            return None

    def show_log_tail(self, job_id: str, driver: DriverIdentity) -> None:
        """The end of a failed driver's log, when it is on this host (Spark's own lines): its
        path recomputed from the ids (the row's ``driver_log`` is not read), a regular file
        only, at most :data:`~checkpointing_airflow.detached_driver.LOG_TAIL_BYTES` read."""
        if driver.host != this_host():
            return
        path = driver_log_path(job_id, driver.attempt)
        try:
            tail = read_log_tail(job_id, driver.attempt, LOG_TAIL_LINES)
        except (OSError, ValueError) as exc:
            self.op.log.warning("the driver's log %s is not shown: %s", path, exc)
            return
        self.op.log.error("the driver's log %s ends:\n%s", path, tail)


def refuse_cluster_mode(op: Any) -> None:
    """A deferred try's driver is watched on the worker's host: deploy mode cluster fails the
    try for good, before the try takes anything over (the connection's and the operator's
    deploy mode, read from a hook built for the purpose)."""
    from airflow.sdk.exceptions import AirflowFailException

    deploy_mode, master = submit_target(op._get_hook())
    if deploy_mode == "cluster":
        raise AirflowFailException(
            f"deferrable: deploy mode cluster (master {master}) is not supported: the driver "
            "is watched on the worker's host; use deploy mode client"
        )
