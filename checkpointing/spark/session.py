"""The Spark session a run uses: started here (``local[2]`` on loopback by default) or under
``spark-submit`` with the submitter's settings, and the runtime SQL settings a run sets for its
duration only."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from py4j.protocol import Py4JError
from pyspark.sql import SparkSession

from checkpointing.spark.executor_env import session_credentials_conf
from checkpointing.spark.jvm_failure import (
    DRIVER_DEFAULT_JAVA_OPTIONS,
    driver_exited,
    spark_defaults,
    with_exit_on_oom,
)

log = logging.getLogger(__name__)


def spark_session(
    app_name: str = "ckpt", master: str | None = None, conf: dict[str, str] | None = None
) -> SparkSession:
    """A Spark session whose Python workers run this interpreter (they need pyarrow and this
    package), keeping partitioning of cached state across joins on a subset of the keys.

    Under ``spark-submit`` the master, driver address and app name are the submitter's (an
    Airflow Spark connection); otherwise ``master`` (default ``local[2]``) runs on loopback.
    ``conf`` adds or overrides settings, e.g. ``spark.executorEnv.*`` for a cluster's executors.
    A driver JVM started here exits on an ``OutOfMemoryError`` (code 3, see
    :mod:`~checkpointing.spark.jvm_failure`), an option added to the administrator's
    ``spark.driver.defaultJavaOptions``: the user's ``spark.driver.extraJavaOptions`` (or
    ``--driver-java-options``) stay as they are."""
    check_pyspark_client()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.config("spark.sql.requireAllClusterKeysForCoPartition", "false")
    if not under_spark_submit():
        master = master or "local[2]"
        builder = (
            builder.master(master)
            .appName(app_name)
            .config("spark.pyspark.python", sys.executable)
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")  # ours is the progress display
        )
        if master.startswith("local") or "127.0.0.1" in master or "localhost" in master:
            # one machine: stay on loopback; a real cluster's executors must reach the driver
            builder = builder.config("spark.driver.host", "127.0.0.1").config(
                "spark.driver.bindAddress", "127.0.0.1"
            )
    elif master:
        builder = builder.master(master)
    settings = {**session_credentials_conf(conf), **(conf or {})}
    if not under_spark_submit():  # the JVM starts here: its options are still ours to add to
        admin = settings.get(
            DRIVER_DEFAULT_JAVA_OPTIONS, spark_defaults(DRIVER_DEFAULT_JAVA_OPTIONS)
        )
        settings[DRIVER_DEFAULT_JAVA_OPTIONS] = with_exit_on_oom(admin)
    for key, value in settings.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def stop_session(spark: SparkSession) -> None:
    """Stop the session, unless its driver JVM is gone (e.g. it ran out of memory): stopping
    would fail on the lost connection and hide the run's own error."""
    if driver_exited():
        return
    try:
        spark.stop()
    except (Py4JError, ConnectionError) as exc:
        log.warning("could not stop the Spark session (its driver JVM is gone?): %s", exc)


@contextmanager
def session_settings(spark: SparkSession, settings: dict[str, str]) -> Iterator[None]:
    """Runtime SQL settings for the duration of a run, then the session's own values again (a
    Python API user's session is theirs)."""
    before = {key: spark.conf.get(key, None) for key in settings}
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)


def under_spark_submit() -> bool:
    """True in a driver launched by ``spark-submit``, whose JVM is already up with its conf."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def check_pyspark_client() -> None:
    """Refuse a pyspark-client (the Spark provider's dependency) whose version is not pyspark's:
    both install files under ``pyspark/``, and a mix of two versions fails later, obscurely."""
    from importlib.metadata import PackageNotFoundError, version

    from checkpointing.errors import ConfigError

    try:
        client, full = version("pyspark-client"), version("pyspark")
    except PackageNotFoundError:
        return
    if client != full:
        raise ConfigError(
            f"pyspark-client {client} does not match pyspark {full}: both ship pyspark/, install "
            f"the same version of each (e.g. pip install 'pyspark=={client}')"
        )
