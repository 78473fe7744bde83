"""How ``ckpt`` reads its command line and shows its usage, where typer's defaults do not fit:

- the root options on every command too (``ckpt list J --metastore-url …``), as ``kubectl``
  and ``airflow`` take them: a flag after the command wins over one before it, and either
  over the environment;
- a usage error (unknown option, missing argument, bad value) as ONE line on stderr when
  stderr is not a terminal (logs, CI, scripts; JSON with ``--json``), typer's box on one;
- help text rewrapped by paragraph (a docstring's line breaks are not the terminal's), and
  no ``<bool>`` placeholder after a flag.

:class:`Command` and :class:`Group` are the click classes of every command and sub-group
(``cls=``), :class:`RootGroup` that of ``ckpt`` itself.
"""

from __future__ import annotations

import inspect
import sys
from functools import cache
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption

from checkpointing.cli.common import (
    ENV_METASTORE_URL,
    ENV_STORAGE_URL,
    configure_logging,
    print_json_error,
    state,
)

#: the panel of each command's help that lists the root options again
GLOBAL_PANEL = "Global options"


def _metastore_url(value: str | None) -> None:
    if value is not None:
        state.metastore_url = value


def _storage_url(value: str | None) -> None:
    if value is not None:
        state.storage_url = value


def _verbose(value: bool) -> None:
    if value:
        configure_logging(True)


def _global_options(
    metastore_url: Annotated[
        str | None,
        typer.Option(
            metavar="URL",
            callback=_metastore_url,
            expose_value=False,
            rich_help_panel=GLOBAL_PANEL,
            help=f"SQLAlchemy URL of the metastore (or {ENV_METASTORE_URL}).",
        ),
    ] = None,
    storage_url: Annotated[
        str | None,
        typer.Option(
            metavar="URL",
            callback=_storage_url,
            expose_value=False,
            rich_help_panel=GLOBAL_PANEL,
            help=(
                "Checkpoint storage: file:///…, s3://…, gs://… or abfss://… "
                f"(or {ENV_STORAGE_URL})."
            ),
        ),
    ] = None,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            callback=_verbose,
            expose_value=False,
            rich_help_panel=GLOBAL_PANEL,
            help="Log what happens.",
        ),
    ] = False,
) -> None:
    """The root options as every command takes them: no environment variable of their own
    (it is read once, by the root), so that a flag before the command is not overridden."""


@cache
def _global_params() -> tuple[Any, ...]:
    """The click parameters of :func:`_global_options`, made by typer once."""
    holder = typer.Typer(add_completion=False)
    holder.command()(_global_options)
    command = typer.main.get_command(holder)
    return tuple(p for p in command.params if p.name != "help")


def unwrap(text: str | None) -> str | None:
    """Help text with each paragraph on one line: the terminal wraps it, not the docstring."""
    if not text:
        return text
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paragraphs)


def _without_flag_placeholders(params: list[Any]) -> list[Any]:
    """A flag takes no value: no ``<bool>`` after it in the help."""
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""
    return params


class _Tidy:
    """Help rewrapped and no ``<bool>`` placeholders; with ``root_options``, the root options
    accepted here too."""

    root_options = True
    help: str | None
    params: list[Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help = unwrap(self.help)
        if self.root_options:
            self.params.extend(_global_params())

    def get_params(self, ctx: Any) -> list[Any]:
        return _without_flag_placeholders(super().get_params(ctx))  # type: ignore[misc]


class Command(_Tidy, TyperCommand):
    """A ``ckpt`` command."""


class Group(_Tidy, TyperGroup):
    """A group of ``ckpt`` commands (``ckpt db``)."""


class RootGroup(_Tidy, TyperGroup):
    """``ckpt`` itself (its own root options): its usage errors one line off a terminal
    (:func:`usage_error`)."""

    root_options = False

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: Any = None,
        **extra: Any,
    ) -> Any:
        as_json = "--json" in args
        try:
            ctx = super().make_context(info_name, args, parent, **extra)
        except typer.Exit:
            raise
        except Exception as exc:
            usage_error(exc, as_json=as_json, resilient=extra.get("resilient_parsing", False))
            raise
        ctx.meta["ckpt.json"] = as_json
        return ctx

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except typer.Exit:
            raise
        except Exception as exc:
            usage_error(exc, as_json=ctx.meta.get("ckpt.json", False), resilient=False)
            raise


def usage_error(exc: Exception, *, as_json: bool, resilient: bool) -> None:
    """Say a click usage error in one line on stderr and exit with its code (2), unless stderr
    is a terminal (typer's box, with the usage, is for people) or it is not one to say here
    (help asked for by giving no arguments; a completion's parse). Returns for those."""
    if not isinstance(exc, typer.TyperException) or type(exc).__name__ == "NoArgsIsHelpError":
        return
    if resilient or (not as_json and _stderr_is_terminal()):
        return
    message = " ".join(exc.format_message().split())
    if as_json:
        print_json_error(message, exc.exit_code)
    else:
        ctx = getattr(exc, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        sys.stderr.write(f"error: {message}{hint}\n")
    raise typer.Exit(exc.exit_code)


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced, or closed
        return False
