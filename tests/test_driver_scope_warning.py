"""Without driver scope, a driver on PostgreSQL gets the task's own metastore connection (every
job's rows): each try says so in its log, naming how to turn the scope on; SQLite, which has no
roles to scope with, says nothing (review of issue 38)."""

from __future__ import annotations

import logging

import pytest

from checkpointing.metastore.engine import Metastore
from checkpointing_airflow.driver_scope import driver_metastore_url


class Operator:
    log = logging.getLogger("test_driver_scope_warning")


def test_a_driver_without_scope_on_postgresql_is_named_in_the_tries_log(
    metastore: Metastore, caplog: pytest.LogCaptureFixture
) -> None:
    url = metastore.url.render_as_string(hide_password=False)
    with caplog.at_level(logging.WARNING, logger=Operator.log.name):
        given = driver_metastore_url(Operator(), metastore, "routes", "run-1-t1", url)
    assert given == url  # no scope: the task's URL, as documented
    warned = [r.getMessage() for r in caplog.records if "driver scope" in r.getMessage()]
    if metastore.engine.dialect.name == "postgresql":
        assert warned == [
            "job routes: the driver gets the task's metastore connection, with every job's "
            "rows: enable driver scope (`ckpt db driver-scope enable`, docs/cluster.md) so "
            "that it can write only its own job's"
        ]
    else:
        assert warned == []
