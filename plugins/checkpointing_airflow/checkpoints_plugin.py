"""The Airflow plugin of airflow-spark-checkpointing: the checkpoint REST API
(:mod:`checkpointing_airflow.api`) mounted in Airflow's api-server under ``/checkpoints``.

Airflow's plugin manager imports this file as a top-level module and registers every
``AirflowPlugin`` subclass it finds here; keep the class in this module only (another module
holding it would register it twice).
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from checkpointing_airflow.api import URL_PREFIX, app
from checkpointing_airflow.links import UI_PATH, CheckpointsLink


class CheckpointingPlugin(AirflowPlugin):
    """Checkpoints in Airflow: the REST API, the Checkpoints page in the UI's navigation (an
    external view: Airflow shows it in an iframe at ``/plugin/checkpoints``) and the operator
    link from a pipeline's task to its page."""

    name = "checkpointing"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "Checkpoints API"}]
    external_views = [
        {
            "name": "Checkpoints",
            # relative: resolved against the <base href> of Airflow's UI, so that the frame
            # follows Airflow behind a path prefix ([api] base_url)
            "href": UI_PATH.lstrip("/"),
            "url_route": "checkpoints",
            "destination": "nav",
            "category": "browse",
        }
    ]
    # the api-server resolves the operator's link by its class: it must be registered here
    operator_extra_links = [CheckpointsLink()]
