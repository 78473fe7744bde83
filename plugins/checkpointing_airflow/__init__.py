"""Airflow glue of airflow-spark-checkpointing: the operator that runs a checkpointed pipeline, its
metastore hook and failure callbacks, and the DAG factory (pipeline specs, savepoints, deploys).

Import-light on purpose: DAG files import from this package at every parse, and Airflow's plugin
manager executes every ``.py`` file under ``plugins/``. Import the submodules you need.

Installed from the wheel, this is an Airflow provider: :func:`get_provider_info` is its
``apache_airflow_provider`` entry point, and the plugin
(:class:`checkpointing_airflow.checkpoints_plugin.CheckpointingPlugin`) its ``airflow.plugins``
entry point (``pyproject.toml``).
"""

from __future__ import annotations

from typing import Any

#: the distribution: Airflow refuses provider info whose package-name is not the installed one
PACKAGE_NAME = "airflow-spark-checkpointing"


def get_provider_info() -> dict[str, Any]:
    """The provider's description for Airflow's providers manager (``airflow providers list``,
    the connection form, extra links); plain data, so discovery imports nothing of ours.

    No ``connection-types`` entry: the metastore hook reads ``postgres`` connections, and
    registering that type here would take it over from Airflow's Postgres provider."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        versions = [version(PACKAGE_NAME)]
    except PackageNotFoundError:  # the checkout's plugins/ without the package installed
        versions = []
    return {
        "package-name": PACKAGE_NAME,
        "name": "Spark checkpointing",
        "description": (
            "Flink-style checkpoints for Airflow-orchestrated PySpark batch pipelines: the "
            "operator, the checkpoint metastore hook, the DAG factory and the Checkpoints API"
        ),
        "versions": versions,
        "integrations": [
            {
                "integration-name": "Spark checkpointing",
                "tags": ["software"],
            }
        ],
        "operators": [
            {
                "integration-name": "Spark checkpointing",
                "python-modules": ["checkpointing_airflow.operators"],
            }
        ],
        "hooks": [
            {
                "integration-name": "Spark checkpointing",
                "python-modules": ["checkpointing_airflow.hooks"],
            }
        ],
        "triggers": [
            {
                "integration-name": "Spark checkpointing",
                "python-modules": ["checkpointing_airflow.triggers"],
            }
        ],
        # no "plugins" entry: the airflow.plugins entry point registers the plugin, and a second
        # registration under the same name is reported by Airflow as a plugin import error
        "extra-links": ["checkpointing_airflow.links.CheckpointsLink"],
    }
