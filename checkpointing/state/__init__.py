"""State format and checkpoint storage: what a checkpoint is on disk.

Key groups, one subtask's snapshot file (Arrow IPC, self-checking), the ``_metadata`` file,
incremental chains, and the file/S3 storage they live in. Pure: it may import the standard
library, PyArrow, boto3 and the top-level ``checkpointing`` modules (errors, ids, clock, config,
status), never another ``checkpointing`` package.
"""
