"""``ckpt validate SPEC…`` (issue 40): every check ``ckpt run`` makes before Spark starts, for a
CI step, without Spark and without writing anything. Exit 0 when all specs are valid, 1 when any
is not (one line per problem naming the spec file and the field), 2 for a usage error; ``--json``
for scripts. What it says about a spec is what ``ckpt run`` says (one shared check); no test here
starts Spark (its start is patched to fail, as in tests/test_cli_run_refused.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from checkpointing.cli import app
from checkpointing.errors import CheckpointingError
from checkpointing.metastore.engine import Metastore
from checkpointing.state.storage import FileSystemCheckpointStorage
from tests.test_cli import make_history, run_ckpt

SPEC = """
job: JOB
source: {format: parquet, path: "SOURCE"}
key: user
aggregations: {n: count()}
sink: {path: "SINK"}
parallelism: 2
max_parallelism: 8
"""

TEMPLATE = """
job: daily
scope: interval
source: {format: parquet, path: "in/date=${DS}/*.parquet"}
key: [user]
aggregations: {n: count()}
sink: {path: "out/date=${DS}"}
"""


class SparkWouldStart(CheckpointingError):
    pass


@pytest.fixture(autouse=True)
def no_spark(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reaching the Spark session's start is ``ckpt run``'s "the input was accepted"."""

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise SparkWouldStart("spark would start here")

    monkeypatch.setattr("checkpointing.spark.session.spark_session", refuse)


def write_spec(
    tmp_path: Path,
    name: str = "pipeline.yaml",
    *,
    job: str = "etl",
    source: str = "data/*.parquet",
    sink: str = "out",
    extra: str = "",
) -> Path:
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "part-0.parquet").write_bytes(b"")  # only globbed before Spark
    path = tmp_path / name
    text = SPEC.replace("JOB", job).replace("SOURCE", source).replace("SINK", sink)
    path.write_text(text + extra)
    return path


def tree(*roots: Path) -> dict[str, str]:
    """Every file under ``roots`` with a hash of its bytes, and every directory."""
    found: dict[str, str] = {}
    for root in roots:
        if not root.exists():
            continue
        for p in sorted(root.rglob("*")):
            found[str(p)] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return found


def _foreign_sink(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "report.csv").write_text("not the sink's\n")
    return {"sink": "theirs"}


#: a bad spec: what it is built from, the field its one line names, and whether the spec
#: itself loads (its job known) before the run's checks refuse it
BAD = [
    pytest.param({"extra": "retries: two\n"}, "retries: ", False, id="field-type"),
    pytest.param(
        {"extra": "paralelism: 4\n"}, "paralelism: unknown field", False, id="unknown-field"
    ),
    pytest.param({"source": "nothing/*.parquet"}, "source.path: ", True, id="glob-matches-nothing"),
    pytest.param(
        {"extra": "transform: no_such_module_ckpt:clean\n"}, "transform: ", False, id="entry-point"
    ),
    pytest.param(_foreign_sink, "sink.path: ", True, id="sink-not-ours"),
    pytest.param({"sink": "data"}, "sink.path: ", False, id="sink-is-the-input"),
]


def _bad_spec(tmp_path: Path, how: Any, name: str = "bad.yaml") -> Path:
    kwargs = how(tmp_path) if callable(how) else how
    return write_spec(tmp_path, name, job="bad", **kwargs)


@pytest.mark.parametrize(("how", "field", "loads"), BAD)
def test_a_bad_spec_is_one_line_naming_the_file_and_field_as_run_says_it(
    tmp_path: Path, how: Any, field: str, loads: bool
) -> None:
    spec = _bad_spec(tmp_path, how)
    runner = CliRunner(env={"CKPT_HOME": str(tmp_path / "home"), "CKPT_METASTORE_URL": None})
    checked = runner.invoke(app, ["validate", str(spec)])
    assert checked.exit_code == 1, checked.output
    assert checked.stdout == ""
    (line,) = checked.stderr.splitlines()
    assert line.startswith(f"error: {spec}: {field}"), line
    assert "Traceback" not in checked.output

    ran = runner.invoke(app, ["run", str(spec)])
    assert ran.exit_code == 1 and "spark would start here" not in ran.output
    assert ran.stderr.splitlines() == [line]  # the same check, the same words

    as_json = runner.invoke(app, ["validate", str(spec), "--json"])
    assert as_json.exit_code == 1
    assert json.loads(as_json.stdout) == {
        "valid": False,
        "specs": [
            {
                "spec": str(spec),
                "valid": False,
                "job": "bad" if loads else None,
                "problems": [line.removeprefix("error: ")],
                "template": False,
            }
        ],
    }
    assert not (tmp_path / "home").exists()


def test_valid_and_invalid_specs_together_exit_1_with_a_line_per_problem(tmp_path: Path) -> None:
    """As a CI step runs it: a real process, stderr a pipe."""
    good = write_spec(tmp_path, "good.yaml")
    template = tmp_path / "daily.yaml"
    template.write_text(TEMPLATE)
    glob = _bad_spec(tmp_path, {"source": "nothing/*.parquet"}, "glob.yaml")
    types = _bad_spec(tmp_path, {"extra": "retries: -1\nretry_delay: soon\n"}, "types.yaml")
    env = {"CKPT_HOME": str(tmp_path / "home")}

    done = run_ckpt("validate", str(good), str(glob), str(template), str(types), env=env)
    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines() == [
        f"valid: {good} (job etl)",
        f"valid: {template} (job daily, a scope: interval template: give --interval-start and "
        "--interval-end to check its input, sink and restore)",
    ]
    problems = done.stderr.splitlines()
    assert problems == [
        f"error: {glob}: source.path: '{tmp_path}/nothing/*.parquet' matches no files",
        f"error: {types}: retries: Input should be greater than or equal to 0 (got -1)",
        f"error: {types}: retry_delay: expected a duration such as '500ms', '30s', '5m' or "
        "'PT1H', got 'soon' (got 'soon')",
    ]

    ok = run_ckpt("validate", str(good), str(template), env=env)
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    assert not (tmp_path / "home").exists()


def test_an_interval_spec_is_checked_bound_to_its_interval(tmp_path: Path) -> None:
    template = tmp_path / "daily.yaml"
    template.write_text(TEMPLATE)
    env = {"CKPT_HOME": str(tmp_path / "home"), "CKPT_METASTORE_URL": None}
    args = ["validate", str(template), "--interval-start", "2026-11-25", "--interval-end"]
    missing = CliRunner(env=env).invoke(app, [*args, "2026-11-26"])
    assert missing.exit_code == 1
    assert f"{template}: source.path: " in missing.stderr and "date=2026-11-25" in missing.stderr
    (tmp_path / "in" / "date=2026-11-25").mkdir(parents=True)
    (tmp_path / "in" / "date=2026-11-25" / "a.parquet").write_bytes(b"")
    bound = CliRunner(env=env).invoke(app, [*args, "2026-11-26"])
    assert bound.exit_code == 0, bound.output
    assert f"valid: {template} (job daily.20261125T000000)" in bound.stdout


@pytest.mark.parametrize(
    "args",
    [[], ["--restore"], ["{spec}", "--parallelism", "0"], ["{spec}", "--bogus"]],
    ids=["no-spec", "no-value", "out-of-range", "unknown-option"],
)
def test_a_usage_error_exits_2(tmp_path: Path, args: list[str]) -> None:
    spec = write_spec(tmp_path)
    result = CliRunner().invoke(app, ["validate", *(a.format(spec=spec) for a in args)])
    assert result.exit_code == 2, result.output
    assert len(result.stderr.splitlines()) == 1, result.stderr


def test_validate_writes_nothing_and_checks_the_restore_source(tmp_path: Path) -> None:
    """Against a metastore with history: the restore source is checked (read only), and every
    file under the folder (the metastore's, the checkpoint storage, the input, the sink's
    parent) is byte for byte as before."""
    url = f"sqlite:///{tmp_path / 'metastore.db'}"
    created = Metastore(url, check_schema=False)
    created.upgrade()
    created.dispose()
    store = Metastore(url)
    storage = FileSystemCheckpointStorage(f"file://{tmp_path / 'ckpt'}")
    make_history(store, storage)  # job etl, checkpoints 1 (subsumed), 2, 3 (aborted)
    store.dispose()
    spec = write_spec(tmp_path)
    base = ["--metastore-url", url, "--storage-url", storage.base_url, "validate", str(spec)]
    before = tree(tmp_path)

    for restore in ("latest", "2"):
        ok = CliRunner().invoke(app, [*base, "--restore", restore, "--json"])
        assert ok.exit_code == 0, ok.output
        assert json.loads(ok.stdout)["valid"] is True
    refused = CliRunner().invoke(app, [*base, "--restore", "99"])
    assert refused.exit_code == 1
    assert refused.stderr.strip() == f"error: {spec}: --restore '99': job etl has no checkpoint 99"
    rescale = CliRunner().invoke(app, [*base, "--parallelism", "9"])
    assert rescale.exit_code == 1
    assert f"--parallelism 9 exceeds max_parallelism 8 of {spec}" in rescale.stderr

    assert tree(tmp_path) == before
    assert not (tmp_path / "out").exists()


def _hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_metastore_url_without_schema_is_refused_like_run_and_not_created(
    tmp_path: Path,
) -> None:
    db = tmp_path / "fresh.db"
    spec = write_spec(tmp_path)
    result = CliRunner(env={"CKPT_METASTORE_URL": None}).invoke(
        app, ["--metastore-url", f"sqlite:///{db}", "validate", str(spec)]
    )
    assert result.exit_code == 3, result.output
    assert "run `ckpt db upgrade`" in result.stderr
    assert not db.exists()
