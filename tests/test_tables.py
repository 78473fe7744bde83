"""Static tables without Spark: the spec's ``tables:`` and ``transform:``, their files'
identity as items of the source's list state (never taken for splits), and the comparison a
restore makes (refused naming the table and the file, or the change returned to record)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from checkpointing.pipeline.spec import SpecError, load_spec
from checkpointing.pipeline.splits import InputSplit, is_table_item, processed_item, resume
from checkpointing.pipeline.tables import (
    TableChangedError,
    check_tables,
    table_changes,
    table_files,
    table_items,
)

SPEC = """
job: joined
source: {format: parquet, path: "in/*.parquet"}
tables:
  planes: {format: parquet, path: "${CKPT_HOME}/planes/*.parquet"}
  codes: {format: csv, path: codes.csv}
transform: SELECT * FROM input JOIN planes USING (tailnum)
key: tailnum
aggregations: {n: count()}
sink: {path: out}
"""


def write_spec(tmp_path: Path, text: str = SPEC) -> Path:
    path = tmp_path / "joined.yaml"
    path.write_text(text)
    return path


def test_tables_and_transform_in_the_spec(tmp_path: Path) -> None:
    home = tmp_path / "home"
    spec = load_spec(write_spec(tmp_path), home=home)
    assert spec.tables["planes"].path == f"{home}/planes/*.parquet"  # ${CKPT_HOME} expanded
    assert spec.tables["codes"].format == "csv" and spec.tables["codes"].header
    assert spec.transform is not None and spec.transform.startswith("SELECT")
    for table, problem in [
        ("input: {format: parquet, path: x.parquet}", "'input' is not a table name"),
        ("a-b: {format: parquet, path: x.parquet}", "'a-b' is not a table name"),
        ("t: {format: csv, path: 's3://b/t.csv'}", "s3:// tables are read as Parquet only"),
        (
            "t: {format: parquet, path: x, haeder: 1}",
            "tables.t.haeder: unknown field (did you mean 'header'?)",
        ),
        ("t: {format: parquet, path: '${HOME}/x'}", "tables.t.path: unknown variable ${HOME}"),
    ]:
        text = SPEC.replace("  codes: {format: csv, path: codes.csv}", f"  {table}")
        with pytest.raises(SpecError, match=re.escape(problem)):
            load_spec(write_spec(tmp_path, text), home=home)
    with pytest.raises(SpecError, match=r"tables: nothing joins them: add a transform"):
        load_spec(write_spec(tmp_path, SPEC.replace("transform:", "# transform:")))
    with pytest.raises(SpecError, match=r"transform: .*is empty"):
        load_spec(write_spec(tmp_path, SPEC.replace("SELECT * FROM input JOIN", "' '\n#")))


def test_table_files_are_listed_with_their_identity(tmp_path: Path) -> None:
    home = tmp_path / "home"
    spec = load_spec(write_spec(tmp_path), home=home)
    with pytest.raises(
        SpecError, match=r"tables\.planes\.path: '.*/planes/\*\.parquet' matches no"
    ):
        table_files(spec)
    (home / "planes").mkdir(parents=True)
    for name in ("b.parquet", "a.parquet"):
        (home / "planes" / name).write_bytes(b"x" * 3)
    (tmp_path / "codes.csv").write_text("code\n1\n")
    items = table_items(table_files(spec))
    assert [(i["table"], os.path.basename(i["path"])) for i in items] == [
        ("planes", "a.parquet"),
        ("planes", "b.parquet"),
        ("codes", "codes.csv"),
    ]
    stat = os.stat(tmp_path / "codes.csv")
    assert items[2] == {
        "table": "codes",
        "path": str(tmp_path / "codes.csv"),
        "size": stat.st_size,
        "mtime": stat.st_mtime_ns,
    }
    assert all(is_table_item(i) and "epoch" not in i for i in items)


PLANES = {"table": "planes", "path": "s3://b/planes.parquet", "size": 10, "etag": "e1"}


def test_a_restore_over_changed_tables_is_refused_naming_the_table_and_file() -> None:
    assert check_tables([PLANES], [dict(PLANES)], 4) is None
    cases = [
        ([{**PLANES, "etag": "e2"}], r"tables\.planes: s3://b/planes\.parquet has changed since "
         r"checkpoint 4 \(size/etag/mtime 10/e1/- then, 10/e2/- now\)"),
        ([PLANES, {**PLANES, "path": "s3://b/more.parquet"}],
         r"tables\.planes: s3://b/more\.parquet was added since checkpoint 4"),
        ([], r"tables\.planes: was joined by checkpoint 4 and is no longer in the spec"),
        ([PLANES, {**PLANES, "table": "codes"}],
         r"tables\.codes: is not in checkpoint 4 \(added to the spec since\)"),
    ]  # fmt: skip
    for now, message in cases:
        with pytest.raises(TableChangedError, match=message):
            check_tables([PLANES], now, 4)
    more = {**PLANES, "path": "s3://b/more.parquet"}
    with pytest.raises(
        TableChangedError, match=r"s3://b/more\.parquet, joined by checkpoint 4, is"
    ):
        check_tables([PLANES, more], [PLANES, {"path": "not a table's"}], 4)
    changed = check_tables([PLANES], [{**PLANES, "size": 11}], 4, allow_changed=True)
    assert changed == {
        "planes": {
            "added": [],
            "removed": [],
            "changed": ["s3://b/planes.parquet"],
            "identity": {"s3://b/planes.parquet": ["10/e1/-", "11/e1/-"]},
        }
    }
    assert table_changes([], [PLANES]) == {
        "planes": {"status": "added to the spec", "files": ["s3://b/planes.parquet"]}
    }


def test_table_items_in_the_source_state_are_not_splits(tmp_path: Path) -> None:
    """``resume`` (and so the preflight and the runtime's restore) reads only the
    splits of the source's state: a table's file is neither pinned nor planned."""
    files = []
    for name in ("a.csv", "b.csv", "c.csv"):
        (tmp_path / name).write_text("x\n1\n")
        files.append(str(tmp_path / name))
    split = InputSplit(files[0], **_identity(files[0]))
    items = [processed_item(split, 0, "run-1"), {**PLANES, "path": files[2]}]
    epochs = resume(items, files[:2], "csv", None, 1, 3).epochs
    assert [[s.path for s in e] for e in epochs] == [[files[0]], [files[1]]]


def _identity(path: str) -> dict[str, int]:
    stat = os.stat(path)
    return {"size": stat.st_size, "mtime": stat.st_mtime_ns}
