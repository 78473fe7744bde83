"""Checkpoint configuration (Flink's ``CheckpointConfig``) and where the metastore and storage live.

Durations are written with a unit (``500ms``, ``30s``, ``5m``, ``1h``, ``2d``, ISO 8601 ``PT30S``)
or given as ``timedelta``; a bare integer is milliseconds, as in Flink's configuration.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from checkpointing.errors import ConfigError

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

#: Flink's ``MINIMAL_CHECKPOINT_TIME``: a periodic interval below this disables periodic triggers.
MINIMAL_CHECKPOINT_TIME = timedelta(milliseconds=10)
#: Flink caps the min pause at one year to avoid overflows.
MAX_MIN_PAUSE = timedelta(days=365)
#: The longest duration accepted anywhere: far beyond any real timeout, and small enough that
#: "now + duration" never overflows a datetime.
MAX_DURATION = timedelta(days=36_500)

_UNITS = {
    "ms": 0.001,
    "milli": 0.001,
    "millis": 0.001,
    "millisecond": 0.001,
    "milliseconds": 0.001,
    "s": 1,
    "sec": 1,
    "secs": 1,
    "second": 1,
    "seconds": 1,
    "m": 60,
    "min": 60,
    "mins": 60,
    "minute": 60,
    "minutes": 60,
    "h": 3600,
    "hour": 3600,
    "hours": 3600,
    "d": 86400,
    "day": 86400,
    "days": 86400,
}
_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*$")


def parse_duration(value: Any) -> timedelta:
    """Parse ``30s``/``5 min``/``PT30S``/int milliseconds into a timedelta.

    A duration that is infinite or longer than :data:`MAX_DURATION` (either sign) is a
    :class:`ValueError` naming the value, never an ``OverflowError``."""
    try:
        parsed = _parse_duration(value)
    except OverflowError:
        parsed = None
    if parsed is None or abs(parsed) > MAX_DURATION:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ValueError(f"duration {shown} is out of range (at most {MAX_DURATION.days:,} days)")
    return parsed


def _parse_duration(value: Any) -> timedelta | None:
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as '30s', got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, int | float):
        return timedelta(milliseconds=value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match and match.group(2).lower() in _UNITS:
            return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2).lower()])
        if value.strip().upper().startswith(("P", "-P")):
            import pendulum

            try:
                parsed = pendulum.parse(value.strip())
            except (ValueError, OverflowError):
                parsed = None
            if isinstance(parsed, timedelta):
                return parsed
        if value.strip().lstrip("-").isdigit():
            return timedelta(milliseconds=int(value))
    raise ValueError(f"expected a duration such as '500ms', '30s', '5m' or 'PT1H', got {value!r}")


Duration = Annotated[timedelta, BeforeValidator(parse_duration)]


def format_duration(value: timedelta | None) -> str:
    if value is None:
        return "off"
    total_ms = round(value.total_seconds() * 1000)
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if total_ms and total_ms % size == 0:
            return f"{total_ms // size}{unit}"
    return f"{total_ms}ms"


class RetentionPolicy(StrEnum):
    """What happens to completed checkpoints when the job terminates (externalized checkpoints)."""

    NEVER_RETAIN = "never_retain"
    RETAIN_ON_FAILURE = "retain_on_failure"
    RETAIN_ON_CANCELLATION = "retain_on_cancellation"


class SavepointRetention(BaseModel):
    """How long completed savepoints are kept, applied by ``ckpt gc``: the ``count`` newest,
    and none completed longer than ``max_age`` ago (either condition expires one). The savepoint
    a restore would pick is always kept."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    count: int | None = Field(default=None, ge=0, strict=True)
    max_age: Duration | None = None

    @field_validator("max_age")
    @classmethod
    def _age_not_negative(cls, v: timedelta | None) -> timedelta | None:
        if v is not None and v < timedelta(0):
            raise ValueError("must not be negative")
        return v


class CheckpointConfig(BaseModel):
    """A job's checkpoint settings, validated.

    :param interval: periodic trigger interval; ``None`` (or below 10 ms) disables periodic
        checkpoints, manual checkpoints and savepoints still work.
    :param timeout: a pending checkpoint older than this is aborted as expired.
    :param min_pause: minimum time from the last *completion* to the next periodic trigger;
        manual checkpoints and savepoints are triggered at once (Flink's
        ``CheckpointRequestDecider``).
    :param max_concurrent: cap on pending checkpoints; further non-forced requests are queued.
    :param tolerable_failures: consecutive checkpoint failures tolerated before the job fails.
    :param retained: how many completed checkpoints are kept; older ones are subsumed.
    :param retention: what to keep when the job terminates.
    :param prefer_checkpoint_for_recovery: on restore, prefer the latest checkpoint over a newer
        savepoint.
    :param savepoint_retention: expire completed savepoints by a count and/or an age when
        ``ckpt gc`` runs (``None``: savepoints are kept until discarded).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    interval: Duration | None = None
    timeout: Duration = timedelta(minutes=10)
    min_pause: Duration = timedelta(0)
    max_concurrent: int = Field(default=1, ge=1, strict=True)
    tolerable_failures: int = Field(default=0, ge=0, strict=True)
    retained: int = Field(default=1, ge=1, strict=True)
    retention: RetentionPolicy = RetentionPolicy.RETAIN_ON_FAILURE
    prefer_checkpoint_for_recovery: bool = False
    savepoint_retention: SavepointRetention | None = None

    @field_validator("interval")
    @classmethod
    def _interval_not_negative(cls, v: timedelta | None) -> timedelta | None:
        if v is not None and v < timedelta(0):
            raise ValueError("must not be negative (leave it out to disable periodic checkpoints)")
        return v

    @field_validator("timeout")
    @classmethod
    def _timeout_positive(cls, v: timedelta) -> timedelta:
        if v <= timedelta(0):
            raise ValueError("must be greater than 0")
        return v

    @field_validator("min_pause")
    @classmethod
    def _min_pause(cls, v: timedelta) -> timedelta:
        if v < timedelta(0):
            raise ValueError("must not be negative")
        return min(v, MAX_MIN_PAUSE)

    @classmethod
    def parse(
        cls, data: dict[str, Any] | None = None, *, source: str = "checkpoint"
    ) -> CheckpointConfig:
        """Validate ``data``; errors become one :class:`ConfigError` naming field and value."""
        try:
            return cls.model_validate(data or {})
        except ValidationError as exc:
            raise ConfigError(describe_validation_error(exc, source)) from None

    @property
    def periodic_interval(self) -> timedelta | None:
        """The effective periodic interval, as Flink derives it.

        Below ``MINIMAL_CHECKPOINT_TIME`` periodic checkpointing is off; an interval smaller than
        the min pause is raised to it (scheduling more often could never trigger).
        """
        if self.interval is None or self.interval < MINIMAL_CHECKPOINT_TIME:
            return None
        return max(self.interval, self.min_pause)


def describe_validation_error(exc: ValidationError, source: str, prefix: str = "") -> str:
    """One line per problem: ``source: field.path: message (got value)``."""
    lines = []
    for err in exc.errors():
        loc = prefix + ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        # a URL's password (a catalog's, a metastore's) is never shown
        got = re.sub(r"(://[^/\s:@'\"]*:)[^@\s]*@", r"\1***@", repr(err.get("input")))
        if len(got) > 60:
            got = got[:57] + "..."
        # a check across fields (no location) names its fields itself: no dump of the whole input
        shown = "" if err["type"] == "missing" or not err["loc"] else f" (got {got})"
        lines.append(f"{source}: {loc}: {msg}{shown}" if loc else f"{source}: {msg}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Where things live: flags, then environment, then project-local defaults.

ENV_METASTORE_URL = "CKPT_METASTORE_URL"
ENV_STORAGE_URL = "CKPT_STORAGE_URL"
#: comma-separated storage URLs, besides the default storage, that a job row's ``storage_url``
#: (or a savepoint request's target) may lie in: see :mod:`checkpointing.state.storage_roots`
ENV_STORAGE_ROOTS = "CKPT_STORAGE_ROOTS"
ENV_HOME = "CKPT_HOME"


def ckpt_home() -> Path:
    """``CKPT_HOME`` (default ``./.ckpt``), absolute: where the embedded defaults live, and what
    ``${CKPT_HOME}`` in a pipeline spec's paths stands for."""
    return Path(os.environ.get(ENV_HOME) or ".ckpt").expanduser().resolve()


@dataclass(frozen=True)
class Settings:
    """Resolved locations of the metastore and checkpoint storage."""

    #: may hold a password: show :attr:`display_metastore_url` instead (not in the repr either)
    metastore_url: str = field(repr=False)
    storage_url: str
    home: Path
    #: the metastore is the embedded default (SQLite under ``home``), not a URL the user gave:
    #: ``ckpt run`` may then create its schema
    embedded_metastore: bool = False

    @property
    def display_metastore_url(self) -> str:
        """The metastore URL without credentials, for messages and logs."""
        return safe_url(normalize_url(self.metastore_url))

    @staticmethod
    def embedded_metastore_url(home: Path | None = None) -> str:
        """The embedded default: SQLite under ``CKPT_HOME``."""
        return f"sqlite:///{(home or ckpt_home()) / 'metastore.db'}"

    @classmethod
    def resolve(cls, metastore_url: str | None = None, storage_url: str | None = None) -> Settings:
        """Flags win over ``CKPT_METASTORE_URL``/``CKPT_STORAGE_URL``, which win over defaults.

        Defaults live under ``CKPT_HOME`` (default ``./.ckpt``): ``metastore.db`` (SQLite) and
        ``checkpoints/`` (local storage).
        """
        home = ckpt_home()
        metastore = metastore_url or os.environ.get(ENV_METASTORE_URL)
        storage = storage_url or os.environ.get(ENV_STORAGE_URL)
        return cls(
            metastore_url=metastore or cls.embedded_metastore_url(home),
            storage_url=storage or (home / "checkpoints").as_uri(),
            home=home,
            embedded_metastore=metastore is None,
        )


def configured_storage_roots() -> list[str]:
    """The storage URLs a job's checkpoint storage may lie in, as configured: the default
    storage (``CKPT_STORAGE_URL``, else ``CKPT_HOME/checkpoints``), then each entry of
    ``CKPT_STORAGE_ROOTS``. A row's ``storage_url`` is anyone's to write: these are not."""
    roots = [Settings.resolve().storage_url]
    roots += [r.strip() for r in os.environ.get(ENV_STORAGE_ROOTS, "").split(",") if r.strip()]
    return roots


# The metastore URL: parsed and shown here, so that no message or log quotes a password.

#: query parameters that may carry a credential (libpq's ``password``, ``sslpassword``, …)
_SECRET_PARAM = re.compile(r"pass|secret|token|key|auth", re.IGNORECASE)


def safe_url(url: URL) -> str:
    """``url`` for messages and logs: the password and any credential-like query parameter
    masked. Never quote a metastore URL any other way."""
    query = {k: ("***" if _SECRET_PARAM.search(k) else v) for k, v in url.query.items()}
    return url.set(query=query).render_as_string(hide_password=True).replace("%2A%2A%2A", "***")


def normalize_url(url: str | URL) -> URL:
    """Parse ``url``; plain ``postgresql://`` means psycopg 3, the driver this project ships.

    A URL that cannot be parsed is never quoted back (it may hold a password): the message says
    what is wrong and shows the scheme only."""
    from sqlalchemy import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # ValueError: e.g. a port that is not a number
        raise ConfigError(
            f"the metastore URL ({_scheme(url)}) is not a valid SQLAlchemy URL: expected "
            "dialect://user:password@host:port/database, with special characters in the user "
            "and password percent-encoded (the URL is not shown: it may contain a password)"
        ) from None
    if "@" in (parsed.host or ""):  # user:p@ss@host parses as password "p", host "ss@host"
        raise ConfigError(
            f"the metastore URL ({_scheme(url)}) has an '@' in its password: percent-encode it "
            "as %40 (the URL is not shown: it contains a password)"
        )
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise ConfigError(
            f"metastore URL {safe_url(parsed)!r}: only sqlite:// and postgresql:// are supported"
        )
    return parsed


def _scheme(url: str | URL) -> str:
    """What precedes ``://``, when it looks like a scheme: safe to show."""
    scheme = str(url).split("://", 1)[0] if "://" in str(url) else ""
    return f"{scheme}://…" if re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]{0,40}", scheme) else "…"
