"""Flink-style checkpointing for Airflow-orchestrated PySpark batch pipelines.

The core library: a checkpoint coordinator over a SQL metastore and file/S3 snapshot storage.
It imports neither Airflow nor Spark; the glue for those lives in ``plugins/``, ``dags/`` and
``checkpointing.spark``.
"""

__version__ = "0.1.0"
