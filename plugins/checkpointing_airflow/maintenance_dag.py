"""``<job>__maintenance``: a pipeline's scheduled garbage collection (``ckpt gc``), the DAG the
factory adds next to the pipeline's own when its spec has a ``maintenance:`` section
(:class:`~checkpointing.pipeline.maintenance_spec.MaintenanceSpec`).

One task, ``gc``, runs :func:`checkpointing.coordination.gc.run_gc` for the job in the worker,
with the pipeline DAG's metastore connection and the storage its runs use (the spec's
``storage``, else ``CKPT_STORAGE_URL``), and logs what it pruned: counts and bytes, no URLs of
the metastore. A RUNNING job is skipped (the task ends *skipped*, with a log line saying why):
its checkpoints change under gc, and a busy pipeline is no failure; the next scheduled run tries
again. So is a job that never ran. A file gc could not delete fails the task after the rest went.

The DAG takes no parameters and acts only on its own pipeline, so Airflow's own permission on the
DAG is the whole check, as for the pipeline's DAG (the generic DAGs' per-pipeline check,
:mod:`~checkpointing_airflow.permissions`, is for DAGs that take the pipeline as a parameter).

Airflow is imported inside the functions. This module is also imported as a top-level module by
Airflow's plugin manager, so it has no side effects and uses only absolute imports.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from checkpointing.config import format_duration
from checkpointing.pipeline.spec import PipelineSpec, SpecError
from checkpointing_airflow.dag_defaults import (
    MAINTENANCE_SUFFIX,
    METASTORE_CONN_ID,
    START_DATE,
    TAG,
)

if TYPE_CHECKING:
    from airflow.sdk import DAG

    from checkpointing.clock import Clock
    from checkpointing.coordination.gc import GcOptions, GcPlan
    from checkpointing.metastore.engine import Metastore

log = logging.getLogger(__name__)


def maintenance_dag_id(job_id: str) -> str:
    """The id of pipeline ``job_id``'s maintenance DAG."""
    return f"{job_id}{MAINTENANCE_SUFFIX}"


def build_maintenance_dag(spec: PipelineSpec, *, metastore_conn_id: str = METASTORE_CONN_ID) -> DAG:
    """DAG ``<job>__maintenance`` with the task ``gc``; ``spec.maintenance`` must be set. Its
    tags and owner are the pipeline's; a bad ``maintenance.schedule`` or a ``vacuum_sink`` of a
    sink that is no Delta table is a :class:`SpecError` naming the file and the field."""
    from airflow.sdk import DAG, task

    maintenance = spec.maintenance
    if maintenance is None:
        raise ValueError(f"pipeline {spec.job} has no maintenance section")
    check_maintenance(spec)
    with DAG(
        dag_id=maintenance_dag_id(spec.job),
        description=f"Garbage collection of {spec.job} (ckpt gc)",
        doc_md=_describe(spec),
        schedule=maintenance.schedule,
        start_date=START_DATE,
        catchup=False,
        max_active_runs=1,
        tags=list(dict.fromkeys([TAG, *spec.tags])),
        default_args={"owner": spec.owner},
    ) as dag:

        @task(task_id="gc", retries=0)
        def gc() -> dict[str, int]:
            from checkpointing_airflow.hooks import (
                CheckpointMetastoreHook,
                mask_metastore_url,
                open_metastore,
            )

            url = CheckpointMetastoreHook(metastore_conn_id).get_url()
            mask_metastore_url(url)  # never in a log line
            metastore = open_metastore(url)
            try:
                return summary(collect_garbage(spec, metastore))
            finally:
                metastore.dispose()

        gc()
    return dag


def check_maintenance(spec: PipelineSpec) -> None:
    """What the maintenance section asks that Airflow or the sink cannot do, refused in one line
    naming the file and the field."""
    from airflow.sdk import DAG

    maintenance = spec.maintenance
    if maintenance is None:
        return
    where = spec.spec_path or spec.job
    if maintenance.vacuum_sink and spec.sink.format != "delta":
        raise SpecError(
            f"{where}: maintenance.vacuum_sink: only a format: delta sink is vacuumed "
            f"(this one is {spec.sink.format})"
        )
    try:  # Airflow checks a cron expression only when it validates the whole DAG
        probe = DAG(dag_id=maintenance_dag_id(spec.job), schedule=maintenance.schedule)
        probe.timetable.validate()
    except Exception as exc:
        raise SpecError(
            f"{where}: maintenance.schedule: {exc} (got {maintenance.schedule!r}; use a cron "
            "expression such as '0 4 * * 0' or a preset such as '@weekly')"
        ) from None


def gc_options(spec: PipelineSpec) -> GcOptions:
    """gc's options from the spec's maintenance section (savepoints: the job's retention)."""
    from checkpointing.coordination.gc import GcOptions

    maintenance = spec.maintenance
    if maintenance is None:
        raise ValueError(f"pipeline {spec.job} has no maintenance section")
    return GcOptions(
        keep_history=maintenance.keep_history,
        grace=maintenance.grace,
        orphans=maintenance.orphans,
        vacuum_sink=spec.resolve(spec.sink.path) if maintenance.vacuum_sink else None,
    )


def collect_garbage(
    spec: PipelineSpec, metastore: Metastore, *, clock: Clock | None = None
) -> GcPlan:
    """The task ``gc``: collect the job's garbage and log what went. A RUNNING or never-run job
    raises Airflow's skip (logged); a deletion that failed fails the task after the rest went."""
    from airflow.sdk.exceptions import AirflowException, AirflowSkipException

    from checkpointing.coordination.gc import JobActiveError, run_gc
    from checkpointing.errors import UnknownJobError
    from checkpointing.metastore.jobs import storage_url_for_run
    from checkpointing.state.storage import CheckpointStorage

    storage = CheckpointStorage.from_url(storage_url_for_run(None, spec))
    try:
        plan = run_gc(metastore, storage, spec.job, gc_options(spec), clock=clock)
    except JobActiveError as exc:
        log.info("job %s: skipped, nothing collected: %s", spec.job, exc)
        raise AirflowSkipException(f"job {spec.job} is RUNNING; gc runs when it is not") from None
    except UnknownJobError:
        log.info("job %s: skipped: the job never ran, so there is nothing to collect", spec.job)
        raise AirflowSkipException(f"job {spec.job} never ran") from None
    log.info(
        "job %s: deleted %d checkpoint row(s) (%d task, %d ack), %d request(s), %d restore(s)",
        spec.job,
        len(plan.checkpoints),
        plan.tasks,
        plan.acks,
        len(plan.requests),
        len(plan.restores),
    )
    log.info(
        "job %s: deleted %d savepoint(s) (%d bytes), %d orphan file(s) (%d bytes), "
        "%d sink table file(s) (%d bytes)",
        spec.job,
        len(plan.savepoints),
        plan.savepoint_bytes,
        len(plan.orphans),
        plan.orphan_bytes,
        len(plan.sink_files),
        plan.sink_bytes,
    )
    for error in plan.errors:
        log.error("job %s: not deleted: %s", spec.job, error)
    if plan.errors:
        raise AirflowException(
            f"job {spec.job}: {len(plan.errors)} deletion(s) failed (the rest went; the next "
            "run tries again)"
        )
    return plan


def summary(plan: GcPlan) -> dict[str, int]:
    """The task's XCom: what went, counted (the lists of files may be long)."""
    return {
        "checkpoints": len(plan.checkpoints),
        "tasks": plan.tasks,
        "acks": plan.acks,
        "requests": len(plan.requests),
        "restores": len(plan.restores),
        "savepoints": len(plan.savepoints),
        "savepoint_bytes": plan.savepoint_bytes,
        "orphans": len(plan.orphans),
        "orphan_bytes": plan.orphan_bytes,
        "sink_files": len(plan.sink_files),
        "sink_bytes": plan.sink_bytes,
    }


def _describe(spec: PipelineSpec) -> str:
    m = spec.maintenance
    assert m is not None
    rows = [
        ("schedule", f"`{m.schedule}`"),
        (
            "history",
            f"ended checkpoints, finished requests and restores older than "
            f"{format_duration(m.keep_history)}",
        ),
        ("savepoints", "by the job's `checkpoint.savepoint_retention` (none: all kept)"),
        ("orphan files", f"older than {format_duration(m.grace)}" if m.orphans else "kept"),
        ("sink", f"Delta table `{spec.sink.path}` vacuumed" if m.vacuum_sink else "untouched"),
    ]
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    return (
        f"### Garbage collection of `{spec.job}`\n\n"
        f"`ckpt gc {spec.job}` on a schedule: never what a restore needs. Skipped while the job "
        "is RUNNING.\n\n"
        f"| | |\n|---|---|\n{table}\n"
    )
