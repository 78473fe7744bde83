"""``checkpoint_deploy``: the upgrade flow. Start a pipeline from a savepoint (or its latest
checkpoint) with its current spec and code, at the same or a new parallelism."""

from pathlib import Path

from checkpointing_airflow.deploy_dag import build_deploy_dag

dag = build_deploy_dag(Path(__file__).parent / "pipelines")
