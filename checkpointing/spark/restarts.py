"""Warm restarts: Flink's restart strategy inside the running Spark application.

When an attempt fails and the Spark driver is still alive — a task or an executor failed, an
epoch's job was aborted — there is no need for a new ``spark-submit``: a new
:class:`~checkpointing.spark.runtime.PipelineRun` in the same application restores the latest
checkpoint (its state read back, as on any restore, possibly rescaled) with the JVM, its JIT,
the Python workers and the file listings already warm. The failed attempt is recorded as any
failed attempt is (its pending checkpoints aborted as job failover); the next one keeps the
attempt id it was given (an Airflow try's), or draws a new one.

A restart happens only after the failed attempt completed a checkpoint, so it resumes past where
that attempt began: a failure that repeats without progress (bad input, a bug) stops after one
replay instead of looping, and reaches Airflow's retries (cold, a new application) as before.
Never restarted: a Spark JVM gone or out of memory (only a new application helps), a coordinator
superseded by a newer try, a refused spec or option, the test hook's simulated process crash.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from checkpointing.coordination.failure import CheckpointException
from checkpointing.errors import ConfigError, SparkJvmError
from checkpointing.pipeline.spec import SpecError
from checkpointing.spark.preflight import RunOptions

if TYPE_CHECKING:
    from checkpointing.spark.runtime import PipelineRun, RunResult

log = logging.getLogger(__name__)

#: failures a restart in the same application cannot help
NOT_RESTARTED: tuple[type[BaseException], ...] = (
    SparkJvmError,
    CheckpointException,
    SpecError,
    ConfigError,
)


def restartable(exc: BaseException) -> bool:
    """Whether ``exc`` may be retried inside the running application."""
    from checkpointing.spark.runtime import SimulatedCrash

    return isinstance(exc, Exception) and not isinstance(exc, (*NOT_RESTARTED, SimulatedCrash))


def run_with_restarts(
    start: Callable[[RunOptions], PipelineRun],
    options: RunOptions,
    *,
    attempts: int,
    delay: timedelta = timedelta(0),
) -> RunResult:
    """``start(options).run()``, restarted from the latest checkpoint up to ``attempts`` times
    while each failed attempt completed a checkpoint (see the module docstring)."""
    restarts = 0
    while True:
        run = start(options)
        try:
            result = run.run()
        except Exception as exc:
            progressed = bool(run.result.checkpoints)
            if restarts >= attempts or not progressed or not restartable(exc):
                raise
            restarts += 1
            log.warning(
                "job %s: attempt %s failed after checkpoint %d (%s); warm restart %d of %d "
                "from the latest checkpoint, in the same Spark application",
                run.spec.job,
                run.attempt,
                run.result.checkpoints[-1],
                str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__,
                restarts,
                attempts,
            )
            time.sleep(delay.total_seconds())
            # the same attempt id when one was given (an Airflow try's: the operator plans its
            # tasks under it; the failed run's pending checkpoints were aborted), else a new one
            options = dataclasses.replace(
                options,
                restore="latest",
                full_refresh=False,  # done by the first try: the restart resumes it
                crash_after_epochs=None,
                fail_task_after_epochs=None,
            )
            continue
        result.restarts = restarts
        return result
