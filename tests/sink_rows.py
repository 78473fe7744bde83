"""Helpers of the table sinks' tests (Delta and Iceberg): the rows each epoch stages, what an
upsert table holds after some epochs, a pipeline run crashed in process after its third epoch,
and ``ckpt run`` over events on S3 SIGKILLed and resumed."""

from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from checkpointing.metastore.engine import Metastore
from checkpointing.state.storage import FileSystemCheckpointStorage
from tests.ckpt_process import CKPT, kill_at_a_random_moment
from tests.spark_pipeline import AGGS, completed_ids, run, write_events

SCHEMA = "user string, n long, total double"


def epoch_rows(epoch: int) -> list[tuple[str, int, float | None]]:
    """Epoch ``e``'s changed rows: 40 users, some new, some seen before, one null total."""
    rng = random.Random(epoch)
    users = rng.sample(range(60), 40)
    return [(f"u{u:02d}", epoch * 100 + u, None if u == 7 else float(u) + epoch) for u in users]


def epoch_df(spark: Any, epoch: int) -> Any:
    return spark.createDataFrame(epoch_rows(epoch), SCHEMA).repartition(3)


def expected_upsert(epochs: range | list[int]) -> pd.DataFrame:
    """The upsert table after ``epochs``: each user's last row, by user."""
    latest: dict[str, tuple[str, int, float | None]] = {}
    for e in epochs:
        latest.update({row[0]: row for row in epoch_rows(e)})
    frame = pd.DataFrame(sorted(latest.values()), columns=["user", "n", "total"])
    return frame.sort_values("user").reset_index(drop=True)


def staged_beyond_checkpoint_2(sink: Any, spark: Any) -> list[dict[str, Any]]:
    """Epochs 1 and 2 staged, checkpoint 2 (covering them) taken and completed — its sink
    state returned — then epoch 3 staged: the job dies before checkpoint 2's commit."""
    sink.stage(1, epoch_df(spark, 1))
    sink.stage(2, epoch_df(spark, 2))
    state = sink.snapshot_state(2)
    sink.stage(3, epoch_df(spark, 3))
    return state


def crash_after_three_epochs(
    spark: Any, spec: Any, tmp_path: Path, job: str
) -> tuple[Metastore, FileSystemCheckpointStorage, int, int]:
    """Run ``spec`` in process until it crashes after its third epoch: the metastore, the
    checkpoint storage and the two retained checkpoints' ids (older, newest)."""
    from checkpointing.spark.runtime import SimulatedCrash

    metastore_url = f"sqlite:///{tmp_path / 'metastore.db'}"
    Metastore(metastore_url, check_schema=False).upgrade()
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=3)
    older, newest = completed_ids(metastore, job)
    return metastore, storage, older, newest


def chosen_seed() -> int:
    """The seed of a randomized test: ``CKPT_TEST_SEED``, or a random one (printed)."""
    seed = int(os.environ.get("CKPT_TEST_SEED") or random.randrange(10_000))
    print(f"seed {seed} (rerun with CKPT_TEST_SEED={seed})")
    return seed


def s3_spec(workdir: Path, bucket: str, job: str, sink: str) -> Path:
    """The aggregation pipeline (``pipeline.yaml`` in ``workdir``) of ``job`` over the events
    :func:`events_on_s3` uploaded, checkpointing to S3 every epoch, into ``sink`` (YAML)."""
    aggs = ", ".join(f"{k}: {f}({c or ''})" for k, (f, c) in AGGS.items())
    spec = workdir / "pipeline.yaml"
    spec.write_text(
        f"""
job: {job}
source: {{format: parquet, path: "s3://{bucket}/in/*.parquet"}}
key: user
aggregations: {{{aggs}}}
sink: {sink}
parallelism: 2
max_parallelism: 8
checkpoint: {{every_epochs: 1, retained: 2}}
storage: s3://{bucket}/checkpoints
"""
    )
    return spec


def events_on_s3(tmp_path: Path, bucket: str) -> Path:
    """The generated events, written under ``tmp_path`` and uploaded to ``s3://bucket/in/``."""
    import boto3

    local = write_events(tmp_path / "events")
    client = boto3.client("s3")
    for path in sorted(local.glob("*.parquet")):
        client.upload_file(str(path), bucket, f"in/{path.name}")
    return local


def killed_then_resumed(
    spec: Path, env: dict[str, str], seed: int, job: str
) -> subprocess.CompletedProcess[str]:
    """``ckpt run spec`` SIGKILLed at a moment ``seed`` picks, then run again to its end at
    parallelism 3 (which must succeed)."""
    kill_at_a_random_moment(spec, env, random.Random(seed), job)
    resumed = subprocess.run(
        [CKPT, "run", str(spec), "--parallelism", "3"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert resumed.returncode == 0, f"seed {seed}: {resumed.stderr[-2000:]}"
    return resumed
