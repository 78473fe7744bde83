"""Warm restarts (issue 23): a task failure leaves the Spark driver alive, so the run restores
its latest checkpoint inside the same application instead of failing to Airflow's retry. Real
local Spark, a real task failure (``raise_error`` in an epoch's job); the output must equal a run
that never failed, and a failure that makes no progress must not loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from checkpointing.metastore import views
from checkpointing.metastore.engine import Metastore
from checkpointing.spark.preflight import RunOptions
from checkpointing.state.storage import FileSystemCheckpointStorage
from tests.spark_pipeline import EPOCHS, assert_equals_reference, events_spec, reference_run
from tests.spark_pipeline import write_events as write_events_to


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'metastore.db'}"
    Metastore(url, check_schema=False).upgrade()
    return url


def restarting(spark: Any, spec: Any, metastore: Metastore, storage: Any, **options: Any) -> Any:
    from checkpointing.spark.restarts import run_with_restarts
    from checkpointing.spark.runtime import PipelineRun

    started: list[Any] = []

    def start(opts: RunOptions) -> PipelineRun:
        started.append(PipelineRun(spec, spark, metastore, storage, opts))
        return started[-1]

    result = run_with_restarts(start, RunOptions(**options), attempts=spec.restarts)
    return result, started


def test_a_task_failure_restarts_warm_from_the_latest_checkpoint_and_stays_exact(
    spark: Any, tmp_path: Path, sqlite_url: str
) -> None:
    from checkpointing.spark.runtime import InputError

    events = write_events_to(tmp_path / "events")
    reference = reference_run(spark, events, tmp_path, sqlite_url)
    metastore = Metastore(sqlite_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")

    spec = events_spec(tmp_path, events, "warm")
    result, started = restarting(spark, spec, metastore, storage, fail_task_after_epochs=3)
    assert result.restarts == 1 and len(started) == 2
    assert started[0].attempt != started[1].attempt  # the failed attempt is closed as such
    assert started[0].result.epochs_run == [0, 1, 2]
    assert result.restored_from == started[0].result.checkpoints[-1]
    assert result.epochs_run == list(range(3, EPOCHS))
    assert_equals_reference(spark, spec, reference)
    newest = views.list_restores(metastore, "warm")[0]  # the warm restart's restore
    assert newest["checkpoint_id"] == result.restored_from

    # no progress: a failure in the attempt's first epoch (no checkpoint yet) is not retried
    early = events_spec(tmp_path, events, "early")
    with pytest.raises(InputError, match="task failure injected in epoch 0"):
        restarting(spark, early, metastore, storage, fail_task_after_epochs=0)
    assert views.count_restores(metastore, "early") == 1  # its own start only: no restart

    # restarts: 0 turns them off: the failure reaches the caller (Airflow's retry)
    disabled = events_spec(tmp_path, events, "disabled", restarts=0)
    with pytest.raises(InputError, match="task failure injected in epoch 2"):
        restarting(spark, disabled, metastore, storage, fail_task_after_epochs=2)


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("restarts: true", "restarts"),
        ("restarts: -1", "restarts"),
        ("restart_delay: -5s", "restart_delay"),
    ],
)
def test_bad_restart_settings_are_refused_naming_the_field(
    tmp_path: Path, line: str, field: str
) -> None:
    from checkpointing.pipeline.spec import SpecError, load_spec

    spec = tmp_path / "p.yaml"
    spec.write_text(
        f"job: j\nsource: {{format: parquet, path: {tmp_path}/*.parquet}}\nkey: user\n"
        f"aggregations: {{n: count()}}\nsink: {{path: {tmp_path}/out}}\n{line}\n"
    )
    with pytest.raises(SpecError, match=field):
        load_spec(spec)
