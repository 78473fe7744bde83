"""What a try of :class:`~checkpointing_airflow.operators.CheckpointedSparkSubmitOperator`
restores and at which parallelism, and whether its run may choose that: a retry takes the
recovery plan its failure callback recorded (else computes the same), a first try its
``restore``; every try first asks that the run's triggering user may make the run's edits
(:func:`run_edits`), since a retry or a cleared task acts on the same choices as the first try.

``op`` is the operator (its rendered fields: ``restore``, ``parallelism``, ``full_refresh``,
``allow_changed_tables``, ``allow_other_job``, ``authorize_restore``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from checkpointing_airflow.attempts import attempt_id, refresh_token, run_started

if TYPE_CHECKING:
    from airflow.sdk import Context

    from checkpointing.metastore.engine import Metastore
    from checkpointing.pipeline.spec import PipelineSpec
    from checkpointing.restore.recovery import RecoveryPlan

log = logging.getLogger(__name__)


def plan_try(
    op: Any, context: Context, spec: PipelineSpec, metastore: Metastore, storage_url: str
) -> tuple[str, int]:
    """What this try restores (``ckpt run --restore``'s value) and its parallelism: a retry's
    recovery plan, else the first try's ``restore``, refused before anything runs when the run
    may not choose it or it is another job's checkpoint or savepoint and that is not allowed."""
    if op.authorize_restore and (edits := run_edits(op, spec)):  # every try, before all else
        authorize_edits(context, spec, edits)
    recovery = recovery_for(op, context, spec, metastore, storage_url)
    if truthy(op.full_refresh):  # every try: the driver resumes or redoes the refresh
        op._refresh_token = refresh_token(context)
        parallelism = recovery.parallelism if recovery else op.parallelism_for(spec, 1)
        return "latest", parallelism
    if recovery is not None:
        return recovery.restore, recovery.parallelism
    restore = str(op.restore)
    refuse_other_jobs_state(op, spec, storage_url, restore)
    return restore, op.parallelism_for(spec, 1)


def run_edits(op: Any, spec: PipelineSpec) -> list[str]:
    """The run's choices that edit the pipeline rather than run it, as the API counts them: a
    restore other than ``latest`` (a retry falls back to it while the run has no checkpoint),
    a full refresh, a restore over changed tables, another parallelism than the spec's
    (``parallelism_on_retry`` is the DAG author's choice, not the run's)."""
    edits = []
    if str(op.restore) != "latest":
        edits.append(f"restore {str(op.restore)!r}")
    if truthy(op.full_refresh):
        edits.append("full refresh")
    if truthy(op.allow_changed_tables):
        edits.append("allow_changed_tables")
    if op.parallelism not in (None, "") and int(op.parallelism) != spec.parallelism:
        edits.append(f"parallelism {op.parallelism} (the spec's: {spec.parallelism})")
    return edits


def authorize_edits(context: Context, spec: PipelineSpec, edits: list[str]) -> None:
    """An edit of the pipeline (the API asks the same): the run's triggering user must be
    allowed to edit the pipeline's DAG, else the task fails for good before anything is done."""
    from airflow.sdk.exceptions import AirflowFailException

    from checkpointing_airflow.permissions import PermissionRefused, authorize_trigger

    dag_run = context["dag_run"]
    try:
        authorize_trigger(
            getattr(dag_run, "triggering_user_name", None),
            spec.job,
            team_name=getattr(dag_run, "team_name", None),
        )
    except PermissionRefused as exc:
        raise AirflowFailException(f"{', '.join(edits)}: {exc}") from None


def recovery_for(
    op: Any, context: Context, spec: PipelineSpec, metastore: Metastore, storage_url: str
) -> RecoveryPlan | None:
    """A retry's restore: the plan the failure callback recorded, else the same computed now
    (Airflow runs callbacks best-effort). None on the first try."""
    from checkpointing.restore.recovery import plan_recovery, planned_recovery
    from checkpointing.state.storage import CheckpointStorage

    ti = context["ti"]
    if ti.try_number <= 1:
        return None
    attempt = attempt_id(ti.dag_id, ti.run_id, ti.try_number)
    parallelism = op.parallelism_for(spec, ti.try_number)
    plan = planned_recovery(metastore, spec.job, attempt)
    if plan is not None and plan.parallelism == parallelism:
        log.info("restore plan recorded by the failure callback: %s", plan.describe())
        return plan
    if plan is not None:  # not what the callback computes from this run's fields: a row
        log.warning(  # written by something else (a driver may write its job's rows)
            "the recorded restore plan's parallelism %s is not this try's %s: recomputed",
            plan.parallelism,
            parallelism,
        )
    plan = plan_recovery(
        metastore,
        CheckpointStorage.from_url(storage_url),
        spec.job,
        attempt=attempt,
        parallelism=parallelism,
        max_parallelism=spec.max_parallelism,
        completed_after=run_started(context),
        otherwise=str(op.restore),
    )
    log.info("no restore plan recorded (callback skipped?); computed: %s", plan.describe())
    return plan


def refuse_other_jobs_state(op: Any, spec: PipelineSpec, storage_url: str, source: str) -> None:
    """A restore path of another job's checkpoint or savepoint fails the task unless
    ``allow_other_job``; anything else wrong with the path is left to the run to report."""
    from airflow.sdk.exceptions import AirflowFailException

    from checkpointing.errors import CheckpointingError
    from checkpointing.restore.lookup import ForeignSnapshotError, load_external
    from checkpointing.state.storage import CheckpointStorage

    if "/" not in source:
        return
    try:
        decision = load_external(
            CheckpointStorage.from_url(storage_url),
            source,
            deep=False,
            job_id=spec.job,
            allow_other_job=truthy(op.allow_other_job),
        )
    except ForeignSnapshotError as exc:
        raise AirflowFailException(str(exc)) from None
    except CheckpointingError:
        return
    if decision.from_job_id is not None:
        log.warning("%s", decision.describe())


def truthy(value: bool | str) -> bool:
    """A templated boolean: rendered Jinja arrives as text."""
    return str(value).strip().lower() in ("true", "1", "yes", "on")
