"""The DAG of the pipeline spec next to this file (same name, .yaml).

One DAG file per spec, so that a broken spec is an import error of this file only. Written by
`python -m checkpointing_airflow.dag_factory sync`, the same for every spec.
"""

from checkpointing_airflow.dag_factory import pipeline_dag

dag = pipeline_dag(__file__)
