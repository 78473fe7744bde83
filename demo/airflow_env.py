"""A project-local Airflow: the environment its commands run with (home, metadata database,
this project's plugins and a DAGs folder) and how to run them.

Shared by ``make demo`` (``airflow dags test`` of the example pipeline), ``make airflow`` (the
local Airflow of :mod:`demo.local_airflow`) and the tests, so that all three configure Airflow
alike. Airflow is only ever run as a subprocess (``airflow …`` of this interpreter's
environment): this module imports nothing of Airflow.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from demo import CHECKOUT, DAGS, PLUGINS

#: the checkout (``dags/``, ``plugins/``, ``demo/``), on the ``PYTHONPATH`` of Airflow's commands
REPO = CHECKOUT
__all__ = ["DAGS", "LOCAL_SPARK", "PLUGINS", "REPO", "airflow_command", "airflow_env", "migrate"]
#: Spark for the pipelines' ``spark-submit``: local, two cores
LOCAL_SPARK = {"conn_type": "spark", "host": "local[2]"}


def airflow_command() -> str:
    """The ``airflow`` of this interpreter's environment (never another one on ``PATH``)."""
    return str(Path(sys.executable).with_name("airflow"))


def free_port() -> int:
    """A TCP port free on this machine now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def airflow_env(
    home: Path,
    dags: Path,
    *,
    ckpt_home: Path,
    database_url: str | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of Airflow commands whose home is ``home`` (created) and whose DAGs folder
    is ``dags``; the metadata database is ``database_url``, default SQLite in ``home``.

    The caller's ``AIRFLOW*`` and ``CKPT_*`` variables are dropped so that nothing of the user's
    own Airflow (e.g. ``~/airflow``) leaks in; the checkpoint defaults live in ``ckpt_home``."""
    home.mkdir(parents=True, exist_ok=True)
    database_url = database_url or f"sqlite:///{home / 'airflow.db'}"
    env = {
        k: v
        for k, v in (os.environ if base is None else base).items()
        if not k.startswith(("AIRFLOW", "CKPT_"))
    }
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(PLUGINS),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": database_url,
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            # a fresh environment's first parse of a DAG file compiles Airflow's, PySpark's and
            # this project's bytecode: on a busy 2-core machine (the tests' two workers) that
            # took over Airflow's default 30 s
            "AIRFLOW__CORE__DAGBAG_IMPORT_TIMEOUT": "300",
            # the log servers of its task runners and triggerer on ports of their own: another
            # Airflow on this machine (a user's, another test's) holds 8793 and 8794
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps(LOCAL_SPARK),
            "CKPT_HOME": str(ckpt_home),
            # plugins/ for DAG files run outside Airflow's loader (``dags test``, workers)
            "PYTHONPATH": os.pathsep.join([str(PLUGINS), str(REPO)]),
            # airflow, spark-submit and ckpt of this environment first
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
        }
    )
    if database_url.startswith("postgresql"):  # psycopg 3 for Airflow's async engine too
        env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC"] = (
            "postgresql+psycopg_async" + (database_url[database_url.index("://") :])
        )
    return env


def migrate(env: Mapping[str, str], *, timeout: float = 600) -> None:
    """Create or upgrade Airflow's metadata database; raise with Airflow's own error."""
    done = subprocess.run(
        [airflow_command(), "db", "migrate"],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-20:]
        raise RuntimeError("airflow db migrate failed:\n" + "\n".join(tail))
