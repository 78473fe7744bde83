"""The Checkpoints page in a real browser: headless Debian Chromium driven by Playwright against
a real Airflow 3 api-server on loopback (:mod:`tests.airflow_api_server`), logged in through
Airflow's own login page.

Screenshots are written to the test's tmp dir and copied to ``.ckpt/test-artifacts/
checkpoints-ui/`` (look at them: they are the evidence that the page renders right).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import pytest

from tests.airflow_api_server import FINISHED, IDLE, LIVE, Server, running_api_server, take_requests
from tests.helpers import location_exists, request_rows

#: Debian's chromium (Playwright's own browser download is not used)
CHROMIUM = Path(os.environ.get("CKPT_TEST_CHROMIUM", "/usr/bin/chromium"))
ARTIFACTS = Path(__file__).resolve().parent.parent / ".ckpt" / "test-artifacts" / "checkpoints-ui"
TIMEOUT_MS = 30_000

if not CHROMIUM.exists():
    pytest.skip(
        f"the browser test needs Debian's Chromium at {CHROMIUM}: install it with "
        "`apt-get install chromium` as root (make test does when it can)",
        allow_module_level=True,
    )
playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="needs Playwright's Python package: run `uv sync`"
)
expect = playwright_api.expect


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_api_server(tmp_path_factory.mktemp("checkpoints-ui")) as s:
        yield s


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


def log_in(browser: Any, server: Server, user: str, pipeline: str, **context: Any) -> Any:
    """A fresh browser session: opening the page redirects to Airflow's login, which signs
    ``user`` in and sends the browser back to the page."""
    page = browser.new_context(**context).new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"{server.url}/checkpoints/ui/?pipeline={pipeline}")
    expect(page).to_have_url(re.compile(r"/auth/login\?next="))
    page.locator("input[name=username]").fill(user)
    page.locator("input[name=password]").fill(server.passwords[user])
    page.get_by_role("button", name="Sign in").click()
    expect(page).to_have_url(re.compile(rf"/checkpoints/ui/\?pipeline={pipeline}$"))
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
    expect(page).to_have_url(f"{server.url}/plugin/checkpoints{prefix}/checkpoints/ui/")
    return page.frame_locator("iframe")


def history_row(page: Any, checkpoint_id: int) -> Any:
    return page.locator(f"#history tbody tr[data-id='{checkpoint_id}']")


def test_a_finished_pipelines_history_summary_details_and_restores(
    server: Server, browser: Any, tmp_path: Path
) -> None:
    page = log_in(browser, server, "admin", FINISHED, viewport={"width": 1280, "height": 900})
    rows = page.locator("#history tbody tr")
    expect(rows).to_have_count(8)
    expect(rows.first).to_contain_text("ABORTED")
    expect(history_row(page, 7)).to_contain_text("SAVEPOINT")
    expect(history_row(page, 7)).to_contain_text("COMPLETED")
    expect(history_row(page, 7)).to_contain_text("3/3")
    expect(history_row(page, 1)).to_contain_text("SUBSUMED")
    expect(page.locator("#pipeline-status")).to_contain_text("FINISHED")
    summary = page.locator("#summary")
    expect(summary).to_contain_text("COMPLETED 3")
    expect(summary).to_contain_text("SUBSUMED 4")
    expect(summary).to_contain_text("ABORTED 1")
    stats = server.call("GET", f"/api/pipelines/{FINISHED}/summary", user="admin").body
    assert stats["state_size"]["max"] < 1024  # shown in bytes
    expect(summary).to_contain_text(
        f"State size min / avg / max{stats['state_size']['min']} B / "
        f"{round(stats['state_size']['avg'])} B / {stats['state_size']['max']} B"
    )
    expect(summary).to_contain_text("Latest savepoint#7")
    expect(summary).to_contain_text("Latest failed#8")
    expect(summary).to_contain_text("from #7, attempt try-2")
    # one point per completed checkpoint (7 of 8: the 8th was aborted)
    expect(page.locator("#chart-size circle")).to_have_count(7)
    expect(page.locator("#chart-duration circle")).to_have_count(7)
    restores = page.locator("#restores tbody tr")
    expect(restores).to_have_count(1)
    expect(restores.first).to_contain_text("try-2")
    expect(restores.first).to_contain_text("#7 SAVEPOINT")

    history_row(page, 7).click()
    expect(page.locator("#detail-title")).to_have_text("Checkpoint #7 (SAVEPOINT, COMPLETED)")
    tasks = page.locator("#detail-tasks tbody tr")
    expect(tasks).to_have_count(3)
    expect(tasks.nth(0)).to_contain_text("sink")
    expect(tasks.nth(2)).to_contain_text("source")
    expect(tasks.nth(2)).to_contain_text("1/2")
    screenshot(page, tmp_path, "1-finished-pipeline")

    # a phone: the page reflows instead of overflowing sideways
    page.set_viewport_size({"width": 390, "height": 844})
    expect(rows).to_have_count(8)
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
    screenshot(page, tmp_path, "2-narrow-screen")
    page.context.close()


def test_an_admin_triggers_a_savepoint_and_watches_it_complete(
    server: Server, browser: Any, tmp_path: Path
) -> None:
    page = log_in(browser, server, "admin", LIVE, viewport={"width": 1280, "height": 900})
    expect(page.locator("#pipeline-status")).to_contain_text("RUNNING")
    before = len(request_rows(server.metastore, LIVE))
    dialogs: list[str] = []

    def accept(dialog: Any) -> None:
        dialogs.append(dialog.message)
        dialog.accept()

    page.once("dialog", accept)
    trigger = page.locator("#trigger-savepoint")
    expect(trigger).to_be_enabled()
    trigger.click()
    status = page.locator("#request-status")
    expect(status).to_contain_text("QUEUED")
    expect(trigger).to_be_disabled()  # while the request is in flight
    assert dialogs == [f"Trigger a savepoint of pipeline {LIVE}?"]
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
    expect(trigger).to_be_enabled()
    screenshot(page, tmp_path, "3-savepoint-completed")

    # discard it from its details: confirmed, marked DISCARDED, its files deleted
    location = server.storage.savepoint_url(LIVE, savepoint_id)
    assert location_exists(server.storage, location)
    history_row(page, savepoint_id).click()
    page.once("dialog", lambda d: d.accept())
    page.locator("#discard-savepoint").click()
    expect(page.locator("#message")).to_contain_text(f"Savepoint #{savepoint_id} discarded.")
    expect(history_row(page, savepoint_id)).to_contain_text("DISCARDED")
    expect(page.locator("#detail-title")).to_contain_text("DISCARDED")
    expect(page.locator("#discard-savepoint")).to_have_count(0)
    assert not location_exists(server.storage, location)

    # a pipeline that is not running: the API's message, nothing queued
    page.locator("#pipeline").select_option(FINISHED)
    expect(history_row(page, 8)).to_be_visible()
    expect(status).to_be_empty()  # the other pipeline's request is not shown here
    page.once("dialog", lambda d: d.accept())
    page.locator("#stop-with-savepoint").click()
    expect(page.locator("#message")).to_contain_text(
        f"job '{FINISHED}' is not running (status FINISHED)"
    )
    assert request_rows(server.metastore, FINISHED) == []
    screenshot(page, tmp_path, "4-not-running")

    # a cancelled confirmation sends nothing
    page.locator("#pipeline").select_option(LIVE)
    expect(page.locator("#pipeline-status")).to_contain_text("RUNNING")
    count = len(request_rows(server.metastore, LIVE))
    page.once("dialog", lambda d: d.dismiss())
    page.locator("#trigger-savepoint").click()
    page.wait_for_timeout(500)
    assert len(request_rows(server.metastore, LIVE)) == count
    page.context.close()


def test_a_read_only_user_cannot_trigger_a_savepoint(
    server: Server, browser: Any, tmp_path: Path
) -> None:
    page = log_in(browser, server, "viewer", LIVE, viewport={"width": 1280, "height": 900})
    expect(history_row(page, 1)).to_be_visible()
    expect(page.locator("#trigger-savepoint")).to_be_disabled()
    expect(page.locator("#stop-with-savepoint")).to_be_disabled()
    expect(page.locator("#pipeline-status")).to_contain_text("read-only")
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
    page = log_in(browser, server, "admin", FINISHED, viewport={"width": 1280, "height": 900})
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
    screenshot(page, tmp_path, "9-restore-from-here")
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

    # an aborted checkpoint cannot be restored: no button
    history_row(page, 8).click()
    expect(page.locator("#detail-title")).to_contain_text("ABORTED")
    expect(page.locator("#restore-from-here")).to_have_count(0)
    history_row(page, 7).click()
    expect(page.locator("#restore-result")).to_be_empty()  # a new panel: no stale result
    page.context.close()


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

    # Browse → Checkpoints in Airflow's UI shows the page in its frame at /plugin/checkpoints
    page = log_in(browser, server, "admin", IDLE, viewport={"width": 1280, "height": 900})
    expect(page.locator("#history tbody")).to_contain_text("No checkpoint yet.")
    frame = open_from_browse_menu(page, server)
    expect(frame.locator("h1")).to_have_text("Checkpoints")
    expect(frame.locator("#pipeline option")).to_have_count(3)
    screenshot(page, tmp_path, "6-in-airflow-navigation")
    page.context.close()


def test_the_page_works_behind_a_path_prefix(
    browser: Any, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Airflow served under ``/airflow`` (``[api] base_url``, as behind a reverse proxy): the
    login, the page's relative API calls and actions, and Airflow's frame around it."""
    with running_api_server(tmp_path_factory.mktemp("prefixed"), prefix="/airflow") as server:
        assert server.url.endswith("/airflow")
        page = log_in(browser, server, "admin", LIVE, viewport={"width": 1280, "height": 900})
        assert page.url == f"{server.url}/checkpoints/ui/?pipeline={LIVE}"
        expect(history_row(page, 1)).to_contain_text("COMPLETED")
        page.once("dialog", lambda d: d.accept())
        page.locator("#trigger-savepoint").click()
        expect(page.locator("#request-status")).to_contain_text("QUEUED")
        (savepoint_id,) = take_requests(server)
        expect(page.locator("#request-status")).to_contain_text("COMPLETED")
        expect(history_row(page, savepoint_id)).to_contain_text("SAVEPOINT")

        frame = open_from_browse_menu(page, server)
        expect(frame.locator("#pipeline option")).to_have_count(3)
        expect(frame.locator("#history tbody tr").first).to_be_visible()
        screenshot(page, tmp_path, "7-behind-path-prefix")
        page.context.close()
