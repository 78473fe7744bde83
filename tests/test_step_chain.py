"""Chained steps (``ck.step(name, fn, chained=True)``, issue 39): a step without a shuffle
checkpointed as its plan and inputs, recomputed inside the steps that read it. Against DuckDB:
the output; against the metastore and the checkpoint storage: a checkpoint per step whose one
subtask has no file, nothing written under the step's name; a rerun that keeps it chained and
reuses the rest; a change to it or to its chaining reruns what reads it, said in one line; a
plan that shuffles or is non-deterministic is refused before its checkpoint exists."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd
import pytest
from pyspark.sql import Window
from pyspark.sql import functions as F
from sqlalchemy import select

from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint, CheckpointAck
from checkpointing.spark.steps import checkpointed
from checkpointing.state.storage import FileSystemCheckpointStorage
from tests.test_steps import expected, published, same, write_inputs

JOB = "chained_revenue"


def run_job(  # type: ignore[no-untyped-def]
    spark, orders: Path, customers: Path, out: Path, metastore, storage, *, chained=True, where=None
):
    """The 4-step job with its join chained (``where``: a filter added to the join)."""
    o, c = spark.read.parquet(str(orders)), spark.read.parquet(str(customers))
    window = Window.partitionBy("day").orderBy(F.desc("rev"), "region")

    def join():  # type: ignore[no-untyped-def]
        joined = o.join(c, "cid")
        return joined if where is None else joined.where(where)

    with checkpointed(spark, JOB, metastore=metastore, storage=storage) as ck:
        enriched = ck.step("enriched", join, chained=chained)
        daily = ck.step(
            "daily",
            lambda: enriched.groupBy("day", "region").agg(
                F.sum("amount").alias("rev"), F.count(F.lit(1)).alias("n")
            ),
        )
        ranked = ck.step("ranked", lambda: daily.withColumn("rank", F.rank().over(window)))
        ck.write(ranked, str(out))
    return ck


def test_a_chained_step_is_a_checkpoint_of_its_plan_and_its_readers_recompute_it(
    spark, tmp_path: Path, sqlite_metastore: Metastore, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    orders, customers = write_inputs(tmp_path / "in")
    storage = FileSystemCheckpointStorage((tmp_path / "ck").as_uri())
    out = tmp_path / "out"
    ck = run_job(spark, orders, customers, out, sqlite_metastore, storage)
    same(published(out), expected(orders, customers))
    assert ck.stats.chained == ["enriched"]
    assert ck.stats.computed == ["daily", "ranked", "output"]
    with sqlite_metastore.transaction() as s:
        rows = s.scalars(
            select(Checkpoint).where(Checkpoint.job_id == JOB).order_by(Checkpoint.checkpoint_id)
        ).all()
        assert [r.status for r in rows] == ["SUBSUMED"] * 3 + ["COMPLETED"]  # one per step
        first = s.scalars(
            select(CheckpointAck).where(CheckpointAck.checkpoint_id == rows[0].checkpoint_id)
        ).all()
        assert [(a.state_handle, a.state_size) for a in first] == [(None, 0)]
    shared = tmp_path / "ck" / JOB / "shared"
    assert {p.parent.name for p in shared.glob("chk-*/*/part-*")} == {"daily", "ranked", "output"}
    # the step that reads it names it: a change to it reruns that step too
    with sqlite_metastore.transaction() as s:
        last = s.scalars(select(Checkpoint).where(Checkpoint.status == "COMPLETED")).one()
        daily_items = [
            a.state_meta["list_state"][0]
            for a in s.scalars(
                select(CheckpointAck).where(CheckpointAck.checkpoint_id == last.checkpoint_id)
            )
            if a.state_meta["list_state"][0]["step"] == "daily"
        ]
    assert daily_items and all(i["upstream"] == ["enriched"] for i in daily_items)

    again = run_job(spark, orders, customers, out, sqlite_metastore, storage)
    assert again.stats.chained == ["enriched"]
    assert again.stats.reused == ["daily", "ranked", "output"]
    assert again.stats.computed == []
    same(published(out), expected(orders, customers))

    with caplog.at_level(logging.INFO, logger="checkpointing.spark.steps"):
        changed = run_job(spark, orders, customers, out, sqlite_metastore, storage, where="day < 5")
    assert changed.stats.chained == ["enriched"]
    assert changed.stats.computed == ["daily", "ranked", "output"]
    lines = [r.getMessage() for r in caplog.records if " changed:" in r.getMessage()]
    assert lines == [
        f"job {JOB}: step enriched changed: rerunning enriched, daily, ranked, output; "
        "reusing the steps upstream of it"
    ]
    want = expected(orders, customers)
    same(published(out), want[want.day < 5].reset_index(drop=True))

    # no longer chained: written as any step, and what reads it reruns
    unchained = run_job(
        spark, orders, customers, out, sqlite_metastore, storage, chained=False, where="day < 5"
    )
    assert unchained.stats.chained == []
    assert unchained.stats.computed == ["enriched", "daily", "ranked", "output"]
    same(published(out), want[want.day < 5].reset_index(drop=True))


@pytest.mark.parametrize(
    ("plan", "why"),
    [
        (lambda o: o.groupBy("day").count(), "this one shuffles"),
        (lambda o: o.repartition(3, "cid"), "this one shuffles"),
        (lambda o: o.withColumn("r", F.rand()), "needs a deterministic plan"),
    ],
)
def test_a_plan_that_shuffles_or_differs_between_runs_is_not_chained(
    plan,  # type: ignore[no-untyped-def]
    why: str,
    spark,  # type: ignore[no-untyped-def]
    tmp_path: Path,
    sqlite_metastore: Metastore,
) -> None:
    orders, _ = write_inputs(tmp_path / "in")
    storage = FileSystemCheckpointStorage((tmp_path / "ck").as_uri())
    o = spark.read.parquet(str(orders))
    with (
        checkpointed(spark, "refused_chain", metastore=sqlite_metastore, storage=storage) as ck,
        pytest.raises(ValueError, match=rf"^step wide: chained=True .*{why}"),
    ):
        ck.step("wide", lambda: plan(o), chained=True)
    with sqlite_metastore.transaction() as s:
        assert s.scalars(select(Checkpoint).where(Checkpoint.job_id == "refused_chain")).all() == []


def test_a_savepoint_at_a_chained_steps_boundary_holds_its_plan_and_restores(
    spark, tmp_path: Path, sqlite_metastore: Metastore
) -> None:  # type: ignore[no-untyped-def]
    """Requested before the first step, the savepoint is taken at the chained step's boundary:
    it holds no file, and a run restored from its path recomputes the join inside the step
    that reads it."""
    from checkpointing.coordination import savepoints

    orders, customers = write_inputs(tmp_path / "in")
    storage = FileSystemCheckpointStorage((tmp_path / "ck").as_uri())
    job = "chained_sp"
    asked: list[int] = []

    def run(out: Path, **options):  # type: ignore[no-untyped-def]
        o, c = spark.read.parquet(str(orders)), spark.read.parquet(str(customers))
        with checkpointed(spark, job, metastore=sqlite_metastore, storage=storage, **options) as ck:
            if not asked:
                asked.append(savepoints.request_savepoint(sqlite_metastore, job, requested_by="t"))
            enriched = ck.step("enriched", lambda: o.join(c, "cid"), chained=True)
            daily = ck.step(
                "daily",
                lambda: enriched.groupBy("day", "region").agg(
                    F.sum("amount").alias("rev"), F.count(F.lit(1)).alias("n")
                ),
            )
            ck.write(daily.withColumn("rank", F.rank().over(window)), str(out))
        return ck

    window = Window.partitionBy("day").orderBy(F.desc("rev"), "region")
    run(tmp_path / "out")
    state = savepoints.request_status(sqlite_metastore, job, asked[0])
    assert state.status == "COMPLETED" and state.savepoint_path is not None
    path = Path(state.savepoint_path.removeprefix("file://"))
    assert path.is_dir() and not list(path.rglob("*.parquet"))  # the plan, no rows

    restored = run(tmp_path / "again", restore=state.savepoint_path)
    assert restored.stats.restored_from == state.checkpoint_id
    assert restored.stats.chained == ["enriched"]
    assert restored.stats.computed == ["daily", "output"]
    same(published(tmp_path / "again"), expected(orders, customers))


REFUSED_SCRIPT = """
from pyspark.sql import SparkSession
from checkpointing.spark.steps import checkpointed

spark = SparkSession.builder.getOrCreate()
with checkpointed(spark, job={job!r}) as ck:
    ck.step("wide", lambda: spark.range(10).groupBy("id").count(), chained=True)
"""


def test_an_object_store_that_cannot_be_reached_is_no_refusal() -> None:
    """A refusal (exit 78, no retry) is a configuration a retry would meet again; an object
    store that could not be reached (an ``ObjectStoreError``, a ``ConfigError`` too) may be back
    for the retry."""
    from checkpointing.errors import ConfigError, InvalidIdError
    from checkpointing.state.buckets import ObjectStoreError
    from checkpointing.steps.script import REFUSED_CAUSE, is_refusal, refusal_cause

    assert is_refusal(ConfigError("step wide: chained=True needs a plan without a shuffle"))
    assert is_refusal(InvalidIdError("invalid step name '../up'"))
    unreachable = ObjectStoreError("s3://b/x: cannot reach the object store (ConnectionError)")
    assert not is_refusal(unreachable) and refusal_cause(unreachable) is None
    assert not is_refusal(RuntimeError("boom")) and not is_refusal(None)
    assert refusal_cause(ConfigError("bad")) == f"{REFUSED_CAUSE}: bad"


def test_ckpt_run_exits_ex_config_for_a_script_refused_for_its_configuration(
    spark,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    """A refusal (here a chained step that shuffles) is one ``error:`` line and exit code 78
    (sysexits' EX_CONFIG), not 1 as a crash: the Airflow task reads it and does not retry."""
    from typer.testing import CliRunner

    from checkpointing.cli import app
    from checkpointing.steps.script import EXIT_REFUSED

    script = tmp_path / "job.py"
    script.write_text(REFUSED_SCRIPT.format(job="refused_run"))
    runner = CliRunner(env={"CKPT_HOME": str(tmp_path / "home"), "CKPT_METASTORE_URL": None})
    done = runner.invoke(app, ["run", str(script)])
    assert done.exit_code == EXIT_REFUSED == 78, done.output
    [line] = [x for x in done.output.splitlines() if x.startswith("error:")]
    assert "step wide: chained=True needs a plan without a shuffle" in line
    crashed = tmp_path / "crash.py"
    crashed.write_text("raise SystemExit(1)\n")
    assert runner.invoke(app, ["run", str(crashed)]).exit_code == 1


def test_a_chained_step_of_any_valid_name_is_found_upstream_of_its_readers(
    spark, tmp_path: Path, sqlite_metastore: Metastore
) -> None:  # type: ignore[no-untyped-def]
    """Step names may hold ``-`` and ``.``, which Spark prints quoted in an alias: the alias is
    the name in hex, so the reader's record names it, and only it (not a name it prefixes)."""
    orders, _ = write_inputs(tmp_path / "in")
    storage = FileSystemCheckpointStorage((tmp_path / "ck").as_uri())
    o = spark.read.parquet(str(orders))
    with checkpointed(spark, "names", metastore=sqlite_metastore, storage=storage) as ck:
        ck.step("clean", lambda: o.where("amount > 50"), chained=True)
        clean = ck.step("clean-orders.v2", lambda: o.where("amount > 10"), chained=True)
        daily = ck.step("daily", lambda: clean.groupBy("day").count())
        rows = {r["day"]: r["count"] for r in daily.collect()}
    assert ck._done["daily"].upstream == ("clean-orders.v2",)
    frame = pd.concat(pd.read_parquet(p) for p in sorted(orders.glob("*.parquet")))
    assert rows == frame[frame.amount > 10].groupby("day").size().to_dict()
