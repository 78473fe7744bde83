"""The partial states of the aggregations beyond count/sum/min/max/avg, as Spark SQL columns.

Each is a value per key that merges exactly, in any order and any grouping (epochs, restores,
rescales), so the result after a crash equals the result without one:

======================  ==============================================  ===========================
aggregation             partial column (type)                           merge
======================  ==============================================  ===========================
count_distinct(c)       ``__set_<name>`` array of c's type, sorted      sorted union
approx_count_distinct   ``__hll_<name>`` binary: a DataSketches HLL     ``hll_union_agg``
max_by(v, o)            ``__maxby_<name>`` struct<order, value>         the best pair (see below)
min_by(v, o)            ``__minby_<name>`` struct<order, value>         the best pair
stddev(c), variance(c)  ``__mom_<name>`` struct<n, mean, m2> (doubles)  Chan's parallel formula
======================  ==============================================  ===========================

max_by/min_by: rows with a null ``order`` are ignored (as Spark's); among rows with the same
best order the smallest non-null value wins, and a null value only when every tied value is
null — so the pair does not depend on which rows an epoch, a replay or a merge saw first. The
pair is compared as a struct ``(order, has value, [not NaN,] key(value), value)`` where for
max_by ``key`` reverses the value's order (``~v`` for integers, ``-v`` for floats and decimals,
nibble-inverted hex for strings and binary, days/microseconds for dates and timestamps).

approx_count_distinct: sketches of lgConfigK 12 (Spark's default), relative standard error
:data:`HLL_RELATIVE_STANDARD_ERROR` (1.6 %); the union of sketches is exact, and the estimate is
always taken as of a union (:func:`out_of_order`), so it does not depend on the merge order.
stddev/variance: never a sum of squares; ``M2 / (n - 1)``, null below two values.
"""

from __future__ import annotations

from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql import types as T

from checkpointing.pipeline.spec import Aggregation

#: log2 of the HLL sketches' register count: Spark's default; relative standard error
#: ~1.04/sqrt(2^12) = 1.6 % (DataSketches HLL_8, after unions)
HLL_LG_CONFIG_K = 12
HLL_RELATIVE_STANDARD_ERROR = 1.04 / 2 ** (HLL_LG_CONFIG_K / 2)

#: partial kinds of the aggregations this module implements
KINDS = {
    "count_distinct": "set",
    "approx_count_distinct": "hll",
    "max_by": "maxby",
    "min_by": "minby",
    "stddev": "mom",
    "variance": "mom",
}

_UNORDERED = (T.MapType, T.VariantType)
_HLL_NATIVE = (T.IntegerType, T.LongType, T.StringType, T.BinaryType)
_HLL_CONVERTED = (
    T.ByteType,
    T.ShortType,
    T.BooleanType,
    T.DateType,
    T.TimestampType,
    T.FloatType,
    T.DoubleType,
    T.DecimalType,
    T.TimestampNTZType,
)
_REVERSIBLE = (
    T.IntegralType,
    T.BooleanType,
    T.FloatType,
    T.DoubleType,
    T.DecimalType,
    T.StringType,
    T.BinaryType,
    T.DateType,
    T.TimestampType,
    T.TimestampNTZType,
)
_MOMENTS = T.StructType(
    [
        T.StructField("n", T.LongType()),
        T.StructField("mean", T.DoubleType()),
        T.StructField("m2", T.DoubleType()),
    ]
)


def check(name: str, agg: Aggregation, fields: dict[str, T.DataType]) -> None:
    """Refuse an input type the aggregation cannot hold or order, naming the aggregation."""
    where = f"aggregation {name} = {agg}"
    value = fields[agg.column] if agg.column is not None else None
    assert value is not None
    if agg.function in ("stddev", "variance") and not isinstance(value, T.NumericType):
        raise ValueError(
            f"{where}: column {agg.column!r} has type {value.simpleString()}; "
            f"{agg.function} needs a numeric column"
        )
    if agg.function == "approx_count_distinct" and not isinstance(
        value, _HLL_NATIVE + _HLL_CONVERTED
    ):
        raise ValueError(
            f"{where}: column {agg.column!r} has type {value.simpleString()}; HLL sketches "
            "take numbers, strings, binary, booleans, dates and timestamps"
        )
    if agg.function == "count_distinct" and isinstance(value, _UNORDERED):
        raise ValueError(
            f"{where}: column {agg.column!r} has type {value.simpleString()}, whose values "
            "cannot be compared for distinctness"
        )
    if agg.function in ("max_by", "min_by"):
        order = fields[agg.order] if agg.order is not None else None
        assert order is not None
        if isinstance(order, _UNORDERED):
            raise ValueError(
                f"{where}: order column {agg.order!r} has type {order.simpleString()}, which "
                "has no order"
            )
        if agg.function == "min_by" and isinstance(value, _UNORDERED):
            raise ValueError(
                f"{where}: column {agg.column!r} has type {value.simpleString()}, which has no "
                "order for the tie rule (the smallest value wins)"
            )
        if agg.function == "max_by" and not isinstance(value, _REVERSIBLE):
            raise ValueError(
                f"{where}: column {agg.column!r} has type {value.simpleString()}; max_by "
                "returns numbers, strings, binary, booleans, dates and timestamps (the "
                "smallest value wins a tie)"
            )


def partial_type(kind: str, agg: Aggregation, fields: dict[str, T.DataType]) -> T.DataType:
    """The partial column's type (every part nullable, so snapshots restore as written)."""
    assert agg.column is not None
    if kind == "set":
        return T.ArrayType(fields[agg.column], True)
    if kind == "hll":
        return T.BinaryType()
    if kind in ("maxby", "minby"):
        assert agg.order is not None
        return T.StructType(
            [T.StructField("order", fields[agg.order]), T.StructField("value", fields[agg.column])]
        )
    assert kind == "mom", kind
    return _MOMENTS


def partial(
    kind: str,
    agg: Aggregation,
    column: Column,
    fields: dict[str, T.DataType] | None,
    order: Column | None = None,
) -> Column:
    """The aggregate over raw input rows (``column`` the value, ``order`` max_by's order)."""
    value_type = fields[agg.column] if fields is not None and agg.column is not None else None
    if kind == "set":
        return F.array_sort(F.collect_set(column))
    if kind == "hll":
        return F.hll_sketch_agg(_hll_input(column, value_type), HLL_LG_CONFIG_K)
    if kind in ("maxby", "minby"):
        assert order is not None
        if value_type is None and kind == "maxby":
            raise ValueError(f"{agg} needs the input schema (its tie rule depends on the type)")
        return _best(kind, order, column, value_type)
    assert kind == "mom", kind
    x = column.cast("double")
    n = F.count(x)
    return F.struct(
        n.alias("n"),
        F.coalesce(F.avg(x), F.lit(0.0)).alias("mean"),
        # Spark's var_pop keeps M2 itself (Welford, merged with Chan's formula): M2 = n * var_pop
        F.coalesce(F.var_pop(x) * n, F.lit(0.0)).alias("m2"),
    )


def merge(kind: str, state: Column, value_type: T.DataType | None) -> Column:
    """The aggregate combining partial columns of several rows (state and deltas) of a key."""
    if kind == "set":
        return F.array_sort(F.array_distinct(F.flatten(F.collect_list(state))))
    if kind == "hll":
        return F.hll_union_agg(state, False)
    if kind in ("maxby", "minby"):
        pair = F.when(state.isNotNull(), state)
        return _best(kind, pair.getField("order"), pair.getField("value"), value_type)
    assert kind == "mom", kind
    # sorted: the same partials fold in the same order, whatever order the rows came in
    parts = F.array_sort(F.collect_list(F.when(state.getField("n") > 0, state)))
    empty = F.struct(
        F.lit(0).cast("long").alias("n"), F.lit(0.0).alias("mean"), F.lit(0.0).alias("m2")
    )
    return F.aggregate(parts, empty, _chan)


def final(agg: Aggregation, state: Column) -> Column:
    """The SQL result from the merged partial column."""
    kind = KINDS[agg.function]
    if kind == "set":
        return F.when(state.isNull(), F.lit(0)).otherwise(F.size(state)).cast("long")
    if kind == "hll":
        return F.coalesce(F.hll_sketch_estimate(out_of_order(state)), F.lit(0)).cast("long")
    if kind in ("maxby", "minby"):
        return state.getField("value")
    n, m2 = state.getField("n"), state.getField("m2")
    variance = F.when(n >= 2, m2 / (n - 1).cast("double"))
    return F.sqrt(variance) if agg.function == "stddev" else variance


def out_of_order(sketch: Column) -> Column:
    """The sketch flagged *out of order*, so that its estimate depends on its registers only.

    A DataSketches HLL sketch in HLL mode estimates with its HIP accumulator while it has only
    seen values one by one (also when a union promoted coupons into it), and with the composite
    estimator from its registers once a union has merged another HLL-mode sketch into it. The
    HIP estimate depends on the order values arrived in, so without this the same rows merged
    in another order (another epoch split, a restore) could give another estimate; with it,
    every merge order — and one sketch over all the rows — gives the same. Preamble: byte 5 the
    flags (16: out of order), byte 7 the mode (low 2 bits; 2: HLL)."""
    mode = F.conv(F.hex(F.substring(sketch, 8, 1)), 16, 10).cast("int")
    flags = F.conv(F.hex(F.substring(sketch, 6, 1)), 16, 10).cast("int")
    flagged = F.concat(
        F.substring(sketch, 1, 5),
        F.unhex(F.lpad(F.hex(flags.bitwiseOR(16)), 2, "0")),
        F.substring(sketch, 7, 1 << 30),
    )
    return F.when(mode.bitwiseAND(3) == 2, flagged).otherwise(sketch)


def _chan(acc: Column, x: Column) -> Column:
    """Chan et al.'s pairwise update of (n, mean, M2): numerically stable, no sums of squares."""
    na, nb = acc.getField("n"), x.getField("n")
    n = na + nb
    delta = x.getField("mean") - acc.getField("mean")
    weight = nb.cast("double") / n.cast("double")
    mean = F.when(na == 0, x.getField("mean")).otherwise(acc.getField("mean") + delta * weight)
    m2 = F.when(na == 0, x.getField("m2")).otherwise(
        acc.getField("m2") + x.getField("m2") + delta * delta * na.cast("double") * weight
    )
    return F.struct(n.alias("n"), mean.alias("mean"), m2.alias("m2"))


def _hll_input(column: Column, value_type: T.DataType | None) -> Column:
    """What Spark's sketches accept (int, long, string, binary): other types mapped one to one,
    so distinct values stay distinct (floats: -0.0 is 0.0, as in Spark's distinct). DataSketches
    ignores empty strings and byte arrays, which SQL counts: strings go in as their UTF-8 bytes
    (the same hash as the string) with ``''`` as the byte 0xFF, which no UTF-8 text is; binary
    values go in behind a 0x00 byte."""
    if isinstance(value_type, T.StringType):
        return F.when(column == "", F.unhex(F.lit("FF"))).otherwise(F.encode(column, "UTF-8"))
    if isinstance(value_type, T.BinaryType):
        return F.concat(F.unhex(F.lit("00")), column)
    if value_type is None or isinstance(value_type, _HLL_NATIVE):
        return column
    if isinstance(value_type, T.ByteType | T.ShortType | T.BooleanType):
        return column.cast("int")
    if isinstance(value_type, T.DateType):
        return F.unix_date(column)
    if isinstance(value_type, T.TimestampType):
        return F.unix_micros(column)
    if isinstance(value_type, T.FloatType | T.DoubleType):
        text = F.when(column == 0, F.lit("0.0")).otherwise(column.cast("double").cast("string"))
    else:
        text = column.cast("string")  # decimals (one scale per column), timestamp_ntz
    return F.encode(text, "UTF-8")  # never empty


def _best(kind: str, order: Column, value: Column, value_type: T.DataType | None) -> Column:
    """The best (order, value) pair of the rows; null when no row has an order."""
    if kind == "minby":  # smallest order, then a non-null value, then the smallest value
        keys = [value.isNull(), value]
        pick = F.min
    else:  # largest order, then a non-null value, then (reversed) the smallest value
        assert value_type is not None
        keys = [value.isNotNull()]
        if isinstance(value_type, T.FloatType | T.DoubleType):
            keys.append(~F.isnan(value))  # NaN is the largest double: last among ties
        keys += [_reversed(value, value_type), value]
        pick = F.max
    fields = [order.alias("o"), *(k.alias(f"k{i}") for i, k in enumerate(keys[:-1]))]
    best = pick(F.when(order.isNotNull(), F.struct(*fields, keys[-1].alias("v"))))
    return F.when(
        best.isNotNull(),
        F.struct(best.getField("o").alias("order"), best.getField("v").alias("value")),
    )


def _reversed(value: Column, value_type: T.DataType) -> Column:
    """A column whose order is the reverse of ``value``'s (for max_by's tie rule)."""
    if isinstance(value_type, T.BooleanType):
        return ~value
    if isinstance(value_type, T.IntegralType):
        return F.bitwise_not(value)  # -v - 1: no overflow at the minimum
    if isinstance(value_type, T.FloatType | T.DoubleType | T.DecimalType):
        return -value
    if isinstance(value_type, T.DateType):
        return F.bitwise_not(F.unix_date(value))
    if isinstance(value_type, T.TimestampType):
        return F.bitwise_not(F.unix_micros(value))
    if isinstance(value_type, T.TimestampNTZType):  # ISO text (years 1-9999) sorts as the time
        value, value_type = value.cast("string"), T.StringType()
    # strings and binary compare byte by byte: invert each nibble of the hex form, and end with
    # a character above every hex digit so that a prefix sorts after its extensions
    binary = value if isinstance(value_type, T.BinaryType) else F.encode(value, "UTF-8")
    inverted = F.translate(F.hex(binary), "0123456789ABCDEF", "FEDCBA9876543210")
    return F.concat(inverted, F.lit("G"))
