"""The Spark driver's credentials: which environment variables hold one (by name), and how they
reach spark-submit — its process environment, never its command line (the Spark provider turns
``env_vars`` into ``--conf`` arguments on YARN and Kubernetes, visible in ``ps``)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

#: driver variables that hold credentials: never on a command line, always masked in logs
SECRET_ENV = frozenset(
    {
        "CKPT_METASTORE_URL",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        # GCS and Azure (checkpointing_airflow.cloud_credentials)
        "GOOGLE_SERVICE_ACCOUNT_KEY",
        "AZURE_STORAGE_CONNECTION_STRING",
        "AZURE_STORAGE_ACCOUNT_KEY",
        "AZURE_STORAGE_SAS_TOKEN",
        "AZURE_STORAGE_CLIENT_SECRET",
    }
)
#: further variable names taken for credentials (``env_vars`` given to the operator): a name
#: that may hold one goes to spark-submit's environment rather than its command line, so
#: erring on the side of a secret costs nothing in client mode. Passwords (``PASS``, ``PWD``),
#: keys (``KEY``, ``APIKEY``), tokens and auth, and URLs, DSNs and connection strings, which
#: embed credentials (``DATABASE_URL``, ``SENTRY_DSN``, ``…_CONNECTION_STRING``).
_SECRET_NAME = re.compile(
    r"SECRET|PASS|PWD|TOKEN|CREDENTIAL|PRIVATE|KEY|AUTH|COOKIE|SESSION|SIGNATURE"
    r"|DSN|(^|_)UR[LI]S?($|_)|CONN(ECTION)?($|_)|CONNECTION_?STR|(^|_)SAS($|_)",
    re.IGNORECASE,
)


#: the driver's own variables that look like credentials but are not (a bucket and prefix,
#: needed in the task log to find the checkpoints)
PUBLIC_ENV = frozenset({"CKPT_STORAGE_URL"})


def is_secret_name(name: str) -> bool:
    """Whether an environment variable's name says it holds a credential."""
    if name in PUBLIC_ENV:
        return False
    return name in SECRET_ENV or bool(_SECRET_NAME.search(name))


@contextmanager
def process_environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in this process's environment (which spark-submit inherits), then restored."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def mask_url_password(url: str, mask: Any) -> None:
    """The password of a SQLAlchemy URL masked on its own too (it may be quoted without the
    rest of the URL)."""
    from sqlalchemy.engine import make_url

    try:
        password = make_url(url).password
    except Exception:  # an unparsable URL: masked whole already
        return
    if password:
        mask(str(password))
