"""The Delta Lake log side of the Delta sink (delta-rs; no Spark here): where the table is and
how delta-rs reaches it, whose table it is, its schema, what this job committed as of which
checkpoint, and the commits themselves.

Each commit the sink makes is one Delta transaction carrying an *app transaction*
(``txn``: app id = the job, version = the checkpoint id, as Spark's ``txnAppId``/``txnVersion``
idempotent writes do) and commit metadata recording the job, the checkpoint, the last epoch the
table holds after it (``ckptEpoch``) and the operation (``create``, ``commit``, ``restore``).
So the table alone says which checkpoint its content belongs to: a restore commits exactly what
is missing, a repeated commit is a no-op, and a restore from an older checkpoint brings the
table back to that checkpoint's version (``RESTORE``, carrying that version's ``txn``).

Credentials come from boto3's environment variables (GCS's and Azure's: those of
:mod:`checkpointing.state.cloud_filesystems`) and go to delta-rs only as storage options;
they are never part of a message: delta-rs errors are re-raised with any secret value masked.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import pyarrow as pa

from checkpointing.errors import ConfigError, StorageError
from checkpointing.sinks.delta_files import DataFile, filesystem, local_path
from checkpointing.state.cloud_filesystems import SECRET_DELTA_OPTIONS, delta_options
from checkpointing.state.object_store import (
    canonical_url,
    endpoint_url,
    is_object_url,
    scheme_of,
    split_url,
)

if TYPE_CHECKING:
    from deltalake import DeltaTable

FIELD = "sink.path"
JOB_KEY, CHECKPOINT_KEY, EPOCH_KEY = "ckptJob", "ckptCheckpoint", "ckptEpoch"
OPERATION_KEY, MODE_KEY, EPOCHS_KEY = "ckptOperation", "ckptMode", "ckptEpochs"
BUCKETS_KEY = "ckptBuckets"
#: the txn version of a table state no checkpoint committed to (checkpoint ids start at 1)
NO_CHECKPOINT = 0
_SECRET_OPTIONS = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")
#: the largest Delta log JSON file read (a commit of this sink adds one file per bucket or
#: partition: kilobytes to a few MiB); a planted larger one is refused unread
MAX_LOG_FILE_BYTES = 64 << 20
#: a JSON commit file of the log: its version
_COMMIT = re.compile(r"(?P<version>[0-9]{20})\.json")


def table_url(path: str) -> str:
    """The table's URL as delta-rs takes it: ``s3://bucket/prefix`` (no trailing ``/``), or an
    absolute local path (a ``file://`` URL's path)."""
    if is_object_url(path):
        return canonical_url(path.rstrip("/"))
    return local_path(path)


def storage_options(url: str, environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """delta-rs storage options for ``url`` from boto3's environment variables (None for a
    local table). Commits are safe against concurrent writers through S3's conditional PUT
    (``conditional_put: etag``, which AWS S3, MinIO and moto support); a DynamoDB locking
    provider (``AWS_S3_LOCKING_PROVIDER``, ``DELTA_DYNAMO_TABLE_NAME``) is passed on when set."""
    if not is_object_url(url):
        return None
    env = os.environ if environ is None else environ
    if scheme_of(url) != "s3":  # GCS, Azure: their own libraries' variables
        return delta_options(scheme_of(url), split_url(url)[0], env)
    options: dict[str, str] = {}
    endpoint = endpoint_url(env)
    if endpoint:
        options["AWS_ENDPOINT_URL"] = endpoint
        if urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}").scheme == "http":
            options["AWS_ALLOW_HTTP"] = "true"
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        options["AWS_REGION"] = region
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        if env.get(name):
            options[name] = env[name]
    for name in ("AWS_S3_LOCKING_PROVIDER", "DELTA_DYNAMO_TABLE_NAME"):
        if env.get(name):
            options[name] = env[name]
    if "AWS_S3_LOCKING_PROVIDER" not in options:
        options["conditional_put"] = env.get("AWS_CONDITIONAL_PUT") or "etag"
    return options


def scrub(text: str, options: Mapping[str, str] | None) -> str:
    """``text`` with every credential value of ``options`` masked."""
    for name in (*_SECRET_OPTIONS, *SECRET_DELTA_OPTIONS):
        value = (options or {}).get(name)
        if value:
            text = text.replace(value, "***")
    return text


def _failure(url: str, what: str, exc: BaseException, options: Mapping[str, str] | None) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return scrub(f"{FIELD}: {url}: {what}: {first[:300]}", options)


# ============================================================================ the location


def top_level_entries(url: str) -> list[str] | None:
    """The names directly under the table location (None: it does not exist). On S3 a missing
    bucket, missing credentials or an unreachable endpoint is a :class:`ConfigError` naming
    ``sink.path`` and the URL."""
    if not is_object_url(url):
        path = local_path(url)
        if os.path.islink(path) and not os.path.exists(path):
            raise ConfigError(f"{FIELD}: {path} is a dangling symlink")
        if not os.path.exists(path):
            return None
        if not os.path.isdir(path):
            raise ConfigError(f"{FIELD}: {path} exists and is not a directory")
        return sorted(os.listdir(path))
    from checkpointing.state.buckets import bucket_for, store_error

    bucket, key = split_url(url)
    prefix = key.rstrip("/") + "/"
    try:
        listed = bucket_for(scheme_of(url), bucket).list(prefix, delimiter=True)
    except Exception as exc:
        error = store_error(url, bucket, exc)
        if error is exc:
            raise ConfigError(_failure(url, "cannot list the table location", exc, None)) from None
        raise ConfigError(f"{FIELD}: {error}") from None
    names = [o.key[len(prefix) :].rstrip("/") for o in listed[:100]]
    return sorted(n for n in names if n) or None


def open_table(url: str) -> DeltaTable | None:
    """The Delta table at ``url``, or None when there is none."""
    from deltalake import DeltaTable

    options = storage_options(url)
    try:
        if not DeltaTable.is_deltatable(url, storage_options=options):
            return None
        return DeltaTable(url, storage_options=options)
    except Exception as exc:
        raise StorageError(_failure(url, "cannot open the Delta table", exc, options)) from None


def check_location(url: str, job: str | None) -> DeltaTable | None:
    """Read only: may the sink of ``job`` write a Delta table at ``url``? Nothing there, an
    empty location, or a table whose every commit is this job's: yes (the table, if any).
    Refused with one line naming ``sink.path``: a non-empty location that is not a Delta table,
    a table another job or another writer committed to, an unreachable bucket."""
    entries = top_level_entries(url)
    if not entries:
        return None
    table = open_table(url) if "_delta_log" in entries else None
    if table is None:
        shown = ", ".join(entries[:3]) + (", …" if len(entries) > 3 else "")
        raise ConfigError(
            f"{FIELD}: {url} is not empty ({shown}) and is not a Delta table; use a new or "
            "empty location, the sink never writes among files it did not create"
        )
    if job is not None:
        check_owner(table, url, job)
    return table


def commits(table: DeltaTable) -> list[dict[str, Any]]:
    """The table's commit infos, newest first (each with its ``version``)."""
    return sorted(table.history(), key=lambda c: int(c.get("version", -1)), reverse=True)


def check_owner(table: DeltaTable, url: str, job: str) -> None:
    """Every commit of the table must be this sink's, for ``job``."""
    for info in commits(table):
        owner = info.get(JOB_KEY)
        if owner == job:
            continue
        version = info.get("version")
        if owner is None:
            raise ConfigError(
                f"{FIELD}: {url} is a Delta table written by another writer (version "
                f"{version}: {info.get('operation')}), not by job {job}'s sink; use a new location"
            )
        raise ConfigError(
            f"{FIELD}: {url} is the Delta table of job {owner!r} (its commits' {JOB_KEY}), not "
            f"of job {job!r}; use another table location"
        )


def check_schema(table: DeltaTable, url: str, schema: pa.Schema) -> None:
    """The table's columns must be the pipeline's output columns, with the same types."""
    from deltalake import Schema

    want = [(f.name, str(f.type)) for f in Schema.from_arrow(schema).fields]
    have = [(f.name, str(f.type)) for f in table.schema().fields]
    if want != have:
        raise ConfigError(
            f"{FIELD}: {url}: the Delta table's schema ({_columns(have)}) does not match the "
            f"pipeline's output ({_columns(want)}); use another table location"
        )


def check_partitions(table: DeltaTable, url: str, partition_by: Sequence[str]) -> None:
    """The table's partition columns are the spec's (a table keeps those it was created with)."""
    have = list(table.metadata().partition_columns)
    if have != list(partition_by):
        raise ConfigError(
            f"sink.partition_by: {url}: the Delta table is partitioned by "
            f"{have or 'nothing'}, the spec says {list(partition_by) or 'nothing'}; use another "
            "table location"
        )


def _columns(fields: Sequence[tuple[str, str]]) -> str:
    return ", ".join(f"{n} {t.removeprefix('PrimitiveType(').rstrip(')')}" for n, t in fields)


# ============================================================================ versions


@dataclass(frozen=True)
class TableState:
    """A version of the table as the sink sees it: the checkpoint whose commit made it
    (:data:`NO_CHECKPOINT`: none) and the last epoch it holds (-1: none)."""

    version: int
    checkpoint_id: int
    epoch: int


def _state(info: Mapping[str, Any]) -> TableState:
    checkpoint = info.get(CHECKPOINT_KEY)
    epoch = info.get(EPOCH_KEY)
    return TableState(
        int(info.get("version", 0)),
        int(checkpoint) if isinstance(checkpoint, int) else NO_CHECKPOINT,
        int(epoch) if isinstance(epoch, int) else -1,
    )


def current_state(table: DeltaTable) -> TableState:
    newest = commits(table)
    return _state(newest[0]) if newest else TableState(table.version(), NO_CHECKPOINT, -1)


def state_for_checkpoint(table: DeltaTable, checkpoint_id: int) -> TableState:
    """The newest version whose commit belongs to a checkpoint ``<= checkpoint_id`` (the
    table's creation at the latest): what that checkpoint had committed."""
    for info in commits(table):
        state = _state(info)
        if state.checkpoint_id <= checkpoint_id:
            return state
    return TableState(0, NO_CHECKPOINT, -1)


def table_buckets(table: DeltaTable) -> int | None:
    """The number of upsert buckets the table was created with (None: not recorded)."""
    for info in commits(table):
        if info.get(OPERATION_KEY) == "create" and isinstance(info.get(BUCKETS_KEY), int):
            return int(info[BUCKETS_KEY])
    return None


def current_files(table: DeltaTable) -> dict[str, int]:
    """The data files of the table's current version: ``{path: size}``."""
    adds = table.get_add_actions(flatten=True)
    columns = {name: adds.column(name).to_pylist() for name in ("path", "size_bytes")}
    return dict(zip(columns["path"], columns["size_bytes"], strict=True))


def referenced_files(url: str, table: DeltaTable) -> set[str]:
    """Every data file a version of the table still in its log adds (the current version's,
    and those of the JSON commits): never deleted, as time travel and RESTORE read them."""
    return set(current_files(table)) | log_adds(url)


def log_adds(url: str, after: int | None = None) -> set[str]:
    """The data files the table's JSON log files add (only commits above version ``after``,
    when given). Each file is bounded by :data:`MAX_LOG_FILE_BYTES` and parsed line by line; a
    file over the bound, not UTF-8, or with a line that is not a JSON object is
    :class:`StorageError` naming the file, rather than a ``ValueError`` or ``RecursionError``
    from deep inside a sink's recovery."""
    from pyarrow import fs

    filesystem_, root = filesystem(url)
    found: set[str] = set()
    selector = fs.FileSelector(f"{root}/_delta_log", allow_not_found=True)
    for info in filesystem_.get_file_info(selector):
        name = info.path.rsplit("/", 1)[-1]
        if info.type != fs.FileType.File or not name.endswith(".json"):
            continue
        if after is not None:
            match = _COMMIT.fullmatch(name)
            if match is None or int(match["version"]) <= after:
                continue
        where = f"{url.rstrip('/')}/_delta_log/{name}"
        if info.size is not None and info.size > MAX_LOG_FILE_BYTES:
            raise StorageError(
                f"{where}: {info.size} bytes, over the Delta log read limit of "
                f"{MAX_LOG_FILE_BYTES} bytes"
            )
        with filesystem_.open_input_stream(info.path) as stream:
            data = stream.read(MAX_LOG_FILE_BYTES + 1)
        if len(data) > MAX_LOG_FILE_BYTES:
            raise StorageError(f"{where}: over the Delta log read limit of {MAX_LOG_FILE_BYTES}")
        found |= _adds_of(data, where)
    return found


def _adds_of(data: bytes, where: str) -> set[str]:
    """The ``add`` paths of one JSON log file's lines, or one line saying what is wrong."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StorageError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    found = set()
    for number, line in enumerate(text.splitlines(), 1):
        if '"add"' not in line:
            continue
        try:
            action = json.loads(line)
        except (ValueError, RecursionError) as exc:
            reason = str(exc)[:120] if isinstance(exc, ValueError) else "nested too deeply"
            raise StorageError(f"{where}: line {number} is not a JSON action ({reason})") from None
        if not isinstance(action, dict):
            raise StorageError(f"{where}: line {number} is not a JSON object")
        add = action.get("add")
        if isinstance(add, dict) and isinstance(add.get("path"), str):
            found.add(add["path"])
    return found


# ============================================================================ writes


def create_table(
    url: str,
    job: str,
    mode: str,
    schema: pa.Schema,
    buckets: int,
    partition_by: Sequence[str] = (),
) -> DeltaTable:
    """Create the (empty) table, its first commit recording the job, the mode and the number
    of upsert buckets (which must never change for the table), partitioned by
    ``partition_by``."""
    from deltalake import DeltaTable
    from deltalake.transaction import CommitProperties

    options = storage_options(url)
    meta = {
        JOB_KEY: job,
        OPERATION_KEY: "create",
        MODE_KEY: mode,
        EPOCH_KEY: -1,
        BUCKETS_KEY: buckets,
    }
    try:
        return DeltaTable.create(
            url,
            schema,
            mode="error",
            partition_by=list(partition_by) or None,
            storage_options=options,
            commit_properties=CommitProperties(custom_metadata=meta),
        )
    except Exception as exc:
        raise StorageError(_failure(url, "cannot create the Delta table", exc, options)) from None


def commit_files(
    table: DeltaTable,
    url: str,
    *,
    job: str,
    checkpoint_id: int,
    epoch: int,
    epochs: Sequence[int],
    adds: Iterable[DataFile],
    removes: Mapping[str, int],
    schema: Any,
) -> None:
    """One transaction: remove ``removes`` (``{path: size}``), add ``adds``, with the job's
    app transaction at ``checkpoint_id`` and the table's last ``epoch`` after it. ``schema``:
    the table's (Arrow or delta-rs)."""
    from deltalake.transaction import (
        AddAction,
        CommitProperties,
        RemoveAction,
        Transaction,
    )

    now = int(time.time() * 1000)
    actions: list[Any] = [RemoveAction(p, True, now, s, {}) for p, s in sorted(removes.items())]
    actions += [
        AddAction(f.path, f.size, dict(f.partition_values), f.mtime or now, True, f.add_stats())
        for f in adds
    ]
    meta = {
        JOB_KEY: job,
        CHECKPOINT_KEY: checkpoint_id,
        EPOCH_KEY: epoch,
        OPERATION_KEY: "commit",
        EPOCHS_KEY: [min(epochs), max(epochs)] if epochs else [],
    }
    properties = CommitProperties(
        custom_metadata=meta, app_transactions=[Transaction(job, checkpoint_id)]
    )
    try:
        table.update_incremental()
        table.create_write_transaction(actions, "append", schema, commit_properties=properties)
        table.update_incremental()
    except Exception as exc:
        options = storage_options(url)
        what = f"commit of checkpoint {checkpoint_id} failed"
        raise StorageError(_failure(url, what, exc, options)) from None


def restore_table(table: DeltaTable, url: str, job: str, state: TableState) -> None:
    """``RESTORE`` the table to ``state``'s version, carrying its checkpoint as the job's
    app transaction (the log's newest ``txn`` for the job is then that checkpoint's)."""
    from deltalake.transaction import CommitProperties, Transaction

    meta = {
        JOB_KEY: job,
        CHECKPOINT_KEY: state.checkpoint_id,
        EPOCH_KEY: state.epoch,
        OPERATION_KEY: "restore",
    }
    properties = CommitProperties(
        custom_metadata=meta, app_transactions=[Transaction(job, state.checkpoint_id)]
    )
    try:
        table.restore(state.version, commit_properties=properties)
        table.update_incremental()
    except Exception as exc:
        options = storage_options(url)
        what = f"cannot restore version {state.version}"
        raise StorageError(_failure(url, what, exc, options)) from None
