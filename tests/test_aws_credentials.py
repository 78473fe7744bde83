"""AWS credentials through the Amazon provider: an Airflow connection with a session token is
resolved by ``AwsBaseHook`` and reaches spark-submit's environment (never its command line or a
log line); the driver hands it on to its executors as ``spark.executorEnv.*`` under a redaction
regex that covers every name. That the executors then write the snapshots with the token is
proven on the standalone cluster (``tests/test_spark_cluster.py``), and a real Airflow task's run
with such a connection, its S3 requests and its logs, in ``tests/test_airflow_failover.py``."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import pytest

from checkpointing.spark.executor_env import FORWARDED, executor_env_conf, redaction_regex
from tests.test_pipeline_permissions import (
    airflow_home,
    install_fake_spark_submit,
    needs_airflow,
)

__all__ = ["airflow_home"]  # the fixture, shared

KEY_ID, SECRET = "ASIAEXAMPLE0TOKEN123", "s3cr3t-8d1f0b7e-secret"
TOKEN = "FwoGZXIvYXdzEToken-7a9c2e"


@pytest.fixture
def token_connection(monkeypatch: pytest.MonkeyPatch, s3_endpoint: str) -> str:
    """``aws_default`` as a deployment defines it: keys, a session token, moto's endpoint."""
    extra = {"aws_session_token": TOKEN, "endpoint_url": s3_endpoint, "region_name": "eu-west-1"}
    conn = {"conn_type": "aws", "login": KEY_ID, "password": SECRET, "extra": extra}
    monkeypatch.setenv("AIRFLOW_CONN_AWS_DEFAULT", json.dumps(conn))
    for name in FORWARDED:
        monkeypatch.delenv(name, raising=False)
    return s3_endpoint


@needs_airflow
def test_a_session_token_connection_reaches_spark_submit_by_environment_only(
    airflow_home: Path,
    token_connection: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from airflow.sdk._shared.secrets_masker import redact

    from checkpointing_airflow import driver_secrets
    from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator

    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_LOCAL", json.dumps({"conn_type": "spark", "host": "local[1]"})
    )
    install_fake_spark_submit(tmp_path / "bin", monkeypatch)

    op = CheckpointedSparkSubmitOperator(
        task_id="run",
        pipeline="spec.yaml",
        conn_id="spark_local",
        env_vars={"PATH": os.environ["PATH"]},  # the stand-in spark-submit first
    )
    with caplog.at_level(logging.DEBUG):
        env = op._driver_env("sqlite:////tmp/m.db", "s3://bucket/checkpoints")
        secrets = op.prepare_submit(env)
        with driver_secrets.process_environment(secrets):
            op._hook.submit(op.application)
    assert env["AWS_ENDPOINT_URL"] == token_connection
    assert env["AWS_DEFAULT_REGION"] == "eu-west-1"
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"} <= set(secrets)
    submitted = json.loads((tmp_path / "submitted.json").read_text())
    assert submitted["env"]["AWS_SESSION_TOKEN"] == TOKEN
    assert submitted["env"]["AWS_SECRET_ACCESS_KEY"] == SECRET
    assert submitted["env"]["AWS_ACCESS_KEY_ID"] == KEY_ID
    command_line = " ".join(submitted["argv"])
    logged = caplog.text
    for value in (SECRET, TOKEN):
        assert value not in command_line
        assert value not in logged
        assert value not in str(redact(f"boto3 said {value}"))  # masked wherever it is logged
    assert "AWS_SESSION_TOKEN" not in os.environ  # only spark-submit's start had it

    # the driver, with spark-submit's environment, hands all of it to its executors
    conf = executor_env_conf(submitted["env"], {})
    assert conf["spark.executorEnv.AWS_SESSION_TOKEN"] == TOKEN
    assert conf["spark.executorEnv.AWS_ENDPOINT_URL"] == token_connection
    regex = re.compile(conf["spark.redaction.regex"])
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        assert regex.search(f"spark.executorEnv.{name}"), name
    assert not regex.search("spark.executorEnv.AWS_ENDPOINT_URL")


@needs_airflow
def test_no_aws_call_for_local_storage_nor_a_missing_connection(
    airflow_home: Path, token_connection: str
) -> None:
    from checkpointing_airflow.aws_credentials import aws_environment

    assert aws_environment("aws_default", "file:///tmp/checkpoints") == {}
    assert aws_environment("aws_missing", "s3://bucket/checkpoints") == {}  # boto3's own chain
    assert aws_environment(None, "s3://bucket/checkpoints") == {}


def test_the_redaction_regex_extends_the_submitters_and_keeps_conf_given() -> None:
    """Spark's default misses ``AWS_ACCESS_KEY_ID``; a submitter's own regex is extended."""
    default = re.compile("(?i)secret|password|token|access[.]?key")
    assert not default.search("spark.executorEnv.AWS_ACCESS_KEY_ID")
    theirs = redaction_regex("(?i)internal[.]host")
    assert re.search(theirs, "spark.internal.host") and re.search(theirs, "AWS_ACCESS_KEY_ID")
    assert redaction_regex(theirs) == theirs  # not extended twice
    conf = executor_env_conf(
        {"AWS_SESSION_TOKEN": TOKEN, "HOME": "/root"},
        {"spark.executorEnv.AWS_SESSION_TOKEN": "given", "spark.redaction.regex": "x"},
    )
    assert conf == {}  # what the caller's conf sets wins; nothing but AWS_* is forwarded
