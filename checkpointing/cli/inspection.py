"""``ckpt restore-plan`` and ``ckpt inspect``: looking inside checkpoints without changing
anything, through :func:`checkpointing.restore.lookup.preview_restore` and
:class:`checkpointing.restore.state_reader.CheckpointReader`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from checkpointing.cli.common import (
    DEFAULT_LIMIT,
    AsJson,
    JobArg,
    Limit,
    err,
    handles_errors,
    limit_or_all,
    out,
    print_json,
    state,
)

if TYPE_CHECKING:
    from rich.table import Table

    from checkpointing.restore.state_reader import StateView


@handles_errors
def restore_plan(
    job: JobArg,
    parallelism: Annotated[
        int, typer.Option(min=1, metavar="N", help="The new number of subtasks.")
    ],
    restore: Annotated[
        str,
        typer.Option(
            metavar="SOURCE",
            help="latest (with fallback past corrupt ones), a checkpoint id, or a checkpoint "
            "or savepoint path: as ckpt run --restore.",
        ),
    ] = "latest",
    from_: Annotated[
        str | None,
        typer.Option("--from", hidden=True, help="Deprecated spelling of --restore."),
    ] = None,
    as_json: AsJson = False,
    allow_other_job: Annotated[
        bool,
        typer.Option(
            "--allow-other-job",
            help="Let --restore be a checkpoint or savepoint path of another job.",
        ),
    ] = False,
) -> None:
    """Dry run of a restore: which checkpoint, and what each new subtask would read.

    Nothing is recorded in the metastore and no state is loaded."""
    from rich.text import Text

    from checkpointing.cli.render import human_bytes
    from checkpointing.metastore.jobs import job_storage
    from checkpointing.restore.lookup import preview_restore

    source = _restore_source(restore, from_)
    metastore = state.metastore()
    preview = preview_restore(
        metastore,
        job_storage(metastore, job, state.storage_url),
        job,
        parallelism=parallelism,
        source=source,
        allow_other_job=allow_other_job,
    )
    data = preview.to_dict()
    if as_json:
        print_json(data)
        return
    old = sorted({op["old_parallelism"] for op in data["operators"]})
    max_p = sorted({op["max_parallelism"] for op in data["operators"]})
    out.print(
        f"job {job}: a restore would read {data['checkpoint_type'].lower()} "
        f"{data['checkpoint_id']} ({data['metadata_path']}), parallelism "
        f"{'/'.join(map(str, old))} -> {parallelism} (max {'/'.join(map(str, max_p))}); "
        "dry run, nothing recorded",
        soft_wrap=True,
    )
    for s in data["skipped"]:
        out.print(
            Text("skipped", style="yellow"),
            f"checkpoint {s['checkpoint_id']}: {s['reason']}",
            soft_wrap=True,
        )
    out.print(_plan_table(data, f"Restore plan of {job} at parallelism {parallelism}"))
    files = len({f["url"] for sub in data["subtasks"] for f in sub["files"]})
    out.print(f"total: {human_bytes(data['bytes'])} of keyed state from {files} file(s)")


@handles_errors
def inspect(
    job: JobArg,
    checkpoint_id: Annotated[
        str, typer.Argument(metavar="CHECKPOINT_ID", help="A completed checkpoint or savepoint id.")
    ],
    operator: Annotated[
        str | None, typer.Option(help="Operator whose state to read (omit: list the operators).")
    ] = None,
    key: Annotated[
        list[str] | None,
        typer.Option(help="Only this key: repeat once per key column, in the key's order."),
    ] = None,
    key_columns: Annotated[
        str | None,
        typer.Option(help="Comma-separated key columns, when the snapshot does not record them."),
    ] = None,
    limit: Limit = DEFAULT_LIMIT,
    as_json: AsJson = False,
) -> None:
    """Read the state in a checkpoint (Flink's State Processor API): keyed rows, one key, or
    operator list state items; every file read is verified against its checksum."""
    from checkpointing.ids import validate_checkpoint_id
    from checkpointing.metastore.jobs import job_storage
    from checkpointing.restore.state_reader import CheckpointReader

    if operator is None and (key or key_columns):
        raise typer.BadParameter("needs --operator", param_hint="--key/--key-columns")
    metastore = state.metastore()
    reader = CheckpointReader.open(
        metastore,
        job_storage(metastore, job, state.storage_url),
        job,
        validate_checkpoint_id(checkpoint_id),
    )
    decision = reader.decision
    title = f"{job} {(decision.checkpoint_type or '').lower()} {decision.checkpoint_id}"
    if operator is None:
        ops = [op.to_dict() for op in reader.operators()]
        if as_json:
            print_json(ops)
        else:
            out.print(_operators_table(ops, f"Operators of {title}"))
        return
    columns = [c.strip() for c in key_columns.split(",") if c.strip()] if key_columns else None
    view = reader.read(operator, key=key or None, key_columns=columns, limit=limit_or_all(limit))
    data = view.to_dict()
    if as_json:
        print_json(data)
        return
    if not data["rows"]:
        out.print(
            f"no state for key {tuple(data['key'])} in {title} (key group {view.key_group})"
            if view.key is not None
            else f"{view.operator_id} has no state in {title}"
        )
        return
    out.print(_state_table(view, data, title))
    if view.truncated:
        out.print(f"first {len(data['rows'])} rows; --limit N shows more, --limit 0 all")


def _restore_source(restore: str, deprecated_from: str | None) -> str:
    """``--restore``, or the old spelling ``--from`` (said once on stderr); both: the same."""
    if deprecated_from is None:
        return restore
    if restore != "latest" and restore != deprecated_from:
        raise typer.BadParameter(
            f"--from {deprecated_from!r} and --restore {restore!r} disagree (--from is the old "
            "name of --restore: give only --restore)",
            param_hint="--restore",
        )
    if not state.as_json:
        err.print("warning: --from is deprecated: use --restore", soft_wrap=True)
    return deprecated_from


# ------------------------------------------------------------------------------------ tables


def _plan_table(data: dict[str, Any], title: str) -> Table:
    """One row per new subtask: its key groups, the files it reads, its list state."""
    from rich.table import Table

    from checkpointing.cli.render import human_bytes

    lists = [op["operator_id"] for op in data["operators"] if op["list_mode"] is not None]
    table = Table(title=title, title_justify="left")
    table.add_column("Subtask", justify="right")
    table.add_column("Key groups")
    table.add_column("Files (key groups)", overflow="fold")
    table.add_column("Bytes", justify="right")
    for op_id in lists:
        table.add_column(f"{op_id} ({'splits' if op_id == 'source' else 'list state'})")
    for sub in data["subtasks"]:
        kg = sub["key_groups"]
        table.add_row(
            str(sub["subtask"]),
            "-" if kg is None else f"{kg['start']}-{kg['end']}",
            "\n".join(
                f"{_file_name(f['url'])} [{f['key_groups']['start']}-{f['key_groups']['end']}]"
                for f in sub["files"]
            )
            or "-",
            human_bytes(sub["bytes"]),
            *(_short_items(sub["list_state"][op_id]) for op_id in lists),
        )
    return table


def _file_name(url: str) -> str:
    return url.rsplit("/", 1)[-1]


def _short_items(items: list[dict[str, Any]], shown: int = 3) -> str:
    """List state items for a table cell: a split as its file name, others as key=value."""
    from checkpointing.pipeline.splits import Consumed, InputSplit, is_consumed_item

    if not items:
        return "-"
    texts = [
        InputSplit.from_state(i).describe()
        if "path" in i
        else Consumed.from_items([i]).describe()
        if is_consumed_item(i)
        else " ".join(f"{k}={v}" for k, v in i.items())
        for i in items
    ]
    more = f" (+{len(texts) - shown} more)" if len(texts) > shown else ""
    return "\n".join(texts[:shown]) + more


def _operators_table(ops: list[dict[str, Any]], title: str) -> Table:
    from rich.table import Table

    from checkpointing.cli.render import human_bytes

    table = Table(title=title, title_justify="left")
    for col in ("Operator", "State", "Parallelism", "Files", "Bytes", "List items"):
        table.add_column(col)
    for op in ops:
        table.add_row(
            op["operator_id"],
            op["kind"],
            f"{op['parallelism']} (max {op['max_parallelism']})",
            str(op["files"]),
            human_bytes(op["bytes"]),
            str(op["list_items"]),
        )
    return table


def _state_table(view: StateView, data: dict[str, Any], title: str) -> Table:
    """An operator's list state items per subtask, or its keyed rows (of one key)."""
    from rich.table import Table

    if view.kind == "list":
        table = Table(title=f"{view.operator_id} list state of {title}", title_justify="left")
        table.add_column("Subtask", justify="right")
        for col in data["columns"]:
            table.add_column(col, overflow="fold")
        for r in data["rows"]:
            table.add_row(str(r["subtask"]), *(_cell(r["item"].get(c)) for c in data["columns"]))
        return table
    where = (
        f", key {tuple(data['key'])} (key group {view.key_group})" if view.key is not None else ""
    )
    from checkpointing.restore.state_reader import describe_value

    table = Table(title=f"{view.operator_id} keyed state of {title}{where}", title_justify="left")
    for col in data["columns"]:
        table.add_column(col, overflow="fold")
    for r in view.rows:  # the values as read: sets, sketches, pairs and moments described
        table.add_row(*(describe_value(c, r[c]) for c in data["columns"]))
    return table


def _cell(value: Any) -> str:
    return "null" if value is None else str(value)
