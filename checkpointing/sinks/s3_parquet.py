"""The objects of an exactly-once Parquet sink on an object store (S3, GCS, Azure; no Spark
here): their names, the ownership marker, the per-epoch commit manifests, the final table's
pointer, how an executor writes a Spark partition's rows as Parquet objects, and how a reader
reads exactly what was committed. The protocol (stage, commit, recover, publish) is
:mod:`checkpointing.spark.s3_parquet_sink`'s.

Layout under ``s3://bucket/prefix`` (or ``gs://``, ``abfs[s]://``; every name relative to
``prefix/``)::

    _ckpt_sink                                  marker: the prefix is this sink's (the job)
    _staging/epoch-<e>/<run>/[c=v/…]part-<p>-<uuid>.parquet   staged output of epoch e
    changelog/epoch=<e>/[c=v/…]part-<p>-<uuid>.parquet        committed copies (same names)
    changelog/epoch=<e>/_SUCCESS                written after the epoch's manifest
    _ckpt_commits/epoch-<e>.json                the epoch's manifest: THE commit point
    final-<token>/_ckpt_sink                    a final table's marker (written first)
    final-<token>/[c=v/…]part-<p>-<uuid>.parquet
    _ckpt_final.json                            pointer: the current final-<token>/, its objects

``<run>`` is a fresh 32-hex id per staging of an epoch, ``<uuid>`` one per object, ``<p>`` the
Spark partition; ``c=v/`` are Hive-style partition directories (values escaped as Hive and
Spark escape them, null and the empty string as ``__HIVE_DEFAULT_PARTITION__``; the partition
columns are not in the files). Everything the sink deletes matches one of these patterns under
a prefix that carries this job's marker; nothing else is ever deleted.
"""

from __future__ import annotations

import base64
import json
import re
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import date
from typing import Any
from urllib.parse import unquote

import pyarrow as pa

from checkpointing.errors import ConfigError, InvalidIdError, StorageError
from checkpointing.ids import validate_id
from checkpointing.state.buckets import TooBig, bucket_for, store_error
from checkpointing.state.object_store import (
    canonical_url,
    expected_form,
    filesystem_for,
    scheme_of,
    split_url,
)

FIELD = "sink.path"
MARKER = "_ckpt_sink"
MARKER_FORMAT = "ckpt-sink"
STAGING = "_staging"
CHANGELOG = "changelog"
COMMITS = "_ckpt_commits"
POINTER = "_ckpt_final.json"
SUCCESS = "_SUCCESS"
EPOCH = "epoch"
HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"
MANIFEST_FORMAT = "ckpt-parquet-epoch"
POINTER_FORMAT = "ckpt-parquet-final"

_MAX_EPOCH = 2**63 - 1
_N = r"(?:0|[1-9][0-9]{0,18})"
_HEX = r"[0-9a-f]{32}"
_DIRS = r"(?:[A-Za-z_][A-Za-z0-9_]*=[^/]*/)*"
#: an object's name relative to its directory (a run's, an epoch's, a final table's)
DATA_NAME = re.compile(rf"{_DIRS}part-[0-9]{{5,9}}-{_HEX}\.parquet", re.ASCII)
_STAGED = re.compile(rf"{STAGING}/epoch-({_N})/({_HEX})/(.+)", re.ASCII | re.DOTALL)
_COMMITTED = re.compile(rf"{CHANGELOG}/epoch=({_N})/(.+)", re.ASCII | re.DOTALL)
_MANIFEST = re.compile(rf"{COMMITS}/epoch-({_N})\.json", re.ASCII)
_FINAL = re.compile(r"(final-[A-Za-z0-9][A-Za-z0-9._-]{0,127})/(.+)", re.ASCII | re.DOTALL)
_MARKER_MAX = 4096
_DOC_MAX = 64 * 2**20
#: bounds of the sink's list state read back from a checkpoint
MAX_FILES_PER_EPOCH = 100_000
_MAX_NAME = 1024
_MAX_SCHEMA = 64 * 1024
#: Hive's and Spark's ``escapePathName``: these characters become ``%XX`` in a directory name
_ESCAPED = frozenset([chr(c) for c in range(1, 0x20)] + list("\"#%'*/:=?\\\x7f{[]^"))
#: one row per object written on an executor
WRITTEN = pa.schema([("path", pa.string()), ("size", pa.int64()), ("rows", pa.int64())])


def validate_epoch(value: object, field: str = "epoch") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_EPOCH:
        raise InvalidIdError(f"invalid {field} {value!r}: expected a non-negative integer")
    return value


# ============================================================================ files and values


@dataclass(frozen=True)
class DataObject:
    """A Parquet object written by the sink: ``path`` relative to its directory."""

    path: str
    size: int
    rows: int

    def item(self) -> list[Any]:
        return [self.path, self.size, self.rows]

    @classmethod
    def from_item(cls, item: Any) -> DataObject:
        """From the sink's list state or a manifest: checked (it names objects to copy)."""
        if not isinstance(item, list | tuple) or len(item) != 3:
            raise ValueError(f"sink state: {str(item)[:80]!r} is not [path, size, rows]")
        path, size, rows = item
        if not isinstance(path, str) or len(path) > _MAX_NAME or not DATA_NAME.fullmatch(path):
            raise ValueError(f"sink state: {str(path)[:80]!r} is not a data object of the sink")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in (size, rows)):
            raise ValueError(f"sink state: {path!r}: size and rows must be non-negative integers")
        return cls(path, size, rows)


def escape_value(value: Any) -> str:
    """A partition value as a Hive directory name part (Spark's ``escapePathName``)."""
    text = partition_text(value)
    if text is None or text == "":
        return HIVE_NULL
    return "".join(f"%{ord(c):02X}" if c in _ESCAPED else c for c in text)


def partition_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, date):
        return value.isoformat(sep=" ") if hasattr(value, "hour") else value.isoformat()
    return str(value)


def partition_values(path: str) -> dict[str, str | None]:
    """The ``col=value/`` directories of an object's relative name, unescaped."""
    values: dict[str, str | None] = {}
    for part in path.split("/")[:-1]:
        name, _, text = part.partition("=")
        values[name] = None if text == HIVE_NULL else unquote(text)
    return values


def encode_schema(schema: pa.Schema) -> str:
    return base64.b64encode(schema.serialize().to_pybytes()).decode()


def decode_schema(text: Any) -> pa.Schema:
    if not isinstance(text, str) or len(text) > _MAX_SCHEMA:
        raise ValueError("sink state: the schema is missing or too long")
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text, validate=True)))


# ============================================================================ executors


def write_objects(
    url: str,
    directory: str,
    schema: pa.Schema,
    partition_by: Sequence[str],
    partition: int,
    batches: Iterator[pa.RecordBatch],
) -> Iterator[pa.RecordBatch]:
    """On an executor: one Spark partition's rows as Parquet objects under ``url/directory/``
    (one per partition value, its ``col=value/`` directories, without those columns), each a
    fresh name; one :data:`WRITTEN` row per object (none for an empty partition)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    rows = [pa.Table.from_batches([b]) for b in batches if b.num_rows]
    if not rows:
        return
    table = pa.concat_tables(rows).select(schema.names).cast(schema)
    filesystem, root = filesystem_for(url)
    groups: list[tuple[str, pa.Table]] = []
    if not partition_by:
        groups.append(("", table))
    else:
        data = [n for n in schema.names if n not in partition_by]
        keys = table.select(list(partition_by)).group_by(list(partition_by)).aggregate([])
        for values in keys.to_pylist():
            match = None
            for column, value in values.items():
                test = (
                    pc.is_null(table[column]) if value is None else pc.equal(table[column], value)
                )
                match = test if match is None else pc.and_(match, test)
            dirs = "".join(f"{c}={escape_value(values[c])}/" for c in partition_by)
            groups.append((dirs, table.filter(pc.fill_null(match, False)).select(data)))
    for dirs, part in groups:
        name = f"{dirs}part-{partition:05d}-{uuid.uuid4().hex}.parquet"
        path = f"{root}/{directory}/{name}"
        pq.write_table(part, path, filesystem=filesystem)
        size = filesystem.get_file_info(path).size
        out = pa.table({"path": [name], "size": [int(size)], "rows": [part.num_rows]}, WRITTEN)
        yield from out.to_batches()


# ============================================================================ the bucket


class SinkObjects:
    """The sink's objects under ``scheme://bucket/prefix`` (S3 through boto3, GCS and Azure
    through gcsfs and adlfs: :mod:`checkpointing.state.buckets`), the driver's side."""

    def __init__(self, url: str) -> None:
        self.url = canonical_url(url.rstrip("/"))
        try:
            self.bucket, key = split_url(self.url)
        except ConfigError:
            raise ConfigError(f"{FIELD}: {url!r}: {expected_form(url, 'prefix/table')}") from None
        self.prefix = key.strip("/") + "/"
        try:
            self.store = bucket_for(scheme_of(self.url), self.bucket)
        except Exception as exc:
            raise self._error("cannot open", exc) from None

    def key(self, name: str) -> str:
        return self.prefix + name

    def object_url(self, name: str) -> str:
        return self.store.url(self.key(name))

    # ------------------------------------------------------------------ plain operations

    def list(self, under: str = "", *, delimiter: bool = False) -> dict[str, int]:
        """Names (relative to the prefix) and sizes of the objects under ``under``; with
        ``delimiter``: only the top level, folders as ``name/`` (size 0)."""
        try:
            listed = self.store.list(self.key(under), delimiter=delimiter)
        except Exception as exc:
            raise self._error("cannot list", exc) from None
        return {o.key[len(self.prefix) :]: o.size for o in listed}

    def get(self, name: str, limit: int = _DOC_MAX) -> bytes | None:
        """The object's bytes (None: there is none; too big: an error)."""
        try:
            return self.store.get(self.key(name), limit)
        except TooBig:
            raise StorageError(
                f"{FIELD}: {self.object_url(name)} is larger than {limit} bytes"
            ) from None
        except Exception as exc:
            raise self._error(f"cannot read {name} in", exc) from None

    def get_json(self, name: str, fmt: str, limit: int = _DOC_MAX) -> dict[str, Any] | None:
        """A JSON document of the sink (``format`` field ``fmt``); None: missing or not one."""
        data = self.get(name, limit)
        if data is None:
            return None
        try:
            doc = json.loads(data)
        except ValueError:
            return None
        return doc if isinstance(doc, dict) and doc.get("format") == fmt else None

    def put(self, name: str, data: bytes) -> None:
        """One PUT: the object appears whole or not at all, replacing an older one atomically."""
        try:
            self.store.put(self.key(name), data)
        except Exception as exc:
            raise self._error(f"cannot write {name} in", exc) from None

    def put_json(self, name: str, doc: dict[str, Any]) -> None:
        self.put(name, _json(doc))

    def put_new(self, name: str, data: bytes) -> bool:
        """A conditional PUT: False when the object exists already (see
        :meth:`~checkpointing.state.buckets.Bucket.put_new`)."""
        try:
            return self.store.put_new(self.key(name), data)
        except Exception as exc:
            raise self._error(f"cannot write {name} in", exc) from None

    def copy(self, source: str, dest: str) -> None:
        """A server-side copy, replacing ``dest``."""
        try:
            self.store.copy(self.key(source), self.key(dest))
        except Exception as exc:
            raise self._error(f"cannot copy {source} to {dest} in", exc) from None

    def delete(self, names: Iterable[str]) -> list[str]:
        """Delete the given objects, only those named as the sink names its own (a
        :class:`ValueError` for anything else: a bug, never an unknown object deleted)."""
        names = sorted(set(names))
        for name in names:
            if not is_own(name):
                raise ValueError(f"refusing to delete {name!r}: not an object the sink names")
        try:
            self.store.delete([self.key(n) for n in names])
        except StorageError as exc:
            raise StorageError(f"{FIELD}: {exc}") from None
        except Exception as exc:
            raise self._error("cannot delete objects in", exc) from None
        return names

    def _error(self, what: str, exc: BaseException) -> Exception:
        """A missing bucket, missing credentials, a denied access or an unreachable endpoint:
        :class:`ConfigError`; anything else: :class:`StorageError`; one line naming the URL."""
        if isinstance(exc, ConfigError):
            return ConfigError(f"{FIELD}: {exc}")
        error = store_error(self.url, self.bucket, exc)
        if error is exc:
            code = getattr(exc, "response", {}).get("Error", {}).get("Code")
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            return StorageError(f"{FIELD}: {self.url}: {what} the sink: {code or first}")
        return ConfigError(f"{FIELD}: {error}")

    # ------------------------------------------------------------------ ownership

    def check_owner(self, job: str | None) -> bool:
        """Read only: may ``job``'s sink write here? An empty prefix, or one marked by no job or
        by ``job``: yes (True: marked). Foreign objects and no marker, or another job's
        marker: :class:`ConfigError` in one line naming ``sink.path``."""
        marker = self.get_json(MARKER, MARKER_FORMAT, _MARKER_MAX)
        if marker is None:
            entries = sorted(self.list(delimiter=True))
            if entries:
                shown = ", ".join(entries[:3]) + (", …" if len(entries) > 3 else "")
                raise ConfigError(
                    f"{FIELD}: {self.url} is not empty ({shown}) and is not a sink prefix (no "
                    f"{MARKER} marker); use a new or empty prefix, the sink never writes among "
                    "objects it did not create"
                )
            return False
        owner = marker.get("job")
        if job is not None and owner is not None and owner != job:
            raise ConfigError(
                f"{FIELD}: {self.url} is the sink of job {owner!r} (its {MARKER} marker), not "
                f"of job {job!r}; use another sink path"
            )
        return True

    def claim(self, job: str | None) -> None:
        """Mark the prefix as ``job``'s before the first write (idempotent). The marker is a
        conditional PUT: of two jobs claiming an empty prefix at once, one wins and the other
        is refused here."""
        if self.check_owner(job):
            return
        self.put_new(MARKER, _json({"format": MARKER_FORMAT, "version": 1, "job": job}))
        self.check_owner(job)

    # ------------------------------------------------------------------ commits

    def manifest(self, epoch: int) -> dict[str, Any] | None:
        return self.get_json(manifest_name(epoch), MANIFEST_FORMAT)

    def committed_epochs(self) -> list[int]:
        """Epochs whose manifest exists, ascending."""
        return sorted(
            int(m[1])
            for name in self.list(f"{COMMITS}/")
            if (m := _MANIFEST.fullmatch(name)) and int(m[1]) <= _MAX_EPOCH
        )


def _json(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, allow_nan=False).encode()


def manifest_name(epoch: int) -> str:
    return f"{COMMITS}/epoch-{validate_epoch(epoch)}.json"


def staged_dir(epoch: int, run: str) -> str:
    return f"{STAGING}/epoch-{validate_epoch(epoch)}/{run}"


def committed_dir(epoch: int) -> str:
    return f"{CHANGELOG}/{EPOCH}={validate_epoch(epoch)}"


def parse_staged(name: str) -> tuple[int, str, str] | None:
    """``(epoch, run, object name)`` of a staged object of the sink; None otherwise."""
    m = _STAGED.fullmatch(name)
    if m is None or int(m[1]) > _MAX_EPOCH or not DATA_NAME.fullmatch(m[3]):
        return None
    return int(m[1]), m[2], m[3]


def parse_committed(name: str) -> tuple[int, str] | None:
    """``(epoch, object name)`` of a committed copy or ``_SUCCESS``; None otherwise."""
    m = _COMMITTED.fullmatch(name)
    if m is None or int(m[1]) > _MAX_EPOCH:
        return None
    if m[2] != SUCCESS and not DATA_NAME.fullmatch(m[2]):
        return None
    return int(m[1]), m[2]


def parse_final(name: str) -> tuple[str, str] | None:
    """``(final-<token>, object name)`` of a final table's object or marker; None otherwise."""
    m = _FINAL.fullmatch(name)
    if m is None or (m[2] != MARKER and not DATA_NAME.fullmatch(m[2])):
        return None
    try:
        validate_id(m[1].removeprefix("final-"), "final token")
    except InvalidIdError:
        return None
    return m[1], m[2]


def is_own(name: str) -> bool:
    """Whether ``name`` (relative to the prefix) is one the sink generates and may delete."""
    return (
        parse_staged(name) is not None
        or parse_committed(name) is not None
        or parse_final(name) is not None
        or _MANIFEST.fullmatch(name) is not None
        or name == POINTER  # removed by a full refresh only
    )


# ============================================================================ readers


def committed_manifests(url: str) -> list[dict[str, Any]]:
    """Every committed epoch's manifest, ascending by epoch (what an exact reader follows)."""
    objects = SinkObjects(url)
    found = []
    for epoch in objects.committed_epochs():
        doc = objects.manifest(epoch)
        if doc is not None and doc.get("epoch") == epoch:
            found.append(doc)
    return found


def committed_object_urls(url: str) -> list[str]:
    """The committed Parquet objects' URLs, as the manifests list them (e.g. for DuckDB's
    ``read_parquet([...], hive_partitioning = true)``)."""
    objects = SinkObjects(url)
    return [objects.object_url(f["path"]) for m in committed_manifests(url) for f in m["files"]]


def read_committed(url: str) -> pa.Table:
    """Every committed epoch's rows once, with a BIGINT ``epoch`` column, read with Arrow from
    exactly the objects the manifests list (never a partial epoch)."""
    manifests = committed_manifests(url)
    if not manifests:
        raise StorageError(f"{FIELD}: {url}: no committed epochs (no {COMMITS}/ manifests)")
    tables = [_read_listed(url, m, m["epoch"]) for m in manifests]
    return pa.concat_tables(tables, promote_options="permissive")


def read_pointer(url: str) -> dict[str, Any] | None:
    """The final table's pointer (None: none published yet)."""
    return SinkObjects(url).get_json(POINTER, POINTER_FORMAT)


def read_final(url: str) -> pa.Table:
    """The current final table (the one the pointer names when read), with Arrow."""
    pointer = read_pointer(url)
    if pointer is None:
        raise StorageError(f"{FIELD}: {url}: no final table published (no {POINTER})")
    return _read_listed(url, pointer, None)


def _read_listed(url: str, doc: dict[str, Any], epoch: int | None) -> pa.Table:
    import pyarrow.parquet as pq

    schema = decode_schema(doc.get("schema"))
    partition_by = [str(c) for c in doc.get("partition_by", [])]
    filesystem, root = filesystem_for(url)
    tables = []
    for item in doc.get("files", []):
        table = pq.read_table(f"{root}/{item['path']}", filesystem=filesystem)
        values = item.get("partition", {})
        for column in partition_by:
            raw = pa.array([values.get(column)] * table.num_rows, pa.string())
            table = table.append_column(column, raw.cast(schema.field(column).type))
        tables.append(table.select(schema.names).cast(schema))
    table = pa.concat_tables(tables) if tables else schema.empty_table()
    if epoch is not None:
        table = table.append_column(EPOCH, pa.array([epoch] * table.num_rows, pa.int64()))
    return table
