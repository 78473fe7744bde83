"""The deferrable, ``scope: interval`` daily pipeline that issue 27's real-Airflow scenarios
backfill (``test_airflow_celery.py`` (f), ``test_airflow_deferrable.py``): its input, spec and DAG,
and the backfill of its days and the full refresh of one day, through Airflow's REST API."""

from __future__ import annotations

import json
import shutil
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from checkpointing.coordination.drivers import read_state
from checkpointing.metastore import views
from checkpointing.metastore.engine import Metastore
from checkpointing.pipeline import datasets
from tests.airflow_harness import AGGS, Api, assert_exactly_once, wait_for, write_daily_spec
from tests.helpers import checkpoint_rows

DAILY = "daily_deferred"
DAYS = ("2026-11-20", "2026-11-21", "2026-11-22")
TASK = "run"
#: the pipeline DAG of the interval spec, as the DAG factory builds it, its task deferrable
DAILY_DAG = """
from checkpointing.pipeline.spec import load_spec
from checkpointing_airflow.dag_factory import build_pipeline_dag

dag = build_pipeline_dag(
    load_spec({spec!r}),
    operator_args={{
        "deferrable": True,
        "coordinator_poll": 1.0,
        "driver_heartbeat_timeout": 180,
        "conf": {{
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1",
        }},
    }},
)
"""


def write_backfill_dag(root: Path, dags: Path, files: Mapping[str, int]) -> None:
    """The input (``root/days/date=<day>``, ``files[day]`` files of its own events each), spec
    and DAG (into ``dags``) of the daily pipeline, writing ``root/days_out/date=<day>``."""
    for n, day in enumerate(DAYS):
        folder = root / "days" / f"date={day}"
        count = files[day]
        datasets.generate_events(folder, events=200 * count, keys=60, files=count, seed=20 + n)
    spec = write_daily_spec(
        root / f"{DAILY}.yaml",
        DAILY,
        root / "days",
        root / "days_out",
        checkpoint="{every_epochs: 1, retained: 2, tolerable_failures: 0}",
        max_active_runs=3,
        retries=1,
        retry_delay="2s",
    )
    (dags / f"{DAILY}.py").write_text(DAILY_DAG.format(spec=str(spec)))


def instance_of(day: str) -> str:
    """The job instance of ``day``'s interval."""
    return f"{DAILY}.{day.replace('-', '')}T000000"


def stop_detached_drivers(metastore_url: str) -> None:
    """Stop what the days' drivers left running (Airflow's stop leaves a detached driver
    running, by design)."""
    from checkpointing_airflow.detached_driver import stop_driver

    metastore = Metastore(metastore_url)
    try:
        for day in DAYS:
            if (driver := read_state(metastore, instance_of(day)).driver) is not None:
                stop_driver(driver)
    finally:
        metastore.dispose()


class DailyBackfill:
    """The backfill of :data:`DAYS` and what each day's run did, through the REST API."""

    def __init__(self, api: Api, metastore: Metastore, root: Path, files: Mapping[str, int]):
        self.api, self.metastore, self.root, self.files = api, metastore, root, files
        self.runs_path = f"/api/v2/dags/{DAILY}/dagRuns"
        self.run_of: dict[str, str] = {}
        self._others: dict[str, list[tuple[str, int]]] = {}

    def start(self) -> None:
        """Backfill every day at once; returns once Airflow created their runs."""
        wait_for(f"the DAG {DAILY}", lambda: self.api.get(f"/api/v2/dags/{DAILY}"))
        assert self.api.call("/api/v2/importErrors")["total_entries"] == 0
        body = {"dag_id": DAILY, "from_date": f"{DAYS[0]}T00:00:00Z"}
        body |= {"to_date": f"{DAYS[-1]}T00:00:00Z", "max_active_runs": len(DAYS)}
        self.api.call("/api/v2/backfills", body)

        def runs() -> dict[str, str]:
            query = f"{self.runs_path}?run_type=backfill&order_by=logical_date"
            found = self.api.call(query)["dag_runs"]
            return {r["logical_date"][:10]: r["dag_run_id"] for r in found}

        self.run_of = wait_for("the backfill's runs", lambda: len(runs()) == len(DAYS) and runs())
        assert sorted(self.run_of) == list(DAYS), self.run_of

    def run_path(self, day: str) -> str:
        return f"{self.runs_path}/{urllib.parse.quote(self.run_of[day], safe='')}"

    def ti_of(self, day: str) -> dict[str, Any] | None:
        return self.api.get(f"{self.run_path(day)}/taskInstances/{TASK}")

    def tries_of(self, day: str) -> list[int]:
        tries = self.api.call(f"{self.run_path(day)}/taskInstances/{TASK}/tries")
        return [t["try_number"] for t in tries["task_instances"]]

    def outcome_of(self, day: str) -> dict[str, Any]:
        path = f"{self.run_path(day)}/taskInstances/{TASK}/xcomEntries/return_value"
        xcom = self.api.call(f"{path}?deserialize=true")
        return xcom["value"] if isinstance(xcom["value"], dict) else json.loads(xcom["value"])

    def wait_succeeded(self) -> None:
        """Every day's run ends in success; at least two days' drivers ran at the same time
        (from each driver's submission to its job's end)."""

        def all_ended() -> dict[str, str] | None:
            states = {d: self.api.call(self.run_path(d))["state"] for d in DAYS}
            return states if all(v in ("success", "failed") for v in states.values()) else None

        assert set(wait_for("the backfill to end", all_ended, 600).values()) == {"success"}
        spans = {}
        for d in DAYS:
            state = read_state(self.metastore, instance_of(d))
            assert state.status == "FINISHED" and state.driver is not None and state.updated_at
            spans[d] = (state.driver.submitted_at, state.updated_at)
        at_once = [
            (a, b)
            for a in DAYS
            for b in DAYS
            if a < b and spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]
        ]
        assert at_once, spans

    def assert_each_day_exactly_once(self) -> None:
        """Each day's output equals pandas over that day's files only."""
        for d in DAYS:
            out, days = self.root / "days_out" / f"date={d}", self.root / "days" / f"date={d}"
            assert_exactly_once(out, days, AGGS)

    def refresh(self, day: str) -> None:
        """Rewrite one of ``day``'s files, then backfill ``day`` again with Full refresh,
        reprocessing its completed run (once the first backfill is marked complete: one
        backfill of a DAG at a time)."""
        self._others = {d: self._outputs(d) for d in DAYS if d != day}
        rewritten = sorted((self.root / "days" / f"date={day}").glob("*.parquet"))[0]
        other = self.root / "rewrite"
        datasets.generate_events(other, events=300, keys=60, files=1, seed=99)
        shutil.move(next(other.glob("*.parquet")), rewritten)

        def backfills_done() -> bool:
            found = self.api.call(f"/api/v2/backfills?dag_id={DAILY}")["backfills"]
            return all(b["completed_at"] for b in found)

        wait_for("the backfill to be marked complete", backfills_done, 60)
        body = {"dag_id": DAILY, "from_date": f"{day}T00:00:00Z", "to_date": f"{day}T00:00:00Z"}
        body |= {"reprocess_behavior": "completed", "dag_run_conf": {"full_refresh": True}}
        self.api.call("/api/v2/backfills", body)

    def assert_refreshed(self, day: str) -> dict[str, dict[str, Any]]:
        """The refresh's run succeeds; its first try reset the day's output, which now equals
        pandas over the day's current files; the other days' output is untouched. Returns what
        each try's driver restored (the callback's plans left out), by attempt."""

        def refreshed() -> str | None:
            run = self.api.call(self.run_path(day))
            if run["conf"] != {"full_refresh": True}:
                return None
            return run["state"] if run["state"] in ("success", "failed") else None

        assert wait_for(f"{day}'s refresh", refreshed) == "success"
        restores = {  # a driver's row records how long its restore took; a plan's does not
            r["attempt"]: r
            for r in reversed(views.list_restores(self.metastore, instance_of(day)))
            if "restore_s" in (r["assignment"] or {})
        }
        refreshes = [r for r in restores.values() if "epochs_removed" in _refresh(r)]
        assert [_refresh(r)["epochs_removed"] for r in refreshes] == [self.files[day]], restores
        out, days = self.root / "days_out" / f"date={day}", self.root / "days" / f"date={day}"
        assert_exactly_once(out, days, AGGS)
        for d, files in self._others.items():
            assert self._outputs(d) == files, d
        return restores

    def latest_completed(self, day: str, attempt: str) -> int:
        """The latest checkpoint of ``day`` that ``attempt`` completed."""
        rows = checkpoint_rows(self.metastore, instance_of(day))
        return max(c.checkpoint_id for c in rows if c.completed_at and c.coordinator_id == attempt)

    def _outputs(self, day: str) -> list[tuple[str, int]]:
        found = (self.root / "days_out").glob(f"date={day}/**/*")
        return sorted((p.name, p.stat().st_mtime_ns) for p in found)


def _refresh(restore: dict[str, Any]) -> dict[str, Any]:
    return (restore.get("assignment") or {}).get("full_refresh") or {}
