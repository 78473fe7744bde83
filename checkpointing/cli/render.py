"""Tables for people: the read models of :mod:`checkpointing.metastore.views` (plain dicts) as Rich
tables.

Shared by the ``ckpt`` commands and the demos (``demo/``), so that a checkpoint history or a list
of restores looks the same wherever it is printed. Values are given as text or
:class:`~rich.text.Text`, never as markup."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rich.table import Table
from rich.text import Text

Row = dict[str, Any]

STATUS_STYLE = {
    "COMPLETED": "green",
    "PENDING": "yellow",
    "ABORTED": "red",
    "SUBSUMED": "dim",
    "DISCARDED": "dim",
    "QUEUED": "yellow",
    "TRIGGERED": "yellow",
    "FAILED": "red",
    "DROPPED": "red",
}


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def human_ms(v: int | None) -> str:
    if v is None:
        return "-"
    return f"{v} ms" if v < 10_000 else f"{v / 1000:.1f} s"


def when(iso: str | None, length: int = 23) -> str:
    """An ISO timestamp as ``YYYY-MM-DD HH:MM:SS[.mmm]`` (``length`` characters), or empty."""
    return (iso or "")[:length].replace("T", " ")


def short(text: str, width: int = 70) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def failure_text(r: Row, width: int = 70) -> str:
    """A checkpoint's failure reason and message, cut to ``width``."""
    return short(": ".join(x for x in (r["failure_reason"], r["failure_message"]) if x), width)


def checkpoints_table(rows: list[Row], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col, kw in (
        ("ID", {"justify": "right"}),
        ("Type", {}),
        ("Status", {}),
        ("Triggered (UTC)", {}),
        ("Duration", {"justify": "right"}),
        ("Acked", {"justify": "right"}),
        ("State size", {"justify": "right"}),
        ("Written", {"justify": "right"}),
        ("Failure", {"overflow": "fold"}),
    ):
        table.add_column(col, **kw)  # type: ignore[arg-type]
    for r in rows:
        table.add_row(
            str(r["checkpoint_id"]),
            r["type"].lower().replace("_", "-"),
            Text(r["status"], style=STATUS_STYLE.get(r["status"], "")),
            when(r["trigger_at"]),
            human_ms(r["duration_ms"]),
            f"{r['acked_tasks']}/{r['num_tasks']}",
            human_bytes(r["state_size"]),
            human_bytes(r["checkpointed_size"]),
            failure_text(r),
        )
    return table


def restore_source(r: Row) -> str:
    """What a restore read: ``empty state`` or ``checkpoint 7`` / ``savepoint 9``."""
    if r["checkpoint_id"] is None:
        return "empty state"
    return f"{r['checkpoint_type'].lower()} {r['checkpoint_id']}"


#: the columns a restores table can show, and how each cell is made from a restore row
RESTORE_COLUMNS: dict[str, Callable[[Row], str]] = {
    "#": lambda r: str(r["restore_id"]),
    "When (UTC)": lambda r: when(r["created_at"], 19),
    "Attempt": lambda r: r["attempt"],
    "Status": lambda r: r["status"],
    "From": restore_source,
    "Parallelism": lambda r: str(r["parallelism"] or "-"),
    "Fallbacks": lambda r: (
        "; ".join(f"{f['checkpoint_id']}: {f['reason']}" for f in r["fallbacks"]) or "-"
    ),
    "Decision": lambda r: r["message"] or "-",
}
#: ``ckpt restores``: when each restore was made; the demos show its status and decision instead
RESTORES = ("#", "When (UTC)", "Attempt", "From", "Parallelism", "Fallbacks")
RESTORE_DECISIONS = ("#", "Attempt", "Status", "From", "Parallelism", "Fallbacks", "Decision")


def restores_table(rows: list[Row], title: str, columns: Sequence[str] = RESTORES) -> Table:
    """A job's restores (:func:`checkpointing.metastore.views.list_restores`), newest first."""
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(*(RESTORE_COLUMNS[col](r) for col in columns))
    return table


def jobs_table(rows: list[Row]) -> Table:
    table = Table(title="Jobs", title_justify="left")
    for col in ("Job", "Status", "Completed", "Pending", "Failed", "Last completed", "Storage"):
        table.add_column(col)
    for r in rows:
        c = r["checkpoints"]
        table.add_row(
            r["job_id"],
            r["status"],
            str(c.get("COMPLETED", 0)),
            str(c.get("PENDING", 0)),
            str(c.get("ABORTED", 0)),
            str(r["last_completed_id"] or "-"),
            r["storage_url"],
        )
    return table


def operators_table(operators: list[Row]) -> Table:
    """Per operator of one checkpoint: subtasks acknowledged, state bytes, the latest ack (a
    step's operator, ``step-<name>``, is the step: its bytes are its output's)."""
    table = Table(title="Operators", title_justify="left")
    for col in ("Operator", "Acked", "State size", "Latest ack"):
        table.add_column(col, overflow="fold")
    for o in operators:
        table.add_row(
            o["operator_id"],
            f"{o['acked']}/{o['subtasks']}",
            human_bytes(o["state_size"]),
            when(o["latest_ack"]) if o["latest_ack"] else "-",
        )
    return table


def tasks_table(tasks: list[Row]) -> Table:
    """Every task of one checkpoint (:func:`checkpointing.metastore.views.checkpoint_detail`) and
    its ack."""
    table = Table(title="Tasks", title_justify="left")
    for col in ("Operator", "Subtask", "Attempt", "Acked", "Size", "Sync", "Async", "Handle"):
        table.add_column(col, overflow="fold")
    for t in tasks:
        table.add_row(
            t["operator_id"],
            f"{t['subtask_index']}/{t['parallelism']} (max {t['max_parallelism']})",
            t["attempt_id"],
            when(t["acked_at"]) if t["acked"] else Text("no", style="yellow"),
            human_bytes(t["state_size"]),
            human_ms(t["sync_ms"]),
            human_ms(t["async_ms"]),
            t["state_handle"] or "-",
        )
    return table


def summary_table(stats: dict[str, Any], title: str) -> Table:
    """:func:`checkpointing.metastore.views.checkpoint_stats` as a two-column table."""

    def spread(values: dict[str, Any] | None, unit: str) -> str:
        if not values:
            return "-"
        return " / ".join(f"{values[k]:,}{unit}" for k in ("min", "avg", "max"))

    def which(row: Row | None) -> str:
        if not row:
            return "-"
        at = when(row["completed_at"] or row["ended_at"] or row["trigger_at"], 19)
        return f"{row['type'].lower()} {row['checkpoint_id']} ({row['status']}, {at})"

    restore = stats["latest_restore"]
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", overflow="fold")
    counts = " · ".join(f"{k} {v}" for k, v in sorted(stats["counts"].items()))
    table.add_row("Checkpoints", counts or "none")
    table.add_row("Duration min / avg / max", spread(stats["duration_ms"], " ms"))
    table.add_row("State size min / avg / max", spread(stats["state_size"], " B"))
    table.add_row("Latest completed", which(stats["latest_completed"]))
    table.add_row("Latest failed", which(stats["latest_failed"]))
    table.add_row("Latest savepoint", which(stats["latest_savepoint"]))
    table.add_row(
        "Latest restore",
        "-"
        if restore is None
        else f"{restore['attempt']} from "
        + ("empty state" if restore["checkpoint_id"] is None else str(restore["checkpoint_id"])),
    )
    return table


def requests_table(rows: list[Row], title: str) -> Table:
    """Savepoint and checkpoint requests (:func:`checkpointing.metastore.views.list_requests`)."""
    table = Table(title=title, title_justify="left")
    for col in ("id", "type", "status", "checkpoint", "requested by", "requested at", "message"):
        table.add_column(col, justify="right" if col in ("id", "checkpoint") else "left")
    for r in rows:
        table.add_row(
            str(r["request_id"]),
            r["type"],
            Text(r["status"], style=STATUS_STYLE.get(r["status"], "white")),
            str(r["checkpoint_id"] or "-"),
            r["requested_by"],
            r["requested_at"] or "-",
            short(r["message"] or ""),
        )
    return table


def _epochs(first: int | None, last: int | None) -> str:
    if first is None:
        return "-"
    return str(first) if first == last else f"{first}-{last}"


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def input_table(section: Row) -> Table:
    """The runs that read a checkpoint's input
    (:func:`checkpointing.metastore.views.consumed_input`), in
    epoch order."""
    table = Table(title="Input", title_justify="left")
    for col, kw in (
        ("Run (attempt)", {"overflow": "fold"}),
        ("Epochs", {"justify": "right"}),
        ("Files", {"justify": "right"}),
        ("Splits", {"justify": "right"}),
        ("Bytes", {"justify": "right"}),
    ):
        table.add_column(col, **kw)  # type: ignore[arg-type]
    for r in section["runs"]:
        table.add_row(
            r["attempt"]
            or Text("earlier runs (compacted)" if r.get("compacted") else "unknown", style="dim"),
            _epochs(r["first_epoch"], r["last_epoch"]),
            str(r["files"]),
            str(r["splits"]),
            human_bytes(r["bytes"]),
        )
    if not section["runs"]:
        table.add_row(Text("nothing read yet", style="dim"), "-", "0", "0", "-")
    return table


def input_totals(section: Row) -> str:
    """One line: the files read, the splits still to read and where the next run starts."""
    line = (
        f"input: {_count(section['files_processed'], 'file')} read "
        f"({human_bytes(section['bytes_processed'])}), "
        f"{_count(section['splits_remaining'], 'split')} still to read"
    )
    if section["next_epoch"] is not None:
        line += f"; the next run starts at epoch {section['next_epoch']}"
    tables: dict[str, int] = {}
    for t in section.get("tables") or []:  # the static tables the transform joined
        tables[t["table"]] = tables.get(t["table"], 0) + 1
    if tables:
        line += "; tables: " + ", ".join(f"{n} ({_count(k, 'file')})" for n, k in tables.items())
    return line


def input_files_table(section: Row) -> Table:
    """The files of a checkpoint's input, by first epoch (``ckpt show --files``)."""
    table = Table(title="Input files", title_justify="left", caption_justify="left")
    for col in ("Path", "Epochs", "Size", "ETag / modified (UTC)", "Read by", "To read"):
        table.add_column(col, overflow="fold")
    for f in section["files"]:
        epochs = f["epochs"]
        contiguous = epochs and epochs[-1] - epochs[0] == len(epochs) - 1
        table.add_row(
            f["path"],
            _epochs(epochs[0], epochs[-1]) if contiguous else ", ".join(map(str, epochs)) or "-",
            human_bytes(f["size"]),
            f["etag"] or when(f["mtime"], 19) or "-",
            ", ".join(f["attempts"]) or "-",
            f"{f['remaining_splits']}/{f['splits']}" if f["remaining_splits"] else "",
        )
    if section["files_omitted"]:
        table.caption = f"and {section['files_omitted']} more files, not listed"
    return table
