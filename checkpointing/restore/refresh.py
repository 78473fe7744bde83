"""A full refresh: where a job's restore lineage starts anew (``ckpt run --full-refresh``).

Refreshing an interval replaces its output: the sink is reset
(:meth:`checkpointing.sinks.protocol.Sink.reset`) and the run starts empty. The job's older
checkpoints and savepoints must then never be restored — their state belongs to output that is
gone — so the job row records the refresh's first checkpoint id (``refresh_checkpoint_id``), below
which ``latest`` looks no further (:func:`checkpointing.restore.lookup.find_latest_valid`). It is
recorded *before* the sink is reset: a crash in between leaves a job with nothing to restore and
a sink the retry resets again, never old state over a reset sink.

A refresh has a token (the Airflow DAG run that asked for it): a retry of the same refresh that
finds one of the refresh's own checkpoints resumes from it instead of resetting again.
"""

from __future__ import annotations

from checkpointing.metastore import jobs
from checkpointing.metastore.engine import Metastore
from checkpointing.restore import lookup
from checkpointing.state.storage import CheckpointStorage


def began(metastore: Metastore, storage: CheckpointStorage, job_id: str, token: str) -> bool:
    """Did the refresh ``token`` begin on this job, and has it a restorable checkpoint yet?"""
    with metastore.transaction() as s:
        job = jobs.job_row(s, job_id)
        if job.refresh_token != token or job.refresh_checkpoint_id is None:
            return False
    latest = lookup.find_latest_valid(metastore, storage, job_id, deep=False)
    return latest.metadata is not None


def begin(metastore: Metastore, job_id: str, token: str | None) -> int:
    """Record a refresh of ``job_id`` starting now: checkpoints from the job's next id on are
    its own, older ones are not restored any more. Returns that first id."""
    with metastore.transaction() as s:
        job = jobs.job_row(s, job_id, lock=True)
        job.refresh_checkpoint_id = job.next_checkpoint_id
        job.refresh_token = token
        return job.refresh_checkpoint_id
