"""The two-phase-commit Parquet sink on a real local Spark session.

What is on disk is checked without the sink object where it matters: ``os`` for names, pyarrow
for the Parquet contents (an independent reader of what Spark wrote).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from pyspark.errors import PySparkException

from checkpointing.errors import ConfigError, InvalidIdError, StorageError
from checkpointing.sinks.guard import write_marker
from checkpointing.spark.parquet_sink import TwoPhaseCommitSink


def _epoch_frame(spark: Any, epoch: int, rows: int, tag: str = "a") -> Any:
    """``rows`` changelog rows produced in ``epoch``; ``tag`` tells copies of one epoch apart."""
    return spark.range(rows).selectExpr(
        f"CAST({epoch} AS BIGINT) AS produced_in", "id AS k", f"'{tag}' AS tag"
    )


def _failing_frame(spark: Any) -> Any:
    """Analyses fine, fails while Spark evaluates it (after other tasks may have written)."""
    return spark.range(0, 100, 1, 4).selectExpr(
        "if(id = 99, raise_error('boom'), id) AS k", "'x' AS tag"
    )


def _rows(path: Path) -> list[dict[str, Any]]:
    """Read a Parquet directory with pyarrow (skips ``_SUCCESS`` and ``.crc`` files)."""
    rows: list[dict[str, Any]] = pq.read_table(str(path)).to_pylist()
    return sorted(rows, key=lambda r: r["k"])


def _names(directory: Path) -> list[str]:
    return sorted(os.listdir(directory)) if directory.exists() else []


def _temp_leftovers(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.name.endswith((".inprogress", ".discarded"))
    )


@pytest.fixture
def sink(tmp_path: Path) -> TwoPhaseCommitSink:
    return TwoPhaseCommitSink(tmp_path / "sink")


# ============================================================================ stage and commit


def test_stage_then_commit_moves_epochs_and_recommit_is_a_no_op(
    spark: Any, sink: TwoPhaseCommitSink
) -> None:
    for epoch in (0, 1, 2):
        sink.stage(epoch, _epoch_frame(spark, epoch, rows=epoch + 2))
    assert sink.staged_epochs() == [0, 1, 2]
    assert sink.committed_epochs() == []
    assert _names(sink.staging_dir) == ["epoch-0", "epoch-1", "epoch-2"]

    assert sink.commit(up_to_epoch=1) == [0, 1]
    assert sink.staged_epochs() == [2]
    assert sink.committed_epochs() == [0, 1]
    assert _names(sink.staging_dir) == ["epoch-2"]
    assert _names(sink.changelog_dir) == ["epoch=0", "epoch=1"]
    assert _rows(sink.changelog_dir / "epoch=1") == [
        {"produced_in": 1, "k": k, "tag": "a"} for k in range(3)
    ]

    assert sink.commit(1) == []  # the same notification twice
    assert sink.commit(0) == []  # an older one arriving late
    assert sink.commit(2) == [2]
    assert sink.commit(7) == []
    assert sink.committed_epochs() == [0, 1, 2]
    assert sink.staged_epochs() == []
    assert _temp_leftovers(sink.path) == []


def test_restaging_an_epoch_keeps_only_the_latest_copy(
    spark: Any, sink: TwoPhaseCommitSink
) -> None:
    sink.stage(3, _epoch_frame(spark, 3, rows=4, tag="old"))
    sink.stage(3, _epoch_frame(spark, 3, rows=2, tag="new"))  # its checkpoint was aborted
    assert sink.staged_epochs() == [3]
    assert _names(sink.staging_dir) == ["epoch-3"]  # no older copy, no temp directory
    assert _rows(sink.staging_dir / "epoch-3") == [
        {"produced_in": 3, "k": k, "tag": "new"} for k in range(2)
    ]
    assert sink.commit(3) == [3]
    assert {r["tag"] for r in _rows(sink.changelog_dir / "epoch=3")} == {"new"}


def test_failed_stage_leaves_no_staged_epoch_and_no_temp_directory(
    spark: Any, sink: TwoPhaseCommitSink
) -> None:
    sink.stage(4, _epoch_frame(spark, 4, rows=3, tag="good"))

    with pytest.raises(PySparkException, match="boom"):
        sink.stage(5, _failing_frame(spark))
    with pytest.raises(PySparkException, match="boom"):
        sink.stage(4, _failing_frame(spark))  # a failed re-stage keeps the older copy

    assert sink.staged_epochs() == [4]
    assert _names(sink.staging_dir) == ["epoch-4"]
    assert _temp_leftovers(sink.path) == []
    assert {r["tag"] for r in _rows(sink.staging_dir / "epoch-4")} == {"good"}
    assert sink.commit(5) == [4]
    assert sink.committed_epochs() == [4]


def test_an_empty_epoch_is_staged_and_committed(spark: Any, sink: TwoPhaseCommitSink) -> None:
    sink.stage(0, _epoch_frame(spark, 0, rows=0))
    sink.stage(1, _epoch_frame(spark, 1, rows=2))
    assert sink.commit(1) == [0, 1]
    counts = Counter(r["epoch"] for r in sink.read_changelog(spark).collect())
    assert counts == {1: 2}


def test_a_dataframe_with_its_own_epoch_column_is_refused(
    spark: Any, sink: TwoPhaseCommitSink
) -> None:
    with pytest.raises(ValueError, match="epoch"):
        sink.stage(0, spark.range(2).selectExpr("id AS Epoch"))
    assert sink.staged_epochs() == []


# ============================================================================ crashes and restore


def test_commit_interrupted_between_renames_is_finished_by_the_next_commit(
    spark: Any, sink: TwoPhaseCommitSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    for epoch in range(4):
        sink.stage(epoch, _epoch_frame(spark, epoch, rows=epoch + 1))

    # the process dies after committing epochs 0 and 1 of a notification for <= 3
    real_rename = os.rename
    renames: list[str] = []

    def crash_on_third_commit(src: Any, dst: Any) -> None:
        if Path(dst).parent == sink.changelog_dir:
            renames.append(Path(dst).name)
            if len(renames) == 3:
                raise OSError(5, "simulated crash")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", crash_on_third_commit)
    with pytest.raises(StorageError, match="simulated crash"):
        sink.commit(3)
    monkeypatch.undo()
    assert sink.committed_epochs() == [0, 1]
    assert sink.staged_epochs() == [2, 3]

    assert sink.commit(1) == []  # a partial re-notification changes nothing
    assert sink.commit(3) == [2, 3]
    assert sink.commit(3) == []
    assert sink.committed_epochs() == [0, 1, 2, 3]
    assert sink.staged_epochs() == []
    counts = Counter(r["epoch"] for r in sink.read_changelog(spark).collect())
    assert counts == {0: 1, 1: 2, 2: 3, 3: 4}


def test_recover_commits_covered_epochs_discards_later_ones_and_sweeps_temp_files(
    spark: Any, sink: TwoPhaseCommitSink
) -> None:
    for epoch in range(5):
        sink.stage(epoch, _epoch_frame(spark, epoch, rows=2))
    assert sink.commit(1) == [0, 1]
    # the checkpoint covering <= 3 completed, then the process died before commit(3) ran;
    # it also left a half-written stage and an unfinished final publish behind (the sink's own
    # temp names, and a final table it published, with its marker, but never swapped in)
    hex_ = "0123abcd" * 4
    leftovers = [
        sink.staging_dir / f".epoch-5.{hex_}.inprogress",
        sink.path / f".final-x.{hex_}.inprogress",
        sink.path / "final-never-swapped",
    ]
    for leftover in leftovers:
        leftover.mkdir()
        (leftover / "part-0.parquet").write_bytes(b"partial")
    write_marker(sink.path / "final-never-swapped", {"job": None, "token": "never-swapped"})

    assert sink.recover(3) == ([2, 3], [4])
    assert sink.committed_epochs() == [0, 1, 2, 3]
    assert sink.staged_epochs() == []
    assert _names(sink.staging_dir) == []
    assert _names(sink.path) == ["_ckpt_sink", "_staging", "changelog"]

    assert sink.recover(3) == ([], [])  # restoring twice from the same checkpoint
    counts = Counter(r["epoch"] for r in sink.read_changelog(spark).collect())
    assert counts == {0: 2, 1: 2, 2: 2, 3: 2}


def test_recover_without_a_checkpoint_discards_every_staged_epoch(
    spark: Any, sink: TwoPhaseCommitSink
) -> None:
    assert sink.recover(None) == ([], [])  # nothing there yet: fine
    sink.stage(0, _epoch_frame(spark, 0, rows=1))
    sink.stage(1, _epoch_frame(spark, 1, rows=1))
    assert sink.recover(None) == ([], [0, 1])
    assert sink.staged_epochs() == []
    assert sink.committed_epochs() == []


def test_a_recomputed_epoch_that_is_already_committed_is_not_committed_twice(
    spark: Any, sink: TwoPhaseCommitSink
) -> None:
    sink.stage(0, _epoch_frame(spark, 0, rows=3, tag="first"))
    sink.stage(1, _epoch_frame(spark, 1, rows=3, tag="first"))
    assert sink.commit(1) == [0, 1]
    # restore from an older checkpoint (covering <= 0): epoch 1 is recomputed and staged again
    assert sink.recover(0) == ([], [])
    sink.stage(1, _epoch_frame(spark, 1, rows=3, tag="recomputed"))
    assert sink.staged_epochs() == [1]
    assert sink.commit(1) == []  # the first commit wins; the staged copy is dropped
    assert sink.staged_epochs() == []
    assert {r["tag"] for r in _rows(sink.changelog_dir / "epoch=1")} == {"first"}


def test_read_changelog_has_each_committed_epochs_rows_exactly_once(
    spark: Any, sink: TwoPhaseCommitSink
) -> None:
    with pytest.raises(StorageError, match="no committed epochs"):
        sink.read_changelog(spark)
    for epoch in range(4):
        sink.stage(epoch, _epoch_frame(spark, epoch, rows=epoch + 2))
    sink.commit(1)
    sink.stage(2, _epoch_frame(spark, 2, rows=4))  # re-staged: only this copy may appear
    sink.commit(2)

    df = sink.read_changelog(spark)
    assert dict(df.dtypes)["epoch"] == "bigint"
    rows = [(r["epoch"], r["produced_in"], r["k"]) for r in df.collect()]
    assert len(rows) == len(set(rows))
    assert all(epoch == produced_in for epoch, produced_in, _ in rows)
    assert Counter(epoch for epoch, _, _ in rows) == {0: 2, 1: 3, 2: 4}  # staged epoch 3 absent


# ============================================================================ final table


def test_publish_final_twice_points_to_the_second_and_removes_the_first(
    spark: Any, sink: TwoPhaseCommitSink
) -> None:
    with pytest.raises(StorageError, match="no final table"):
        sink.read_final(spark)

    first = sink.publish_final(spark.range(3), "run-1")
    assert first == str(sink.path / "final-run-1")
    assert os.readlink(sink.final_link) == "final-run-1"
    assert sink.read_final(spark).count() == 3

    second = sink.publish_final(spark.range(5), "run-2")
    assert second == str(sink.path / "final-run-2")
    assert os.readlink(sink.final_link) == "final-run-2"
    assert not os.path.exists(first)
    assert _names(sink.path) == ["_ckpt_sink", "final", "final-run-2"]
    assert [r["id"] for r in pq.read_table(str(sink.final_link)).to_pylist()] == list(range(5))
    assert sink.read_final(spark).count() == 5

    # the token is an idempotency key: a retried publish of run-2 writes nothing
    assert sink.publish_final(spark.range(9), "run-2") == second
    assert sink.read_final(spark).count() == 5
    assert _names(sink.path) == ["_ckpt_sink", "final", "final-run-2"]


def test_a_failed_publish_keeps_the_previous_final_table(
    spark: Any, sink: TwoPhaseCommitSink
) -> None:
    sink.publish_final(spark.range(3), "ok")
    with pytest.raises(PySparkException, match="boom"):
        sink.publish_final(_failing_frame(spark), "broken")
    assert os.readlink(sink.final_link) == "final-ok"
    assert _names(sink.path) == ["_ckpt_sink", "final", "final-ok"]
    assert sink.read_final(spark).count() == 3


def test_final_is_never_missing_or_partial_while_it_is_republished(
    spark: Any, sink: TwoPhaseCommitSink
) -> None:
    rows_per_version = 40

    def version(v: int) -> Any:
        return spark.range(0, rows_per_version, 1, 4).selectExpr("id AS k", f"{v} AS version")

    sink.publish_final(version(0), "v0")
    final = str(sink.final_link)
    stop = threading.Event()
    problems: list[str] = []
    reads = Counter[str]()

    def reader() -> None:
        while not stop.is_set():
            try:
                if not os.path.exists(final):
                    problems.append("final is missing")
                    continue
                before = os.readlink(final)
                try:
                    table = pq.read_table(final)
                except Exception as exc:
                    if os.readlink(final) != before:
                        reads["superseded"] += 1  # the version being read was swapped out
                    else:
                        problems.append(f"reading {before} failed: {exc!r}")
                    continue
                if os.readlink(final) != before:
                    # swapped (and the old version deleted) while reading: readers of an old
                    # version may see it vanish; the guarantee is about `final` itself
                    reads["superseded"] += 1
                    continue
                versions = set(table.column("version").to_pylist())
                if len(versions) != 1 or table.num_rows != rows_per_version:
                    problems.append(f"partial table: {table.num_rows} rows, versions {versions}")
                else:
                    reads["whole"] += 1
            except Exception as exc:
                problems.append(f"reader: {exc!r}")
            time.sleep(0.001)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        for v in range(1, 6):
            sink.publish_final(version(v), f"v{v}")
    finally:
        stop.set()
        thread.join(timeout=30)
    assert problems == []
    assert reads["whole"] > 0
    assert os.readlink(final) == "final-v5"
    assert _names(sink.path) == ["_ckpt_sink", "final", "final-v5"]
    assert {r["version"] for r in sink.read_final(spark).collect()} == {5}


# ============================================================================ validation


@pytest.mark.parametrize("epoch", [-1, 2**63, 1.0, "3", True, None])
def test_bad_epochs_are_refused_before_anything_is_written(
    spark: Any, sink: TwoPhaseCommitSink, epoch: Any
) -> None:
    with pytest.raises(InvalidIdError):
        sink.stage(epoch, spark.range(1))
    with pytest.raises(ValueError):  # InvalidIdError is a ValueError
        sink.commit(epoch)
    if epoch is not None:
        with pytest.raises(InvalidIdError):
            sink.recover(epoch)
    assert not sink.path.exists()


@pytest.mark.parametrize("token", ["", "../x", "a/b", ".hidden", "x..y", "a b", "x" * 129, 7, None])
def test_bad_tokens_are_refused_before_anything_is_written(
    spark: Any, sink: TwoPhaseCommitSink, token: Any
) -> None:
    with pytest.raises(InvalidIdError):
        sink.publish_final(spark.range(1), token)
    assert not sink.path.exists()


def test_sink_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert TwoPhaseCommitSink(f"file://{tmp_path}/out").path == tmp_path / "out"
    assert TwoPhaseCommitSink(str(tmp_path / "a" / ".." / "out")).path == tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    assert TwoPhaseCommitSink(Path("rel")).path == tmp_path / "rel"
    for bad in ["s3://bucket/prefix", "s3a://bucket/x", "file://relative/x", "", f"{tmp_path}/a*"]:
        with pytest.raises(ConfigError):
            TwoPhaseCommitSink(bad)


def test_a_step_output_is_published_by_links_marked_and_never_through_a_symlink(
    tmp_path: Path,
) -> None:
    """``ck.write``'s publish links the output step's files (the same bytes, no second write),
    marks the table as Spark's writer does (``_SUCCESS``) and refuses a symbolic link."""
    from checkpointing.errors import StorageError
    from checkpointing.spark.parquet_sink import _link_parquet

    step = tmp_path / "step"
    step.mkdir()
    part = step / "part-00000-x.snappy.parquet"
    part.write_bytes(b"PAR1 rows PAR1")
    _link_parquet([part], tmp_path / "table")
    linked = tmp_path / "table" / part.name
    assert linked.read_bytes() == part.read_bytes() and linked.stat().st_ino == part.stat().st_ino
    assert (tmp_path / "table" / "_SUCCESS").is_file()
    part.unlink()  # a checkpoint released later: the table keeps its file
    assert linked.read_bytes() == b"PAR1 rows PAR1"

    (tmp_path / "secret").write_bytes(b"not ours")
    planted = step / "part-00001-y.snappy.parquet"
    planted.symlink_to(tmp_path / "secret")
    with pytest.raises(StorageError, match="symbolic link"):
        _link_parquet([planted], tmp_path / "table2")
    assert not (tmp_path / "table2").exists()  # nothing left behind
