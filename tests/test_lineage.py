"""Lineage names (issue 26): a spec's inputs and sink as OpenLineage datasets and as the Airflow
Asset the pipeline task updates, for each kind of source and sink. The events themselves, sent by
the OpenLineage provider's listener through a real transport, are asserted in the Airflow
failover scenario (tests/test_airflow_failover.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from checkpointing.pipeline.spec import load_spec
from checkpointing_airflow.lineage import input_datasets, output_dataset, sink_asset


def spec_of(tmp_path: Path, source: dict[str, Any], sink: dict[str, Any], **fields: Any) -> Any:
    path = tmp_path / "lineage.yaml"
    spec = {
        "job": "lineage",
        "source": source,
        "key": ["user"],
        "aggregations": {"n": "count()"},
        "sink": sink,
        **fields,
    }
    path.write_text(yaml.safe_dump(spec))
    return load_spec(path)


def names(datasets: list[Any]) -> list[tuple[str, str]]:
    return [(d.namespace, d.name) for d in datasets]


def test_local_files_and_static_tables_are_file_datasets_and_the_sink_a_file_asset(
    tmp_path: Path,
) -> None:
    spec = spec_of(
        tmp_path,
        {"format": "parquet", "path": "events/*.parquet"},
        {"path": "out"},
        tables={"users": {"format": "csv", "path": "tables/users.csv"}},
        transform="SELECT i.* FROM input i JOIN users u ON i.user = u.user",
    )
    assert names(input_datasets(spec)) == [
        ("file", str(tmp_path / "events")),  # the glob cut at its directory
        ("file", str(tmp_path / "tables" / "users.csv")),
    ]
    assert names([output_dataset(spec)]) == [("file", str(tmp_path / "out"))]
    asset = sink_asset(spec)
    assert asset.uri == (tmp_path / "out").as_uri()
    assert asset.extra == {"pipeline": "lineage", "format": "parquet"}


def test_s3_prefixes_are_bucket_namespaced_and_a_delta_table_is_its_location(
    tmp_path: Path,
) -> None:
    spec = spec_of(
        tmp_path,
        {"format": "parquet", "path": "s3://raw-bucket/events/2026/*/*.parquet"},
        {"format": "delta", "path": "s3://lake/tables/by_user/"},
    )
    assert names(input_datasets(spec)) == [("s3://raw-bucket", "events/2026")]
    assert names([output_dataset(spec)]) == [("s3://lake", "tables/by_user")]
    assert sink_asset(spec).uri == "s3://lake/tables/by_user"


def test_an_iceberg_sink_is_its_table_in_the_warehouse(tmp_path: Path) -> None:
    spec = spec_of(
        tmp_path,
        {"format": "parquet", "path": "events/*.parquet"},
        {"format": "iceberg", "path": "warehouse", "table": "analytics.by_user"},
    )
    table = tmp_path / "warehouse" / "analytics" / "by_user"
    output = output_dataset(spec)
    assert names([output]) == [("file", str(table))]
    (symlink,) = output.facets["symlinks"].identifiers
    assert (symlink.name, symlink.type) == ("analytics.by_user", "TABLE")
    assert sink_asset(spec).uri == table.as_uri()
