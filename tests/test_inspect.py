"""``ckpt inspect``: reading the state inside real checkpoints (Flink's State Processor API).

A real Spark run crashes after 2 of 6 epochs (one run per metastore backend, shared by the
module): its two checkpoints must hold exactly the partial aggregates pandas computes from the
first 1 and 2 input files, a key lookup must return exactly that key's row while reading only the
file of its key group, list state must be the consumed and remaining splits, and corrupt or
misplaced files must be refused. Multi-column typed keys are checked on a checkpoint whose key
groups Spark computed."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from sqlalchemy import update
from typer.testing import CliRunner

from checkpointing.cli import app
from checkpointing.config import CheckpointConfig
from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.coordination.pending import TaskAck, TaskSpec
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint
from checkpointing.restore.state_reader import KEY_COLUMNS_METADATA, inspect_state
from checkpointing.state.keygroups import key_group_for, key_group_range
from checkpointing.state.metadata import read_metadata
from checkpointing.state.snapshot import read_snapshot_info, write_keyed_snapshot
from checkpointing.state.storage import FileSystemCheckpointStorage, checksum_of
from tests.spark_pipeline import EPOCHS, completed_ids, events_spec, run, write_events

MAX_P = 16
STATE = [
    "__cnt_n",
    "__cnt_n_amount",
    "__sum_total",
    "__sum_avg_amount",
    "__cnt_avg_amount",
    "__max_max_q",
    "__min_min_q",
]


@dataclass
class Backend:
    url: str
    metastore: Metastore


@dataclass
class Crashed:
    backend: Backend
    storage: FileSystemCheckpointStorage
    job: str
    files: list[Path]
    #: checkpoint id -> number of epochs (input files) it covers
    covers: dict[int, int]


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def backend(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Backend]:
    """A metastore for the module. On PostgreSQL the session's database: job ids here are
    unique, and no test in this module truncates it."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('inspect-db') / 'metastore.db'}"
        Metastore(url, check_schema=False).upgrade()
    else:
        url = request.getfixturevalue("pg_url")
    metastore = Metastore(url)
    yield Backend(url, metastore)
    metastore.dispose()


@pytest.fixture(scope="module")
def crashed(backend: Backend, spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Crashed:
    from checkpointing.spark.runtime import SimulatedCrash

    workdir = tmp_path_factory.mktemp("inspect")
    events = write_events(workdir / "events")
    job = f"inspect-{uuid.uuid4().hex[:8]}"
    storage = FileSystemCheckpointStorage(f"file://{workdir / 'ckpt'}")
    with pytest.raises(SimulatedCrash):
        run(
            spark,
            # full snapshots: these tests read each checkpoint's own files (inspecting
            # incremental chains: tests/test_incremental_checkpoints.py)
            events_spec(
                workdir,
                events,
                job,
                checkpoint={"every_epochs": 1, "retained": 2, "incremental": False},
            ),
            backend.metastore,
            storage,
            crash_after_epochs=2,
        )
    first, second = completed_ids(backend.metastore, job)
    files = sorted(events.glob("*.parquet"))
    return Crashed(backend, storage, job, files, {first: 1, second: 2})


def ckpt(backend: Backend, storage: FileSystemCheckpointStorage, *args: str) -> Any:
    result = CliRunner().invoke(
        app, ["--metastore-url", backend.url, "--storage-url", storage.base_url, *args]
    )
    assert "Traceback" not in result.output, result.output
    return result


def inspect_json(c: Crashed, *args: str) -> dict[str, Any]:
    result = ckpt(c.backend, c.storage, "inspect", c.job, *args, "--json")
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def expected_state(files: list[Path]) -> pd.DataFrame:
    """The partial aggregates per user after reading ``files``, computed with pandas."""
    g = pd.concat(pd.read_parquet(f) for f in files).groupby("user", sort=True)
    amount = g["amount"]
    return pd.DataFrame(
        {
            "__cnt_n": g.size(),
            "__cnt_n_amount": amount.count(),
            "__sum_total": amount.sum(min_count=1),
            "__sum_avg_amount": amount.sum(min_count=1),
            "__cnt_avg_amount": amount.count(),
            "__max_max_q": g["quantity"].max(),
            "__min_min_q": g["quantity"].min(),
        }
    ).reset_index()


def file_of_group(c: Crashed, checkpoint_id: int, group: int) -> str:
    chk = c.storage.path_of(c.storage.checkpoint_url(c.job, checkpoint_id))
    [path] = [p for p in chk.glob("aggregate-*.arrow") if group in read_snapshot_info(p).groups]
    return path.as_uri()


# --------------------------------------------------------------------------- keyed state


def test_every_row_equals_pandas_at_the_checkpoint_epoch(crashed: Crashed) -> None:
    for checkpoint_id, epochs in crashed.covers.items():
        data = inspect_json(crashed, str(checkpoint_id), "--operator", "aggregate", "--limit", "0")
        assert data["kind"] == "keyed"
        assert data["key_columns"] == ["user"]
        assert data["columns"] == ["user", *STATE, "key_group"]
        assert data["truncated"] is False
        assert len(data["files_read"]) == 3  # parallelism 3
        got = pd.DataFrame(data["rows"])
        assert list(got.key_group) == sorted(got.key_group)  # key-group order
        assert all(
            key_group_for([u], MAX_P) == g for u, g in zip(got.user, got.key_group, strict=True)
        )
        got = got.sort_values("user").reset_index(drop=True)
        pd.testing.assert_frame_equal(
            got[["user", *STATE]],
            expected_state(crashed.files[:epochs]),
            check_dtype=False,
            check_exact=False,
        )


@pytest.mark.parametrize("user", ["u0", "u17", "u299"])
def test_key_lookup_returns_the_pandas_row_reading_one_file(crashed: Crashed, user: str) -> None:
    group = key_group_for([user], MAX_P)
    for checkpoint_id, epochs in crashed.covers.items():
        data = inspect_json(crashed, str(checkpoint_id), "--operator", "aggregate", "--key", user)
        expected = expected_state(crashed.files[:epochs])
        expected = expected[expected.user == user].to_dict("records")
        assert data["key"] == [user]
        assert data["key_group"] == group
        assert data["files_read"] == [file_of_group(crashed, checkpoint_id, group)]
        if not expected:  # this key has no events in these epochs: no state
            assert data["rows"] == []
            continue
        [row] = data["rows"]
        assert row["key_group"] == group
        assert row["user"] == user
        for column in STATE:
            assert row[column] == pytest.approx(expected[0][column]), column


def test_core_api_equals_the_cli(crashed: Crashed) -> None:
    checkpoint_id = max(crashed.covers)
    view = inspect_state(
        crashed.backend.metastore,
        crashed.storage,
        crashed.job,
        checkpoint_id,
        "aggregate",
        key=["u0"],
    )
    assert view.to_dict() == inspect_json(
        crashed, str(checkpoint_id), "--operator", "aggregate", "--key", "u0"
    )


def test_absent_key_has_no_state(crashed: Crashed) -> None:
    checkpoint_id = max(crashed.covers)
    data = inspect_json(crashed, str(checkpoint_id), "--operator", "aggregate", "--key", "nobody")
    assert data["rows"] == []
    assert data["key_group"] == key_group_for(["nobody"], MAX_P)
    result = ckpt(
        crashed.backend,
        crashed.storage,
        "inspect",
        crashed.job,
        str(checkpoint_id),
        "--operator",
        "aggregate",
        "--key",
        "nobody",
    )
    assert result.exit_code == 0
    assert "no state for key ('nobody',)" in result.stdout


def test_limit_and_table(crashed: Crashed) -> None:
    checkpoint_id = max(crashed.covers)
    data = inspect_json(crashed, str(checkpoint_id), "--operator", "aggregate", "--limit", "5")
    assert len(data["rows"]) == 5 and data["truncated"] is True
    assert [r["key_group"] for r in data["rows"]] == [0] * 5  # from the first key group
    result = ckpt(
        crashed.backend,
        crashed.storage,
        "inspect",
        crashed.job,
        str(checkpoint_id),
        "--operator",
        "aggregate",
        "--key",
        "u0",
    )
    assert result.exit_code == 0, result.output
    assert f"key ('u0',) (key group {key_group_for(['u0'], MAX_P)})" in result.stdout
    assert "__cnt_n" in result.stdout and "u0" in result.stdout


# --------------------------------------------------------------------------- list state


def test_list_state_is_the_consumed_and_remaining_splits_and_staged(crashed: Crashed) -> None:
    for checkpoint_id, epochs in crashed.covers.items():
        source = inspect_json(crashed, str(checkpoint_id), "--operator", "source")
        assert source["kind"] == "list"
        items = sorted(
            (r["item"]["epoch"], r["item"]["path"], bool(r["item"].get("processed")))
            for r in source["rows"]
        )  # the splits processed (the input consumed), then those still to read
        assert items == [(e, str(crashed.files[e]), e < epochs) for e in range(EPOCHS)]
        assert {r["subtask"] for r in source["rows"]} == {0, 1, 2}
        sink = inspect_json(crashed, str(checkpoint_id), "--operator", "sink")
        assert sink["rows"] and all(r["item"]["epoch"] < epochs for r in sink["rows"])
    table = ckpt(
        crashed.backend, crashed.storage, "inspect", crashed.job, "1", "--operator", "source"
    )
    assert table.exit_code == 0
    assert crashed.files[EPOCHS - 1].name in table.stdout


def test_operators_are_listed_without_operator(crashed: Crashed) -> None:
    checkpoint_id = max(crashed.covers)
    result = ckpt(crashed.backend, crashed.storage, "inspect", crashed.job, str(checkpoint_id))
    assert result.exit_code == 0, result.output
    assert all(op in result.stdout for op in ("aggregate", "sink", "source"))
    data = json.loads(
        ckpt(
            crashed.backend, crashed.storage, "inspect", crashed.job, str(checkpoint_id), "--json"
        ).stdout
    )
    assert [(o["operator_id"], o["kind"], o["files"]) for o in data] == [
        ("aggregate", "keyed", 3),
        ("sink", "list", 0),
        ("source", "list", 0),
    ]


# --------------------------------------------------------------------------- refusals


def test_errors_are_one_line_with_exit_1(crashed: Crashed) -> None:
    job, cid = crashed.job, str(max(crashed.covers))
    cases = [
        (["inspect", "nope", "1", "--operator", "aggregate"], "unknown job 'nope'"),
        (["inspect", job, "99", "--operator", "aggregate"], f"job {job} has no checkpoint 99"),
        (
            ["inspect", job, cid, "--operator", "joiner"],
            f"checkpoint {cid} of job {job} has no operator 'joiner'; its operators: "
            "aggregate, sink, source",
        ),
        (["inspect", job, cid, "--operator", "source", "--key", "u1"], "not keyed state"),
        (
            ["inspect", job, cid, "--operator", "aggregate", "--key", "u1", "--key", "2"],
            "keyed by 1 column(s) (user); give one key value per column",
        ),
        (
            [
                "inspect",
                job,
                cid,
                "--operator",
                "aggregate",
                "--key",
                "9",
                "--key-columns=__max_max_q",
            ],
            "is not the key of operator 'aggregate'",
        ),
    ]
    for args, message in cases:
        result = ckpt(crashed.backend, crashed.storage, *args)
        assert result.exit_code == 1, (args, result.output)
        assert message in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1


def test_corrupt_file_is_refused_and_other_files_still_read(crashed: Crashed) -> None:
    checkpoint_id = max(crashed.covers)
    group = key_group_for(["u0"], MAX_P)
    victim = crashed.storage.path_of(file_of_group(crashed, checkpoint_id, group))
    other = next(
        f"u{i}"
        for i in range(300)
        if file_of_group(crashed, checkpoint_id, key_group_for([f"u{i}"], MAX_P)) != victim.as_uri()
    )
    original = victim.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0x01  # same size: only the checksum tells
    try:
        victim.write_bytes(bytes(data))
        args = ["inspect", crashed.job, str(checkpoint_id), "--operator", "aggregate"]
        result = ckpt(crashed.backend, crashed.storage, *args, "--key", "u0")
        assert result.exit_code == 1
        assert f"{victim.as_uri()}: checksum mismatch" in result.stderr
        result = ckpt(crashed.backend, crashed.storage, *args, "--key", other, "--json")
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["rows"][0]["user"] == other
    finally:
        victim.write_bytes(original)


# --------------------------------------------------------------------------- typed keys

ROUTES = ["EWR", "JFK", "LGA"]
KEY = ["origin", "flight", "day"]


def typed_checkpoint(
    spark: Any, backend: Backend, storage: FileSystemCheckpointStorage, *, recorded: bool
) -> tuple[str, int, pa.Table]:
    """A completed checkpoint of keyed state with a (string, long, date) key whose key groups
    Spark computed; with ``recorded`` the columns come in another order and the snapshot
    records the key columns in its schema metadata."""
    from checkpointing.spark.keys import key_group_column

    rows = [(ROUTES[i % 3], 1000 + i % 40, dt.date(2013, 1, 1 + i % 5), i) for i in range(120)]
    df = spark.createDataFrame(rows, "origin string, flight long, day date, __cnt_n long")
    table = df.withColumn("key_group", key_group_column(KEY, 8)).toArrow()
    if recorded:
        table = table.select(["day", "__cnt_n", "flight", "key_group", "origin"])
        table = table.replace_schema_metadata({KEY_COLUMNS_METADATA: json.dumps(KEY)})
    job = f"typed-{uuid.uuid4().hex[:8]}"
    tasks = [TaskSpec("aggregate", i, f"att-{i}", 2, 8) for i in range(2)]
    coordinator = CheckpointCoordinator(
        job, backend.metastore, storage, CheckpointConfig(), plan_provider=lambda: tasks
    )
    pending = coordinator.trigger_checkpoint()
    location = storage.location_for(pending.location)
    acks = []
    for task in tasks:
        r = key_group_range(8, 2, task.subtask_index)
        mine = table.filter(
            pc.and_(
                pc.greater_equal(table["key_group"], r.start),
                pc.less_equal(table["key_group"], r.end),
            )
        )
        data = write_keyed_snapshot(mine, operator_id="aggregate", key_groups=r, max_parallelism=8)
        info = storage.write_bytes(location.file_url(f"aggregate-{task.subtask_index}.arrow"), data)
        groups = read_snapshot_info(data).groups
        meta = {
            "key_groups": [r.start, r.end],
            "group_bytes": {g: s.nbytes for g, s in groups.items()},
        }
        acks.append(TaskAck(task.attempt_id, info.url, info.size, info.checksum, state_meta=meta))
    assert coordinator.receive_acknowledge(pending.checkpoint_id, acks).completed is not None
    return job, pending.checkpoint_id, table


@pytest.mark.parametrize("recorded", [False, True], ids=["derived", "recorded"])
def test_multi_column_typed_key(
    spark: Any, backend: Backend, tmp_path: Path, recorded: bool
) -> None:
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    job, cid, table = typed_checkpoint(spark, backend, storage, recorded=recorded)
    rows = table.to_pylist()
    target = next(r for r in rows if r["origin"] == "JFK" and r["day"] == dt.date(2013, 1, 2))
    args = ["inspect", job, str(cid), "--operator", "aggregate"]
    key = ["--key", "JFK", "--key", str(target["flight"]), "--key", "2013-01-02"]

    result = ckpt(backend, storage, *args, *key, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["key_columns"] == KEY
    assert data["key"] == ["JFK", target["flight"], "2013-01-02"]
    assert data["key_group"] == target["key_group"]  # Python's hash = Spark's
    assert data["columns"] == [*KEY, "__cnt_n", "key_group"]
    assert data["rows"] == [
        {
            **{c: target[c] for c in KEY},
            "day": "2013-01-02",
            "__cnt_n": target["__cnt_n"],
            "key_group": target["key_group"],
        }
    ]

    # a value written another way ("01234") is cast to the column's type first
    padded = ["--key", "JFK", "--key", f"0{target['flight']}", "--key", "2013-01-02"]
    again = json.loads(ckpt(backend, storage, *args, *padded, "--json").stdout)
    assert again["rows"] == data["rows"]

    bad = ckpt(backend, storage, *args, "--key", "JFK", "--key", "ten", "--key", "2013-01-02")
    assert bad.exit_code == 1
    assert "key column 'flight' is int64: cannot read 'ten' as int64" in bad.stderr

    reordered = ["--key", "2013-01-02", "--key", "JFK", "--key", str(target["flight"])]
    wrong_order = ckpt(backend, storage, *args, *reordered, "--key-columns", "day,origin,flight")
    assert wrong_order.exit_code == 1
    assert "is not the key of operator 'aggregate'" in wrong_order.stderr


def test_handle_outside_the_checkpoint_directory_is_refused(
    spark: Any, backend: Backend, tmp_path: Path
) -> None:
    """A ``_metadata`` (with matching checksums everywhere) must not steer reads elsewhere."""
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    job, cid, _ = typed_checkpoint(spark, backend, storage, recorded=False)
    with backend.metastore.transaction() as s:
        path = s.get(Checkpoint, (job, cid)).metadata_path
    metadata = read_metadata(storage, path)
    [op] = metadata.operators
    moved = storage.path_of(op.subtasks[0].handle)
    elsewhere = tmp_path / "ckpt" / job / "elsewhere" / moved.name
    elsewhere.parent.mkdir(parents=True)
    shutil.copy(moved, elsewhere)
    subtasks = [op.subtasks[0].model_copy(update={"handle": elsewhere.as_uri()}), *op.subtasks[1:]]
    tampered = metadata.model_copy(
        update={"operators": [op.model_copy(update={"subtasks": subtasks})]}
    )
    data = tampered.to_bytes()
    storage.path_of(path).write_bytes(data)
    with backend.metastore.transaction() as s:
        s.execute(
            update(Checkpoint)
            .where(Checkpoint.job_id == job, Checkpoint.checkpoint_id == cid)
            .values(metadata_checksum=checksum_of(data))
        )
    result = ckpt(backend, storage, "inspect", job, str(cid), "--operator", "aggregate")
    assert result.exit_code == 1
    assert f"{elsewhere.as_uri()}: state handle outside the checkpoint's directory" in result.stderr
