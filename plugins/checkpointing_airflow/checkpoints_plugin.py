"""The Airflow plugin of airflow-spark-checkpointing: the checkpoint REST API
(:mod:`checkpointing_airflow.api`) mounted in Airflow's api-server under ``/checkpoints``.

Two ways in: installed from the wheel, the ``airflow.plugins`` entry point names the class (as
``checkpointing_airflow.checkpoints_plugin``); in a checkout whose ``plugins/`` is Airflow's
plugins folder, the plugin manager imports this file as the top-level module
``checkpoints_plugin`` and registers every ``AirflowPlugin`` subclass it finds here. Keep the
class in this module only (another module holding it would register it twice), and when both
ways meet (the checkout's editable install), the folder's copy steps aside: Airflow would
otherwise report the second registration as a plugin import error.
"""

from __future__ import annotations

from importlib.metadata import entry_points

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


#: this module's name when imported as a package module (the entry point's)
ENTRY_POINT_MODULE = "checkpointing_airflow.checkpoints_plugin"


def registered_by_entry_point() -> bool:
    """Whether an installed distribution's ``airflow.plugins`` entry point names this plugin."""
    return any(ep.module == ENTRY_POINT_MODULE for ep in entry_points(group="airflow.plugins"))


if __name__ != ENTRY_POINT_MODULE and registered_by_entry_point():
    # loaded from the plugins folder while the entry point registers the plugin: leave no
    # AirflowPlugin subclass here for the folder scan to find
    del CheckpointingPlugin
