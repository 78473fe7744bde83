"""The pipelines directory: one spec (``<name>.yaml``) and one DAG file (``<name>.py``) per
pipeline, and ``python -m checkpointing_airflow.dag_files sync|check DIR`` (also run as
``python -m checkpointing_airflow.dag_factory``) that writes and checks them.

**Why each spec has its own DAG file.** Airflow parses DAG files one Python file at a time and
records import errors per file. An import error marks every DAG of its file stale
(``airflow.dag_processing.collection._update_import_errors``), and the dag-processor lists only
``.py`` and ``.zip`` files. The DAG importer registry of Airflow 3.3 cannot be extended from
configuration. If one factory file built every pipeline, one broken spec would take down all of
them. So each spec has a DAG file next to it, ``<name>.py``. It holds the same two lines for every
spec (:data:`DAG_FILE`). A broken spec is then an import error of that one file, and the error
names the spec file and the field. ``dags/checkpoint_pipelines.py`` checks the directory as a
whole (:func:`raise_for_pipeline_problems`): every spec has a DAG file and no two specs share a
job id.

No Airflow import: ``sync`` and the checks run without it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from checkpointing.errors import ConfigError
from checkpointing.pipeline.spec import SpecError, load_spec
from checkpointing_airflow.dag_defaults import MAINTENANCE_SUFFIX

SPEC_SUFFIX = ".yaml"

#: the DAG file of every spec, ``<name>.py`` next to ``<name>.yaml``
DAG_FILE = '''\
"""The DAG of the pipeline spec next to this file (same name, .yaml).

One DAG file per spec, so that a broken spec is an import error of this file only. Written by
`python -m checkpointing_airflow.dag_factory sync`, the same for every spec.
"""

from checkpointing_airflow.dag_factory import pipeline_dag

dag = pipeline_dag(__file__)
'''


class PipelineSetError(ConfigError):
    """The specs of a pipelines directory do not make a set of DAGs (names the files)."""


def spec_file_for(dag_file: str | Path) -> Path:
    """The spec a pipeline DAG file builds: the ``.yaml`` with the same name next to it."""
    return Path(dag_file).absolute().with_suffix(SPEC_SUFFIX)


def spec_files(directory: str | Path) -> list[Path]:
    """The specs of a pipelines directory, sorted."""
    return sorted(Path(directory).glob(f"*{SPEC_SUFFIX}"))


def known_pipelines(directory: str | Path) -> dict[str, Path]:
    """Job id → spec file, for the specs that load. Broken ones are left out here; their own DAG
    files report them."""
    found: dict[str, Path] = {}
    for path in spec_files(directory):
        try:
            spec = load_spec(path)
        except SpecError:
            continue
        found.setdefault(spec.job, path.absolute())
    return dict(sorted(found.items()))


def pipeline_problems(directory: str | Path) -> list[str]:
    """What keeps the specs of ``directory`` from becoming one DAG each: a spec without a DAG
    file, a ``.yml`` spec, two specs with one job id (or a job id that is another spec's
    maintenance DAG's). Broken specs are left to their DAG files."""
    directory = Path(directory)
    problems = [
        f"{path}: a pipeline spec must end in {SPEC_SUFFIX} (rename it)"
        for path in sorted(directory.glob("*.yml"))
    ]
    jobs: dict[str, list[Path]] = {}
    #: maintenance DAG id → its spec
    maintenance: dict[str, Path] = {}
    for path in spec_files(directory):
        if not path.with_suffix(".py").exists():
            problems.append(
                f"{path}: no DAG file {path.stem}.py next to it, so Airflow does not see this "
                f"pipeline; write it with `python -m checkpointing_airflow.dag_factory sync "
                f"{directory}`"
            )
        try:
            spec = load_spec(path)
        except SpecError:
            continue
        jobs.setdefault(spec.job, []).append(path)
        if spec.maintenance is not None:
            maintenance[f"{spec.job}{MAINTENANCE_SUFFIX}"] = path
    for job, paths in sorted(jobs.items()):
        if len(paths) > 1:
            names = ", ".join(p.name for p in paths)
            problems.append(f"{directory}: job: {job!r} is the job of {names}: one DAG per job id")
        if job in maintenance:
            problems.append(
                f"{directory}: job: {job!r} of {paths[0].name} is the maintenance DAG's id of "
                f"{maintenance[job].name}: one DAG per id"
            )
    return problems


def raise_for_pipeline_problems(directory: str | Path) -> None:
    """Fail (an import error of the calling DAG file, which has no DAGs) when the directory's
    specs do not make one DAG each."""
    problems = pipeline_problems(directory)
    if problems:
        raise PipelineSetError("\n".join(problems))


def sync_dag_files(directory: str | Path) -> tuple[list[Path], list[Path]]:
    """Write the DAG file of every spec that has none; delete unchanged generated DAG files whose
    spec is gone. Returns (written, deleted)."""
    directory = Path(directory)
    written = []
    for path in spec_files(directory):
        dag_file = path.with_suffix(".py")
        if not dag_file.exists():
            dag_file.write_text(DAG_FILE)
            written.append(dag_file)
    deleted = []
    for dag_file in sorted(directory.glob("*.py")):
        if not dag_file.with_suffix(SPEC_SUFFIX).exists() and dag_file.read_text() == DAG_FILE:
            dag_file.unlink()
            deleted.append(dag_file)
    return written, deleted


def main(argv: list[str] | None = None) -> int:
    """``python -m checkpointing_airflow.dag_files sync|check DIR``."""
    parser = argparse.ArgumentParser(prog="python -m checkpointing_airflow.dag_files")
    parser.add_argument("command", choices=["sync", "check"])
    parser.add_argument("directory", type=Path, nargs="?", default=Path("dags/pipelines"))
    args = parser.parse_args(argv)
    if args.command == "sync":
        written, deleted = sync_dag_files(args.directory)
        for path in written:
            print(f"wrote {path}")
        for path in deleted:
            print(f"deleted {path} (its spec is gone)")
    problems = pipeline_problems(args.directory)
    for spec in spec_files(args.directory):
        try:
            job = load_spec(spec).job
        except SpecError as exc:
            problems.append(str(exc))
            continue
        print(f"ok {spec.name}: DAG {job}")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
