"""``ckpt run`` as users run it: a real process, killed with SIGKILL after k completed checkpoints,
rerun until done. The final table and every committed epoch of the changelog must equal an
independent (pandas) computation: no duplicate epoch, no missing epoch, no partial file."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from checkpointing import datasets
from checkpointing.metastore import Metastore

CKPT = str(Path(sys.executable).with_name("ckpt"))
AGGS = {"n": ("count", None), "total": ("sum", "amount"), "avg_amount": ("avg", "amount")}
FILES = 5


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env["CKPT_HOME"] = str(home)
    return env


def _completed(home: Path, job: str) -> int:
    store = Metastore(f"sqlite:///{home / 'metastore.db'}")
    try:
        from checkpointing.views import list_checkpoints

        return len(list_checkpoints(store, job, status="COMPLETED")) + len(
            list_checkpoints(store, job, status="SUBSUMED")
        )
    except Exception:
        return 0
    finally:
        store.dispose()


@pytest.mark.parametrize("kill_after", [1, 3])
def test_kill_9_and_rerun_until_done(tmp_path: Path, kill_after: int) -> None:
    data = tmp_path / "data"
    files = datasets.generate_events(data, events=5_000, keys=200, files=FILES, seed=kill_after)
    spec = tmp_path / "pipeline.yaml"
    spec.write_text(
        """
job: killed
source: {format: parquet, path: "data/*.parquet", splits_per_epoch: 1}
key: user
aggregations: {n: count(), total: sum(amount), avg_amount: avg(amount)}
sink: {path: out}
parallelism: 2
max_parallelism: 8
checkpoint: {every_epochs: 1, retained: 2, retention: retain_on_cancellation}
"""
    )
    home = tmp_path / "home"
    env = _env(home)
    assert subprocess.run([CKPT, "db", "upgrade"], env=env, check=False).returncode == 0

    proc = subprocess.Popen(
        [CKPT, "run", str(spec)], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 300
    while _completed(home, "killed") < kill_after and proc.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint completed in time"
        time.sleep(0.2)
    assert proc.poll() is None, "the job finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)

    for _ in range(3):  # rerun until done, as an automatic retry would
        result = subprocess.run(
            [CKPT, "run", str(spec)], env=env, capture_output=True, text=True, check=False
        )
        if result.returncode == 0:
            break
    assert result.returncode == 0, result.stderr[-2000:]
    restored = re.search(r"restored from checkpoint (\d+)", result.stdout)
    assert restored is not None, result.stdout
    assert int(restored.group(1)) >= kill_after  # resumed, not restarted

    out = tmp_path / "out"
    final = pd.read_parquet(out / "final").sort_values("user").reset_index(drop=True)
    frames = [pd.read_parquet(p) for p in files]
    expected = datasets.expected_aggregates(pd.concat(frames), ["user"], AGGS)
    pd.testing.assert_frame_equal(
        final[expected.columns.tolist()], expected, check_dtype=False, check_exact=False
    )
    committed = sorted(int(p.name.split("=")[1]) for p in (out / "changelog").glob("epoch=*"))
    assert committed == list(range(FILES))
    for epoch in range(FILES):
        got = pd.read_parquet(out / "changelog" / f"epoch={epoch}")
        got = got.sort_values("user").reset_index(drop=True)
        upto = pd.concat(frames[: epoch + 1])
        touched = set(frames[epoch].user)
        want = datasets.expected_aggregates(upto[upto.user.isin(touched)], ["user"], AGGS)
        pd.testing.assert_frame_equal(
            got[want.columns.tolist()], want, check_dtype=False, check_exact=False
        )
    assert not list(out.rglob("*.inprogress"))
