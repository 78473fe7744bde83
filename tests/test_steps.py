"""Checkpointed steps of an existing PySpark job (``checkpointed``, issue 39), in-process with
the shared Spark session: a 4-step job (a join of two inputs, an aggregate, a window, a write)
against DuckDB, each step a checkpoint whose subtasks are its Spark tasks, a rerun that reuses
every step, a changed step rerun with its descendants while the step upstream of it is reused, a
changed input file, and a non-deterministic step checkpointed whole."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow.dataset as ds
import pytest
from pyspark.sql import Window
from pyspark.sql import functions as F
from sqlalchemy import func, select

from checkpointing.errors import ConfigError, InvalidIdError
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint, CheckpointAck, CheckpointTask, Job
from checkpointing.spark.steps import checkpointed
from checkpointing.state.storage import FileSystemCheckpointStorage

ORACLE = """
WITH enriched AS (SELECT o.*, c.region FROM orders o JOIN customers c USING (cid)),
daily AS (SELECT day, region, sum(amount) AS rev, count(*) AS n FROM enriched GROUP BY day, region)
SELECT day, region, rev, n,
       rank() OVER (PARTITION BY day ORDER BY rev DESC, region) AS rank
FROM daily ORDER BY day, region
"""


def write_inputs(root: Path, rows: int = 3000, files: int = 3) -> tuple[Path, Path]:
    """Orders in ``files`` Parquet files, customers in one, written by pandas."""
    orders, customers = root / "orders", root / "customers"
    orders.mkdir(parents=True)
    customers.mkdir(parents=True)
    per = rows // files
    for f in range(files):
        ids = range(f * per, (f + 1) * per)
        pd.DataFrame(
            {
                "oid": list(ids),
                "cid": [i % 53 for i in ids],
                "day": [i % 7 for i in ids],
                "amount": [float((i * 37) % 101) for i in ids],
            }
        ).to_parquet(orders / f"part-{f}.parquet")
    pd.DataFrame({"cid": range(53), "region": [f"r{i % 5}" for i in range(53)]}).to_parquet(
        customers / "c.parquet"
    )
    return orders, customers


def expected(orders: Path, customers: Path) -> pd.DataFrame:
    """The independent computation: DuckDB's SQL over the same files."""
    con = duckdb.connect()
    con.execute(f"CREATE VIEW orders AS SELECT * FROM read_parquet('{orders}/*.parquet')")
    con.execute(f"CREATE VIEW customers AS SELECT * FROM read_parquet('{customers}/*.parquet')")
    return con.execute(ORACLE).df()


def published(out: Path) -> pd.DataFrame:
    """The published table as pyarrow reads ``<out>/final`` (the sink's documented layout)."""
    frame = ds.dataset(out / "final", format="parquet").to_table().to_pandas()
    return frame.sort_values(["day", "region"]).reset_index(drop=True)


def run_job(spark, orders: Path, customers: Path, out: Path, metastore, storage, *, agg=None):  # type: ignore[no-untyped-def]
    """The 4-step job as a user writes it with ``ck``."""
    o, c = spark.read.parquet(str(orders)), spark.read.parquet(str(customers))
    aggs = agg or [F.sum("amount").alias("rev"), F.count(F.lit(1)).alias("n")]
    window = Window.partitionBy("day").orderBy(F.desc("rev"), "region")
    with checkpointed(spark, "daily_revenue", metastore=metastore, storage=storage) as ck:
        enriched = ck.step("enriched", lambda: o.join(c, "cid"))
        daily = ck.step("daily", lambda: enriched.groupBy("day", "region").agg(*aggs))
        ranked = ck.step("ranked", lambda: daily.withColumn("rank", F.rank().over(window)))
        ck.write(ranked, str(out))
    return ck


def acked_files(metastore: Metastore, checkpoint_id: int, step: str) -> set[str]:
    """The names of the files the metastore holds acknowledged for ``step``'s own subtasks in
    checkpoint ``checkpoint_id`` (a subtask that wrote nothing has no file)."""
    with metastore.transaction() as s:
        handles = s.scalars(
            select(CheckpointAck.state_handle)
            .join(
                CheckpointTask,
                (CheckpointTask.checkpoint_id == CheckpointAck.checkpoint_id)
                & (CheckpointTask.attempt_id == CheckpointAck.attempt_id),
            )
            .where(
                CheckpointAck.checkpoint_id == checkpoint_id,
                CheckpointTask.operator_id == f"step-{step}",
                CheckpointAck.state_handle.is_not(None),
            )
        ).all()
    return {h.rsplit("/", 1)[-1] for h in handles}


def same(actual: pd.DataFrame, want: pd.DataFrame) -> None:
    actual = actual[list(want.columns)].astype(want.dtypes.to_dict())
    pd.testing.assert_frame_equal(actual, want, check_dtype=False)


def test_a_four_step_job_equals_duckdb_and_each_step_is_a_checkpoint_of_its_tasks(
    spark, tmp_path: Path, sqlite_metastore: Metastore, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    orders, customers = write_inputs(tmp_path / "in")
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ck'}")
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="checkpointing.spark.steps"):
        ck = run_job(spark, orders, customers, out, sqlite_metastore, storage)
    # the join (a broadcast one: no shuffle) is the one step the log says could be chained
    hints = [r.getMessage() for r in caplog.records if "does not shuffle" in r.getMessage()]
    assert len(hints) == 1 and "step enriched does not shuffle" in hints[0], hints
    assert "chained=True" in hints[0]
    want = expected(orders, customers)
    same(published(out), want)
    assert len(published(out)) == len(want) == 35  # every (day, region) once
    assert ck.stats.computed == ["enriched", "daily", "ranked", "output"]
    with sqlite_metastore.transaction() as s:
        rows = s.scalars(
            select(Checkpoint)
            .where(Checkpoint.job_id == "daily_revenue")
            .order_by(Checkpoint.checkpoint_id)
        ).all()
        assert len(rows) == 4  # a checkpoint per step
        assert [r.status for r in rows] == ["SUBSUMED"] * 3 + ["COMPLETED"]
        for row, step in zip(rows, ["enriched", "daily", "ranked", "output"], strict=True):
            own = s.scalar(
                select(func.count())
                .select_from(CheckpointTask)
                .where(
                    CheckpointTask.checkpoint_id == row.checkpoint_id,
                    CheckpointTask.operator_id == f"step-{step}",
                )
            )
            assert own == ck.stats.partitions_computed[step]  # a subtask per Spark task
        acks = s.scalars(
            select(CheckpointAck).where(CheckpointAck.checkpoint_id == rows[1].checkpoint_id)
        ).all()
        files = [a for a in acks if a.state_handle]
        assert files and all(a.checksum.startswith("sha256:") and a.state_size > 0 for a in files)
        job = s.get(Job, "daily_revenue")
        # its driver beat while it ran, as a spec's does (a killed one's stamp goes stale)
        assert job is not None and job.status == "FINISHED" and job.heartbeat_at is not None
    # the step files the last checkpoint holds are all there, the subsumed steps' own are kept
    shared = tmp_path / "ck" / "daily_revenue" / "shared"
    assert {p.parent.name for p in shared.glob("chk-*/*/part-*")} == {
        "enriched",
        "daily",
        "ranked",
        "output",
    }
    assert not list(shared.glob("chk-*/*/.*.crc"))  # the writer's leftovers are removed


def test_a_rerun_reuses_every_step_and_a_changed_step_reruns_with_its_descendants(
    spark, tmp_path: Path, sqlite_metastore: Metastore, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    orders, customers = write_inputs(tmp_path / "in")
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ck'}")
    out = tmp_path / "out"
    run_job(spark, orders, customers, out, sqlite_metastore, storage)
    first = sorted(p.name for p in out.iterdir())

    again = run_job(spark, orders, customers, out, sqlite_metastore, storage)
    assert again.stats.reused == ["enriched", "daily", "ranked", "output"]
    assert again.stats.computed == []
    assert sorted(p.name for p in out.iterdir()) == first  # published once: nothing new
    same(published(out), expected(orders, customers))

    changed = [F.sum("amount").alias("rev"), F.count("oid").alias("n")]  # count(1) -> count(oid)
    with caplog.at_level(logging.INFO, logger="checkpointing.spark.steps"):
        third = run_job(spark, orders, customers, out, sqlite_metastore, storage, agg=changed)
    assert third.stats.reused == ["enriched"]  # upstream of the change: reused
    assert third.stats.computed == ["daily", "ranked", "output"]
    lines = [r.getMessage() for r in caplog.records if " changed:" in r.getMessage()]
    assert lines == [
        "job daily_revenue: step daily changed: rerunning daily, ranked, output; "
        "reusing the steps upstream of it"
    ]
    same(published(out), expected(orders, customers))

    frame = pd.read_parquet(customers / "c.parquet")
    frame["region"] = [f"r{i % 3}" for i in range(len(frame))]
    frame.to_parquet(customers / "c.parquet")  # a new version of an input file
    fourth = run_job(spark, orders, customers, out, sqlite_metastore, storage, agg=changed)
    assert fourth.stats.reused == []  # every step reads it, directly or through a step
    same(published(out), expected(orders, customers))


def test_a_non_deterministic_step_is_checkpointed_whole_and_read_back_as_written(
    spark, tmp_path: Path, sqlite_metastore: Metastore, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ck'}")
    base = spark.range(0, 200, 1, 4)

    def run():  # type: ignore[no-untyped-def]
        with checkpointed(spark, "noisy", metastore=sqlite_metastore, storage=storage) as ck:
            noisy = ck.step("noisy", lambda: base.withColumn("r", F.rand()))
            rows = sorted(tuple(r) for r in noisy.collect())
        return ck, rows

    with caplog.at_level(logging.INFO, logger="checkpointing.spark.steps"):
        _, rows = run()
    assert any(
        "step noisy is checkpointed whole: its plan is non-deterministic" in r.getMessage()
        for r in caplog.records
    )
    second, again = run()
    assert second.stats.reused == ["noisy"]
    assert again == rows  # the checkpoint's rows, not new random ones
    assert len({r[0] for r in rows}) == 200


def test_a_wide_step_that_finds_no_rows_at_run_time_completes_and_reads_back_empty(
    spark, tmp_path: Path, sqlite_metastore: Metastore
) -> None:  # type: ignore[no-untyped-def]
    # the filter is on the data, so only a run finds nothing: adaptive execution then replaces
    # the aggregate by an empty relation of no partition, and the step still completes
    orders, _ = write_inputs(tmp_path / "in")
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ck'}")
    o = spark.read.parquet(str(orders))
    assert spark.conf.get("spark.sql.adaptive.enabled") == "true"

    def run():  # type: ignore[no-untyped-def]
        with checkpointed(spark, "nothing", metastore=sqlite_metastore, storage=storage) as ck:
            refunds = ck.step(
                "refunds",
                lambda: o.where(F.col("amount") < 0).groupBy("day").agg(F.sum("amount").alias("r")),
            )
            rows = refunds.collect()
        return ck, refunds, rows

    first, refunds, rows = run()
    assert rows == [] and refunds.columns == ["day", "r"]
    assert first.stats.computed == ["refunds"] and first.stats.partitions_computed["refunds"] == 1
    with sqlite_metastore.transaction() as s:
        row = s.scalars(select(Checkpoint).where(Checkpoint.job_id == "nothing")).one()
        assert row.status == "COMPLETED"
        checkpoint_id = row.checkpoint_id
    step_dir = tmp_path / "ck" / "nothing" / "shared" / f"chk-{checkpoint_id}" / "refunds"
    names = {p.name for p in step_dir.iterdir()}
    # one file, its schema only, acknowledged as the step's one subtask
    assert len(names) == 1 and names == acked_files(sqlite_metastore, checkpoint_id, "refunds")
    assert ds.dataset(step_dir, format="parquet").to_table().num_rows == 0
    second, _, again = run()
    assert second.stats.reused == ["refunds"] and again == []


@pytest.mark.parametrize(
    ("plan", "why"),
    [
        (lambda df: df.withColumn("t", F.current_timestamp()), "reads the clock"),
        (lambda df: df.limit(5), "a limit without a sort"),
        (lambda df: df.withColumn("u", F.expr("uuid()")), "non-deterministic"),
    ],
)
def test_plans_that_differ_between_runs_are_named(plan, why: str, spark) -> None:  # type: ignore[no-untyped-def]
    from checkpointing.spark.step_writer import describe

    storage = FileSystemCheckpointStorage("file:///tmp/unused-ckpt-storage")
    facts = describe(spark, plan(spark.range(10)), storage, "j")
    assert facts.nondeterministic is not None and why in facts.nondeterministic
    assert (
        describe(spark, spark.range(10).orderBy("id").limit(5), storage, "j").nondeterministic
        is None
    )


def test_a_step_is_narrow_only_without_a_shuffle_in_its_physical_plan(
    spark,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    """Partial resume runs a narrow step over its missing partitions' files only: a step whose
    shuffle only the physical plan shows (applyInPandas, a rebalance hint) must not count as
    narrow, or a resume would compute groups from part of their rows."""
    from checkpointing.spark.step_writer import describe

    storage = FileSystemCheckpointStorage((tmp_path / "ck").as_uri())
    spark.range(40).withColumn("k", F.col("id") % 4).write.parquet(str(tmp_path / "in"))
    data = spark.read.parquet(str(tmp_path / "in"))

    def total(frame: pd.DataFrame) -> pd.DataFrame:
        return frame.groupby("k", as_index=False)["id"].sum()

    grouped = data.groupBy("k").applyInPandas(total, "k long, id long")
    assert describe(spark, data.withColumn("x", F.col("id") * 2), storage, "j").narrow
    assert not describe(spark, grouped, storage, "j").narrow
    assert not describe(spark, data.hint("rebalance"), storage, "j").narrow


def test_a_bad_step_name_is_refused_before_anything_runs(
    spark, tmp_path: Path, sqlite_metastore: Metastore
) -> None:  # type: ignore[no-untyped-def]
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ck'}")
    with (
        checkpointed(spark, "names", metastore=sqlite_metastore, storage=storage) as ck,
        pytest.raises(InvalidIdError, match=r"invalid step name '\.\./up'"),
    ):
        ck.step("../up", lambda: spark.range(3))
    assert not (tmp_path / "ck" / "names" / "shared").exists()


@pytest.mark.parametrize("spec", ["periodic", "operator state"])
def test_a_script_is_refused_a_spec_pipelines_job_before_anything_is_written(
    spark, tmp_path: Path, sqlite_metastore: Metastore, spec: str
) -> None:  # type: ignore[no-untyped-def]
    """A spec pipeline's job (periodic checkpoints configured, or a latest checkpoint holding
    operator state and no step) named by a script: one line, and the job row and its
    checkpoints stay as they were (the script would have overwritten its configuration and
    retired its checkpoints)."""
    from checkpointing.clock import ManualClock
    from tests.helpers import complete, new_coordinator

    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ck'}")
    config = {"interval": "1s"} if spec == "periodic" else {}
    clock = ManualClock()
    coordinator = new_coordinator(sqlite_metastore, storage, clock, job_id="spec_job", **config)
    if spec == "operator state":
        coordinator.activate()
        complete(coordinator)

    def rows() -> tuple[object, ...]:
        with sqlite_metastore.reading() as s:
            job = s.get(Job, "spec_job")
            assert job is not None
            done = s.scalars(select(Checkpoint.status).where(Checkpoint.job_id == "spec_job"))
            return (job.coordinator_id, job.interval_ms, job.updated_at, sorted(done))

    before = rows()
    with (
        pytest.raises(ConfigError) as refused,
        checkpointed(spark, "spec_job", metastore=sqlite_metastore, storage=storage) as ck,
    ):
        ck.step("one", lambda: spark.range(3))
    line = str(refused.value)
    why = "periodically" if spec == "periodic" else "hold 'sink'"
    assert "job 'spec_job' is a pipeline spec's" in line and why in line, line
    assert rows() == before


def test_which_steps_a_change_reruns_and_when_a_step_cut_short_resumes(
    spark,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    """Descendants of a changed step from the recorded graph, the decision, and the reasons a
    step cut short reruns whole (its missing partitions are recomputed from its input's files:
    only an input that is a scan of files qualifies)."""
    from checkpointing.spark.step_salvage import KeptStep, resumable, step_input
    from checkpointing.spark.step_writer import PlanFacts, as_url
    from checkpointing.steps.plan import StepRecord, change_line, decide, downstream_of

    def rec(name: str, *up: str) -> StepRecord:
        return StepRecord(name, f"fp-{name}", up, "{}", 1, True)

    steps = {r.name: r for r in [rec("a"), rec("b", "a"), rec("c"), rec("d", "b", "c")]}
    assert downstream_of("a", steps) == ["b", "d"]
    assert downstream_of("c", steps) == ["d"]
    assert change_line("j", "a", steps).startswith("job j: step a changed: rerunning a, b, d;")
    assert decide("a", "fp-a", steps, None).reused
    assert decide("a", "other", steps, None).reason.startswith("changed")
    assert decide("b", "other", steps, "it reads step a").reason == "it reads step a"
    assert not decide("e", "fp-e", steps, None).reused

    kept = KeptStep("s", "fp", 4, {0: ("file:///x", 1, None, None)})
    facts = PlanFacts("p", "p", "{}", (), (), None, True)
    spark.range(4).write.parquet(str(tmp_path / "in"))
    scan = spark.read.parquet(str(tmp_path / "in"))
    files = {as_url(p) for p in scan.inputFiles()}
    assert step_input(scan, files)  # a step as read back: a bare scan of its files
    assert not step_input(scan, files - {next(iter(files))})  # a file of no step
    for transformed in (scan.alias("ckpt_chained__73"), scan.withColumn("x", F.lit(1))):
        assert not step_input(transformed, files)
    assert resumable("s", kept, facts, scan, is_step=True) is None
    assert "names no checkpointed input" in resumable("s", kept, facts, None, is_step=False)
    assert "not a step as read back" in resumable("s", kept, facts, scan, is_step=False)
    wide = PlanFacts("p", "p", "{}", (), (), None, False)
    assert "not narrow" in resumable("s", kept, wide, scan, is_step=True)
    noisy = PlanFacts("p", "p", "{}", (), (), "its plan reads the clock (now())", True)
    assert "checkpointed whole" in resumable("s", kept, noisy, scan, is_step=True)


def test_run_script_refuses_a_bad_path_in_one_line_and_runs_a_script_with_the_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ckpt run script.py``'s library side: a missing or non-Python file is named before
    anything is created; a script runs as ``__main__`` with its arguments and the settings'
    metastore and storage in its environment, and its exit code comes back."""
    from checkpointing.config import Settings
    from checkpointing.errors import ConfigError
    from checkpointing.steps.script import run_script

    home = tmp_path / "home"
    settings = Settings(
        metastore_url=f"sqlite:///{home / 'metastore.db'}",
        storage_url=(home / "checkpoints").as_uri(),
        home=home,
        embedded_metastore=True,
    )
    with pytest.raises(ConfigError, match=r"script .*missing\.py: no such file"):
        run_script(tmp_path / "missing.py", (), settings)
    (tmp_path / "job.txt").write_text("")
    with pytest.raises(ConfigError, match=r"not a Python file"):
        run_script(tmp_path / "job.txt", (), settings)
    assert not home.exists()  # refused before anything was created

    monkeypatch.delenv("CKPT_STORAGE_URL", raising=False)
    script = tmp_path / "job.py"
    seen = tmp_path / "seen.txt"
    script.write_text(
        "import os, sys\n"
        f"open({str(seen)!r}, 'w').write(' '.join([__name__, *sys.argv[1:], "
        "os.environ['CKPT_STORAGE_URL']]))\n"
        "sys.exit(3)\n"
    )
    assert run_script(script, ["--day", "2026-11-28"], settings) == 3
    assert seen.read_text() == f"__main__ --day 2026-11-28 {settings.storage_url}"
    assert "CKPT_STORAGE_URL" not in os.environ  # restored after the run
    assert Metastore(settings.metastore_url).current_revision() is not None  # schema created


def test_ckpt_run_runs_a_script_and_names_a_missing_one(tmp_path: Path) -> None:
    """``ckpt run script.py``: the script runs under the command's settings (its exit code is
    the command's); a missing script is one line naming it, with a non-zero exit."""
    from typer.testing import CliRunner

    from checkpointing.cli import app

    home = tmp_path / "home"
    runner = CliRunner(env={"CKPT_HOME": str(home), "CKPT_METASTORE_URL": None})
    script = tmp_path / "job.py"
    seen = tmp_path / "seen.txt"
    script.write_text(
        "import os, sys\n"
        f"open({str(seen)!r}, 'w').write(os.environ['CKPT_STORAGE_URL'])\n"
        "sys.exit(4)\n"
    )
    done = runner.invoke(app, ["run", str(script)])
    assert done.exit_code == 4, done.output
    assert seen.read_text() == (home / "checkpoints").as_uri()
    missing = runner.invoke(app, ["run", str(tmp_path / "gone.py")])
    assert missing.exit_code != 0
    assert "gone.py: no such file" in missing.output
    assert len(missing.output.strip().splitlines()) == 1


def test_steps_are_written_in_parquet_v2_and_the_published_table_in_sparks_defaults(
    spark, tmp_path: Path, sqlite_metastore: Metastore
) -> None:  # type: ignore[no-untyped-def]
    """A step's own files are read back only by this project's Spark: version 2 pages (delta
    encodings, written faster); the table ``ck.write`` publishes is read by anyone: Spark's
    default version 1, as a job without ``ck`` writes it."""
    import pyarrow.parquet as pq

    storage = FileSystemCheckpointStorage((tmp_path / "ck").as_uri())
    out = tmp_path / "out"
    with checkpointed(spark, "formats", metastore=sqlite_metastore, storage=storage) as ck:
        ids = ck.step("ids", lambda: spark.range(0, 200_000, 1, 2))
        ck.write(ids, str(out))

    def encodings(files: list[Path]) -> set[str]:
        assert files
        return {
            e for f in files for e in pq.ParquetFile(f).metadata.row_group(0).column(0).encodings
        }

    shared = tmp_path / "ck" / "formats" / "shared"
    assert "DELTA_BINARY_PACKED" in encodings(list(shared.glob("chk-*/ids/part-*")))
    final = encodings(list((out / "final").glob("part-*")))
    assert "PLAIN" in final and "DELTA_BINARY_PACKED" not in final
    assert sorted(pq.read_table(out / "final").column("id").to_pylist()) == list(range(200_000))


def test_a_step_whose_checkpoint_a_later_try_aborts_cancels_its_write(
    spark, tmp_path: Path, sqlite_metastore: Metastore
) -> None:  # type: ignore[no-untyped-def]
    """A later try takes the job over while a step is written (its takeover aborts the step's
    pending checkpoint): the next acknowledgement is discarded, the watcher cancels the step's
    Spark job instead of letting every task run for nothing, and the step fails naming why."""
    import threading
    import time

    from checkpointing.coordination.failure import CoordinatorSuperseded
    from checkpointing.spark.step_savepoints import StepCoordinator
    from checkpointing.spark.step_writer import StepCheckpointError
    from checkpointing.steps.plan import step_config

    storage = FileSystemCheckpointStorage((tmp_path / "ck").as_uri())
    parts = 24
    started = tmp_path / "started"
    started.mkdir()

    @F.udf("long")
    def slow(x):  # type: ignore[no-untyped-def]  (no hints: Spark would read them as a kind)
        from pyspark import TaskContext

        (started / str(TaskContext.get().partitionId())).touch()  # the partitions that ran
        time.sleep(0.05)
        return x

    base = spark.range(0, parts * 10, 1, parts).withColumn("y", slow("id"))  # ~0.5 s a task
    taken = threading.Event()

    def later_try() -> None:  # once the first file is acknowledged, as a retry's driver starts
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with sqlite_metastore.reading() as s:
                acked = s.scalar(
                    select(func.count())
                    .select_from(CheckpointAck)
                    .where(CheckpointAck.job_id == "taken", CheckpointAck.state_handle.is_not(None))
                )
            if acked:
                StepCoordinator(
                    "taken", sqlite_metastore, storage, step_config(), coordinator_id="retry-1"
                ).activate()
                taken.set()
                return
            time.sleep(0.02)

    thread = threading.Thread(target=later_try)
    # the watcher's refusal, or the takeover itself when the write failed first (the takeover
    # deletes the aborted checkpoint's directory under it)
    with (
        pytest.raises(
            (StepCheckpointError, CoordinatorSuperseded),
            match=r"step slow: checkpoint 1 was aborted|superseded by retry-1",
        ),
        checkpointed(spark, "taken", metastore=sqlite_metastore, storage=storage) as ck,
    ):
        thread.start()
        ck.step("slow", lambda: base)
    thread.join()
    assert taken.is_set()
    ran = len(list(started.iterdir()))  # without the cancel, the write ran every partition
    assert 0 < ran < parts, ran  # cancelled: the later partitions never ran
