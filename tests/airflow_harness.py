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

import pandas as pd

from checkpointing import datasets
from demo.airflow_env import REPO, airflow_command, airflow_env, migrate

__all__ = ["AIRFLOW", "CKPT", "REPO", "AirflowHome", "assert_exactly_once", "make_airflow_home"]

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


#: the aggregations of the Airflow tests' pipelines (over ``datasets.generate_events``)
AGGS: dict[str, tuple[str, str | None]] = {
    "n": ("count", None),
    "total": ("sum", "amount"),
    "avg_amount": ("avg", "amount"),
}


def write_events_spec(
    path: Path, job: str, events: Path, out: Path, *, checkpoint: str, **fields: object
) -> Path:
    """A pipeline spec at ``path``: job ``job`` aggregating :data:`AGGS` per user over the
    Parquet files in ``events`` into the sink ``out``, parallelism 2 of 16 key groups, the
    ``checkpoint`` section given as YAML flow text; ``fields`` are further top-level fields."""
    aggs = ", ".join(f"{k}: {f}({c or ''})" for k, (f, c) in AGGS.items())
    extra = "\n".join(f"{k}: {v}" for k, v in fields.items())
    path.write_text(
        f"""
job: {job}
source: {{format: parquet, path: "{events}/*.parquet", splits_per_epoch: 1}}
key: user
aggregations: {{{aggs}}}
sink: {{path: {out}}}
parallelism: 2
max_parallelism: 16
checkpoint: {checkpoint}
{extra}
"""
    )
    return path


def make_airflow_home(root: Path, database_url: str, ckpt_home: Path) -> AirflowHome:
    """Create and migrate an Airflow home whose metadata database is ``database_url``."""
    home, dags = root / "airflow", root / "dags"
    dags.mkdir(parents=True, exist_ok=True)
    env = airflow_env(home, dags, ckpt_home=ckpt_home, database_url=database_url)
    # `airflow dags test` triggers as `dag_test`: the savepoint and deploy DAGs check that the
    # triggering user may edit the pipeline's DAG (SimpleAuthManager's users)
    env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"] = "admin:admin,dag_test:user"
    migrate(env)
    return AirflowHome(home, dags, env)


def assert_exactly_once(
    out: Path, events: Path, aggregations: dict[str, tuple[str, str | None]]
) -> None:
    """The sink ``out`` of a pipeline over ``events`` (one file per epoch, keyed by ``user``)
    equals an uninterrupted run's: the final table is the independent pandas aggregation of
    every event, every epoch's changelog is committed once with exactly the keys of its file,
    and nothing is left in progress."""
    frames = [pd.read_parquet(p) for p in sorted(events.glob("*.parquet"))]
    final = pd.read_parquet(out / "final").sort_values("user").reset_index(drop=True)
    expected = datasets.expected_aggregates(pd.concat(frames), ["user"], aggregations)
    pd.testing.assert_frame_equal(
        final[expected.columns.tolist()], expected, check_dtype=False, check_exact=False
    )
    committed = sorted(int(p.name.split("=")[1]) for p in (out / "changelog").glob("epoch=*"))
    assert committed == list(range(len(frames)))
    for epoch, frame in enumerate(frames):
        got = pd.read_parquet(out / "changelog" / f"epoch={epoch}")
        assert sorted(got.user) == sorted(frame.user.unique()), f"epoch {epoch}"
    assert not list(out.rglob("*.inprogress"))
