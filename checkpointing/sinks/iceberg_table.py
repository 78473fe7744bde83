"""The Iceberg side of the Iceberg sink (pyiceberg's SQL catalog; no Spark here): the catalog and
where the table lives, whose table it is, its schema, which checkpoint each snapshot belongs to,
and the snapshots the sink commits and rolls back to.

The table is ``<namespace>.<name>`` in a pyiceberg SQL catalog (a SQLAlchemy URL: SQLite or
PostgreSQL; by default a SQLite file ``catalog.db`` in a local warehouse), located at
``<warehouse>/<namespace>/<name>`` (the warehouse is ``sink.path``: a local folder or
``s3://bucket/prefix``). Its data files are ``<location>/data/ckpt-<job>-e<epoch>-…parquet``
(named as the Delta sink names its files, :mod:`checkpointing.sinks.delta_files`).

Each snapshot the sink commits carries in its summary the job (``ckpt.job``), the checkpoint
whose completion committed it (``ckpt.checkpoint``), the last epoch the table holds after it
(``ckpt.epoch``) and the operation (``create``: the table's first, empty snapshot; ``commit``).
So the current snapshot alone says which checkpoint the table's content belongs to: a repeated
commit is a no-op, a restore commits exactly what is missing, and a restore from an older
checkpoint moves the table's ``main`` branch back to that checkpoint's snapshot (an Iceberg
rollback: no new snapshot, the newer ones stay in the metadata for time travel). The table's
properties record its job (``ckpt.job``), mode and number of upsert buckets.

Credentials (AWS keys from boto3's environment variables, a catalog URL's password) go to
pyiceberg only as properties and are never part of a message.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from checkpointing.errors import ConfigError, StorageError
from checkpointing.sinks.delta_files import local_path, parse_name
from checkpointing.state.object_store import endpoint_url, is_object_url

if TYPE_CHECKING:
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.manifest import DataFile as IcebergDataFile
    from pyiceberg.table import Table
    from pyiceberg.table.snapshots import Snapshot

FIELD, TABLE_FIELD, CATALOG_FIELD = "sink.path", "sink.table", "sink.catalog"
JOB_KEY, CHECKPOINT_KEY, EPOCH_KEY = "ckpt.job", "ckpt.checkpoint", "ckpt.epoch"
OPERATION_KEY, MODE_KEY, EPOCHS_KEY, BUCKETS_KEY = (
    "ckpt.operation",
    "ckpt.mode",
    "ckpt.epochs",
    "ckpt.buckets",
)
#: the checkpoint of a snapshot no checkpoint committed (the table's creation; ids start at 1)
NO_CHECKPOINT = 0
CATALOG_NAME = "ckpt"
DEFAULT_CATALOG_FILE = "catalog.db"
_PART = r"[A-Za-z_][A-Za-z0-9_]{0,127}"
IDENTIFIER = re.compile(rf"{_PART}(\.{_PART})+", re.ASCII)
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")


# ============================================================================ names and URLs


def parse_identifier(text: str) -> tuple[str, ...]:
    """``namespace.table`` (a nested namespace too: ``a.b.table``) as its parts."""
    if not isinstance(text, str) or not IDENTIFIER.fullmatch(text):
        raise ValueError(
            f"{text!r} is not namespace.table (letters, digits and _, each part starting with "
            "a letter or _)"
        )
    return tuple(text.split("."))


def warehouse_url(path: str) -> str:
    """The warehouse as pyiceberg takes it: ``s3://bucket/prefix`` or an absolute local path."""
    if is_object_url(path):
        return path.rstrip("/")
    return local_path(path)


def default_catalog(warehouse: str) -> str | None:
    """The catalog of a spec that names none: a SQLite file in a local warehouse; None on an
    object store (SQLite cannot live there: the spec must name a catalog)."""
    if is_object_url(warehouse):
        return None
    return f"sqlite:///{local_path(warehouse)}/{DEFAULT_CATALOG_FILE}"


def mask_url(url: str) -> str:
    """A catalog URL as it may be shown: its password masked."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def check_catalog_url(url: str) -> str:
    """A SQLAlchemy URL of SQLite or PostgreSQL (:class:`ValueError` otherwise, the URL masked)."""
    from sqlalchemy.engine import make_url

    try:
        backend = make_url(url).get_backend_name()
    except Exception:
        raise ValueError(f"{mask_url(url)!r} is not a SQLAlchemy URL") from None
    if backend not in ("sqlite", "postgresql"):
        raise ValueError(
            f"{mask_url(url)!r}: pyiceberg's SQL catalog here is SQLite or PostgreSQL "
            "(sqlite:///path or postgresql+psycopg://host/db)"
        )
    return url


def table_location(warehouse: str, identifier: Sequence[str]) -> str:
    return "/".join([warehouse_url(warehouse), *identifier])


def data_url(location: str) -> str:
    """Where the sink's data files live (the table's ``data/`` folder)."""
    return f"{location}/data"


def file_base(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def scrub(text: str, catalog_url: str | None = None) -> str:
    """``text`` with the AWS credentials of the environment and the catalog's password masked."""
    for name in _SECRET_ENV:
        value = os.environ.get(name)
        if value and len(value) > 3:
            text = text.replace(value, "***")
    if catalog_url:
        from sqlalchemy.engine import make_url

        try:
            password = make_url(catalog_url).password
        except Exception:
            password = None
        if password:
            text = text.replace(str(password), "***")
        text = text.replace(catalog_url, mask_url(catalog_url))
    return text


def failure(field: str, what: str, exc: BaseException, catalog_url: str | None) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return scrub(f"{field}: {what}: {first[:300]}", catalog_url)


# ============================================================================ the catalog


def io_properties(warehouse: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """pyiceberg FileIO properties: Arrow's, with boto3's environment for an S3 warehouse."""
    props = {"py-io-impl": "pyiceberg.io.pyarrow.PyArrowFileIO"}
    if not is_object_url(warehouse):
        return props
    env = os.environ if environ is None else environ
    endpoint = endpoint_url(env)
    if endpoint:
        props["s3.endpoint"] = endpoint
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        props["s3.region"] = region
    for name, prop in (
        ("AWS_ACCESS_KEY_ID", "s3.access-key-id"),
        ("AWS_SECRET_ACCESS_KEY", "s3.secret-access-key"),
        ("AWS_SESSION_TOKEN", "s3.session-token"),
    ):
        if env.get(name):
            props[prop] = env[name]
    return props


def open_catalog(catalog_url: str, warehouse: str) -> SqlCatalog:
    """pyiceberg's SQL catalog at ``catalog_url`` (its tables created when missing)."""
    try:
        from pyiceberg.catalog.sql import SqlCatalog
    except ImportError:
        raise ConfigError(
            "sink.format: iceberg needs pyiceberg: pip install "
            "'airflow-spark-checkpointing[iceberg]'"
        ) from None

    if catalog_url.startswith("sqlite:///"):
        os.makedirs(os.path.dirname(catalog_url.removeprefix("sqlite:///")) or ".", exist_ok=True)
    try:
        return SqlCatalog(
            CATALOG_NAME,
            uri=catalog_url,
            warehouse=warehouse_url(warehouse),
            **io_properties(warehouse),
        )
    except Exception as exc:
        raise ConfigError(
            failure(CATALOG_FIELD, f"cannot open {mask_url(catalog_url)}", exc, catalog_url)
        ) from None


def load_table(catalog: SqlCatalog, identifier: Sequence[str]) -> Table | None:
    from pyiceberg.exceptions import NoSuchTableError

    try:
        return catalog.load_table(tuple(identifier))
    except NoSuchTableError:
        return None


def check_owner(table: Table, name: str, job: str) -> None:
    """The table must be this sink's for ``job``: its ``ckpt.job`` property, and every
    snapshot's summary."""
    owner = table.properties.get(JOB_KEY)
    if owner is None:
        raise ConfigError(
            f"{TABLE_FIELD}: {name} is an Iceberg table another writer created (no {JOB_KEY} "
            f"property), not job {job!r}'s sink; use another table"
        )
    if owner != job:
        raise ConfigError(
            f"{TABLE_FIELD}: {name} is the Iceberg table of job {owner!r} (its {JOB_KEY}), not "
            f"of job {job!r}; use another table"
        )
    for snapshot in table.snapshots():
        writer = snapshot.summary.get(JOB_KEY) if snapshot.summary else None
        if writer != job:
            raise ConfigError(
                f"{TABLE_FIELD}: {name}: snapshot {snapshot.snapshot_id} was committed by "
                f"{'another writer' if writer is None else f'job {writer!r}'}, not by job "
                f"{job!r}'s sink; use another table"
            )


def check_schema(table: Table, name: str, schema: pa.Schema) -> None:
    """The table's columns must be the pipeline's output columns, with the same types."""
    have = [(f.name, str(f.field_type)) for f in table.schema().fields]
    want = [(f.name, str(f.field_type)) for f in iceberg_schema(schema).fields]
    if have != want:
        shown = ", ".join(f"{n} {t}" for n, t in have)
        wanted = ", ".join(f"{n} {t}" for n, t in want)
        raise ConfigError(
            f"{TABLE_FIELD}: {name}: the Iceberg table's schema ({shown}) does not match the "
            f"pipeline's output ({wanted}); use another table"
        )


def iceberg_schema(schema: pa.Schema) -> Any:
    """The Iceberg schema pyiceberg makes of an Arrow schema (fresh field ids)."""
    from pyiceberg.catalog import Catalog

    return Catalog._convert_schema_if_needed(schema)


# ============================================================================ snapshots


@dataclass(frozen=True)
class TableState:
    """A snapshot as the sink sees it: the checkpoint that committed it (:data:`NO_CHECKPOINT`:
    none) and the last epoch the table holds in it (-1: none)."""

    snapshot_id: int | None
    checkpoint_id: int
    epoch: int


def _int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def state_of(snapshot: Snapshot | None) -> TableState:
    if snapshot is None:
        return TableState(None, NO_CHECKPOINT, -1)
    summary = snapshot.summary
    return TableState(
        snapshot.snapshot_id,
        _int(summary.get(CHECKPOINT_KEY) if summary else None, NO_CHECKPOINT),
        _int(summary.get(EPOCH_KEY) if summary else None, -1),
    )


def current_state(table: Table) -> TableState:
    return state_of(table.current_snapshot())


def lineage(table: Table) -> list[Snapshot]:
    """The current snapshot and its ancestors, newest first."""
    from pyiceberg.table.snapshots import ancestors_of

    return list(ancestors_of(table.current_snapshot(), table.metadata))


def state_for_checkpoint(table: Table, checkpoint_id: int) -> TableState:
    """The newest snapshot of the current lineage committed by a checkpoint ``<=
    checkpoint_id`` (the table's creation at the latest): what that checkpoint had committed."""
    found = TableState(None, NO_CHECKPOINT, -1)
    for snapshot in lineage(table):
        found = state_of(snapshot)
        if found.checkpoint_id <= checkpoint_id:
            return found
    return found


def live_files(table: Table) -> dict[str, IcebergDataFile]:
    """The data files of the current snapshot: ``{file name: DataFile}``."""
    if table.current_snapshot() is None:
        return {}
    return {file_base(task.file.file_path): task.file for task in table.scan().plan_files()}


def referenced_files(table: Table) -> set[str]:
    """The names of the data files any snapshot in the metadata holds (time travel and a
    rollback read them: never deleted)."""
    found: set[str] = set()
    seen: set[str] = set()
    for snapshot in table.snapshots():
        for manifest in snapshot.manifests(table.io):
            if manifest.manifest_path in seen:
                continue
            seen.add(manifest.manifest_path)
            for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=False):
                found.add(file_base(entry.data_file.file_path))
    return found


def table_buckets(table: Table) -> int | None:
    return _int(table.properties.get(BUCKETS_KEY), 0) or None


# ============================================================================ writes


def _summary(job: str, checkpoint_id: int, epoch: int, operation: str) -> dict[str, str]:
    return {
        JOB_KEY: job,
        CHECKPOINT_KEY: str(checkpoint_id),
        EPOCH_KEY: str(epoch),
        OPERATION_KEY: operation,
    }


def create_table(
    catalog: SqlCatalog,
    identifier: Sequence[str],
    location: str,
    *,
    job: str,
    mode: str,
    buckets: int,
    schema: pa.Schema,
    catalog_url: str,
) -> Table:
    """Create the table (its namespace too) and its first, empty snapshot (``create``): the
    state a restore to before any checkpoint brings the table back to."""
    from pyiceberg.table import TableProperties

    name = ".".join(identifier)
    try:
        catalog.create_namespace_if_not_exists(tuple(identifier[:-1]))
        table = catalog.create_table(
            tuple(identifier),
            schema=iceberg_schema(schema),
            location=location,
            properties={JOB_KEY: job, MODE_KEY: mode, BUCKETS_KEY: str(buckets)},
        )
        with table.transaction() as txn:
            mapping = txn.table_metadata.schema().name_mapping.model_dump_json()
            txn.set_properties(**{TableProperties.DEFAULT_NAME_MAPPING: mapping})
            summary = _summary(job, NO_CHECKPOINT, -1, "create")
            with txn.update_snapshot(snapshot_properties=summary).fast_append():
                pass
        return catalog.load_table(tuple(identifier))
    except Exception as exc:
        raise StorageError(
            failure(TABLE_FIELD, f"{name}: cannot create the Iceberg table", exc, catalog_url)
        ) from None


def commit_files(
    table: Table,
    *,
    job: str,
    checkpoint_id: int,
    epoch: int,
    epochs: Sequence[int],
    adds: Iterable[str],
    removes: Iterable[str],
    catalog_url: str,
) -> Table:
    """One snapshot: the data files named ``removes`` (of the current snapshot) deleted, the
    files at ``adds`` (full paths) added, its summary carrying the checkpoint and the table's
    last ``epoch``. An overwrite when it removes files, else an append."""
    from pyiceberg.io.pyarrow import parquet_file_to_data_file

    summary = _summary(job, checkpoint_id, epoch, "commit")
    if epochs:
        summary[EPOCHS_KEY] = f"{min(epochs)}-{max(epochs)}"
    try:
        table = table.refresh()
        current = live_files(table)
        removed = [current[n] for n in sorted(set(removes)) if n in current]
        with table.transaction() as txn:
            update = txn.update_snapshot(snapshot_properties=summary)
            with update.overwrite() if removed else update.fast_append() as producer:
                for data_file in removed:
                    producer.delete_data_file(data_file)
                for path in adds:
                    producer.append_data_file(
                        parquet_file_to_data_file(table.io, txn.table_metadata, path)
                    )
        return table.refresh()
    except Exception as exc:
        what = f"{table.name()[-1]}: commit of checkpoint {checkpoint_id} failed"
        raise StorageError(failure(TABLE_FIELD, what, exc, catalog_url)) from None


def rollback(table: Table, state: TableState, catalog_url: str) -> Table:
    """Move the table's ``main`` branch back to ``state``'s snapshot (an ancestor)."""
    assert state.snapshot_id is not None
    try:
        table.manage_snapshots().rollback_to_snapshot(state.snapshot_id).commit()
        return table.refresh()
    except Exception as exc:
        what = f"cannot roll back to snapshot {state.snapshot_id}"
        raise StorageError(failure(TABLE_FIELD, what, exc, catalog_url)) from None


def own_file_epochs(names: Iterable[str], beyond: int) -> list[int]:
    """The epochs of the sink's file names that lie beyond epoch ``beyond``."""
    return sorted({p[1] for n in names if (p := parse_name(n)) and p[1] > beyond})
