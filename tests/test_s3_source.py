"""Parquet input on S3 (moto's server on loopback, a real HTTP endpoint), read by Arrow on the
executors with no Hadoop S3 jars: a job over ``s3://bucket/in/*.parquet`` — whole objects and
row-group runs of a big one — crashed and resumed at another parallelism equals a pandas
computation; a restore over a replaced object (another ETag) is refused naming it; a bad bucket,
an empty prefix, missing credentials or an unreachable endpoint are one-line errors naming
``source.path`` and the URL before anything is written."""

from __future__ import annotations

import io
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline.spec import SpecError
from checkpointing.pipeline.splits import Consumed
from checkpointing.spark.preflight import RunOptions, check_run, input_files
from checkpointing.state.object_store import list_objects
from checkpointing.state.storage import FileSystemCheckpointStorage
from tests import oracle
from tests.spark_pipeline import AGGS, assert_matches_pandas, make_spec, run, tables

ROW_GROUP = 500


def _frame(rows: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "user": [f"u{k:03d}" for k in rng.integers(0, 120, rows)],
            "amount": np.where(rng.random(rows) < 0.05, np.nan, rng.normal(50, 20, rows)),
            "quantity": rng.integers(1, 9, rows),
        }
    )


def _parquet(frame: pd.DataFrame) -> bytes:
    out = io.BytesIO()
    table = pa.Table.from_pandas(frame, preserve_index=False)
    pq.write_table(table, out, row_group_size=ROW_GROUP)
    return out.getvalue()


def _s3() -> Any:
    import boto3

    return boto3.client("s3")


def test_s3_parquet_crash_rescaled_restore_and_replaced_object(
    spark: Any, s3_bucket: str, executors_see_s3: None, tmp_path: Path
) -> None:
    from checkpointing.spark.runtime import SimulatedCrash

    # a big object (4 row groups → 2 row-group splits) and two small ones, plus keys the glob
    # must skip: another suffix, and a deeper "folder" (``*`` stays within a segment)
    frames = {"in/a.parquet": _frame(2000, 1), "in/b.parquet": _frame(500, 2)}
    frames["in/c.parquet"] = _frame(500, 3)
    for key, frame in frames.items():
        _s3().put_object(Bucket=s3_bucket, Key=key, Body=_parquet(frame))
    _s3().put_object(Bucket=s3_bucket, Key="in/notes.txt", Body=b"not input")
    _s3().put_object(Bucket=s3_bucket, Key="in/old/z.parquet", Body=_parquet(_frame(10, 9)))
    big = len(_parquet(frames["in/a.parquet"]))
    source = (
        f'{{format: parquet, path: "s3://{s3_bucket}/in/*.parquet", splits_per_epoch: 1, '
        f"max_split_bytes: {big // 2}}}"
    )
    spec = make_spec(tmp_path, "s3job", source)
    objects = input_files(spec)
    assert [o.url for o in objects] == [f"s3://{s3_bucket}/{k}" for k in sorted(frames)]

    metastore_url = f"sqlite:///{tmp_path / 'metastore.db'}"
    Metastore(metastore_url, check_schema=False).upgrade()
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=2)

    # a.parquet, which the checkpoint read, replaced (another ETag, same key): refused, naming it
    original = _parquet(frames["in/a.parquet"])
    _s3().put_object(Bucket=s3_bucket, Key="in/a.parquet", Body=_parquet(_frame(500, 4)))
    with pytest.raises(SpecError, match=f"source: s3://{s3_bucket}/in/a.parquet was read by"):
        run(spark, spec, metastore, storage, parallelism=2)
    _s3().put_object(Bucket=s3_bucket, Key="in/a.parquet", Body=original)  # same bytes, ETag

    resumed = run(spark, spec, metastore, storage, parallelism=2)
    assert resumed.epochs_total == 4  # a[0-1], a[2-3], b, c
    assert resumed.epochs_run == [2, 3]
    assert resumed.restored_from is not None
    final, changelog = tables(spark, spec)
    ordered = [frames[k] for k in sorted(frames)]
    assert_matches_pandas(final, ordered)
    # each epoch's changelog: the keys of its split, with their aggregates as of that epoch
    epoch_rows = [frames["in/a.parquet"][:1000], frames["in/a.parquet"][1000:], *ordered[1:]]
    for epoch, rows in enumerate(epoch_rows):
        seen = pd.concat(epoch_rows[: epoch + 1])
        expected = oracle.expected_aggregates(seen, ["user"], AGGS)
        expected = expected[expected.user.isin(set(rows.user))].reset_index(drop=True)
        got = changelog[changelog.epoch == epoch].reset_index(drop=True)
        pd.testing.assert_frame_equal(
            got[expected.columns.tolist()], expected, check_dtype=False, check_exact=False
        )


def _spec(tmp_path: Path, path: str, name: str = "bad") -> Any:
    return make_spec(tmp_path, name, f'{{format: parquet, path: "{path}"}}')


def _refused(tmp_path: Path, path: str) -> str:
    """The one-line refusal of a run over ``path``, before anything is written."""
    spec = _spec(tmp_path, path)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SpecError) as err:
        check_run(spec, RunOptions(), storage, None)
    message = str(err.value)
    assert "\n" not in message and message.startswith("source.path: "), message
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "bad-out").exists()
    return message


def test_three_incremental_runs_over_landing_objects_equal_one_run(
    spark: Any, s3_bucket: str, executors_see_s3: None, tmp_path: Path
) -> None:
    """A daily job over ``s3://bucket/landing/*.parquet``: each run restores the last one's
    final checkpoint (the objects it consumed: key, size, ETag) and reads only the objects that
    landed since, so three runs with new objects between them equal one run over all of them;
    the restored checkpoint's consumed objects are the earlier runs' ones. A static table on
    S3, joined in the transform, is recorded (its ETag) and unchanged across the runs."""
    from checkpointing.restore import lookup as restore

    days = [
        {"landing/d1-a.parquet": _frame(700, 11), "landing/d1-b.parquet": _frame(300, 12)},
        {"landing/d2-a.parquet": _frame(900, 13)},
        {"landing/d3-a.parquet": _frame(400, 14), "landing/d3-b.parquet": _frame(600, 15)},
    ]
    # a static table on S3 too: the transform drops the blocked users' rows
    blocked = pd.DataFrame({"user": [f"u{k:03d}" for k in range(0, 120, 7)]})
    _s3().put_object(Bucket=s3_bucket, Key="dims/blocked.parquet", Body=_parquet(blocked))
    source = f'{{format: parquet, path: "s3://{s3_bucket}/landing/*.parquet"}}'
    spec = make_spec(
        tmp_path,
        "daily",
        source,
        tables={"blocked": {"format": "parquet", "path": f"s3://{s3_bucket}/dims/blocked.parquet"}},
        transform="SELECT i.* FROM input i LEFT ANTI JOIN blocked b ON i.user = b.user",
    )
    metastore_url = f"sqlite:///{tmp_path / 'metastore.db'}"
    Metastore(metastore_url, check_schema=False).upgrade()
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    runs = []
    for day in days:
        for key, frame in day.items():
            _s3().put_object(Bucket=s3_bucket, Key=key, Body=_parquet(frame))
        check_run(spec, RunOptions(), storage, metastore)  # the preflight agrees
        runs.append(run(spark, spec, metastore, storage))
    assert [r.epochs_run for r in runs] == [[0, 1], [2], [3, 4]]
    assert [r.restored_from is None for r in runs] == [True, False, False]
    assert runs[2].restored_from == runs[1].checkpoints[-1]
    consumed = restore.find_latest_valid(metastore, storage, "daily").metadata
    assert consumed is not None
    # the last run's splits inline, the earlier runs' objects compacted into one record
    # (path, size, ETag, mtime): together every object consumed, each once
    items = [i for i in consumed.list_items("source") if i.get("processed")]
    compacted = Consumed.from_items(consumed.list_items("source")).files
    assert sorted(i["path"] for i in items) == [f"s3://{s3_bucket}/{k}" for k in sorted(days[2])]
    assert sorted(compacted) == [f"s3://{s3_bucket}/{k}" for d in days[:2] for k in sorted(d)]
    assert all(i["size"] > 0 and len(i["etag"]) == 32 for i in items)
    assert all(
        size and size > 0 and etag and len(etag) == 32 for size, etag, _ in compacted.values()
    )
    recorded = [i for i in consumed.list_items("source") if "table" in i]  # the table's object
    assert [(i["table"], i["path"]) for i in recorded] == [
        ("blocked", f"s3://{s3_bucket}/dims/blocked.parquet")
    ]
    assert len(recorded[0]["etag"]) == 32

    final, changelog = tables(spark, spec)
    everything = [frame for day in days for _, frame in sorted(day.items())]
    kept = [f[~f.user.isin(set(blocked.user))] for f in everything]
    assert_matches_pandas(final, kept)  # = one run over every object
    assert sorted(changelog.epoch.unique()) == [0, 1, 2, 3, 4]


def test_bad_bucket_and_empty_prefix_are_refused_in_one_line(
    s3_bucket: str, tmp_path: Path
) -> None:
    message = _refused(tmp_path, "s3://no-such-bucket-ckpt/in/*.parquet")
    assert "bucket 'no-such-bucket-ckpt' does not exist" in message
    message = _refused(tmp_path, f"s3://{s3_bucket}/nothing/*.parquet")
    assert message == f"source.path: 's3://{s3_bucket}/nothing/*.parquet' matches no objects"


def test_missing_credentials_and_unreachable_endpoint_are_refused(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = f"s3://{s3_bucket}/in/*.parquet"
    with monkeypatch.context() as env:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            env.delenv(name, raising=False)
        env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        env.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        assert "no AWS credentials found" in _refused(tmp_path, path)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    message = _refused(tmp_path, path)
    assert f"cannot reach the S3 endpoint http://127.0.0.1:{port}" in message


def test_spec_refuses_non_parquet_and_malformed_s3_paths(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"source.path: s3:// input is read as Parquet only"):
        make_spec(tmp_path, "csv", '{format: csv, path: "s3://b/in/*.csv"}')
    with pytest.raises(SpecError, match=r"source.path: expected s3://bucket/prefix"):
        make_spec(tmp_path, "nokey", '{format: parquet, path: "s3://b"}')


def test_listing_matches_segments_like_a_local_glob(s3_bucket: str) -> None:
    for key in ("x/1.parquet", "x/2.parquet", "x/y/3.parquet", "x/10.parquet", "xz/4.parquet"):
        _s3().put_object(Bucket=s3_bucket, Key=key, Body=b"data")
    urls = [
        o.url.removeprefix(f"s3://{s3_bucket}/")
        for o in list_objects(f"s3://{s3_bucket}/x/?.parquet")
    ]
    assert urls == ["x/1.parquet", "x/2.parquet"]
    objects = list_objects(f"s3://{s3_bucket}/x/*/*.parquet")
    assert [o.url for o in objects] == [f"s3://{s3_bucket}/x/y/3.parquet"]
    assert objects[0].size == 4 and objects[0].etag and '"' not in objects[0].etag


def test_s3a_urls_are_s3(s3_bucket: str) -> None:
    """``s3a://``, what Spark users type, names the same objects: listed, stored and sunk as
    ``s3://``."""
    from checkpointing.sinks.s3_parquet import SinkObjects
    from checkpointing.state.storage import CheckpointStorage

    _s3().put_object(Bucket=s3_bucket, Key="in/a.parquet", Body=_parquet(_frame(10, 1)))
    listed = list_objects(f"s3a://{s3_bucket}/in/*.parquet")
    assert [o.url for o in listed] == [f"s3://{s3_bucket}/in/a.parquet"]
    storage = CheckpointStorage.from_url(f"s3a://{s3_bucket}/ckpt")
    assert storage.base_url == f"s3://{s3_bucket}/ckpt"
    info = storage.write_bytes(storage.checkpoint_url("j", 1) + "/_metadata", b"{}")
    assert _s3().get_object(Bucket=s3_bucket, Key="ckpt/j/chk-1/_metadata")["Body"].read() == b"{}"
    assert info.url == f"s3://{s3_bucket}/ckpt/j/chk-1/_metadata"
    assert SinkObjects(f"s3a://{s3_bucket}/out").object_url("x") == f"s3://{s3_bucket}/out/x"
