"""The Spark driver's own metastore credentials: with driver scope enabled on a PostgreSQL
metastore (``ckpt db driver-scope enable``), each try's driver gets a per-attempt role that can
read and write only its own job's rows (:mod:`checkpointing.metastore.driver_roles`) instead of
the task's own URL; nor does it inherit the variable of the task's metastore connection from the
worker's environment. SQLite, or PostgreSQL without it: the task's URL, as before."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from checkpointing.metastore.driver_roles import (
    DEFAULT_TTL,
    driver_scope,
    grant_driver,
    revoke_driver,
)

if TYPE_CHECKING:
    from checkpointing.metastore.engine import Metastore

log = logging.getLogger(__name__)


def role_ttl(op: Any) -> timedelta:
    """How long the driver's role is valid: the operator's ``driver_role_ttl`` (seconds), else
    its ``execution_timeout``, else :data:`~checkpointing.metastore.driver_roles.DEFAULT_TTL`."""
    ttl = getattr(op, "driver_role_ttl", None)
    if ttl not in (None, ""):
        return timedelta(seconds=float(ttl))
    timeout = getattr(op, "execution_timeout", None)
    return timeout if isinstance(timeout, timedelta) and timeout > timedelta(0) else DEFAULT_TTL


def driver_metastore_url(
    op: Any, metastore: Metastore, job_id: str, attempt: str, task_url: str
) -> str:
    """The metastore URL the driver of ``attempt`` gets: its own role's when driver scope is
    enabled (the password masked in the task log at once), else ``task_url``. A scope that is
    enabled but incomplete, or a role the task cannot create, fails the try: falling back to
    the task's URL would quietly give the driver every job's rows."""
    from airflow.sdk.exceptions import AirflowFailException
    from airflow.sdk.log import mask_secret

    from checkpointing.metastore.driver_roles import DriverScopeError

    scope = driver_scope(metastore)
    if scope.group is None:
        if metastore.engine.dialect.name == "postgresql":  # where a scope could be had
            op.log.warning(
                "job %s: the driver gets the task's metastore connection, with every job's "
                "rows: enable driver scope (`ckpt db driver-scope enable`, docs/cluster.md) so "
                "that it can write only its own job's",
                job_id,
            )
        return task_url
    ttl = role_ttl(op)
    try:
        url = grant_driver(metastore, job_id, attempt, ttl)
    except DriverScopeError as exc:
        raise AirflowFailException(f"job {job_id}: driver scope: {exc}") from None
    assert url.password is not None
    mask_secret(url.password)
    rendered = url.render_as_string(hide_password=False)
    mask_secret(rendered)
    op.log.info(
        "job %s: the driver connects to the metastore as %s, its own job's rows only, for %s",
        job_id,
        url.username,
        ttl,
    )
    return rendered


def withheld_variables(op: Any, scoped: bool) -> tuple[str, ...]:
    """The variables of this worker's environment that a scoped driver must not inherit: the
    one Airflow reads the task's metastore connection from (``AIRFLOW_CONN_<ID>``), if set
    there. (``CKPT_METASTORE_URL`` is the driver's own already.) None without driver scope."""
    if not scoped:
        return ()
    return (f"AIRFLOW_CONN_{str(op.metastore_conn_id).upper()}",)


@contextmanager
def withheld_environment(names: Iterable[str]) -> Iterator[None]:
    """``names`` out of this process's environment while spark-submit starts and runs (the
    provider's hook gives it a copy of ``os.environ``), then put back."""
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def release_driver(metastore: Metastore, job_id: str, attempt: str) -> None:
    """Drop the role of ``attempt``'s driver, once that driver is gone. A failure is only
    logged: the role expires and the next grant (or ``ckpt db driver-scope expire``) drops
    it."""
    try:
        if revoke_driver(metastore, job_id, attempt):
            log.info("job %s: the driver role of %s is dropped", job_id, attempt)
    except Exception as exc:  # the try's outcome matters more
        log.warning("job %s: the driver role of %s is not dropped: %s", job_id, attempt, exc)
