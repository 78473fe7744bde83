"""The DAG of one pipeline spec: ``<job>`` with the task ``run``, a
:class:`~checkpointing_airflow.operators.CheckpointedSparkSubmitOperator`.

Every ``dags/pipelines/<name>.yaml`` (the spec of :mod:`checkpointing.pipeline.spec`, with its
deployment fields ``schedule``, ``retries``, ``retry_delay``, ``parallelism_on_retry``, ``owner``
and ``tags``) becomes the DAG ``<job>``, built by its own DAG file calling :func:`pipeline_dag`
(:mod:`checkpointing_airflow.dag_files` says why).

Airflow is imported inside the functions. This module is also imported as a top-level module by
Airflow's plugin manager, so it has no side effects and uses only absolute imports.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from checkpointing.config import format_duration
from checkpointing.pipeline.interval import Scope
from checkpointing.pipeline.spec import PipelineSpec, SpecError, load_spec
from checkpointing.state.object_store import is_object_url
from checkpointing_airflow.dag_defaults import (
    DEPLOY_DAG_ID,
    METASTORE_CONN_ID,
    SAVEPOINT_DAG_ID,
    SPARK_CONN_ID,
    START_DATE,
    TAG,
)
from checkpointing_airflow.dag_files import spec_file_for
from checkpointing_airflow.maintenance_dag import build_maintenance_dag

if TYPE_CHECKING:
    from airflow.sdk import DAG

#: Airflow refuses longer tags
MAX_TAG_LENGTH = 100


def pipeline_dag(
    dag_file: str | Path,
    *,
    metastore_conn_id: str = METASTORE_CONN_ID,
    spark_conn_id: str = SPARK_CONN_ID,
    operator_args: Mapping[str, Any] | None = None,
) -> DAG:
    """The DAG of the spec next to ``dag_file`` (call it with ``__file__``). A spec with a
    ``maintenance:`` section also gets its DAG ``<job>__maintenance``
    (:mod:`~checkpointing_airflow.maintenance_dag`), built first: a ``with DAG`` block run while
    Airflow imports the DAG file registers its DAG with that file, so every existing DAG file
    (the same two lines) carries it without a change.

    A broken spec raises :class:`~checkpointing.pipeline.spec.SpecError` naming the file and the
    field, and Airflow records it as this DAG file's import error."""
    spec = load_spec(spec_file_for(dag_file))
    if spec.maintenance is not None:
        # built in the DAG file's import, Airflow registers it with the file as well
        build_maintenance_dag(spec, metastore_conn_id=metastore_conn_id)
    return build_pipeline_dag(
        spec,
        metastore_conn_id=metastore_conn_id,
        spark_conn_id=spark_conn_id,
        operator_args=operator_args,
    )


def build_pipeline_dag(
    spec: PipelineSpec,
    *,
    metastore_conn_id: str = METASTORE_CONN_ID,
    spark_conn_id: str = SPARK_CONN_ID,
    operator_args: Mapping[str, Any] | None = None,
) -> DAG:
    """DAG ``spec.job`` with the task ``run``. Airflow-level mistakes in the deployment fields
    (a bad cron expression, a tag that is too long) become :class:`SpecError` as well.

    ``operator_args`` go to the task's operator on top of what the spec says, e.g. Spark
    ``conf`` or the failure drill ``fail_first_try_after_epochs`` (``make demo`` uses both)."""
    from airflow.sdk import DAG, Param

    from checkpointing_airflow.lineage import sink_asset
    from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator

    check_deployment(spec)
    alerting = _alert_args(spec)
    with DAG(
        dag_id=spec.job,
        description=summary(spec),
        doc_md=describe(spec),
        schedule=spec.schedule,
        start_date=START_DATE,
        # an incremental job's two runs would write the same state and sink: one at a time;
        # a scope: interval job's runs are instances of their own (the spec may allow more)
        catchup=spec.catchup,
        max_active_runs=spec.max_active_runs,
        tags=list(dict.fromkeys([TAG, *spec.tags])),
        default_args={"owner": spec.owner},
        params={
            "restore": Param(
                "latest",
                type="string",
                minLength=1,
                title="Restore from",
                description=(
                    "latest: resume from the newest valid checkpoint (for a finished job, its "
                    "last run's final one: only new input is read; start empty if there is "
                    "none); none: start empty; a checkpoint id; or a savepoint or checkpoint "
                    "path. Retries always resume from this run's latest checkpoint."
                ),
            ),
            "parallelism": Param(
                spec.parallelism,
                type="integer",
                minimum=1,
                maximum=spec.max_parallelism,
                title="Parallelism",
                description=(
                    f"subtasks of every operator; the spec says {spec.parallelism}. A different "
                    "value rescales the restored state (key groups are reassigned)."
                ),
            ),
            **_table_params(spec),
            **_interval_params(spec),
        },
    ) as dag:
        CheckpointedSparkSubmitOperator(
            task_id="run",
            pipeline=str(spec.spec_path),
            restore="{{ params.restore }}",
            parallelism="{{ params.parallelism }}",
            allow_changed_tables="{{ params.allow_changed_tables }}" if spec.tables else False,
            parallelism_on_retry=spec.parallelism_on_retry,
            **_interval_args(spec),
            metastore_conn_id=metastore_conn_id,
            conn_id=spark_conn_id,
            retries=spec.retries,
            retry_delay=spec.retry_delay,
            # each successful run updates the sink's Asset: downstream DAGs can schedule on it
            outlets=[sink_asset(spec)],
            **alerting,
            # choosing the restore is an edit of the pipeline, as in the API
            **{"authorize_restore": True, **(operator_args or {})},
        )
    return dag


def _alert_args(spec: PipelineSpec) -> dict[str, Any]:
    """The operator's ``alerts`` from the spec's ``alerts:`` section; a notifier that cannot be
    built is a :class:`SpecError` naming it."""
    from checkpointing_airflow.alerts import notifiers_from_spec

    if spec.alerts is None:
        return {}
    try:
        notifiers = notifiers_from_spec(spec.alerts)
    except Exception as exc:
        raise SpecError(
            f"{spec.spec_path or spec.job}: alerts.notifiers: {type(exc).__name__}: {exc}"
        ) from None
    return {"alerts": notifiers, "alert_after_failures": spec.alerts.after_failures}


def check_deployment(spec: PipelineSpec) -> None:
    """What Airflow would refuse in the deployment fields, refused with the file and field."""
    from airflow.sdk import DAG

    where = spec.spec_path or spec.job
    for tag in spec.tags:
        if len(tag) > MAX_TAG_LENGTH:
            raise SpecError(f"{where}: tags: {tag!r} is longer than {MAX_TAG_LENGTH} characters")
    if spec.schedule is None:
        return
    try:  # Airflow checks a cron expression only when it validates the whole DAG
        probe = DAG(
            dag_id=spec.job, schedule=spec.schedule, start_date=START_DATE, max_active_runs=1
        )
        probe.timetable.validate()
    except Exception as exc:
        raise SpecError(
            f"{where}: schedule: {exc} (got {spec.schedule!r}; use a cron expression such as "
            "'0 3 * * *' or a preset such as '@daily')"
        ) from None


def summary(spec: PipelineSpec) -> str:
    """One line for the DAG list."""
    if spec.stateless:
        middle = "stateless" + (" (transform)" if spec.transform or spec.code else "")
    else:
        computes = ", ".join(spec.aggregations) or f"Python pipeline {spec.pipeline or ''}".rstrip()
        middle = f"{computes} by {', '.join(spec.key)}"
    return f"{spec.source.format} {Path(spec.source.path).name} → {middle} → {_sink_name(spec)}"


def _sink_name(spec: PipelineSpec) -> str:
    if spec.sink.format == "iceberg":
        return f"{spec.sink.table} (Iceberg, {spec.sink.path})"
    return spec.sink.path


def describe(spec: PipelineSpec) -> str:
    """The DAG's documentation (Markdown): what the pipeline reads, computes, writes, and how it
    checkpoints, retries and is operated."""
    config = spec.checkpoint.config()
    checkpoints = []
    if spec.checkpoint.every_epochs:
        checkpoints.append(f"every {spec.checkpoint.every_epochs} epoch(s)")
    if config.periodic_interval is not None:
        checkpoints.append(f"every {format_duration(config.periodic_interval)}")
    checkpoints += [
        f"timeout {format_duration(config.timeout)}",
        f"{config.retained} retained",
        config.retention.value,
    ]
    retry_parallelism = spec.parallelism_on_retry or spec.parallelism
    aggregations = ", ".join(f"`{name} = {agg}`" for name, agg in spec.aggregations.items())
    rows = [
        ("spec", f"`{spec.spec_path}`"),
        (
            "source",
            f"{spec.source.format} `{spec.source.path}`, "
            + (
                f"epochs of up to {spec.source.epoch_bytes.human_readable()}"
                if spec.source.epoch_bytes is not None
                else f"{spec.source.splits_per_epoch} file(s) per epoch"
            ),
        ),
        *_code_rows(spec),
        *(
            [("stage", "stateless: each epoch's rows appended to the sink exactly once")]
            if spec.stateless
            else [
                ("key", ", ".join(f"`{k}`" for k in spec.key)),
                *([("aggregations", aggregations)] if aggregations else []),
            ]
        ),
        ("sink", _sink_doc(spec)),
        ("parallelism", f"{spec.parallelism} (max parallelism {spec.max_parallelism})"),
        (
            "retries",
            f"{spec.retries}, {format_duration(spec.retry_delay)} apart, each resuming from the "
            f"latest checkpoint at parallelism {retry_parallelism}"
            if spec.retries
            else "none",
        ),
        ("checkpoints", "; ".join(checkpoints)),
        ("storage", f"`{spec.storage}`" if spec.storage else "`CKPT_STORAGE_URL` (or default)"),
        ("schedule", f"`{spec.schedule}`" if spec.schedule else "none (triggered)"),
    ]
    table = "\n".join(f"| {name} | {value} |" for name, value in rows)
    return (
        f"### Checkpointed pipeline `{spec.job}`\n\n"
        "Runs the pipeline on Spark in epochs with checkpoints at epoch boundaries; a failed "
        "try is retried from the latest completed checkpoint.\n\n"
        f"| | |\n|---|---|\n{table}\n\n"
        "Trigger it with **Restore from** (`latest`, `none`, a checkpoint id or a savepoint "
        "path) and **Parallelism** (rescales the state). Take a savepoint with the "
        f"`{SAVEPOINT_DAG_ID}` DAG; start a new version from one with `{DEPLOY_DAG_ID}`.\n"
    )


def _code_rows(spec: PipelineSpec) -> list[tuple[str, str]]:
    """A spec naming Python code: the entry points, the stages they built, the shipped files."""
    rows = []
    if spec.pipeline:
        stages = ", ".join(f"`{s!r}`" for s in spec.code.stages) if spec.code else "?"
        rows.append(("code", f"`{spec.pipeline}` (Python pipeline; stages {stages})"))
    if spec.transform:
        rows.append(("transform", f"`{' '.join(spec.transform.split())[:200]}`"))
    if spec.py_files:
        rows.append(("py_files", ", ".join(f"`{f}`" for f in spec.py_files)))
    return rows


def _sink_doc(spec: PipelineSpec) -> str:
    """The sink, as the DAG's documentation describes it."""
    if spec.sink.format == "delta":
        mode = spec.sink_mode
        return f"`{spec.sink.path}` (a Delta Lake table, {mode} mode; one commit per checkpoint)"
    if spec.sink.format == "iceberg":
        return (
            f"`{spec.sink.table}` in `{spec.sink.path}` (an Iceberg table, {spec.sink_mode} "
            "mode; one snapshot per checkpoint)"
        )
    parts = (
        f", partitioned by {', '.join(spec.sink.partition_by)}" if spec.sink.partition_by else ""
    )
    if is_object_url(spec.sink.path):  # s3://, s3a://, gs://, abfs[s]://
        final = "" if spec.stateless else ", the final table named by `_ckpt_final.json`"
        return (
            f"`{spec.sink.path}` (Parquet objects: each committed epoch listed by its manifest "
            f"in `_ckpt_commits/`{final}{parts})"
        )
    if spec.stateless:
        return f"`{spec.sink.path}` (the committed epochs in `changelog/`{parts})"
    return f"`{spec.sink.path}` (final table in `final/`, epochs in `changelog/`{parts})"


#: the run's data interval (Airflow 3: a run without one, e.g. triggered with no logical date,
#: is the point of its ``run_after``)
INTERVAL_START = "{{ (data_interval_start or dag_run.run_after).isoformat() }}"
INTERVAL_END = "{{ (data_interval_end or dag_run.run_after).isoformat() }}"


def _interval_args(spec: PipelineSpec) -> dict[str, Any]:
    """A ``scope: interval`` spec: its run's data interval, and the full-refresh switch."""
    if spec.scope is not Scope.INTERVAL:
        return {}
    return {
        "interval_start": INTERVAL_START,
        "interval_end": INTERVAL_END,
        "full_refresh": "{{ params.full_refresh }}",
    }


def _interval_params(spec: PipelineSpec) -> dict[str, Any]:
    """A ``scope: interval`` spec: the trigger form's full refresh of the run's interval."""
    from airflow.sdk import Param

    if spec.scope is not Scope.INTERVAL:
        return {}
    return {
        "full_refresh": Param(
            False,
            type="boolean",
            title="Full refresh",
            description=(
                "replace this interval's output: its sink reset (only the job's own output), "
                "then the interval read again from the start; its checkpoints before are not "
                "restored any more. Retries of this run resume the refresh."
            ),
        )
    }


def _table_params(spec: PipelineSpec) -> dict[str, Any]:
    """A pipeline with static tables: the switch that accepts a restore over changed tables."""
    from airflow.sdk import Param

    if not spec.tables:
        return {}
    return {
        "allow_changed_tables": Param(
            False,
            type="boolean",
            title="Allow changed tables",
            description=(
                f"restore even though a static table ({', '.join(sorted(spec.tables))}) "
                "changed since the checkpoint (the change is recorded with the restore); "
                "otherwise such a restore fails before anything is written."
            ),
        )
    }
