"""What both flights demos share (``make demo`` on Airflow, :mod:`demo.airflow_demo`; and
``--no-airflow`` on Spark alone, :mod:`demo.spark_only`): the example pipeline
``dags/pipelines/nycflights13.yaml`` over real data (the 336,776 flights of 2013, one Parquet file
per day, aggregated per route), the demo's copy of its spec, the crash point, and the verification
of the final table and every committed changelog epoch against an independent pandas computation
(:func:`checkpointing.pipeline.datasets.expected_aggregates`). The job ids and the sinks belong to
the demos, so a rerun starts afresh without touching a job run from the spec itself.
"""

from __future__ import annotations

import numbers
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from rich.console import Console
from rich.table import Table
from rich.text import Text
from sqlalchemy import delete

from checkpointing.config import Settings
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Job
from checkpointing.pipeline import datasets
from checkpointing.pipeline.spec import PipelineSpec, load_spec
from checkpointing.state.storage import CheckpointStorage
from demo import SPEC_PATH

__all__ = ["SPEC_PATH", "Verification", "demo_spec", "ensure_flights", "verify"]

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


def step(number: str, text: str) -> Text:
    """A numbered step of a demo: the number in bold, then ``text`` as it is."""
    return Text.assemble((number, "bold"), " ", text)


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
    console.print(step("metastore", settings.display_metastore_url))
    console.print(step("storage  ", settings.storage_url))
    console.print(step("spec     ", str(spec_path)))
    metastore = Metastore(settings.metastore_url, check_schema=False)
    metastore.upgrade()
    storage = CheckpointStorage.from_url(settings.storage_url)
    flights = datasets.nycflights13_flights()
    data_dir = settings.home / "data" / "nycflights13"
    files, generated = ensure_flights(data_dir, flights)
    if not (data_dir / datasets.PLANES_FILE).exists():  # the seat-miles example's static table
        datasets.write_planes(data_dir)
    console.print(
        step(
            "data     ",
            f"{len(flights):,} flights in {len(files)} daily files under {data_dir}"
            + (" (generated now)" if generated else ""),
        ),
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


def day_of(path: str | Path) -> str:
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
    epoch_of_day = {day_of(p): i // n for i, p in enumerate(files)}
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


# ------------------------------------------------------------------------------ runs


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


# ------------------------------------------------------------------------------ output


def print_problems(console: Console, check: Verification) -> None:
    """What the verification found wrong, one line each."""
    console.print(Text.assemble("  ", ("verification failed", "red"), ":"))
    for problem in check.problems:
        console.print(f"  {problem}", highlight=False, soft_wrap=True)


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
