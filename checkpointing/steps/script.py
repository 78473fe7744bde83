"""Run a user's PySpark script under the job's settings: what ``ckpt run script.py`` does for a
job whose steps are checkpointed (:func:`checkpointing.spark.steps.checkpointed`).

The script is the user's own, run as ``python script.py args`` would run it (``__main__``, its
``sys.argv``, its folder first on ``sys.path``), with the metastore and checkpoint storage of
``settings`` in the environment, where ``checkpointed(spark, job=...)`` finds them, and the
run's ``--restore`` (``latest`` or ``none``) in :data:`ENV_RESTORE`, the default of
``checkpointed``'s ``restore``. Nothing is imported from Spark here: the script builds its own
session.

Deployed by the Airflow operator (``CheckpointedSparkSubmitOperator(application=..., job=...)``),
the driver's environment also names the job the task was declared for (:data:`ENV_JOB`):
:func:`check_job` refuses a script whose ``checkpointed(spark, job=...)`` names another one, so
that the task's Checkpoints page, metrics and retries never watch a job the script does not run.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path

from checkpointing.config import ENV_METASTORE_URL, ENV_STORAGE_URL, Settings
from checkpointing.errors import ConfigError
from checkpointing.metastore.engine import Metastore

#: ``checkpointed``'s ``restore`` when its caller gives none: set by ``ckpt run script.py``
ENV_RESTORE = "CKPT_RESTORE"
#: what a script's run may restore by name: its latest checkpoint, or nothing (else a
#: savepoint's path, :func:`check_restore`)
RESTORES = ("latest", "none")
#: the job the deploying task declared (``job=`` of the Airflow operator), set in the driver
ENV_JOB = "CKPT_JOB"
#: the coordinator id the deploying task named for this try
#: (:func:`checkpointing.coordination.attempt.name_successor`): the script's ``checkpointed``
#: acts under it, and is refused once a later try named another
ENV_COORDINATOR = "CKPT_COORDINATOR_ID"
#: a script's run refused for its configuration (a bad step, restore or job; sysexits'
#: ``EX_CONFIG``): the driver exits with it, and the Airflow task fails without a retry, which
#: would be refused the same way
EXIT_REFUSED = 78
#: the job row's failure cause, before the refusal's own line, when a script's run was refused
#: for its configuration: a deferred try sees the job row, not the driver's exit code
REFUSED_CAUSE = "refused for its configuration"


def is_refusal(exc: BaseException | None) -> bool:
    """Whether ``exc`` refuses the script's configuration, which a retry would meet again (exit
    :data:`EXIT_REFUSED`, no retry): a ``ConfigError`` or an invalid id, but not an object
    store that could not be reached or refused access (``ObjectStoreError``), which a retry may
    get past."""
    from checkpointing.errors import InvalidIdError
    from checkpointing.state.buckets import ObjectStoreError

    return isinstance(exc, ConfigError | InvalidIdError) and not isinstance(exc, ObjectStoreError)


def refusal_cause(exc: BaseException | None) -> str | None:
    """The job row's failure cause for a run that ``exc`` ended: :data:`REFUSED_CAUSE` and the
    refusal for a refusal, else None."""
    return f"{REFUSED_CAUSE}: {exc}" if is_refusal(exc) else None


def expected_job() -> str | None:
    """The job the deploying task declared for this script (:data:`ENV_JOB`), None when the
    script runs on its own (``python job.py``, ``ckpt run job.py``)."""
    return os.environ.get(ENV_JOB) or None


def check_job(job: str) -> None:
    """Refuse, in one line naming both, a ``checkpointed(spark, job=...)`` whose job is not the
    one the deploying task declared: its checkpoints would be another job's than the task's
    retries restore and its page shows."""
    declared = expected_job()
    if declared is not None and declared != job:
        raise ConfigError(
            f"job {job!r}: the script's checkpointed(spark, job={job!r}) is not the task's "
            f"job={declared!r} ({ENV_JOB}); make them equal"
        )


def check_script(path: str | Path) -> Path:
    """The script's path, or one line naming it: a readable ``.py`` file."""
    script = Path(path)
    if script.suffix != ".py":
        raise ConfigError(f"script {script}: not a Python file (.py)")
    if not script.is_file():
        raise ConfigError(f"script {script}: no such file")
    return script.resolve()


def check_restore(restore: str) -> str:
    """A script's ``--restore``: ``latest``, ``none``, or a savepoint's path (its directory or
    its ``_metadata``; a local one made absolute, and it must hold a ``_metadata``; a URL of
    other storage is read when the run restores it), else one line naming it. Nothing is
    written here: the job's own check (another job's savepoint is refused) is the run's."""
    from checkpointing.state.storage import METADATA_FILE

    if restore in RESTORES:
        return restore
    local = restore.removeprefix("file://") if restore.startswith("file:///") else None
    if local is None and "://" in restore:
        return restore.rstrip("/")
    path = Path(os.path.abspath(os.path.expanduser(local if local is not None else restore)))
    metadata = path if path.name == METADATA_FILE else path / METADATA_FILE
    if not metadata.is_file():
        raise ConfigError(
            f"--restore {restore!r}: not 'latest' (the job's latest checkpoint), 'none' (start "
            f"over) or a savepoint's directory (no {metadata})"
        )
    return str(metadata.parent)


def run_script(
    path: str | Path,
    args: Sequence[str] = (),
    settings: Settings | None = None,
    *,
    restore: str = "latest",
) -> int:
    """Run the script at ``path`` with ``args``; its exit code (0 when it returns). The
    embedded metastore's schema is created first (as ``ckpt run`` does for a spec)."""
    script = check_script(path)
    check_restore(restore)
    settings = settings or Settings.resolve()
    if settings.embedded_metastore:
        settings.home.mkdir(parents=True, exist_ok=True)
        created = Metastore(settings.metastore_url, check_schema=False)
        created.ensure_schema()
        created.dispose()
    saved_env = {k: os.environ.get(k) for k in (ENV_METASTORE_URL, ENV_STORAGE_URL, ENV_RESTORE)}
    saved_argv, saved_path = sys.argv, list(sys.path)
    os.environ[ENV_METASTORE_URL] = settings.metastore_url
    os.environ[ENV_STORAGE_URL] = settings.storage_url
    os.environ[ENV_RESTORE] = restore
    sys.argv = [str(script), *args]
    sys.path.insert(0, str(script.parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return 0
