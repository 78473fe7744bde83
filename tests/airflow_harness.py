"""A real Airflow for tests: its own AIRFLOW_HOME and metadata database (SQLite or PostgreSQL),
this project's plugins, a DAGs folder of the test's own, and ``airflow dags test`` runs in
subprocesses (so that a test can kill one)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checkpointing.airflow_env import REPO, airflow_command, airflow_env, migrate

__all__ = ["AIRFLOW", "CKPT", "REPO", "AirflowHome", "make_airflow_home"]

AIRFLOW = airflow_command()
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
    dags.mkdir(parents=True, exist_ok=True)
    env = airflow_env(home, dags, ckpt_home=ckpt_home, database_url=database_url)
    migrate(env)
    return AirflowHome(home, dags, env)
