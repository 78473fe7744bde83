"""Whether a job id may be a script's: a spec pipeline's job is refused, by the script's
``checkpointed`` and by the Airflow task that deploys the script (before it names its
coordinator, which would fence the spec's), before either writes anything. Decided from the
metastore alone: the job's own storage may be elsewhere than the script's, and unreachable."""

from __future__ import annotations

from sqlalchemy import select

from checkpointing.errors import ConfigError
from checkpointing.metastore import jobs
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import CheckpointTask
from checkpointing.steps.identity import operator_id

#: what every step checkpoint's operator ids start with (:func:`operator_id`)
STEP_OPERATOR_PREFIX = operator_id("x")[:-1]


def refuse_a_specs_job(metastore: Metastore, job_id: str) -> jobs.JobInfo | None:
    """Refuse, in one line, a job that is a spec pipeline's: it asks for periodic checkpoints
    (a step job never does), or one of its checkpoints has an operator that is no step's
    (a spec's ``source``, ``aggregate``, ``sink``). A script would overwrite its configuration
    and retire its checkpoints. A job not registered yet is the script's to take. The job as
    registered (None: not yet), for the caller's restore."""
    job = jobs.get_job(metastore, job_id)
    if job is None:
        return None
    periodic = job.config.periodic_interval is not None
    with metastore.reading() as s:
        other = s.scalar(
            select(CheckpointTask.operator_id)
            .where(
                CheckpointTask.job_id == job_id,
                CheckpointTask.operator_id.not_like(f"{STEP_OPERATOR_PREFIX}%"),
            )
            .order_by(CheckpointTask.operator_id)
            .limit(1)
        )
    if periodic or other is not None:
        why = "it checkpoints periodically" if periodic else f"its checkpoints hold {other!r}"
        raise ConfigError(
            f"job {job_id!r} is a pipeline spec's ({why}): a script's checkpointed(spark, "
            "job=...) needs a job of its own"
        )
    return job
