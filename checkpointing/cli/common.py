"""What every ``ckpt`` command shares: the consoles, the settings given as flags, error handling
and the option types used by many commands."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from functools import wraps
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from checkpointing.config import Settings
from checkpointing.errors import CheckpointingError, SchemaOutdated

if TYPE_CHECKING:
    from checkpointing.metastore import Metastore

# markup off: ids, paths and stored messages are printed as typed (``[/x]`` is text, not a
# tag); styles are given as Text objects
out = Console(markup=False)
if not out.is_terminal:  # logs and CI: wide enough for the tables, never wrapped mid-word
    out = Console(width=160, markup=False)
err = Console(stderr=True, soft_wrap=True, highlight=False, markup=False)

EXIT_ERROR, EXIT_SCHEMA = 1, 3
#: the largest ``--limit`` (a SQL LIMIT must fit a 32-bit integer everywhere)
MAX_LIMIT = 2**31 - 1

#: arguments and options many commands take, with the same help everywhere
JobArg = Annotated[str, typer.Argument(help="Job id.")]
AsJson = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]

F = TypeVar("F", bound=Callable[..., Any])


class State:
    """The root options (``--metastore-url``, ``--storage-url``) every command reads."""

    metastore_url: str | None = None
    storage_url: str | None = None

    @property
    def settings(self) -> Settings:
        return Settings.resolve(self.metastore_url, self.storage_url)

    def metastore(self, *, check_schema: bool = True, create: bool | None = None) -> Metastore:
        from checkpointing.metastore import Metastore

        return Metastore(self.settings.metastore_url, check_schema=check_schema, create=create)


state = State()


#: the settings every entry point takes as flags (``ckpt`` and ``python -m demo``)
MetastoreUrlOption = Annotated[
    str | None,
    typer.Option(help="SQLAlchemy URL of the metastore [env: CKPT_METASTORE_URL]"),
]
StorageUrlOption = Annotated[
    str | None,
    typer.Option(help="Checkpoint storage, file:///… or s3://… [env: CKPT_STORAGE_URL]"),
]
VerboseOption = Annotated[bool, typer.Option("--verbose", "-v", help="Log what happens.")]


def main_options(
    metastore_url: MetastoreUrlOption = None,
    storage_url: StorageUrlOption = None,
    verbose: VerboseOption = False,
) -> None:
    state.metastore_url = metastore_url
    state.storage_url = storage_url
    configure_logging(verbose)


def configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("alembic", "botocore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def handles_errors(fn: F) -> F:
    """Known errors become one line on stderr and a non-zero exit code, never a traceback."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SchemaOutdated as exc:
            print_error(exc)
            raise typer.Exit(EXIT_SCHEMA) from None
        except CheckpointingError as exc:
            print_error(exc)
            raise typer.Exit(EXIT_ERROR) from None
        except OSError as exc:  # a file the user named: unreadable, a directory, the disk full
            print_error(exc)
            raise typer.Exit(EXIT_ERROR) from None

    return wrapper  # type: ignore[return-value]


def print_error(message: object) -> None:
    err.print(Text("error:", style="red"), Text(str(message)))


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
