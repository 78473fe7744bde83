"""The checkpoint protocol (Flink's ``CheckpointCoordinator`` and its collaborators): trigger,
acknowledge, decline, expire, complete, subsume, notify; requests, fencing of superseded
coordinators, the failure manager, the shared-state registry, savepoints from other processes.

May import the top-level modules, :mod:`checkpointing.state` and :mod:`checkpointing.metastore`;
never :mod:`checkpointing.restore`, Spark or Airflow.
"""
