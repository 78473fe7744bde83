"""Spark glue: the runtime that runs checkpointed jobs on PySpark. The only part of the project
that imports pyspark (the core in ``checkpointing`` never does)."""
