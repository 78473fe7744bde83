"""The SQL metastore: engine, typed models, Alembic migrations, and the read and registration
queries every process shares (jobs, the views the CLI and API show, a run's outcome).

May import the top-level modules, :mod:`checkpointing.state` and :mod:`checkpointing.pipeline`;
never :mod:`checkpointing.coordination` or :mod:`checkpointing.restore` (they build on it).
"""
