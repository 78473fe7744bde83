"""What every DAG of the plugin shares: the connection ids, the tag, the start date, the ids of
the savepoint and deploy DAGs, and the job-id pattern of the trigger forms.

No Airflow import: the checkpoint API and ``python -m checkpointing_airflow.dag_files`` use these
too."""

from __future__ import annotations

from datetime import UTC, datetime

from checkpointing import ids

METASTORE_CONN_ID = "checkpoint_metastore"
SPARK_CONN_ID = "spark_default"
#: every DAG made here carries this tag
TAG = "checkpointing"
SAVEPOINT_DAG_ID = "checkpoint_savepoint"
DEPLOY_DAG_ID = "checkpoint_deploy"
#: a pipeline's maintenance DAG is ``<job>`` + this (``maintenance:`` in its spec)
MAINTENANCE_SUFFIX = "__maintenance"
#: start date of scheduled pipelines; ``catchup`` is off, so only the next due run happens
START_DATE = datetime(2025, 1, 1, tzinfo=UTC)
#: a job id (``checkpointing.ids``) as a JSON-schema pattern for the trigger forms
JOB_ID_PATTERN = ids.ID_PATTERN
