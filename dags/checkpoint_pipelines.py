"""The pipeline DAG factory's entry: checks that every spec in ``pipelines/`` becomes one DAG.

Each spec ``pipelines/<name>.yaml`` is built into its DAG by its own DAG file, ``<name>.py``, so
that a broken spec is an import error of that file only (see
``checkpointing_airflow.dag_files``). This file holds no DAG: its import error lists a spec
without a DAG file and two specs with one job id, and hides nothing.
"""

from pathlib import Path

from checkpointing_airflow.dag_files import raise_for_pipeline_problems

raise_for_pipeline_problems(Path(__file__).parent / "pipelines")
