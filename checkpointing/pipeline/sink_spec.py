"""A spec's ``sink:`` section: where and how the pipeline's output is written (a Parquet
directory or S3 prefix, a Delta table, an Iceberg table), validated field by field."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from checkpointing.pipeline.columns import as_list, check_columns
from checkpointing.state.object_store import (
    ObjectStoreError,
    expected_form,
    is_object_url,
    split_url,
)

#: the column of the epoch in a sink's changelog (the parquet sink's directories, Delta's column)
EPOCH_COLUMN = "epoch"


class SinkSpec(BaseModel):
    """``format: parquet`` (default): a local directory or an ``s3://bucket/prefix`` of
    staged/committed epochs and a final table; ``format: delta``: a Delta Lake table, local or
    ``s3://``, written ``mode: upsert`` (one row per key, the default) or ``mode: changelog``
    (each epoch's rows, with ``epoch``); ``format: iceberg``: the Iceberg table ``table:
    namespace.name`` of pyiceberg's SQL ``catalog`` (a SQLAlchemy URL; default: a SQLite file in
    a local warehouse) in the warehouse ``path`` (local or ``s3://``), written ``mode: upsert``
    (the default) or ``mode: append``.

    ``changelog: false`` (parquet's default): publish only the final table, as a plain batch job
    does; no epoch's changed rows are staged, so an aggregation's state is kept as each epoch's
    partial aggregates, written once as the checkpoints' files and merged once for the final
    table (see :mod:`checkpointing.spark.keyed_runs`). ``changelog: true`` (opt-in) also stages
    and commits each epoch's changed rows under ``changelog/``. Delta and Iceberg sinks commit
    every checkpoint's rows to their table: ``changelog`` is true for them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    format: Literal["parquet", "delta", "iceberg"] = "parquet"
    #: iceberg only (required there): ``namespace.table``
    table: str | None = Field(default=None, validate_default=True)
    #: iceberg only: the SQL catalog's SQLAlchemy URL (SQLite or PostgreSQL); None: a SQLite
    #: file ``catalog.db`` in the (local) warehouse. Not in the repr: it may hold a password
    catalog: str | None = Field(default=None, validate_default=True, repr=False)
    #: delta (upsert, changelog) and iceberg (upsert, append) only; None: ``upsert``
    mode: Literal["upsert", "changelog", "append"] | None = None
    #: parquet only: stage and commit each epoch's changed rows under ``changelog/``, for
    #: pipelines that read them (opt-in); false (the default): only the final table. Always true
    #: for delta and iceberg (they commit every checkpoint's rows)
    changelog: bool = False
    #: output columns whose values name Hive-style ``col=value/`` directories (parquet) or the
    #: table's partition columns (delta); checked against the output before anything is written
    partition_by: list[str] = []

    @model_validator(mode="before")
    @classmethod
    def _changelog_default(cls, data: Any) -> Any:
        table_format = isinstance(data, dict) and data.get("format") in ("delta", "iceberg")
        if table_format and "changelog" not in data:
            return {**data, "changelog": True}
        return data

    @field_validator("changelog")
    @classmethod
    def _changelog_for_parquet(cls, v: bool, info: ValidationInfo) -> bool:
        fmt = info.data.get("format")
        if not v and fmt in ("delta", "iceberg"):
            raise ValueError(
                f"a format: {fmt} sink commits every checkpoint's rows to its table; "
                "changelog: false is for the parquet sink (its final table only)"
            )
        return v

    @field_validator("partition_by", mode="before")
    @classmethod
    def _partition_list(cls, v: Any) -> Any:
        return as_list(v)

    @field_validator("partition_by")
    @classmethod
    def _partition_columns(cls, v: list[str]) -> list[str]:
        for name in check_columns(v, "partition"):
            if name.lower() == EPOCH_COLUMN:
                raise ValueError(f"{name!r} is the sink's own epoch column: partition by another")
        return v

    @field_validator("table")
    @classmethod
    def _table_for_iceberg(cls, v: str | None, info: ValidationInfo) -> str | None:
        from checkpointing.sinks.iceberg_table import parse_identifier

        if info.data.get("format") != "iceberg":
            if v is not None:
                raise ValueError("only a format: iceberg sink names a table")
            return v
        if v is None:
            raise ValueError("a format: iceberg sink needs its table: namespace.table")
        parse_identifier(v)
        return v

    @field_validator("catalog")
    @classmethod
    def _catalog_for_iceberg(cls, v: str | None, info: ValidationInfo) -> str | None:
        from checkpointing.sinks.iceberg_table import check_catalog_url

        if info.data.get("format") != "iceberg":
            if v is not None:
                raise ValueError("only a format: iceberg sink has a catalog")
            return v
        if v is None:
            if is_object_url(str(info.data.get("path") or "")):
                raise ValueError(
                    "an s3:// warehouse needs a catalog: a SQLAlchemy URL of SQLite or "
                    "PostgreSQL (postgresql+psycopg://host/db; the password from PGPASSWORD "
                    "or ~/.pgpass)"
                )
            return v
        return check_catalog_url(v)

    @field_validator("mode")
    @classmethod
    def _mode_for_tables(cls, v: str | None, info: ValidationInfo) -> str | None:
        fmt = info.data.get("format")
        if v is not None and fmt == "parquet":
            raise ValueError(
                "only a format: delta or iceberg sink has a mode (the parquet sink writes a "
                "changelog and a final table)"
            )
        if fmt == "delta" and v == "append":
            raise ValueError("a format: delta sink's mode is upsert or changelog")
        if fmt == "iceberg" and v == "changelog":
            raise ValueError("a format: iceberg sink's mode is upsert or append")
        return v

    @field_validator("path")
    @classmethod
    def _object_store_path(cls, v: str) -> str:
        if is_object_url(v):
            try:
                split_url(v)
            except ObjectStoreError:
                raise ValueError(expected_form(v, "prefix/table")) from None
        return v
