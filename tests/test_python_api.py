"""The Python API on real local Spark: a user stage over Arrow/pandas per key group (distinct
items and the last 3 amounts per user — list state, not a built-in aggregation), crash-free, then
crashed and resumed with another parallelism; both equal an independent pandas computation."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from checkpointing.metastore.engine import Metastore
from checkpointing.spark import ArrowStage, Pipeline
from checkpointing.state.storage import FileSystemCheckpointStorage

EPOCHS, EVENTS, USERS, MAX_PARALLELISM = 4, 3_000, 120, 16

STATE = pa.schema([("items", pa.list_(pa.string())), ("last3", pa.list_(pa.float64()))])
OUTPUT = pa.schema([("distinct_items", pa.int64()), ("last3", pa.list_(pa.float64()))])


def _register_by_value() -> None:
    """Ship this module's functions to the Python workers by value (they need not import it)."""
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def user_stage(calls: Path) -> ArrowStage:
    """Per user: the sorted distinct items and the last 3 amounts (by ``seq``), vectorised with
    pandas over the whole key-group batch; each call logs its batch size to ``calls``."""

    def update(state: pa.Table, batch: pa.Table) -> tuple[pa.Table, pa.Table]:
        (calls / uuid.uuid4().hex).write_text(str(batch.num_rows))
        old = state.to_pandas()
        new = batch.to_pandas().sort_values("seq")
        items = pd.concat(
            [
                old[["user", "items"]].explode("items").rename(columns={"items": "item"}),
                new[["user", "item"]],
            ]
        ).drop_duplicates()
        amounts = pd.concat(
            [
                old[["user", "last3"]].explode("last3").rename(columns={"last3": "amount"}),
                new[["user", "amount"]],
            ]
        )
        merged = pd.DataFrame(
            {
                "items": items.groupby("user")["item"].agg(lambda s: sorted(s)),
                "last3": amounts.groupby("user").tail(3).groupby("user")["amount"].agg(list),
            }
        ).reset_index()
        changed = merged[merged.user.isin(new.user)]
        out = changed.assign(distinct_items=changed["items"].str.len())
        return pa.Table.from_pandas(merged, preserve_index=False), out[["user", *OUTPUT.names]]

    def final(state: pa.Table) -> pa.Table:
        return pa.table(
            {
                "user": state.column("user"),
                "distinct_items": pc.list_value_length(state.column("items")),
                "last3": state.column("last3"),
            }
        )

    return ArrowStage(update, state_schema=STATE, output=OUTPUT, final=final)


def write_events(path: Path) -> list[pd.DataFrame]:
    rng = np.random.default_rng(7)
    frames = []
    per = EVENTS // EPOCHS
    for i in range(EPOCHS):
        frame = pd.DataFrame(
            {
                "user": [f"u{k}" for k in rng.integers(0, USERS, per)],
                "item": [f"i{k}" for k in rng.integers(0, 25, per)],
                "amount": np.round(rng.gamma(2.0, 20.0, per), 2),
                "seq": np.arange(i * per, (i + 1) * per, dtype=np.int64),
            }
        )
        pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), path / f"e-{i}.parquet")
        frames.append(frame)
    return frames


def expected(events: pd.DataFrame) -> pd.DataFrame:
    """The independent computation: per user, distinct items and the last 3 amounts."""
    events = events.sort_values("seq")
    grouped = events.groupby("user")
    return pd.DataFrame(
        {
            "distinct_items": grouped["item"].nunique(),
            "last3": grouped["amount"].agg(lambda s: list(s.iloc[-3:])),
        }
    ).reset_index()


def api_pipeline(workdir: Path, events: Path, name: str, **stages: Any) -> Pipeline:
    """A job over the test events keyed by user, with ``stage=`` or ``stages=``."""
    return Pipeline(
        job=name,
        source={"format": "parquet", "path": f"{events}/*.parquet"},
        key="user",
        sink={"path": str(workdir / f"{name}-out"), "changelog": True},  # its epochs read
        parallelism=3,
        max_parallelism=MAX_PARALLELISM,
        checkpoint={"every_epochs": 1, "retained": 2},
        **stages,
    )


def pipeline(workdir: Path, events: Path, name: str, calls: Path) -> Pipeline:
    return api_pipeline(workdir, events, name, stage=user_stage(calls))


def tables(spark: Any, p: Pipeline) -> tuple[pd.DataFrame, pd.DataFrame]:
    from checkpointing.spark.parquet_sink import TwoPhaseCommitSink

    sink = TwoPhaseCommitSink(p.spec.sink.path)
    final = sink.read_final(spark).toPandas().sort_values("user").reset_index(drop=True)
    changelog = sink.read_changelog(spark).toPandas()
    changelog = changelog.sort_values(["epoch", "user"]).reset_index(drop=True)
    for frame in (final, changelog):
        frame["last3"] = frame["last3"].map(list)
    return final, changelog


def assert_expected(
    final: pd.DataFrame, changelog: pd.DataFrame, frames: list[pd.DataFrame]
) -> None:
    want = expected(pd.concat(frames))
    pd.testing.assert_frame_equal(final[want.columns.tolist()], want, check_dtype=False)
    for epoch in range(EPOCHS):  # each epoch's changed rows: its users, state after the epoch
        so_far = expected(pd.concat(frames[: epoch + 1]))
        want = so_far[so_far.user.isin(frames[epoch].user)].reset_index(drop=True)
        got = changelog[changelog.epoch == epoch].reset_index(drop=True)
        pd.testing.assert_frame_equal(got[want.columns.tolist()], want, check_dtype=False)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[pd.DataFrame]]:
    path = tmp_path_factory.mktemp("api-events")
    return path, write_events(path)


@pytest.fixture(scope="module")
def reference(spark: Any, data: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One crash-free run shared by the tests: its tables, and the per-call batch sizes."""
    _register_by_value()
    workdir = tmp_path_factory.mktemp("api-ref")
    calls = workdir / "calls"
    calls.mkdir()
    url = f"sqlite:///{workdir / 'metastore.db'}"
    Metastore(url, check_schema=False).upgrade()
    p = pipeline(workdir, data[0], "api-reference", calls)
    storage = FileSystemCheckpointStorage(f"file://{workdir / 'ckpt'}")
    metastore = Metastore(url)
    result = p.run(spark, metastore, storage)
    metastore.dispose()
    assert result.epochs_run == list(range(EPOCHS))
    sizes = [int(f.read_text()) for f in calls.iterdir()]
    return tables(spark, p), sizes


def test_crash_free_run_equals_pandas(data: Any, reference: Any) -> None:
    (final, changelog), _ = reference
    assert_expected(final, changelog, data[1])
    assert len(final) == pd.concat(data[1]).user.nunique()


def test_update_is_called_per_key_group_not_per_record(reference: Any) -> None:
    _, sizes = reference
    assert sum(sizes) == EVENTS  # every input row reached exactly one call
    assert len(sizes) <= MAX_PARALLELISM * EPOCHS
    assert max(sizes) > 1


@pytest.mark.parametrize("metastore_url", ["sqlite"], indirect=True)
def test_crash_and_rescaled_resume_equals_the_crash_free_run(
    spark: Any, data: Any, reference: Any, tmp_path: Path, metastore: Metastore
) -> None:
    from checkpointing.spark.preflight import RunOptions
    from checkpointing.spark.runtime import SimulatedCrash

    calls = tmp_path / "calls"
    calls.mkdir()
    p = pipeline(tmp_path, data[0], "api-crashy", calls)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SimulatedCrash):
        p.run(spark, metastore, storage, RunOptions(parallelism=4, crash_after_epochs=2))
    resumed = p.run(spark, metastore, storage, RunOptions(parallelism=2))
    assert resumed.restored_from is not None
    assert resumed.epochs_run == [2, 3]
    final, changelog = tables(spark, p)
    pd.testing.assert_frame_equal(final, reference[0][0])
    pd.testing.assert_frame_equal(changelog, reference[0][1])
    assert_expected(final, changelog, data[1])


def test_stage_declarations_are_checked() -> None:
    with pytest.raises(ValueError, match="give final=fn"):
        ArrowStage(lambda s, b: (s, b), state_schema=STATE, output=OUTPUT)
    with pytest.raises(ValueError, match="clash with key columns"):
        ArrowStage(
            lambda s, b: (s, b), state_schema=STATE, output=pa.schema([("last3", pa.int64())])
        ).with_key(["last3"])


def test_update_results_must_keep_the_key_columns() -> None:
    from checkpointing.spark.stages import _update_subtask

    stage = ArrowStage(
        lambda s, b: (b.select(["n"]), b.select(["n"])),
        state_schema=pa.schema([("n", pa.int64())]),
        output=pa.schema([("n", pa.int64())]),
    )
    tagged = pa.schema(
        [
            ("__kind", pa.int32()),
            ("__subtask", pa.int32()),
            ("__key_group", pa.int32()),
            ("user", pa.string()),
            ("__s_n", pa.int64()),
            ("__o_n", pa.int64()),
        ]
    )
    batch = pa.table(
        {
            "user": ["a"],
            "n": [1],
            "__key_group": pa.array([3], pa.int32()),
            "__subtask": pa.array([0], pa.int32()),
        }
    )
    empty = pa.table(
        {
            "user": pa.array([], pa.string()),
            "__subtask": pa.array([], pa.int32()),
            "__key_group": pa.array([], pa.int32()),
            "n": pa.array([], pa.int64()),
        }
    )
    with pytest.raises(ValueError, match=r"lacks columns \['user'\]"):
        _update_subtask(
            stage.update, ["user"], stage.state_fields, stage.output_fields, tagged, empty, batch
        )


# ------------------------------------------------------------------------ a chain of stages
# Stage 1 (keyed by user): each user's first purchase of each item, emitted once (dedup state:
# the items the user has bought). Stage 2 (keyed by item, declarative): per item, how many users
# bought it and the sum of those first purchases. Two keyed states, re-keyed between them; the
# transform before them makes the item (stage 2's key).

FIRST = pa.schema([("item", pa.string()), ("amount", pa.float64())])


def first_purchases() -> ArrowStage:
    def update(state: pa.Table, batch: pa.Table) -> tuple[pd.DataFrame, pd.DataFrame]:
        seen = state.to_pandas().explode("items").rename(columns={"items": "item"})
        new = batch.to_pandas().sort_values("seq").drop_duplicates(["user", "item"])
        marked = new.merge(seen[["user", "item"]], on=["user", "item"], how="left", indicator=True)
        firsts = marked[marked["_merge"] == "left_only"]
        pairs = pd.concat([seen[["user", "item"]].dropna(), firsts[["user", "item"]]])
        items = pairs.groupby("user")["item"].agg(sorted).rename("items").reset_index()
        return items, firsts[["user", "item", "amount"]]

    def final(state: pa.Table) -> pd.DataFrame:  # not the sink's: the chain ends in stage 2
        rows = state.to_pandas().explode("items").rename(columns={"items": "item"})
        return rows.assign(amount=np.nan)[["user", "item", "amount"]]

    items = pa.schema([("items", pa.list_(pa.string()))])
    return ArrowStage(update, state_schema=items, output=FIRST, final=final, uid="first-purchase")


def per_item() -> Any:
    from checkpointing.spark.aggregations import AggregationPlan
    from checkpointing.spark.stages import AggregationStage

    return AggregationStage(
        AggregationPlan(["item"], {"buyers": "count()", "first_spend": "sum(amount)"})
    )


def per_item_with_uid(uid: str) -> Any:
    stage = per_item()
    stage.uid = uid
    return stage


def expected_items(events: pd.DataFrame) -> pd.DataFrame:
    firsts = events.sort_values("seq").drop_duplicates(["user", "item"])
    grouped = firsts.groupby("item")
    return pd.DataFrame(
        {"buyers": grouped.size(), "first_spend": grouped["amount"].sum()}
    ).reset_index()


def item_tables(spark: Any, p: Pipeline) -> tuple[pd.DataFrame, pd.DataFrame]:
    from checkpointing.spark.parquet_sink import TwoPhaseCommitSink

    sink = TwoPhaseCommitSink(p.spec.sink.path)
    final = sink.read_final(spark).toPandas().sort_values("item").reset_index(drop=True)
    changelog = sink.read_changelog(spark).toPandas()
    return final, changelog.sort_values(["epoch", "item"]).reset_index(drop=True)


@pytest.mark.parametrize("metastore_url", ["sqlite"], indirect=True)
def test_a_chain_of_two_keyed_stages_crashes_and_resumes_rescaled(
    spark: Any, data: Any, tmp_path: Path, metastore: Metastore
) -> None:
    from pyspark.sql import functions as F

    from checkpointing.spark.preflight import RunOptions
    from checkpointing.spark.runtime import SimulatedCrash

    def labelled(rows: Any, _tables: Any) -> Any:  # the transform makes stage 2's key
        return rows.withColumn("item", F.concat(F.lit("item-"), F.col("item")))

    _register_by_value()
    frames = [f.assign(item="item-" + f.item) for f in data[1]]
    p = api_pipeline(
        tmp_path, data[0], "api-chain", stages=[first_purchases(), per_item()], transform=labelled
    )
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    with pytest.raises(SimulatedCrash):
        p.run(spark, metastore, storage, RunOptions(parallelism=4, crash_after_epochs=2))
    # both stages snapshot their own keyed state, under their own operator ids
    snapshots = {f.name.rsplit("-", 1)[0] for f in (tmp_path / "ckpt").rglob("*.arrow")}
    assert snapshots == {"first-purchase", "stage-2"}
    resumed = p.run(spark, metastore, storage, RunOptions(parallelism=2))
    assert resumed.restored_from is not None
    assert resumed.epochs_run == [2, 3]

    final, changelog = item_tables(spark, p)
    want = expected_items(pd.concat(frames))
    pd.testing.assert_frame_equal(final[want.columns.tolist()], want, check_dtype=False)
    for epoch in range(EPOCHS):  # each epoch: the items with new first purchases, cumulative
        so_far = pd.concat(frames[: epoch + 1])
        before = pd.concat(frames[:epoch]) if epoch else so_far.iloc[:0]
        new_pairs = so_far.sort_values("seq").drop_duplicates(["user", "item"])
        new_pairs = new_pairs[new_pairs.seq.isin(frames[epoch].seq)]
        assert not new_pairs.empty
        want = expected_items(so_far)
        want = want[want.item.isin(new_pairs.item)].reset_index(drop=True)
        got = changelog[changelog.epoch == epoch].reset_index(drop=True)
        pd.testing.assert_frame_equal(got[want.columns.tolist()], want, check_dtype=False)
        assert len(before) + len(frames[epoch]) == len(so_far)


def test_a_chain_needs_keys_and_distinct_operator_ids(
    spark: Any, data: Any, tmp_path: Path, metastore_url: str
) -> None:
    from checkpointing.pipeline.spec import SpecError
    from checkpointing.spark.state import chained_stages

    unkeyed = ArrowStage(lambda s, b: (s, b), state_schema=STATE, output=OUTPUT, final=len)
    with pytest.raises(SpecError, match=r"stage 2 .* has no key"):
        chained_stages([per_item(), unkeyed], ["item"])
    twice = [first_purchases(), first_purchases().with_key(["seq"])]
    with pytest.raises(SpecError, match="operator id 'first-purchase' is taken"):
        chained_stages(twice, ["user"])
    with pytest.raises(ValueError, match="invalid stage 1 uid"):
        chained_stages([per_item_with_uid("../state")], ["item"])
    runs = chained_stages([first_purchases(), per_item()], ["user"])
    assert [(r.operator_id, r.key) for r in runs] == [
        ("first-purchase", ["user"]),
        ("stage-2", ["item"]),
    ]
    with pytest.raises(ValueError, match="not both"):
        Pipeline(job="x", source={}, key="user", sink="out", stage=per_item(), stages=[per_item()])
    with pytest.raises(ValueError, match="key: the first stage is keyed by it"):
        Pipeline(job="x", source={}, sink="out", stage=per_item())
    with pytest.raises(ValueError, match="key: a keyed job needs a stage"):
        Pipeline(job="x", source={}, key="user", sink="out")
