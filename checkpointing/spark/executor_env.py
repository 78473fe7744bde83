"""The driver's S3 credentials for its executors, and Spark's redaction of them.

Executors, not the driver, write and read the state snapshots, so they need the S3 credentials
the driver got (the Airflow operator resolves them once per try and puts them in spark-submit's
environment, never on its command line). The driver hands its own boto3 variables on as
``spark.executorEnv.*`` when it builds its session: the cluster manager sets them in each
executor's environment, off every command line.

Spark shows its configuration in the UI's Environment page and writes it to the event log,
redacting keys or values that match ``spark.redaction.regex``. Its default
(``(?i)secret|password|token|access[.]?key``) covers ``AWS_SECRET_ACCESS_KEY`` and
``AWS_SESSION_TOKEN`` but not ``AWS_ACCESS_KEY_ID`` (an underscore, not a dot): the session's
regex adds ``access_key``, keeping any regex the submitter set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from checkpointing.state.cloud_filesystems import AZURE_VARIABLES, GCS_VARIABLES

#: boto3's variables an executor needs to reach the same S3 as the driver
FORWARDED = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    # GCS and Azure (gs://, abfs://): gcsfs's, adlfs's and delta-rs's own variables
    *GCS_VARIABLES,
    *AZURE_VARIABLES,
    # a savepoint's target outside the storage base is written only inside these
    "CKPT_STORAGE_ROOTS",
)
#: Spark's default redaction regex
SPARK_DEFAULT_REDACTION = "(?i)secret|password|token|access[.]?key"
#: what every session redacts: Spark's default plus ``access_key`` (``AWS_ACCESS_KEY_ID``), and
#: Google's and Azure's keys (``GOOGLE_SERVICE_ACCOUNT_KEY``, ``AZURE_STORAGE_ACCOUNT_KEY``,
#: ``AZURE_STORAGE_CONNECTION_STRING``)
SENSITIVE = "secret|password|token|access[._]?key|account[._]?key|connection[._]?string"
REDACTION = f"(?i){SENSITIVE}"


def executor_env_conf(
    environ: Mapping[str, str] | None = None,
    conf: Mapping[str, str] | None = None,
    submitted_regex: str | None = None,
) -> dict[str, str]:
    """Session settings that give the executors the driver's AWS variables (``environ``,
    default this process's), unless ``conf`` sets them already, and a redaction regex that
    covers them (``submitted_regex``: one the submitter set, extended rather than replaced)."""
    environ = os.environ if environ is None else environ
    conf = conf or {}
    out = {
        f"spark.executorEnv.{name}": environ[name]
        for name in FORWARDED
        if environ.get(name) and f"spark.executorEnv.{name}" not in conf
    }
    if "spark.redaction.regex" not in conf:
        out["spark.redaction.regex"] = redaction_regex(submitted_regex)
    return out


def redaction_regex(submitted: str | None) -> str:
    """The session's ``spark.redaction.regex``: ours, or the submitter's extended by ours (a
    scoped ``(?i:…)`` group, valid in Java's and Python's syntax wherever it stands)."""
    if not submitted or submitted in (SPARK_DEFAULT_REDACTION, REDACTION):
        return REDACTION
    if SENSITIVE in submitted:
        return submitted
    return f"{submitted}|(?i:{SENSITIVE})"


def submitted_redaction_regex() -> str | None:
    """``spark.redaction.regex`` as spark-submit gave it to the driver's JVM (``--conf``,
    ``--properties-file`` or ``spark-defaults.conf`` become system properties); None outside
    spark-submit or when unset."""
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        return None
    from pyspark import SparkContext

    SparkContext._ensure_initialized()  # the gateway spark-submit started; nothing new
    jvm = SparkContext._jvm
    assert jvm is not None
    value = jvm.java.lang.System.getProperty("spark.redaction.regex")
    return str(value) if value else None


def session_credentials_conf(conf: Mapping[str, str] | None = None) -> dict[str, str]:
    """:func:`executor_env_conf` for a session being built with ``conf`` (what
    :func:`checkpointing.spark.session.spark_session` adds)."""
    return executor_env_conf(conf=conf, submitted_regex=submitted_redaction_regex())
