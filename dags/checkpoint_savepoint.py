"""``checkpoint_savepoint``: a savepoint of a running pipeline, triggered from the Airflow UI's
trigger form (pipeline, stop, timeout); its result is the savepoint's path."""

from pathlib import Path

from checkpointing_airflow.savepoint_dag import build_savepoint_dag

dag = build_savepoint_dag(Path(__file__).parent / "pipelines")
