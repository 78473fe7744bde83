"""The example pipeline package of the entry-point tests (``ckpt_example``, imported by specs'
``pipeline:`` and ``transform:``), and :func:`package_zip` to ship it as ``py_files``."""

from __future__ import annotations

import zipfile
from pathlib import Path

PACKAGE = Path(__file__).parent / "ckpt_example"


def package_zip(directory: Path) -> Path:
    """The example package as ``directory/ckpt_example.zip`` (what a team ships with
    ``--py-files``; the directory holding it is never on ``sys.path`` itself)."""
    path = directory / "ckpt_example.zip"
    with zipfile.ZipFile(path, "w") as archive:
        for source in sorted(PACKAGE.glob("*.py")):
            archive.write(source, f"ckpt_example/{source.name}")
    return path
