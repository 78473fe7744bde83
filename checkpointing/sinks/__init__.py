"""The Spark-free side of the two-phase-commit sinks: the ``Sink`` protocol the runtime drives,
where a sink may write and what it may delete (``guard``), the Delta Lake table's log and data
files through delta-rs, the Iceberg table through pyiceberg, and the two as table formats of the
table sink (``table_formats``). The Spark writers are in :mod:`checkpointing.spark` (``sinks``,
``parquet_sink``, ``table_sink``, ``delta_sink``, ``iceberg_sink``); the Airflow plugin needs
only this package.

May import the top-level modules and :mod:`checkpointing.state`.
"""
