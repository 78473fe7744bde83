"""Savepoints of a step job (issue 39): requested from outside the running job as the UI, the
API (``savepoints.request_savepoint``, what the API's action calls) and ``ckpt savepoint`` do,
taken at the next step boundary, self-contained (the steps' files copied into the savepoint's
own directory), left alone by retention and ``ckpt gc``, restorable by path
(``checkpointed(restore=path)``, ``ckpt run script.py --restore path``) with its steps reused,
refused for another job in one line before anything is written; a stop-with-savepoint ends
the run FINISHED. Real Spark (the shared session), SQLite metastore, local storage; the
oracle is pandas over the input files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pyarrow.dataset as ds
import pytest
from pyspark.sql import functions as F
from typer.testing import CliRunner

from checkpointing.cli import app
from checkpointing.coordination import savepoints
from checkpointing.errors import ConfigError
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint, CheckpointRequest, Job
from checkpointing.spark import step_savepoints
from checkpointing.spark.steps import CheckpointedJob, checkpointed
from checkpointing.state.storage import FileSystemCheckpointStorage

JOB = "daily_sp"

SCRIPT = """
import json, sys
from pyspark.sql import SparkSession
from checkpointing.spark.steps import checkpointed
from tests.test_step_savepoints import daily_job

orders, customers, out = sys.argv[1:4]
spark = SparkSession.builder.getOrCreate()
with checkpointed(spark, job="daily_sp") as ck:
    daily_job(ck, spark, orders, customers, out)
stats = {"reused": ck.stats.reused, "computed": ck.stats.computed,
         "restored_from": ck.stats.restored_from}
json.dump(stats, open(out + ".stats.json", "w"))
"""


def write_inputs(root: Path) -> tuple[Path, Path]:
    orders, customers = root / "orders", root / "customers"
    orders.mkdir(parents=True)
    customers.mkdir(parents=True)
    for f in range(2):
        ids = range(f * 500, (f + 1) * 500)
        pd.DataFrame(
            {
                "oid": list(ids),
                "cid": [i % 17 for i in ids],
                "day": [i % 5 for i in ids],
                "amount": [float((i * 31) % 97) for i in ids],
            }
        ).to_parquet(orders / f"part-{f}.parquet")
    pd.DataFrame({"cid": range(17), "region": [f"r{i % 3}" for i in range(17)]}).to_parquet(
        customers / "c.parquet"
    )
    return orders, customers


def daily_job(ck: CheckpointedJob, spark, orders, customers, out, before=None) -> None:  # type: ignore[no-untyped-def]
    """The job as a user writes it: a join, an aggregate, a publish (``before``: what the
    test does once the job runs, before its first step)."""
    if before is not None:
        before()
    o, c = spark.read.parquet(str(orders)), spark.read.parquet(str(customers))
    enriched = ck.step("enriched", lambda: o.join(c, "cid"))
    daily = ck.step(
        "daily",
        lambda: enriched.groupBy("day", "region").agg(
            F.sum("amount").alias("rev"), F.count(F.lit(1)).alias("n")
        ),
    )
    ck.write(daily, str(out))


def oracle_enriched(orders: Path, customers: Path) -> pd.DataFrame:
    o = pd.concat(pd.read_parquet(p) for p in sorted(orders.glob("*.parquet")))
    return o.merge(pd.read_parquet(customers / "c.parquet"), on="cid")


def oracle(orders: Path, customers: Path) -> pd.DataFrame:
    grouped = oracle_enriched(orders, customers).groupby(["day", "region"], as_index=False)
    return grouped.agg(rev=("amount", "sum"), n=("oid", "count"))


def same(actual: pd.DataFrame, want: pd.DataFrame, keys: list[str]) -> None:
    actual = actual[list(want.columns)].sort_values(keys).reset_index(drop=True)
    want = want.sort_values(keys).reset_index(drop=True)
    pd.testing.assert_frame_equal(actual, want, check_dtype=False)


def published(out: Path) -> pd.DataFrame:
    return ds.dataset(out / "final", format="parquet").to_table().to_pandas()


def rows(metastore: Metastore, model, **where) -> list:  # type: ignore[no-untyped-def]
    with metastore.transaction() as s:
        found = s.query(model).filter_by(**where).all()
        s.expunge_all()
        return found


@pytest.fixture
def setup(tmp_path: Path, sqlite_metastore: Metastore):  # type: ignore[no-untyped-def]
    orders, customers = write_inputs(tmp_path / "in")
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ck'}")
    return orders, customers, storage, sqlite_metastore


def test_a_savepoint_is_taken_at_the_first_boundary_self_contained_kept_and_restorable(
    spark, tmp_path: Path, setup
) -> None:  # type: ignore[no-untyped-def]
    orders, customers, storage, metastore = setup
    out = tmp_path / "out"
    asked: list[int] = []

    def request() -> None:  # as the API's request_savepoint does, once the job runs
        asked.append(savepoints.request_savepoint(metastore, JOB, requested_by="airflow:test"))

    with checkpointed(spark, JOB, metastore=metastore, storage=storage) as ck:
        daily_job(ck, spark, orders, customers, out, before=request)
    same(published(out), oracle(orders, customers), ["day", "region"])

    state = savepoints.request_status(metastore, JOB, asked[0])
    assert state.status == "COMPLETED" and state.savepoint_path is not None
    path = Path(state.savepoint_path.removeprefix("file://"))
    assert path == tmp_path / "ck" / JOB / "savepoints" / f"savepoint-{state.checkpoint_id}"
    [row] = rows(metastore, Checkpoint, job_id=JOB, checkpoint_id=state.checkpoint_id)
    assert row.checkpoint_type == "SAVEPOINT"
    # taken at the first boundary: the step enriched only, its files in the savepoint's own dir
    assert {p.parent.name for p in path.glob("*/*.parquet")} == {"enriched"}
    # linked, not copied: one inode with the job's own file, which neither name may write
    for p in path.glob("*/*.parquet"):
        assert p.stat().st_nlink >= 2 and p.stat().st_mode & 0o222 == 0, p
    assert (path / "_metadata").is_file()
    saved = ds.dataset(path / "enriched", format="parquet").to_table().to_pandas()
    same(saved, oracle_enriched(orders, customers), ["oid"])

    # the job's checkpoints gone: the savepoint is a copy, not a reference
    for d in (tmp_path / "ck" / JOB).iterdir():
        if d.name != "savepoints":
            shutil.rmtree(d)
    shutil.rmtree(out)
    with checkpointed(spark, JOB, metastore=metastore, storage=storage, restore=str(path)) as ck:
        daily_job(ck, spark, orders, customers, out)
    assert ck.stats.restored_from == state.checkpoint_id
    assert ck.stats.reused == ["enriched"] and ck.stats.computed == ["daily", "output"]
    same(published(out), oracle(orders, customers), ["day", "region"])

    # retention (two finished runs) and ckpt gc leave it alone
    runner = CliRunner()
    base = ["--metastore-url", str(metastore.url), "--storage-url", storage.base_url]
    done = runner.invoke(app, [*base, "gc", JOB, "--grace", "0s", "--keep-history", "0s"])
    assert done.exit_code == 0, done.output
    [row] = rows(metastore, Checkpoint, job_id=JOB, checkpoint_id=state.checkpoint_id)
    assert row.status == "COMPLETED"
    saved = ds.dataset(path / "enriched", format="parquet").to_table().to_pandas()
    same(saved, oracle_enriched(orders, customers), ["oid"])
    # the restored run's own checkpoints never refer to the savepoint's files
    shared = {p.parent.name for p in (tmp_path / "ck" / JOB / "shared").glob("chk-*/*/*.parquet")}
    assert shared == {"enriched", "daily", "output"}


def test_stop_with_savepoint_ends_the_run_and_ckpt_run_resumes_from_its_path(
    spark, tmp_path: Path, setup
) -> None:  # type: ignore[no-untyped-def]
    orders, customers, storage, metastore = setup
    out = tmp_path / "out"
    runner = CliRunner()
    base = ["--metastore-url", str(metastore.url), "--storage-url", storage.base_url]
    reached: list[str] = []

    def stop() -> None:  # ckpt savepoint --stop, while the job runs
        done = runner.invoke(app, [*base, "savepoint", JOB, "--stop"])
        assert done.exit_code == 0, done.output
        reached.append("requested")

    with checkpointed(spark, JOB, metastore=metastore, storage=storage) as ck:
        daily_job(ck, spark, orders, customers, out, before=stop)
        reached.append("after the job")  # not reached: the run stopped at the first boundary
    assert reached == ["requested"]
    assert ck.stopped_with_savepoint is not None
    assert ck.stats.computed == ["enriched"] and not out.exists()
    [job] = rows(metastore, Job, job_id=JOB)
    assert job.status == "FINISHED"
    [request] = rows(metastore, CheckpointRequest, job_id=JOB)
    assert request.status == "COMPLETED" and request.checkpoint_type == "SAVEPOINT_THEN_STOP"
    path = ck.stopped_with_savepoint.removeprefix("file://")

    # another job's restore of it: one line, nothing registered or written
    with pytest.raises(ConfigError) as refused:
        checkpointed(spark, "other_job", metastore=metastore, storage=storage, restore=path)
    assert "\n" not in str(refused.value) and f"job {JOB}, not of job other_job" in str(
        refused.value
    )
    assert rows(metastore, Job, job_id="other_job") == []
    # a job id like an interval's job instance would be authorised as another DAG (the API's)
    with pytest.raises(ValueError, match="ends like an interval's job instance"):
        checkpointed(spark, "daily.20261125T000000", metastore=metastore, storage=storage)
    assert not (tmp_path / "ck" / "other_job").exists()

    # the stop's savepoint is the job's newest completion: the next run's `latest` (adopted
    # into the job's shared state, as a savepoint is never referred to by a checkpoint)
    with checkpointed(spark, JOB, metastore=metastore, storage=storage) as ck:
        daily_job(ck, spark, orders, customers, out)
    assert ck.stats.restored_from == request.checkpoint_id and ck.stats.reused == ["enriched"]
    same(published(out), oracle(orders, customers), ["day", "region"])

    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    args = ["run", str(script), str(orders), str(customers), str(out)]
    done = runner.invoke(app, [*base, *args[:2], "--restore", str(tmp_path / "nope"), *args[2:]])
    assert done.exit_code != 0 and "--restore" in done.stderr, done.output
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not Path(f"{out}.stats.json").exists()  # refused before the script ran

    shutil.rmtree(out)  # the resumed run publishes it again, or the comparison below fails
    done = runner.invoke(app, [*base, *args[:2], "--restore", path, *args[2:]])
    assert done.exit_code == 0, done.output
    stats = json.loads(Path(f"{out}.stats.json").read_text())
    assert stats["reused"] == ["enriched"] and stats["computed"] == ["daily", "output"]
    assert stats["restored_from"] == request.checkpoint_id
    same(published(out), oracle(orders, customers), ["day", "region"])


def test_a_failed_savepoint_fails_its_request_not_the_job_and_a_swallowed_stop_stops_again(
    spark, tmp_path: Path, setup, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    orders, customers, storage, metastore = setup
    out = tmp_path / "out"
    asked: list[int] = []

    def broken(*args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        raise OSError("No space left on device")

    monkeypatch.setattr(step_savepoints, "_copy", broken)  # the disk fills while it links
    with checkpointed(spark, JOB, metastore=metastore, storage=storage) as ck:
        daily_job(
            ck,
            spark,
            orders,
            customers,
            out,
            before=lambda: asked.append(
                savepoints.request_savepoint(metastore, JOB, requested_by="airflow:test")
            ),
        )
    same(published(out), oracle(orders, customers), ["day", "region"])
    [job] = rows(metastore, Job, job_id=JOB)
    assert job.status == "FINISHED"
    state = savepoints.request_status(metastore, JOB, asked[0])
    assert state.status == "FAILED" and "No space left on device" in (state.message or "")
    [failed] = rows(metastore, Checkpoint, job_id=JOB, checkpoint_type="SAVEPOINT")
    assert failed.status != "COMPLETED" and failed.status != "PENDING"
    assert not list((tmp_path / "ck" / JOB / "savepoints").glob("savepoint-*/*/*.parquet"))
    monkeypatch.undo()

    # a stop the script's own `except Exception` swallowed ends the run at the next step
    runner = CliRunner()
    base = ["--metastore-url", str(metastore.url), "--storage-url", storage.base_url]
    shutil.rmtree(out)
    with checkpointed(spark, JOB, metastore=metastore, storage=storage, restore="none") as ck:
        done = runner.invoke(app, [*base, "savepoint", JOB, "--stop"])
        assert done.exit_code == 0, done.output
        o, c = spark.read.parquet(str(orders)), spark.read.parquet(str(customers))
        try:
            enriched = ck.step("enriched", lambda: o.join(c, "cid"))
        except Exception:  # a user's catch-all
            enriched = None
        assert enriched is None and ck.stopped_with_savepoint is not None
        with pytest.raises(step_savepoints.StoppedWithSavepoint):
            ck.step("again", lambda: o)
    assert ck.stats.computed == ["enriched"] and not out.exists()
    [job] = rows(metastore, Job, job_id=JOB)
    assert job.status == "FINISHED"
