"""Which steps a run reuses and which it recomputes, from the latest completed checkpoint: pure
functions over the ``_metadata`` of a step checkpoint, no Spark and no metastore.

Every step checkpoint holds the whole job so far: its own step's subtasks (one per Spark task,
each with the Parquet file it wrote) and those of every earlier step it carries (their files,
under the job's ``shared/``, registered by the checkpoint that wrote them). Each subtask's
``list_state`` holds one item describing its step (:class:`StepFile`), so a restore needs
nothing but the ``_metadata``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from checkpointing.config import CheckpointConfig
from checkpointing.state.metadata import CheckpointMetadata

#: the ``list_state`` item of a step's subtask carries this key
STEP_KEY = "step"


#: a step may run for hours: its checkpoint must not expire while Spark writes it
STEP_TIMEOUT = timedelta(days=2)


def step_config() -> CheckpointConfig:
    """A step job's checkpoint configuration: no periodic checkpoints (a step is one), and
    each may take as long as its step."""
    return CheckpointConfig(timeout=STEP_TIMEOUT)


@dataclass(frozen=True)
class StepFile:
    """One subtask of a step: the Parquet file its Spark task wrote (None: an empty task)."""

    partition: int
    handle: str | None
    size: int
    checksum: str | None


@dataclass(frozen=True)
class StepRecord:
    """A completed step as a checkpoint records it."""

    name: str
    fingerprint: str
    upstream: tuple[str, ...]
    schema: str
    parallelism: int
    deterministic: bool
    files: tuple[StepFile, ...] = field(default=())
    #: a narrow step's input file per partition (matched across runs when it resumes)
    partition_inputs: tuple[str | None, ...] = ()
    #: chained into the steps that read it: no files, recomputed from its inputs by them
    chained: bool = False

    def item(self, partition: int) -> dict[str, Any]:
        """The ``list_state`` item of subtask ``partition``."""
        inputs = self.partition_inputs
        return {
            **({"chained": True} if self.chained else {}),
            "parallelism": self.parallelism,
            "input": inputs[partition] if partition < len(inputs) else None,
            STEP_KEY: self.name,
            "fingerprint": self.fingerprint,
            "upstream": list(self.upstream),
            "schema": self.schema,
            "deterministic": self.deterministic,
            "partition": partition,
        }

    @property
    def urls(self) -> list[str]:
        """The step's files, in partition order (empty tasks wrote none)."""
        return [f.handle for f in sorted(self.files, key=lambda f: f.partition) if f.handle]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


def restored_steps(metadata: CheckpointMetadata | None) -> dict[str, StepRecord]:
    """The steps a completed step checkpoint holds, by name; a subtask without a step item (a
    checkpoint of something else) is ignored."""
    if metadata is None:
        return {}
    steps: dict[str, StepRecord] = {}
    for op in metadata.operators:
        items = [(s, (s.list_state or [{}])[0]) for s in op.subtasks]
        items = [(s, i) for s, i in items if isinstance(i, Mapping) and STEP_KEY in i]
        if not items:
            continue
        first = items[0][1]
        steps[str(first[STEP_KEY])] = StepRecord(
            name=str(first[STEP_KEY]),
            fingerprint=str(first["fingerprint"]),
            upstream=tuple(str(u) for u in first.get("upstream", [])),
            schema=str(first["schema"]),
            parallelism=op.parallelism,
            deterministic=bool(first.get("deterministic", True)),
            files=tuple(
                StepFile(int(i["partition"]), s.handle, s.size, s.checksum) for s, i in items
            ),
            partition_inputs=tuple(
                i.get("input") for _, i in sorted(items, key=lambda x: int(x[1]["partition"]))
            ),
            chained=first.get("chained") is True,
        )
    return steps


def downstream_of(name: str, steps: Mapping[str, StepRecord]) -> list[str]:
    """The recorded steps that read ``name``, directly or through others, in record order."""
    found: list[str] = []
    frontier = {name}
    changed = True
    while changed:
        changed = False
        for step in steps.values():
            if step.name not in found and frontier & set(step.upstream):
                found.append(step.name)
                frontier.add(step.name)
                changed = True
    return found


@dataclass(frozen=True)
class StepDecision:
    """What a run does with one step: reuse its checkpoint, or compute it (and why)."""

    reuse: StepRecord | None
    reason: str

    @property
    def reused(self) -> bool:
        return self.reuse is not None


def decide(
    name: str, fingerprint: str, restored: Mapping[str, StepRecord], reason_upstream: str | None
) -> StepDecision:
    """Reuse ``name``'s restored checkpoint when its fingerprint is unchanged; else compute it,
    saying why (new, changed, or downstream of a changed step: ``reason_upstream``)."""
    record = restored.get(name)
    if record is None:
        return StepDecision(None, "no completed checkpoint of it")
    if record.fingerprint == fingerprint:
        return StepDecision(record, "unchanged")
    if reason_upstream is not None:
        return StepDecision(None, reason_upstream)
    return StepDecision(None, "changed (its plan or input files differ)")


def change_line(job: str, name: str, restored: Mapping[str, StepRecord]) -> str:
    """The one line a run logs when a step changed: the step and what it reruns."""
    below = downstream_of(name, restored)
    rerun = ", ".join([name, *below])
    return f"job {job}: step {name} changed: rerunning {rerun}; reusing the steps upstream of it"


def missing_partitions(parallelism: int, done: Iterable[int]) -> list[int]:
    """The partitions of a step cut short that no acknowledged file covers."""
    have = set(done)
    return [p for p in range(parallelism) if p not in have]


def carried(steps: Sequence[StepRecord]) -> list[tuple[StepRecord, StepFile]]:
    """Every subtask a step checkpoint carries from earlier steps, in order."""
    return [(s, f) for s in steps for f in sorted(s.files, key=lambda f: f.partition)]
