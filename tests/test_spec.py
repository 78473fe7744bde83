"""The pipeline spec: valid files load; every mistake names the file and the field."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from checkpointing.pipeline.spec import Aggregation, SpecError, load_spec

VALID = """
job: routes
source:
  format: parquet
  path: data/*.parquet
  splits_per_epoch: 4
key: [origin, dest]
aggregations:
  flights: count()
  with_delay: count(dep_delay)
  distance: sum(distance)
  min_delay: min(dep_delay)
  max_delay: max(dep_delay)
  avg_delay: avg(arr_delay)
sink:
  path: out/routes
parallelism: 4
max_parallelism: 64
checkpoint:
  every_epochs: 1
  timeout: 5m
  retained: 3
  retention: retain_on_cancellation
storage: s3://bucket/checkpoints
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    return path


def test_a_valid_spec_loads(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, VALID))
    assert spec.job == "routes"
    assert spec.key == ["origin", "dest"]
    assert spec.aggregations["flights"] == Aggregation(function="count", column=None)
    assert str(spec.aggregations["avg_delay"]) == "avg(arr_delay)"
    assert spec.checkpoint.every_epochs == 1
    config = spec.checkpoint.config()
    assert (config.timeout, config.retained) == (timedelta(minutes=5), 3)
    assert spec.resolve(spec.source.path) == str(tmp_path / "data" / "*.parquet")
    assert spec.resolve("s3://b/x") == "s3://b/x"


def test_a_single_key_column_may_be_a_string(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, VALID.replace("key: [origin, dest]", "key: origin")))
    assert spec.key == ["origin"]


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            "parallelism: 4",
            "paralelism: 4",
            "paralelism: unknown field (did you mean 'parallelism'?)",
        ),
        (
            "  splits_per_epoch: 4",
            "  split_per_epoch: 4",
            "source.split_per_epoch: unknown field (did you mean 'splits_per_epoch'?)",
        ),
        (
            "  retained: 3",
            "  retaind: 3",
            "checkpoint.retaind: unknown field (did you mean 'retained'?)",
        ),
        (
            "  retained: 3",
            "  retained: 0",
            "checkpoint.retained: Input should be greater than or equal to 1 (got 0)",
        ),
        ("  timeout: 5m", "  timeout: 0s", "checkpoint.timeout: must be greater than 0"),
        ("retain_on_cancellation", "keep_forever", "checkpoint.retention: Input should be"),
        (
            "  format: parquet\n  path",
            "  format: avro\n  path",
            "source.format: Input should be 'parquet', 'csv' or 'json'",
        ),
        (
            "sum(distance)",
            "total(distance)",
            "aggregations: distance: 'total(distance)' is not an aggregation",
        ),
        ("sum(distance)", "sum()", "aggregations: distance: sum() needs a column"),
        (
            "sum(distance)",
            "max_by(distance)",
            "aggregations: distance: max_by(distance): max_by needs two columns, "
            "max_by(value, order) (the value of the row with the maximum order)",
        ),
        (
            "sum(distance)",
            "min_by(distance, dep_delay, x)",
            "distance: min_by(distance, dep_delay, x): min_by needs two columns",
        ),
        ("sum(distance)", "stddev(a, b)", "distance: stddev(a, b): stddev takes one column, not 2"),
        ("sum(distance)", "count(a, b)", "distance: count(a, b): count takes one column, not 2"),
        ("sum(distance)", "max_by(a, )", "distance: max_by(a, ): '' is not a column name"),
        ("sum(distance)", "count_distinct(a.b)", "'a.b' is not a column name"),
        ("sum(distance)", "median(distance)", "is not an aggregation: use count(), count(col)"),
        ("parallelism: 4", "parallelism: 100", "parallelism 100 exceeds max_parallelism 64"),
        ("job: routes", "job: ../routes", "invalid job '../routes'"),
        ("key: [origin, dest]", "key: []", "key: needs at least one key column"),
        ("  flights: count()", "  origin: count()", "clash with key columns: ['origin']"),
    ],
)
def test_mistakes_name_the_file_and_the_field(
    tmp_path: Path, old: str, new: str, expected: str
) -> None:
    assert old in VALID
    path = write(tmp_path, VALID.replace(old, new, 1))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert str(path) in str(err.value)
    assert expected in str(err.value)


def test_missing_required_sections(tmp_path: Path) -> None:
    path = write(tmp_path, "job: x\n")
    with pytest.raises(SpecError) as err:
        load_spec(path)
    for field in ("source: Field required", "sink: Field required"):
        assert f"{path}: {field}" in str(err.value)
    assert "key" not in str(err.value)  # without a key the job is stateless


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no such pipeline spec"):
        load_spec(tmp_path / "nope.yaml")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(write(tmp_path, "job: [unclosed"))
    with pytest.raises(SpecError, match="a pipeline spec is a mapping"):
        load_spec(write(tmp_path, "- a\n- b\n"))
    # YAML tags that would construct Python objects are refused, never executed
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(write(tmp_path, "job: !!python/object/apply:os.system ['true']\n"))


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        # a key given twice is refused, naming the key and both lines (not silently the last)
        (
            "  with_delay: count(dep_delay)",
            "  flights: count(dep_delay)",
            "line 10, column 3: not valid YAML: duplicate key 'flights' (first given on line 9)",
        ),
        ("job: routes", "job: routes\njob: other", "duplicate key 'job' (first given on line 2)"),
        # strict integers: YAML's true is not the parallelism 1
        ("parallelism: 4", "parallelism: true", "parallelism: Input should be a valid integer"),
        ("max_parallelism: 64", "max_parallelism: 64.0", "max_parallelism: Input should be a"),
        ("  every_epochs: 1", "  every_epochs: true", "checkpoint.every_epochs: Input should be"),
        # a string is not the switch for incremental checkpoints (YAML's yes/no are booleans)
        ("  every_epochs: 1", "  every_epochs: 1\n  incremental: 'no'", "checkpoint.incremental: "),
        ("  splits_per_epoch: 4", "  splits_per_epoch: '4'", "source.splits_per_epoch: Input"),
        # epoch_bytes: a positive size, and not beside splits_per_epoch (one rule for epochs)
        (
            "  splits_per_epoch: 4",
            "  epoch_bytes: 0",
            "source.epoch_bytes: Input should be greater",
        ),
        (
            "  splits_per_epoch: 4",
            "  epoch_bytes: -5",
            "source.epoch_bytes: expected a positive size",
        ),
        ("  splits_per_epoch: 4", "  epoch_bytes: -1MiB", "source.epoch_bytes: could not parse"),
        ("  splits_per_epoch: 4", "  epoch_bytes: lots", "source.epoch_bytes: could not parse"),
        ("  splits_per_epoch: 4", "  epoch_bytes: true", "source.epoch_bytes: expected a positive"),
        (
            "  splits_per_epoch: 4",
            "  splits_per_epoch: 4\n  epoch_bytes: 64MiB",
            "source.splits_per_epoch and source.epoch_bytes: give one",
        ),
        ("parallelism: 4", "parallelism: 4\nretries: yes", "retries: Input should be a valid"),
        ("parallelism: 4", "parallelism: 4\nretry_delay: -5s", "retry_delay: must not be negative"),
        # durations that overflow or are infinite: the field and the value, no OverflowError
        ("  timeout: 5m", "  timeout: 9999999999d", "checkpoint.timeout: duration '9999999999d'"),
        (
            "  timeout: 5m",
            "  timeout: 5m\n  interval: 100000000000000000000",
            "checkpoint.interval: duration 100000000000000000000 is out of range",
        ),
        ("parallelism: 4", "parallelism: 4\nretry_delay: .inf", "retry_delay: duration inf is out"),
    ],
)
def test_bad_values_are_refused_naming_the_field(
    tmp_path: Path, old: str, new: str, expected: str
) -> None:
    assert old in VALID
    path = write(tmp_path, VALID.replace(old, new, 1))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert str(err.value).startswith(f"{path}: ")
    assert expected in str(err.value)
    assert len(str(err.value).splitlines()) == 1


def test_epochs_are_planned_by_bytes_when_the_source_says_so(tmp_path: Path) -> None:
    default = load_spec(write(tmp_path, VALID)).source
    assert (default.splits_per_epoch, default.epoch_bytes) == (4, None)
    sized = VALID.replace("  splits_per_epoch: 4", "  epoch_bytes: 256MiB", 1)
    source = load_spec(write(tmp_path, sized)).source
    assert (source.splits_per_epoch, source.epoch_bytes) == (1, 256 << 20)


def test_incremental_checkpoints_are_the_default_and_can_be_switched_off(tmp_path: Path) -> None:
    assert load_spec(write(tmp_path, VALID)).checkpoint.incremental is True
    off = VALID.replace("  every_epochs: 1", "  every_epochs: 1\n  incremental: false", 1)
    assert load_spec(write(tmp_path, off)).checkpoint.incremental is False


def test_a_check_across_fields_names_them_without_dumping_the_spec(tmp_path: Path) -> None:
    path = write(tmp_path, VALID.replace("parallelism: 4", "parallelism: 100", 1))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert str(err.value) == f"{path}: parallelism 100 exceeds max_parallelism 64"


def test_a_directory_or_a_binary_file_is_not_a_spec(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="is a directory, not a pipeline spec"):
        load_spec(tmp_path)
    binary = tmp_path / "spec.yaml"
    binary.write_bytes(b"job: \xff\xfe\x00routes\n")
    with pytest.raises(SpecError, match=r"spec.yaml: not UTF-8 text"):
        load_spec(binary)


def test_yaml_merge_keys_may_still_be_overridden(tmp_path: Path) -> None:
    """``<<: *base`` then a key of the merged mapping is an override, not a duplicate."""
    text = VALID.replace("sink:\n  path: out/routes", "sink:\n  <<: {path: x}\n  path: out/routes")
    assert load_spec(write(tmp_path, text)).sink.path == "out/routes"


def test_paths_may_refer_to_the_home_of_the_metastore_and_checkpoints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("CKPT_HOME", str(home))
    text = (
        VALID.replace("path: data/*.parquet", "path: ${CKPT_HOME}/data/flights-*.parquet")
        .replace("path: out/routes", "path: ${CKPT_HOME}/out/routes")
        .replace("storage: s3://bucket/checkpoints", "storage: file://${CKPT_HOME}/elsewhere")
    )
    spec = load_spec(write(tmp_path, text))
    assert spec.resolve(spec.source.path) == f"{home}/data/flights-*.parquet"
    assert spec.resolve(spec.sink.path) == f"{home}/out/routes"
    assert spec.storage == f"file://{home}/elsewhere"
    # a caller that knows another home (e.g. a container's) says so; a relative CKPT_HOME is
    # the working directory's, as for the metastore
    assert (
        load_spec(write(tmp_path, text), home=Path("/opt/ckpt")).sink.path == "/opt/ckpt/out/routes"
    )
    monkeypatch.setenv("CKPT_HOME", "rel")
    monkeypatch.chdir(tmp_path)
    assert load_spec(write(tmp_path, text)).sink.path == f"{tmp_path.resolve()}/rel/out/routes"


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ("path: data/*.parquet", "path: ${HOME}/data/*.parquet", "source.path"),
        ("path: out/routes", "path: ${AWS_SECRET_ACCESS_KEY}/out", "sink.path"),
        ("storage: s3://bucket/checkpoints", "storage: s3://${BUCKET}/c", "storage"),
        ("path: out/routes", "path: ${}/out", "sink.path"),
    ],
)
def test_an_unknown_variable_is_refused_naming_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: str, new: str, field: str
) -> None:
    """Only ``${CKPT_HOME}``: the environment's other variables (secrets among them) never
    reach a path, a log or an error message."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    with pytest.raises(SpecError, match=rf"pipeline\.yaml: {field}: unknown variable") as info:
        load_spec(write(tmp_path, VALID.replace(old, new)))
    assert "${CKPT_HOME}" in str(info.value) and "s3cr3t" not in str(info.value)


def test_a_dollar_without_braces_is_a_plain_character(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, VALID.replace("path: out/routes", "path: out/$routes")))
    assert spec.sink.path == "out/$routes"


@pytest.mark.parametrize(
    ("text", "function", "column", "order", "shown"),
    [
        ("count_distinct(tailnum)", "count_distinct", "tailnum", None, "count_distinct(tailnum)"),
        (" approx_count_distinct( dest ) ", "approx_count_distinct", "dest", None, None),
        (
            "max_by(carrier,dep_delay)",
            "max_by",
            "carrier",
            "dep_delay",
            "max_by(carrier, dep_delay)",
        ),
        ("min_by( carrier , arr_delay )", "min_by", "carrier", "arr_delay", None),
        ("stddev(dep_delay)", "stddev", "dep_delay", None, None),
        ("variance(dep_delay)", "variance", "dep_delay", None, None),
        ("count()", "count", None, None, "count()"),
    ],
)
def test_aggregation_forms(
    text: str, function: str, column: str | None, order: str | None, shown: str | None
) -> None:
    agg = Aggregation.parse(text)
    assert (agg.function, agg.column, agg.order) == (function, column, order)
    assert str(agg) == (shown or text.strip().replace(" ", "").replace(",", ", "))
    assert Aggregation.parse(str(agg)) == agg


def test_new_aggregations_load_from_a_spec(tmp_path: Path) -> None:
    text = VALID.replace(
        "  avg_delay: avg(arr_delay)\n",
        "  avg_delay: avg(arr_delay)\n  planes: count_distinct(tailnum)\n"
        "  worst: max_by(carrier, dep_delay)\n  sd: stddev(dep_delay)\n",
    )
    spec = load_spec(write(tmp_path, text))
    assert spec.aggregations["worst"] == Aggregation(
        function="max_by", column="carrier", order="dep_delay"
    )
    assert str(spec.aggregations["planes"]) == "count_distinct(tailnum)"
    assert spec.aggregations["worst"].columns == ["carrier", "dep_delay"]
