"""Exactly-once Parquet sink on S3 (``s3://bucket/prefix``, any S3-compatible endpoint): Flink's
``TwoPhaseCommitSinkFunction`` where the local sink (:mod:`checkpointing.spark.parquet_sink`)
renames directories. The objects and their names are :mod:`checkpointing.sinks.s3_parquet`'s.

Why this design: S3 has no rename, no atomic directory and no cheap consistent "is this epoch
whole?" — but a single PUT is atomic (the object appears whole, or not at all; a PUT over an
object replaces it atomically) and listings are strongly consistent. So an epoch is committed
by *one PUT of a small manifest object* listing its objects; the data objects themselves are
copied into place first, where a crash leaves only copies no manifest names (deleted on
recovery). Readers that must never see a partial epoch follow the manifests; a reader listing
``changelog/`` may see a partial epoch during a commit's copy window (the copies of an epoch
whose manifest is not written yet, or left by a crash before it) — ``_SUCCESS`` appears in an
epoch's directory only after its manifest, so a Hadoop-style reader can skip directories
without it.

* **Pre-commit** (:meth:`S3ParquetSink.stage`): the executors write the epoch's rows as Parquet
  objects under ``_staging/epoch-<e>/<run>/`` (``mapInArrow``, Arrow's S3 filesystem: Spark
  itself has no S3 filesystem here), one per Spark partition and partition value, and return
  only ``(name, size, rows)``. The driver keeps that list; :meth:`~S3ParquetSink.snapshot_state`
  puts it in the checkpoint (bounded, checked when read back), so a recovery commits exactly
  the objects of the checkpointed staging, never those of a retried task or a later run.
* **Commit** (:meth:`~S3ParquetSink.commit`, on checkpoint completion), per epoch ascending:
  server-side copy of each listed object to ``changelog/epoch=<e>/<same name>`` (a redo
  overwrites identically), PUT ``_ckpt_commits/epoch-<e>.json`` (the commit point), PUT
  ``changelog/epoch=<e>/_SUCCESS``, then delete ``_staging/epoch-<e>/``. Idempotent: an epoch
  whose manifest exists is committed, and the first commit wins (a recomputed copy is dropped).
* **Recover** (:meth:`~S3ParquetSink.recover`): commit what the restored checkpoint's list
  state covers but has no manifest (its staged objects must all still be there), then delete
  every staged object, the copies of epochs without a manifest, and final tables the pointer
  does not name — all only under the sink's own names (see ``is_own``).
* **Final table** (keyed jobs): :meth:`~S3ParquetSink.publish_final` PUTs
  ``final-<token>/_ckpt_sink``, the executors write ``final-<token>/…``, then one PUT replaces
  the pointer ``_ckpt_final.json`` (naming the directory and its objects) and older
  ``final-*`` tables carrying the sink's marker are deleted.

Ownership as for the local sink: a ``_ckpt_sink`` marker object records the job; a prefix with
other objects and no marker, or another job's marker, is refused before anything is written.

Limits: one writer per prefix (the job's driver; the marker is claimed with a conditional
PUT, so two jobs cannot both claim an empty prefix, but nothing fences two runs of one job); a
reader that resolved the pointer to an older final table may lose its objects when a later
publish deletes it (resolve again and retry); epochs must share one schema; the driver reads
the committed rows whole in :meth:`~S3ParquetSink.read_changelog` (a test and small-table
convenience: big tables are read from the manifests' object lists, e.g. with DuckDB).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema

from checkpointing.errors import StorageError
from checkpointing.ids import validate_id
from checkpointing.sinks import s3_parquet as objects
from checkpointing.sinks.s3_parquet import (
    EPOCH,
    FIELD,
    MANIFEST_FORMAT,
    MARKER,
    MARKER_FORMAT,
    MAX_FILES_PER_EPOCH,
    POINTER,
    POINTER_FORMAT,
    STAGING,
    SUCCESS,
    WRITTEN,
    DataObject,
    SinkObjects,
    committed_dir,
    decode_schema,
    encode_schema,
    manifest_name,
    parse_committed,
    parse_final,
    parse_staged,
    partition_values,
    staged_dir,
    validate_epoch,
    write_objects,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Staged:
    """An epoch's staged objects: the run directory and what the executors wrote there."""

    epoch: int
    run: str
    schema: str
    files: tuple[DataObject, ...]

    def item(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "run": self.run,
            "schema": self.schema,
            "files": [f.item() for f in self.files],
        }

    @classmethod
    def from_item(cls, item: Any) -> Staged:
        """From the sink's list state, checked: it names objects to copy."""
        if not isinstance(item, dict):
            raise ValueError(f"sink state: {str(item)[:80]!r} is not a staged epoch")
        epoch = validate_epoch(item.get("epoch"))
        run, files = item.get("run"), item.get("files")
        if (
            not isinstance(run, str)
            or len(run) != 32
            or not all(c in "0123456789abcdef" for c in run)
        ):
            raise ValueError(f"sink state: epoch {epoch}: {str(run)[:80]!r} is not a run id")
        if not isinstance(files, list) or len(files) > MAX_FILES_PER_EPOCH:
            raise ValueError(f"sink state: epoch {epoch}: expected a list of staged objects")
        schema = item.get("schema")
        decode_schema(schema)
        return cls(epoch, run, str(schema), tuple(DataObject.from_item(f) for f in files))


class S3ParquetSink:
    """Stage per epoch, commit by manifest, publish a final table behind a pointer; see the
    module docstring."""

    def __init__(self, path: str, job: str | None = None, partition_by: Sequence[str] = ()) -> None:
        """Reads only: refuses a prefix ``job`` may not write to (foreign objects and no
        marker, another job's marker, a missing bucket, no credentials) in one line."""
        self.store = SinkObjects(path)
        self.path = self.store.url
        self.job = job
        self.partition_by = list(partition_by)
        self._claimed = False
        self._schema: pa.Schema | None = None
        #: staged, uncommitted epochs
        self._staged: dict[int, Staged] = {}
        #: a completion notification may commit from another thread than the epochs' stage
        self._lock = threading.RLock()
        if job is not None:
            self.store.check_owner(job)

    def __repr__(self) -> str:
        return f"S3ParquetSink({self.path!r})"

    # ------------------------------------------------------------------ phase one

    def stage(self, epoch: int, df: DataFrame) -> None:
        """Pre-commit: the executors write the epoch's objects under a fresh run directory;
        the driver keeps their list (an older staging of the epoch is deleted)."""
        epoch = validate_epoch(epoch)
        schema = self._schema_for(df)
        self._claim()
        run = uuid.uuid4().hex
        url, directory, parts = self.path, staged_dir(epoch, run), list(self.partition_by)

        def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            from pyspark import TaskContext

            context = TaskContext.get()
            partition = context.partitionId() if context is not None else 0
            yield from write_objects(url, directory, schema, parts, partition, batches)

        written = df.mapInArrow(write, from_arrow_schema(WRITTEN)).collect()
        files = tuple(
            sorted((DataObject(r.path, r.size, r.rows) for r in written), key=lambda f: f.path)
        )
        with self._lock:
            older = self._staged.get(epoch)
            self._staged[epoch] = Staged(epoch, run, encode_schema(schema), files)
        if older is not None:
            self._delete_staged(epoch, keep=run)

    def _schema_for(self, df: DataFrame) -> pa.Schema:
        names = [f.name for f in df.schema.fields]
        if any(n.lower() == EPOCH for n in names):
            raise ValueError(
                f"the sink adds the {EPOCH!r} partition column; the rows already have one "
                "(rename it)"
            )
        missing = [c for c in self.partition_by if c not in names]
        if missing:
            raise ValueError(f"sink.partition_by: column {missing[0]!r} is not in the output")
        schema = pa.schema([f.with_nullable(True) for f in to_arrow_schema(df.schema)])
        if self._schema is not None and schema != self._schema:
            raise StorageError(f"{FIELD}: {self.path}: epochs differ in schema ({schema})")
        self._schema = schema
        return schema

    def snapshot_state(self, up_to_epoch: int) -> list[dict[str, Any]]:
        """One item per staged, uncommitted epoch ``<= up_to_epoch``: its run and objects."""
        with self._lock:
            staged = sorted(self._staged.items())
        return [s.item() for e, s in staged if e <= up_to_epoch]

    # ------------------------------------------------------------------ phase two

    def commit(self, up_to_epoch: int, checkpoint_id: int | None = None) -> list[int]:
        """Commit every staged epoch ``<= up_to_epoch``, ascending; the epochs this call
        committed (an epoch with a manifest already is skipped, its staged copy dropped)."""
        up_to = validate_epoch(up_to_epoch, "up_to_epoch")
        with self._lock:
            pending = [s for e, s in sorted(self._staged.items()) if e <= up_to]
            committed = []
            for staged in pending:
                if self._commit_epoch(staged, checkpoint_id):
                    committed.append(staged.epoch)
                del self._staged[staged.epoch]
            return committed

    def _commit_epoch(self, staged: Staged, checkpoint_id: int | None) -> bool:
        epoch = staged.epoch
        if self.store.manifest(epoch) is not None:  # the first commit wins
            self._delete_staged(epoch)
            return False
        self._claim()
        source, dest = staged_dir(epoch, staged.run), committed_dir(epoch)
        for f in staged.files:
            self.store.copy(f"{source}/{f.path}", f"{dest}/{f.path}")
        self.store.put_json(
            manifest_name(epoch),
            {
                "format": MANIFEST_FORMAT,
                "version": 1,
                "job": self.job,
                "epoch": epoch,
                "checkpoint_id": checkpoint_id,
                "schema": staged.schema,
                "partition_by": self.partition_by,
                "files": [_listed(f"{dest}/{f.path}", f) for f in staged.files],
            },
        )
        self.store.put(f"{dest}/{SUCCESS}", b"")
        self._delete_staged(epoch)
        return True

    def _delete_staged(self, epoch: int, keep: str | None = None) -> None:
        names = [
            n
            for n in self.store.list(f"{STAGING}/epoch-{epoch}/")
            if (p := parse_staged(n)) is not None and p[0] == epoch and p[1] != keep
        ]
        self.store.delete(names)

    # ------------------------------------------------------------------ restore

    def recover(
        self,
        checkpoint_epoch: int | None,
        *,
        checkpoint_id: int | None = None,
        state: Sequence[dict[str, Any]] = (),
    ) -> tuple[list[int], list[int]]:
        """Bring the prefix in line with a restore from a checkpoint covering epochs
        ``<= checkpoint_epoch`` (None: an empty start) whose list state is ``state``; returns
        ``(epochs committed now, epochs whose staged objects were deleted)``."""
        limit = None if checkpoint_epoch is None else validate_epoch(checkpoint_epoch)
        with self._lock:
            self._staged.clear()
            if self.job is None or not self.store.check_owner(self.job):
                return [], []  # nothing of ours here yet
            self._claimed = True
            items = [Staged.from_item(i) for i in state] if limit is not None else []
            pending = [
                s for s in items if s.epoch <= limit and self.store.manifest(s.epoch) is None
            ]
            staged = self.store.list(f"{STAGING}/")
            for s in pending:
                missing = [
                    f.path
                    for f in s.files
                    if f"{staged_dir(s.epoch, s.run)}/{f.path}" not in staged
                ]
                if missing:
                    raise StorageError(
                        f"{FIELD}: {self.path}: checkpoint {checkpoint_id}'s staged objects of "
                        f"epoch {s.epoch} are gone ({', '.join(missing[:3])}); restore from a "
                        "newer checkpoint"
                    )
            committed = [s.epoch for s in pending if self._commit_epoch(s, checkpoint_id)]
            leftovers = [n for n in self.store.list(f"{STAGING}/") if parse_staged(n)]
            beyond = -1 if limit is None else limit
            discarded = sorted(
                {p[0] for n in leftovers if (p := parse_staged(n)) and p[0] > beyond}
            )
            self.store.delete(leftovers)
            self._sweep()
            return committed, discarded

    def _sweep(self) -> None:
        """Delete copies of epochs without a manifest (a commit interrupted before its manifest
        by a crash, for a checkpoint not restored), and final tables the pointer does not name."""
        done = set(self.store.committed_epochs())
        copies = [
            n
            for n in self.store.list("changelog/")
            if (p := parse_committed(n)) is not None and p[0] not in done
        ]
        self.store.delete(copies)
        pointer = self.store.get_json(POINTER, POINTER_FORMAT)
        self._delete_finals_except(None if pointer is None else pointer.get("location"))

    def reset(self) -> list[int]:
        """:meth:`checkpointing.sinks.protocol.Sink.reset`: the pointer first (readers then see
        no final table), the manifests newest first (each epoch's commit point), then what
        they listed, the staged objects and the final tables; only under a prefix this job
        claimed."""
        with self._lock:
            self._staged.clear()
            if self.job is None or not self.store.check_owner(self.job):
                return []  # nothing of ours here
            self._claimed = True
            epochs = self.store.committed_epochs()
            self.store.delete([POINTER])
            self.store.delete([manifest_name(e) for e in reversed(epochs)])
            self.store.delete([n for n in self.store.list(f"{STAGING}/") if parse_staged(n)])
            self._sweep()  # the copies of epochs without a manifest, finals no pointer names
            return epochs

    def recovery_detail(self) -> dict[str, Any] | None:
        return None

    def committed_epochs(self) -> list[int]:
        """Epochs with a manifest in ``_ckpt_commits/``, ascending."""
        return self.store.committed_epochs()

    # ------------------------------------------------------------------ the final table

    def publish_final(self, df: DataFrame, token: str) -> str:
        """Write ``df`` as ``final-<token>/`` and make the pointer name it (one PUT); older
        final tables of the sink are deleted after. Idempotent per ``token``. Returns the
        table's location (``s3://…/final-<token>``)."""
        token = validate_id(token, "final token")
        name = f"final-{token}"
        self._claim()
        pointer = self.store.get_json(POINTER, POINTER_FORMAT)
        if pointer is not None and pointer.get("location") == name:
            self._delete_finals_except(name)
            return self.store.object_url(name)
        self._delete_finals(name)  # an earlier attempt of ours that never became current
        self.store.put_json(
            f"{name}/{MARKER}",
            {"format": MARKER_FORMAT, "version": 1, "job": self.job, "token": token},
        )
        schema = pa.schema([f.with_nullable(True) for f in to_arrow_schema(df.schema)])
        url, parts = self.path, list(self.partition_by)

        def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            from pyspark import TaskContext

            context = TaskContext.get()
            partition = context.partitionId() if context is not None else 0
            yield from write_objects(url, name, schema, parts, partition, batches)

        written = df.mapInArrow(write, from_arrow_schema(WRITTEN)).collect()
        files = sorted((DataObject(r.path, r.size, r.rows) for r in written), key=lambda f: f.path)
        self.store.put_json(
            POINTER,
            {
                "format": POINTER_FORMAT,
                "version": 1,
                "job": self.job,
                "token": token,
                "location": name,
                "schema": encode_schema(schema),
                "partition_by": parts,
                "files": [_listed(f"{name}/{f.path}", f) for f in files],
            },
        )
        self._delete_finals_except(name)
        return self.store.object_url(name)

    def _delete_finals_except(self, keep: str | None) -> None:
        for entry in self.store.list(delimiter=True):
            directory = entry.rstrip("/")
            if entry.endswith("/") and directory != keep and directory.startswith("final-"):
                self._delete_finals(directory)

    def _delete_finals(self, directory: str) -> None:
        """Delete a ``final-<token>/`` table the sink published (its marker names the token)."""
        if parse_final(f"{directory}/{MARKER}") is None:
            return
        marker = self.store.get_json(f"{directory}/{MARKER}", MARKER_FORMAT)
        if marker is None or f"final-{marker.get('token')}" != directory:
            return
        names = [n for n in self.store.list(f"{directory}/") if parse_final(n) is not None]
        names.sort(key=lambda n: n.endswith(f"/{MARKER}"))  # the marker last
        self.store.delete([n for n in names if not n.endswith(f"/{MARKER}")])
        self.store.delete([n for n in names if n.endswith(f"/{MARKER}")])

    # ------------------------------------------------------------------ reading

    def read_changelog(self, spark: SparkSession) -> DataFrame:
        """Every committed epoch's rows once, with a BIGINT ``epoch`` column: exactly the
        objects the manifests list, read with Arrow on the driver (Spark has no S3 here)."""
        return spark.createDataFrame(objects.read_committed(self.path))

    def read_final(self, spark: SparkSession) -> DataFrame:
        """The current final table (the pointer's, when this is called)."""
        return spark.createDataFrame(objects.read_final(self.path))

    # ------------------------------------------------------------------ internals

    def _claim(self) -> None:
        if not self._claimed:
            if self.job is None:
                raise StorageError(f"{self!r} was opened read-only (no job)")
            self.store.claim(self.job)
            self._claimed = True


def _listed(path: str, f: DataObject) -> dict[str, Any]:
    """A manifest's or the pointer's entry of one object (path relative to the prefix)."""
    return {"path": path, "size": f.size, "rows": f.rows, "partition": partition_values(f.path)}
