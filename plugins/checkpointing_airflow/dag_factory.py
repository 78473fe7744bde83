"""DAGs from pipeline specs, and the savepoint and deploy DAGs: the names DAG files import.

The DAGs live in their own modules; this one gathers them for the DAG files (every generated
pipeline DAG file, :data:`~checkpointing_airflow.dag_files.DAG_FILE`, imports
:func:`pipeline_dag` from here) and keeps ``python -m checkpointing_airflow.dag_factory
sync|check DIR`` working:

- :mod:`~checkpointing_airflow.pipeline_dag`: the DAG of one pipeline spec;
- :mod:`~checkpointing_airflow.maintenance_dag`: a pipeline's ``<job>__maintenance`` (gc);
- :mod:`~checkpointing_airflow.savepoint_dag`: ``checkpoint_savepoint``;
- :mod:`~checkpointing_airflow.deploy_dag`: ``checkpoint_deploy`` (upgrades, rescaling);
- :mod:`~checkpointing_airflow.permissions`: the generic DAGs' per-pipeline permission checks;
- :mod:`~checkpointing_airflow.dag_files`: the pipelines directory and its ``sync``/``check``;
- :mod:`~checkpointing_airflow.dag_defaults`: connection ids, DAG ids, tag, start date.

Airflow is imported inside the functions, so ``sync`` and the checks run without it. This module
is also imported as a top-level module by Airflow's plugin manager, so it has no side effects and
uses only absolute imports.
"""

from __future__ import annotations

import sys

from checkpointing_airflow.dag_defaults import (
    DEPLOY_DAG_ID,
    JOB_ID_PATTERN,
    METASTORE_CONN_ID,
    SAVEPOINT_DAG_ID,
    SPARK_CONN_ID,
    START_DATE,
    TAG,
)
from checkpointing_airflow.dag_files import (
    DAG_FILE,
    SPEC_SUFFIX,
    PipelineSetError,
    known_pipelines,
    main,
    pipeline_problems,
    raise_for_pipeline_problems,
    spec_file_for,
    spec_files,
    sync_dag_files,
)
from checkpointing_airflow.deploy_dag import (
    DeployError,
    build_deploy_dag,
    deploy_plan_from_params,
    plan_deploy,
)
from checkpointing_airflow.maintenance_dag import (
    build_maintenance_dag,
    collect_garbage,
    maintenance_dag_id,
)
from checkpointing_airflow.permissions import PermissionRefused, authorize_run, authorize_trigger
from checkpointing_airflow.pipeline_dag import (
    MAX_TAG_LENGTH,
    build_pipeline_dag,
    check_deployment,
    describe,
    pipeline_dag,
    summary,
)
from checkpointing_airflow.savepoint_dag import (
    build_savepoint_dag,
    savepoint_from_params,
    take_savepoint,
)

__all__ = [
    "DAG_FILE",
    "DEPLOY_DAG_ID",
    "JOB_ID_PATTERN",
    "MAX_TAG_LENGTH",
    "METASTORE_CONN_ID",
    "SAVEPOINT_DAG_ID",
    "SPARK_CONN_ID",
    "SPEC_SUFFIX",
    "START_DATE",
    "TAG",
    "DeployError",
    "PermissionRefused",
    "PipelineSetError",
    "authorize_run",
    "authorize_trigger",
    "build_deploy_dag",
    "build_maintenance_dag",
    "build_pipeline_dag",
    "build_savepoint_dag",
    "check_deployment",
    "collect_garbage",
    "deploy_plan_from_params",
    "describe",
    "known_pipelines",
    "main",
    "maintenance_dag_id",
    "pipeline_dag",
    "pipeline_problems",
    "plan_deploy",
    "raise_for_pipeline_problems",
    "savepoint_from_params",
    "spec_file_for",
    "spec_files",
    "summary",
    "sync_dag_files",
    "take_savepoint",
]

if __name__ == "__main__":
    sys.exit(main())
