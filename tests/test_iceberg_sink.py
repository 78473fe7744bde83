"""The Iceberg sink (pyiceberg's SQL catalog, no Spark Iceberg jars): a local warehouse with the
default SQLite catalog, and an S3 warehouse on moto's server (a real HTTP endpoint) with a
PostgreSQL catalog. Executors pre-commit Parquet files readers do not see, each completed
checkpoint is one Iceberg snapshot whose summary carries the job and the checkpoint id, a replayed
commit is a no-op, a crash between completion and commit is committed once on recovery, staged
files beyond the checkpoint are deleted, and a restore from an older checkpoint rolls the table
back to that checkpoint's snapshot. A pipeline run crashes, resumes from the older checkpoint at
another parallelism and equals pandas. Everything is read back with pyiceberg, never through the
sink. Bad specs and foreign tables are refused in one line naming the field, nothing written."""

from __future__ import annotations

import os
import re
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest

from checkpointing.errors import ConfigError, StorageError
from checkpointing.metastore import views
from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline.spec import SpecError, load_spec
from checkpointing.sinks.delta_files import list_own_files
from tests import oracle, sink_rows
from tests.ckpt_process import ckpt_env
from tests.sink_rows import epoch_df, epoch_rows, expected_upsert, staged_beyond_checkpoint_2
from tests.spark_pipeline import AGGS, EPOCHS, make_spec, run, write_events

JOB = "icejob"


# ============================================================================ reading back


def _catalog(catalog_url: str, warehouse: str) -> Any:
    """pyiceberg's own SQL catalog over the same database (the test's reader, not the sink's)."""
    from pyiceberg.catalog.sql import SqlCatalog

    props = {}
    if warehouse.startswith("s3://"):
        props = {
            "s3.endpoint": os.environ["AWS_ENDPOINT_URL"],
            "s3.access-key-id": os.environ["AWS_ACCESS_KEY_ID"],
            "s3.secret-access-key": os.environ["AWS_SECRET_ACCESS_KEY"],
            "s3.region": "us-east-1",
        }
    return SqlCatalog("ckpt", uri=catalog_url, warehouse=warehouse, **props)


def _read(catalog_url: str, warehouse: str, name: str, sort: list[str]) -> pd.DataFrame:
    table = _catalog(catalog_url, warehouse).load_table(name)
    return table.scan().to_pandas().sort_values(sort).reset_index(drop=True)


def _commits(catalog_url: str, warehouse: str, name: str) -> Counter[int]:
    """How many snapshots of ``name`` each checkpoint committed (every snapshot in the
    metadata, rolled back ones too)."""
    table = _catalog(catalog_url, warehouse).load_table(name)
    return Counter(
        int(s.summary["ckpt.checkpoint"])
        for s in table.snapshots()
        if s.summary.get("ckpt.operation") == "commit" and s.summary.get("ckpt.job") == JOB
    )


# ============================================================================ unit level


def _expected_append(epochs: range | list[int]) -> pd.DataFrame:
    rows = [row for e in epochs for row in epoch_rows(e)]
    frame = pd.DataFrame(rows, columns=["user", "n", "total"])
    return frame.sort_values(["n", "user"]).reset_index(drop=True)


def _assert_equal(got: pd.DataFrame, want: pd.DataFrame) -> None:
    got = got[want.columns.tolist()].astype({"user": object})
    pd.testing.assert_frame_equal(got, want, check_dtype=False)


def _sink(
    warehouse: str, catalog: str | None, name: str, mode: str = "upsert", job: str = JOB
) -> Any:
    from checkpointing.spark.iceberg_sink import IcebergSink

    return IcebergSink(
        warehouse, table=name, catalog=catalog, job=job, key=["user"], mode=mode, max_parallelism=8
    )


def test_upsert_commit_replay_crash_recover_and_rollback(spark: Any, tmp_path: Path) -> None:
    """A local warehouse with its default SQLite catalog (the end-to-end test below writes an
    S3 warehouse with a PostgreSQL catalog)."""
    warehouse = str(tmp_path / "warehouse")
    catalog, name, default = f"sqlite:///{warehouse}/catalog.db", "analytics.totals", None
    sink = _sink(warehouse, default, name)
    sink.stage(0, epoch_df(spark, 0))
    assert _read(catalog, warehouse, name, ["user"]).empty  # staged: no reader sees it
    state_1 = sink.snapshot_state(0)
    assert [item["epoch"] for item in state_1] == [0]
    assert sink.commit(0, 1) == [0]
    _assert_equal(_read(catalog, warehouse, name, ["user"]), expected_upsert([0]))
    assert sink.commit(0, 1) == []  # replayed: a no-op
    assert sink.committed_epochs() == [0]

    state_2 = staged_beyond_checkpoint_2(sink, spark)
    _assert_equal(_read(catalog, warehouse, name, ["user"]), expected_upsert([0]))

    restarted = _sink(warehouse, default, name)
    assert restarted.recover(2, checkpoint_id=2, state=state_2) == ([1, 2], [3])
    assert restarted.recovery_detail() is None
    _assert_equal(_read(catalog, warehouse, name, ["user"]), expected_upsert(range(3)))
    data = restarted.data
    epochs_on_disk = {int(re.search(r"-e(\d+)-", n)[1]) for n in list_own_files(data, JOB)}
    assert 3 not in epochs_on_disk  # staged beyond the checkpoint: deleted
    again = _sink(warehouse, default, name)
    assert again.recover(2, checkpoint_id=2, state=state_2) == ([], [])  # replayed: a no-op
    again.stage(3, epoch_df(spark, 3))
    assert again.commit(3, 3) == [3]
    _assert_equal(_read(catalog, warehouse, name, ["user"]), expected_upsert(range(4)))
    assert _commits(catalog, warehouse, name) == Counter({1: 1, 2: 1, 3: 1})
    # the current snapshot's summary: the job, the checkpoint, the last epoch
    current = _catalog(catalog, warehouse).load_table(name).current_snapshot()
    assert {k: current.summary[k] for k in ("ckpt.job", "ckpt.checkpoint", "ckpt.epoch")} == {
        "ckpt.job": JOB,
        "ckpt.checkpoint": "3",
        "ckpt.epoch": "3",
    }

    # a restore from checkpoint 1: the table rolls back to its snapshot, then epoch 1 again
    older = _sink(warehouse, default, name)
    assert older.recover(0, checkpoint_id=1, state=state_1) == ([], [])
    detail = older.recovery_detail()
    assert detail is not None and detail["table"] == name and detail["checkpoint_id"] == 1
    assert detail["table_checkpoint_id"] == 3 and detail["from_snapshot"] == current.snapshot_id
    _assert_equal(_read(catalog, warehouse, name, ["user"]), expected_upsert([0]))
    older.stage(1, epoch_df(spark, 5))  # the recomputed epoch 1 (other rows, to tell them apart)
    assert older.commit(1, 4) == [1]
    _assert_equal(_read(catalog, warehouse, name, ["user"]), expected_upsert([0, 5]))
    assert older.committed_epochs() == [0, 1]
    assert _commits(catalog, warehouse, name) == Counter({1: 1, 2: 1, 3: 1, 4: 1})
    assert older.publish_final(epoch_df(spark, 0), "token") == older.path
    with pytest.raises(StorageError, match=r"^sink\.table: .* an empty start would write"):
        _sink(warehouse, default, name).recover(None)


def test_append_mode_and_a_checkpoint_over_several_epochs(spark: Any, tmp_path: Path) -> None:
    warehouse = str(tmp_path / "warehouse")
    catalog = f"sqlite:///{warehouse}/catalog.db"
    sink = _sink(warehouse, None, "raw.events", "append")
    for epoch in range(3):  # a checkpoint every third epoch: one snapshot for three epochs
        sink.stage(epoch, epoch_df(spark, epoch))
    assert sink.commit(2, 5) == [0, 1, 2]
    got = _read(catalog, warehouse, "raw.events", ["n", "user"])
    assert list(got.columns) == ["user", "n", "total"]  # the rows as they are
    _assert_equal(got, _expected_append(range(3)))
    sink.stage(3, epoch_df(spark, 3))
    state = sink.snapshot_state(3)
    restarted = _sink(warehouse, None, "raw.events", "append")  # crash before the commit
    assert restarted.recover(3, checkpoint_id=6, state=state) == ([3], [])
    assert restarted.recover(3, checkpoint_id=6, state=state) == ([], [])
    _assert_equal(
        _read(catalog, warehouse, "raw.events", ["n", "user"]), _expected_append(range(4))
    )
    assert _commits(catalog, warehouse, "raw.events") == Counter({5: 1, 6: 1})


# ============================================================================ a pipeline


@pytest.fixture(scope="module")
def events(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_events(tmp_path_factory.mktemp("events"))


def test_pipeline_crash_resume_rescaled_from_the_older_checkpoint(
    spark: Any, tmp_path: Path, events: Path
) -> None:
    """An upsert pipeline crashes after 3 epochs, resumes at another parallelism from the older
    of its two retained checkpoints (the table is ahead of it: rolled back to its snapshot, the
    restore event says so), and at the end equals pandas; every checkpoint committed once."""
    from tests.spark_pipeline import completed_ids

    warehouse = str(tmp_path / "warehouse")
    catalog = f"sqlite:///{warehouse}/catalog.db"
    spec = make_spec(tmp_path, JOB, f'{{format: parquet, path: "{events}/*.parquet"}}')
    sink = spec.sink.model_copy(
        update={"path": warehouse, "format": "iceberg", "table": "analytics.user_totals"}
    )
    spec = spec.model_copy(update={"sink": sink})
    metastore, storage, older, newest = sink_rows.crash_after_three_epochs(
        spark, spec, tmp_path, JOB
    )
    assert _commits(catalog, warehouse, "analytics.user_totals")[newest] == 1
    result = run(spark, spec, metastore, storage, restore=str(older), parallelism=2)
    location = f"{warehouse}/analytics/user_totals"
    assert result.final_path == location == spec.final_location()
    assert result.epochs_run == list(range(2, EPOCHS))

    frames = [pd.read_parquet(p) for p in sorted(events.glob("*.parquet"))]
    want = oracle.expected_aggregates(pd.concat(frames), ["user"], AGGS)
    got = _read(catalog, warehouse, "analytics.user_totals", ["user"])
    got = got[want.columns.tolist()].astype({"user": object})
    pd.testing.assert_frame_equal(got, want, check_dtype=False)

    restores = sorted(views.list_restores(metastore, JOB), key=lambda r: r["restore_id"])
    detail = restores[-1]["assignment"]["sink"]
    assert detail["table"] == "analytics.user_totals" and detail["checkpoint_id"] == older
    assert detail["table_checkpoint_id"] == newest
    counts = _commits(catalog, warehouse, "analytics.user_totals")
    assert sorted(counts) == list(range(1, max(counts) + 1))  # every checkpoint...
    assert set(counts.values()) == {1}  # ...once, the rolled back one too
    table = _catalog(catalog, warehouse).load_table("analytics.user_totals")
    assert int(table.current_snapshot().summary["ckpt.epoch"]) == EPOCHS - 1
    from pyiceberg.table.snapshots import ancestors_of

    lineage = [
        int(s.summary["ckpt.checkpoint"])
        for s in ancestors_of(table.current_snapshot(), table.metadata)
    ]  # newest first, down to the creation's empty snapshot (no checkpoint)
    assert lineage[-1] == 0 and newest not in lineage and older in lineage
    assert lineage[0] == max(counts) == completed_ids(metastore, JOB)[-1]
    metastore.dispose()


@pytest.fixture
def catalog_pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database for the Iceberg catalog's tables (not the metastore's, whose
    schema tests compare every table with the models), dropped after."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from tests.conftest import PG_URL

    admin_url = make_url(PG_URL)
    name = f"ckpt_iceberg_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield admin_url.set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def _expected_totals(frames: list[pd.DataFrame]) -> pd.DataFrame:
    return oracle.expected_aggregates(pd.concat(frames), ["user"], AGGS)


@pytest.mark.timeout(600)
def test_ckpt_run_on_s3_with_a_postgresql_catalog_killed_at_a_random_moment_then_rescaled(
    s3_bucket: str, catalog_pg_url: str, tmp_path: Path
) -> None:
    """``ckpt run`` with input, checkpoints and the warehouse on S3 and the catalog on
    PostgreSQL, SIGKILLed at a seeded random moment, resumed at another parallelism: the
    table equals pandas, and every checkpoint is committed as one snapshot, once."""
    pg_url = catalog_pg_url
    seed = sink_rows.chosen_seed()
    local = sink_rows.events_on_s3(tmp_path, s3_bucket)
    name = "analytics.totals"
    sink = f'{{format: iceberg, path: "s3://{s3_bucket}/lake", table: {name}, catalog: "{pg_url}"}}'
    spec = sink_rows.s3_spec(tmp_path, s3_bucket, JOB, sink)
    env = ckpt_env(tmp_path / "home")
    resumed = sink_rows.killed_then_resumed(spec, env, seed, JOB)
    assert f"final table {name} (Iceberg, at s3://{s3_bucket}/lake/" in resumed.stdout

    warehouse = f"s3://{s3_bucket}/lake"
    frames = [pd.read_parquet(p) for p in sorted(local.glob("*.parquet"))]
    want = _expected_totals(frames)
    got = _read(pg_url, warehouse, name, ["user"])[want.columns.tolist()]
    pd.testing.assert_frame_equal(got.astype({"user": object}), want, check_dtype=False)
    counts = _commits(pg_url, warehouse, name)
    assert counts and set(counts.values()) == {1}, (seed, counts)
    store = Metastore(f"sqlite:///{tmp_path / 'home' / 'metastore.db'}")
    try:  # every checkpoint that completed (the killed run's in-flight one did not) is a snapshot
        completed = {
            r["checkpoint_id"]
            for r in views.list_checkpoints(store, JOB)
            if r["status"] in ("COMPLETED", "SUBSUMED", "DISCARDED")
        }
        assert set(counts) == completed, (seed, counts, completed)
        restores = sorted(views.list_restores(store, JOB), key=lambda r: r["restore_id"])
        assert len(restores) == 2 and restores[1]["parallelism"] == 3, restores
        assert restores[1]["checkpoint_id"] in (None, *counts), restores
    finally:
        store.dispose()


# ============================================================================ refusals


def _load(tmp_path: Path, name: str, sink: str) -> Any:
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f'job: {name}\nsource: {{format: parquet, path: "{tmp_path}/in/*.parquet"}}\n'
        f"key: user\naggregations: {{n: count()}}\nsink: {sink}\n"
    )
    return load_spec(path)


def _one_line(exc: BaseException, field: str, *parts: str) -> str:
    message = str(exc)
    assert "\n" not in message.strip() and f"{field}: " in message, message
    for part in parts:
        assert part in message, message
    assert "s3cret" not in message and "testing" not in message  # never a credential
    return message


def test_refusals_name_the_field_and_write_nothing(spark: Any, tmp_path: Path) -> None:
    cases = {
        "{path: wh, format: iceberg}": ("sink.table", "needs its table"),
        "{path: wh, format: iceberg, table: totals}": ("sink.table", "not namespace.table"),
        "{path: wh, format: iceberg, table: a.1b}": ("sink.table", "not namespace.table"),
        "{path: wh, format: iceberg, table: a.b, mode: changelog}": ("sink.mode", "upsert or"),
        "{path: wh, format: delta, mode: append}": ("sink.mode", "upsert or changelog"),
        "{path: wh, table: a.b}": ("sink.table", "only a format: iceberg"),
        "{path: wh, mode: append}": ("sink.mode", "only a format: delta or iceberg"),
        "{path: s3://b/lake, format: iceberg, table: a.b}": ("sink.catalog", "needs a catalog"),
        "{path: wh, format: iceberg, table: a.b, changelog: false}": ("sink.changelog", "iceberg"),
        "{path: wh, format: iceberg, table: a.b, catalog: 'mysql://u:s3cret@h/d'}": (
            "sink.catalog",
            "SQLite or PostgreSQL",
        ),
    }
    for i, (sink, (field, part)) in enumerate(cases.items()):
        with pytest.raises(SpecError) as err:
            _load(tmp_path, f"s{i}", sink)
        _one_line(err.value, field, part)
    spec = _load(
        tmp_path,
        "ok",
        "{path: s3://b/lake, format: iceberg, table: a.b, mode: append, "
        "catalog: 'postgresql+psycopg://u:s3cret@h/d'}",
    )
    assert spec.sink_mode == "append"
    spec = _load(tmp_path, "ok2", "{path: wh, format: iceberg, table: a.b}")
    assert spec.final_location() == f"{tmp_path}/wh/a/b" and spec.sink_mode == "upsert"
    assert spec.catalog_url() is None  # the sink's default: catalog.db in the warehouse
    spec = _load(
        tmp_path, "ok3", "{path: wh, format: iceberg, table: a.b, catalog: sqlite:///c.db}"
    )
    assert spec.catalog_url() == f"sqlite:///{tmp_path}/c.db"  # the spec folder's, as paths
    assert not (tmp_path / "wh").exists()

    warehouse = str(tmp_path / "warehouse")
    catalog = f"sqlite:///{warehouse}/catalog.db"
    sink = _sink(warehouse, None, "analytics.totals")
    sink.stage(0, epoch_df(spark, 0))
    sink.commit(0, 1)
    files_before = list_own_files(sink.data, JOB)
    with pytest.raises(ConfigError) as err:  # another job's table: refused when opened
        _sink(warehouse, None, "analytics.totals", job="other")
    _one_line(err.value, "sink.table", "job 'icejob'", "not of job 'other'")
    other = spark.createDataFrame([("u1", 1)], "user string, n int")
    with pytest.raises(ConfigError) as err:  # the output does not match the table's schema
        _sink(warehouse, None, "analytics.totals").stage(1, other)
    _one_line(err.value, "sink.table", "schema", "does not match")
    assert list_own_files(sink.data, JOB) == files_before

    foreign = _catalog(catalog, warehouse)  # a table some other writer made, with a snapshot
    foreign.create_namespace_if_not_exists("other")
    table = foreign.create_table("other.t", pa.schema([("user", pa.string())]))
    table.append(pa.table({"user": ["a"]}))
    with pytest.raises(ConfigError) as err:
        _sink(warehouse, None, "other.t")
    _one_line(err.value, "sink.table", "another writer created")
    assert len(foreign.load_table("other.t").snapshots()) == 1

    plain = tmp_path / "warehouse" / "raw" / "files"  # a non-empty folder where the table goes
    plain.mkdir(parents=True)
    (plain / "report.csv").write_text("a,b\n")
    with pytest.raises(ConfigError) as err:
        _sink(warehouse, None, "raw.files")
    _one_line(err.value, "sink.path", "not empty (report.csv)")
    assert [p.name for p in plain.iterdir()] == ["report.csv"]
    with pytest.raises(ConfigError) as err:  # a catalog that cannot be reached: password masked
        _sink(warehouse, "postgresql+psycopg://u:s3cret@127.0.0.1:1/none", "a.b")
    _one_line(err.value, "sink.catalog", "u:***@127.0.0.1:1")
