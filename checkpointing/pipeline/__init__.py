"""The pipeline domain: the declarative spec, its operator ids, input splits and epochs, static
tables, and the demo data sets with their independent expected results.

May import the top-level modules, :mod:`checkpointing.state` and :mod:`checkpointing.sinks`
(where a sink may write); never the metastore or the protocol.
"""
