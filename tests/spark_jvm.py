"""The JVM options of every Spark driver the tests start: C1 only, and Spark's classes from a
class-data-sharing archive (AppCDS) made once by a warm-up run of the pipeline.

The suite starts dozens of short-lived driver JVMs (``ckpt run``, ``spark-submit`` from Airflow,
the demo, the cluster tests' drivers); each spends most of its CPU loading, verifying and
compiling Spark's classes. Java 17 dumps the classes a JVM loaded into an archive at its exit
(``-XX:ArchiveClassesAtExit``); later JVMs with the same class path map them instead
(``-XX:SharedArchiveFile``): about half a driver's start-up CPU on this 2-core machine. A JVM whose
class path differs (e.g. another ``SPARK_CONF_DIR``) runs as before, silently.

The options reach every driver through ``SPARK_SUBMIT_OPTS`` (read by ``spark-submit`` for the
driver JVM in client mode), which every process the tests start inherits. Tests only: the
product's defaults never set them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

#: C1 only: in JVMs this short-lived, C2's compiles cost more CPU than the pipeline itself.
#: C1 alone shrinks the default code cache to 48 MB, which a test process's shared session
#: (hundreds of tests' generated code) filled: "Out of space in CodeCache for adapters" killed
#: its SparkContext mid-suite. Reserved, not committed: the pages are used only when filled.
C1_ONLY = "-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=256m"
#: a JVM that cannot use the archive (another class path, another JDK) says so on its stdout,
#: which is the pipeline's: not a word (it then runs as without one)
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"
#: how long the warm-up run may take (a loaded machine)
WARM_UP_TIMEOUT_S = 600


def pyspark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def java_binary() -> Path | None:
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    return Path(found).resolve() if found else None


def archive_key() -> str:
    """What an archive is valid for: this JDK and this pyspark's jars (names, sizes, mtimes),
    as the JVM checks them."""
    java = java_binary()
    jars = sorted((pyspark_home() / "jars").glob("*.jar"))
    parts = [str(java), str(java.stat().st_mtime_ns) if java else ""]
    parts += [f"{j.name}:{j.stat().st_size}:{j.stat().st_mtime_ns}" for j in jars]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def driver_java_options(archive: Path | None) -> str:
    """The drivers' options: C1 only, and the archive when there is one (never a missing
    file: the JVM would then lose the JDK's own archive too)."""
    if archive is None or not archive.is_file():
        return C1_ONLY
    return f"{C1_ONLY} -XX:SharedArchiveFile={archive} {QUIET}"


def ensure_archive(cache_dir: Path) -> Path | None:
    """The archive for this JDK and pyspark in ``cache_dir``, made now by a warm-up run if
    missing (about a minute on an idle 2-core machine; kept for later sessions); None if it
    could not be made or another session is making it (the tests then run without it)."""
    if java_binary() is None:
        return None
    archive = cache_dir / f"spark-{archive_key()}.jsa"
    if archive.is_file():
        return archive
    cache_dir.mkdir(parents=True, exist_ok=True)
    with (cache_dir / "lock").open("w") as lock:
        try:  # another session is making it: this one runs without, rather than wait
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        return archive if archive.is_file() else _make_archive(cache_dir, archive)


def _make_archive(cache_dir: Path, archive: Path) -> Path | None:
    work = Path(tempfile.mkdtemp(prefix="ckpt-tests-cds-", dir=cache_dir))
    try:
        partial = work / "spark.jsa"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPT_", "SPARK_"))}
        env["PYSPARK_SUBMIT_ARGS"] = (
            f"--driver-java-options '{C1_ONLY} -XX:ArchiveClassesAtExit={partial} {QUIET}' "
            "pyspark-shell"
        )
        repo = Path(__file__).resolve().parent.parent
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(
                [sys.executable, "-m", "tests.spark_jvm", str(work)],
                cwd=repo,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=WARM_UP_TIMEOUT_S,
                check=False,
            )
        if not partial.is_file() or not (work / "done.json").is_file():
            return None
        os.replace(partial, archive)  # whole, or not at all: other sessions may read it now
        return archive
    finally:
        shutil.rmtree(work, ignore_errors=True)


def warm_up(work: Path) -> None:
    """A short run of the runtime's pipeline (Parquet in, keyed aggregations with state
    snapshots, a changelog sink), so that the archive holds the classes a test's driver
    loads; then the JVM is made to exit and waited for, which writes the archive."""
    from pyspark import SparkContext

    from checkpointing.metastore.engine import Metastore
    from checkpointing.pipeline import datasets
    from checkpointing.spark.session import spark_session
    from checkpointing.state.storage import FileSystemCheckpointStorage
    from tests.spark_pipeline import events_spec, run

    events = work / "events"
    datasets.generate_events(events, events=600, keys=30, files=3, seed=1)
    url = f"sqlite:///{work / 'metastore.db'}"
    Metastore(url, check_schema=False).upgrade()
    spark = spark_session("ckpt-tests-warm-up")
    spark.conf.set("spark.sql.shuffle.partitions", "4")
    storage = FileSystemCheckpointStorage(f"file://{work / 'checkpoints'}")
    result = run(spark, events_spec(work, events, "warm-up"), Metastore(url), storage)
    jvm = SparkContext._gateway.proc  # type: ignore[union-attr]
    spark.stop()
    jvm.stdin.close()  # the gateway exits on its stdin's end: then the JVM dumps the archive
    jvm.wait(timeout=WARM_UP_TIMEOUT_S)
    (work / "done.json").write_text(json.dumps({"epochs": result.epochs_run}))


if __name__ == "__main__":
    warm_up(Path(sys.argv[1]))
