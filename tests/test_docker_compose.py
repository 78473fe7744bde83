"""docker-compose.yml, checked without a Docker engine (none runs on our machines).

The compose file is parsed, and the test checks that every mount, command, environment variable,
URL, credential and port refers to something that exists in this repository or in the locked
dependencies, and that the files agree with each other and with the code's settings. The image is
built from uv.lock, and its tag names the locked Airflow and Spark versions, which must be the
ones in the lock. A renamed directory, a mistyped variable, a Spark port that no longer matches,
or a lock bump without a new tag makes a test here fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import posixpath
import re
import shlex
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from sqlalchemy.engine import make_url

from checkpointing.config import ENV_HOME, ENV_METASTORE_URL, ENV_STORAGE_URL
from checkpointing.spec import load_spec
from checkpointing.storage import CheckpointStorage, S3CheckpointStorage

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()
LOCK = ROOT / "uv.lock"
IMAGE_TAG = re.compile(
    r"^airflow-spark-checkpointing:airflow-(?P<airflow>[^-]+)-spark-(?P<spark>.+)$"
)
#: the project's image runs Airflow and Spark
PROJECT_IMAGE = {name for name, s in SERVICES.items() if "build" in s}
#: environment variables of third-party images, as their documentation names them
IMAGE_ENV = {
    "postgres": {"POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_DB"},
    "minio/minio": {"MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"},
}


def command(service: str) -> list[str]:
    value = SERVICES[service].get("command") or SERVICES[service].get("entrypoint") or []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def environment(service: str) -> dict[str, str]:
    env = SERVICES[service].get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def mounts(service: str) -> dict[str, str]:
    """Container path → host path (``./…``) or volume name."""
    found = {}
    for entry in SERVICES[service].get("volumes") or []:
        source, target = entry.split(":")[:2]
        found[target] = source
    return found


def listening_ports(service: str) -> set[int]:
    ports = {int(str(p).split(":")[-1]) for p in SERVICES[service].get("ports") or []}
    return ports | {int(p) for p in SERVICES[service].get("expose") or []}


def locked(name: str) -> str:
    packages = {p["name"]: p["version"] for p in tomllib.loads(LOCK.read_text())["package"]}
    assert name in packages, f"{LOCK} does not lock {name}: the image would not have it"
    return packages[name]


def code_text(*folders: str) -> str:
    return "\n".join(
        path.read_text() for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))
    )


def airflow_services() -> set[str]:
    return {name for name in PROJECT_IMAGE if command(name)[:1] == ["airflow"]}


def worker_service() -> str:
    """Where the Spark driver runs: the CeleryExecutor runs tasks on the Celery worker."""
    assert environment("airflow-worker")["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert command("airflow-worker")[:3] == ["airflow", "celery", "worker"]
    return "airflow-worker"


def common_env() -> dict[str, str]:
    """The environment every Airflow service shares (``x-airflow-common``)."""
    return {k: str(v) for k, v in COMPOSE["x-airflow-common"]["environment"].items()}


def healthcheck(service: str) -> list[str]:
    """The service's healthcheck command, ``CMD``/``CMD-SHELL`` first."""
    probe = (SERVICES[service].get("healthcheck") or {}).get("test") or []
    return [str(word) for word in probe]


# ============================================================================ the image


def test_one_image_built_from_the_lock_runs_airflow_and_spark_at_the_locked_versions() -> None:
    assert {"airflow-apiserver", "airflow-scheduler", "spark-master", "spark-worker"} <= (
        PROJECT_IMAGE
    )
    images = {SERVICES[name]["image"] for name in PROJECT_IMAGE}
    assert len(images) == 1, images
    tag = IMAGE_TAG.match(images.pop())
    assert tag, "the image tag names the Airflow and Spark versions it holds"
    assert tag["airflow"] == locked("apache-airflow")
    assert tag["spark"] == locked("pyspark")
    for name in PROJECT_IMAGE:
        assert SERVICES[name]["build"] == {"context": ".", "dockerfile": "docker/Dockerfile"}
    others = {s["image"] for n, s in SERVICES.items() if n not in PROJECT_IMAGE}
    assert not [i for i in others if re.search(r"airflow|spark", i)], others

    # the Dockerfile installs exactly the lock, with the uv and the Python the project uses
    install = re.search(r"^RUN uv sync --frozen --no-dev --no-editable\b(.*)$", DOCKERFILE, re.M)
    assert install, "the image installs the project from the lock"
    # … with the extras its services run: Airflow with the Celery executor, Spark, S3
    words = install[1].split()
    extras = {words[i + 1] for i, w in enumerate(words[:-1]) if w == "--extra"}
    assert "--all-extras" in words or {"airflow", "celery", "s3", "spark"} <= extras, install[0]
    makefile_uv = re.search(r"^UV_VERSION \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert makefile_uv and f"ARG UV_VERSION={makefile_uv[1]}" in DOCKERFILE
    python = re.search(r"^FROM python:3\.(\d+)-", DOCKERFILE, re.M)
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert python and requires == ">=3.11" and int(python[1]) >= 11
    for line in re.findall(r"^COPY (.+) \S+$", DOCKERFILE, re.M):
        for source in line.split():
            assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".git", ".ckpt"} <= set(ignored)


# ============================================================================ mounts and paths


def test_every_mount_exists_and_driver_and_executors_share_the_pipelines_data() -> None:
    declared = set(COMPOSE.get("volumes") or {})
    for name in SERVICES:
        for target, source in mounts(name).items():
            assert target.startswith("/"), (name, target)
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which does not exist"
            else:
                assert source in declared, f"{name} mounts undeclared volume {source}"

    docker_env = dict(re.findall(r"^\s+(\w+)=(\S+?)(?: \\)?$", DOCKERFILE, re.M))
    for name in airflow_services() | {"ckpt-init"}:
        env, where = environment(name), mounts(name)
        assert where[env["AIRFLOW__CORE__DAGS_FOLDER"]] == "./dags"
        assert where[env["AIRFLOW__CORE__PLUGINS_FOLDER"]] == "./plugins"
        assert where[env[ENV_HOME]] == "ckpt-data"
        assert env[ENV_HOME] == docker_env[ENV_HOME]
        assert where[f"{docker_env['AIRFLOW_HOME']}/logs"] == "airflow-logs"
    home = environment(worker_service())[ENV_HOME]
    assert mounts("spark-worker")[home] == "ckpt-data"  # the same path for the executors

    # each spec's local input and sink, as the driver resolves them in the container, are on it
    dags = environment(worker_service())["AIRFLOW__CORE__DAGS_FOLDER"]
    for spec_file in sorted((ROOT / "dags" / "pipelines").glob("*.yaml")):
        spec = load_spec(spec_file, home=Path(home))  # ${CKPT_HOME} as in the container
        for path in (spec.source.path, spec.sink.path):
            if "://" in path:
                continue
            inside = posixpath.normpath(posixpath.join(dags, "pipelines", path))
            assert inside.startswith(home + "/"), f"{spec_file.name}: {path} → {inside}"


# ============================================================================ environment


def test_every_environment_variable_is_one_that_something_reads() -> None:
    ours = code_text("checkpointing", "plugins", "dags")
    glue = code_text("plugins", "dags")
    botocore = Path(importlib.util.find_spec("botocore").origin).parent  # type: ignore[union-attr]
    boto_text = "\n".join(p.read_text() for p in sorted(botocore.glob("*.py")))
    airflow_options = set()
    for name in SERVICES:
        image = SERVICES[name].get("image", "").split(":")[0]
        for var in environment(name):
            if var.startswith("AIRFLOW__"):
                assert name in PROJECT_IMAGE and re.fullmatch(r"AIRFLOW__[A-Z_]+__[A-Z_]+", var)
                airflow_options.add(var)  # each checked against Airflow's configuration below
            elif var.startswith("AIRFLOW_CONN_"):
                conn_id = var.removeprefix("AIRFLOW_CONN_").lower()
                assert f'"{conn_id}"' in glue, f"{name}: no code uses connection {conn_id!r}"
            elif var.startswith("CKPT_"):
                assert var in (ENV_HOME, ENV_METASTORE_URL, ENV_STORAGE_URL), (name, var)
                assert f'"{var}"' in ours
            elif var.startswith("AWS_"):
                assert f"'{var}'" in boto_text, f"{name}: boto3 does not read {var}"
                assert var in ours
            else:
                assert var in IMAGE_ENV.get(image, set()), f"{name}: nothing reads {var}"
    assert airflow_options


def test_the_services_agree_on_hosts_ports_and_credentials() -> None:
    env = environment(worker_service())

    # every URL names a service that listens on that port
    urls = [v for name in SERVICES for v in environment(name).values() if "://" in v]
    urls += [w for name in SERVICES for w in command(name) if re.match(r"\w+://", w)]
    for url in urls:
        if url.startswith("s3://"):
            continue
        parts = urlsplit(re.sub(r"^[\w+.-]+://", "x://", url))  # urlsplit refuses "_" in schemes
        if parts.hostname == "localhost":
            continue
        assert parts.hostname in SERVICES, f"{url}: no service {parts.hostname}"
        assert parts.port in listening_ports(parts.hostname), f"{url}: port not listened on"
    # the ports the commands open are the ones published or exposed; host ports do not clash
    for name in SERVICES:
        words = command(name)
        for flag in ("--port", "--webui-port", "--address", "--console-address"):
            if flag in words:
                port = int(words[words.index(flag) + 1].lstrip(":"))
                assert port in listening_ports(name), f"{name}: {flag} {port} is not published"
    published = [str(p).rsplit(":", 1)[0] for s in SERVICES.values() for p in s.get("ports") or []]
    assert len(published) == len(set(published)), published

    # PostgreSQL: the roles and databases the URLs use are the ones init.sql creates
    init = (ROOT / "docker" / "postgres" / "init.sql").read_text()
    metastore = make_url(env[ENV_METASTORE_URL])
    assert metastore.drivername == "postgresql+psycopg"  # the driver the project locks
    for url in (
        make_url(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]),
        metastore,
        make_url(env["AIRFLOW_CONN_CHECKPOINT_METASTORE"]),
    ):
        assert f"CREATE ROLE {url.username} LOGIN PASSWORD '{url.password}';" in init
        assert f"CREATE DATABASE {url.database} OWNER {url.username};" in init
    conn = make_url(env["AIRFLOW_CONN_CHECKPOINT_METASTORE"])
    assert (conn.host, conn.port, conn.database, conn.username) == (
        metastore.host,
        metastore.port,
        metastore.database,
        metastore.username,
    )

    # S3: the storage is an S3 URL the code accepts, in the bucket minio-init creates, with the
    # credentials MinIO is started with, for the driver and the executors alike
    storage = CheckpointStorage.from_url(env[ENV_STORAGE_URL])
    assert isinstance(storage, S3CheckpointStorage)
    bucket, _ = storage.split(storage.base_url)
    init_s3 = " ".join(command("minio-init"))
    assert f"mc mb --ignore-existing local/{bucket}" in init_s3
    minio = environment("minio")
    for name in (worker_service(), "spark-worker"):
        s3 = environment(name)
        assert s3["AWS_ACCESS_KEY_ID"] == minio["MINIO_ROOT_USER"]
        assert s3["AWS_SECRET_ACCESS_KEY"] == minio["MINIO_ROOT_PASSWORD"]
        assert urlsplit(s3["AWS_ENDPOINT_URL"]).hostname == "minio"
        assert f"{minio['MINIO_ROOT_USER']} {minio['MINIO_ROOT_PASSWORD']}" in init_s3

    # start-up order: every dependency exists; Airflow starts on migrated databases
    for name, service in SERVICES.items():
        for dependency in service.get("depends_on") or []:
            assert dependency in SERVICES, (name, dependency)
    for name in airflow_services() - {"airflow-init"}:
        depends = SERVICES[name]["depends_on"]
        assert depends["airflow-init"]["condition"] == "service_completed_successfully"
        assert depends["ckpt-init"]["condition"] == "service_completed_successfully"


# ============================================================================ commands


def test_every_command_runs_something_that_exists() -> None:
    from typer.testing import CliRunner

    from checkpointing.cli import app

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    pyspark = Path(importlib.util.find_spec("pyspark").origin).parent  # type: ignore[union-attr]
    jars = sorted((pyspark / "jars").glob("spark-core_*.jar"))
    assert jars, "pyspark ships its jars"
    classes = set(zipfile.ZipFile(jars[0]).namelist())
    checked = set()
    for name in SERVICES:
        words = command(name)
        if not words or name not in PROJECT_IMAGE:
            continue
        if words[:2] == ["python", "-c"]:
            compile(words[2], f"{name} command", "exec")
        elif words[0] == "ckpt":
            assert "ckpt" in scripts
            result = CliRunner().invoke(app, [*words[1:], "--help"])
            assert result.exit_code == 0, (name, result.output)
        elif words[0] == "spark-class":
            assert (pyspark / "bin" / "spark-class").exists()
            assert words[1].replace(".", "/") + ".class" in classes, (name, words[1])
        else:
            assert words[0] == "airflow", name  # checked against Airflow's CLI below
        checked.add(words[0])
        assert name != "secrets-init" or words[0] == "python"
        probe = (SERVICES[name].get("healthcheck") or {}).get("test") or []
        if probe[:3] == ["CMD", "python", "-c"]:
            compile(probe[3], f"{name} healthcheck", "exec")
    assert checked == {"ckpt", "spark-class", "airflow", "python"}


_AIRFLOW_CHECK = r"""
import json, os, sys
request = json.loads(sys.stdin.read())
from airflow.cli import cli_parser
from airflow.configuration import retrieve_configuration_description
from airflow.models.connection import Connection
from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from checkpointing_airflow.hooks import connection_url

out = {"bad_commands": [], "unknown_options": []}
parser = cli_parser.get_parser()
for argv in request["commands"]:
    try:
        parser.parse_args(argv)
    except SystemExit:
        out["bad_commands"].append(argv)
options = retrieve_configuration_description()
for section, key in request["options"]:
    described = options.get(section, {}).get("options", {})
    # OPTION_CMD / OPTION_SECRET: the value of a sensitive option from a command or a backend
    base = key[: -len("_cmd")] if key.endswith("_cmd") else key.removesuffix("_secret")
    if key not in described and not (base in described and described[base].get("sensitive")):
        out["unknown_options"].append([section, key])
for conn_id, value in request["connections"].items():
    os.environ["AIRFLOW_CONN_" + conn_id.upper()] = value
uri = request["connections"]["checkpoint_metastore"]
out["metastore_url"] = connection_url(Connection(conn_id="checkpoint_metastore", uri=uri))
spark = SparkSubmitHook(conn_id="spark_default")._resolve_connection()
out["spark"] = {"master": spark["master"], "deploy_mode": spark["deploy_mode"]}
# the Celery app the worker's healthcheck pings, configured from the compose settings
out["celery"] = {}
for path in request["celery_apps"]:
    module, _, name = path.rpartition(".")
    app = getattr(__import__(module, fromlist=[name]), name)
    out["celery"][path] = [app.conf.broker_url, app.conf.result_backend]
print("@@RESULT@@" + json.dumps(out))
"""


@pytest.mark.skipif(
    importlib.util.find_spec("airflow") is None, reason="Apache Airflow is not installed"
)
def test_airflow_accepts_the_commands_settings_and_connections(tmp_path: Path) -> None:
    env = environment(worker_service())
    probes = [healthcheck(name) for name in sorted(SERVICES)]
    shell = [" ".join(p[1:]) for p in probes if p[:1] == ["CMD-SHELL"]]
    request = {
        "commands": [command(name)[1:] for name in sorted(airflow_services())]
        + [probe[2:] for probe in probes if probe[:2] == ["CMD", "airflow"]],
        "celery_apps": sorted({app for s in shell for app in re.findall(r"--app[= ](\S+)", s)}),
        "options": sorted(
            {
                tuple(var.removeprefix("AIRFLOW__").lower().split("__", 1))
                for name in PROJECT_IMAGE
                for var in environment(name)
                if var.startswith("AIRFLOW__")
            }
        ),
        "connections": {
            var.removeprefix("AIRFLOW_CONN_").lower(): value
            for var, value in env.items()
            if var.startswith("AIRFLOW_CONN_")
        },
    }
    isolated = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")},
        "AIRFLOW_HOME": str(tmp_path),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{tmp_path / 'airflow.db'}",
        # the executor decides which commands exist (`airflow celery …`); Celery's settings
        **{k: v for k, v in env.items() if k.startswith(("AIRFLOW__CORE__EXEC", "AIRFLOW__CEL"))},
    }
    result = _python_check(_AIRFLOW_CHECK, isolated, stdin=json.dumps(request), timeout=600)
    assert len(request["commands"]) >= 7 and result["bad_commands"] == []
    assert ["celery", "worker"] in request["commands"]
    assert ["jobs", "check", "--job-type", "SchedulerJob", "--local"] in request["commands"]
    assert (
        result["celery"]
        == {
            app: [env["AIRFLOW__CELERY__BROKER_URL"], env["AIRFLOW__CELERY__RESULT_BACKEND"]]
            for app in request["celery_apps"]
        }
        and request["celery_apps"]
    ), result["celery"]
    assert result["unknown_options"] == []
    # the hook reaches the same metastore as `ckpt`, the operator the compose Spark master
    assert result["metastore_url"] == env[ENV_METASTORE_URL]
    assert result["spark"] == {"master": "spark://spark-master:7077", "deploy_mode": "client"}


# ============================================================================ a local-only sandbox


def test_the_sandbox_is_published_on_loopback_only_and_labelled_local_only() -> None:
    """Every visitor is an admin and the passwords are well known: nothing may be reachable
    from another machine (docker publishes a port without an address on every interface)."""
    text = (ROOT / "docker-compose.yml").read_text()
    assert "LOCAL-ONLY SANDBOX" in text.split("\n", 1)[0]
    published = {name: s.get("ports") or [] for name, s in SERVICES.items()}
    assert any(published.values())
    for name, ports in published.items():
        for port in ports:
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"
            assert str(port).count(":") == 2, (name, port)
    cluster = (ROOT / "docs" / "cluster.md").read_text()
    assert "local-only sandbox" in cluster and "127.0.0.1" in cluster


def test_the_jwt_secret_is_generated_on_first_start_not_written_in_the_file() -> None:
    """A fixed JWT secret in a public file lets anyone sign Airflow tokens: it is generated at
    random once, into a volume that the Airflow components read it from."""
    for name in SERVICES:
        env = environment(name)
        assert "AIRFLOW__API_AUTH__JWT_SECRET" not in env, f"{name}: a fixed JWT secret"
    init = SERVICES["secrets-init"]
    script = command("secrets-init")[2]
    assert "secrets.token_urlsafe(" in script and "os.O_EXCL" in script  # once, at random
    (target,) = [t for t, source in mounts("secrets-init").items() if source == "compose-secrets"]
    assert re.search(rf'path = "{re.escape(target)}/(\w+)"', script)
    secret_file = re.search(rf'path = "({re.escape(target)}/\w+)"', script)[1]  # type: ignore[index]
    assert init["user"] == "0:0" and "os.chown(path, 50000, 0)" in script
    assert "0o400" in script
    assert "compose-secrets" in COMPOSE["volumes"]
    for name in airflow_services() | {"ckpt-init"}:
        env = environment(name)
        assert env["AIRFLOW__API_AUTH__JWT_SECRET_CMD"] == f"cat {secret_file}", name
        assert mounts(name)[target] == "compose-secrets", name
        assert SERVICES[name]["depends_on"]["secrets-init"] == {
            "condition": "service_completed_successfully"
        }, name
    # the image's Airflow user is the uid the file is given to
    assert "useradd --uid 50000" in DOCKERFILE


# ============================================================================ start-up and health


def test_long_running_services_run_under_init_report_health_and_wait_for_it() -> None:
    """An init process reaps the orphans of killed tasks (spark-submit, drivers) and forwards
    SIGTERM; a service whose dependants need it answering has a healthcheck they wait on."""
    one_shot = {"secrets-init", "airflow-init", "ckpt-init", "minio-init"}
    for name in PROJECT_IMAGE - one_shot:
        assert SERVICES[name].get("init") is True, f"{name}: no init process"
    assert healthcheck("airflow-apiserver")[:3] == ["CMD", "python", "-c"]
    assert "/api/v2/monitor/health" in healthcheck("airflow-apiserver")[3]
    assert healthcheck("airflow-scheduler") == [
        *["CMD", "airflow", "jobs", "check", "--job-type", "SchedulerJob", "--local"]
    ]
    ping = " ".join(healthcheck("airflow-worker"))
    assert healthcheck("airflow-worker")[0] == "CMD-SHELL"
    # $$: compose's escape of a $ the shell expands, in the container
    assert re.search(r"celery --app \S+ inspect ping -d \"celery@\$\$\{HOSTNAME\}\"", ping), ping
    assert healthcheck("redis") == ["CMD", "redis-cli", "ping"]
    # tasks and callbacks go through the api-server's execution API; tasks through the broker
    for name in (
        "airflow-scheduler",
        "airflow-dag-processor",
        "airflow-triggerer",
        worker_service(),
    ):
        depends = SERVICES[name]["depends_on"]
        assert depends["airflow-apiserver"] == {"condition": "service_healthy"}, name
        assert depends["redis"] == {"condition": "service_healthy"}, name
        assert depends["postgres"] == {"condition": "service_healthy"}, name
    for name, service in SERVICES.items():
        depends = service.get("depends_on") or {}
        for dependency, how in depends.items() if isinstance(depends, dict) else []:
            if how["condition"] == "service_healthy":
                assert healthcheck(dependency), f"{name} waits on {dependency}'s missing health"


_ENGINES_CHECK = r"""
import asyncio, json
from sqlalchemy import text
from airflow import settings
from airflow.providers.celery.executors.celery_executor import app


async def select_one():
    async with settings.AsyncSession() as session:
        return (await session.execute(text("SELECT 1"))).scalar_one()


session = app.backend.ResultSession()  # Celery's result backend: its tables, in Airflow's db
try:
    backend = session.execute(text("SELECT current_database()")).scalar_one()
finally:
    session.close()
out = {
    "sync": [settings.engine.url.drivername, settings.engine.url.database],
    "async": [settings.async_engine.url.drivername, settings.async_engine.url.database],
    "async_select": asyncio.run(select_one()),
    "result_backend_database": backend,
}
print("@@RESULT@@" + json.dumps(out))
"""


@pytest.mark.postgres
@pytest.mark.skipif(
    importlib.util.find_spec("airflow") is None, reason="Apache Airflow is not installed"
)
def test_airflow_migrates_and_runs_on_postgresql_with_the_compose_database_settings(
    tmp_path: Path,
) -> None:
    """Airflow's sync and async engines and Celery's result backend, exactly as compose sets
    them (drivers, user, password), on the local PostgreSQL: only the host (``postgres`` →
    127.0.0.1) and the database (a fresh one, ``airflow`` → unique) differ. Without the async
    URL Airflow derives ``postgresql+asyncpg://`` and ``airflow db migrate`` fails."""
    from tests.airflow_harness import AIRFLOW, fresh_pg_database

    env = common_env()
    keys = (
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC",
        "AIRFLOW__CELERY__RESULT_BACKEND",
    )
    urls = {k: make_url(env[k].removeprefix("db+")) for k in keys}
    sync = urls[keys[0]]
    assert {(u.host, u.port, u.username, u.password, u.database) for u in urls.values()} == {
        (sync.host, sync.port, sync.username, sync.password, sync.database)
    }, "one database for Airflow and Celery's results"
    assert sync.host == "postgres"
    with fresh_pg_database("compose_airflow", owner=sync.username, password=sync.password) as db:

        def local(value: str) -> str:
            moved = make_url(value.removeprefix("db+")).set(host="127.0.0.1", database=db.database)
            prefix = "db+" if value.startswith("db+") else ""
            return prefix + moved.render_as_string(hide_password=False)

        run_env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")},
            "AIRFLOW_HOME": str(tmp_path / "airflow"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": env["AIRFLOW__CORE__EXECUTOR"],
            **{k: local(env[k]) for k in keys},
        }
        for argv in (["db", "migrate"], ["db", "check"]):
            done = subprocess.run(
                [AIRFLOW, *argv], env=run_env, capture_output=True, text=True, timeout=600
            )
            assert done.returncode == 0, (argv, (done.stderr or done.stdout)[-4000:])
        result = _python_check(_ENGINES_CHECK, run_env, timeout=300)
    assert result == {
        "sync": [urls[keys[0]].drivername, db.database],
        "async": [urls[keys[1]].drivername, db.database],
        "async_select": 1,
        "result_backend_database": db.database,
    }
    assert result["async"][0] == "postgresql+psycopg_async"  # a driver the lock installs


def _python_check(
    script: str, env: dict[str, str], *, stdin: str | None = None, timeout: float
) -> Any:
    """Run ``script`` in a fresh interpreter with ``env``; what it printed after ``@@RESULT@@``
    (JSON), after asserting that it succeeded."""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        input=stdin,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("@@RESULT@@", 1)[1].splitlines()[0])
