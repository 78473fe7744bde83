"""The operator ids of a pipeline job, defined once for the runtime and the core.

The Spark runtime acks under these ids and the core plans checkpoints and restores for them
(``recovery.pipeline_plan``); the core cannot import Spark, so both read them from here.
"""

from __future__ import annotations

#: the source (its splits are operator list state), the first keyed stage and the sink
SOURCE, AGGREGATE, SINK = "source", "aggregate", "sink"

#: the operators of a pipeline job with one keyed stage, in chain order
PIPELINE_OPERATORS: tuple[str, ...] = (SOURCE, AGGREGATE, SINK)
