"""The browser tests' Chromium: Debian's (Playwright's own browser download is not used), at
``CKPT_TEST_CHROMIUM``; a test module without it, or without Playwright's package, is skipped
(which fails ``make test``: tests/conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest

CHROMIUM = Path(os.environ.get("CKPT_TEST_CHROMIUM", "/usr/bin/chromium"))


def playwright_or_skip() -> ModuleType:
    """``playwright.sync_api``; the calling module skipped when Chromium or it is missing."""
    if not CHROMIUM.exists():
        pytest.skip(
            f"the browser test needs Debian's Chromium at {CHROMIUM}: install it with "
            "`apt-get install chromium` as root (make test does when it can)",
            allow_module_level=True,
        )
    return pytest.importorskip(
        "playwright.sync_api", reason="needs Playwright's Python package: run `uv sync`"
    )
