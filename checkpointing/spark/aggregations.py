"""Keyed aggregations as mergeable partial aggregates, in Spark SQL column expressions only.

The runtime keeps per-key state as *partial aggregates* (one row per key) and folds each epoch's
input into it:

    delta = epoch.groupBy(*key).agg(*plan.partials())
    state = plan.merge(state, delta, key)  # union + groupBy: no join, no shuffle of the state
    result = plan.final(state)

Partial columns, per aggregation ``name``:

=============  ======================================  ========================================
aggregation    partial columns                         merge
=============  ======================================  ========================================
count()        ``__cnt_<name>`` (long)                 add (null counts as 0)
count(c)       ``__cnt_<name>`` (long)                 add (null counts as 0)
sum(c)         ``__sum_<name>`` (long/double/decimal)  add, ignoring nulls (null + null = null)
min(c)/max(c)  ``__min_<name>``/``__max_<name>``       least/greatest, ignoring nulls
avg(c)         ``__sum_<name>``, ``__cnt_<name>``      as sum and count
=============  ======================================  ========================================

count_distinct, approx_count_distinct, max_by, min_by, stddev and variance keep one partial
column each, described in :mod:`checkpointing.spark.partials`.

:meth:`AggregationPlan.final` turns them into SQL results: counts are longs (0, never null),
sum/min/max are null when a key has no non-null value, avg is ``sum / count`` (null when the
count is 0) as a double, or over decimals as Spark's ``avg`` gives it: ``decimal(p + 4, s + 4)``
from the exact decimal sum, never through a double. Everything runs in the JVM: no Python UDFs,
nothing per record in Python.

Null key values are one key, as in ``groupBy`` (the merge is a ``groupBy`` too). With
Spark's default ANSI mode an overflowing integer sum fails the query, in the epoch's aggregate and
in the merge alike, instead of wrapping around. NaN is a value to Spark, not a null: it is counted,
it is the largest double for min/max, and it makes sum and avg NaN.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from checkpointing.pipeline.spec import Aggregation
from checkpointing.spark import partials as states

_MAX_DECIMAL_PRECISION = 38


def _col(name: str) -> Column:
    """A column by its exact name (dots or spaces in it are not struct paths)."""
    return F.col("`" + name.replace("`", "``") + "`")


def sum_type(input_type: T.DataType) -> T.DataType:
    """The type Spark's ``sum`` gives a column of ``input_type``: integers → long, float and
    double → double, ``decimal(p, s)`` → ``decimal(min(38, p + 10), s)``."""
    if isinstance(input_type, T.IntegralType):
        return T.LongType()
    if isinstance(input_type, T.FloatType | T.DoubleType):
        return T.DoubleType()
    if isinstance(input_type, T.DecimalType):
        return T.DecimalType(
            min(_MAX_DECIMAL_PRECISION, input_type.precision + 10), input_type.scale
        )
    raise ValueError(f"sum of a {input_type.simpleString()} column")


class _Partial:
    """One partial column: its name, the aggregation it belongs to, and its kind."""

    __slots__ = ("aggregation", "column", "kind", "name", "order", "output")

    def __init__(self, kind: str, output: str, aggregation: Aggregation) -> None:
        self.kind = kind  # "cnt", "sum", "min", "max", or a kind of :data:`partials.KINDS`
        self.output = output
        self.aggregation = aggregation
        self.column = aggregation.column
        self.order = aggregation.order
        self.name = f"__{kind}_{output}"


class AggregationPlan:
    """The partial-aggregate form of a keyed aggregation stage (see the module docstring).

    ``aggregations`` maps output column names to :class:`~checkpointing.pipeline.spec.Aggregation`
    (or its text, ``"avg(dep_delay)"``). Given ``input_schema``, the plan is checked against it
    here; otherwise when :meth:`partials`, :meth:`state_schema` or :meth:`empty_state` get a schema.
    """

    def __init__(
        self,
        key: Sequence[str],
        aggregations: Mapping[str, Aggregation | str],
        input_schema: T.StructType | None = None,
    ) -> None:
        if isinstance(key, str):
            key = [key]
        self.key: list[str] = list(key)
        if not self.key:
            raise ValueError("an aggregation plan needs at least one key column")
        if len(set(self.key)) != len(self.key):
            raise ValueError(f"key columns repeat: {self.key}")
        if not aggregations:
            raise ValueError("an aggregation plan needs at least one aggregation")
        self.aggregations: dict[str, Aggregation] = {
            name: agg if isinstance(agg, Aggregation) else Aggregation.parse(agg)
            for name, agg in aggregations.items()
        }
        clash = set(self.key) & set(self.aggregations)
        if clash:
            raise ValueError(f"aggregation names clash with key columns: {sorted(clash)}")

        self._partials: list[_Partial] = []
        for name, agg in self.aggregations.items():
            kinds = {"count": ["cnt"], "sum": ["sum"], "min": ["min"], "max": ["max"]}
            kinds.update({f: [kind] for f, kind in states.KINDS.items()})
            for kind in kinds.get(agg.function, ["sum", "cnt"]):  # avg: sum and count
                self._partials.append(_Partial(kind, name, agg))
        self.partial_columns: list[str] = [p.name for p in self._partials]
        clash = set(self.key) & set(self.partial_columns)
        if clash:
            raise ValueError(f"key columns clash with partial-aggregate columns: {sorted(clash)}")
        self.input_schema = input_schema
        if input_schema is not None:
            self.check(input_schema)

    def __repr__(self) -> str:
        aggs = ", ".join(f"{name}={agg}" for name, agg in self.aggregations.items())
        return f"AggregationPlan(key={self.key}, {aggs})"

    # -- validation and types --------------------------------------------------------------------

    def check(self, input_schema: T.StructType) -> None:
        """Refuse a plan the input cannot feed: a missing key or aggregated column, sum/avg
        of a non-numeric column, or a type the aggregation cannot hold or order (see
        :func:`partials.check`). Messages name the aggregation and the column."""
        fields = {f.name: f.dataType for f in input_schema.fields}
        for name in self.key:
            if name not in fields:
                raise ValueError(f"key: column {name!r} is not in the input ({sorted(fields)})")
        for name, agg in self.aggregations.items():
            if agg.column is None:
                continue
            for column in agg.columns:
                if column not in fields:
                    raise ValueError(
                        f"aggregation {name} = {agg}: column {column!r} is not in the input "
                        f"({sorted(fields)})"
                    )
            if agg.function in states.KINDS:
                states.check(name, agg, fields)
                continue
            data_type = fields[agg.column]
            if agg.function in ("sum", "avg") and not isinstance(data_type, T.NumericType):
                raise ValueError(
                    f"aggregation {name} = {agg}: column {agg.column!r} has type "
                    f"{data_type.simpleString()}; {agg.function} needs a numeric column"
                )
            if agg.function in ("min", "max") and isinstance(data_type, T.MapType | T.VariantType):
                raise ValueError(
                    f"aggregation {name} = {agg}: column {agg.column!r} has type "
                    f"{data_type.simpleString()}, which has no order for {agg.function}"
                )

    def _schema(self, input_schema: T.StructType | None) -> T.StructType | None:
        schema = input_schema if input_schema is not None else self.input_schema
        if schema is not None and schema is not self.input_schema:
            self.check(schema)
        return schema

    def _partial_type(self, partial: _Partial, input_schema: T.StructType) -> T.DataType:
        if partial.kind == "cnt":
            return T.LongType()
        if partial.kind not in ("sum", "min", "max"):
            fields = {f.name: f.dataType for f in input_schema.fields}
            return states.partial_type(partial.kind, partial.aggregation, fields)
        assert partial.column is not None
        input_type = input_schema[partial.column].dataType
        return sum_type(input_type) if partial.kind == "sum" else input_type

    def partial_fields(self, input_schema: T.StructType | None = None) -> list[T.StructField]:
        """The partial columns' fields, typed from the input as :meth:`partials` computes them:
        counts long (not nullable), sums as :func:`sum_type`, min/max the input column's type."""
        schema = self._schema(input_schema)
        if schema is None:
            raise ValueError("the partial columns' types need the input schema")
        return [
            T.StructField(p.name, self._partial_type(p, schema), p.kind != "cnt")
            for p in self._partials
        ]

    def state_schema(
        self,
        input_schema: T.StructType | None = None,
        extra_fields: Sequence[T.StructField] = (),
    ) -> T.StructType:
        """The state's schema: the key columns (as in the input), ``extra_fields`` (passthrough
        columns such as a key group), then :meth:`partial_fields` — the column order
        :meth:`merge` returns when ``on`` is the key plus the extra columns."""
        schema = self._schema(input_schema)
        if schema is None:
            raise ValueError("the state schema needs the input schema")
        keys = [schema[name] for name in self.key]
        return T.StructType([*keys, *extra_fields, *self.partial_fields(schema)])

    def empty_state(
        self,
        spark: Any,
        input_schema: T.StructType | None = None,
        extra_fields: Sequence[T.StructField] = (),
    ) -> DataFrame:
        """A state with no keys yet, of :meth:`state_schema`."""
        return spark.createDataFrame([], self.state_schema(input_schema, extra_fields))

    # -- the three steps ---------------------------------------------------------------------------

    def partials(self, input_schema: T.StructType | None = None) -> list[Column]:
        """Aggregate expressions over raw input rows, for
        ``df.groupBy(*key).agg(*plan.partials())``. With an input schema (here or given to the
        plan) they are checked against it and cast to exactly the :meth:`partial_fields` types."""
        schema = self._schema(input_schema)
        fields = None if schema is None else {f.name: f.dataType for f in schema.fields}
        out = []
        for p in self._partials:
            if p.kind == "cnt":
                expr = F.count(F.lit(1)) if p.column is None else F.count(_col(p.column))
            elif p.kind not in ("sum", "min", "max"):
                assert p.column is not None
                order = None if p.order is None else _col(p.order)
                expr = states.partial(p.kind, p.aggregation, _col(p.column), fields, order)
            else:
                assert p.column is not None
                fn = {"sum": F.sum, "min": F.min, "max": F.max}[p.kind]
                expr = fn(_col(p.column))
            if schema is not None:
                expr = expr.cast(self._partial_type(p, schema))
            out.append(expr.alias(p.name))
        return out

    def merge(
        self,
        state: DataFrame,
        delta: DataFrame,
        on: Sequence[str],
        *,
        changed_flag: str | None = None,
    ) -> DataFrame:
        """Fold ``delta`` (partial aggregates of new input) into ``state``, combining the partials
        per ``on`` — null key values are one key, as ``groupBy`` groups them. Returns ``on`` +
        :attr:`partial_columns`, typed as in ``state``. Either side may lack keys of the other,
        or be empty.

        A union then a ``groupBy(*on)``, not a join: when both sides are hash-partitioned by a
        subset of ``on`` (the runtime's subtask), neither is shuffled and the result keeps that
        partitioning — the state never moves between epochs. ``changed_flag``: also return this
        boolean column, true for the keys ``delta`` touched (the epoch's changed rows)."""
        on = [on] if isinstance(on, str) else list(on)
        if len(set(on)) != len(on):
            raise ValueError(f"merge: columns in `on` repeat: {on}")
        missing_key = [k for k in self.key if k not in on]
        if missing_key:
            raise ValueError(f"merge: `on` {on} lacks key columns {missing_key}")
        columns = on + self.partial_columns
        for side, df in (("state", state), ("delta", delta)):
            missing = [c for c in columns if c not in df.columns]
            if missing:
                raise ValueError(f"merge: the {side} lacks columns {missing}")

        types = {f.name: f.dataType for f in state.schema.fields}
        flag = "__touched"
        sides = [
            df.select(
                *(_col(c).cast(types[c]).alias(c) for c in columns), F.lit(touched).alias(flag)
            )
            for df, touched in ((state, False), (delta, True))
        ]
        combine = {"cnt": F.sum, "sum": F.sum, "min": F.min, "max": F.max}
        aggs = [
            (
                combine[p.kind](_col(p.name))
                if p.kind in combine
                else states.merge(p.kind, _col(p.name), _value_type(types[p.name]))
            )
            .cast(types[p.name])
            .alias(p.name)
            for p in self._partials
        ]
        if changed_flag is not None:
            aggs.append(F.max(flag).alias(changed_flag))
        return sides[0].unionByName(sides[1]).groupBy(*(_col(c) for c in on)).agg(*aggs)

    def final(self, state: DataFrame, extra: Sequence[str] = ()) -> DataFrame:
        """The result per key: key columns, ``extra`` passthrough columns, then one column per
        aggregation with SQL semantics (see the module docstring)."""
        partial = {(p.output, p.kind): _col(p.name) for p in self._partials}
        out = [_col(c) for c in [*self.key, *extra]]
        for name, agg in self.aggregations.items():
            if agg.function == "count":
                expr = F.coalesce(partial[name, "cnt"], F.lit(0)).cast("long")
            elif agg.function == "avg":
                expr = _average(
                    partial[name, "sum"], partial[name, "cnt"], state.schema[f"__sum_{name}"]
                )
            elif agg.function in states.KINDS:
                expr = states.final(agg, partial[name, states.KINDS[agg.function]])
            else:
                expr = partial[name, agg.function]
            out.append(expr.alias(name))
        return state.select(out)


def _average(total: Column, count: Column, total_field: T.StructField) -> Column:
    """``sum / count``, null for no values: a double, or over decimals what Spark's ``avg``
    gives — ``decimal(p + 4, s + 4)`` from the exact decimal sum (``decimal(p + 10, s)``), the
    division and its rounding as Spark's own (a sum of precision 38 leaves ``p`` unknown: the
    result is then ``decimal(38, s + 4)``, the same values)."""
    total_type = total_field.dataType
    if not isinstance(total_type, T.DecimalType):
        return F.when(count > 0, total.cast("double") / count.cast("double"))
    precision = _MAX_DECIMAL_PRECISION
    if total_type.precision < _MAX_DECIMAL_PRECISION:
        precision = total_type.precision - 10 + 4
    result = T.DecimalType(
        min(_MAX_DECIMAL_PRECISION, precision), min(_MAX_DECIMAL_PRECISION, total_type.scale + 4)
    )
    return F.when(count > 0, (total / count.cast(T.DecimalType(20, 0))).cast(result))


def _value_type(state_type: T.DataType) -> T.DataType | None:
    """The value's type in a max_by/min_by pair (what its tie rule orders by)."""
    if isinstance(state_type, T.StructType) and "value" in state_type.names:
        return state_type["value"].dataType
    return None
