"""The Airflow plugin of airflow-spark-checkpointing: the checkpoint REST API
(:mod:`checkpointing_airflow.api`) mounted in Airflow's api-server under ``/checkpoints``.

Airflow's plugin manager imports this file as a top-level module and registers every
``AirflowPlugin`` subclass it finds here; keep the class in this module only (another module
holding it would register it twice).
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from checkpointing_airflow.api import URL_PREFIX, app


class CheckpointingPlugin(AirflowPlugin):
    """Checkpoints in Airflow: the REST API that the Checkpoints UI and scripts use."""

    name = "checkpointing"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "Checkpoints API"}]
