"""``make demo`` (``python -m demo``): the example pipeline as an Airflow DAG, end to end, on
embedded defaults.

``dags/pipelines/nycflights13.yaml`` becomes a DAG through the project's DAG factory, in a
project-local Airflow (``CKPT_HOME/airflow-demo``: SQLite, this project's plugins), and runs with
``airflow dags test``: the :class:`~checkpointing_airflow.operators.CheckpointedSparkSubmitOperator`
submits it to local Spark with ``spark-submit``; the first try crashes partway (the operator's
failure drill), Airflow's failure callback plans the restore and the retry resumes from the latest
checkpoint. The demo then verifies the sink against an independent pandas computation (the same
check as the Spark-only demo, :func:`demo.flights.verify`) and prints the checkpoint and restore
history.

Airflow runs only as a subprocess here: this module imports nothing of it.
"""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from rich.console import Console
from rich.text import Text

from checkpointing.cli.render import RESTORE_DECISIONS, checkpoints_table, restores_table
from checkpointing.config import Settings
from checkpointing.metastore.views import list_checkpoints, list_restores
from checkpointing.pipeline.spec import PipelineSpec, load_spec
from demo import SPEC_PATH
from demo.airflow_env import airflow_command, airflow_env, migrate
from demo.flights import (
    AVG_RTOL,
    Verification,
    crash_point,
    demo_conf,
    open_demo_home,
    print_problems,
    reset_job,
    step,
    top_routes,
    verify,
)

#: the demo's DAG and job id: the example pipeline's, marked as the demo's own, so that the demo
#: (which starts afresh every time) never touches a job run from the spec itself
DEFAULT_JOB = "nycflights13_routes_demo"
#: the retry starts this long after the crash (the spec's default is 30 s)
RETRY_DELAY = "2s"

DAG_FILE = '''\
"""make demo: the pipeline spec next to this file (the example pipeline {source} with the demo's
job id, input and sink) as a DAG of the project's DAG factory. Its first try crashes after
{crash_after} epochs (the operator's failure drill). Written by `make demo`, rewritten each run."""

from checkpointing_airflow.dag_factory import pipeline_dag

dag = pipeline_dag(__file__, operator_args={operator_args!r})
'''

#: an Airflow (structlog) log line: timestamp, [level], message, then [logger] and key=value pairs
_LOG_LINE = re.compile(r"^\S+\s+\[\s*\w+\s*\]\s+(?P<msg>.*?)(?:\s+\[[\w.]+\](?P<kv>.*))?$")
_TRY = re.compile(r"job \S+: try (\d+) as coordinator (\S+), restore (\S+), parallelism (\d+)")
_CRASH = re.compile(r"crash injected after epoch (\d+)")
_STATE = re.compile(r"\bnew_state=(\w+)")
#: messages shown as they are (the epochs of ``ckpt run``, the failover, the end)
_SHOWN = re.compile(
    r"^(job \S+: epoch \d+/\d+ done .*|failover: .*|restore plan recorded .*"
    r"|no restore plan recorded .*|job \S+ finished: .*)"
)


@dataclass
class DemoRun:
    """What the Airflow run printed that the demo checks: each try's restore, the crash, and
    the finishing try's summary."""

    tries: list[tuple[int, str, int]] = field(default_factory=list)  # (try, restore, parallelism)
    crashed: bool = False
    finished: str | None = None
    states: list[str] = field(default_factory=list)  # the task's states, in order
    returncode: int | None = None
    _shown: set[str] = field(default_factory=set)

    def read(self, line: str) -> Text | None:
        """Note what ``line`` of the log says; return what to show of it (once), if anything.
        Spark's driver output comes twice (as it runs, and again in the error of a failed
        try), so every message is shown at most once per try."""
        m = _LOG_LINE.match(line.rstrip("\n"))
        msg, kv = (m.group("msg"), m.group("kv") or "") if m else (line.strip(), "")
        msg = msg.removeprefix("error: ")
        if (t := _TRY.search(msg)) is not None:
            self.tries.append((int(t.group(1)), t.group(3), int(t.group(4))))
            self._shown.clear()
            return Text.assemble(
                (f"try {t.group(1)}", "bold"),
                f" (coordinator {t.group(2)}): restore {t.group(3)}, parallelism {t.group(4)}",
            )
        if msg.startswith("Task instance state updated") and (s := _STATE.search(kv)):
            self.states.append(s.group(1))
            return Text.assemble("airflow: task run -> ", (s.group(1), "bold"))
        if (c := _CRASH.search(msg)) is not None:
            if self.crashed:
                return None
            self.crashed = True
            # the runtime counts epochs from 0, the epoch lines from 1
            return Text.assemble(
                (f"the Spark driver dies after epoch {int(c.group(1)) + 1}", "red"),
                f" (the failure drill: {c.group(0)})",
            )
        if (shown := _SHOWN.search(msg)) is None or shown.group(0) in self._shown:
            return None
        self._shown.add(shown.group(0))
        if " finished: " in msg:
            self.finished = msg
        return Text(shown.group(0))


def write_demo_dag(
    spec_path: Path, dags: Path, job: str, data_dir: Path, sink_dir: Path, crash_after: int
) -> PipelineSpec:
    """The example spec with the demo's job id, input, sink and retry delay, and its DAG file,
    in the demo's DAGs folder. Returns the spec as the DAG will load it."""
    raw = yaml.safe_load(spec_path.read_text())
    pattern = Path(raw["source"]["path"]).name
    raw.update(
        job=job,
        source={**raw["source"], "path": str(data_dir / pattern)},
        sink={**raw["sink"], "path": str(sink_dir)},
        retry_delay=RETRY_DELAY,
    )
    dags.mkdir(parents=True, exist_ok=True)
    for old in dags.glob("*"):  # one DAG only: an earlier demo's job id must not linger
        if old.is_file():
            old.unlink()
    spec_file = dags / f"{job}.yaml"
    header = f"# written by `make demo` from {spec_path}; rewritten each run\n"
    spec_file.write_text(header + yaml.safe_dump(raw, sort_keys=False))
    spec = load_spec(spec_file)
    operator_args: dict[str, Any] = {
        "fail_first_try_after_epochs": crash_after,
        "conf": {**demo_conf(spec, "local[2]"), "spark.ui.enabled": "false"},
    }
    spec_file.with_suffix(".py").write_text(
        DAG_FILE.format(source=spec_path.name, crash_after=crash_after, operator_args=operator_args)
    )
    return spec


def run_dag(
    env: dict[str, str], dag_id: str, log_file: Path, console: Console, timeout: float = 1800
) -> DemoRun:
    """``airflow dags test DAG``: the whole log to ``log_file``, the lines that tell the story to
    the console as they come."""
    seen = DemoRun()
    deadline = time.monotonic() + timeout
    with (
        log_file.open("w") as log,
        subprocess.Popen(
            [airflow_command(), "dags", "test", dag_id],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        ) as proc,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            shown = seen.read(line)
            if shown is not None:
                indent = "  " if shown.plain.startswith("try") else "    "
                console.print(Text.assemble(indent, shown), soft_wrap=True)
            if time.monotonic() > deadline:
                proc.kill()
                console.print(Text.assemble("  ", (f"timed out after {timeout:.0f} s", "red")))
                break
        seen.returncode = proc.wait()
    return seen


def run_airflow_demo(
    settings: Settings,
    console: Console,
    *,
    job: str = DEFAULT_JOB,
    spec_path: Path = SPEC_PATH,
    crash_after: int | None = None,
) -> Verification:
    """Run the example pipeline as an Airflow DAG with a crash in its first try; verify the
    retry's resume and the output; show the history."""
    started = time.monotonic()
    root = settings.home / "airflow-demo"
    dags = root / "dags"
    console.print(step("airflow  ", f"{root} (SQLite), DAGs in {dags}"))
    metastore, storage, flights, data_dir, files = open_demo_home(console, settings, spec_path)
    sink_dir = settings.home / "demo" / job / "out"
    if reset_job(metastore, storage, job, sink_dir):
        console.print(f"removed the previous run of job {job} (metastore rows, checkpoints, sink)")
    probe = load_spec(spec_path)
    num_epochs = -(-len(files) // probe.source.splits_per_epoch)
    crash_after = crash_point(num_epochs, probe.checkpoint.every_epochs or 1, crash_after)
    spec = write_demo_dag(spec_path, dags, job, data_dir, sink_dir, crash_after)

    env = airflow_env(root, dags, ckpt_home=settings.home)
    env["CKPT_METASTORE_URL"] = settings.metastore_url
    env["CKPT_STORAGE_URL"] = settings.storage_url
    console.print()
    console.print(step("1.", "Airflow's metadata database (airflow db migrate)"))
    t = time.monotonic()
    migrate(env)
    console.print(f"  ready in {time.monotonic() - t:.0f} s", highlight=False)

    every = spec.checkpoint.every_epochs or 1
    log_file = root / "dags-test.log"
    console.print()
    console.print(
        step(
            "2.",
            f"airflow dags test {job}: {num_epochs} epochs of {spec.source.splits_per_epoch} "
            f"days, a checkpoint every {every} epoch(s), parallelism {spec.parallelism}, "
            f"{spec.retries} retries {RETRY_DELAY} apart; the first try crashes after epoch "
            f"{crash_after}. Full log: {log_file}",
        ),
        soft_wrap=True,
    )
    run = run_dag(env, job, log_file, console)

    check = Verification()
    if run.returncode != 0:
        check.problems.append(
            f"airflow dags test {job} failed (exit code {run.returncode}); see {log_file}"
        )
    if not run.crashed:
        check.problems.append("the injected crash did not happen in the first try")
    if [t for t, _, _ in run.tries[:2]] != [1, 2]:
        check.problems.append(f"expected a first try and a retry, saw tries {run.tries}")
    if "up_for_retry" not in run.states or run.states[-1:] != ["success"]:
        check.problems.append(f"the task went through {run.states}, expected a retry, then success")
    if run.finished is None:
        check.problems.append("the pipeline did not finish")
    if not check.ok:
        print_problems(console, check)
        return check

    check = verify(spec, flights, files, sink_dir)
    checkpoints = list_checkpoints(metastore, job)
    restores = list_restores(metastore, job)
    restored = next((r for r in restores if r["status"] == "RESTORED"), None)
    redone = None
    if restored is None or restored["checkpoint_id"] is None:
        check.problems.append(f"no restore from a checkpoint is recorded: {restores}")
    else:
        created = pd.Timestamp(restored["created_at"])
        before = [
            c["checkpoint_id"]
            for c in checkpoints
            if c["completed_at"] and pd.Timestamp(c["completed_at"]) < created
        ]
        latest = max(before, default=None)
        if restored["checkpoint_id"] != latest:
            check.problems.append(
                f"the retry restored checkpoint {restored['checkpoint_id']}, but the latest "
                f"completed before it was {latest}"
            )
        epochs_run = re.search(r"(\d+) of (\d+) epochs run", run.finished or "")
        if epochs_run:
            redone = crash_after - (num_epochs - int(epochs_run.group(1)))

    console.print()
    console.print(step("3.", "the result, the checkpoint history and the restores\n"))
    console.print(top_routes(pd.read_parquet(sink_dir / "final"), spec))
    console.print(checkpoints_table(checkpoints, f"Checkpoints of {job}"))
    console.print(restores_table(restores, f"Restores of {job}", RESTORE_DECISIONS))
    metastore.dispose()

    console.print()
    console.print(step("4.", "verification against an independent pandas computation"))
    if not check.ok:
        print_problems(console, check)
        return check
    assert restored is not None
    console.print(
        Text.assemble(
            "  ",
            ("ok", "green"),
            f": the final table ({check.routes} routes) and all "
            f"{check.epochs} changelog epochs are equal to it\n"
            f"  (counts, sums, minima and maxima exactly, averages within {AVG_RTOL:g}); "
            f"the retry restored checkpoint {restored['checkpoint_id']}, the latest completed "
            f"before the crash, and redid {redone if redone is not None else '?'} epoch(s).\n"
            f"  {time.monotonic() - started:.0f} s in all. Try: ckpt list {job} | "
            f"ckpt restores {job} | ckpt show {job} {restored['checkpoint_id']}",
        ),
        soft_wrap=True,
    )
    return check
