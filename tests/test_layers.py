"""The package layout of docs/architecture.md, held by the code: every import (module-level or
function-local) points down the layers, the plugin imports no Spark module, and the core's top
level stays small. Static: it parses the files and runs none of them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "checkpointing"
PLUGIN = ROOT / "plugins" / "checkpointing_airflow"

#: low to high; a module may import its own layer or a lower one
LAYERS = [
    "base",  # checkpointing/*.py: errors, ids, clock, config, status
    "state",
    "sinks",
    "pipeline",
    "metastore",
    "coordination",
    "restore",
    "steps",
    "spark",
    "cli",
]
#: what only some layers may import (the core stays free of the frameworks around it)
FRAMEWORKS = {
    "airflow": set(),
    "pyspark": {"spark"},
    "rich": {"cli"},
    "typer": {"cli"},
}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "checkpointing":
        return None
    if len(parts) == 1 or (CORE / parts[1]).with_suffix(".py").is_file():
        return "base"
    return parts[1]


def _module_name(path: Path, root: Path, top: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([top, *parts])


def _type_checking_lines(tree: ast.Module) -> set[int]:
    """The lines of ``if TYPE_CHECKING:`` blocks: imports for annotations, never run."""
    return {
        line
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)
    }


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) of every import in ``path``, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return found


def _core_files() -> list[Path]:
    return sorted(p for p in CORE.rglob("*.py") if "migrations" not in p.parts)


@pytest.mark.parametrize("path", _core_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_core_import_points_down_the_layers(path: Path) -> None:
    module = _module_name(path, CORE, "checkpointing")
    own = _layer(module)
    assert own in LAYERS, f"{path.relative_to(ROOT)}: in no layer of docs/architecture.md"
    annotations_only = _type_checking_lines(ast.parse(path.read_text()))
    wrong = []
    for line, target in _imports(path, module):
        layer = _layer(target)
        if layer is not None and layer in LAYERS and LAYERS.index(layer) > LAYERS.index(own):
            wrong.append(f"line {line}: {own} imports {target} ({layer})")
        framework = target.split(".")[0]
        if (
            framework in FRAMEWORKS
            and own not in FRAMEWORKS[framework]
            and line not in annotations_only
        ):
            wrong.append(f"line {line}: {own} imports {framework}")
    assert not wrong, f"{path.relative_to(ROOT)}: " + "; ".join(wrong)


def test_the_plugin_imports_no_spark_module() -> None:
    wrong = [
        f"{path.relative_to(ROOT)} line {line}: {target}"
        for path in sorted(PLUGIN.rglob("*.py"))
        for line, target in _imports(path, _module_name(path, PLUGIN, "checkpointing_airflow"))
        if target.startswith(("checkpointing.spark", "checkpointing.cli", "pyspark"))
    ]
    assert not wrong, wrong


def test_the_core_top_level_holds_few_modules_and_each_package_says_what_it_is() -> None:
    top = sorted(p.name for p in CORE.glob("*.py"))
    assert len(top) <= 8, top
    for package in (p for p in CORE.iterdir() if (p / "__init__.py").is_file()):
        if package.name == "migrations":
            continue
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert doc, f"{package.relative_to(ROOT)}/__init__.py has no docstring"
