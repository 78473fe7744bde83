"""Chained steps: ``ck.step(name, fn, chained=True)``, Flink's operator chaining for a step
cheaper to recompute than to write.

A step that scans files and maps them without a shuffle (a filter, a projection, a join with
a broadcast table) costs more to write and read back than to recompute: on the step benchmark
the join's 12 million rows take longer to write with Spark's Parquet writer than the whole job
takes without it. Flink never persists such an edge either: chained operators run in one task,
and what a batch job keeps across a failure are its blocking results. A chained step is still a
checkpoint (one subtask, acknowledged without a file) whose identity is its plan and its input
files' versions, which is its whole state, as a Flink source's offsets are. The steps that read
it recompute it inside their own tasks, and a resume that finds it unchanged recomputes it the
same way. What it gives up: a crash inside the step that reads it loses that step's progress,
and a savepoint holds its plan, not its rows (its inputs must still be there to restore it).
"""

from __future__ import annotations

import re

from pyspark.sql import DataFrame

from checkpointing.coordination.coordinator import CheckpointCoordinator
from checkpointing.spark import step_writer
from checkpointing.steps.plan import StepFile, StepRecord

#: the alias a chained step's DataFrame carries (its name in hex: an identifier Spark prints
#: unquoted, whatever the step's name): the steps that read it find it in their plans
ALIAS_PREFIX = "ckpt_chained__"
_ALIAS = re.compile(rf"SubqueryAlias {ALIAS_PREFIX}([0-9a-f]+)\b")


def refusal(name: str, facts: step_writer.PlanFacts) -> str | None:
    """Why step ``name`` cannot be chained (one line), or None."""
    if facts.shuffles:
        return (
            f"step {name}: chained=True needs a plan without a shuffle (a scan, filter, "
            "projection or broadcast join); this one shuffles, so checkpoint it"
        )
    if facts.nondeterministic:
        return (
            f"step {name}: chained=True needs a deterministic plan (its readers recompute it); "
            f"{facts.nondeterministic}"
        )
    return None


def hint(job: str, name: str, size: int, seconds: float) -> str:
    """The line a step that could have been chained logs once its rows are written: it does
    not shuffle, so writing and reading back its rows may cost more than recomputing them."""
    return (
        f"job {job}: step {name} does not shuffle, yet its rows were written "
        f"({size / 1e6:,.0f} MB; the step took {seconds:.0f} s): if they cost more to write and "
        "read back than to recompute, ck.step(..., chained=True) checkpoints it as its plan "
        "and inputs instead, unless a narrow step resumes from it (input=) "
        "(docs/steps.md, Chained steps)"
    )


def chained_frame(df: DataFrame, name: str) -> DataFrame:
    """What ``ck.step`` returns for a chained step: its own plan, named for its readers."""
    return df.alias(alias(name))


def alias(name: str) -> str:
    """A chained step's alias."""
    return f"{ALIAS_PREFIX}{name.encode().hex()}"


def chained_upstream(named_plan: str, chained: set[str]) -> set[str]:
    """The chained steps a step's plan reads (their aliases in its analyzed plan)."""
    by_alias = {alias(n): n for n in chained}
    return {by_alias[a] for m in _ALIAS.findall(named_plan) if (a := ALIAS_PREFIX + m) in by_alias}


def chained_record(
    name: str, fingerprint: str, upstream: tuple[str, ...], schema: str
) -> StepRecord:
    """A chained step as its checkpoint records it: one subtask, no file."""
    return StepRecord(
        name,
        fingerprint,
        upstream,
        schema,
        1,
        True,
        files=(StepFile(0, None, 0, None),),
        chained=True,
    )


def checkpoint_chained(
    coordinator: CheckpointCoordinator,
    record: StepRecord,
    carried: list[StepRecord],
    run: str,
    seq: int,
) -> StepRecord:
    """The chained step's checkpoint (``record``: :func:`chained_record`): what it carries,
    and its one subtask acknowledged with no file; complete once acknowledged."""
    checkpoint_id, tasks = step_writer.trigger_step(coordinator, run, seq, carried, record)
    acker = step_writer.StepAcknowledger(
        coordinator, checkpoint_id, record, tasks.own, directory=""
    )
    acker.ack_many(list(record.files))
    if acker.completed is None:
        raise step_writer.StepCheckpointError(
            f"step {record.name}: checkpoint {checkpoint_id} did not complete"
        )
    return record
