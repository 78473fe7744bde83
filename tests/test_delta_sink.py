"""The Delta Lake sink (delta-rs, no Spark Delta jars), on a local table and on S3 (moto's
server on loopback, a real HTTP endpoint): executors pre-commit Parquet files that readers do not
see, each completed checkpoint is one Delta transaction whose app transaction is the checkpoint,
a crash between completion and commit is committed once on recovery, staged files beyond the
checkpoint are deleted, a restore from an older checkpoint restores the table version (and the
restore event says so), and upsert and changelog tables equal an independent computation (read
with ``deltalake``, not Spark). End to end: ``ckpt run`` with input, checkpoints and the table
on S3, SIGKILLed at a seeded random moment and resumed at another parallelism. Bad locations are
refused in one line before anything is written."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest

from checkpointing.errors import ConfigError, StorageError
from checkpointing.metastore import views
from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline.spec import SpecError
from checkpointing.sinks.delta_files import list_own_files
from tests import oracle, sink_rows
from tests.ckpt_process import ckpt_env
from tests.delta_helpers import read_table, txn_counts
from tests.sink_rows import epoch_df, epoch_rows, expected_upsert, staged_beyond_checkpoint_2
from tests.spark_pipeline import AGGS, EPOCHS, make_spec, run, write_events

JOB = "deltajob"


@pytest.fixture(params=["local", "s3"])
def table_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "table")
    bucket = request.getfixturevalue("s3_bucket")
    request.getfixturevalue("executors_see_s3")
    return f"s3://{bucket}/tables/routes"


def _sink(url: str, mode: str = "upsert", job: str = JOB) -> Any:
    from checkpointing.spark.delta_sink import DeltaSink

    return DeltaSink(url, job=job, key=["user"], mode=mode, max_parallelism=8)


def _expected_changelog(epochs: range | list[int]) -> pd.DataFrame:
    rows = [(*row, e) for e in epochs for row in epoch_rows(e)]
    frame = pd.DataFrame(rows, columns=["user", "n", "total", "epoch"])
    return frame.sort_values(["epoch", "user"]).reset_index(drop=True)


def _assert_equal(got: pd.DataFrame, want: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(got[want.columns.tolist()], want, check_dtype=False)


# ============================================================================ unit level


def test_upsert_stage_commit_crash_recover(spark: Any, table_url: str) -> None:
    sink = _sink(table_url)
    sink.stage(0, epoch_df(spark, 0))
    assert read_table(table_url, ["user"]).empty  # staged: no reader sees it
    state = sink.snapshot_state(0)
    assert [item["epoch"] for item in state] == [0] and len(json.dumps(state)) < 4096
    assert sink.commit(0, 1) == [0]
    _assert_equal(read_table(table_url, ["user"]), expected_upsert([0]))
    assert sink.commit(0, 1) == []  # repeated: a no-op
    assert sink.committed_epochs() == [0]

    checkpoint_2 = staged_beyond_checkpoint_2(sink, spark)
    assert list_own_files(table_url, JOB)  # 1 committed + 3 staged epochs of files
    _assert_equal(read_table(table_url, ["user"]), expected_upsert([0]))

    restarted = _sink(table_url)
    committed, discarded = restarted.recover(2, checkpoint_id=2, state=checkpoint_2)
    assert (committed, discarded) == ([1, 2], [3])
    assert restarted.recovery_detail() is None
    _assert_equal(read_table(table_url, ["user"]), expected_upsert(range(3)))
    epochs_on_disk = {int(re.search(r"-e(\d+)-", n)[1]) for n in list_own_files(table_url, JOB)}
    assert 3 not in epochs_on_disk  # staged beyond the checkpoint: deleted
    again = _sink(table_url)
    assert again.recover(2, checkpoint_id=2, state=checkpoint_2) == ([], [])
    again.stage(3, epoch_df(spark, 3))
    assert again.commit(3, 3) == [3]
    _assert_equal(read_table(table_url, ["user"]), expected_upsert(range(4)))
    assert txn_counts(table_url, JOB) == Counter(
        {1: 1, 2: 1, 3: 1}
    )  # each checkpoint's commit once

    # at the end: a retried task's leftover of ours is deleted, nothing else
    from checkpointing.sinks.delta_files import filesystem

    filesystem_, root = filesystem(table_url)
    leftover, foreign = (
        f"ckpt-{JOB}-e3-g1-{'0' * 32}.parquet",
        f"ckpt-other-e3-g1-{'0' * 32}.parquet",
    )
    for name in (leftover, foreign, "notes.txt"):
        with filesystem_.open_output_stream(f"{root}/{name}") as out:
            out.write(b"x")
    assert again.publish_final(epoch_df(spark, 0), "token") == again.path
    assert leftover not in list_own_files(table_url, JOB)
    for name in (foreign, "notes.txt"):
        assert filesystem_.get_file_info(f"{root}/{name}").size == 1
    _assert_equal(read_table(table_url, ["user"]), expected_upsert(range(4)))


def test_changelog_and_superseded_staged_files(spark: Any, tmp_path: Path) -> None:
    url = str(tmp_path / "changelog")
    sink = _sink(url, "changelog")
    for epoch in range(3):  # a checkpoint every third epoch: one commit for three epochs
        sink.stage(epoch, epoch_df(spark, epoch))
    assert sink.commit(2, 5) == [0, 1, 2]
    got = read_table(url, ["epoch", "user"])
    assert str(got.epoch.dtype) == "int64"
    _assert_equal(got, _expected_changelog(range(3)))
    sink.stage(3, epoch_df(spark, 3))
    state = sink.snapshot_state(3)
    restarted = _sink(url, "changelog")  # crash before checkpoint 6's commit
    assert restarted.recover(3, checkpoint_id=6, state=state) == ([3], [])
    assert restarted.recover(3, checkpoint_id=6, state=state) == ([], [])
    _assert_equal(read_table(url, ["epoch", "user"]), _expected_changelog(range(4)))
    assert txn_counts(url, JOB) == Counter({5: 1, 6: 1})

    upsert = _sink(str(tmp_path / "upsert"))  # three epochs in one commit: one file per bucket
    for epoch in range(3):
        upsert.stage(epoch, epoch_df(spark, epoch))
    upsert.commit(2, 1)
    names = list_own_files(upsert.path, JOB)
    assert len(names) == len({re.search(r"-g(\d+)-", n)[1] for n in names})  # no leftovers
    _assert_equal(read_table(upsert.path, ["user"]), expected_upsert(range(3)))


def test_restore_from_an_older_checkpoint_restores_the_table_version(
    spark: Any, tmp_path: Path
) -> None:
    url = str(tmp_path / "table")
    sink = _sink(url)
    states = {}
    for epoch in range(3):  # checkpoint epoch+1 covers epochs <= epoch, committed each time
        sink.stage(epoch, epoch_df(spark, epoch))
        states[epoch + 1] = sink.snapshot_state(epoch)
        sink.commit(epoch, epoch + 1)
    from deltalake import DeltaTable

    before = DeltaTable(url).version()
    restored = _sink(url)
    assert restored.recover(0, checkpoint_id=1, state=states[1]) == ([], [])
    detail = restored.recovery_detail()
    assert detail == {
        "table": url,
        "restored_to_version": 1,
        "from_version": before,
        "checkpoint_id": 1,
        "table_checkpoint_id": 3,
    }
    assert DeltaTable(url).transaction_version(JOB) == 1
    _assert_equal(read_table(url, ["user"]), expected_upsert([0]))
    restored.stage(1, epoch_df(spark, 3))  # the recomputed epoch 1 (other rows, to tell them apart)
    assert restored.commit(1, 4) == [1]
    _assert_equal(read_table(url, ["user"]), expected_upsert([0, 3]))
    assert restored.committed_epochs() == [0, 1]
    with pytest.raises(StorageError, match=r"^sink\.path: .* an empty start would write"):
        _sink(url).recover(None)  # (the runtime refuses it before: committed_epochs)


# ============================================================================ pipelines


@pytest.fixture(scope="module")
def events(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_events(tmp_path_factory.mktemp("events"))


def _pipeline_spec(tmp_path: Path, events: Path, sink: str, mode: str) -> Any:
    source = f'{{format: parquet, path: "{events}/*.parquet"}}'
    spec = make_spec(tmp_path, JOB, source)
    return spec.model_copy(
        update={
            "sink": spec.sink.model_copy(update={"path": sink, "format": "delta", "mode": mode})
        }
    )


@pytest.mark.parametrize("mode", ["upsert", "changelog"])
def test_pipeline_crash_and_older_restore(
    spark: Any, tmp_path: Path, events: Path, mode: str
) -> None:
    """In process: crash, then resume at another parallelism from the *older* of the two
    retained checkpoints (the table is ahead of it): the table is restored to that
    checkpoint's version (the restore event says so) and at the end equals pandas."""

    url = str(tmp_path / "table")
    spec = _pipeline_spec(tmp_path, events, url, mode)
    metastore, storage, older, newest = sink_rows.crash_after_three_epochs(
        spark, spec, tmp_path, JOB
    )
    assert txn_counts(url, JOB)[newest] == 1
    result = run(spark, spec, metastore, storage, restore=str(older), parallelism=2)
    assert result.final_path == url and result.epochs_run == list(range(2, EPOCHS))
    frames = [pd.read_parquet(p) for p in sorted(events.glob("*.parquet"))]
    _check_table(url, mode, frames)
    restores = sorted(views.list_restores(metastore, JOB), key=lambda r: r["restore_id"])
    detail = restores[-1]["assignment"]["sink"]
    assert detail["table"] == url and detail["checkpoint_id"] == older
    assert detail["table_checkpoint_id"] == newest
    assert detail["restored_to_version"] < detail["from_version"]
    counts = txn_counts(
        url, JOB
    )  # every checkpoint committed once (the newest before the restore too)
    assert set(counts.values()) == {1} and newest in counts
    metastore.dispose()


def _check_table(url: str, mode: str, frames: list[pd.DataFrame]) -> None:
    if mode == "upsert":
        want = oracle.expected_aggregates(pd.concat(frames), ["user"], AGGS)
        got = read_table(url, ["user"])
        pd.testing.assert_frame_equal(got[want.columns.tolist()], want, check_dtype=False)
        return
    got = read_table(url, ["epoch", "user"])
    assert sorted(got.epoch.unique()) == list(range(EPOCHS))
    for epoch in range(EPOCHS):
        upto = pd.concat(frames[: epoch + 1])
        touched = upto[upto.user.isin(set(frames[epoch].user))]
        want = oracle.expected_aggregates(touched, ["user"], AGGS)
        rows = got[got.epoch == epoch].reset_index(drop=True)
        pd.testing.assert_frame_equal(rows[want.columns.tolist()], want, check_dtype=False)


# ============================================================================ refusals


def _one_line(exc: BaseException, *parts: str) -> str:
    message = str(exc)
    assert "\n" not in message and message.startswith("sink.path: "), message
    for part in parts:
        assert part in message, message
    assert "testing" not in message  # never a credential
    return message


def test_refuses_a_missing_bucket_and_missing_credentials(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError) as err:
        _sink("s3://no-such-bucket-ckpt/tables/routes")
    _one_line(err.value, "s3://no-such-bucket-ckpt/tables/routes", "does not exist")
    with monkeypatch.context() as env:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            env.delenv(name, raising=False)
        env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        env.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        with pytest.raises(ConfigError) as err:
            _sink(f"s3://{s3_bucket}/tables/routes")
        _one_line(err.value, f"s3://{s3_bucket}/tables/routes", "no AWS credentials")
    import boto3

    assert "Contents" not in boto3.client("s3").list_objects_v2(Bucket=s3_bucket)


def test_refuses_foreign_tables_and_content(spark: Any, tmp_path: Path) -> None:
    from deltalake import write_deltalake

    url = str(tmp_path / "table")
    sink = _sink(url)
    sink.stage(0, epoch_df(spark, 0))
    sink.commit(0, 1)
    with pytest.raises(ConfigError) as err:  # another job's table
        _sink(url, job="other")
    _one_line(err.value, url, "job 'deltajob'", "not of job 'other'")

    # the pipeline's output does not match the table's schema: refused before a file is written
    files_before = list_own_files(url, JOB)
    other = spark.createDataFrame([("u1", 1)], "user string, n int")
    with pytest.raises(ConfigError) as err:
        _sink(url).stage(1, other)
    _one_line(err.value, url, "schema", "does not match")
    assert list_own_files(url, JOB) == files_before

    foreign = tmp_path / "foreign"  # a Delta table some other writer made
    write_deltalake(str(foreign), pa.table({"user": ["a"]}))
    with pytest.raises(ConfigError) as err:
        _sink(str(foreign))
    _one_line(err.value, str(foreign), "written by another writer")
    assert len(list(foreign.iterdir())) == 2  # its data file and its log, untouched

    plain = tmp_path / "plain"  # a non-empty folder that is no Delta table
    plain.mkdir()
    (plain / "report.csv").write_text("a,b\n")
    with pytest.raises(ConfigError) as err:
        _sink(str(plain))
    _one_line(err.value, str(plain), "not empty (report.csv)", "not a Delta table")
    assert [p.name for p in plain.iterdir()] == ["report.csv"]


def _load(tmp_path: Path, name: str, sink: str, source: str | None = None, extra: str = "") -> Any:
    from checkpointing.pipeline.spec import load_spec

    source = source or f'{{format: parquet, path: "{tmp_path}/in/*.parquet"}}'
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"job: {name}\nsource: {source}\nkey: user\naggregations: {{n: count()}}\n"
        f"sink: {sink}\n{extra}"
    )
    return load_spec(path)


@pytest.mark.parametrize(
    ("planted", "reason"),
    [
        (b'{"add": {"path": "x"}\n', r"line 1 is not a JSON action \(Expecting"),
        (
            b'{"add": ' + b"[" * 100_000 + b"\n",
            r"line 1 is not a JSON action \(nested too deeply\)",
        ),
        (b'{"add": {"path": "\xff"}}\n', r"not UTF-8 \(invalid start byte at byte 18\)"),
        (b'{"commitInfo": {}}\n["add"]\n', r"line 2 is not a JSON object"),
        (b" " * 2000, r"2000 bytes, over the Delta log read limit of 1000 bytes"),
    ],
)
def test_a_malformed_delta_log_file_is_one_line_naming_it(
    tmp_path: Path, planted: bytes, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28: each Delta log JSON file was read whole and a bad line aborted the sink's
    recovery (and the vacuum) with an uncaught ``ValueError`` / ``RecursionError`` /
    ``UnicodeDecodeError``. Now bounded, and a :class:`StorageError` naming the file."""
    from deltalake import DeltaTable, write_deltalake

    from checkpointing.coordination.sink_vacuum import _later_adds
    from checkpointing.sinks import delta_log

    url = str(tmp_path / "table")
    write_deltalake(url, pa.table({"user": ["a"], "n": [1]}))
    table = DeltaTable(url)
    assert delta_log.log_adds(url) == set(delta_log.current_files(table))  # an intact log
    monkeypatch.setattr(delta_log, "MAX_LOG_FILE_BYTES", 1000 if b"[[[" not in planted else 10**6)
    name = f"{1:020d}.json"
    (tmp_path / "table" / "_delta_log" / name).write_bytes(planted)
    where = re.escape(f"{url}/_delta_log/{name}: ")
    with pytest.raises(StorageError, match=f"^{where}{reason}"):
        delta_log.referenced_files(url, table)
    with pytest.raises(StorageError, match=f"^{where}{reason}"):
        _later_adds(url, 0)


def test_spec_refusals(tmp_path: Path) -> None:
    with pytest.raises(
        SpecError, match=r"sink\.mode: .*only a format: delta or iceberg sink has a mode"
    ):
        _load(tmp_path, "a", "{path: out, mode: upsert}")
    with pytest.raises(SpecError) as err:  # a bucket with no table prefix
        _load(tmp_path, "b", "{path: gs://bucket, format: delta}")
    assert "\n" not in str(
        err.value
    ) and "sink.path: expected gs://bucket/prefix/table (got 'gs://bucket')" in str(err.value)
    with pytest.raises(SpecError, match=r"sink\.mode"):
        _load(tmp_path, "c", "{path: x, format: delta, mode: merge}")
    spec = _load(tmp_path, "d", "{path: s3://bucket/tables/t, format: delta}")
    assert spec.sink_mode == "upsert"
    with pytest.raises(SpecError, match=r"sink\.path: s3://bucket/ckpt/t lies inside the check"):
        _load(
            tmp_path,
            "e",
            "{path: s3://bucket/ckpt/t, format: delta}",
            extra="storage: s3://bucket/ckpt",
        )
    s3_source = '{format: parquet, path: "s3://bucket/in/*.parquet"}'
    with pytest.raises(SpecError, match=r"sink\.path: s3://bucket/in is the input prefix"):
        _load(tmp_path, "f", "{path: s3://bucket/in, format: delta}", source=s3_source)
    local = _load(tmp_path, "g", "{path: out/t, format: delta, mode: changelog}")
    assert local.sink.format == "delta" and local.sink_mode == "changelog"
    with pytest.raises(SpecError, match=r"sink\.path: .* is the spec's own folder"):
        _load(tmp_path, "h", f"{{path: {tmp_path}, format: delta}}")


# ============================================================================ end to end


@pytest.mark.timeout(600)
def test_ckpt_run_on_s3_killed_at_a_random_moment_then_rescaled(
    s3_bucket: str, tmp_path: Path
) -> None:
    seed = sink_rows.chosen_seed()
    local = sink_rows.events_on_s3(tmp_path, s3_bucket)
    sink = f'{{path: "s3://{s3_bucket}/tables/routes", format: delta}}'
    spec = sink_rows.s3_spec(tmp_path, s3_bucket, JOB, sink)
    sink_rows.killed_then_resumed(spec, ckpt_env(tmp_path / "home"), seed, JOB)
    url = f"s3://{s3_bucket}/tables/routes"
    frames = [pd.read_parquet(p) for p in sorted(local.glob("*.parquet"))]
    _check_table(url, "upsert", frames)
    counts = txn_counts(url, JOB)
    assert counts and set(counts.values()) == {1}, (seed, counts)
    store = Metastore(f"sqlite:///{tmp_path / 'home' / 'metastore.db'}")
    try:
        restores = sorted(views.list_restores(store, JOB), key=lambda r: r["restore_id"])
        assert len(restores) == 2 and restores[1]["parallelism"] == 3, restores
        assert restores[1]["checkpoint_id"] in (None, *counts), restores  # one we committed
    finally:
        store.dispose()
