"""A real Airflow for tests: its own AIRFLOW_HOME and metadata database (SQLite or PostgreSQL),
this project's plugins, a DAGs folder of the test's own, and ``airflow dags test`` runs in
subprocesses (so that a test can kill one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
AIRFLOW = str(Path(sys.executable).with_name("airflow"))
CKPT = str(Path(sys.executable).with_name("ckpt"))


@dataclass
class AirflowHome:
    home: Path
    dags: Path
    env: dict[str, str]

    def run(self, *args: str, timeout: float = 600, **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run(
            [AIRFLOW, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **kwargs,
        )

    def dags_test(
        self, dag_id: str, conf: dict[str, Any] | None = None, *, timeout: float = 900
    ) -> subprocess.CompletedProcess:
        args = ["dags", "test", dag_id]
        if conf is not None:
            args += ["--conf", json.dumps(conf)]
        return self.run(*args, timeout=timeout)

    def write_dag(self, name: str, source: str) -> Path:
        path = self.dags / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        return path


def make_airflow_home(root: Path, database_url: str, ckpt_home: Path) -> AirflowHome:
    """Create and migrate an Airflow home whose metadata database is ``database_url``."""
    home, dags = root / "airflow", root / "dags"
    home.mkdir(parents=True, exist_ok=True)
    dags.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "CKPT_"))}
    env.update(
        {
            "AIRFLOW_HOME": str(home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": database_url,
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "AIRFLOW_CONN_SPARK_DEFAULT": json.dumps({"conn_type": "spark", "host": "local[2]"}),
            "CKPT_HOME": str(ckpt_home),
            "PYTHONPATH": os.pathsep.join([str(REPO / "plugins"), str(REPO)]),
        }
    )
    if database_url.startswith("postgresql"):  # psycopg 3 for Airflow's async engine too
        env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC"] = (
            "postgresql+psycopg_async" + (database_url[database_url.index("://") :])
        )
    airflow = AirflowHome(home, dags, env)
    migrated = airflow.run("db", "migrate", timeout=600)
    assert migrated.returncode == 0, migrated.stderr[-3000:]
    return airflow
