"""An aggregation's state merged lazily: a log-structured merge for runs that publish only the
final table (``sink.changelog: false``).

A stage whose changed rows someone reads every epoch (a changelog sink, the next stage of a
chain) must merge each epoch's partial aggregates into the whole state: O(state) per epoch, O(state
x epochs) per run. When only the final table is published, the last aggregation stage instead
keeps a compacted *base* (one row per key, ``StageRun.state``) and the partial aggregates of each
epoch since (*deltas*, ``StageRun.deltas``, one row per key each, materialised), so an epoch costs
O(its input):

- an incremental checkpoint writes the deltas since the subtask's previous checkpoint (merged
  among themselves when there are several) as the next file of its chain, marked
  ``chain_merge: aggregate`` (:mod:`checkpointing.state.incremental`): O(changes), no merge with
  the base;
- the base and the deltas are merged (*compaction*) when :data:`MAX_DELTAS` deltas accumulate,
  when a snapshot must be full (a savepoint, a chain cut, non-incremental checkpoints) and once
  for the final table;
- a restore merges an aggregate chain with the stage's own merge, in Spark.

Exactness is the merge's: partial aggregates combine in any grouping (see
:mod:`checkpointing.spark.aggregations`), so the final table is the one an eager merge gives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from checkpointing.pipeline.spec import PipelineSpec
from checkpointing.spark.executor import SEQ
from checkpointing.spark.stages import AggregationStage, Keyed
from checkpointing.spark.state import MAX_DIRTY_EPOCHS, StageRun

#: deltas kept in memory before they are merged into the base: bounds what a final merge or a
#: full snapshot has to combine, and the materialised epochs the driver holds on to
MAX_DELTAS = 8


def lazy_stage(spec: PipelineSpec, stages: Sequence[StageRun]) -> StageRun | None:
    """The stage whose state may be merged lazily: the last one, when nothing reads its changed
    rows (the sink publishes only the final table) and it is a declarative aggregation."""
    last = stages[-1] if stages else None
    if spec.sink.changelog or last is None or not isinstance(last.stage, AggregationStage):
        return None
    return last


def add_epoch(
    s: StageRun, epoch: int, rows: DataFrame, keyed: Keyed, *, track: bool, reset: bool
) -> None:
    """Fold one epoch's ``rows`` into ``s`` as a delta: their partial aggregates per key,
    materialised; with ``track`` also kept for the next incremental snapshot (see
    :meth:`StageRun.track_changes`, ``reset`` as there). Past :data:`MAX_DELTAS` the state is
    compacted."""
    stage = s.stage
    assert isinstance(stage, AggregationStage)
    delta = stage.partials_of(rows, keyed).localCheckpoint(eager=True)
    s.deltas.append(delta)
    if track:
        s.track_changes(epoch, delta, MAX_DIRTY_EPOCHS, reset=reset)
    if len(s.deltas) >= MAX_DELTAS:
        compact(s, lambda: delta.where(F.lit(False)))


def compact(s: StageRun, empty: Callable[[], DataFrame]) -> DataFrame:
    """Merge the deltas into the base (materialised, one row per key); the state as it is.
    No base yet (``s.state`` None: nothing restored, never compacted): one delta is the state
    as it stands, several are merged among themselves, none give ``empty()``."""
    stage = s.stage
    assert isinstance(stage, AggregationStage)
    if s.state is None and len(s.deltas) <= 1:
        s.state = s.deltas[0] if s.deltas else empty()
    elif s.deltas:
        parts = s.deltas if s.state is None else [s.state, *s.deltas]
        s.state = stage.compact(parts).localCheckpoint(eager=True)
    s.deltas = []
    return s.state


def changes(s: StageRun) -> DataFrame | None:
    """The partial aggregates of the epochs since the chains' checkpoint, one row per key (the
    deltas merged among themselves, never with the base), with the last epoch in :data:`SEQ`:
    an aggregate chain's next file; None when no epoch ran since."""
    if not s.dirty:
        return None
    stage = s.stage
    assert isinstance(stage, AggregationStage)
    last = s.dirty[-1][0]
    parts = [df for _, df in s.dirty]
    merged = parts[0] if len(parts) == 1 else stage.compact(parts)
    return merged.withColumn(SEQ, F.lit(last))
