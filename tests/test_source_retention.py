"""Bounded source state and inputs that expire (issue 25), without Spark: the source's list
state compacts earlier runs' files (:class:`~checkpointing.pipeline.splits.Consumed`), a file read
and gone since is forgotten, a changed one is refused by name unless ``source.on_changed_input``
says otherwise, and a partly read file that is gone is an error naming it. The soak test runs 400
simulated daily runs through the core (listing, planning, the source state, the ``_metadata``
round trip, a rescale now and then) over objects on moto's S3 server with a lifecycle step."""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from checkpointing.cli.render import input_table
from checkpointing.metastore.input_views import summarize_items
from checkpointing.pipeline.operator_ids import SOURCE
from checkpointing.pipeline.spec import SourceSpec, SpecError, load_spec
from checkpointing.pipeline.splits import (
    Consumed,
    InputSplit,
    SplitError,
    describe_epochs,
    has_progress,
    plan_epochs,
    plan_splits,
    processed_item,
    resume,
    schema_splits,
    source_state,
)
from checkpointing.restore.assignment import assign_list_state
from checkpointing.state.metadata import CheckpointMetadata, OperatorState, SubtaskStateHandle
from checkpointing.state.object_store import ObjectInfo, list_objects


def obj(name: str, etag: str = "e", size: int = 10) -> ObjectInfo:
    return ObjectInfo(f"s3://b/{name}", size, etag)


def run_once(
    items: list[dict[str, Any]], files: list[ObjectInfo], *, on_changed: str = "refuse"
) -> tuple[list[list[InputSplit]], list[dict[str, Any]], list[str]]:
    """One run through the core: resume from ``items`` (none: an empty start), read every
    epoch after the checkpoint, the final checkpoint's source state; and the paths it read."""
    if has_progress(items):
        resumed = resume(items, files, "parquet", None, 1, 1, on_changed=on_changed)
        epochs, consumed = resumed.epochs, resumed.consumed
        first = consumed.epochs  # the epochs done: compacted, or the last run's
    else:
        epochs, consumed, first = plan_epochs(plan_splits(files, "parquet", None), 1, None), None, 0
    read = [s.path for e in epochs[first:] for s in e]
    return epochs, source_state(epochs, len(epochs), consumed, {}, "run"), read


def test_many_runs_keep_the_state_the_size_of_the_listing_and_one_run() -> None:
    """500 runs of 4 new files each, 120 files kept listed (a lifecycle): the state holds the
    listed files read earlier once each (compacted, no epochs) and the last run's splits; every
    file is read exactly once; epochs keep their numbers (the compacted ones empty)."""
    landed: list[ObjectInfo] = []
    items: list[dict[str, Any]] = []
    read: list[str] = []
    sizes = []
    for day in range(500):
        landed += [obj(f"d{day:04d}-{i}.parquet") for i in range(4)]
        listed = landed[-120:]
        epochs, items, now = run_once(items, listed)
        read += now
        assert now == [f.url for f in landed[-4:]]
        assert len(epochs) == 4 * (day + 1)
        sizes.append(len(json.dumps(items)))
    assert len(read) == len(set(read)) == 2000
    assert sizes[-1] <= sizes[50] * 1.05
    (consumed,) = [i for i in items if "consumed" in i]
    assert consumed["consumed"]["epochs"] == 1996
    assert len(consumed["consumed"]["files"]) == 116  # the listed ones, the last run's inline
    assert sum(1 for i in items if i.get("processed")) == 4


def test_an_old_checkpoint_one_item_per_split_resumes_and_is_compacted() -> None:
    """A checkpoint written before compaction (every processed split an item, no record) still
    resumes; its files are compacted by the next run's checkpoints."""
    files = [obj(f"f{i}.parquet") for i in range(5)]
    old = [
        processed_item(InputSplit(f.url, size=10, etag="e"), i, "a0") for i, f in enumerate(files)
    ]
    resumed = resume(old, [*files, obj("new.parquet")], "parquet", None, 1, 7)
    assert [[s.path for s in e] for e in resumed.epochs][-1] == ["s3://b/new.parquet"]
    assert resumed.consumed == Consumed(5, {f.url: (10, "e", None) for f in files})
    state = source_state(resumed.epochs, 6, resumed.consumed, {}, "a1")
    assert state[0] == resumed.consumed.to_item()
    assert [i["epoch"] for i in state[1:]] == [5]
    assert describe_epochs(resumed.epochs, _source()).startswith("6 splits (60 B) in 6 epochs")
    later = resume(state, [*files, obj("new.parquet"), obj("z.parquet")], "parquet", None, 1, 8)
    assert [s.path for s in later.epochs[6]] == ["s3://b/z.parquet"]
    assert describe_epochs(later.epochs, _source()).startswith(
        "2 splits (20 B) in 2 epochs after 5 compacted epochs"
    )


def _source() -> Any:
    return SourceSpec(format="parquet", path="/in/*.parquet")


SPEC = """
job: j
source: {format: parquet, path: /in/*.parquet}
key: [user]
aggregations: {n: count()}
sink: {path: /out}
"""


def load_spec_text(text: str, tmp_path: Path) -> Any:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return load_spec(path)


def test_a_file_read_and_gone_is_forgotten_and_a_changed_one_refused_by_name() -> None:
    files = [obj(f"f{i}.parquet") for i in range(3)]
    _, items, _ = run_once([], files)
    _, items, read = run_once(items, files[1:])  # f0 expired: no refusal, nothing read
    assert read == []
    assert "s3://b/f0.parquet" not in json.dumps(items)
    changed = [files[1], obj("f2.parquet", etag="other")]
    with pytest.raises(SplitError, match=r"f2\.parquet was read by checkpoint 1 and has changed"):
        run_once(items, changed)
    _, ignored, read = run_once(items, changed, on_changed="ignore")
    assert read == [] and '"other"' in json.dumps(ignored)  # remembered in its new version
    _, again, read = run_once(items, changed, on_changed="reprocess")
    assert read == ["s3://b/f2.parquet"]
    _, _, read = run_once(again, changed, on_changed="reprocess")
    assert read == []  # once


def test_a_partly_read_file_gone_or_changed_is_an_error_naming_it() -> None:
    """Row groups 0-1 of big.parquet read, 2-3 still to read: whatever on_changed_input says."""
    big = obj("big.parquet", size=100)
    done = InputSplit(big.url, (0, 2), size=100, etag="e")
    rest = InputSplit(big.url, (2, 4), size=100, etag="e")
    items = [processed_item(done, 0, "a"), rest.to_state(1)]
    with pytest.raises(
        SplitError, match=r"big\.parquet was partly read by checkpoint 3 and is gone"
    ):
        resume(items, [obj("x.parquet")], "parquet", None, 1, 3)
    for how in ("ignore", "reprocess"):
        with pytest.raises(SplitError, match=r"big\.parquet was read by checkpoint 3 and has"):
            resume(items, [obj("big.parquet", "new", 100)], "parquet", None, 1, 3, on_changed=how)
    resumed = resume(items, [big], "parquet", None, 1, 3)
    assert resumed.epochs[1] == [rest]
    # compacted while partly read: the rest is still pinned on the next restore
    state = source_state(resumed.epochs, 1, resumed.consumed, {}, "b")
    with pytest.raises(SplitError, match="partly read"):
        resume(state, [], "parquet", None, 1, 4)


def test_the_state_rescaled_round_robin_resumes_the_same() -> None:
    """List state dealt over 3 subtasks, then pooled and dealt over 2 (a rescale): the same
    epochs and record."""
    files = [obj(f"f{i}.parquet") for i in range(6)]
    _, items, _ = run_once([], files[:3])
    _, items, _ = run_once(items, files[:5])
    dealt = [items[i::3] for i in range(3)]
    rescaled = [i for s in assign_list_state(dealt, 2) for i in s]
    a = resume(items, files, "parquet", None, 1, 2)
    b = resume(rescaled, files, "parquet", None, 1, 2)
    assert (a.epochs, a.consumed) == (b.epochs, b.consumed)


def test_inspect_shows_the_record_in_one_line() -> None:
    from checkpointing.cli.inspection import _short_items

    record = Consumed(400, {f"s3://b/f{i}": (1, "e", None) for i in range(62)}).to_item()
    assert _short_items([record]) == "62 files read in epochs 0-399 (compacted)"


def test_the_schema_is_learnt_from_a_listed_file_when_earlier_epochs_are_compacted() -> None:
    files = [obj("a.parquet"), obj("b.parquet")]
    epochs: list[list[InputSplit]] = [[], [InputSplit("s3://b/gone.parquet")]]
    assert [s.path for s in schema_splits(epochs, 2, files)] == ["s3://b/a.parquet"]
    epochs.append([InputSplit("s3://b/b.parquet")])
    assert [s.path for s in schema_splits(epochs, 3, files)] == ["s3://b/b.parquet"]


def _rendered(table: Any) -> str:
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(table)
    return console.export_text()


def test_the_input_view_and_the_epochs_done_count_the_compacted_files() -> None:
    files = [obj(f"f{i}.parquet") for i in range(3)]
    _, items, _ = run_once([], files)
    _, items, _ = run_once(items, [*files, obj("g.parquet")])
    section = summarize_items(items)
    assert section["files_processed"] == 4 and section["next_epoch"] == 4
    assert section["bytes_processed"] == 40
    # the record's files are one row, "earlier runs (compacted)", over the compacted epochs
    earlier, last = section["runs"]
    assert (earlier["compacted"], earlier["attempt"], earlier["files"]) == (True, None, 3)
    assert (earlier["first_epoch"], earlier["last_epoch"]) == (0, 2)
    assert (last["compacted"], last["attempt"], last["first_epoch"]) == (False, "run", 3)
    assert "earlier runs (compacted)" in _rendered(input_table(section))
    _, items, _ = run_once(items, files)  # g gone, nothing new: only the record
    assert all("consumed" in i for i in items)
    assert summarize_items(items)["next_epoch"] == 4


def test_on_changed_input_is_validated_in_one_line(tmp_path: Path) -> None:
    def with_setting(value: str, text: str = SPEC) -> str:
        return text.replace("*.parquet}", f"*.parquet, on_changed_input: {value}}}")

    with pytest.raises(SpecError) as bad:
        load_spec_text(with_setting("skip"), tmp_path)
    assert "source.on_changed_input" in str(bad.value) and "\n" not in str(bad.value)
    with pytest.raises(SpecError, match="only a stateless job") as keyed:
        load_spec_text(with_setting("reprocess"), tmp_path)
    assert "\n" not in str(keyed.value)
    assert load_spec_text(with_setting("ignore"), tmp_path).source.on_changed_input == "ignore"
    stateless = with_setting(
        "reprocess", SPEC.replace("key: [user]\naggregations: {n: count()}\n", "")
    )
    assert load_spec_text(stateless, tmp_path).source.on_changed_input == "reprocess"


DAY_NS = 86_400 * 10**9


def test_max_file_age_keeps_the_record_the_size_of_the_window_when_nothing_expires() -> None:
    """400 daily runs of 3 new objects each, none ever deleted, ``source.max_file_age`` 30 days:
    the record holds the files of the last 30 days only (Spark's ``maxFileAge``, counted from
    the newest file read), every file is read exactly once, a late file older than the window is
    skipped (and said so) while one inside it is read, and the ``_metadata`` of the 400th run is
    the size of the 40th's. Without the setting the record names every file ever read."""
    age = timedelta(days=30)

    def landed(day: int) -> list[ObjectInfo]:
        return [
            ObjectInfo(f"s3://b/{day:04d}-{n}.parquet", 10, "e", day * DAY_NS + n) for n in range(3)
        ]

    listing: list[ObjectInfo] = []
    items: list[dict[str, Any]] = []
    unbounded: list[dict[str, Any]] = []
    read: list[str] = []
    sizes: dict[int, int] = {}
    for day in range(400):
        listing += landed(day)
        if day == 200:  # late arrivals: one 45 days old (skipped), one 10 days old (read)
            listing += [
                ObjectInfo("s3://b/late-old.parquet", 10, "e", (day - 45) * DAY_NS),
                ObjectInfo("s3://b/late-new.parquet", 10, "e", (day - 10) * DAY_NS),
            ]
        if has_progress(items):
            resumed = resume(items, listing, "parquet", None, 1, day, max_file_age=age)
            epochs, consumed = resumed.epochs, resumed.consumed
            if day == 200:
                assert "s3://b/late-old.parquet" in resumed.skipped
            first = consumed.epochs
            assert consumed.watermark == (day - 1) * DAY_NS + 2  # the newest file read so far
        else:
            epochs, consumed, first = (
                plan_epochs(plan_splits(listing, "parquet", None), 1, None),
                None,
                0,
            )
        read += [s.path for e in epochs[first:] for s in e]
        items = source_state(epochs, len(epochs), consumed, {}, f"run-{day}")
        sizes[day] = len(metadata_round_trip(items, day + 1, 1))
        _, unbounded, _ = run_once(unbounded, listing)
    assert len(read) == len(set(read)) == 1201  # every object once, and late-new
    assert "s3://b/late-new.parquet" in read and "s3://b/late-old.parquet" not in read
    record = Consumed.from_items(items)
    assert 85 <= len(record.files) <= 93  # ~30 days of 3 files (the last run's inline)
    assert min(p for p in record.files) >= f"s3://b/{399 - 31:04d}"
    assert sizes[399] <= 1.1 * sizes[40]
    assert len(Consumed.from_items(unbounded).files) == 1199  # all but the last run's 3


def test_max_file_age_on_local_files_counts_from_their_mtime(tmp_path: Path) -> None:
    """Local input: the write times are the files' mtimes; an old file read earlier is
    forgotten (and not read again), a new old-looking one is skipped."""

    def write(name: str, day: int) -> str:
        path = tmp_path / name
        path.write_text("x")
        os.utime(path, ns=(day * DAY_NS, day * DAY_NS))
        return str(path)

    files = [write("a.csv", 1), write("b.csv", 40)]
    _, items, _ = run_once([], files)  # an empty start reads everything, as Spark's first batch
    files += [write("c.csv", 5), write("d.csv", 41)]
    resumed = resume(items, files, "csv", None, 1, 2, max_file_age=timedelta(days=30))
    assert resumed.aged == [files[0]] and resumed.skipped == [files[0], files[2]]
    assert [s.path for e in resumed.epochs[resumed.consumed.epochs :] for s in e] == [files[3]]
    assert set(resumed.consumed.files) == {files[1]}


def test_max_file_age_is_validated_in_one_line(tmp_path: Path) -> None:
    def with_age(value: str) -> str:
        return SPEC.replace("*.parquet}", f"*.parquet, max_file_age: {value}}}")

    for bad in ("0s", "-1d", "soon"):
        with pytest.raises(SpecError) as refused:
            load_spec_text(with_age(bad), tmp_path)
        assert "source.max_file_age" in str(refused.value) and "\n" not in str(refused.value)
    assert load_spec_text(with_age("30d"), tmp_path).source.max_file_age == timedelta(days=30)


# ---------------------------------------------------------------------- the soak test


def metadata_round_trip(items: list[dict[str, Any]], checkpoint_id: int, parallelism: int) -> bytes:
    """The source's list state dealt over ``parallelism`` subtasks into a ``_metadata``."""
    now = datetime.now(UTC)
    subtasks = [
        SubtaskStateHandle(
            subtask_index=i,
            attempt_id=f"a{i}",
            handle=None,
            size=0,
            checksum=None,
            list_state=items[i::parallelism],
        )
        for i in range(parallelism)
    ]
    operator = OperatorState(
        operator_id=SOURCE, parallelism=parallelism, max_parallelism=128, subtasks=subtasks
    )
    return CheckpointMetadata(
        job_id="soak",
        checkpoint_id=checkpoint_id,
        checkpoint_type="checkpoint",
        trigger_at=now,
        completed_at=now,
        operators=[operator],
    ).to_bytes()


DAYS = 400


def test_soak_400_daily_runs_on_s3_with_a_30_day_lifecycle(
    s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """400 "days": 2 tiny objects land each day (a few rows each), a lifecycle step deletes
    those older than 30 days, then the day's run lists the bucket, resumes from the last
    ``_metadata`` (parsed back; rescaled over 1-3 subtasks), reads the new objects and writes
    its ``_metadata``. No run is refused, every object is read exactly once, the per-user sums
    equal an independent computation over everything landed, and the 400th run's ``_metadata``
    and planning time are within a small factor of the 10th run's."""
    from checkpointing.state import object_store

    s3 = object_store._client()
    # one client for the 400 listings (a run makes its own: ~0.1 s each, not what is measured)
    monkeypatch.setattr(object_store, "_client", lambda: s3)
    pattern = f"s3://{s3_bucket}/raw/*.json"
    landed: dict[str, int] = {}  # key -> day
    expected: dict[str, int] = {}
    table: dict[str, int] = {}
    reads: list[str] = []
    data = b""
    sizes: dict[int, int] = {}
    planning: dict[int, float] = {}
    for day in range(DAYS):
        for n in range(2):
            key = f"raw/{day:04d}-{n}.json"
            rows = [{"user": f"u{(day + n + r) % 7}", "v": day % 5 + r} for r in range(3)]
            s3.put_object(Bucket=s3_bucket, Key=key, Body=json.dumps(rows).encode())
            landed[key] = day
            for row in rows:
                expected[row["user"]] = expected.get(row["user"], 0) + row["v"]
        expired = [k for k, d in landed.items() if d < day - 30]  # the lifecycle rule
        if expired:
            s3.delete_objects(Bucket=s3_bucket, Delete={"Objects": [{"Key": k} for k in expired]})
            for key in expired:
                del landed[key]
        started = time.perf_counter()
        files = list_objects(pattern)
        if data:
            items = CheckpointMetadata.from_bytes(data, "_metadata").list_items(SOURCE)
            resumed = resume(items, files, "parquet", None, 1, day)
            epochs, consumed = resumed.epochs, resumed.consumed
            first = consumed.epochs
        else:
            epochs, consumed, first = (
                plan_epochs(plan_splits(files, "parquet", None), 1, None),
                None,
                0,
            )
        planning[day] = time.perf_counter() - started
        for epoch in epochs[first:]:
            for split in epoch:
                key = split.path.removeprefix(f"s3://{s3_bucket}/")
                for row in json.loads(s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read()):
                    table[row["user"]] = table.get(row["user"], 0) + row["v"]
                reads.append(key)
        state = source_state(epochs, len(epochs), consumed, {}, f"run-{day}")
        data = metadata_round_trip(state, day + 1, 1 + day % 3)
        sizes[day] = len(data)
    assert len(reads) == len(set(reads)) == 800
    assert table == expected
    # the listing grows to 31 days of objects, then stays: so does the state
    assert sizes[399] <= 4 * sizes[9] and sizes[399] <= 1.1 * sizes[40]
    late, early = (
        sorted(planning[d] for d in range(390, 400)),
        sorted(planning[d] for d in range(9, 19)),
    )
    assert late[5] <= 5 * early[5], (late, early)  # medians


# ---------------------------------------------------------------------- on Spark


@pytest.mark.parametrize("metastore_url", ["sqlite"], indirect=True)
def test_daily_runs_on_spark_over_an_expiring_inbox_equal_pandas(
    spark: Any, tmp_path: Path, metastore_url: str
) -> None:
    """Three daily runs of the keyed events pipeline, two files landing a day and the oldest
    day's files expired before the next run: no run is refused, each file is read once (its
    epoch's changelog holds exactly its keys), the final table equals pandas over everything
    ever landed, and the last checkpoint's source state no longer names the expired files. A
    file read earlier and rewritten since is refused by name."""
    import shutil

    from checkpointing.metastore import jobs
    from checkpointing.metastore.engine import Metastore
    from checkpointing.state.storage import FileSystemCheckpointStorage
    from tests.spark_pipeline import assert_matches_pandas, make_spec, run, tables, write_events

    files = sorted(write_events(tmp_path / "events").glob("*.parquet"))
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    spec = make_spec(tmp_path, "daily", f'{{format: parquet, path: "{inbox}/*.parquet"}}')
    metastore = Metastore(metastore_url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    for day in range(3):
        for f in files[2 * day : 2 * day + 2]:
            shutil.copy(f, inbox / f.name)
        if day:
            for f in files[2 * day - 2 : 2 * day]:  # the lifecycle: yesterday's files expire
                (inbox / f.name).unlink()
        result = run(spark, spec, metastore, storage)
        assert (result.epochs_total, result.epochs_run) == (2 * day + 2, [2 * day, 2 * day + 1])
    # the driver beat while it ran (and stopped with it)
    assert jobs.get_job(metastore, "daily").heartbeat_at is not None  # type: ignore[union-attr]
    final, changelog = tables(spark, spec)
    assert_matches_pandas(final, [pd.read_parquet(f) for f in files])
    for epoch, f in enumerate(files):
        assert set(changelog[changelog.epoch == epoch].user) == set(pd.read_parquet(f).user)
    latest = max((tmp_path / "ckpt").rglob("_metadata"), key=lambda p: p.stat().st_mtime_ns)
    text = latest.read_text()
    assert '"consumed"' in text and files[0].name not in text and files[3].name not in text

    # source.max_file_age: a late file written 10 days before the newest one read is skipped,
    # a fresh one is read
    aged = make_spec(
        tmp_path, "daily", f'{{format: parquet, path: "{inbox}/*.parquet", max_file_age: 2d}}'
    )
    newest = max((inbox / f.name).stat().st_mtime_ns for f in files[4:6])
    shutil.copy(files[0], inbox / "late-old.parquet")
    os.utime(inbox / "late-old.parquet", ns=(newest - 10 * DAY_NS, newest - 10 * DAY_NS))
    shutil.copy(files[1], inbox / "late-new.parquet")
    result = run(spark, aged, metastore, storage)
    assert (result.epochs_total, result.epochs_run) == (7, [6])
    _, changelog = tables(spark, aged)
    assert set(changelog[changelog.epoch == 6].user) == set(pd.read_parquet(files[1]).user)
    for name in ("late-old.parquet", "late-new.parquet"):
        (inbox / name).unlink()

    shutil.copy(files[0], inbox / files[5].name)  # the last file read, rewritten
    with pytest.raises(SplitError, match=rf"{files[5].name} was read by checkpoint \d+ and has"):
        run(spark, spec, metastore, storage)
