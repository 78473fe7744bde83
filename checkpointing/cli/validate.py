"""``ckpt validate SPEC…``: every check ``ckpt run`` makes before Spark starts, for a CI step:
the same function (:func:`checkpointing.cli.preflight.check_before_spark`), without Spark and
without writing anything. Exit 0 when every spec is valid, 1 when any is not (one line per
problem, naming the spec file and the field), 2 for a usage error."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from checkpointing.cli.common import (
    EXIT_ERROR,
    AsJson,
    err,
    handles_errors,
    out,
    print_json,
)
from checkpointing.cli.preflight import (
    AllowChangedTablesOption,
    AllowOtherJobOption,
    FullRefreshOption,
    IntervalEndOption,
    IntervalStartOption,
    ParallelismOption,
    RestoreOption,
    check_before_spark,
    data_interval,
    naming_the_file,
)
from checkpointing.errors import CheckpointingError, MetastoreUnavailable, SchemaOutdated

if TYPE_CHECKING:
    from checkpointing.pipeline.interval import DataInterval
    from checkpointing.spark.preflight import RunOptions


@dataclass
class Verdict:
    """One spec's result: its problems (none: valid), each one line naming the file."""

    spec: str
    job: str | None = None
    problems: list[str] = field(default_factory=list)
    #: a ``scope: interval`` spec checked without an interval: its input and restore are not
    template: bool = False

    @property
    def valid(self) -> bool:
        return not self.problems


@handles_errors
def validate(
    specs: Annotated[
        list[Path],
        typer.Argument(metavar="SPEC", help="Pipeline specs (YAML) to check, one or more."),
    ],
    restore: RestoreOption = "latest",
    parallelism: ParallelismOption = None,
    allow_other_job: AllowOtherJobOption = False,
    allow_changed_tables: AllowChangedTablesOption = False,
    interval_start: IntervalStartOption = None,
    interval_end: IntervalEndOption = None,
    full_refresh: FullRefreshOption = False,
    as_json: AsJson = False,
) -> None:
    """Check pipeline specs as `ckpt run` does before Spark starts, without running them.

    Fields, paths, Python entry points, the input globs, the sink's ownership, and the restore
    source against the metastore (read only; a metastore that does not exist yet has no
    checkpoint). Nothing is written: no metastore row, no file. Exit code 0 when all are valid,
    1 when any is not (a line per problem on stderr, naming the spec file and the field), 2 for
    a usage error. A scope: interval spec without --interval-start/--interval-end is checked as
    a template (its fields and entry points)."""
    from checkpointing.spark.preflight import RunOptions

    options = RunOptions(
        restore=restore,
        parallelism=parallelism,
        allow_other_job=allow_other_job,
        allow_changed_tables=allow_changed_tables,
        full_refresh=full_refresh,
    )
    interval = data_interval(interval_start, interval_end)
    verdicts = [_check(path, options, interval) for path in specs]
    valid = all(v.valid for v in verdicts)
    if as_json:
        print_json({"valid": valid, "specs": [_as_dict(v) for v in verdicts]})
    else:
        for v in verdicts:
            _say(v)
    if not valid:
        raise typer.Exit(EXIT_ERROR)


def _check(path: Path, options: RunOptions, interval: DataInterval | None) -> Verdict:
    """A spec's verdict; an unreachable or outdated metastore is not the spec's fault: raised."""
    from checkpointing.pipeline.spec import load_spec

    verdict = Verdict(str(path))
    try:
        if interval is None:
            spec = load_spec(path)  # a template validates as one (its placeholders unfilled)
            verdict.job = spec.job
            if spec.is_template:
                verdict.template = True
                return verdict
        checked = check_before_spark(path, options, interval)
        checked.metastore.dispose()
        verdict.job = checked.spec.job
    except (SchemaOutdated, MetastoreUnavailable):
        raise
    except (CheckpointingError, OSError) as exc:
        verdict.problems = [
            naming_the_file(path, None, line) for line in str(exc).splitlines() if line.strip()
        ]
    return verdict


def _as_dict(verdict: Verdict) -> dict[str, Any]:
    return {"spec": verdict.spec, "valid": verdict.valid, **asdict(verdict)}


def _say(verdict: Verdict) -> None:
    from rich.text import Text

    if not verdict.valid:
        for problem in verdict.problems:
            err.print(Text("error:", style="red"), Text(problem), soft_wrap=True)
        return
    note = (
        ", a scope: interval template: give --interval-start and --interval-end to check its "
        "input, sink and restore"
        if verdict.template
        else ""
    )
    out.print(f"valid: {verdict.spec} (job {verdict.job}{note})", soft_wrap=True)
