"""Shared fixtures: every metastore test runs against SQLite *and* PostgreSQL; S3 tests talk to a
real HTTP S3 endpoint (moto's server, started here on loopback)."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from checkpointing.clock import ManualClock
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.models import Base
from checkpointing.state.storage import FileSystemCheckpointStorage
from tests.helpers import free_port

# py4j says "Closing down clientserver connection" (INFO) from a finalizer at interpreter exit,
# when pytest has closed the stream logging writes to: a "--- Logging error ---" traceback after
# the summary, which reads as a failure
logging.getLogger("py4j").setLevel(logging.WARNING)

#: set by ``make test``: what the suite needs must be there, so a missing one fails the run
#: (as a missing PostgreSQL does) instead of quietly skipping the tests that need it
REQUIRE_ALL_ENV = "CKPT_TEST_REQUIRE_ALL"


def missing_requirements() -> list[str]:
    """What the whole suite needs and this machine lacks: Apache Airflow, Playwright's Python
    package, and Chromium for the browser test (``CKPT_TEST_CHROMIUM``)."""
    import importlib.util

    missing = []
    if importlib.util.find_spec("airflow") is None:
        missing.append("Apache Airflow (uv sync)")
    if importlib.util.find_spec("playwright") is None:
        missing.append("Playwright's Python package (uv sync)")
    chromium = Path(os.environ.get("CKPT_TEST_CHROMIUM", "/usr/bin/chromium"))
    if not chromium.exists():
        missing.append(f"Chromium at {chromium} (apt-get install chromium as root)")
    return missing


def pytest_sessionstart(session: pytest.Session) -> None:
    """Under ``make test`` (:data:`REQUIRE_ALL_ENV`), refuse to start without what the suite
    needs, naming it; a plain ``pytest`` still skips the tests that need what is missing."""
    if os.environ.get(REQUIRE_ALL_ENV) != "1":
        return
    missing = missing_requirements()
    if missing:
        raise pytest.UsageError(
            f"make test needs {', '.join(missing)}; without it tests would be skipped"
        )


#: skips ``make test`` accepts, each reviewed: node id -> why. Any other skip fails the run
#: under :data:`REQUIRE_ALL_ENV` (a scenario whose dependency is missing must not pass by
#: skipping); empty: the suite runs everything
ALLOWED_SKIPS: dict[str, str] = {}
_unexpected_skips: list[str] = []


def _note_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if os.environ.get(REQUIRE_ALL_ENV) != "1" or not report.skipped:
        return
    if report.nodeid not in ALLOWED_SKIPS:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        _unexpected_skips.append(f"{report.nodeid or '(collection)'}: {reason}")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _note_skip(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _note_skip(report)  # a module-level importorskip skips its whole file here


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under ``make test``, a skip not in :data:`ALLOWED_SKIPS` fails the run, named."""
    if _unexpected_skips:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        lines = "\n".join(f"  {s}" for s in _unexpected_skips)
        print(f"\nmake test: {len(_unexpected_skips)} unexpected skip(s) fail the run:\n{lines}")


#: the test files that take longest (real Airflow and Spark scenarios), longest first: they are
#: collected first, so that with ``make test TEST_WORKERS=N`` (pytest-xdist, a file at a time, in
#: collection order with ``--no-loadscope-reorder``) they start at once and the processes end
#: together
LONGEST_FIRST = (
    # the failover scenario first: the LocalExecutor backfill scenario (deferrable) timed out
    # twice when the two ran at once (an unexplained interference); after it, it passes
    "test_airflow_failover.py",
    "test_airflow_celery.py",
    "test_airflow_deferrable.py",
    "test_source_retention.py",
    "test_airflow_savepoints.py",
    "test_airflow_steps.py",
    "test_delta_sink.py",
    "test_spark_cluster.py",
    "test_demo.py",
    "test_cli_run.py",
    "test_iceberg_sink.py",
    "test_provider_package.py",
    "test_checkpoints_ui.py",
    "test_cli.py",
    "test_s3_parquet_sink.py",
    "test_savepoints.py",
    "test_s3_source.py",
    "test_gcs_storage.py",
    "test_delta_azure.py",
    "test_spark_runtime_failures.py",
    "test_azure_storage.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable otherwise


def pytest_configure(config: pytest.Config) -> None:
    """Airflow reads its home and database at first import: never the user's ``~/airflow``."""
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="ckpt-tests-airflow-"))
    os.environ["AIRFLOW_HOME"] = str(home)
    os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{home / 'airflow.db'}"
    os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
    if not hasattr(config, "workerinput"):  # pytest-xdist's workers inherit the environment
        _spark_driver_options(config.rootpath / ".pytest_cache" / "ckpt-spark-cds")


def _spark_driver_options(cache: Path) -> None:
    """Every Spark driver JVM the tests start (in this process, ``ckpt run``, ``spark-submit``
    from Airflow, the demo) starts C1-only from a class-data-sharing archive of Spark's classes,
    made once per JDK and pyspark and kept in ``cache`` (:mod:`tests.spark_jvm`), through
    ``SPARK_SUBMIT_OPTS``, which they all inherit."""
    from tests.spark_jvm import driver_java_options, ensure_archive

    try:  # CKPT_TEST_SPARK_CDS=0: without the archive (to compare; C1 only still)
        archive = None if os.environ.get("CKPT_TEST_SPARK_CDS") == "0" else ensure_archive(cache)
    except Exception as exc:  # e.g. no pyspark: those tests fail on their own, with their error
        print(f"note: no class-data-sharing archive for the tests' Spark drivers: {exc}")
        archive = None
    options = [os.environ.get("SPARK_SUBMIT_OPTS", ""), driver_java_options(archive)]
    os.environ["SPARK_SUBMIT_OPTS"] = " ".join(o for o in options if o)


PG_URL = os.environ.get("CKPT_TEST_PG_URL", "postgresql+psycopg://127.0.0.1:5432/test")


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this test session, migrated to head, dropped after."""
    admin_url = make_url(PG_URL)
    name = f"ckpt_test_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # pragma: no cover - environment problem, say what to do
        pytest.fail(
            f"PostgreSQL at {admin_url.render_as_string(hide_password=True)} is needed by the "
            f"metastore tests (set CKPT_TEST_PG_URL, or start it): {exc}"
        )
    url = admin_url.set(database=name).render_as_string(hide_password=False)
    Metastore(url, check_schema=False).upgrade()
    yield url
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


def _truncate(store: Metastore) -> None:
    tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
    with store.engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))


@pytest.fixture(params=["sqlite", "postgresql"])
def metastore_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """The URL of an empty, migrated metastore, once per backend."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'metastore.db'}"
        Metastore(url, check_schema=False).upgrade()
        yield url
    else:
        url = request.getfixturevalue("pg_url")
        store = Metastore(url)
        _truncate(store)
        store.dispose()
        yield url


@pytest.fixture
def metastore(metastore_url: str) -> Iterator[Metastore]:
    store = Metastore(metastore_url)
    yield store
    store.dispose()


@pytest.fixture
def sqlite_metastore(tmp_path: Path) -> Iterator[Metastore]:
    """A migrated SQLite metastore only: for tests of logic above the metastore, not of its
    backends."""
    url = f"sqlite:///{tmp_path / 'metastore.db'}"
    Metastore(url, check_schema=False).upgrade()
    store = Metastore(url)
    yield store
    store.dispose()


@pytest.fixture
def storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FileSystemCheckpointStorage:
    """The test's checkpoint storage, configured as a storage root as a deployment's is
    (``CKPT_STORAGE_ROOTS``): a coordinator given no storage takes the job row's only then."""
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'checkpoints'}")
    monkeypatch.setenv("CKPT_STORAGE_ROOTS", storage.base_url)
    return storage


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server in its own process on loopback: a real HTTP endpoint, not a mock."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    else:  # pragma: no cover
        proc.kill()
        pytest.fail("moto server did not start")
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def s3_env(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """boto3's standard chain pointed at the loopback endpoint via AWS_ENDPOINT_URL."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return s3_endpoint


@pytest.fixture
def executors_see_s3(spark: object, s3_env: str) -> Iterator[None]:
    """The session-wide Spark fixture started before this test pointed AWS_* at moto: hand
    them to its Python workers as ``spark_session`` does when it builds a session with them
    (``spark.executorEnv.*``, which becomes the context's worker environment)."""
    from checkpointing.spark.executor_env import FORWARDED

    environment = spark.sparkContext.environment  # type: ignore[attr-defined]
    saved = dict(environment)
    environment.update({k: os.environ[k] for k in FORWARDED if os.environ.get(k)})
    yield
    environment.clear()
    environment.update(saved)


@pytest.fixture
def s3_bucket(s3_env: str) -> str:
    import boto3

    name = f"ckpt-{uuid.uuid4().hex[:10]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """A real local Spark session (the installed pyspark, with its own jars), configured as the
    runtime configures its own."""
    from checkpointing.spark.session import spark_session
    from tests.spark_jvm import C1_ONLY

    # short JVM lives: C1-only JIT halves the driver's CPU on this 2-core machine (with room
    # for the generated code of every test this process runs)
    session = spark_session("ckpt-tests", conf={"spark.driver.extraJavaOptions": C1_ONLY})
    session.conf.set("spark.sql.shuffle.partitions", "4")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def runtime_events(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runtime tests' input (``tests/spark_pipeline.py``), written once for the session:
    tests that change input copy it first."""
    from tests.spark_pipeline import write_events

    return write_events(tmp_path_factory.mktemp("runtime-events"))


@pytest.fixture(scope="session")
def runtime_reference(
    spark: object, runtime_events: Path, tmp_path_factory: pytest.TempPathFactory
):  # type: ignore[no-untyped-def]
    """One crash-free run over :func:`runtime_events`, checked against pandas, for the session:
    what every crashed, restored or rescaled run of that input must equal."""
    from tests.spark_pipeline import reference_run

    workdir = tmp_path_factory.mktemp("runtime-reference")
    url = f"sqlite:///{workdir / 'metastore.db'}"
    Metastore(url, check_schema=False).upgrade()
    return reference_run(spark, runtime_events, workdir, url)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """A headless Chromium (Debian's: :mod:`tests.browser`) for a browser test module."""
    from playwright.sync_api import sync_playwright

    from tests.browser import CHROMIUM

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            yield chromium
        finally:
            chromium.close()
