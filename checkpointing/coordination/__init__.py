"""The checkpoint protocol (Flink's ``CheckpointCoordinator`` and its collaborators): trigger,
acknowledge, decline, expire, complete, subsume, notify; requests, fencing of superseded
coordinators, the failure manager, the shared-state registry, deleting files (the cleaner),
savepoints from other processes.

The coordinator (``coordinator``) is composed, not derived: it holds its completion handler
(``completion``, behind the two-method ``gateway``), cleaner, failure manager and fencing.

May import the layers below it (the top-level modules, :mod:`checkpointing.state`,
:mod:`checkpointing.sinks`, :mod:`checkpointing.pipeline`, :mod:`checkpointing.metastore`);
never :mod:`checkpointing.restore`, Spark or Airflow.
"""
