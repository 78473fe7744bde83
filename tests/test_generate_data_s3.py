"""``ckpt generate-data s3://bucket/prefix``: the input files written as objects through Arrow's
S3 filesystem, against a real HTTP S3 endpoint (moto's server, ``s3_bucket``); a missing bucket
or missing credentials is one line, and nothing is written."""

from __future__ import annotations

import uuid
from pathlib import Path

import boto3
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from checkpointing.cli import app
from checkpointing.pipeline import datasets
from checkpointing.state.object_store import list_objects, open_object

EVENTS = ["--events", "1000", "--keys", "10", "--files", "3", "--seed", "4"]


def keys_in(bucket: str) -> list[str]:
    listed = boto3.client("s3").list_objects_v2(Bucket=bucket)
    return sorted(o["Key"] for o in listed.get("Contents", []))


def test_synthetic_events_are_written_as_objects_equal_to_the_local_files(
    s3_bucket: str, tmp_path: Path
) -> None:
    result = CliRunner().invoke(app, ["generate-data", f"s3://{s3_bucket}/in/events/", *EVENTS])
    assert result.exit_code == 0, result.output
    assert "wrote 3 files" in result.stdout and f"to s3://{s3_bucket}/in/events/" in result.stdout

    # the objects the pipelines' S3 source lists, with the bytes of the local files' tables
    objects = list_objects(f"s3://{s3_bucket}/in/events/events-*.parquet")
    assert [o.url.rsplit("/", 1)[1] for o in objects] == [
        "events-00000.parquet",
        "events-00001.parquet",
        "events-00002.parquet",
    ]
    assert keys_in(s3_bucket) == [f"in/events/events-0000{i}.parquet" for i in range(3)]
    local = datasets.generate_events(tmp_path, events=1000, keys=10, files=3, seed=4)
    for obj, path in zip(objects, local, strict=True):
        with open_object(obj.url) as file:
            assert pq.read_table(file).equals(pq.read_table(path))
        assert obj.size > 0


@pytest.mark.parametrize("dataset", ["synthetic", "nycflights13"])
def test_a_missing_bucket_is_one_line_and_nothing_is_written(s3_env: str, dataset: str) -> None:
    missing = f"ckpt-missing-{uuid.uuid4().hex[:8]}"
    result = CliRunner().invoke(
        app, ["generate-data", f"s3://{missing}/nycflights13", "--dataset", dataset]
    )
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines() == [
        f"error: s3://{missing}/nycflights13: bucket {missing!r} does not exist"
    ]
    assert missing not in [b["Name"] for b in boto3.client("s3").list_buckets()["Buckets"]]


def test_missing_credentials_are_one_line_and_nothing_is_written(
    s3_bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with monkeypatch.context() as env:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            env.delenv(name, raising=False)
        env.delenv("AWS_PROFILE", raising=False)
        env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        env.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        result = CliRunner().invoke(app, ["generate-data", f"s3://{s3_bucket}/in", *EVENTS])
    assert result.exit_code == 1, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: s3://{s3_bucket}/in: no AWS credentials found"), line
    assert keys_in(s3_bucket) == []


@pytest.mark.parametrize("dest", ["s3://{bucket}", "s3://{bucket}/", "s3://{bucket}//x"])
def test_a_destination_without_a_prefix_is_refused(s3_bucket: str, dest: str) -> None:
    url = dest.format(bucket=s3_bucket)
    result = CliRunner().invoke(app, ["generate-data", url, *EVENTS])
    assert result.exit_code == 1, result.output
    assert result.stderr.strip().splitlines() == [f"error: {url}: expected s3://bucket/prefix"]
    assert keys_in(s3_bucket) == []
