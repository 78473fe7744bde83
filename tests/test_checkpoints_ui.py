"""The Checkpoints page in a real browser: headless Debian Chromium driven by Playwright against
a real Airflow 3 api-server on loopback (:mod:`tests.airflow_api_server`), logged in through
Airflow's own login page.

Screenshots are written to the test's tmp dir and copied to ``.ckpt/test-artifacts/
checkpoints-ui/`` (look at them: they are the evidence that the page renders right).
"""

from __future__ import annotations

import json
import re
import shutil
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import pytest

from tests.airflow_api_server import FINISHED, IDLE, LIVE, Server, running_api_server, take_requests
from tests.browser import playwright_or_skip
from tests.helpers import location_exists, request_rows

ARTIFACTS = Path(__file__).resolve().parent.parent / ".ckpt" / "test-artifacts" / "checkpoints-ui"
TIMEOUT_MS = 30_000

playwright_api = playwright_or_skip()
expect = playwright_api.expect


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """This module's two api-servers, by path prefix: Airflow at the root, and under
    ``/airflow`` (``[api] base_url``, as behind a reverse proxy), each with a metastore of its
    own; started together and stopped together, so that their start-ups (and their stops,
    seconds each) overlap."""
    servers = {
        "": running_api_server(tmp_path_factory.mktemp("checkpoints-ui")),
        "/airflow": running_api_server(tmp_path_factory.mktemp("prefixed"), prefix="/airflow"),
    }
    with ThreadPoolExecutor(len(servers)) as pool:
        started = {prefix: pool.submit(s.__enter__) for prefix, s in servers.items()}
        wait(started.values())  # all up (or failed) before any is used or stopped
        up = [prefix for prefix, future in started.items() if future.exception() is None]
        try:
            yield {prefix: future.result() for prefix, future in started.items()}
        finally:
            for stopped in [pool.submit(servers[p].__exit__, None, None, None) for p in up]:
                stopped.result()


@pytest.fixture(scope="module")
def server(servers: dict[str, Server]) -> Server:
    return servers[""]


#: a time zone chosen in Airflow's header (its UI keeps it in localStorage "timezone"), with a
#: half-hour offset so that a page that ignores it cannot pass by luck
ZONE = "Asia/Kolkata"
WIDE = {"width": 1440, "height": 1000}
NO_DIALOGS = "window.confirm/alert/prompt are ignored in Airflow's frame (no allow-modals)"


def log_in(browser: Any, server: Server, user: str, pipeline: str, **context: Any) -> Any:
    """A fresh browser session: opening the page redirects to Airflow's login, which signs
    ``user`` in and sends the browser back to the page. Airflow's UI time zone is :data:`ZONE`;
    a browser dialog fails the test (the page must never depend on one)."""
    query = context.pop("query", "")
    page = browser.new_context(**context).new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.add_init_script(f"localStorage.setItem('timezone', {json.dumps(json.dumps(ZONE))})")
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.dialogs = dialogs
    page.goto(f"{server.url}/checkpoints/ui/?pipeline={pipeline}{query}")
    expect(page).to_have_url(re.compile(r"/auth/login\?next="))
    page.locator("input[name=username]").fill(user)
    page.locator("input[name=password]").fill(server.passwords[user])
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(re.compile(rf"/checkpoints/ui/\?pipeline={pipeline}"))
    expect(page.locator("#pipeline")).to_have_value(pipeline)
    return page


def screenshot(page: Any, tmp_path: Path, name: str) -> Path:
    """A full-page screenshot in the test's tmp dir, copied to :data:`ARTIFACTS`."""
    shot = tmp_path / f"{name}.png"
    page.screenshot(path=str(shot), full_page=True)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, ARTIFACTS / shot.name)
    return shot


def open_from_browse_menu(page: Any, server: Server) -> Any:
    """Browse → Checkpoints in Airflow's UI: the page in Airflow's frame at /plugin/checkpoints;
    Airflow then mirrors the frame's path into its own URL (a deep link), with the prefix."""
    page.goto(f"{server.url}/")
    page.get_by_role("button", name="Browse").click()
    page.get_by_role("menuitem", name="Checkpoints").click()
    prefix = urlsplit(server.url).path
    expect(page).to_have_url(re.compile(rf"/plugin/checkpoints{prefix}/checkpoints/ui/"))
    sandbox = page.locator("iframe").get_attribute("sandbox")
    assert "allow-modals" not in sandbox.split(), sandbox  # Airflow's sandbox, as users get it
    return page.frame_locator("iframe")


def history_row(page: Any, checkpoint_id: int) -> Any:
    return page.locator(f"#history tbody tr[data-id='{checkpoint_id}']")


def airflow_time(iso: str) -> str:
    """A time as Airflow's UI shows it in :data:`ZONE`: 24-hour ``YYYY-MM-DD HH:mm:ss``."""
    from datetime import datetime
    from zoneinfo import ZoneInfo

    return datetime.fromisoformat(iso).astimezone(ZoneInfo(ZONE)).strftime("%Y-%m-%d %H:%M:%S")


def test_a_finished_pipelines_history_summary_details_and_restores(
    server: Server, browser: Any, tmp_path: Path
) -> None:
    page = log_in(browser, server, "admin", FINISHED, viewport=WIDE)
    rows = page.locator("#history tbody tr")
    expect(rows).to_have_count(8)
    expect(rows.first).to_contain_text("ABORTED")
    expect(history_row(page, 7)).to_contain_text("SAVEPOINT")
    expect(history_row(page, 7)).to_contain_text("COMPLETED")
    expect(history_row(page, 7)).to_contain_text("3/3")
    expect(history_row(page, 7)).to_contain_text("35.0 s")
    expect(history_row(page, 1)).to_contain_text("SUBSUMED")
    # subsumed is a disposal, not a failure; the aborted one's reason is under Failure
    expect(history_row(page, 1).locator("td.failure")).to_be_empty()
    expect(history_row(page, 1).locator("td.disposal")).to_contain_text("subsumed")
    expect(history_row(page, 8).locator("td.failure")).not_to_be_empty()
    # Written: the bytes a checkpoint wrote itself, as `ckpt list` shows them
    written = server.call("GET", f"/api/pipelines/{FINISHED}/checkpoints/7", user="admin").body
    assert 0 < written["checkpointed_size"] < 1024, written  # shown in bytes
    expect(history_row(page, 7).locator("td.written")).to_have_text(
        f"{written['checkpointed_size']} B"
    )
    expect(page.locator("#legend")).to_contain_text("SUBSUMED")
    expect(page.locator("#legend")).to_contain_text("DISCARDED")
    # times in Airflow's zone and format, the zone labelled
    first = server.call("GET", f"/api/pipelines/{FINISHED}/checkpoints/1", user="admin").body
    expect(history_row(page, 1)).to_contain_text(airflow_time(first["trigger_at"]))
    expect(page.locator("#timezone")).to_have_text(f"Times in {ZONE} (UTC+05:30)")
    expect(page.locator("#history thead")).to_contain_text(f"Triggered ({ZONE})")
    expect(page.locator("#refreshed")).to_contain_text(re.compile(r"refreshed \d+ s ago"))

    expect(page.locator("#pipeline-status")).to_contain_text("FINISHED")
    # not running: the savepoint actions are disabled, and the page says why in words
    expect(page.locator("#trigger-savepoint")).to_be_disabled()
    expect(page.locator("#stop-with-savepoint")).to_be_disabled()
    expect(page.locator("#actions-why")).to_contain_text(
        f"Savepoints can be taken only while the pipeline runs: {FINISHED} is FINISHED."
    )
    summary = page.locator("#summary")
    expect(summary).to_contain_text("COMPLETED 3")
    expect(summary).to_contain_text("SUBSUMED 4")
    expect(summary).to_contain_text("ABORTED 1")
    expect(page.locator("#restorable")).to_contain_text("#7 savepoint")
    stats = server.call("GET", f"/api/pipelines/{FINISHED}/summary", user="admin").body
    assert stats["state_size"]["max"] < 1024  # shown in bytes
    expect(summary).to_contain_text(
        f"State size min / avg / max{stats['state_size']['min']} B / "
        f"{round(stats['state_size']['avg'])} B / {stats['state_size']['max']} B"
    )
    expect(summary).to_contain_text("Latest savepoint#7")
    expect(summary).to_contain_text("Latest failed#8")
    expect(summary).to_contain_text("from #7, attempt try-2")
    # by trigger time: six checkpoints, the savepoint and the failure marked apart; the 35 s
    # savepoint is off the duration chart's scale (marked) instead of flattening the rest
    duration = page.locator("#chart-duration")
    expect(duration.locator("g.point")).to_have_count(8)
    expect(duration.locator("g.point.checkpoint")).to_have_count(6)
    expect(duration.locator("g.point.savepoint")).to_have_count(1)
    expect(duration.locator("g.point.failed")).to_have_count(1)
    expect(duration.locator(".outlier")).to_have_text("35.0 s (off scale)")
    expect(duration.locator("text").filter(has_text="1.0 s")).to_have_count(1)  # a y tick
    expect(page.locator("#chart-size g.point.checkpoint")).to_have_count(6)
    restores = page.locator("#restores tbody tr")
    expect(restores).to_have_count(1)
    expect(restores.first).to_contain_text("try-2")
    expect(restores.first).to_contain_text("#7 savepoint")

    history_row(page, 7).click()
    expect(page.locator("#detail-title")).to_have_text("Checkpoint #7 (SAVEPOINT, COMPLETED)")
    operators = page.locator("#detail-operators tbody tr")
    expect(operators).to_have_count(2)  # sink and source, their subtasks summed
    expect(operators.nth(1)).to_contain_text(re.compile(r"source\s*2/2"))
    tasks = page.locator("#detail-tasks tbody tr")
    expect(tasks).to_have_count(3)
    expect(tasks.nth(0)).to_contain_text("sink")
    expect(tasks.nth(2)).to_contain_text("source")
    expect(tasks.nth(2)).to_contain_text("1/2")
    # the input its two runs consumed: one row per run, the files collapsed
    expect(page.locator("#detail-input-runs tbody tr")).to_have_text(
        [
            re.compile(r"try-1\s*0\u20131\s*2\s*2\s*5\.0 KiB"),  # epochs 0 to 1 (an en dash)
            re.compile(r"try-2\s*2\s*1\s*1\s*4\.9 KiB"),
        ]
    )
    expect(page.locator("#detail-input-totals")).to_contain_text(
        "2 files read (5.0 KiB), 1 split still to read; the next run starts at epoch 3."
    )
    expect(page.locator("#detail-input-files")).not_to_be_visible()
    # what can be done is the primary action: restore (the pipeline is not running)
    expect(page.locator("#restore-from-here")).to_have_class(re.compile(r"\bprimary\b"))
    handle = tasks.nth(0).locator("td.path")
    expect(handle).to_contain_text("…/")  # under the location shown above, full path on hover
    assert handle.evaluate("e => e.getBoundingClientRect().height") < 40  # one line
    screenshot(page, tmp_path, "1-finished-pipeline")

    # a subsumed checkpoint's details say that its files are gone
    history_row(page, 1).click()
    expect(page.locator("#detail-gone")).to_contain_text("Subsumed")
    expect(page.locator("#restore-from-here")).to_have_count(0)

    # filters and paging (the API's status, type, limit and offset)
    page.locator("#filter-status").select_option("SUBSUMED")
    expect(rows).to_have_count(4)
    page.locator("#filter-type").select_option("SAVEPOINT")
    expect(rows).to_have_text(["No checkpoint matches the filters."])
    page.locator("#filter-status").select_option("")
    expect(rows).to_have_count(1)
    expect(rows.first).to_contain_text("SAVEPOINT")
    page.locator("#filter-type").select_option("")
    expect(rows).to_have_count(8)
    page.context.close()

    page = log_in(browser, server, "admin", FINISHED, viewport=WIDE, query="&rows=3")
    rows = page.locator("#history tbody tr")
    expect(page.locator("#history-range")).to_have_text("1\u20133 of 8")
    expect(page.locator("#page-newer")).to_be_disabled()
    page.locator("#page-older").click()
    expect(page.locator("#history-range")).to_have_text("4\u20136 of 8")
    expect(rows.first).to_have_attribute("data-id", "5")
    page.locator("#page-older").click()
    expect(page.locator("#history-range")).to_have_text("7\u20138 of 8")
    expect(page.locator("#page-older")).to_be_disabled()
    page.locator("#page-newer").click()
    expect(page.locator("#history-range")).to_have_text("4\u20136 of 8")

    # a restore that had to skip unusable checkpoints: each fallback on its own line, with why
    from checkpointing.restore.lookup import RestoreDecision, SkippedCheckpoint, record_restore

    skipped = [
        SkippedCheckpoint(3, "chk-3/_metadata: missing"),
        SkippedCheckpoint(2, "chk-2/op-0: size 10, expected 12"),
    ]
    decision = RestoreDecision(IDLE, None, None, None, None, skipped)
    record_restore(server.metastore, decision, attempt="try-9")
    page.locator("#pipeline").select_option(IDLE)
    fallbacks = page.locator("#restores tbody tr").first.locator("ol.fallbacks li")
    expect(fallbacks).to_have_text(
        ["#3 chk-3/_metadata: missing", "#2 chk-2/op-0: size 10, expected 12"]
    )
    expect(page.locator("#restores tbody tr").first).to_contain_text("EMPTY")
    screenshot(page, tmp_path, "1b-restore-fallbacks")
    page.locator("#pipeline").select_option(FINISHED)
    expect(rows).to_have_count(3)

    # a phone: the page reflows instead of overflowing sideways
    page.set_viewport_size({"width": 390, "height": 844})
    expect(rows).to_have_count(3)
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
    screenshot(page, tmp_path, "2-narrow-screen")
    assert page.dialogs == [], NO_DIALOGS
    page.context.close()


def test_an_admin_triggers_a_savepoint_and_watches_it_complete(
    server: Server, browser: Any, tmp_path: Path
) -> None:
    page = log_in(browser, server, "admin", LIVE, viewport=WIDE)
    expect(page.locator("#pipeline-status")).to_contain_text("RUNNING")
    expect(page.locator("#actions-why")).to_be_empty()
    before = len(request_rows(server.metastore, LIVE))

    # a cancelled confirmation sends nothing
    trigger = page.locator("#trigger-savepoint")
    expect(trigger).to_have_class(re.compile(r"\bprimary\b"))
    trigger.click()
    page.locator("#action-confirm button.cancel").click()
    expect(page.locator("#action-confirm")).to_be_hidden()
    page.wait_for_timeout(300)
    assert len(request_rows(server.metastore, LIVE)) == before

    trigger.click()
    expect(page.locator("#action-confirm")).to_contain_text(
        f"Trigger a savepoint of pipeline {LIVE}?"
    )
    page.locator("#action-confirm-button").click()
    status = page.locator("#request-status")
    expect(status).to_contain_text("QUEUED")
    expect(trigger).to_be_disabled()  # while the request is in flight
    (row,) = request_rows(server.metastore, LIVE)[before:]
    assert row.requested_by == "airflow:admin"

    (savepoint_id,) = take_requests(server)  # the job's coordinator, at its next epoch boundary
    expect(status).to_contain_text("COMPLETED")
    expect(status).to_contain_text(f"checkpoint #{savepoint_id}")
    expect(page.locator("#message")).to_contain_text(
        f"Savepoint #{savepoint_id} completed: {server.storage.savepoint_url(LIVE, savepoint_id)}"
    )
    expect(history_row(page, savepoint_id)).to_contain_text("SAVEPOINT")
    expect(history_row(page, savepoint_id)).to_contain_text("COMPLETED")
    expect(page.locator("#restorable")).to_contain_text(f"#{savepoint_id} savepoint")
    expect(trigger).to_be_enabled()
    screenshot(page, tmp_path, "3-savepoint-completed")

    # discard it from its details: confirmed in the page, marked DISCARDED, its files deleted
    location = server.storage.savepoint_url(LIVE, savepoint_id)
    assert location_exists(server.storage, location)
    history_row(page, savepoint_id).click()
    page.locator("#discard-savepoint").click()
    expect(page.locator("#restore-confirm")).to_contain_text(f"Discard savepoint #{savepoint_id}")
    page.locator("#discard-confirm-button").click()
    expect(page.locator("#message")).to_contain_text(f"Savepoint #{savepoint_id} discarded")
    expect(history_row(page, savepoint_id)).to_contain_text("DISCARDED")
    expect(history_row(page, savepoint_id).locator("td.disposal")).to_contain_text(
        "discarded by user"
    )
    expect(page.locator("#detail-title")).to_contain_text("DISCARDED")
    expect(page.locator("#detail-gone")).to_contain_text("its files are deleted")
    expect(page.locator("#discard-savepoint")).to_have_count(0)
    assert not location_exists(server.storage, location)
    # the latest completed one is gone: the summary says so, and what can still be restored
    expect(page.locator("#summary")).to_contain_text(f"Latest completed#{savepoint_id} at")
    expect(page.locator("#summary")).to_contain_text("(now discarded: not restorable)")
    expect(page.locator("#restorable")).to_contain_text("#1 checkpoint")
    screenshot(page, tmp_path, "4-discarded")
    assert page.dialogs == [], NO_DIALOGS
    page.context.close()


def test_a_read_only_user_cannot_trigger_a_savepoint(
    server: Server, browser: Any, tmp_path: Path
) -> None:
    page = log_in(browser, server, "viewer", LIVE, viewport=WIDE)
    expect(history_row(page, 1)).to_be_visible()
    expect(page.locator("#trigger-savepoint")).to_be_disabled()
    expect(page.locator("#stop-with-savepoint")).to_be_disabled()
    expect(page.locator("#actions-why")).to_contain_text("Read-only")
    screenshot(page, tmp_path, "5-viewer-read-only")
    before = len(request_rows(server.metastore, LIVE))
    # what the button would send, sent anyway from the page (same origin, the CSRF header)
    answer = page.evaluate(
        """async (pipeline) => {
            const r = await fetch(`../api/pipelines/${pipeline}/savepoints`, {method: "POST",
              headers: {"Content-Type": "application/json", "X-Requested-By": "test"},
              body: "{}"});
            return [r.status, (await r.json()).detail];
        }""",
        LIVE,
    )
    assert answer[0] == 403 and "no edit access" in answer[1], answer
    assert len(request_rows(server.metastore, LIVE)) == before

    # a completed savepoint's details: the discard button is there, disabled
    page.locator("#pipeline").select_option(FINISHED)
    history_row(page, 7).click()
    expect(page.locator("#detail-title")).to_have_text("Checkpoint #7 (SAVEPOINT, COMPLETED)")
    expect(page.locator("#discard-savepoint")).to_be_disabled()
    expect(page.locator("#restore-from-here")).to_be_disabled()
    page.context.close()


def test_an_admin_restores_from_a_savepoint_with_the_deploy_dag(
    server: Server, browser: Any, tmp_path: Path
) -> None:
    page = log_in(browser, server, "admin", FINISHED, viewport=WIDE)
    history_row(page, 7).click()
    expect(page.locator("#detail-title")).to_have_text("Checkpoint #7 (SAVEPOINT, COMPLETED)")
    page.locator("#restore-from-here").click()
    confirm = page.locator("#restore-confirm")
    expect(confirm).to_contain_text(f"Start pipeline {FINISHED} from savepoint #7")
    page.locator("#restore-parallelism").fill("2")
    screenshot(page, tmp_path, "8-restore-confirm")
    page.locator("#restore-confirm-button").click()
    link = page.locator("#restore-run")
    expect(link).to_be_visible()
    expect(page.locator("#restore-result")).to_contain_text("DAG run of checkpoint_deploy queued")
    expect(confirm).to_be_hidden()
    run_id = link.inner_text()
    assert run_id.startswith("manual__"), run_id
    assert link.get_attribute("href") == f"../../dags/checkpoint_deploy/runs/{quote(run_id)}"
    # the run Airflow queued: from the savepoint's _metadata, at the parallelism asked for
    request = urllib.request.Request(
        f"{server.url}/api/v2/dags/checkpoint_deploy/dagRuns/{quote(run_id)}",
        headers={"Authorization": f"Bearer {server.tokens['admin']}"},
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        run = json.loads(r.read())
    metadata = server.call("GET", f"/api/pipelines/{FINISHED}/checkpoints/7", user="admin").body
    assert run["conf"] == {
        "pipeline": FINISHED,
        "from": metadata["metadata_path"],
        "parallelism": 2,
    }
    assert run["state"] == "queued" and run["triggering_user_name"] == "admin"

    # an aborted checkpoint cannot be restored: no button, and its failure said so
    history_row(page, 8).click()
    expect(page.locator("#detail-title")).to_contain_text("ABORTED")
    expect(page.locator("#restore-from-here")).to_have_count(0)
    history_row(page, 7).click()
    expect(page.locator("#restore-result")).to_be_empty()  # a new panel: no stale result
    assert page.dialogs == [], NO_DIALOGS
    page.context.close()


def drive_every_action_in_the_frame(page: Any, server: Server, tmp_path: Path, name: str) -> None:
    """Browse → Checkpoints, then every action inside Airflow's sandboxed frame: trigger a
    savepoint, discard it, restore from a savepoint, stop with a savepoint; each confirmed in
    the page, queued, its progress shown. Last, a link to the task's log opens in Airflow."""
    ignored: list[str] = []
    page.on("console", lambda m: ignored.append(m.text) if "Ignored call" in m.text else None)
    frame = open_from_browse_menu(page, server)
    expect(frame.locator("h1")).to_have_text("Checkpoints")
    expect(frame.locator("#pipeline option")).to_have_count(3)
    frame.locator("#pipeline").select_option(LIVE)
    expect(frame.locator("#pipeline-status")).to_contain_text("RUNNING")
    expect(frame.locator("#timezone")).to_contain_text(ZONE)
    status = frame.locator("#request-status")

    # Trigger savepoint
    before = len(request_rows(server.metastore, LIVE))
    frame.locator("#trigger-savepoint").click()
    frame.locator("#action-confirm-button").click()
    expect(status).to_contain_text("QUEUED")
    expect(status).to_contain_text("next epoch boundary")
    assert len(request_rows(server.metastore, LIVE)) == before + 1
    screenshot(page, tmp_path, f"{name}-a-savepoint-queued-in-frame")
    (savepoint_id,) = take_requests(server)
    expect(status).to_contain_text("COMPLETED")
    expect(frame.locator("#message")).to_contain_text(f"Savepoint #{savepoint_id} completed")

    # Discard savepoint
    history_row(frame, savepoint_id).click()
    frame.locator("#discard-savepoint").click()
    frame.locator("#discard-confirm-button").click()
    expect(frame.locator("#message")).to_contain_text(f"Savepoint #{savepoint_id} discarded")
    expect(history_row(frame, savepoint_id)).to_contain_text("DISCARDED")
    assert not location_exists(server.storage, server.storage.savepoint_url(LIVE, savepoint_id))

    # Restore from here (the finished pipeline, from its savepoint)
    frame.locator("#pipeline").select_option(FINISHED)
    history_row(frame, 7).click()
    frame.locator("#restore-from-here").click()
    frame.locator("#restore-confirm-button").click()
    expect(frame.locator("#restore-result")).to_contain_text("DAG run of checkpoint_deploy queued")
    expect(frame.locator("#restore-run")).to_be_visible()

    # Stop with savepoint
    frame.locator("#pipeline").select_option(LIVE)
    before = len(request_rows(server.metastore, LIVE))
    frame.locator("#stop-with-savepoint").click()
    expect(frame.locator("#action-confirm")).to_contain_text("The job ends once the savepoint")
    screenshot(page, tmp_path, f"{name}-b-stop-confirm-in-frame")
    frame.locator("#action-confirm-button").click()
    expect(status).to_contain_text("QUEUED")
    (row,) = request_rows(server.metastore, LIVE)[before:]
    assert row.checkpoint_type == "SAVEPOINT_THEN_STOP" and row.requested_by == "airflow:admin"
    (stop_id,) = take_requests(server)
    expect(status).to_contain_text("COMPLETED")
    expect(frame.locator("#message")).to_contain_text(f"Savepoint #{stop_id} completed")
    expect(history_row(frame, stop_id)).to_contain_text("SAVEPOINT_THEN_STOP")
    screenshot(page, tmp_path, f"{name}-c-stopped-in-frame")
    assert ignored == [] and page.dialogs == [], (ignored, page.dialogs, NO_DIALOGS)

    # the pipeline's DAG, runs and latest task log, opened in Airflow (not in the frame)
    prefix = urlsplit(server.url).path
    expect(frame.locator("#link-dag")).to_have_attribute("href", f"../../dags/{LIVE}")
    expect(frame.locator("#link-runs")).to_have_attribute("href", f"../../dags/{LIVE}/runs")
    log_link = frame.locator("#link-log")
    expect(log_link).to_have_attribute(
        "href", f"../../dags/{LIVE}/runs/{quote(server.live_run, safe='')}/tasks/run"
    )
    log_link.click()
    expect(page).to_have_url(
        f"{server.url}/dags/{LIVE}/runs/{quote(server.live_run, safe='')}/tasks/run"
    )
    assert urlsplit(page.url).path.startswith(f"{prefix}/dags/")
    expect(page.locator("iframe")).to_have_count(0)  # Airflow's own page, not a nested one
    expect(page.get_by_text("No Task Instance found")).to_have_count(0)  # once loaded
    expect(page.get_by_text("No logs available for this task.")).to_be_visible()  # its log
    screenshot(page, tmp_path, f"{name}-d-task-log-in-airflow")


def test_the_page_is_in_airflows_navigation_and_the_operator_links_to_it(
    server: Server, browser: Any, tmp_path: Path
) -> None:
    request = urllib.request.Request(
        f"{server.url}/api/v2/plugins",
        headers={"Authorization": f"Bearer {server.tokens['admin']}"},
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        plugins = {p["name"]: p for p in json.loads(r.read())["plugins"]}
    plugin = plugins["checkpointing"]
    (view,) = plugin["external_views"]
    assert (view["name"], view["href"], view["url_route"], view["destination"]) == (
        "Checkpoints",
        "checkpoints/ui/",
        "checkpoints",
        "nav",
    )
    assert any("CheckpointsLink" in link for link in plugin["operator_extra_links"])

    from checkpointing_airflow.links import checkpoints_page
    from checkpointing_airflow.operators import CheckpointedSparkSubmitOperator

    (link,) = CheckpointedSparkSubmitOperator.operator_extra_links
    assert link.name == "Checkpoints"
    assert checkpoints_page(IDLE, "") == f"/checkpoints/ui/?pipeline={IDLE}"
    assert checkpoints_page(LIVE, "https://x.example/airflow/") == (
        f"https://x.example/airflow/checkpoints/ui/?pipeline={LIVE}"
    )

    # Browse → Checkpoints in Airflow's UI shows the page in its frame at /plugin/checkpoints,
    # where every action works (confirmed in the page: the frame allows no browser dialog)
    page = log_in(browser, server, "admin", IDLE, viewport={"width": 1440, "height": 1400})
    expect(page.locator("#history tbody")).to_contain_text("No checkpoint yet.")
    expect(page.locator("#link-log")).to_have_count(0)  # no run of its DAG in Airflow
    drive_every_action_in_the_frame(page, server, tmp_path, "6-in-airflow")
    page.context.close()


def test_the_page_works_behind_a_path_prefix(
    servers: dict[str, Server], browser: Any, tmp_path: Path
) -> None:
    """Airflow served under ``/airflow`` (``[api] base_url``, as behind a reverse proxy): the
    login, the page's relative API calls and actions, and Airflow's frame around it."""
    server = servers["/airflow"]
    assert server.url.endswith("/airflow")
    page = log_in(browser, server, "admin", LIVE, viewport={"width": 1440, "height": 1400})
    assert page.url == f"{server.url}/checkpoints/ui/?pipeline={LIVE}"
    expect(history_row(page, 1)).to_contain_text("COMPLETED")
    drive_every_action_in_the_frame(page, server, tmp_path, "7-behind-path-prefix")
    page.context.close()
