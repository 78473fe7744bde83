"""The README's first screen shows the step API's before and after on a real job: its "after" is
the code of ``examples/steps/daily_revenue.py`` (which the Airflow tests run), and its "before"
is that code with ``ck`` taken out, so "a handful of changed lines" is what a user changes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
EXAMPLE = ROOT / "examples" / "steps" / "daily_revenue.py"


def first_screen_blocks() -> tuple[str, str]:
    """The before and after Python blocks of the README's first table."""
    table = README.read_text().split("<table>", 1)[1].split("</table>", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", table, re.S)
    assert len(blocks) == 2, "the README's first table holds a before and an after block"
    return blocks[0], blocks[1]


def dumps(statements: list[ast.stmt]) -> list[str]:
    return [ast.dump(s) for s in statements]


class WithoutCk(ast.NodeTransformer):
    """The job as it was before ``ck``: ``ck.step(name, lambda: df)`` is ``df``,
    ``ck.write(df, out)`` is ``df.write.parquet(out)``, the ``with checkpointed`` block its
    body."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "ck":
            if f.attr == "step":
                body = node.args[1]
                assert isinstance(body, ast.Lambda)
                return body.body
            if f.attr == "write":
                df, out = node.args
                write = ast.Attribute(value=df, attr="write", ctx=ast.Load())
                return ast.Call(
                    func=ast.Attribute(value=write, attr="parquet", ctx=ast.Load()),
                    args=[out],
                    keywords=[],
                )
        return node


def without_ck(statements: list[ast.stmt]) -> list[ast.stmt]:
    plain: list[ast.stmt] = []
    for s in statements:
        if isinstance(s, ast.With):
            plain += [WithoutCk().visit(b) for b in s.body]
        else:
            plain.append(s)
    return plain


def test_the_readme_after_is_the_example_and_its_before_the_same_without_ck() -> None:
    before, after = first_screen_blocks()
    after_body = ast.parse(after).body
    example = next(
        f for f in ast.parse(EXAMPLE.read_text()).body
        if isinstance(f, ast.FunctionDef) and f.name == "main"
    )  # fmt: skip
    lines = dumps(example.body)
    # every statement of the README's after is the example's, in the example's order
    at = [lines.index(d) for d in dumps(after_body)]
    assert at == sorted(at), "the README's after is not in the example's order"
    assert any(isinstance(s, ast.With) for s in after_body)
    # its before is the same job with ck taken out, statement for statement
    assert dumps(ast.parse(before).body) == dumps(without_ck(after_body))
    # what a user changes: the with line, and each step's call wrapped around its expression
    changed = [ln for ln in after.splitlines() if "ck" in ln or "checkpointed" in ln]
    assert len(changed) <= 6, changed


def test_a_readme_after_that_drifts_from_the_example_fails() -> None:
    """The check has teeth: a step computed differently in the README is refused."""
    _, after = first_screen_blocks()
    drifted = after.replace('F.sum("amount")', 'F.max("amount")')
    assert drifted != after
    example = next(
        f for f in ast.parse(EXAMPLE.read_text()).body
        if isinstance(f, ast.FunctionDef) and f.name == "main"
    )  # fmt: skip
    lines = dumps(example.body)
    assert any(d not in lines for d in dumps(ast.parse(drifted).body))
