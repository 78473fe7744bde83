"""The last aggregation's state as the checkpoints' own Parquet runs (issue 37): each epoch's
partial aggregates written once by Spark's writer, every checkpoint acknowledging the runs since
the last one, restore and rescale taking the runs over as they are, a bounded merge of runs, a
self-contained savepoint, ``ckpt inspect`` over runs. One scenario on real local Spark; every
final table is checked against pandas over the input files (an oracle written here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.metastore.engine import Metastore
from checkpointing.restore import lookup
from checkpointing.restore.state_reader import inspect_state
from checkpointing.spark import keyed_runs
from checkpointing.spark.state import through_epoch
from checkpointing.state.keygroups import key_group_range
from checkpointing.state.metadata import PARQUET, CheckpointMetadata
from checkpointing.state.storage import FileSystemCheckpointStorage
from checkpointing.status import CheckpointType
from tests.spark_pipeline import (
    EPOCHS,
    assert_matches_pandas,
    checkpoint_metadata,
    completed_ids,
    make_spec,
    run,
    write_events,
)


@pytest.fixture
def metastore(sqlite_metastore: Metastore) -> Metastore:
    return sqlite_metastore


def final_of(spark: Any, out: Path) -> pd.DataFrame:
    [final] = sorted(out.glob("final-*"))  # read with Spark's plain reader, not the sink's
    return spark.read.parquet(str(final)).toPandas().sort_values("user").reset_index(drop=True)


def aggregate_of(metadata: CheckpointMetadata) -> Any:
    [op] = [o for o in metadata.operators if o.operator_id == "aggregate"]
    return op


def run_files(metadata: CheckpointMetadata) -> set[str]:
    return {f.handle for s in aggregate_of(metadata).subtasks for f in s.files()}


def test_runs_are_the_state_across_crashes_rescale_merges_and_savepoints(
    spark: Any, tmp_path: Path, metastore: Metastore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from checkpointing.spark.runtime import SimulatedCrash

    events = write_events(tmp_path / "events")
    frames = [pd.read_parquet(p) for p in sorted(events.glob("*.parquet"))]
    source = f'{{format: parquet, path: "{events}/*.parquet", splits_per_epoch: 1}}'
    out = tmp_path / "out"
    # no changelog setting: the default publishes the final table only
    spec = make_spec(tmp_path, "runs", source, sink=f"{{path: {out}}}")
    assert spec.sink.changelog is False
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ck'}")
    monkeypatch.setenv("CKPT_STORAGE_ROOTS", storage.base_url)  # another coordinator joins
    shared = storage.shared_url("runs")

    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=2)
    assert not (out / "changelog").exists()
    first = checkpoint_metadata(metastore, storage, "runs", 2)
    op = aggregate_of(first)
    handles = [s for s in op.subtasks if s.handle]
    assert handles and all(h.file_format == PARQUET for h in handles)
    for s in op.subtasks:  # each subtask owns Flink's range, and reads it from every run
        r = key_group_range(op.max_parallelism, op.parallelism, s.subtask_index)
        assert s.key_groups == (r.start, r.end)
        assert {f.handle for f in s.files()} == run_files(first)
    # the runs of both epochs, each under the shared/chk-<id>/ of the checkpoint that took it
    assert all(f.startswith(f"{shared}/chk-") for f in run_files(first))
    assert {f.split("/chk-")[1].split("/")[0] for f in run_files(first)} == {"1", "2"}
    # nothing of the dead attempt is left in staging
    assert not any((tmp_path / "ck" / "runs" / "staging").glob("*/*"))

    # inspect: the subtasks' key groups of every run, partials merged = pandas over 2 files
    view = inspect_state(metastore, storage, "runs", 2, "aggregate")
    got = pd.DataFrame(view.rows).set_index("user").sort_index()
    head = pd.concat(frames[:2])
    pd.testing.assert_series_equal(
        got["__cnt_n"], head.groupby("user").size(), check_names=False, check_dtype=False
    )
    pd.testing.assert_series_equal(
        got["__max_max_q"], head.groupby("user")["quantity"].max(), check_names=False
    )
    user = head["user"].iloc[0]
    one = inspect_state(metastore, storage, "runs", 2, "aggregate", key=[str(user)])
    assert [r["__cnt_n"] for r in one.rows] == [int((head["user"] == user).sum())]

    # rescaled 3 -> 2: the runs are taken over as they are (nothing read), the next
    # checkpoint references them beside the new epoch's
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=1, parallelism=2)
    second = checkpoint_metadata(metastore, storage, "runs", 3)
    assert run_files(first) < run_files(second)
    assert aggregate_of(second).parallelism == 2

    # a merge of runs past the bound (here 4 files): the chain starts from the merged files
    monkeypatch.setattr(keyed_runs, "max_runs", lambda parallelism: 4)
    savepoints: list[int] = []

    def savepoint_after(epoch: int, _ms: int) -> None:
        if epoch == 3:  # asked from another process, through the metastore
            other = CheckpointCoordinator("runs", metastore)
            savepoints.append(other.request(CheckpointType.SAVEPOINT, requested_by="test"))

    result = run(spark, spec, metastore, storage, parallelism=4, on_epoch=savepoint_after)
    assert result.epochs_run == list(range(3, EPOCHS))
    final = final_of(spark, out)
    assert_matches_pandas(final, frames)
    last = checkpoint_metadata(metastore, storage, "runs", max(result.checkpoints))
    assert all("/aggregate-merged/" in f for f in run_files(last))

    # the savepoint: self-contained, one file per subtask holding exactly its key groups
    assert savepoints
    [sp] = completed_ids(metastore, "runs", "SAVEPOINT")
    sp_meta = checkpoint_metadata(metastore, storage, "runs", sp)
    assert sp_meta.checkpoint_type == "SAVEPOINT"
    sp_dir = storage.savepoint_url("runs", sp_meta.checkpoint_id)
    sp_op = aggregate_of(sp_meta)
    assert all(f.startswith(sp_dir) for f in run_files(sp_meta))
    for s in sp_op.subtasks:
        assert not s.chain
        if s.handle:
            part = pd.read_parquet(s.handle.removeprefix("file://"))
            assert part["__key_group"].between(*s.key_groups).all()
            assert part["__key_group"].is_monotonic_increasing

    # a fresh job from the savepoint at another parallelism: same final table
    fresh_out = tmp_path / "fresh-out"
    fresh = make_spec(tmp_path, "fresh", source, sink=f"{{path: {fresh_out}}}")
    restored = run(
        spark, fresh, metastore, storage, restore=sp_dir, allow_other_job=True, parallelism=3
    )
    assert restored.restored_from == sp_meta.checkpoint_id
    covered = through_epoch(sp_meta, EPOCHS)  # the boundary after the request
    assert restored.epochs_run == list(range(covered + 1, EPOCHS)) and restored.checkpoints
    # never claimed: the fresh job's checkpoints hold copies in its own shared/, not the
    # savepoint's files (which stay the savepoint owner's to discard)
    fresh_last = lookup.load_checkpoint(metastore, storage, "fresh", restored.checkpoints[-1])
    assert fresh_last.metadata is not None
    fresh_files = run_files(fresh_last.metadata)
    assert all(f.startswith(storage.shared_url("fresh")) for f in fresh_files)
    assert_matches_pandas(final_of(spark, fresh_out), frames)


def test_runs_on_s3_are_written_here_and_uploaded_across_a_crash_and_rescale(
    spark: Any, tmp_path: Path, metastore: Metastore, s3_bucket: str, executors_see_s3: None
) -> None:
    """``s3://`` checkpoint storage with no Hadoop S3 connector: Spark writes each epoch's runs
    on this host, a checkpoint uploads them; a restore copies them back (verified) and the
    final merge reads them locally."""
    import boto3

    from checkpointing.spark.runtime import SimulatedCrash
    from checkpointing.state.s3_storage import S3CheckpointStorage

    events = write_events(tmp_path / "events")
    frames = [pd.read_parquet(p) for p in sorted(events.glob("*.parquet"))]
    source = f'{{format: parquet, path: "{events}/*.parquet", splits_per_epoch: 1}}'
    out = tmp_path / "out"
    spec = make_spec(tmp_path, "runs", source, sink=f"{{path: {out}}}")
    storage = S3CheckpointStorage(f"s3://{s3_bucket}/ck")
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=3)
    first = checkpoint_metadata(metastore, storage, "runs", 3)
    assert all(f.startswith(f"s3://{s3_bucket}/ck/runs/shared/chk-") for f in run_files(first))
    listed = boto3.client("s3").list_objects_v2(Bucket=s3_bucket, Prefix="ck/runs/shared/")
    assert {f"s3://{s3_bucket}/{o['Key']}" for o in listed["Contents"]} >= run_files(first)
    result = run(spark, spec, metastore, storage, parallelism=2)
    assert result.restored_from == 3 and result.epochs_run == list(range(3, EPOCHS))
    assert_matches_pandas(final_of(spark, out), frames)


def test_every_aggregation_kind_survives_runs_a_crash_and_a_rescale(
    spark: Any, tmp_path: Path, metastore: Metastore
) -> None:
    """Sets, HLL sketches, max_by pairs and moments are written as Parquet runs and merged at
    the end exactly as in the changelog path: the oracle is pandas over all the input."""
    from checkpointing.spark.partials import HLL_RELATIVE_STANDARD_ERROR
    from checkpointing.spark.runtime import SimulatedCrash
    from tests.test_spark_aggregates_more import assert_kinds_exact, kinds_spec

    spec, events = kinds_spec(tmp_path, "runs", sink=f"{{path: {tmp_path / 'out'}}}")
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SimulatedCrash):  # the default: a checkpoint after every epoch here
        run(spark, spec, metastore, storage, crash_after_epochs=2)
    assert completed_ids(metastore, "runs")[-1] == 2  # (the default retains one)
    resumed = run(spark, spec, metastore, storage, parallelism=2)
    assert resumed.restored_from == 2 and resumed.epochs_run == [2, 3]
    got = {r["user"]: r for r in final_of(spark, tmp_path / "out").to_dict("records")}
    want = assert_kinds_exact(got, events)
    for user, row in want.items():  # an estimate: within four standard errors of the truth
        bound = 4 * HLL_RELATIVE_STANDARD_ERROR * row["distinct_amount"]
        assert abs(got[user]["approx_amount"] - row["distinct_amount"]) <= max(1, bound), user
