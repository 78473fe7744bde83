"""Checkpoint configuration: validation errors name the field and the value; durations."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from checkpointing.clock import ManualClock
from checkpointing.config import CheckpointConfig, RetentionPolicy
from checkpointing.errors import ConfigError
from checkpointing.metastore.engine import Metastore
from checkpointing.metastore.jobs import config_of
from checkpointing.state.storage import FileSystemCheckpointStorage
from tests.helpers import job_row, new_coordinator


@pytest.mark.parametrize(
    ("data", "field", "shown"),
    [
        ({"interval": "-5s"}, "interval", "'-5s'"),
        ({"interval": -1}, "interval", "-1"),
        ({"retained": 0}, "retained", "0"),
        ({"retained": -3}, "retained", "-3"),
        ({"retention": "forever"}, "retention", "'forever'"),
        ({"timeout": "0s"}, "timeout", "'0s'"),
        ({"timeout": 0}, "timeout", "0"),
        ({"timeout": "-1m"}, "timeout", "'-1m'"),
        ({"min_pause": "-1s"}, "min_pause", "'-1s'"),
        ({"max_concurrent": 0}, "max_concurrent", "0"),
        ({"tolerable_failures": -1}, "tolerable_failures", "-1"),
        ({"interval": "soon"}, "interval", "'soon'"),
        ({"intervall": "1s"}, "intervall", "'1s'"),
    ],
)
def test_invalid_values_name_the_field_and_the_value(
    data: dict[str, Any], field: str, shown: str
) -> None:
    with pytest.raises(ConfigError) as exc:
        CheckpointConfig.parse(data, source="jobs/etl.yaml")
    message = str(exc.value)
    assert message.startswith(f"jobs/etl.yaml: {field}: ")
    assert f"(got {shown})" in message


def test_every_problem_is_reported() -> None:
    with pytest.raises(ConfigError) as exc:
        CheckpointConfig.parse({"interval": "-5s", "retained": 0, "timeout": "0s"})
    lines = str(exc.value).splitlines()
    assert [line.split(":")[1].strip() for line in lines] == ["interval", "timeout", "retained"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("30s", timedelta(seconds=30)),
        ("500ms", timedelta(milliseconds=500)),
        ("PT1M", timedelta(minutes=1)),
        ("PT30S", timedelta(seconds=30)),
        ("5 min", timedelta(minutes=5)),
        ("2h", timedelta(hours=2)),
        ("1d", timedelta(days=1)),
        (1500, timedelta(milliseconds=1500)),
        ("1500", timedelta(milliseconds=1500)),
        (timedelta(seconds=7), timedelta(seconds=7)),
    ],
)
def test_durations(value: Any, expected: timedelta) -> None:
    config = CheckpointConfig.parse({"interval": value, "timeout": value, "min_pause": value})
    assert config.interval == expected
    assert config.timeout == expected
    assert config.min_pause == expected


def test_defaults_follow_flink() -> None:
    config = CheckpointConfig.parse({})
    assert config.interval is None and config.periodic_interval is None
    assert config.timeout == timedelta(minutes=10)
    assert config.min_pause == timedelta(0)
    assert (config.max_concurrent, config.tolerable_failures, config.retained) == (1, 0, 1)
    assert config.prefer_checkpoint_for_recovery is False
    assert CheckpointConfig.parse({"retention": "never_retain"}).retention is (
        RetentionPolicy.NEVER_RETAIN
    )


def test_config_is_stored_with_the_job_in_milliseconds(
    metastore: Metastore, storage: FileSystemCheckpointStorage, clock: ManualClock
) -> None:
    settings: dict[str, Any] = {
        "interval": 1500,
        "timeout": "PT2M",
        "min_pause": "500ms",
        "max_concurrent": 3,
        "tolerable_failures": 2,
        "retained": 4,
        "retention": "retain_on_cancellation",
        "prefer_checkpoint_for_recovery": True,
    }
    coord = new_coordinator(metastore, storage, clock, **settings)
    job = job_row(metastore)
    assert (job.interval_ms, job.timeout_ms, job.min_pause_ms) == (1500, 120_000, 500)
    assert (job.max_concurrent, job.tolerable_failures, job.retained) == (3, 2, 4)
    assert job.retention == "retain_on_cancellation"
    assert config_of(job) == coord.config == CheckpointConfig.parse(settings)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"timeout": "9999999999d"}, "timeout"),
        ({"interval": 100000000000000000000}, "interval"),
        ({"interval": "100000000000000000000"}, "interval"),
        ({"timeout": float("inf")}, "timeout"),
        ({"min_pause": float("-inf")}, "min_pause"),
        ({"timeout": float("nan")}, "timeout"),
        ({"timeout": "PT99999999999H"}, "timeout"),
        ({"timeout": "36501d"}, "timeout"),  # fits a timedelta, but now + it may not
    ],
)
def test_overflowing_or_infinite_durations_are_refused_like_any_bad_value(
    data: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError) as exc:
        CheckpointConfig.parse(data, source="jobs/etl.yaml")
    message = str(exc.value)
    assert message.startswith(f"jobs/etl.yaml: {field}: duration ")
    assert "out of range" in message and len(message.splitlines()) == 1


@pytest.mark.parametrize("field", ["retained", "max_concurrent", "tolerable_failures"])
def test_counts_are_strict_integers(field: str) -> None:
    """YAML's ``true`` is not the count 1, nor is ``2.0`` or ``"2"`` a count."""
    for value in (True, 2.0, "2"):
        with pytest.raises(ConfigError, match=f"{field}: Input should be a valid integer"):
            CheckpointConfig.parse({field: value})


def test_settings_never_show_the_metastore_password() -> None:
    from checkpointing.config import Settings

    settings = Settings.resolve("postgresql://ckpt:s3cret@db.internal/ckpt?password=s3cret")
    assert "s3cret" not in repr(settings)
    assert settings.display_metastore_url == (
        "postgresql+psycopg://ckpt:***@db.internal/ckpt?password=***"
    )
    assert not settings.embedded_metastore and Settings.resolve().embedded_metastore
