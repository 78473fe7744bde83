"""The Spark application the operator submits, for a spec and for a user's script alike."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def spark_application() -> str:
    """The file spark-submit runs: ``checkpointing/cli/spark_app.py`` of the installed package
    (the ``ckpt`` command line; a file path, so the plugin imports no Spark module for it)."""
    spec = importlib.util.find_spec("checkpointing")
    assert spec is not None and spec.submodule_search_locations
    return str(Path(next(iter(spec.submodule_search_locations))) / "cli" / "spark_app.py")
