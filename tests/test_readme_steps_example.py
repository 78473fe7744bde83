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


def example_main() -> list[str]:
    """The statements of ``examples/steps/daily_revenue.py``'s ``main``, dumped."""
    main = next(
        f for f in ast.parse(EXAMPLE.read_text()).body
        if isinstance(f, ast.FunctionDef) and f.name == "main"
    )  # fmt: skip
    return dumps(main.body)


def problems(before: str, after: str, example: list[str]) -> list[str]:
    """What is wrong with a before/after pair against the example's statements (empty: all
    good)."""
    found = []
    after_body = ast.parse(after).body
    missing = [d for d in dumps(after_body) if d not in example]
    if missing:
        found.append(f"{len(missing)} statement(s) of the after are not the example's")
    else:
        at = [example.index(d) for d in dumps(after_body)]
        if at != sorted(at):
            found.append("the after is not in the example's order")
    if not any(isinstance(s, ast.With) for s in after_body):
        found.append("the after has no `with checkpointed(...)` block")
    if dumps(ast.parse(before).body) != dumps(without_ck(after_body)):
        found.append("the before is not the after with ck taken out")
    changed = [ln for ln in after.splitlines() if "ck" in ln or "checkpointed" in ln]
    if len(changed) > 6:
        found.append(f"{len(changed)} lines changed, more than a handful")
    return found


def test_the_readme_after_is_the_example_and_its_before_the_same_without_ck() -> None:
    before, after = first_screen_blocks()
    assert problems(before, after, example_main()) == []


def test_a_readme_pair_that_drifts_from_the_example_fails() -> None:
    """The check has teeth: a step computed differently, steps out of order, or a before that
    is not the after without ck, is each refused."""
    before, after = first_screen_blocks()
    example = example_main()
    drifted = after.replace('F.sum("amount")', 'F.max("amount")')
    assert drifted != after and problems(before, drifted, example)
    lines = after.splitlines()
    first_read, second_read = lines[0], lines[1]
    assert first_read.startswith("orders") and second_read.startswith("customers")
    swapped = "\n".join([second_read, first_read, *lines[2:]])
    assert "order" in " ".join(problems(before, swapped, example))
    other_before = before.replace("ranked.write.parquet(out)", "ranked.write.csv(out)")
    assert other_before != before
    assert "ck taken out" in " ".join(problems(other_before, after, example))
