"""The operator extra link "Checkpoints": from a pipeline's task instance in Airflow's UI to
that pipeline's Checkpoints page (served by :mod:`checkpointing_airflow.api`)."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.sdk.types import TaskInstanceKey

#: the page, under the plugin app's prefix (``checkpointing_airflow.api.URL_PREFIX``)
UI_PATH = "/checkpoints/ui/"


def checkpoints_page(pipeline_id: str, base_url: str | None = None) -> str:
    """The Checkpoints page of one pipeline; under ``[api] base_url`` when it is set (Airflow
    behind a path prefix), else a path on Airflow's own host."""
    if base_url is None:
        from airflow.configuration import conf

        base_url = conf.get("api", "base_url", fallback="") or ""
    return f"{base_url.rstrip('/')}{UI_PATH}?pipeline={quote(pipeline_id, safe='')}"


class CheckpointsLink(BaseOperatorLink):
    """ "Checkpoints" on a checkpointed pipeline's task: its DAG id is the pipeline's job id."""

    name = "Checkpoints"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        """The page of the task's pipeline."""
        return checkpoints_page(ti_key.dag_id)
