"""Checkpointed steps under a crash (issue 39): a user's script SIGKILLed at a seeded random
moment, then resumed at another parallelism, publishes exactly DuckDB's answer with every row
once; a narrow step SIGKILLed part-way through its tasks recomputes only its missing
partitions (counted against the acknowledgements the crashed run left in the metastore).

The script runs in its own process (the kill is a real SIGKILL of its driver); the first run
as ``python script.py``, the resume through :func:`checkpointing.steps.script.run_script`,
what ``ckpt run script.py`` runs."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pandas as pd
import pyarrow.dataset as ds
from sqlalchemy import select

from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Checkpoint
from tests.test_steps import acked_files, expected, write_inputs

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import json, sys
from pyspark.sql import Window, functions as F
from checkpointing.spark.session import spark_session
from checkpointing.spark.steps import checkpointed

mode, data, out, master, shuffle, stats = sys.argv[1:7]
jvm = {"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1"}
spark = spark_session("steps-chaos", master, jvm)
spark.conf.set("spark.sql.shuffle.partitions", shuffle)
with checkpointed(spark, job=f"chaos_{mode}") as ck:
    if mode == "job":
        orders = spark.read.parquet(f"{data}/orders")
        customers = spark.read.parquet(f"{data}/customers")
        enriched = ck.step("enriched", lambda: orders.join(customers, "cid"))
        daily = ck.step("daily", lambda: enriched.groupBy("day", "region").agg(
            F.sum("amount").alias("rev"), F.count(F.lit(1)).alias("n")))
        w = Window.partitionBy("day").orderBy(F.desc("rev"), "region")
        ranked = ck.step("ranked", lambda: daily.withColumn("rank", F.rank().over(w)))
        ck.write(ranked, out)
    else:
        items = spark.read.parquet(f"{data}/items")
        base = ck.step("base", lambda: items.repartition(8, "oid"))
        scored = ck.step(
            "scored",
            lambda x: x.withColumn("h", F.sha2(F.repeat(F.col("tag"), 10000), 256)),
            input=base,
        )
        ck.write(scored, out)
s = ck.stats
json.dump({"reused": s.reused, "computed": s.computed, "partitions": s.partitions_computed,
           "salvaged": s.partitions_salvaged}, open(stats, "w"))
"""


def _env(tmp: Path) -> dict[str, str]:
    """The script's settings: a migrated metastore of the test's own, its storage."""
    url = f"sqlite:///{tmp / 'metastore.db'}"
    if not (tmp / "metastore.db").exists():
        Metastore(url, check_schema=False).upgrade()
    return {
        **os.environ,
        "CKPT_METASTORE_URL": f"sqlite:///{tmp / 'metastore.db'}",
        "CKPT_STORAGE_URL": (tmp / "ck").as_uri(),
        "PYTHONPATH": str(ROOT),
    }


def _command(
    tmp: Path, mode: str, master: str, shuffle: int, tag: str, *, via_run: bool
) -> list[str]:
    script = tmp / "job.py"
    script.write_text(SCRIPT)
    args = [mode, str(tmp / "in"), str(tmp / "out"), master, str(shuffle), str(tmp / f"{tag}.json")]
    if via_run:
        runner = (
            "import sys; from checkpointing.steps.script import run_script; "
            "sys.exit(run_script(sys.argv[1], sys.argv[2:]))"
        )
        return [sys.executable, "-c", runner, str(script), *args]
    return [sys.executable, str(script), *args]


def _kill_when(proc: subprocess.Popen, files: Path, pattern: str, count: int) -> int:
    """SIGKILL the script once ``count`` task files of ``pattern`` are committed; how many were
    there. The script must not end first."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        seen = len(list(files.glob(pattern)))
        if seen >= count:
            proc.kill()
            proc.wait()
            return seen
        if proc.poll() is not None:
            log = files.parents[2] / "first.log"
            raise AssertionError(f"the script ended before the kill: {log.read_text()[-3000:]}")
        time.sleep(0.01)
    proc.kill()
    raise AssertionError(f"no {count} files of {pattern} within 240 s")


def _resume(tmp: Path, mode: str, master: str, shuffle: int) -> dict:
    done = subprocess.run(
        _command(tmp, mode, master, shuffle, "resume", via_run=True),
        env=_env(tmp),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp / "resume.json").read_text())


def _published(out: Path, key: list[str]) -> pd.DataFrame:
    frame = ds.dataset(out / "final", format="parquet").to_table().to_pandas()
    return frame.sort_values(key).reset_index(drop=True)


def test_a_script_killed_at_a_random_moment_resumes_at_another_parallelism_exactly(
    tmp_path: Path,
) -> None:
    seed = int(os.environ.get("CKPT_CHAOS_SEED", random.randrange(1 << 30)))
    print(f"CKPT_CHAOS_SEED={seed}")
    # committed task files, over all steps: each step writes one at least (an empty task
    # writes its schema), four steps in all, so 1-3 is before the end
    kill_after = random.Random(seed).randint(1, 3)
    orders, customers = write_inputs(tmp_path / "in")
    proc = subprocess.Popen(
        _command(tmp_path, "job", "local[1]", 3, "first", via_run=False),
        env=_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "first.log").open("w"),
    )
    shared = tmp_path / "ck" / "chaos_job" / "shared"
    _kill_when(proc, shared, "chk-*/*/part-*.parquet", kill_after)
    assert proc.returncode == -9

    stats = _resume(tmp_path, "job", "local[2]", 5)
    assert sorted(stats["reused"] + stats["computed"]) == ["daily", "enriched", "output", "ranked"]
    got = _published(tmp_path / "out", ["day", "region"])
    want = expected(orders, customers)
    assert not got.duplicated(["day", "region"]).any() and len(got) == len(want)
    pd.testing.assert_frame_equal(
        got[list(want.columns)], want.astype(got[list(want.columns)].dtypes.to_dict())
    )


def test_a_narrow_step_killed_part_way_recomputes_only_its_missing_partitions(
    tmp_path: Path,
) -> None:
    items = tmp_path / "in" / "items"
    items.mkdir(parents=True)
    for f in range(2):
        ids = range(f * 6000, (f + 1) * 6000)
        pd.DataFrame({"oid": list(ids), "tag": [f"t{i % 7}" for i in ids]}).to_parquet(
            items / f"part-{f}.parquet"
        )
    proc = subprocess.Popen(
        _command(tmp_path, "narrow", "local[1]", 3, "first", via_run=False),
        env=_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "first.log").open("w"),
    )
    shared = tmp_path / "ck" / "chaos_narrow" / "shared"
    _kill_when(proc, shared, "chk-*/scored/part-*.parquet", 4)  # half of its 8 tasks
    metastore = Metastore(f"sqlite:///{tmp_path / 'metastore.db'}")
    with metastore.transaction() as s:
        pending = s.scalar(
            select(Checkpoint.checkpoint_id).where(
                Checkpoint.job_id == "chaos_narrow", Checkpoint.status == "PENDING"
            )
        )
    acked = len(acked_files(metastore, pending, "scored"))
    metastore.dispose()
    assert 1 <= acked < 8, acked  # the crash left some of its tasks acknowledged, not all

    stats = _resume(tmp_path, "narrow", "local[2]", 5)
    assert stats["reused"] == ["base"]
    assert stats["salvaged"] == {"scored": acked}
    assert stats["partitions"]["scored"] == 8 - acked  # only the missing partitions
    got = _published(tmp_path / "out", ["oid"])
    con = duckdb.connect()
    want = con.execute(
        f"SELECT oid, tag, sha256(repeat(tag, 10000)) AS h "
        f"FROM read_parquet('{items}/*.parquet') ORDER BY oid"
    ).df()
    assert not got.duplicated(["oid"]).any()
    pd.testing.assert_frame_equal(got[["oid", "tag", "h"]], want, check_dtype=False)
