"""The deferrable pipeline task's trigger: the checkpoint coordinator of its try, in Airflow's
triggerer, while the task's detached Spark driver runs (:mod:`checkpointing_airflow.deferred`).

The trigger serialises ids and plain values only (job, attempt, connection id, storage URL,
parallelism, poll and timeout): the metastore URL, which may hold a password, is resolved from the
Airflow connection by the trigger itself. Everything else is in the metastore, so a restarted
triggerer resumes the coordination where it was
(:class:`~checkpointing.coordination.detached.DetachedAttempt`), under the same coordinator id
(the attempt id): the fencing is the non-deferrable task's (a newer try's activation supersedes
it; a superseded trigger fires a failure event and stops).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from checkpointing.coordination.drivers import AttemptVerdict, Outcome
from checkpointing.coordination.heartbeat import HEARTBEAT_TIMEOUT
from checkpointing.errors import ConfigError

log = logging.getLogger(__name__)

CLASSPATH = "checkpointing_airflow.triggers.CheckpointCoordinatorTrigger"


class CheckpointCoordinatorTrigger(BaseTrigger):
    """Coordinate one try's checkpoints until its driver's outcome is in the metastore (the job
    row FINISHED or FAILED for this try) or the driver stops heart-beating; then fire one event,
    :meth:`AttemptVerdict.to_event <checkpointing.coordination.drivers.AttemptVerdict.to_event>`.

    :param job_id: the job (instance) the try runs.
    :param attempt: the try's attempt id, its coordinator id.
    :param parallelism: the try's parallelism, and ``max_parallelism`` the job's: the subtasks a
        checkpoint waits for.
    :param metastore_conn_id: the checkpoint metastore connection (else ``CKPT_METASTORE_URL``
        of the triggerer, else the embedded default).
    :param storage_url: the job's checkpoint storage (no credentials).
    :param aws_conn_id: the AWS connection for S3 storage, resolved here (the task's); a
        missing one, or None: boto3's own chain in the triggerer.
    :param poll_seconds: seconds between coordinator passes.
    :param heartbeat_timeout_seconds: a driver silent this long is lost.
    :param watcher: the try coordinating: ``attempt``'s own, or a retry's that re-attached to
        ``attempt``'s live driver (the coordinator id stays ``attempt``, the driver's).
    :param coordinates: False for a script's driver, which coordinates its own steps (its
        ``checkpointed``): the trigger then only watches it (its verdict, metrics), triggers
        nothing and aborts nothing (a lost driver's pending step stays for the retry to
        salvage); ``parallelism`` is then unused.
    """

    def __init__(
        self,
        *,
        job_id: str,
        attempt: str,
        parallelism: int,
        max_parallelism: int,
        metastore_conn_id: str,
        storage_url: str,
        poll_seconds: float = 1.0,
        heartbeat_timeout_seconds: float = HEARTBEAT_TIMEOUT.total_seconds(),
        watcher: str | None = None,
        aws_conn_id: str | None = None,
        coordinates: bool = True,
    ) -> None:
        super().__init__()
        self.job_id = job_id
        self.attempt = attempt
        self.parallelism = int(parallelism)
        self.max_parallelism = int(max_parallelism)
        self.metastore_conn_id = metastore_conn_id
        self.storage_url = storage_url
        self.poll_seconds = float(poll_seconds)
        self.heartbeat_timeout_seconds = float(heartbeat_timeout_seconds)
        self.watcher = watcher or attempt
        self.aws_conn_id = aws_conn_id
        self.coordinates = bool(coordinates)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            CLASSPATH,
            {
                "job_id": self.job_id,
                "attempt": self.attempt,
                "parallelism": self.parallelism,
                "max_parallelism": self.max_parallelism,
                "metastore_conn_id": self.metastore_conn_id,
                "storage_url": self.storage_url,
                "poll_seconds": self.poll_seconds,
                "heartbeat_timeout_seconds": self.heartbeat_timeout_seconds,
                "watcher": self.watcher,
                "aws_conn_id": self.aws_conn_id,
                "coordinates": self.coordinates,
            },
        )

    async def metastore_url(self) -> str:
        """The metastore URL from the connection (async: the triggerer's event loop), else the
        triggerer's ``CKPT_METASTORE_URL``, else the embedded default."""
        from airflow.sdk.exceptions import AirflowNotFoundException

        from checkpointing.config import Settings
        from checkpointing_airflow.hooks import CheckpointMetastoreHook, connection_url

        try:
            conn = await CheckpointMetastoreHook.aget_connection(self.metastore_conn_id)
        except AirflowNotFoundException:
            return Settings.resolve().metastore_url
        return connection_url(conn)

    def _error(self, message: str) -> TriggerEvent:
        return TriggerEvent(AttemptVerdict(Outcome.ERROR, self.attempt, message).to_event())

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Every ``poll_seconds`` one coordinator pass in a worker thread (the metastore calls
        block); the event once the try ended. A metastore that stays unreachable for the
        heartbeat timeout fails the try (the driver could not be watched)."""
        from checkpointing_airflow.hooks import open_metastore

        try:
            url = await self.metastore_url()
            metastore = await asyncio.to_thread(open_metastore, url)
        except Exception as exc:
            yield self._error(f"job {self.job_id}: the metastore cannot be opened: {exc}")
            return
        self.log.info(
            "job %s: %s attempt %s (poll %.1f s, heartbeat timeout %.0f s)",
            self.job_id,
            "coordinating" if self.coordinates else "watching the script driver of",
            self.attempt,
            self.poll_seconds,
            self.heartbeat_timeout_seconds,
        )
        failing_since: float | None = None
        try:
            try:
                attempt = await asyncio.to_thread(self.coordination, metastore)  # off the loop
            except ConfigError as exc:
                yield self._error(f"job {self.job_id}: {exc}")
                return
            while True:
                try:
                    verdict = await asyncio.to_thread(attempt.poll)
                    failing_since = None
                except Exception as exc:  # the metastore away: the driver goes on, so do we
                    failing_since = failing_since or time.monotonic()
                    if time.monotonic() - failing_since > self.heartbeat_timeout_seconds:
                        yield self._error(f"job {self.job_id}: coordination failed: {exc}")
                        return
                    self.log.warning("job %s: coordinator pass failed: %s", self.job_id, exc)
                    verdict = None
                if verdict is not None:
                    self.log.info("%s", verdict.message)
                    yield TriggerEvent(verdict.to_event())
                    return
                await asyncio.sleep(self.poll_seconds)
        finally:
            await asyncio.to_thread(metastore.dispose)

    async def on_kill(self) -> None:
        """The user marked the deferred task failed or cleared it: stop the try's driver when
        it runs on this host (never on a triggerer restart: ``cleanup`` is not ``on_kill``)."""
        await asyncio.to_thread(self._stop_driver, await self.metastore_url())

    def _stop_driver(self, url: str) -> None:
        from checkpointing.coordination.drivers import owned_process, read_state
        from checkpointing_airflow.detached_driver import stop_driver
        from checkpointing_airflow.hooks import open_metastore

        metastore = open_metastore(url)
        try:
            state = read_state(metastore, self.job_id)
        finally:
            metastore.dispose()
        driver = state.driver
        if driver is None or driver.attempt != self.attempt:
            return
        if not owned_process(driver.pid, driver.attempt):  # pid 0, 1, another group, reused
            return  # not ours: never signalled (stop_driver checks again before each signal)
        if state.watcher in (None, self.watcher) and stop_driver(driver):
            self.log.warning("job %s: stopped the %s", self.job_id, driver.describe())

    def coordination(self, metastore: Any) -> Any:
        """The try's :class:`~checkpointing.coordination.detached.DetachedAttempt`, its stats
        tracker reporting checkpoint metrics through Airflow's ``Stats`` (alerts and the lineage
        facet need the task's context: the worker side's, not here)."""
        from checkpointing.coordination.detached import DetachedAttempt
        from checkpointing.coordination.stats_tracker import CheckpointStatsTracker
        from checkpointing.restore.recovery import pipeline_plan
        from checkpointing.state.s3_storage import S3CheckpointStorage
        from checkpointing.state.storage import CheckpointStorage
        from checkpointing_airflow.aws_credentials import s3_client
        from checkpointing_airflow.metrics import CheckpointMetrics

        tracker = CheckpointStatsTracker(
            self.job_id, metastore, self.attempt, [CheckpointMetrics(self.job_id)]
        )
        storage = CheckpointStorage.from_url(self.storage_url)
        # the task's connection, never the triggerer's own credentials (it serves every task)
        client = s3_client(self.aws_conn_id, self.storage_url, fallback=False)
        if client is not None:
            storage = S3CheckpointStorage(self.storage_url, client=client)
        return DetachedAttempt(
            self.job_id,
            metastore,
            storage,
            attempt=self.attempt,
            tasks=(
                pipeline_plan(self.attempt, self.parallelism, self.max_parallelism)
                if self.coordinates
                else []
            ),
            poll=self.poll_seconds,
            heartbeat_timeout=timedelta(seconds=self.heartbeat_timeout_seconds),
            stats_tracker=tracker,
            watcher=self.watcher,
            coordinates=self.coordinates,
        )
