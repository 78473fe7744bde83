"""Checkpointed steps of an existing PySpark job, the Spark-free half: a step's identity (its
fingerprint from the plan, its input files and its upstream steps), what a restored checkpoint
says about each step and which steps a run reuses, recomputes or resumes, and running a user's
script under the job's settings (``ckpt run script.py``).

A step is a checkpoint and each Spark task of it a subtask; the Spark side (triggering, writing
each partition with Spark's own writer, acknowledging each file, reading a step back) is
:mod:`checkpointing.spark.steps`, whose :func:`~checkpointing.spark.steps.checkpointed` is the
public entry.

May import layers 1 to 7 (the top level, ``state``, ``metastore``, ``coordination``,
``restore``); never PySpark, Airflow, Rich nor Typer.
"""
