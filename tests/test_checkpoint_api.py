"""The checkpoint REST API (``plugins/checkpointing_airflow/api/``) in a real Airflow 3
api-server on loopback (:mod:`tests.airflow_api_server`): SimpleAuthManager with ``admin``, the
read-only ``viewer`` and ``outsider`` (no access to any DAG), and a metastore seeded through the
core library. One server for the whole module: it takes most of the module's time.
"""

from __future__ import annotations

import json
import re
import socket
import sqlite3
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import pytest

from tests.airflow_api_server import (
    FINISHED,
    IDLE,
    LIVE,
    Server,
    running_api_server,
    take_requests,
)
from tests.helpers import ack_all, location_exists, request_rows


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with running_api_server(tmp_path_factory.mktemp("checkpoint-api")) as s:
        yield s


READS = [
    "/api/pipelines",
    f"/api/pipelines/{FINISHED}",
    f"/api/pipelines/{FINISHED}/summary",
    f"/api/pipelines/{FINISHED}/checkpoints",
    f"/api/pipelines/{FINISHED}/checkpoints/1",
    f"/api/pipelines/{FINISHED}/restores",
    f"/api/pipelines/{FINISHED}/requests",
    f"/api/pipelines/{FINISHED}/requests/1",
    f"/api/pipelines/{FINISHED}/restore-plan?parallelism=2",
    "/openapi.json",
]


# ============================================================================ who may do what


def test_every_endpoint_refuses_a_caller_who_is_not_logged_in(server: Server) -> None:
    for path in READS:
        for token in (None, "not-a-jwt", server.tokens["admin"][:-4] + "AAAA"):
            r = server.call("GET", path, token=token)
            assert r.status == 401, (path, token, r.body)
            assert r.headers.get("www-authenticate") == "Bearer"
            assert "not authenticated" in r.body["detail"]
    before = len(request_rows(server.metastore, LIVE))
    r = server.call("POST", f"/api/pipelines/{LIVE}/savepoints", body={"stop": False})
    assert r.status == 401, r.body
    assert len(request_rows(server.metastore, LIVE)) == before


def test_a_logged_in_user_reads_and_the_openapi_schema_describes_the_api(server: Server) -> None:
    for user in ("admin", "viewer"):
        for path in READS:
            if path.endswith("/requests/1"):
                continue  # no request yet: 404, tested below
            r = server.call("GET", path, user=user)
            assert r.status == 200, (user, path, r.body)
    schema = server.call("GET", "/openapi.json", user="viewer").body
    assert schema["servers"] == [{"url": "/checkpoints"}]
    paths = schema["paths"]
    assert set(paths) == {
        "/api/pipelines",
        "/api/pipelines/{pipeline_id}",
        "/api/pipelines/{pipeline_id}/summary",
        "/api/pipelines/{pipeline_id}/checkpoints",
        "/api/pipelines/{pipeline_id}/checkpoints/{checkpoint_id}",
        "/api/pipelines/{pipeline_id}/checkpoints/{checkpoint_id}/discard",
        "/api/pipelines/{pipeline_id}/checkpoints/{checkpoint_id}/restore",
        "/api/pipelines/{pipeline_id}/restores",
        "/api/pipelines/{pipeline_id}/requests",
        "/api/pipelines/{pipeline_id}/requests/{request_id}",
        "/api/pipelines/{pipeline_id}/savepoints",
        "/api/pipelines/{pipeline_id}/restore-plan",
    }
    post = paths["/api/pipelines/{pipeline_id}/savepoints"]["post"]
    assert {"202", "401", "403", "404", "409", "422"} <= set(post["responses"])
    assert "CheckpointDetail" in schema["components"]["schemas"]
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_a_read_only_user_cannot_request_a_savepoint(server: Server) -> None:
    before = len(request_rows(server.metastore, LIVE))
    for stop in (False, True):
        r = server.call(
            "POST", f"/api/pipelines/{LIVE}/savepoints", user="viewer", body={"stop": stop}
        )
        assert r.status == 403, r.body
        assert "no edit access" in r.body["detail"] and "'viewer'" in r.body["detail"]
    assert len(request_rows(server.metastore, LIVE)) == before
    pipelines = server.call("GET", "/api/pipelines", user="viewer").body["pipelines"]
    assert {p["job_id"]: p["can_edit"] for p in pipelines} == {
        FINISHED: False,
        LIVE: False,
        IDLE: False,
    }
    admin = server.call("GET", f"/api/pipelines/{LIVE}", user="admin").body
    assert admin["can_edit"] is True


def test_a_user_without_access_to_the_dags_sees_no_pipeline(server: Server) -> None:
    assert server.call("GET", "/api/pipelines", user="outsider").body == {
        "pipelines": [],
        "total": 0,
    }
    for path in READS[1:9]:
        r = server.call("GET", path, user="outsider")
        assert r.status == 403 and "no read access" in r.body["detail"], (path, r.body)
    r = server.call("GET", "/api/pipelines/nope", user="outsider")
    assert r.status == 403, "an unknown pipeline is no different: nothing leaks"
    r = server.call("POST", f"/api/pipelines/{LIVE}/savepoints", user="outsider", body={})
    assert r.status == 403 and "no edit access" in r.body["detail"]


def test_the_ui_cookie_authenticates_but_cannot_be_used_for_a_cross_site_action(
    server: Server,
) -> None:
    before = len(request_rows(server.metastore, LIVE))
    cookie = {"Cookie": f"_token={server.tokens['admin']}"}
    assert server.call("GET", "/api/pipelines", headers=cookie).status == 200
    path = f"/api/pipelines/{LIVE}/savepoints"
    # a form another site posts: the browser sends the cookie, nothing else
    r = server.call("POST", path, body={}, headers={**cookie, "Origin": "https://evil.example"})
    assert r.status == 403 and "X-Requested-By" in r.body["detail"], r.body
    forged = {**cookie, "X-Requested-By": "ui", "Origin": "https://evil.example"}
    r = server.call("POST", path, body={}, headers=forged)
    assert r.status == 403 and "'https://evil.example' is not Airflow's" in r.body["detail"]
    referer = {**cookie, "X-Requested-By": "ui", "Referer": "http://evil.example/page"}
    assert server.call("POST", path, body={}, headers=referer).status == 403
    assert len(request_rows(server.metastore, LIVE)) == before
    # the Checkpoints page itself: Airflow's origin, the header set by its fetch
    own = {**cookie, "X-Requested-By": "ui", "Origin": server.url}
    r = server.call("POST", path, body={}, headers=own)
    assert r.status == 202, r.body
    assert r.body["requested_by"] == "airflow:admin"
    take_requests(server)


# ============================================================================ reads


def test_pipelines_with_their_status_and_latest_checkpoint(server: Server) -> None:
    body = server.call("GET", "/api/pipelines", user="viewer").body
    assert body["total"] == 3
    by_id = {p["job_id"]: p for p in body["pipelines"]}
    finished, live, idle = by_id[FINISHED], by_id[LIVE], by_id[IDLE]
    assert (finished["status"], finished["running"]) == ("FINISHED", False)
    assert (live["status"], live["running"]) == ("RUNNING", True)
    assert finished["last_completed_id"] == 7
    assert finished["latest_checkpoint"]["checkpoint_id"] == 8
    assert finished["latest_checkpoint"]["status"] == "ABORTED"
    assert finished["checkpoints"] == {"COMPLETED": 3, "SUBSUMED": 4, "ABORTED": 1}
    assert idle["latest_checkpoint"] is None and idle["checkpoints"] == {}
    assert server.call("GET", f"/api/pipelines/{LIVE}", user="viewer").body["job_id"] == LIVE


def test_a_pipelines_summary(server: Server) -> None:
    body = server.call("GET", f"/api/pipelines/{FINISHED}/summary", user="viewer").body
    assert body["counts"] == {"COMPLETED": 3, "SUBSUMED": 4, "ABORTED": 1}
    assert body["completed"] == 7
    history = server.call("GET", f"/api/pipelines/{FINISHED}/checkpoints", user="viewer").body
    done = [c for c in history["checkpoints"] if c["completed_at"]]
    sizes = [c["state_size"] for c in done]
    durations = [c["duration_ms"] for c in done]
    assert body["state_size"] == {
        "min": min(sizes),
        "avg": round(sum(sizes) / len(sizes), 1),
        "max": max(sizes),
    }
    assert body["duration_ms"]["min"] == min(durations)
    assert body["duration_ms"]["max"] == max(durations)
    assert body["latest_completed"]["checkpoint_id"] == 7
    assert (body["latest_failed"]["checkpoint_id"], body["latest_failed"]["status"]) == (
        8,
        "ABORTED",
    )
    assert body["latest_savepoint"]["type"] == "SAVEPOINT"
    assert body["latest_savepoint"]["checkpoint_id"] == 7
    assert (body["latest_restore"]["attempt"], body["latest_restore"]["checkpoint_id"]) == (
        "try-2",
        7,
    )

    idle = server.call("GET", f"/api/pipelines/{IDLE}/summary", user="viewer").body
    assert idle == {
        "job_id": IDLE,
        "counts": {},
        "completed": 0,
        "duration_ms": None,
        "state_size": None,
        "latest_completed": None,
        "latest_failed": None,
        "latest_savepoint": None,
        "latest_restore": None,
    }


def test_checkpoint_history_is_paged_and_filtered(server: Server) -> None:
    base = f"/api/pipelines/{FINISHED}/checkpoints"
    pages = [
        server.call("GET", f"{base}?limit=3&offset={o}", user="viewer").body for o in (0, 3, 6)
    ]
    assert [p["total"] for p in pages] == [8, 8, 8]
    ids = [[c["checkpoint_id"] for c in p["checkpoints"]] for p in pages]
    assert ids == [[8, 7, 6], [5, 4, 3], [2, 1]]
    assert pages[1]["limit"] == 3 and pages[1]["offset"] == 3
    first = pages[2]["checkpoints"][1]
    assert (first["type"], first["status"], first["acked_tasks"], first["num_tasks"]) == (
        "CHECKPOINT",
        "SUBSUMED",
        3,
        3,
    )
    assert first["duration_ms"] == 0 and first["state_size"] > 0

    completed = server.call("GET", f"{base}?status=COMPLETED", user="viewer").body
    assert completed["total"] == 3
    assert [c["checkpoint_id"] for c in completed["checkpoints"]] == [7, 6, 5]
    saved = server.call("GET", f"{base}?type=SAVEPOINT&status=COMPLETED", user="viewer").body
    assert [(c["checkpoint_id"], c["type"]) for c in saved["checkpoints"]] == [(7, "SAVEPOINT")]
    assert saved["total"] == 1
    beyond = server.call("GET", f"{base}?offset=100", user="viewer").body
    assert beyond["checkpoints"] == [] and beyond["total"] == 8

    for bad in ("status=DONE", "type=backup", "limit=0", "limit=501", "offset=-1", "limit=x"):
        r = server.call("GET", f"{base}?{bad}", user="viewer")
        assert r.status == 422, (bad, r.body)


def test_a_checkpoint_in_detail_per_operator_and_subtask(server: Server) -> None:
    detail = server.call("GET", f"/api/pipelines/{FINISHED}/checkpoints/7", user="viewer").body
    assert (detail["job_id"], detail["type"], detail["status"]) == (
        FINISHED,
        "SAVEPOINT",
        "COMPLETED",
    )
    assert [(t["operator_id"], t["subtask_index"]) for t in detail["tasks"]] == [
        ("sink", 0),
        ("source", 0),
        ("source", 1),
    ]
    for task in detail["tasks"]:
        assert task["acked"] is True
        assert task["state_handle"].startswith(detail["storage_location"])
        assert task["state_size"] > 0 and task["acked_at"] is not None
        assert "sync_ms" in task and "async_ms" in task
    assert sum(t["state_size"] for t in detail["tasks"]) == detail["state_size"]
    # per operator (as Flink's checkpoint details): the subtasks' acks and bytes summed
    by_operator = {
        op: [t for t in detail["tasks"] if t["operator_id"] == op] for op in ("sink", "source")
    }
    assert detail["operators"] == [
        {
            "operator_id": op,
            "subtasks": len(ts),
            "acked": len(ts),
            "state_size": sum(t["state_size"] for t in ts),
            "latest_ack": max(t["acked_at"] for t in ts),
        }
        for op, ts in by_operator.items()
    ]
    # the input its runs consumed, from the source's acks (the seed's SOURCE_STATE)
    consumed = detail["input"]
    assert [
        (r["attempt"], r["first_epoch"], r["last_epoch"], r["files"], r["bytes"])
        for r in consumed["runs"]
    ] == [("try-1", 0, 1, 2, 5100), ("try-2", 2, 2, 1, 5000)]
    assert (consumed["files_processed"], consumed["splits_remaining"]) == (2, 1)
    assert consumed["next_epoch"] == 3 and consumed["files_omitted"] == 0
    local, big, new = consumed["files"]
    assert local["mtime"] == "2023-11-14T22:13:20Z" and local["etag"] is None
    assert (big["epochs"], big["attempts"], big["etag"]) == ([1, 2], ["try-1", "try-2"], "e-big")
    assert (new["path"], new["remaining_splits"]) == ("s3://in/new.parquet", 1)
    aborted = server.call("GET", f"/api/pipelines/{FINISHED}/checkpoints/8", user="viewer").body
    assert aborted["status"] == "ABORTED" and not any(t["acked"] for t in aborted["tasks"])
    assert all(o["acked"] == 0 and o["state_size"] == 0 for o in aborted["operators"])
    assert sum(o["subtasks"] for o in aborted["operators"]) == len(aborted["tasks"]) > 0
    assert aborted["input"] is None  # its source never acknowledged it
    previous = server.call("GET", f"/api/pipelines/{FINISHED}/checkpoints/6", user="viewer").body
    assert previous["input"]["runs"] == [] and previous["input"]["files"] == []  # no list state


def test_unknown_ids_are_404_and_malformed_ones_422(server: Server) -> None:
    not_found = [
        "/api/pipelines/nope",
        "/api/pipelines/nope/checkpoints",
        "/api/pipelines/nope/summary",
        "/api/pipelines/nope/checkpoints/1",
        "/api/pipelines/nope/restores",
        "/api/pipelines/nope/requests",
        "/api/pipelines/nope/restore-plan?parallelism=2",
        f"/api/pipelines/{FINISHED}/checkpoints/99",
        f"/api/pipelines/{FINISHED}/requests/4242",
    ]
    for path in not_found:
        r = server.call("GET", path, user="viewer")
        assert r.status == 404, (path, r.body)
        assert isinstance(r.body["detail"], str) and r.body["detail"]
    malformed = [
        "/api/pipelines/-dash-first",
        "/api/pipelines/a..b/checkpoints",
        "/api/pipelines/" + "x" * 129,
        f"/api/pipelines/{FINISHED}/checkpoints/0",
        f"/api/pipelines/{FINISHED}/checkpoints/abc",
        f"/api/pipelines/{FINISHED}/checkpoints/{2**63}",
        f"/api/pipelines/{FINISHED}/requests/-1",
        f"/api/pipelines/{FINISHED}/requests/latest",
    ]
    for path in malformed:
        r = server.call("GET", path, user="viewer")
        assert r.status == 422, (path, r.body)
    before = len(request_rows(server.metastore, LIVE))
    r = server.call("POST", "/api/pipelines/nope/savepoints", user="admin", body={})
    assert r.status == 404 and "unknown job 'nope'" in r.body["detail"]
    r = server.call("POST", f"/api/pipelines/{LIVE}/savepoints", user="admin", body={"stop": "x"})
    assert r.status == 422
    r = server.call("POST", f"/api/pipelines/{LIVE}/savepoints", user="admin", body={"drop": 1})
    assert r.status == 422
    assert len(request_rows(server.metastore, LIVE)) == before


def test_restore_history(server: Server) -> None:
    (restore,) = server.call("GET", f"/api/pipelines/{FINISHED}/restores", user="viewer").body[
        "restores"
    ]
    assert (restore["attempt"], restore["checkpoint_id"], restore["parallelism"]) == (
        "try-2",
        7,
        3,
    )
    assert restore["status"] == "PLANNED" and restore["fallbacks"] == []
    assert [op["operator_id"] for op in restore["assignment"]["operators"]] == ["sink", "source"]
    assert server.call("GET", f"/api/pipelines/{LIVE}/restores", user="viewer").body == {
        "restores": [],
        "total": 0,
        "limit": 50,
        "offset": 0,
    }


def test_restore_plan_preview(server: Server) -> None:
    base = f"/api/pipelines/{FINISHED}/restore-plan"
    plan = server.call("GET", f"{base}?parallelism=4", user="viewer").body
    assert (plan["checkpoint_id"], plan["checkpoint_type"], plan["dry_run"]) == (
        7,
        "SAVEPOINT",
        True,
    )
    assert plan["parallelism"] == 4 and len(plan["subtasks"]) == 4
    assert {
        (op["operator_id"], op["old_parallelism"], op["parallelism"]) for op in plan["operators"]
    } == {
        ("sink", 1, 4),
        ("source", 2, 4),
    }
    older = server.call("GET", f"{base}?parallelism=1&from=6", user="viewer").body
    assert (older["checkpoint_id"], older["checkpoint_type"]) == (6, "CHECKPOINT")
    # what was planned is not recorded: still the one restore of the seed
    assert (
        len(
            server.call("GET", f"/api/pipelines/{FINISHED}/restores", user="admin").body["restores"]
        )
        == 1
    )

    r = server.call("GET", f"{base}?parallelism=17", user="viewer")  # above max parallelism 16
    assert r.status == 422 and "16" in r.body["detail"], r.body
    for bad in (
        "parallelism=0",
        "parallelism=-2",
        "",
        "parallelism=2&from=abc",
        "parallelism=2&from=/etc",
    ):
        assert server.call("GET", f"{base}?{bad}", user="viewer").status == 422, bad
    r = server.call("GET", f"{base}?parallelism=2&from=1", user="viewer")  # subsumed
    assert r.status == 404 and "SUBSUMED" in r.body["detail"], r.body
    r = server.call("GET", f"/api/pipelines/{IDLE}/restore-plan?parallelism=2", user="viewer")
    assert r.status == 404 and "no valid completed checkpoint" in r.body["detail"], r.body


# ============================================================================ actions


def deploy_runs(server: Server) -> list[dict]:
    """The runs of the deploy DAG, from Airflow's own REST API."""
    request = urllib.request.Request(
        f"{server.url}/api/v2/dags/checkpoint_deploy/dagRuns",
        headers={"Authorization": f"Bearer {server.tokens['admin']}"},
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        return list(json.loads(r.read())["dag_runs"])


def test_restore_from_here_runs_the_deploy_dag_from_that_checkpoint(server: Server) -> None:
    restore = f"/api/pipelines/{FINISHED}/checkpoints/7/restore"
    # a read-only user, or no access at all: refused, nothing triggered
    for user in ("viewer", "outsider"):
        r = server.call("POST", restore, user=user, body={})
        assert r.status == 403 and "no edit access" in r.body["detail"], (user, r.body)
    assert deploy_runs(server) == []

    r = server.call("POST", restore, user="admin", body={"parallelism": 2})
    assert r.status == 202, r.body
    savepoint = server.call("GET", f"/api/pipelines/{FINISHED}/checkpoints/7", user="admin").body
    conf = {"pipeline": FINISHED, "from": savepoint["metadata_path"], "parallelism": 2}
    assert r.body["dag_id"] == "checkpoint_deploy" and r.body["conf"] == conf
    assert r.body["state"] == "queued"
    run_id = r.body["dag_run_id"]
    assert r.body["url"] == f"/dags/checkpoint_deploy/runs/{quote(run_id, safe='')}"
    (run,) = deploy_runs(server)
    assert (run["dag_run_id"], run["state"], run["conf"]) == (run_id, "queued", conf)
    assert run["run_type"] == "manual" and run["triggering_user_name"] == "admin"

    # a retained checkpoint too; no parallelism: the spec's
    r = server.call("POST", f"/api/pipelines/{FINISHED}/checkpoints/6/restore", user="admin")
    assert r.status == 202, r.body
    assert r.body["conf"]["parallelism"] is None
    assert r.body["conf"]["from"].endswith("/_metadata")
    assert len(deploy_runs(server)) == 2

    # only a completed checkpoint whose files verify, of a pipeline that is not running
    for checkpoint_id, state in ((1, "SUBSUMED"), (8, "ABORTED")):
        path = f"/api/pipelines/{FINISHED}/checkpoints/{checkpoint_id}/restore"
        r = server.call("POST", path, user="admin", body={})
        assert r.status == 409 and f"is {state}" in r.body["detail"], r.body
    r = server.call("POST", f"/api/pipelines/{LIVE}/checkpoints/1/restore", user="admin")
    assert r.status == 409 and "is running" in r.body["detail"], r.body
    detail = server.call("GET", f"/api/pipelines/{FINISHED}/checkpoints/6", user="admin").body
    state_file = Path(urlsplit(detail["tasks"][0]["state_handle"]).path)
    original = state_file.read_bytes()
    state_file.write_bytes(original + b"corrupt")
    try:
        r = server.call("POST", f"/api/pipelines/{FINISHED}/checkpoints/6/restore", user="admin")
    finally:
        state_file.write_bytes(original)
    assert r.status == 409 and "do not verify" in r.body["detail"], r.body
    # unknown → 404, malformed → 422
    r = server.call("POST", f"/api/pipelines/{FINISHED}/checkpoints/999/restore", user="admin")
    assert r.status == 404, r.body
    r = server.call("POST", "/api/pipelines/nope/checkpoints/1/restore", user="admin")
    assert r.status == 404, r.body
    for body in ({"parallelism": 0}, {"parallelism": "x"}, {"other": 1}):
        assert server.call("POST", restore, user="admin", body=body).status == 422, body
    r = server.call("POST", restore, user="admin", body={"parallelism": 17})  # max is 16
    assert r.status == 422 and "16" in r.body["detail"], r.body
    assert len(deploy_runs(server)) == 2

    # the deploy DAG gone from the DAGs folder (stale, as the dag-processor marks it): 409
    airflow_db = server.log.parent / "airflow" / "airflow.db"
    stale = "UPDATE dag SET is_stale = ? WHERE dag_id = 'checkpoint_deploy'"
    with closing(sqlite3.connect(airflow_db)) as db, db:
        assert db.execute(stale, (True,)).rowcount == 1
    try:
        r = server.call("POST", restore, user="admin", body={})
    finally:
        with closing(sqlite3.connect(airflow_db)) as db, db:
            db.execute(stale, (False,))
    assert r.status == 409, r.body
    assert "deploy DAG checkpoint_deploy is not available" in r.body["detail"]
    assert len(deploy_runs(server)) == 2


def test_an_admin_requests_a_savepoint_and_follows_it_to_completion(server: Server) -> None:
    r = server.call("POST", f"/api/pipelines/{LIVE}/savepoints", user="admin", body={})
    assert r.status == 202, r.body
    queued = r.body
    assert (queued["status"], queued["checkpoint_type"], queued["done"]) == (
        "QUEUED",
        "SAVEPOINT",
        False,
    )
    assert queued["requested_by"] == "airflow:admin" and queued["savepoint_path"] is None
    location = r.headers["location"]
    assert (
        location == f"{server.url}/checkpoints/api/pipelines/{LIVE}/requests/{queued['request_id']}"
    )
    path = location.removeprefix(f"{server.url}/checkpoints")
    assert server.call("GET", path, user="viewer").body["status"] == "QUEUED"
    listed = server.call("GET", f"/api/pipelines/{LIVE}/requests", user="viewer").body["requests"]
    assert listed[0]["request_id"] == queued["request_id"] and listed[0]["status"] == "QUEUED"

    (savepoint_id,) = take_requests(server)
    done = server.call("GET", path, user="viewer").body
    assert (done["status"], done["done"], done["succeeded"]) == ("COMPLETED", True, True)
    assert done["checkpoint_id"] == savepoint_id
    assert done["savepoint_path"] == server.storage.savepoint_url(LIVE, savepoint_id)
    detail = server.call(
        "GET", f"/api/pipelines/{LIVE}/checkpoints/{savepoint_id}", user="viewer"
    ).body
    assert detail["type"] == "SAVEPOINT" and detail["request"]["request_id"] == queued["request_id"]
    # the request belongs to its pipeline only
    other = f"/api/pipelines/{FINISHED}/requests/{queued['request_id']}"
    assert server.call("GET", other, user="viewer").status == 404


def test_a_savepoint_of_a_pipeline_that_is_not_running_is_a_clear_409(server: Server) -> None:
    for job, state in ((FINISHED, "FINISHED"), (IDLE, "CREATED")):
        r = server.call(
            "POST", f"/api/pipelines/{job}/savepoints", user="admin", body={"stop": True}
        )
        assert r.status == 409, r.body
        assert f"job '{job}' is not running (status {state})" in r.body["detail"]
    assert request_rows(server.metastore, FINISHED) == []


def test_a_completed_savepoint_is_discarded_with_its_files(server: Server) -> None:
    r = server.call("POST", f"/api/pipelines/{LIVE}/savepoints", user="admin", body={})
    (savepoint_id,) = take_requests(server)
    location = server.storage.savepoint_url(LIVE, savepoint_id)
    assert location_exists(server.storage, location)
    discard = f"/api/pipelines/{LIVE}/checkpoints/{savepoint_id}/discard"
    r = server.call("POST", discard, user="viewer")
    assert r.status == 403 and "no edit access" in r.body["detail"], r.body
    cookie = {"Cookie": f"_token={server.tokens['admin']}"}
    assert server.call("POST", discard, headers=cookie).status == 403  # no X-Requested-By
    assert location_exists(server.storage, location)

    r = server.call("POST", discard, user="admin")
    assert r.status == 200, r.body
    assert (r.body["checkpoint_id"], r.body["status"]) == (savepoint_id, "DISCARDED")
    assert not location_exists(server.storage, location)
    r = server.call("POST", discard, user="admin")
    assert r.status == 409 and "only a COMPLETED savepoint" in r.body["detail"], r.body
    r = server.call("POST", f"/api/pipelines/{LIVE}/checkpoints/1/discard", user="admin")
    assert r.status == 409 and "CHECKPOINT: only a COMPLETED savepoint" in r.body["detail"]
    r = server.call("POST", f"/api/pipelines/{LIVE}/checkpoints/999/discard", user="admin")
    assert r.status == 404, r.body
    r = server.call("POST", f"/api/pipelines/{LIVE}/checkpoints/0/discard", user="admin")
    assert r.status == 422, r.body


def test_discarding_a_savepoint_whose_row_points_elsewhere_deletes_nothing(
    server: Server, tmp_path: Path
) -> None:
    """Issue 38, scenario B: pipeline code (which has the metastore URL) points its own
    completed savepoint's row at a directory of the api-server's host, or at the storage base;
    ``POST …/discard`` is refused (409), deletes nothing and leaves the savepoint COMPLETED."""
    from sqlalchemy import update

    from checkpointing.metastore.models import Checkpoint

    server.call("POST", f"/api/pipelines/{LIVE}/savepoints", user="admin", body={})
    (savepoint_id,) = take_requests(server)
    own = server.storage.savepoint_url(LIVE, savepoint_id)
    victim = tmp_path / "opt-airflow"
    (victim / "dags").mkdir(parents=True)
    (victim / "dags" / "keep.py").write_text("# not the pipeline's")
    for target in (f"file://{victim}", server.storage.base_url):
        with server.metastore.transaction() as s:
            s.execute(
                update(Checkpoint)
                .where(Checkpoint.job_id == LIVE, Checkpoint.checkpoint_id == savepoint_id)
                .values(storage_location=target)
            )
        r = server.call(
            "POST", f"/api/pipelines/{LIVE}/checkpoints/{savepoint_id}/discard", user="admin"
        )
        assert r.status == 409 and "as the ids give it" in r.body["detail"], r.body
        assert (victim / "dags" / "keep.py").read_text() == "# not the pipeline's"
        assert location_exists(server.storage, own)
        detail = server.call(
            "GET", f"/api/pipelines/{LIVE}/checkpoints/{savepoint_id}", user="admin"
        ).body
        assert detail["status"] == "COMPLETED", detail


def test_a_storage_url_outside_the_roots_is_never_read_or_deleted_by_the_api_server(
    server: Server, tmp_path: Path
) -> None:
    """Issue 38 (M1): pipeline code points its job row's ``storage_url`` (and its savepoint's
    row) at a tree of the api-server's host laid out like the job's storage: discard, restore
    and the restore plan answer 409 naming the job and the field, and delete nothing there.
    The api-server's roots: its ``CKPT_STORAGE_URL`` (no ``CKPT_STORAGE_ROOTS``)."""
    import shutil

    from sqlalchemy import update

    from checkpointing.metastore.models import Checkpoint, Job

    server.call("POST", f"/api/pipelines/{LIVE}/savepoints", user="admin", body={})
    (savepoint_id,) = take_requests(server)
    victim = tmp_path / "opt-airflow"
    for job in (LIVE, FINISHED):  # the same layout: the ids derive paths in it
        shutil.copytree(server.storage.path_of(server.storage.job_url(job)), victim / job)
    keep = victim / LIVE / "savepoints" / f"savepoint-{savepoint_id}" / "keep.py"
    keep.write_text("# not the pipeline's")
    registered = server.storage.base_url

    def forge(storage_url: str) -> None:
        with server.metastore.transaction() as s:
            s.execute(
                update(Job).where(Job.job_id.in_([LIVE, FINISHED])).values(storage_url=storage_url)
            )
            s.execute(
                update(Checkpoint)
                .where(Checkpoint.job_id == LIVE, Checkpoint.checkpoint_id == savepoint_id)
                .values(
                    storage_location=f"{storage_url}/{LIVE}/savepoints/savepoint-{savepoint_id}"
                )
            )

    runs = len(deploy_runs(server))
    forge(f"file://{victim}")
    try:
        for method, job, path in [
            ("POST", LIVE, f"checkpoints/{savepoint_id}/discard"),
            ("POST", FINISHED, "checkpoints/7/restore"),
            ("GET", FINISHED, "restore-plan?parallelism=2&from=7"),
        ]:
            r = server.call(method, f"/api/pipelines/{job}/{path}", user="admin")
            assert r.status == 409, (path, r.body)
            assert r.body["detail"].startswith(
                f"job '{job}': storage_url 'file://{victim}' is not under an allowed checkpoint "
                f"storage root ({registered}"
            ), r.body
        assert keep.read_text() == "# not the pipeline's"
        assert len(deploy_runs(server)) == runs  # no restore was triggered
        detail = server.call(
            "GET", f"/api/pipelines/{LIVE}/checkpoints/{savepoint_id}", user="admin"
        ).body
        assert detail["status"] == "COMPLETED", detail
    finally:
        forge(registered)


def test_stop_with_savepoint_ends_the_job(server: Server) -> None:
    r = server.call("POST", f"/api/pipelines/{LIVE}/savepoints", user="admin", body={"stop": True})
    assert r.status == 202 and r.body["checkpoint_type"] == "SAVEPOINT_THEN_STOP", r.body
    take_requests(server)
    done = server.call(
        "GET", f"/api/pipelines/{LIVE}/requests/{r.body['request_id']}", user="admin"
    )
    assert done.body["succeeded"] is True, done.body


# ============================================================================ issue 10 §4


def test_the_restore_history_is_paged_and_bounded(server: Server) -> None:
    """Every retry records a restore: the history is read a page at a time, like the others."""
    from checkpointing.restore.lookup import RestoreDecision, record_restore

    empty = RestoreDecision(IDLE, None, None, None, None)
    for attempt in range(5):
        record_restore(server.metastore, empty, attempt=f"paged-{attempt}")
    base = f"/api/pipelines/{IDLE}/restores"
    pages = [
        server.call("GET", f"{base}?limit=2&offset={o}", user="viewer").body for o in (0, 2, 4)
    ]
    assert [[r["attempt"] for r in p["restores"]] for p in pages] == [
        ["paged-4", "paged-3"],
        ["paged-2", "paged-1"],
        ["paged-0"],
    ]
    assert [(p["total"], p["limit"], p["offset"]) for p in pages] == [
        (5, 2, 0),
        (5, 2, 2),
        (5, 2, 4),
    ]
    assert server.call("GET", base, user="viewer").body["limit"] == 50  # the default page
    for bad in ("limit=0", "limit=501", "offset=-1", "limit=x"):
        r = server.call("GET", f"{base}?{bad}", user="viewer")
        assert r.status == 422, (bad, r.body)


def _airflow_api(server: Server, method: str, path: str, body: Any = None) -> int:
    """Airflow's own REST API as admin; the HTTP status."""
    request = urllib.request.Request(
        f"{server.url}/api/v2{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={
            "Authorization": f"Bearer {server.tokens['admin']}",
            "Content-Type": "application/json",
        },
        method=method,
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_a_metastore_problem_is_shown_without_its_details(server: Server) -> None:
    """The `checkpoint_metastore` connection pointing at a server that is down, then at a URL
    that does not parse: every caller, even one without access to any DAG, learns only that the
    metastore is unavailable; the reason goes to the api-server's log, without the password."""
    password = "pw-Zq81xK3v"
    broken = [
        {"conn_type": "postgres", "host": "127.0.0.1", "port": 1, "schema": "ckpt"},
        {
            "conn_type": "postgres",
            "extra": json.dumps(
                {"sqlalchemy_url": f"postgresql+psycopg://ckpt:{password}@@127.0.0.1:x/ckpt"}
            ),
        },
    ]
    for connection in broken:
        body = {"connection_id": "checkpoint_metastore", "login": "ckpt", "password": password}
        assert _airflow_api(server, "POST", "/connections", {**body, **connection}) == 201
        try:
            for user in ("outsider", "viewer", "admin"):
                for path in ("/api/pipelines", f"/api/pipelines/{FINISHED}/checkpoints"):
                    r = server.call("GET", path, user=user)
                    if r.status == 403:  # the outsider reads no pipeline: refused first
                        continue
                    assert r.status == 503, (user, path, r.body)
                    detail = r.body["detail"]
                    assert "checkpoint metastore is unavailable" in detail, detail
                    for leak in ("127.0.0.1", "ckpt:", password, "psycopg", "postgres"):
                        assert leak not in detail, (leak, detail)
        finally:
            assert _airflow_api(server, "DELETE", "/connections/checkpoint_metastore") == 204
    log = server.log.read_text(errors="replace")
    assert "checkpoint API: metastore problem" in log
    assert password not in log
    assert server.call("GET", "/api/pipelines", user="viewer").status == 200  # back again


def _raw_post(server: Server, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
    """A POST over a plain socket, so that the body may be shorter than its Content-Length (or
    chunked); the status and what came back within 15 s."""
    parts = urlsplit(server.url)
    head = [f"POST {parts.path}/checkpoints/api/pipelines/{LIVE}/savepoints HTTP/1.1"]
    head += [f"Host: {parts.netloc}", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    with socket.create_connection((parts.hostname, parts.port), timeout=15) as conn:
        conn.sendall("\r\n".join(head).encode() + body)
        received = b""
        try:
            while b"\r\n\r\n" not in received:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                received += chunk
        except TimeoutError:
            pytest.fail("no answer in 15 s: the server waits for the whole body")
    status_line = received.split(b"\r\n", 1)[0].split()
    return int(status_line[1]), received


def test_request_bodies_are_bounded_and_the_login_is_checked_before_the_body_is_read(
    server: Server,
) -> None:
    before = len(request_rows(server.metastore, LIVE))
    path = f"/api/pipelines/{LIVE}/savepoints"
    # a body announced as a gigabyte: refused at once, by its length, not read
    status_code, answer = _raw_post(
        server,
        {"Content-Type": "application/json", "Content-Length": str(10**9)},
        b'{"stop": false, "pad": "',
    )
    assert status_code == 413, answer
    # a chunked body, whose size is not known in advance: refused too
    status_code, answer = _raw_post(
        server,
        {
            "Content-Type": "application/json",
            "Transfer-Encoding": "chunked",
            "Authorization": f"Bearer {server.tokens['admin']}",
        },
        b"5\r\n{}   \r\n",
    )
    assert status_code == 411, answer
    # too large for an admin as well (before: read whole, then 422 for the unknown field)
    r = server.call("POST", path, user="admin", body={"stop": False, "pad": "x" * 100_000})
    assert r.status == 413 and "larger than" in r.body["detail"], r.body
    # without a login, a body is never parsed: 401, not a JSON error
    sent = urllib.request.Request(
        f"{server.url}/checkpoints{path}",
        data=b"{not json",
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(sent, timeout=30)
    assert refused.value.code == 401
    assert "not authenticated" in json.loads(refused.value.read())["detail"]
    # a body of ordinary size still works
    r = server.call("POST", path, user="viewer", body={"stop": False})
    assert r.status == 403, r.body
    assert len(request_rows(server.metastore, LIVE)) == before


def test_nothing_is_loaded_from_another_site(server: Server) -> None:
    """The Swagger page loaded its scripts from a public CDN inside Airflow's origin (and
    offline clusters cannot reach it): it is gone; the schema is at openapi.json."""
    for user in ("admin", "viewer"):
        r = server.call("GET", "/docs", user=user)
        assert r.status == 404, r.body
    schema = server.call("GET", "/openapi.json", user="viewer")
    assert schema.status == 200
    page = urllib.request.Request(
        f"{server.url}/checkpoints/ui/", headers={"Cookie": f"_token={server.tokens['viewer']}"}
    )
    with urllib.request.urlopen(page, timeout=30) as r:
        html = r.read().decode()
    for text in (json.dumps(schema.body), html):
        assert not re.search(r"(src|href)=[\"']?(https?:)?//", text), "an external asset"
        assert "cdn." not in text


# ============================================================================ issue 22 §4

#: fields the API adds to a view's row: everything else comes from the view, key for key
API_ONLY = {
    "Pipeline": {"running", "latest_checkpoint", "can_edit"},
    "RequestState": {"done", "succeeded"},
}


def _models_of(annotation: Any) -> list[type]:
    """The response models in a field's annotation (``X | None``, ``list[X]``)."""
    from typing import get_args

    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_of(arg)]


def _drift(row: dict[str, Any], model: type, where: str, seen: set[str]) -> list[str]:
    """Where ``row`` (a view's dict) and ``model`` (its API shape) disagree, nested rows too."""
    seen.add(model.__name__)
    fields = model.model_fields
    found = [f"{where}.{key}: no field in {model.__name__}" for key in row if key not in fields]
    extra = API_ONLY.get(model.__name__, set())
    found += [
        f"{where}.{name}: {model.__name__} has it, the view does not"
        for name in fields
        if name not in row and name not in extra
    ]
    for key, value in row.items():
        nested = _models_of(fields[key].annotation) if key in fields else []
        for item in value if isinstance(value, list) else [value]:
            if nested and isinstance(item, dict):
                found += _drift(item, nested[0], f"{where}.{key}", seen)
    return found


def test_every_key_a_view_returns_is_a_field_of_the_apis_shape(
    metastore: Any, storage: Any
) -> None:
    """The API's response models and the views they are built from (``ckpt … --json``) say the
    same, key for key, nested rows included: a view's key without a field would be dropped
    silently (the Checkpoints page's Written column was empty so), a field without a key
    would fail every response."""
    from checkpointing.coordination import savepoints
    from checkpointing.metastore import views
    from checkpointing.metastore.input_views import summarize_items
    from checkpointing.restore.lookup import preview_restore
    from checkpointing_airflow.api import schemas
    from tests.airflow_api_server import SOURCE_STATE, _seed

    live = _seed(metastore, storage)
    request_id = savepoints.request_savepoint(metastore, LIVE, requested_by="admin")
    (requested,) = live.process_requests()  # a savepoint with its request
    assert ack_all(live, requested).completed is not None
    rows: list[tuple[str, dict[str, Any], type]] = [
        *(("list_jobs", r, schemas.Pipeline) for r in views.list_jobs(metastore)),
        *(
            ("list_checkpoints", r, schemas.CheckpointSummary)
            for r in views.list_checkpoints(metastore, FINISHED)
        ),
        (
            "checkpoint_detail",
            views.checkpoint_detail(metastore, FINISHED, 7),
            schemas.CheckpointDetail,
        ),
        (
            "checkpoint_detail of a requested savepoint",
            views.checkpoint_detail(metastore, LIVE, requested.checkpoint_id),
            schemas.CheckpointDetail,
        ),
        ("consumed_input", views.consumed_input(metastore, FINISHED, 7), schemas.ConsumedInput),
        (
            "input with a table",
            summarize_items([*SOURCE_STATE[0], {"table": "dim", "path": "/t/dim.csv", "size": 9}]),
            schemas.ConsumedInput,
        ),
        *(("list_restores", r, schemas.Restore) for r in views.list_restores(metastore, FINISHED)),
        *(
            ("list_requests", r, schemas.RequestSummary)
            for r in views.list_requests(metastore, LIVE)
        ),
        ("checkpoint_stats", views.checkpoint_stats(metastore, FINISHED), schemas.PipelineSummary),
        (
            "preview_restore",
            preview_restore(metastore, storage, FINISHED, parallelism=3, deep=False).to_dict(),
            schemas.RestorePlan,
        ),
        (
            "request_status",
            savepoints.request_status(metastore, LIVE, request_id).to_dict(),
            schemas.RequestState,
        ),
    ]
    seen: set[str] = set()
    drift = [d for where, row, model in rows for d in _drift(row, model, where, seen)]
    assert not drift, "the views and the API's shapes drifted apart:\n" + "\n".join(drift)
    # every shape was held to a row, none passed for want of data (the seed's state has no key
    # groups: KeyGroupRange is derived from the core's dataclass, see schemas.from_core)
    assert {
        "Pipeline",
        "CheckpointSummary",
        "CheckpointDetail",
        "TaskAck",
        "RequestRef",
        "ConsumedInput",
        "InputRun",
        "InputFile",
        "InputTable",
        "Restore",
        "RequestSummary",
        "PipelineSummary",
        "Spread",
        "RestorePlan",
        "OperatorPlan",
        "SubtaskPlan",
        "RequestState",
    } <= seen, seen


def test_a_step_jobs_savepoint_requested_through_the_api_is_taken_at_its_next_boundary(
    server: Server, spark, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """The Checkpoints page's "Savepoint" button on a step job (``checkpointed``): the request
    the API queues is taken at the job's next step boundary, and the API follows it to its
    savepoint, whose files equal the step's rows (pandas)."""
    import pyarrow.dataset as ds

    from checkpointing.spark.steps import checkpointed
    from tests.test_step_savepoints import (
        daily_job,
        oracle,
        oracle_enriched,
        published,
        same,
        write_inputs,
    )

    job = "steps_live"
    orders, customers = write_inputs(tmp_path / "in")
    out = tmp_path / "out"
    queued: list[dict[str, Any]] = []

    def press_the_button() -> None:  # once the job runs, as a user on its page would
        r = server.call("POST", f"/api/pipelines/{job}/savepoints", user="admin", body={})
        assert r.status == 202, r.body
        queued.append(r.body)

    with checkpointed(spark, job, metastore=server.metastore, storage=server.storage) as ck:
        daily_job(ck, spark, orders, customers, out, before=press_the_button)
    same(published(out), oracle(orders, customers), ["day", "region"])
    done = server.call(
        "GET", f"/api/pipelines/{job}/requests/{queued[0]['request_id']}", user="viewer"
    ).body
    assert (done["status"], done["succeeded"]) == ("COMPLETED", True)
    assert done["savepoint_path"] == server.storage.savepoint_url(job, done["checkpoint_id"])
    saved = Path(done["savepoint_path"].removeprefix("file://")) / "enriched"
    same(
        ds.dataset(saved, format="parquet").to_table().to_pandas(),
        oracle_enriched(orders, customers),
        ["oid"],
    )
    detail = server.call(
        "GET", f"/api/pipelines/{job}/checkpoints/{done['checkpoint_id']}", user="viewer"
    ).body
    assert detail["type"] == "SAVEPOINT" and [o["operator_id"] for o in detail["operators"]] == [
        "step-enriched"
    ]
