"""A spec's optional ``alerts:`` section: who hears of checkpoint trouble, which the Airflow DAG
factory turns into notifiers on the pipeline's task (``checkpointing_airflow.alerts``). Plain
data here: a notifier is named by its import path, built by the provider."""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: the alerts a pipeline raises (docs/operations.md says what each means and what to do)
ALERT_KINDS = (
    "checkpoint_failures",
    "tolerable_failures_exceeded",
    "restore_fallback",
    "restore_rescaled",
    "savepoint_completed",
    "savepoint_failed",
)

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*\.[A-Za-z_]\w*$")


class NotifierSpec(BaseModel):
    """``notifier``: the import path of an Airflow notifier class (any ``BaseNotifier``, e.g.
    ``airflow.providers.slack.notifications.slack.SlackNotifier``); ``args``: its keyword
    arguments (templated by Airflow: ``{{ checkpoint_alert.message }}`` is the alert's text);
    ``on``: the alert kinds it hears, default all."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    notifier: str
    args: dict[str, Any] = {}
    on: list[str] = list(ALERT_KINDS)

    @field_validator("notifier")
    @classmethod
    def _path(cls, v: str) -> str:
        if not _IMPORT_PATH.match(v):
            raise ValueError(f"an import path such as package.module.MyNotifier, not {v!r}")
        return v

    @field_validator("on")
    @classmethod
    def _kinds(cls, v: list[str]) -> list[str]:
        unknown = [k for k in v if k not in ALERT_KINDS]
        if unknown:
            raise ValueError(f"unknown alert kind(s) {unknown}: one of {', '.join(ALERT_KINDS)}")
        return v


class AlertsSpec(BaseModel):
    """``after_failures``: consecutive checkpoint failures that raise ``checkpoint_failures``
    (once per run of failures, before ``tolerable_failures`` fails the job); ``notifiers``: who
    hears the alerts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    after_failures: int = Field(default=1, ge=1, strict=True)
    notifiers: list[NotifierSpec] = []
