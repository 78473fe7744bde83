"""Restore: finding the newest valid checkpoint (``lookup``), planning a failed attempt's
successor (``recovery``), reassigning state to a new parallelism (``assignment``), and reading a
checkpoint's state back (``state_reader``, for ``ckpt inspect``).

May import every core package below it (state, pipeline, metastore, coordination).
"""
