"""``python -m demo --no-airflow``: the example pipeline on local Spark in this process, no
Airflow (``make demo`` runs it as an Airflow DAG, :mod:`demo.airflow_demo`).

It runs ``dags/pipelines/nycflights13.yaml`` over the flights of 2013 with a crash injected
partway, resumes from the latest checkpoint, verifies the final table and every committed
changelog epoch against an independent pandas computation (:func:`demo.flights.verify`) and prints
the checkpoint and restore history.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console
from rich.text import Text

from checkpointing.cli.render import RESTORE_DECISIONS, checkpoints_table, restores_table
from checkpointing.config import Settings
from checkpointing.metastore.views import list_checkpoints, list_restores
from demo import SPEC_PATH
from demo.flights import (
    AVG_RTOL,
    Verification,
    crash_point,
    day_of,
    demo_conf,
    demo_spec,
    open_demo_home,
    print_problems,
    reset_job,
    step,
    top_routes,
    verify,
)

DEFAULT_JOB = "demo-nycflights13"


class _EpochLog:
    """One line per epoch: its days, its time, and the checkpoint completed at its boundary."""

    def __init__(
        self, console: Console, label: str, intro: Callable[[Any], str] | None = None
    ) -> None:
        self.console = console
        self.label = label
        self.intro = intro  # printed once, above the first epoch's line (after the restore)
        self.run: Any = None
        self.seen = 0

    def __call__(self, epoch: int, millis: int) -> None:
        if self.intro is not None:
            self.console.print(self.intro(self.run), highlight=False)
            self.intro = None
        files = [split.path for split in self.run.epochs[epoch]]
        done = self.run.result.checkpoints[self.seen :]
        self.seen = len(self.run.result.checkpoints)
        mark = f"  checkpoint {', '.join(map(str, done))} completed" if done else ""
        self.console.print(
            f"  {self.label} epoch {epoch + 1:>2}/{len(self.run.epochs)} "
            f"{day_of(files[0])}..{day_of(files[-1])}  {millis / 1000:5.1f} s{mark}",
            highlight=False,
        )


def run_flights_demo(
    settings: Settings,
    console: Console,
    *,
    job: str = DEFAULT_JOB,
    spec_path: Path = SPEC_PATH,
    crash_after: int | None = None,
    master: str = "local[2]",
) -> Verification:
    """Crash, resume, verify, show the history. The crash comes after ``crash_after`` epochs
    (default: about two thirds through, off a checkpoint boundary so some work is lost)."""
    from checkpointing.spark.preflight import RunOptions
    from checkpointing.spark.runtime import PipelineRun, SimulatedCrash
    from checkpointing.spark.session import spark_session

    started = time.monotonic()
    metastore, storage, flights, data_dir, files = open_demo_home(console, settings, spec_path)
    sink_dir = settings.home / "demo" / job / "out"
    spec = demo_spec(spec_path, job, data_dir, sink_dir)
    if reset_job(metastore, storage, job, sink_dir):
        console.print(f"removed the previous run of job {job} (metastore rows, checkpoints, sink)")

    num_epochs = -(-len(files) // spec.source.splits_per_epoch)
    every = spec.checkpoint.every_epochs or 1
    crash_after = crash_point(num_epochs, every, crash_after)

    spark = spark_session(f"ckpt-demo-{job}", master, conf=demo_conf(spec, master))
    spark.sparkContext.setLogLevel("ERROR")
    try:
        console.print()
        console.print(
            step(
                "1.",
                f"job {job}: {num_epochs} epochs of {spec.source.splits_per_epoch} days, a "
                f"checkpoint every {every} epoch(s), parallelism {spec.parallelism}; a crash is "
                f"injected after epoch {crash_after}",
            )
        )
        log = _EpochLog(console, "run 1")
        first = PipelineRun(
            spec, spark, metastore, storage, RunOptions(crash_after_epochs=crash_after),
            on_epoch=log,
        )  # fmt: skip
        log.run = first
        try:
            first.run()
            raise RuntimeError("the injected crash did not happen")
        except SimulatedCrash:
            console.print(
                Text.assemble(
                    "  ",
                    ("crash", "red"),
                    f": attempt {first.attempt} died after epoch {crash_after} (injected)",
                )
            )
        completed = list_checkpoints(metastore, job, status="COMPLETED", limit=1)
        latest = completed[0]["checkpoint_id"] if completed else None
        console.print(
            f"  checkpoints completed before the crash: {first.result.checkpoints or 'none'}; "
            f"epochs staged in the sink but not committed: "
            f"{[e + 1 for e in first.sink.staged_epochs()] or 'none'}"
        )

        def resumed(run: Any) -> str:
            start = run.result.epochs_run[0]  # called after the retry's first epoch
            redo = [e + 1 for e in first.result.epochs_run if e >= start]
            return (
                f"  restored from checkpoint {run.result.restored_from} (the latest completed "
                f"was {latest}): skipping epochs 1..{start}, redoing {len(redo)} "
                f"epoch(s) lost in the crash ({', '.join(map(str, redo)) or '-'})"
            )

        console.print()
        console.print(step("2.", "the retry resumes with --restore latest"))
        log = _EpochLog(console, "run 2", intro=resumed)
        second = PipelineRun(spec, spark, metastore, storage, RunOptions(), on_epoch=log)
        log.run = second
        result = second.run()
    finally:
        spark.stop()
    console.print(
        f"  finished: {len(result.epochs_run)} of {num_epochs} epochs run by the retry; "
        f"final table {result.final_path}",
        highlight=False,
    )

    check = verify(spec, flights, files, sink_dir)
    restores = list_restores(metastore, job)
    last = restores[0] if restores else None
    if result.restored_from is None or result.restored_from != latest:
        check.problems.append(f"restored from {result.restored_from}, expected {latest}")
    if last is None or last["attempt"] != second.attempt or last["checkpoint_id"] != latest:
        check.problems.append(f"the restore of attempt {second.attempt} is not recorded: {last}")

    console.print()
    console.print(step("3.", "the result, the checkpoint history and the restores\n"))
    console.print(top_routes(pd.read_parquet(sink_dir / "final"), spec))
    console.print(checkpoints_table(list_checkpoints(metastore, job), f"Checkpoints of {job}"))
    console.print(restores_table(restores, f"Restores of {job}", RESTORE_DECISIONS))
    metastore.dispose()

    console.print()
    console.print(step("4.", "verification against an independent pandas computation"))
    if check.ok:
        console.print(
            Text.assemble(
                "  ",
                ("ok", "green"),
                f": the final table ({check.routes} routes) and all "
                f"{check.epochs} changelog epochs are equal to it\n"
                f"  (counts, sums, minima and maxima exactly, averages within {AVG_RTOL:g}); "
                f"the restore from checkpoint {result.restored_from} is recorded.\n"
                f"  {time.monotonic() - started:.0f} s in all. Try: ckpt list {job} | "
                f"ckpt show {job} {result.restored_from} | ckpt restores {job}",
            )
        )
    else:
        print_problems(console, check)
    return check
