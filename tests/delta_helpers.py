"""Reading a Delta table and its log in tests: with ``deltalake`` and the log's JSON, never
through the sink under test."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pandas as pd

from checkpointing.sinks.delta_log import storage_options


def read_table(url: str, sort: list[str]) -> pd.DataFrame:
    """The table's current version, as pandas, sorted."""
    from deltalake import DeltaTable

    table = DeltaTable(url, storage_options=storage_options(url)).to_pyarrow_table()
    return table.to_pandas().sort_values(sort).reset_index(drop=True)


def delta_log(url: str) -> list[list[dict[str, Any]]]:
    """Each Delta commit's actions, by version (read straight from ``_delta_log/*.json``)."""
    from pyarrow import fs

    from checkpointing.sinks.delta_files import filesystem

    filesystem_, root = filesystem(url)
    infos = filesystem_.get_file_info(fs.FileSelector(f"{root}/_delta_log"))
    commits = []
    for info in sorted(i.path for i in infos if i.path.endswith(".json")):
        with filesystem_.open_input_stream(info) as stream:
            commits.append([json.loads(line) for line in stream.read().decode().splitlines()])
    return commits


def txn_counts(url: str, job: str) -> Counter[int]:
    """How often each checkpoint's app transaction of ``job`` was committed (RESTORE commits,
    which carry the txn of the version they bring back, not counted)."""
    counts: Counter[int] = Counter()
    for actions in delta_log(url):
        info = next(a["commitInfo"] for a in actions if "commitInfo" in a)
        if info.get("operation") == "RESTORE":
            continue
        counts.update(
            a["txn"]["version"] for a in actions if "txn" in a and a["txn"]["appId"] == job
        )
    return counts
