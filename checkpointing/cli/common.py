"""What every ``ckpt`` command shares: the consoles, the settings given as flags, error handling
and the option types used by many commands.

Nothing heavy is imported here: ``--help`` and the ``--json`` reads must start fast (scripts
poll them), so Rich's console is made on first use and each command imports what it needs."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from enum import Enum
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from checkpointing.errors import CheckpointingError, SchemaOutdated

if TYPE_CHECKING:
    from rich.console import Console

    from checkpointing.config import Settings
    from checkpointing.metastore.engine import Metastore

#: the distribution ``ckpt --version`` reports
DISTRIBUTION = "airflow-spark-checkpointing"
#: the environment variables of the root options (as :mod:`checkpointing.config` reads them)
ENV_METASTORE_URL, ENV_STORAGE_URL = "CKPT_METASTORE_URL", "CKPT_STORAGE_URL"

EXIT_ERROR, EXIT_USAGE, EXIT_SCHEMA = 1, 2, 3
#: the largest ``--limit`` (a SQL LIMIT must fit a 32-bit integer everywhere)
MAX_LIMIT = 2**31 - 1
#: every ``--limit``'s default: enough rows for a screen, bounded for a job with a long history
DEFAULT_LIMIT = 50

F = TypeVar("F", bound=Callable[..., Any])


class _LazyConsole:
    """A Rich console made on first use, so that ``--json`` output never imports Rich's."""

    def __init__(self, factory: Callable[[], Console]) -> None:
        self._factory = factory
        self._console: Console | None = None

    def get(self) -> Console:
        if self._console is None:
            self._console = self._factory()
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)


def real_console(console: Console) -> Console:
    """The console behind :data:`out` or :data:`err` (made now), for Rich objects that use it
    as a context manager (a Progress, a Live, a status)."""
    return console.get() if isinstance(console, _LazyConsole) else console


def _out() -> Console:
    # markup off: ids, paths and stored messages are printed as typed (``[/x]`` is text, not a
    # tag); styles are given as Text objects
    from rich.console import Console

    console = Console(markup=False)
    if not console.is_terminal:  # logs and CI: wide enough for the tables, never wrapped mid-word
        console = Console(width=160, markup=False)
    return console


def _err() -> Console:
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True, highlight=False, markup=False)


out: Console = _LazyConsole(_out)  # type: ignore[assignment]
err: Console = _LazyConsole(_err)  # type: ignore[assignment]


@contextmanager
def waiting(console: Console, *, quiet: bool = False) -> Iterator[Callable[[str], None]]:
    """Say what is being awaited: a spinner with the seconds waited on a terminal, a line
    whenever it changes otherwise (logs, CI), nothing when ``quiet`` (``--json``). Yields the
    function that says it."""
    import time

    from rich.text import Text

    console = real_console(console)
    if quiet:
        yield lambda _what: None
    elif console.is_terminal:
        start = time.monotonic()
        with console.status(Text("")) as status:
            yield lambda what: status.update(
                Text(f"{what} {time.monotonic() - start:.0f} s", overflow="ellipsis", no_wrap=True)
            )
    else:
        said: list[str] = []

        def say(what: str) -> None:
            if not said or said[-1] != what:
                said.append(what)
                console.print(what, soft_wrap=True)

        yield say


def choices(values: Iterable[Any], *param_decls: str, help: str, **kwargs: Any) -> Any:
    """A ``typer.Option`` that takes one of ``values`` (an Enum's members or strings), listed in
    the help as users see them in the output (``COMPLETED``), accepted in any case and with ``-``
    for ``_`` (``completed``, ``savepoint-then-stop``); anything else is a usage error (exit 2)
    naming the option and the valid values."""
    allowed = {str(v.value if isinstance(v, Enum) else v): v for v in values}

    def canonical(text: str) -> str:
        return text.strip().casefold().replace("-", "_")

    def parse(text: Any) -> Any:
        if not isinstance(text, str):  # the default, or a value already converted
            return text
        for shown, value in allowed.items():
            if canonical(shown) == canonical(text):
                return value
        raise typer.BadParameter(f"{text!r} is not one of {', '.join(allowed)}")

    return typer.Option(
        *param_decls,
        parser=parse,
        metavar=param_decls[0].lstrip("-").upper() if param_decls else "NAME",
        help=f"{help} One of: {', '.join(allowed)}.",
        autocompletion=lambda incomplete: [
            # in the case typed (`co` → `completed`): the shell keeps only what starts with it
            v.lower() if incomplete.islower() else v
            for v in allowed
            if canonical(v).startswith(canonical(incomplete))
        ],
        **kwargs,
    )


def complete_job(ctx: typer.Context, incomplete: str) -> list[str]:
    """Shell completion of a job id: the metastore's jobs (the URL as given on the line or in
    the environment); nothing when it cannot be read (a completion never prints an error)."""
    try:
        from checkpointing.config import Settings
        from checkpointing.metastore.engine import Metastore
        from checkpointing.metastore.views import list_jobs

        url = state.metastore_url or ctx.find_root().params.get("metastore_url")
        store = Metastore(Settings.resolve(url, None).metastore_url, create=False)
        try:
            jobs = [str(row["job_id"]) for row in list_jobs(store)]
        finally:
            store.dispose()
    except Exception:  # a completion says nothing rather than a traceback
        return []
    return [job for job in jobs if job.startswith(incomplete)]


#: arguments and options many commands take, with the same help everywhere
JobArg = Annotated[str, typer.Argument(metavar="JOB", help="Job id.", autocompletion=complete_job)]
AsJson = Annotated[
    bool,
    typer.Option(
        "--json", help="JSON on stdout instead of text (an error: JSON on stderr, docs/cli.md)."
    ),
]
Limit = Annotated[
    int,
    typer.Option(min=0, max=MAX_LIMIT, metavar="N", help="At most N rows (0: all)."),
]


def limit_or_all(limit: int) -> int | None:
    """A ``--limit`` as the read functions take it: None for 0 (all)."""
    return limit or None


class State:
    """The root options (``--metastore-url``, ``--storage-url``) every command reads, and
    whether the command runs with ``--json`` (its errors are then JSON too)."""

    metastore_url: str | None = None
    storage_url: str | None = None
    as_json: bool = False

    @property
    def settings(self) -> Settings:
        from checkpointing.config import Settings

        return Settings.resolve(self.metastore_url, self.storage_url)

    def metastore(self, *, check_schema: bool = True, create: bool | None = None) -> Metastore:
        from checkpointing.metastore.engine import Metastore

        return Metastore(self.settings.metastore_url, check_schema=check_schema, create=create)


state = State()


#: the settings every entry point takes as flags or from the environment (``ckpt`` and
#: ``python -m demo``); an unset option falls back to the embedded default under ``CKPT_HOME``
MetastoreUrlOption = Annotated[
    str | None,
    typer.Option(
        metavar="URL",
        envvar=ENV_METASTORE_URL,
        show_envvar=True,
        help="SQLAlchemy URL of the metastore.",
    ),
]
StorageUrlOption = Annotated[
    str | None,
    typer.Option(
        metavar="URL",
        envvar=ENV_STORAGE_URL,
        show_envvar=True,
        help="Checkpoint storage: file:///…, s3://…, gs://… or abfss://…",
    ),
]
VerboseOption = Annotated[bool, typer.Option("--verbose", "-v", help="Log what happens.")]


def package_version() -> str:
    """This distribution's version; from a checkout without install metadata, the version in
    its ``pyproject.toml``, marked as such."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        import tomllib

        found = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["version"]
    except (OSError, KeyError, ValueError):
        return "unknown (not installed)"
    return f"{found} (checkout {pyproject.parent}, not installed)"


def _show_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"ckpt {package_version()}\n")
        raise typer.Exit()


VersionOption = Annotated[
    bool,
    typer.Option(
        "--version", callback=_show_version, is_eager=True, help="Show the version and exit."
    ),
]


def main_options(
    metastore_url: MetastoreUrlOption = None,
    storage_url: StorageUrlOption = None,
    verbose: VerboseOption = False,
    version: VersionOption = False,
) -> None:
    state.metastore_url = metastore_url
    state.storage_url = storage_url
    state.as_json = False
    configure_logging(verbose)


def configure_logging(verbose: bool) -> None:
    level = logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level)  # again: ``-v`` after the command comes second
    for noisy in ("alembic", "botocore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def handles_errors(fn: F) -> F:
    """Known errors become one line on stderr and a non-zero exit code, never a traceback
    (with ``--json``: that line is a JSON object, :func:`print_error`)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        state.as_json = bool(kwargs.get("as_json"))
        try:
            return fn(*args, **kwargs)
        except SchemaOutdated as exc:
            print_error(exc, code=EXIT_SCHEMA)
            raise typer.Exit(EXIT_SCHEMA) from None
        except CheckpointingError as exc:
            print_error(exc)
            raise typer.Exit(EXIT_ERROR) from None
        except OSError as exc:  # a file the user named: unreadable, a directory, the disk full
            print_error(exc)
            raise typer.Exit(EXIT_ERROR) from None

    return wrapper  # type: ignore[return-value]


def print_error(message: object, *, code: int = EXIT_ERROR) -> None:
    """One line on stderr: ``error: …``, or under ``--json`` ``{"error": "…", "exit_code": N}``
    (scripts read stdout for the result and stderr for why there is none)."""
    if state.as_json:
        print_json_error(str(message), code)
        return
    from rich.text import Text

    err.print(Text("error:", style="red"), Text(str(message)))


def print_json_error(message: str, code: int) -> None:
    sys.stderr.write(json.dumps({"error": message, "exit_code": code}) + "\n")


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
