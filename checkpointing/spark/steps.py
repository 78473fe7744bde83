"""Checkpoint an existing PySpark job step by step: :func:`checkpointed`.

::

    with checkpointed(spark, job="daily_revenue") as ck:
        enriched = ck.step("enriched", lambda: orders.join(customers, "customer_id"))
        daily = ck.step("daily", lambda: enriched.groupBy("day").agg(F.sum("amount")))
        ck.write(daily, "/data/out")

A step is a checkpoint (a PENDING row of the job's coordinator, its tasks the step's Spark
tasks plus the earlier steps it carries) and each Spark task a subtask, acknowledged with the
Parquet file it committed (:mod:`checkpointing.spark.step_writer`). The step's DataFrame is read
back from those files, so the next step starts from the checkpoint. A rerun of the job restores
its latest completed checkpoint (verifying every file's checksum) and reuses each step whose
fingerprint (:mod:`checkpointing.steps.identity`) is unchanged; a changed step reruns with every
step downstream of it (:mod:`checkpointing.steps.plan`). A step cut short by a crash keeps the
files its committed tasks acknowledged; when the step is narrow over a checkpointed input and
deterministic (``ck.step(name, fn, input=upstream)``), only its missing partitions are
recomputed (:mod:`checkpointing.spark.step_salvage`). A step without a shuffle that is cheaper
to recompute than to write can be chained into the steps that read it
(``ck.step(name, fn, chained=True)``, :mod:`checkpointing.spark.step_chain`). Savepoints
requested from outside (the UI, the API, ``ckpt savepoint``) are taken at step boundaries, and
``restore=<savepoint path>`` restores one (:mod:`checkpointing.spark.step_savepoints`).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from checkpointing.spark.step_job import CheckpointedJob, StepStats

__all__ = ["CheckpointedJob", "StepStats", "checkpointed"]

_IMPL = "checkpointing.spark.step_job"


def _warm() -> None:
    # an error here is raised again where it matters: checkpointed() imports the module too
    with contextlib.suppress(Exception):
        importlib.import_module(_IMPL)


#: a script imports this module before it builds its SparkSession: the step API's own imports
#: (the metastore's SQLAlchemy, the coordinator; about a second and a half) run on this thread
#: while the JVM starts, instead of before it. (A process forked while it runs, by
#: multiprocessing's "fork" start method in that first second, may inherit a held import lock:
#: fork after ``checkpointed()`` or use "spawn", as Python 3.12 warns for any thread.)
_WARMING = threading.Thread(target=_warm, name="ckpt-steps-import", daemon=True)
_WARMING.start()


def __getattr__(name: str) -> Any:
    if name in ("CheckpointedJob", "StepStats"):
        return getattr(importlib.import_module(_IMPL), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def checkpointed(spark: SparkSession, job: str, **options: Any) -> CheckpointedJob:
    """A run of ``job`` whose steps are checkpoints (see the module docstring): ``with
    checkpointed(spark, job="daily") as ck: ...``. ``metastore``/``storage`` default to the
    settings (``CKPT_METASTORE_URL``, ``CKPT_STORAGE_URL``, ``CKPT_HOME``); ``restore="none"``
    starts from nothing (default: ``ckpt run script.py --restore``'s, else ``latest``);
    ``verify=False`` checks sizes instead of checksums on restore."""
    impl = importlib.import_module(_IMPL)  # waits for the warming thread's import, if running
    job_class: type[CheckpointedJob] = impl.CheckpointedJob
    return job_class(spark, job, **options)
