"""The per-epoch transform and the static tables of a run.

``transform:`` (a Spark SQL ``SELECT``, or the Python API's function) turns each epoch's rows
into the keyed stage's input: the epoch's rows are the view ``input``, each static table of
``tables:`` the view of its name. The tables are read once per attempt (cached; a small one is
broadcast to the join) and their files' identity goes into every checkpoint
(:mod:`checkpointing.pipeline.tables`).

The transform runs again on every replayed epoch (after a restore, a retried Spark task), so it
must be **deterministic**: ``rand()``, ``uuid()``, ``current_timestamp()``,
``monotonically_increasing_id()``… would give a replayed epoch other rows than the first run
gave, and the state would count something no input says. Its analyzed plan is checked
(Catalyst's ``deterministic``, plus the clock functions Catalyst calls deterministic because
they are fixed within one query, but not across epochs).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from py4j.protocol import Py4JError, Py4JJavaError
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from checkpointing.pipeline.entry import is_entry_point, load_code
from checkpointing.pipeline.spec import PipelineSpec, SpecError
from checkpointing.pipeline.splits import InputSplit
from checkpointing.pipeline.tables import TableFiles, check_tables, table_files, table_items
from checkpointing.spark.object_source import object_schema, read_object_splits
from checkpointing.state.object_store import ObjectInfo

if TYPE_CHECKING:
    from checkpointing.spark.preflight import RunOptions

log = logging.getLogger(__name__)

#: ``transform(input, tables) -> rows``: the Python API's transform
TransformFn = Callable[[DataFrame, Mapping[str, DataFrame]], DataFrame]
#: the view the epoch's rows are registered as
INPUT_VIEW = "input"
#: tables up to this size (bytes on disk) are broadcast to the transform's joins
BROADCAST_BYTES = 64 * 1024 * 1024
#: Catalyst calls these deterministic (one value per query), but each epoch is another query
_CLOCKS = {"CurrentDate", "CurrentTimestamp", "Now", "LocalTimestamp", "CurrentTime"}
_CLOCK_TEXT = re.compile(r"\b(current_date|current_timestamp|now|localtimestamp|current_time)\(")
_SUBQUERIES = ("Subquery", "Exists", "ListQuery")


class InputTransform:
    """The run's transform over the static tables (nothing, when the spec has neither): a
    context manager for the run, which releases the cached tables at its end."""

    def __init__(
        self, spark: SparkSession, spec: PipelineSpec, fn: TransformFn | None = None
    ) -> None:
        #: the SQL transform; ``transform: module:fn`` names a function instead
        self.sql = None if is_entry_point(spec.transform) else spec.transform
        if fn is not None and self.sql is not None:
            raise SpecError("transform: give a SQL transform or a Python function, not both")
        if fn is None and self.sql is None and spec.transform is not None:
            code = spec.code or load_code(spec, spec.spec_path or Path(spec.job))
            fn = code.transform if code is not None else None
        self.spark, self.spec, self.fn = spark, spec, fn
        #: listed once per attempt: what its checkpoints record
        self.files: TableFiles = table_files(spec)
        self.items = table_items(self.files)
        self._tables: dict[str, DataFrame] | None = None
        self._checked = False

    @property
    def active(self) -> bool:
        return self.fn is not None or self.sql is not None

    def __enter__(self) -> InputTransform:
        return self

    def __exit__(self, *_exc: object) -> None:
        for df in (self._tables or {}).values():
            df.unpersist()
        self._tables = None

    def check_restore(
        self, recorded: list[dict[str, Any]], checkpoint_id: int, options: RunOptions
    ) -> dict[str, Any] | None:
        """The tables a restore's checkpoint recorded are those listed now: refused otherwise
        (naming the table and the file), unless ``options.allow_changed_tables``; the changes
        then, for the restore's decision."""
        allow = options.allow_changed_tables
        changed = check_tables(recorded, self.items, checkpoint_id, allow_changed=allow)
        if changed:
            log.warning("job %s: tables changed since checkpoint %d: %s", self.spec.job,
                        checkpoint_id, changed)  # fmt: skip
        return changed

    # ------------------------------------------------------------------ tables

    def tables(self) -> dict[str, DataFrame]:
        """Every static table, read once per attempt (cached; small ones broadcast)."""
        if self._tables is None:
            tables = {}
            for name, files in self.files.items():
                df, rows = self._read_table(name, files)
                size = sum(
                    f.size if isinstance(f, ObjectInfo) else int(i["size"])
                    for f, i in zip(files, self._items_of(name), strict=True)
                )
                log.info(
                    "table %s: %d rows from %d file(s), %d bytes", name, rows, len(files), size
                )
                tables[name] = F.broadcast(df) if size <= BROADCAST_BYTES else df
            self._tables = tables
        return self._tables

    def _items_of(self, name: str) -> list[dict[str, Any]]:
        return [i for i in self.items if i["table"] == name]

    def _read_table(self, name: str, files: list[str] | list[ObjectInfo]) -> tuple[DataFrame, int]:
        """The table, cached and read now (its rows counted): a file that cannot be read is a
        :class:`SpecError` naming ``tables.<name>``, not an epoch's input error."""
        table = self.spec.tables[name]
        try:
            if files and isinstance(files[0], ObjectInfo):
                splits = [InputSplit(f.url, size=f.size, etag=f.etag) for f in files]  # type: ignore[union-attr]
                df = read_object_splits(self.spark, splits, object_schema(splits[0]))
            else:
                reader = self.spark.read.format(table.format.value)
                if table.format.value == "csv":
                    reader = reader.options(header=table.header, inferSchema=True, mode="FAILFAST")
                df = reader.load([str(f) for f in files])
            df = df.cache()
            return df, df.count()
        except (PySparkException, Py4JJavaError, OSError) as exc:
            raise SpecError(
                f"tables.{name}: cannot read {table.path}: {_first_line(exc)}"
            ) from None

    # ------------------------------------------------------------------ transform

    def apply(self, rows: DataFrame) -> DataFrame:
        """The transform's output over an epoch's ``rows`` (lazy: analysed, not run); the rows
        themselves without a transform. SQL errors, unknown columns or tables and
        non-deterministic expressions are :class:`SpecError` naming ``transform``."""
        if not self.active:
            return rows
        tables = self.tables()
        if self.fn is not None:
            out = self.fn(rows, MappingProxyType(tables))
            if not isinstance(out, DataFrame):
                raise SpecError(f"transform: must return a DataFrame, not {type(out).__name__}")
            self._check_deterministic(out, "transform: the returned DataFrame")
            return out
        out = self._sql(rows, tables)
        if not self._checked:  # the same SQL every epoch: one check per attempt
            self._check_deterministic(out, f"transform: {_short(self.sql or '')}")
            self._checked = True
        return out

    def _sql(self, rows: DataFrame, tables: Mapping[str, DataFrame]) -> DataFrame:
        """``transform`` over the views ``input`` and the tables, analysed while they are
        registered; the session's own temporary views of those names come back after."""
        views = {INPUT_VIEW: rows, **tables}
        catalog = self.spark._jsparkSession.sessionState().catalog()  # type: ignore[attr-defined]
        before = {n: self.spark.table(n) for n in views if catalog.getTempView(n).isDefined()}
        try:
            for name, df in views.items():
                df.createOrReplaceTempView(name)
            return self.spark.sql(self.sql or "")
        except PySparkException as exc:
            raise SpecError(f"transform: {_first_line(exc)}") from None
        finally:
            for name in views:
                if name in before:
                    before[name].createOrReplaceTempView(name)
                else:
                    self.spark.catalog.dropTempView(name)

    @contextmanager
    def naming_output(self) -> Iterator[None]:
        """Checks of the key and the stages against the transform's output: their "not in the
        input" means not in the output of ``transform``."""
        try:
            yield
        except ValueError as exc:
            if not self.active or isinstance(exc, SpecError):
                raise
            message = str(exc)
            if "is not in the input" in message:
                message = message.replace(
                    "is not in the input", "is not in the output of transform"
                )
            else:
                message = f"{message} (in the output of transform)"
            raise SpecError(message) from None

    def _check_deterministic(self, df: DataFrame, what: str) -> None:
        culprits = nondeterministic(df)
        if culprits:
            raise SpecError(
                f"{what} is not deterministic: {', '.join(culprits)} (every epoch, and a "
                "replayed one, must give the same rows)"
            )


def nondeterministic(df: DataFrame) -> list[str]:
    """The non-deterministic functions of ``df``'s analysed plan (``rand()``, ``uuid()``,
    ``current_timestamp()``…), in plan order; empty when it is deterministic."""
    plan = df._jdf.queryExecution().analyzed()
    if plan.deterministic() and not _CLOCK_TEXT.search(plan.toString()):
        return []
    found: dict[str, None] = {}
    _walk_plan(plan, found)
    if not found and not plan.deterministic():
        found["a non-deterministic expression"] = None
    return list(found)


def _seq(seq: Any) -> list[Any]:
    return [seq.apply(i) for i in range(seq.size())]


def _walk_plan(plan: Any, found: dict[str, None]) -> None:
    for expression in _seq(plan.expressions()):
        _walk_expression(expression, found)
    for child in _seq(plan.children()):
        _walk_plan(child, found)


def _walk_expression(expression: Any, found: dict[str, None]) -> None:
    name = expression.getClass().getSimpleName()
    children = _seq(expression.children())
    if name in _CLOCKS or (
        not expression.deterministic() and all(c.deterministic() for c in children)
    ):
        found[f"{str(expression.prettyName()).lower()}()"] = None
    if any(part in name for part in _SUBQUERIES):
        with suppress(Py4JError):
            _walk_plan(expression.plan(), found)
    for child in children:
        _walk_expression(child, found)


def _first_line(exc: BaseException) -> str:
    """Spark's message without its plan dump and SQLSTATE: one line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"\s*SQLSTATE: \w+;?", "", text).rstrip(";").strip()


def _short(sql: str, limit: int = 60) -> str:
    text = " ".join(sql.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
