"""Airflow glue of airflow-spark-checkpointing: the operator that runs a checkpointed pipeline, its
metastore hook and failure callbacks, and the DAG factory (pipeline specs, savepoints, deploys).

Import-light on purpose: DAG files import from this package at every parse, and Airflow's plugin
manager executes every ``.py`` file under ``plugins/``. Import the submodules you need.
"""
