"""The checkpoint REST API (``plugins/checkpointing_airflow/api.py``) in a real Airflow 3
api-server on loopback, loaded from this project's ``plugins/`` like in production, with
Airflow's SimpleAuthManager and three users: ``admin``, the read-only ``viewer`` and
``outsider``, who has no role (no access to any DAG).

The metastore is seeded through the core library (coordinators completing real checkpoints
without Spark); the api-server finds it as the operators do (``CKPT_METASTORE_URL``). One
server for the whole module: it takes most of the module's time.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from checkpointing.airflow_env import airflow_command, airflow_env, migrate
from checkpointing.clock import ManualClock
from checkpointing.coordinator import CheckpointCoordinator
from checkpointing.metastore import Metastore
from checkpointing.properties import JobStatus
from checkpointing.restore import find_latest_valid, preview_restore, record_restore
from checkpointing.storage import FileSystemCheckpointStorage
from tests.helpers import ack_all, complete, new_coordinator, request_rows

SIMPLE_AUTH_MANAGER = (
    "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
)
FINISHED = "routes-finished"  # 7 checkpoints and a savepoint, then FINISHED
LIVE = "routes-live"  # RUNNING: takes savepoints
IDLE = "routes-idle"  # registered, never ran: no checkpoints


@dataclass
class Response:
    status: int
    body: Any
    headers: dict[str, str]


@dataclass
class Server:
    url: str
    tokens: dict[str, str]
    metastore: Metastore
    storage: FileSystemCheckpointStorage
    live: CheckpointCoordinator
    log: Path

    def call(
        self,
        method: str,
        path: str,
        *,
        user: str | None = None,
        token: str | None = None,
        body: Any = None,
        headers: dict[str, str] | None = None,
    ) -> Response:
        """``path`` under the plugin's prefix; ``user`` sends that user's bearer token."""
        sent = {"Accept": "application/json", **(headers or {})}
        if user is not None:
            token = self.tokens[user]
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            sent["Content-Type"] = "application/json"
        request = urllib.request.Request(
            f"{self.url}/checkpoints{path}", data=data, headers=sent, method=method
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return Response(r.status, _json(r.read()), dict(r.headers))
        except urllib.error.HTTPError as e:
            return Response(e.code, _json(e.read()), dict(e.headers))


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _token(url: str, user: str, password: str) -> str:
    request = urllib.request.Request(
        f"{url}/auth/token",
        json.dumps({"username": user, "password": password}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        return str(json.loads(r.read())["access_token"])


def _seed(metastore: Metastore, storage: FileSystemCheckpointStorage) -> CheckpointCoordinator:
    """Three jobs through the core API: FINISHED with a history (completed, subsumed, a
    savepoint, an aborted one) and a restore; RUNNING with one checkpoint; CREATED with none."""
    clock = ManualClock()
    done = new_coordinator(metastore, storage, clock, job_id=FINISHED, retained=2)
    done.activate()
    done.job_status_changed(JobStatus.RUNNING)
    for _ in range(6):
        clock.advance(60)
        complete(done)
    clock.advance(60)
    complete(done, savepoint=True)  # checkpoint 7
    clock.advance(60)
    done.trigger_checkpoint()  # 8: still pending when the job ends, so aborted
    decision = find_latest_valid(metastore, storage, FINISHED)
    plan = preview_restore(metastore, storage, FINISHED, parallelism=3, deep=False).plan
    record_restore(metastore, decision, attempt="try-2", parallelism=3, assignment=plan.to_dict())
    done.job_status_changed(JobStatus.FINISHED)

    live = new_coordinator(metastore, storage, clock, job_id=LIVE)
    live.activate()
    live.job_status_changed(JobStatus.RUNNING)
    complete(live)

    new_coordinator(metastore, storage, clock, job_id=IDLE).activate()
    return live


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("checkpoint-api")
    url_metastore = f"sqlite:///{root / 'metastore.db'}"
    Metastore(url_metastore, check_schema=False).upgrade()
    metastore = Metastore(url_metastore)
    storage = FileSystemCheckpointStorage(f"file://{root / 'checkpoints'}")
    live = _seed(metastore, storage)

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    (root / "dags").mkdir()
    env = airflow_env(root / "airflow", root / "dags", ckpt_home=root / "ckpt")
    passwords = {u: secrets.token_urlsafe(12) for u in ("admin", "viewer", "outsider")}
    (root / "passwords.json").write_text(json.dumps(passwords))
    env.update(
        {
            "CKPT_METASTORE_URL": url_metastore,
            "CKPT_STORAGE_URL": storage.base_url,
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(port),
            "AIRFLOW__API__BASE_URL": url,
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(48),
            "AIRFLOW__CORE__AUTH_MANAGER": SIMPLE_AUTH_MANAGER,
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,viewer:viewer,outsider:",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(root / "passwords.json"),
        }
    )
    migrate(env)
    log = root / "api-server.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [airflow_command(), "api-server"],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"the api-server exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(f"{url}/api/v2/monitor/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the api-server did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        tokens = {user: _token(url, user, password) for user, password in passwords.items()}
        yield Server(url, tokens, metastore, storage, live, log)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        metastore.dispose()


READS = [
    "/api/pipelines",
    f"/api/pipelines/{FINISHED}",
    f"/api/pipelines/{FINISHED}/checkpoints",
    f"/api/pipelines/{FINISHED}/checkpoints/1",
    f"/api/pipelines/{FINISHED}/restores",
    f"/api/pipelines/{FINISHED}/requests",
    f"/api/pipelines/{FINISHED}/requests/1",
    f"/api/pipelines/{FINISHED}/restore-plan?parallelism=2",
    "/openapi.json",
    "/docs",
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
        "/api/pipelines/{pipeline_id}/checkpoints",
        "/api/pipelines/{pipeline_id}/checkpoints/{checkpoint_id}",
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
    for path in READS[1:8]:
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
    _take_requests(server)


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
    aborted = server.call("GET", f"/api/pipelines/{FINISHED}/checkpoints/8", user="viewer").body
    assert aborted["status"] == "ABORTED" and not any(t["acked"] for t in aborted["tasks"])


def test_unknown_ids_are_404_and_malformed_ones_422(server: Server) -> None:
    not_found = [
        "/api/pipelines/nope",
        "/api/pipelines/nope/checkpoints",
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
        "restores": []
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


def _take_requests(server: Server) -> list[int]:
    """The live job's next epoch boundary: it triggers the queued savepoints and acks them."""
    taken = []
    for pending in server.live.process_requests():
        assert ack_all(server.live, pending).completed is not None
        taken.append(pending.checkpoint_id)
    return taken


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

    (savepoint_id,) = _take_requests(server)
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


def test_stop_with_savepoint_ends_the_job(server: Server) -> None:
    r = server.call("POST", f"/api/pipelines/{LIVE}/savepoints", user="admin", body={"stop": True})
    assert r.status == 202 and r.body["checkpoint_type"] == "SAVEPOINT_THEN_STOP", r.body
    _take_requests(server)
    done = server.call(
        "GET", f"/api/pipelines/{LIVE}/requests/{r.body['request_id']}", user="admin"
    )
    assert done.body["succeeded"] is True, done.body
