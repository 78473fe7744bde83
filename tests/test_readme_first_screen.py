# ruff: noqa: RUF001  (Markdown: the multiplication sign is meant)
"""The README's first screen answers, in order, what the project does, when to use it (and what
it costs), what a job looks like before and after, and how to install it: README.md rendered as
Markdown in a GitHub-like page, opened in a real Chromium at 1280x900, each answer's text inside
that one viewport and below the previous answer's.

``CKPT_WRITE_README_SCREENSHOT=1`` (``make readme-screenshot``) writes the viewport to
``docs/images/readme-first-screen.png``; otherwise it goes to the test's tmp dir.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from markdown_it import MarkdownIt

from tests.browser import playwright_or_skip

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SCREENSHOT = ROOT / "docs" / "images" / "readme-first-screen.png"
WIDTH, HEIGHT = 1280, 900

playwright_api = playwright_or_skip()

#: github.com's README look, roughly (github-markdown-css): 16px text in a box of at most 980px
STYLE = """
body { margin: 0; background: #fff; color: #1f2328; }
.markdown-body { box-sizing: border-box; max-width: 980px; margin: 0 auto; padding: 32px;
  font-family: -apple-system, "Segoe UI", "Noto Sans", Helvetica, Arial, sans-serif;
  font-size: 16px; line-height: 1.5; word-wrap: break-word; }
.markdown-body > :first-child { margin-top: 0; }
.markdown-body p, .markdown-body ul, .markdown-body ol, .markdown-body table,
.markdown-body pre { margin-top: 0; margin-bottom: 16px; }
.markdown-body h1, .markdown-body h2 { margin: 24px 0 16px; font-weight: 600; line-height: 1.25;
  padding-bottom: .3em; border-bottom: 1px solid #d1d9e0; }
.markdown-body h1 { font-size: 2em; }
.markdown-body h2 { font-size: 1.5em; }
.markdown-body ul { padding-left: 2em; }
.markdown-body li + li { margin-top: .25em; }
.markdown-body a { color: #0969da; text-decoration: none; }
.markdown-body code { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas,
  "Liberation Mono", monospace; font-size: 85%; padding: .2em .4em; border-radius: 6px;
  background: rgba(129, 139, 152, .12); }
.markdown-body pre { padding: 16px; overflow: auto; font-size: 85%; line-height: 1.45;
  border-radius: 6px; background: #f6f8fa; }
.markdown-body pre code { font-size: 100%; padding: 0; background: transparent; }
.markdown-body table { border-spacing: 0; border-collapse: collapse; display: block;
  width: max-content; max-width: 100%; overflow: auto; }
.markdown-body th, .markdown-body td { padding: 6px 13px; border: 1px solid #d1d9e0;
  vertical-align: top; }
.markdown-body th { font-weight: 600; }
.markdown-body td > :last-child { margin-bottom: 0; }
"""

#: the four answers, in the order the first screen must give them; each is one or more texts
#: (a regular expression matched inside one text node) that must all be on the first screen
ANSWERS: list[tuple[str, list[str]]] = [
    ("what it does, in one sentence", [r"Flink-style checkpoints for long PySpark batch jobs"]),
    ("when to use it, when not, its cost", [r"Use it", r"just rerun", r"\d\.\d\d× W"]),
    (
        "your job before and after, and how it is deployed",
        [r"spark\.read\.parquet\(", r"ck\.step\(", r"CheckpointedSparkSubmitOperator\("],
    ),
    ("install: the two commands", [r"make demo", r"make test"]),
]

#: where (viewport coordinates) the first text-node match of each regular expression is drawn
LOCATE = """(patterns) => patterns.map((source) => {
  const re = new RegExp(source);
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const m = re.exec(node.data);
    if (!m) continue;
    const range = document.createRange();
    range.setStart(node, m.index);
    range.setEnd(node, m.index + m[0].length);
    const r = range.getBoundingClientRect();
    return {top: r.top, bottom: r.bottom, left: r.left, right: r.right};
  }
  return null;
})"""


def rendered(markdown: str) -> str:
    """The page github.com would show for this README, near enough: CommonMark with tables and
    raw HTML, in the stylesheet above."""
    md = MarkdownIt("commonmark", {"html": True}).enable(["table", "strikethrough"])
    return (
        '<!doctype html><html><head><meta charset="utf-8"><title>README</title>'
        f"<style>{STYLE}</style></head><body><article class='markdown-body'>"
        f"{md.render(markdown)}</article></body></html>"
    )


def first_screen(browser: Any, markdown: str, screenshot: Path | None = None) -> list[str]:
    """What the first 1280x900 screen of ``markdown`` fails to answer, or answers out of order
    (empty: all four, in order)."""
    page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
    try:
        page.set_content(rendered(markdown), wait_until="load")
        if screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=False)
        purpose = page.evaluate(
            "() => { const h = document.querySelector('h1'); "
            "const p = h && h.nextElementSibling; return p ? p.textContent : ''; }"
        )
        rects = [page.evaluate(LOCATE, patterns) for _, patterns in ANSWERS]
        # text past the README's box is cut off (a wide table scrolls sideways), not shown
        right = page.evaluate(
            "() => document.querySelector('article').getBoundingClientRect().right"
        )
    finally:
        page.close()
    problems = []
    text = " ".join(purpose.split())
    if not (text.endswith(".") and text.count(". ") == 0):
        problems.append(f"the paragraph under the title is not one sentence: {text!r}")
    previous: tuple[str, float] | None = None
    for (answer, patterns), found in zip(ANSWERS, rects, strict=True):
        tops = []
        for pattern, rect in zip(patterns, found, strict=True):
            if rect is None:
                problems.append(f"{answer}: no text matches {pattern!r}")
            elif rect["bottom"] > HEIGHT:
                problems.append(f"{answer}: {pattern!r} is below the first screen ({rect})")
            elif rect["right"] > min(right, WIDTH):
                problems.append(f"{answer}: {pattern!r} is cut off on the right ({rect})")
            else:
                tops.append(rect["top"])
        if not tops:
            continue
        if previous is not None and min(tops) <= previous[1]:
            problems.append(f"{answer} (y {min(tops):.0f}) is not below {previous[0]}")
        previous = (answer, max(tops))
    return problems


def test_readme_first_screen_answers_the_four_questions_in_order(
    browser: Any, tmp_path: Path
) -> None:
    write = os.environ.get("CKPT_WRITE_README_SCREENSHOT") == "1"
    shot = SCREENSHOT if write else tmp_path / SCREENSHOT.name
    problems = first_screen(browser, README.read_text(), shot)
    assert not problems, "README.md's first screen (1280x900):\n" + "\n".join(problems)
    assert shot.stat().st_size > 10_000  # a page was drawn, not a blank


def test_a_readme_whose_answers_are_pushed_down_or_reordered_fails(browser: Any) -> None:
    """The check has teeth: the same README with a long section before its answers, or with
    install above the use/don't-use answer, is refused."""
    text = README.read_text()
    title, rest = text.split("\n\n", 1)
    purpose, rest = rest.split("\n\n", 1)
    padded = f"{title}\n\n{purpose}\n\n" + "".join(f"Filler line {i}.\n\n" for i in range(20))
    problems = first_screen(browser, padded + rest)
    assert any("below the first screen" in p for p in problems), problems
    install = re.search(r"^\*\*Install\*\*.*?\n\n", rest, re.S | re.M)
    assert install, "no **Install** paragraph in README.md's first screen"
    swapped = rest.replace(install.group(0), "")
    problems = first_screen(browser, f"{title}\n\n{purpose}\n\n{install.group(0)}{swapped}")
    assert any(p.startswith("install: the two commands") for p in problems), problems
