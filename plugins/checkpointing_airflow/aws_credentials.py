"""S3 credentials for the Spark driver and its executors, resolved through the Amazon provider.

The provider's :class:`~airflow.providers.amazon.aws.hooks.base_aws.AwsBaseHook` understands every
kind of AWS connection (keys, a session token, an assumed role, a profile, web identity), so the
operator asks it for the credentials instead of reading the connection's fields. They are
resolved once per try, here, and handed on as boto3's standard variables: to spark-submit's
process environment (the driver inherits it), and from the driver's environment to the executors
through ``spark.executorEnv.*`` (:func:`checkpointing.spark.executor_env.executor_env_conf`).

The task's own process reads and writes the checkpoint storage too (the restore lookup of a
retry, the coordinator's retention and orphaned completions, the failure callbacks): it holds
the same variables in its environment while it does (:func:`storage_environment`).

Temporary credentials (a role, a session token) are not refreshed: a try must finish before they
expire (an assumed role's default session is one hour; raise the role's maximum session duration
and the connection's ``assume_role_kwargs`` ``DurationSeconds`` for longer runs). A retry
resolves fresh ones.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

#: what the driver and executors get; the secrets among them are masked and kept off command lines
CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def aws_environment(aws_conn_id: str | None, storage_url: str) -> dict[str, str]:
    """boto3's variables (keys, session token, endpoint, region) for a run whose checkpoints go to
    ``storage_url``, from the Airflow AWS connection ``aws_conn_id``.

    Nothing for non-S3 storage (no AWS call is made), and nothing when the connection does not
    exist: the driver's and executors' own standard chain (environment, profile, instance role)
    then applies, as it would without Airflow."""
    hook = _s3_hook(aws_conn_id, storage_url)
    if hook is None:
        return {}
    credentials = hook.get_credentials()  # frozen: a role is assumed now, once for this try
    env: dict[str, str] = {}
    if credentials.access_key and credentials.secret_key:
        env["AWS_ACCESS_KEY_ID"] = credentials.access_key
        env["AWS_SECRET_ACCESS_KEY"] = credentials.secret_key
        if credentials.token:
            env["AWS_SESSION_TOKEN"] = credentials.token
    endpoint = hook.conn_config.get_service_endpoint_url("s3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        env["AWS_ENDPOINT_URL"] = str(endpoint)
    if hook.region_name:
        env["AWS_DEFAULT_REGION"] = str(hook.region_name)
    return env


def storage_environment(
    aws_conn_id: str | None,
    storage_url: str,
    *,
    gcp_conn_id: str | None = None,
    azure_conn_id: str | None = None,
) -> dict[str, str]:
    """:func:`aws_environment`, its credentials masked in the task's log: for this process's
    own storage access (under ``process_environment``) and the driver's. GCS and Azure storage:
    :func:`checkpointing_airflow.cloud_credentials.cloud_environment` of ``gcp_conn_id`` or
    ``azure_conn_id``."""
    if not storage_url.startswith(("s3://", "s3a://")):
        from checkpointing_airflow.cloud_credentials import cloud_environment

        return cloud_environment(storage_url, gcp_conn_id=gcp_conn_id, azure_conn_id=azure_conn_id)
    env = aws_environment(aws_conn_id, storage_url)
    if env:
        from airflow.sdk.log import mask_secret

        for name in CREDENTIAL_VARIABLES:
            if env.get(name):
                mask_secret(env[name])
    return env


def s3_client(aws_conn_id: str | None, storage_url: str, *, fallback: bool = True) -> Any:
    """A boto3 S3 client of the connection ``aws_conn_id`` (its keys, token or role, endpoint
    and region), for a process that serves many tasks and so cannot put one task's credentials
    in its environment (the triggerer); None for non-S3 storage. A missing or unusable
    connection gives None (boto3's own chain of this process then applies) only with
    ``fallback``; without it (the triggerer: its own credentials are not the task's) it raises
    :class:`~checkpointing.errors.ConfigError` naming the connection."""
    from checkpointing.errors import ConfigError

    try:
        hook = _s3_hook(aws_conn_id, storage_url)
        if hook is None and not fallback and storage_url.startswith(("s3://", "s3a://")):
            raise ConfigError(
                f"AWS connection {aws_conn_id or '(none)'!r} not found here: the storage "
                f"{storage_url} is not read with this process's own credentials for a task; "
                "create the connection (an empty one uses boto3's chain explicitly)"
            )
        return None if hook is None else hook.get_conn()
    except ConfigError:
        raise
    except Exception as exc:  # the lookup itself failed
        if not fallback:
            raise ConfigError(
                f"AWS connection {aws_conn_id!r} not usable here ({type(exc).__name__})"
            ) from None
        log.warning(  # the process's own chain, said once
            "AWS connection %s not usable here (%s): S3 through boto3's own credential chain",
            aws_conn_id,
            type(exc).__name__,
        )
        return None


def _s3_hook(aws_conn_id: str | None, storage_url: str) -> Any:
    """The Amazon provider's hook of ``aws_conn_id`` for S3 storage; None for other storage
    (no AWS call) or a connection that does not exist (boto3's own chain then applies)."""
    if not aws_conn_id or not storage_url.startswith(("s3://", "s3a://")):
        return None
    from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        BaseHook.get_connection(aws_conn_id)
    except AirflowNotFoundException:
        return None
    return AwsBaseHook(aws_conn_id=aws_conn_id, client_type="s3")
