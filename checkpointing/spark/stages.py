"""Keyed stateful stages: what :class:`~checkpointing.spark.runtime.PipelineRun` folds each
epoch's input into. Two ways in, one runtime:

- :class:`AggregationStage` — the spec's declarative ``aggregations`` (an
  :class:`~checkpointing.spark.aggregations.AggregationPlan`), all in Spark SQL;
- :class:`ArrowStage` — user Python code over Arrow tables, called once per key group per epoch
  (vectorised: never once per record).

Either way the state is a table of key columns, ``__subtask``, ``__key_group`` and the stage's
state columns, partitioned by subtask — so snapshots, restore and rescaling are the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T
from pyspark.sql.pandas.types import from_arrow_type, to_arrow_schema

from checkpointing.pipeline.spec import PipelineSpec, SpecError
from checkpointing.spark.aggregations import AggregationPlan
from checkpointing.spark.keys import KEY_GROUP, SUBTASK

#: ``keyed(df)``: ``df`` with its key group and subtask columns, partitioned by subtask
Keyed = Callable[[DataFrame], DataFrame]
#: ``update(state, batch) -> (new_state, changed)``; pandas DataFrames are accepted as results
UpdateFn = Callable[[pa.Table, pa.Table], tuple[Any, Any]]
FinalFn = Callable[[pa.Table], Any]


@dataclass(frozen=True)
class StepResult:
    """What one epoch's :meth:`Stage.step` gives the runtime."""

    #: the new state, materialised and partitioned by subtask
    state: DataFrame
    #: the sink rows of the keys that changed: the next stage's input in a chain, else the sink's
    output: DataFrame
    #: the state rows of the keys that changed, what an incremental snapshot writes; None for a
    #: stage whose snapshots are always full (``Stage.incremental`` false)
    changed_state: DataFrame | None = None


class Stage(Protocol):
    """What the runtime needs of a keyed stateful stage."""

    @property
    def key(self) -> list[str]:
        """The key columns its state is partitioned by (empty until keyed: the first stage of a
        chain takes the pipeline's through :meth:`with_key`)."""
        ...

    @property
    def uid(self) -> str | None:
        """The operator id its state is stored under (Flink's ``uid``); None: by position."""
        ...

    @property
    def incremental(self) -> bool:
        """Whether its snapshots may be incremental: ``step`` gives every state row it changed
        (``changed_state``) and the state never drops a key, which a log of changed rows cannot
        express."""
        ...

    def with_key(self, key: Sequence[str]) -> Stage:
        """This stage for the pipeline's key columns (refuses a mismatch)."""
        ...

    def check(self, input_schema: T.StructType) -> None:
        """Refuse an input the stage cannot process, before any state exists."""
        ...

    def state_schema(
        self, input_schema: T.StructType, extra_fields: Sequence[T.StructField] = ()
    ) -> T.StructType:
        """Key columns, ``extra_fields`` (subtask, key group), then the state columns."""
        ...

    def step(self, state: DataFrame, rows: DataFrame, keyed: Keyed) -> StepResult:
        """Fold one epoch's input ``rows`` into ``state``; ``keyed`` adds the key group and
        subtask columns and partitions by subtask, as the state is."""
        ...

    def final(self, state: DataFrame) -> DataFrame:
        """The final table: one sink row per key of ``state``."""
        ...

    def output_schema(self, input_schema: T.StructType) -> T.StructType:
        """The schema of the rows it emits (``step``'s output, ``final``'s): the next stage's
        input in a chain."""
        ...


class AggregationStage:
    """The declarative stage: pre-aggregate the epoch per key, merge into the state.

    ``uid``: the operator id its state is stored under (Flink's ``uid``), default by position.
    """

    #: a merge never drops a key, and its step tells the rows it changed
    incremental = True

    def __init__(self, plan: AggregationPlan, *, uid: str | None = None) -> None:
        self.plan = plan
        self.uid = uid

    def __repr__(self) -> str:
        return f"AggregationStage(key={self.plan.key}, {list(self.plan.aggregations)})"

    @property
    def key(self) -> list[str]:
        return list(self.plan.key)

    def with_key(self, key: Sequence[str]) -> AggregationStage:
        if list(key) != self.plan.key:
            raise ValueError(f"the aggregation plan's key {self.plan.key} is not {list(key)}")
        return self

    def check(self, input_schema: T.StructType) -> None:
        self.plan.check(input_schema)

    def state_schema(
        self, input_schema: T.StructType, extra_fields: Sequence[T.StructField] = ()
    ) -> T.StructType:
        return self.plan.state_schema(input_schema, extra_fields)

    def step(self, state: DataFrame, rows: DataFrame, keyed: Keyed) -> StepResult:
        """One shuffle per epoch, of the input rows by subtask: the partials, the merge (union +
        groupBy) and the changed rows then stay in the subtask's partition with its state."""
        on = [SUBTASK, KEY_GROUP, *self.plan.key]
        delta = keyed(rows).groupBy(*on).agg(*self.plan.partials(rows.schema))
        merged = self.plan.merge(state, delta, on, changed_flag=_CHANGED)
        merged = merged.localCheckpoint(eager=True)
        changed = merged.where(F.col(_CHANGED)).drop(_CHANGED)
        return StepResult(merged.drop(_CHANGED), self.plan.final(changed), changed)

    def partials_of(self, rows: DataFrame, keyed: Keyed) -> DataFrame:
        """The partial aggregates of one epoch's ``rows``, one row per key, partitioned by
        subtask like the state: what a lazily merged state (:mod:`~checkpointing.spark.lazy_state`)
        adds per epoch instead of merging."""
        on = [SUBTASK, KEY_GROUP, *self.plan.key]
        return keyed(rows).groupBy(*on).agg(*self.plan.partials(rows.schema))

    def compact(self, parts: Sequence[DataFrame]) -> DataFrame:
        """``parts`` (states or partial aggregates, several rows of a key allowed) merged into
        one row per key, still partitioned by subtask (a union and a ``groupBy``, no shuffle)."""
        on = [SUBTASK, KEY_GROUP, *self.plan.key]
        first, rest = parts[0], list(parts[1:])
        if not rest:
            return self.plan.merge(first, first.where(F.lit(False)), on)  # keeps partitioning
        delta = rest[0]
        for part in rest[1:]:
            delta = delta.unionByName(part)
        return self.plan.merge(first, delta, on)

    def final(self, state: DataFrame) -> DataFrame:
        return self.plan.final(state)

    def output_schema(self, input_schema: T.StructType) -> T.StructType:
        from pyspark.sql import SparkSession

        spark = SparkSession.getActiveSession()
        assert spark is not None, "needs an active Spark session"
        empty = spark.createDataFrame([], self.state_schema(input_schema))
        return self.plan.final(empty).schema  # analysed only: no Spark job


_CHANGED = "__changed"  # the merge's flag: the key had input this epoch
_KIND = "__kind"  # 0: a state row, 1: a changed (sink) row, in the stage's one output table
_S, _O = "__s_", "__o_"  # prefixes of state and output columns in that table


class ArrowStage:
    """A keyed stage whose state update is user code over Arrow tables.

    ``update(state, batch) -> (new_state, changed)`` is called once per key group that has input
    in an epoch: ``state`` holds the stored rows of every key in that key group (key columns +
    ``state_schema``; no rows for a new group), ``batch`` that epoch's input rows of the group
    (all input columns, in no particular order). ``new_state`` replaces the group's state — keys
    left out are dropped — and ``changed`` are the sink rows (key columns + ``output``) of the
    keys that changed. Results may be Arrow tables or pandas DataFrames; they are cast to the
    declared schemas. New keys must come from ``batch`` (a key belongs to exactly one group).

    ``final(state) -> rows`` gives the final table's rows from a key group's state; by default
    the state's key and ``output`` columns (which must then be state columns).

    ``key``: required for a stage after the first of a chain (the first takes the pipeline's);
    ``uid``: the operator id its state is stored under (Flink's ``uid``), default by position.
    """

    #: snapshots are full: ``update`` may drop keys, which a log of changed rows cannot express
    incremental = False

    def __init__(
        self,
        update: UpdateFn,
        *,
        state_schema: pa.Schema,
        output: pa.Schema,
        final: FinalFn | None = None,
        key: Sequence[str] | None = None,
        uid: str | None = None,
    ) -> None:
        self.update = update
        self.uid = uid
        self.state_fields = pa.schema(state_schema)
        self.output_fields = pa.schema(output)
        self.final_fn = final
        self.key: list[str] = list(key) if key is not None else []
        for what, schema in (("state_schema", self.state_fields), ("output", self.output_fields)):
            names = schema.names
            if len(set(names)) != len(names):
                raise ValueError(f"{what}: column names repeat: {names}")
            reserved = [n for n in names if n.startswith("__")]
            if reserved:
                raise ValueError(f"{what}: names starting with '__' are reserved: {reserved}")
        missing = [n for n in self.output_fields.names if n not in self.state_fields.names]
        if final is None and missing:
            raise ValueError(
                f"output columns {missing} are not state columns: give final=fn(state) -> rows"
            )
        if self.key:
            self.with_key(self.key)

    def __repr__(self) -> str:
        name = getattr(self.update, "__qualname__", repr(self.update))
        return f"ArrowStage({name}, key={self.key})"

    def with_key(self, key: Sequence[str]) -> ArrowStage:
        key = [key] if isinstance(key, str) else list(key)
        if self.key and key != self.key:
            raise ValueError(f"the stage's key {self.key} is not the pipeline's key {key}")
        for what, schema in (("state_schema", self.state_fields), ("output", self.output_fields)):
            clash = set(key) & set(schema.names)
            if clash:
                raise ValueError(f"{what}: columns clash with key columns: {sorted(clash)}")
        self.key = key
        return self

    # -- schemas ---------------------------------------------------------------------------

    def check(self, input_schema: T.StructType) -> None:
        missing = [k for k in self.key if k not in input_schema.names]
        if missing:
            raise ValueError(f"key: columns {missing} are not in the input")
        for f in [*self.state_fields, *self.output_fields]:
            from_arrow_type(f.type)  # refuses Arrow types Spark cannot hold

    def _key_fields(self, input_schema: T.StructType) -> list[T.StructField]:
        return [T.StructField(k, input_schema[k].dataType, True) for k in self.key]

    @staticmethod
    def _fields(schema: pa.Schema, prefix: str = "") -> list[T.StructField]:
        return [T.StructField(prefix + f.name, from_arrow_type(f.type), True) for f in schema]

    def state_schema(
        self, input_schema: T.StructType, extra_fields: Sequence[T.StructField] = ()
    ) -> T.StructType:
        self.check(input_schema)
        keys = self._key_fields(input_schema)
        return T.StructType([*keys, *extra_fields, *self._fields(self.state_fields)])

    def output_schema(self, input_schema: T.StructType) -> T.StructType:
        """The sink rows' schema: key columns, then ``output``."""
        return T.StructType([*self._key_fields(input_schema), *self._fields(self.output_fields)])

    # -- the epoch step --------------------------------------------------------------------

    def step(self, state: DataFrame, rows: DataFrame, keyed: Keyed) -> StepResult:
        """One cogroup of state and input by subtask: the user function runs per key group
        inside it; its state and changed rows leave in one tagged table, materialised once,
        so the function runs once per group and epoch."""
        keys = self._key_fields(rows.schema)
        tagged_schema = T.StructType(
            [
                T.StructField(_KIND, T.IntegerType()),
                T.StructField(SUBTASK, T.IntegerType()),
                T.StructField(KEY_GROUP, T.IntegerType()),
                *keys,
                *self._fields(self.state_fields, _S),
                *self._fields(self.output_fields, _O),
            ]
        )
        tagged_arrow = to_arrow_schema(tagged_schema)
        update, key = self.update, list(self.key)
        state_fields, output_fields = self.state_fields, self.output_fields

        def cogrouped(left: pa.Table, right: pa.Table) -> pa.Table:  # annotated for Spark
            return _update_subtask(
                update, key, state_fields, output_fields, tagged_arrow, left, right
            )

        tagged = (
            state.groupBy(SUBTASK)
            .cogroup(keyed(rows).groupBy(SUBTASK))
            .applyInArrow(cogrouped, tagged_schema)
            .localCheckpoint(eager=True)
        )
        new_state = tagged.where(F.col(_KIND) == 0).select(
            *self.key,
            SUBTASK,
            KEY_GROUP,
            *(F.col(_S + n).alias(n) for n in self.state_fields.names),
        )
        changed = tagged.where(F.col(_KIND) == 1).select(
            *self.key, *(F.col(_O + n).alias(n) for n in self.output_fields.names)
        )
        return StepResult(new_state, changed)

    def final(self, state: DataFrame) -> DataFrame:
        columns = [*self.key, *self.output_fields.names]
        if self.final_fn is None:
            return state.select(*columns)
        schema = self.output_schema(state.schema)
        target = _nullable(to_arrow_schema(schema))
        final_fn, key = self.final_fn, list(self.key)
        state_names = [*key, *self.state_fields.names]

        def per_subtask(table: pa.Table) -> pa.Table:  # annotated for Spark
            parts = [
                _conform(final_fn(group.select(state_names)), target, "final")
                for _, group in _by_key_group(table)
            ]
            return pa.concat_tables(parts) if parts else target.empty_table()

        return state.groupBy(SUBTASK).applyInArrow(per_subtask, schema)


def _nullable(schema: pa.Schema) -> pa.Schema:
    return pa.schema([f.with_nullable(True) for f in schema])


def _conform(result: Any, schema: pa.Schema, what: str) -> pa.Table:
    """A user function's result as a table of exactly ``schema`` (by column name)."""
    if isinstance(result, pd.DataFrame):
        result = pa.Table.from_pandas(result, preserve_index=False)
    if isinstance(result, pa.RecordBatch):
        result = pa.Table.from_batches([result])
    if not isinstance(result, pa.Table):
        raise TypeError(f"{what}: expected a pyarrow.Table or pandas.DataFrame, got {result!r}")
    missing = [n for n in schema.names if n not in result.column_names]
    if missing:
        raise ValueError(
            f"{what}: result lacks columns {missing} (has {result.column_names}); it must keep "
            "the key columns"
        )
    return result.select(schema.names).cast(schema)


def _by_key_group(table: pa.Table) -> list[tuple[int, pa.Table]]:
    """``table`` split by its key-group column: one slice per group, groups ascending."""
    if table.num_rows == 0:
        return []
    table = table.sort_by(KEY_GROUP)
    groups = table.column(KEY_GROUP).to_numpy()
    values, starts = np.unique(groups, return_index=True)
    ends = [*starts[1:], table.num_rows]
    return [
        (int(g), table.slice(int(s), int(e) - int(s)))
        for g, s, e in zip(values, starts, ends, strict=True)
    ]


def _update_subtask(
    update: UpdateFn,
    key: list[str],
    state_fields: pa.Schema,
    output_fields: pa.Schema,
    tagged: pa.Schema,
    left: pa.Table,
    right: pa.Table,
) -> pa.Table:
    """Runs on an executor, for one subtask: ``update`` per key group with input; groups
    without input keep their state as it is."""
    tagged = _nullable(tagged)
    key_types = [tagged.field(k).type for k in key]
    state_schema = pa.schema(
        [*(pa.field(k, t) for k, t in zip(key, key_types, strict=True)), *_nullable(state_fields)]
    )
    output_schema = pa.schema(
        [*(pa.field(k, t) for k, t in zip(key, key_types, strict=True)), *_nullable(output_fields)]
    )
    parts: list[pa.Table] = []

    def add(kind: int, rows: pa.Table, subtask: Any, key_group: Any, columns: pa.Schema) -> None:
        n = rows.num_rows
        if n == 0:
            return
        given = {k: rows.column(k) for k in key}
        prefix = _S if columns is state_fields else _O
        given.update({prefix + name: rows.column(name) for name in columns.names})
        given[_KIND] = pa.array([kind] * n, pa.int32())
        given[SUBTASK] = (
            subtask if isinstance(subtask, pa.ChunkedArray) else pa.array([subtask] * n, pa.int32())
        )
        given[KEY_GROUP] = (
            key_group
            if isinstance(key_group, pa.ChunkedArray)
            else pa.array([key_group] * n, pa.int32())
        )
        arrays = [
            given[f.name].cast(f.type) if f.name in given else pa.nulls(n, f.type) for f in tagged
        ]
        parts.append(pa.Table.from_arrays(arrays, schema=tagged))

    called: list[int] = []
    if right.num_rows:
        subtask = int(right.column(SUBTASK)[0].as_py())
        stored = dict(_by_key_group(left))
        for key_group, batch in _by_key_group(right):
            before = stored.get(key_group)
            before = (
                before.select(state_schema.names)
                if before is not None
                else state_schema.empty_table()
            )
            new_state, changed = update(before, batch.drop_columns([SUBTASK, KEY_GROUP]))
            new_state = _conform(new_state, state_schema, "update's new state")
            changed = _conform(changed, output_schema, "update's changed rows")
            add(0, new_state, subtask, key_group, state_fields)
            add(1, changed, subtask, key_group, output_fields)
            called.append(key_group)
    if left.num_rows:
        done = pc.is_in(left.column(KEY_GROUP), pa.array(called, pa.int32()))
        kept = left.filter(pc.invert(done))
        add(0, kept, kept.column(SUBTASK), kept.column(KEY_GROUP), state_fields)
    return pa.concat_tables(parts) if parts else tagged.empty_table()


def stage_chain(spec: PipelineSpec, stage: Stage | None, stages: Sequence[Stage]) -> list[Stage]:
    """A run's stateful stages: ``stages`` (a chain), else ``stage``, else the spec's
    aggregations; none for a stateless spec (its epochs' rows go to the sink as they are)."""
    if stage is not None and stages:
        raise ValueError("give either stage or stages, not both")
    if stages:
        return list(stages)
    if stage is not None:
        return [stage]
    if spec.aggregations:
        return [AggregationStage(AggregationPlan(spec.key, spec.aggregations))]
    if spec.stateless:
        return []
    raise SpecError("aggregations: needs at least one aggregation (or a stage)")
