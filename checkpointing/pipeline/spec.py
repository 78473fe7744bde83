"""The declarative pipeline spec (``PIPELINE.yaml``) run by ``ckpt run``.

A source → an optional transform → a keyed aggregation stage (or none: a stateless pipeline,
whose epochs' rows are appended to the sink) → a sink, with the job's checkpoint configuration. The
format is documented in ``docs/pipeline-spec.md``. Every problem is reported with the file and
the field (``routes.yaml: checkpoint.retained: …``); unknown or mistyped fields are errors, with
a suggestion when a known field is close.
"""

from __future__ import annotations

import difflib
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Any, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from checkpointing.config import (
    CheckpointConfig,
    ckpt_home,
    describe_validation_error,
    parse_duration,
)
from checkpointing.errors import ConfigError, SpecError
from checkpointing.ids import validate_id
from checkpointing.pipeline.aggregation_spec import AGGREGATE_FUNCTIONS, Aggregation
from checkpointing.pipeline.alerts_spec import AlertsSpec
from checkpointing.pipeline.columns import as_list, check_columns, is_identifier
from checkpointing.pipeline.interval import DataInterval, Scope, check_job_name
from checkpointing.pipeline.maintenance_spec import MaintenanceSpec
from checkpointing.pipeline.path_variables import as_sample, expand_path_variables, path_variables
from checkpointing.pipeline.sink_spec import EPOCH_COLUMN, SinkSpec
from checkpointing.pipeline.spec_file import read_spec_file
from checkpointing.sinks.guard import check_pipeline_sink
from checkpointing.state.keygroups import DEFAULT_MAX_PARALLELISM, UPPER_BOUND_MAX_PARALLELISM

__all__ = [
    "AGGREGATE_FUNCTIONS",
    "EPOCH_COLUMN",
    "Aggregation",
    "CheckpointSpec",
    "MaintenanceSpec",
    "PipelineSpec",
    "SinkSpec",
    "SourceFormat",
    "SourceSpec",
    "SpecError",
    "TableSpec",
    "load_spec",
]
from checkpointing.state.object_store import (
    ObjectStoreError,
    expected_form,
    is_object_url,
    split_url,
)

if TYPE_CHECKING:
    from checkpointing.pipeline.entry import PipelineCode


class SourceFormat(StrEnum):
    PARQUET = "parquet"
    CSV = "csv"
    JSON = "json"


class OnChangedInput(StrEnum):
    """What a run does with a file read earlier that has changed since (same name, another
    size, ETag or mtime)."""

    REFUSE = "refuse"  # name it and refuse the run (the default)
    IGNORE = "ignore"  # keep what was read, never read it again
    REPROCESS = "reprocess"  # read it again as new input (stateless jobs only: they append)


class SourceSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    format: SourceFormat
    #: a glob of input files, relative to the spec file's directory unless absolute or a URL
    path: str
    splits_per_epoch: int = Field(default=1, ge=1, strict=True)
    #: plan epochs by work instead: consecutive splits up to this many bytes (e.g. ``256MiB``;
    #: a bigger split is an epoch alone); not with ``splits_per_epoch``
    epoch_bytes: ByteSize | None = Field(default=None, gt=0)
    #: parquet only: split files larger than this into runs of row groups (e.g. ``128MiB``);
    #: unset, every file is one split
    max_split_bytes: ByteSize | None = Field(default=None, gt=0)
    #: CSV only: does the first line hold column names
    header: bool = True
    #: a file read by an earlier run that has changed since: refuse the run, ignore the
    #: change, or reprocess it (a stateless job only)
    on_changed_input: OnChangedInput = OnChangedInput.REFUSE
    #: Spark's ``maxFileAge``: on an incremental run, skip unread files last written more than
    #: this long before the newest file read so far, and forget read ones as old (the record
    #: of files read stays the size of that window); unset, every file is remembered
    max_file_age: timedelta | None = None

    @field_validator("max_file_age", mode="before")
    @classmethod
    def _max_file_age(cls, v: Any) -> timedelta | None:
        if v is None:
            return None
        age = parse_duration(v)
        if age <= timedelta(0):
            raise ValueError("must be positive (e.g. 30d)")
        return age

    @field_validator("path")
    @classmethod
    def _object_store_path(cls, v: str, info: ValidationInfo) -> str:
        """``s3://`` input is read by Arrow on the executors (no Hadoop S3 jars): Parquet only,
        and a bucket and key glob are needed. Local paths are not checked here."""
        return _object_input_path(v, info, "s3:// input is", "source.format")

    @field_validator("epoch_bytes", mode="before")
    @classmethod
    def _a_size(cls, v: Any) -> Any:
        """YAML's ``true`` is not one byte, and a negative number is no size to parse."""
        if isinstance(v, bool) or (isinstance(v, int | float) and v < 0):
            raise ValueError("expected a positive size, e.g. 256MiB")
        return v


def _object_input_path(v: str, info: ValidationInfo, what: str, field: str) -> str:
    """An input path on ``s3://`` needs a bucket and a key glob, and Parquet (read by Arrow on
    the executors); ``what`` and ``field`` name them in the refusal of another format."""
    if not is_object_url(v):
        return v
    try:
        split_url(v)
    except ObjectStoreError:
        raise ValueError(expected_form(v, "prefix/*.parquet")) from None
    fmt = info.data.get("format")
    if fmt is not None and fmt != SourceFormat.PARQUET:
        raise ValueError(f"{what} read as Parquet only for now; {field} is {fmt}")
    return v


class TableSpec(BaseModel):
    """A static table (``tables.<name>``): read once per attempt, joinable in ``transform``
    under its name. Its files' identity is recorded in every checkpoint, so a restore over a
    changed table is refused (its rows would differ from the epochs already processed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: SourceFormat
    #: a file, a glob, or ``s3://bucket/prefix/*.parquet``; relative to the spec file
    path: str
    #: CSV only: does the first line hold column names
    header: bool = True

    @field_validator("path")
    @classmethod
    def _object_store_path(cls, v: str, info: ValidationInfo) -> str:
        """On ``s3://``: Parquet objects read as the source's are (Arrow, no Hadoop jars)."""
        return _object_input_path(v, info, "s3:// tables are", "format")


class CheckpointSpec(BaseModel):
    """The job's checkpoint settings: those of :class:`CheckpointConfig` plus ``every_epochs``
    (checkpoint at every N-th epoch boundary, instead of or as well as a time ``interval``)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    every_epochs: int | None = Field(default=None, ge=1, strict=True)
    #: write only the state changed since the previous checkpoint, referencing the rest from
    #: earlier checkpoints (Flink's incremental checkpoints); false: every checkpoint is full
    incremental: bool = Field(default=True, strict=True)

    def config(self) -> CheckpointConfig:
        return CheckpointConfig.model_validate(self.model_extra or {})


class PipelineSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    job: str
    source: SourceSpec
    #: the keyed stage's key; none (with no aggregations): a stateless pipeline, whose epochs'
    #: rows (after the transform) are appended to the sink exactly once
    key: list[str] = []
    #: required in a spec file with a key; empty for a Python API job, whose stage is code (see
    #: :class:`checkpointing.spark.pipeline.Pipeline`)
    aggregations: dict[str, Aggregation] = {}
    #: a Spark SQL ``SELECT`` over the view ``input`` (the epoch's rows) and the ``tables``,
    #: or a Python function's entry point ``module.path:fn`` (``fn(input, tables) ->
    #: DataFrame``), run on every epoch (and again on a replayed one): it must be deterministic
    transform: str | None = None
    #: a Python pipeline: the entry point ``module.path:build`` of a function returning a
    #: :class:`checkpointing.spark.Pipeline` (or of one), which gives the job; the spec file then
    #: holds the deployment (:mod:`checkpointing.pipeline.entry`)
    pipeline: str | None = None
    #: ``.py``/``.zip``/``.egg`` files the entry points import from, relative to the spec file;
    #: the driver puts them on ``sys.path``, spark-submit ships them (``--py-files``)
    py_files: list[str] = []
    #: static inputs by name, each a view the transform may join
    tables: dict[str, TableSpec] = {}
    sink: SinkSpec
    # strict: a YAML ``true`` is not the integer 1
    parallelism: int = Field(default=2, ge=1, strict=True)
    max_parallelism: int = Field(
        default=DEFAULT_MAX_PARALLELISM, ge=1, le=UPPER_BOUND_MAX_PARALLELISM, strict=True
    )
    checkpoint: CheckpointSpec = CheckpointSpec()
    storage: str | None = None
    #: ``incremental``: each run reads what is new since the last one; ``interval``: each run
    #: reads its data interval (``${DS}`` … in the paths), as its own job instance
    scope: Scope = Scope.INCREMENTAL
    #: warm restarts (Flink's restart strategy): after a failure that leaves the Spark driver
    #: alive (a task's, an executor's), the run restores its latest checkpoint inside the same
    #: application, up to this many times, each only after the failed attempt completed a
    #: checkpoint (so it resumes past where that attempt began); 0: none
    restarts: int = Field(default=3, ge=0, le=100, strict=True)
    restart_delay: timedelta = timedelta(seconds=1)
    # Deployment as an Airflow DAG (``dags/pipelines/*.yaml``); ``ckpt run`` ignores these.
    #: a cron expression or preset (``@daily``); none: triggered by hand or by a deploy
    schedule: str | None = None
    #: automatic failover reruns, each resuming from the latest checkpoint
    retries: int = Field(default=2, ge=0, le=100, strict=True)
    retry_delay: timedelta = timedelta(seconds=30)
    #: the parallelism of retries (a rescaled restore); default: ``parallelism``
    parallelism_on_retry: int | None = Field(default=None, ge=1, strict=True)
    owner: str = "airflow"
    tags: list[str] = []
    #: ``scope: interval`` only: DAG runs (intervals) at once, and whether the scheduler
    #: creates the runs of past intervals since ``start_date`` (Airflow's ``catchup``)
    max_active_runs: int = Field(default=1, ge=1, le=64, strict=True)
    catchup: bool = Field(default=False, strict=True)
    #: scheduled garbage collection, the DAG ``<job>__maintenance``; none: no such DAG
    maintenance: MaintenanceSpec | None = None
    #: notifiers for checkpoint trouble, restores and savepoints (the pipeline DAG's task)
    alerts: AlertsSpec | None = None
    #: where the spec was loaded from (set by :func:`load_spec`, not part of the file)
    spec_path: Path | None = Field(default=None, exclude=True)
    #: what its entry points resolved to (set by :func:`load_spec`)
    _code: Any = PrivateAttr(default=None)
    #: the data interval this spec was bound to (``scope: interval``; None: not bound)
    _interval: DataInterval | None = PrivateAttr(default=None)

    @property
    def interval(self) -> DataInterval | None:
        return self._interval

    @property
    def is_template(self) -> bool:
        """A ``scope: interval`` spec not bound to an interval (its placeholders unfilled)."""
        return self.scope is Scope.INTERVAL and self._interval is None

    def check_runnable(self) -> None:
        """A ``scope: interval`` spec runs only bound to an interval: :class:`SpecError`."""
        if self.is_template:
            raise SpecError(
                f"{self.spec_path or self.job}: scope: interval: a run needs its data interval "
                "(ckpt run --interval-start START --interval-end END; the DAG passes its run's)"
            )

    @field_validator("job")
    @classmethod
    def _job_id(cls, v: str) -> str:
        return check_job_name(validate_id(v, "job"))

    @field_validator("retry_delay", "restart_delay", mode="before")
    @classmethod
    def _retry_delay(cls, v: Any) -> timedelta:
        delay = parse_duration(v)
        if delay < timedelta(0):
            raise ValueError("must not be negative")
        return delay

    @field_validator("key", mode="before")
    @classmethod
    def _key_list(cls, v: Any) -> Any:
        return as_list(v)

    @field_validator("key")
    @classmethod
    def _key_columns(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("needs at least one key column (leave key out for a stateless job)")
        return check_columns(v, "key")

    @field_validator("transform")
    @classmethod
    def _transform_text(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("is empty: give a SELECT over input, or leave it out")
        return v

    @field_validator("transform", "pipeline", "py_files")
    @classmethod
    def _entry_points(cls, v: Any, info: ValidationInfo) -> Any:
        from checkpointing.pipeline.entry import check_entry_field

        return check_entry_field(str(info.field_name), v)

    @field_validator("tables")
    @classmethod
    def _table_names(cls, v: dict[str, TableSpec]) -> dict[str, TableSpec]:
        for name in v:
            if not is_identifier(name) or name.lower() == "input":
                raise ValueError(f"{name!r} is not a table name (an identifier other than input)")
        return v

    @field_validator("aggregations", mode="before")
    @classmethod
    def _parse_aggregations(cls, v: Any) -> Any:
        if not isinstance(v, dict) or not v:
            raise ValueError("needs at least one aggregation, e.g. {flights: count()}")
        out = {}
        for name, text in v.items():
            if not is_identifier(name):
                raise ValueError(f"{name!r} is not a valid output column name")
            try:
                out[name] = text if isinstance(text, Aggregation) else Aggregation.parse(text)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        return out

    @model_validator(mode="before")
    @classmethod
    def _stateless_changelog(cls, data: Any) -> Any:
        """A job with no key publishes its epochs' rows: its parquet sink's ``changelog``
        defaults to true (a keyed job's to false: the final table only)."""
        if isinstance(data, dict) and not data.get("key"):
            sink = data.get("sink")
            if isinstance(sink, dict) and "changelog" not in sink:
                return {**data, "sink": {**sink, "changelog": True}}
            if isinstance(sink, SinkSpec) and "changelog" not in sink.model_fields_set:
                return {**data, "sink": sink.model_copy(update={"changelog": True})}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> PipelineSpec:
        for name in ("parallelism", "parallelism_on_retry"):
            value = getattr(self, name)
            if value is not None and value > self.max_parallelism:
                raise ValueError(f"{name} {value} exceeds max_parallelism {self.max_parallelism}")
        clash = set(self.key) & set(self.aggregations)
        if clash:
            raise ValueError(f"aggregation names clash with key columns: {sorted(clash)}")
        if self.aggregations and not self.key:
            raise ValueError("key: Field required (the aggregations are per key)")
        if not self.key:
            self._check_stateless_sink()
        elif self.source.on_changed_input == OnChangedInput.REPROCESS:
            raise ValueError(
                "source.on_changed_input: reprocess reads a changed file again, which only a "
                "stateless job takes exactly (it appends); use refuse or ignore for a keyed job"
            )
        elif self.aggregations and (
            outside := [
                c for c in self.sink.partition_by if c not in {*self.key, *self.aggregations}
            ]
        ):
            raise ValueError(
                f"sink.partition_by: {outside[0]!r} is not an output column "
                f"(the output: {', '.join([*self.key, *self.aggregations])})"
            )
        if self.sink.partition_by and self.sink.format == "iceberg":
            raise ValueError(
                "sink.partition_by: an Iceberg table is not partitioned yet: partition a Delta "
                "changelog table or the parquet sink"
            )
        if self.sink.partition_by and self.sink.format == "delta" and self.sink_mode == "upsert":
            raise ValueError(
                "sink.partition_by: a format: delta upsert table is not partitioned (its files "
                "are buckets of keys): partition a mode: changelog table or the parquet sink"
            )
        if self.scope is not Scope.INTERVAL and (self.max_active_runs > 1 or self.catchup):
            raise ValueError(
                "max_active_runs and catchup: only a scope: interval job's runs are independent "
                "(an incremental job's runs share its state and sink: one at a time)"
            )
        if self.scope is Scope.INTERVAL and self.sink.format == "iceberg":
            raise ValueError(
                "scope: interval: an Iceberg sink is one table for every interval; use a "
                "parquet or delta sink whose path names the interval (e.g. out/date=${DS})"
            )
        if (
            self.source.epoch_bytes is not None
            and "splits_per_epoch" in self.source.model_fields_set
        ):
            raise ValueError(
                "source.splits_per_epoch and source.epoch_bytes: give one (epochs are planned "
                "by split count or by bytes, not both)"
            )
        return self

    def _check_stateless_sink(self) -> None:
        """A stateless job appends its epochs' rows: there is no per-key table to keep."""
        if self.sink.mode == "upsert":
            raise ValueError(
                "sink.mode: upsert keeps one row per key, and the job has no key: leave mode "
                "out (a stateless job appends its rows: changelog) or give a key"
            )
        if not self.sink.changelog:
            raise ValueError(
                "sink.changelog: false publishes a final table per key, and the job has no "
                "key: a stateless job's output is its epochs' rows (leave changelog out)"
            )

    @property
    def stateless(self) -> bool:
        """No keyed stage (a spec with no key; a Python API job with no stage): the source's
        split state is the only operator state, the sink appends each epoch's rows."""
        return not self.key

    @property
    def sink_mode(self) -> str:
        """A table sink's mode: as given, else ``upsert`` for a keyed job and, for a stateless
        one, the epochs' rows appended (Delta's ``changelog``, Iceberg's ``append``)."""
        if self.sink.mode is not None:
            return self.sink.mode
        if self.key:
            return "upsert"
        return "append" if self.sink.format == "iceberg" else "changelog"

    @property
    def code(self) -> PipelineCode | None:
        """What the spec's entry points (``pipeline:``, ``transform: module:fn``) resolved to
        when :func:`load_spec` loaded it; None: it has none."""
        return self._code

    def resolve(self, path: str) -> str:
        """A path of the spec, relative to the spec file's directory."""
        if "://" in path or Path(path).is_absolute() or self.spec_path is None:
            return path
        return str((self.spec_path.parent / path).resolve())

    def catalog_url(self) -> str | None:
        """An Iceberg sink's catalog URL, a relative SQLite path resolved against the spec's
        folder (as the spec's paths are); None: the sink's default."""
        url = self.sink.catalog
        if url and url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
            return "sqlite:///" + self.resolve(url.removeprefix("sqlite:///"))
        return url

    def final_location(self) -> str:
        """Where readers find a finished job's output: the Delta table itself (which holds it,
        in upsert mode, or the changelog); the Iceberg table's location
        (``<warehouse>/<namespace>/<table>``, ``sink.table`` in ``sink.catalog``); for the Parquet
        sink, a stateless job's committed epochs (``<path>/changelog``) and a keyed job's final
        table (the ``<path>/final`` link). On S3 a reader follows objects, not a listing: a
        stateless job's epochs are the manifests' under ``<path>/_ckpt_commits/`` (returned:
        ``<path>/changelog``, where the objects are) and a keyed job's final table is the pointer
        ``<path>/_ckpt_final.json`` (returned), see :mod:`checkpointing.sinks.s3_parquet`."""
        path = self.resolve(self.sink.path)
        if self.sink.format == "delta":
            return path
        if self.sink.format == "iceberg" and self.sink.table:
            from checkpointing.sinks.iceberg_table import parse_identifier, table_location

            return table_location(path, parse_identifier(self.sink.table))
        if is_object_url(path):
            return f"{path.rstrip('/')}/" + ("changelog" if self.stateless else "_ckpt_final.json")
        # a stateless job's table is its committed epochs (Spark reads epoch=<e>/ as a column)
        return str(
            Path(path.removeprefix("file://")) / ("changelog" if self.stateless else "final")
        )


def load_spec(
    path: str | Path,
    overrides: dict[str, Any] | None = None,
    *,
    home: Path | None = None,
    interval: DataInterval | None = None,
) -> PipelineSpec:
    """Read and validate a pipeline spec; :class:`SpecError` names the file and the field.

    ``${CKPT_HOME}`` in its paths is ``home`` (default: ``CKPT_HOME``, as the metastore and the
    checkpoints find it), so that a spec's data and output can live in the same home. A
    ``scope: interval`` spec bound to ``interval`` has its placeholders (``${DS}`` …) filled and
    its job id made the interval's instance (``daily.20261125T000000``); unbound, it is a
    template (placeholders kept) that validates but does not run."""
    path = Path(path)
    raw = read_spec_file(path)
    raw = {**raw, **(overrides or {})}
    variables, keep = path_variables(raw, path, home or ckpt_home(), interval)
    try:
        raw = expand_path_variables(raw, variables, keep=keep)
    except ValueError as exc:
        raise SpecError(f"{path}: {exc}") from None
    from checkpointing.pipeline.entry import load_code, python_pipeline, resolve_py_files

    raw = resolve_py_files(raw, path)
    if "pipeline" in raw:  # the job is code: its Pipeline, with this file's deployment
        spec, code = python_pipeline(raw, path, PipelineSpec)
    else:
        try:
            spec = PipelineSpec.model_validate(raw)
        except ValidationError as exc:
            raise SpecError(_with_suggestions(describe_validation_error(exc, str(path)))) from None
        if "key" in raw and "aggregations" not in raw:  # a file has no other way to say what
            # the keyed stage does; without a key the job is stateless
            raise SpecError(
                f"{path}: aggregations: Field required (the keyed stage's; leave key out for a "
                "stateless job)"
            )
        code = load_code(spec, path)
    has_transform = spec.transform is not None or (code is not None and code.transform)
    if spec.tables and not has_transform:  # only a transform reads them
        raise SpecError(f"{path}: tables: nothing joins them: add a transform: over them")
    try:
        _check_checkpoint_fields(raw.get("checkpoint"))
        spec.checkpoint.config()
    except ValidationError as exc:
        raise SpecError(describe_validation_error(exc, str(path), prefix="checkpoint.")) from None
    except ValueError as exc:
        raise SpecError(f"{path}: {exc}") from None
    spec = spec.model_copy(update={"spec_path": path.resolve()})
    if interval is not None:
        try:
            spec = spec.model_copy(update={"job": interval.job_id(spec.job)})
        except ValueError as exc:
            raise SpecError(f"{path}: job: {exc}") from None
        spec._interval = interval
    try:  # a sink that is the input, the storage, the spec's folder, ~ or / would lose files
        check_pipeline_sink(spec if not spec.is_template else as_sample(spec))
    except ConfigError as exc:
        raise SpecError(f"{path}: {exc}") from None
    spec._code = code
    return spec


def _check_checkpoint_fields(section: Any) -> None:
    if not isinstance(section, dict):
        return
    known = set(CheckpointConfig.model_fields) | {"every_epochs", "incremental"}
    for name in section:
        if name not in known:
            hint = difflib.get_close_matches(str(name), sorted(known), n=1)
            more = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ValueError(f"checkpoint.{name}: unknown field{more}")


def _with_suggestions(message: str) -> str:
    """Add "did you mean" to unknown-field lines."""
    lines = []
    for line in message.splitlines():
        if ": unknown field" in line:
            loc = line.split(": ")[1]
            parts = loc.split(".")
            model: Any = PipelineSpec
            for p in parts[:-1]:
                if get_origin(model) is dict:  # tables.<name>: the mapping's values
                    model = get_args(model)[1]
                    continue
                field = model.model_fields.get(p) if hasattr(model, "model_fields") else None
                model = getattr(field, "annotation", None) if field else None
                if get_origin(model) in (Union, UnionType):  # an optional section (``X | None``)
                    model = next((a for a in get_args(model) if hasattr(a, "model_fields")), model)
            if model is not None and hasattr(model, "model_fields"):
                hint = difflib.get_close_matches(parts[-1], list(model.model_fields), n=1)
                if hint:
                    line = line.replace(
                        ": unknown field", f": unknown field (did you mean {hint[0]!r}?)", 1
                    )
        lines.append(line)
    return "\n".join(lines)
