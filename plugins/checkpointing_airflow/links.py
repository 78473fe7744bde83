"""The operator extra link "Checkpoints": from a pipeline's task instance in Airflow's UI to
its job's Checkpoints page (served by :mod:`checkpointing_airflow.api`)."""

from __future__ import annotations

import contextlib
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
    """ "Checkpoints" on a checkpointed pipeline's task: the page of the task's job."""

    name = "Checkpoints"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        """The page of the job the try ran: an interval run's own instance (Airflow computes the
        link as the try ends, its interval rendered), a script's declared ``job``, else the
        DAG's (a factory DAG's id is its job's) when the spec cannot be read here."""
        job = getattr(operator, "job", None) or ti_key.dag_id  # a script's declared job
        if getattr(operator, "pipeline", None):
            with contextlib.suppress(Exception):  # a missing link must not hide the try's outcome
                job = operator.load_spec().job  # type: ignore[attr-defined]
        return checkpoints_page(job)
