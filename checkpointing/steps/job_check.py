"""Whether a job id may be a script's: a spec pipeline's job is refused, by the script's
``checkpointed`` and by the Airflow task that deploys the script (before it names its
coordinator, which would fence the spec's), before either writes anything."""

from __future__ import annotations

from checkpointing.errors import ConfigError
from checkpointing.metastore import jobs
from checkpointing.metastore.engine import Metastore
from checkpointing.restore.lookup import find_latest_valid
from checkpointing.state.storage import CheckpointStorage
from checkpointing.steps.plan import restored_steps


def refuse_a_specs_job(metastore: Metastore, storage: CheckpointStorage, job_id: str) -> None:
    """Refuse, in one line, a job that is a spec pipeline's: it asks for periodic checkpoints
    (a step job never does), or its latest completed checkpoint holds operator state and no
    step. A script would overwrite its configuration and retire its checkpoints. A job not
    registered yet is the script's to take."""
    job = jobs.get_job(metastore, job_id)
    if job is None:
        return
    periodic = job.config.periodic_interval is not None
    specs = False
    if not periodic and job.last_completed_id is not None:
        metadata = find_latest_valid(metastore, storage, job_id, deep=False).metadata
        specs = metadata is not None and bool(metadata.operators) and not restored_steps(metadata)
    if periodic or specs:
        why = "it checkpoints periodically" if periodic else "its checkpoints hold operator state"
        raise ConfigError(
            f"job {job_id!r} is a pipeline spec's ({why}): a script's checkpointed(spark, "
            "job=...) needs a job of its own"
        )
