"""The package's import graph follows the layer order written in docs/architecture.md.

Every ``import dualseg.X`` / ``from dualseg.X import ...`` in ``src/dualseg`` (also inside
functions) is read with ``ast``; a module may import its own layer or the layers below, never
one above. The layer table is parsed from the docs, so the picture and the code cannot drift.
Deprecated alias modules (``SHIMS``) re-export a moved command and are exempt.
"""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "dualseg"
DOC = ROOT / "docs" / "architecture.md"

# old module path -> new one (kept for one release; each warns on import)
SHIMS = {
    "dualseg.engine.cli": "dualseg.commands.train",
    "dualseg.engine.cli_eval": "dualseg.commands.eval",
    "dualseg.engine.cli_predict": "dualseg.commands.predict",
    "dualseg.engine.demo": "dualseg.commands.demo",
    "dualseg.export.cli": "dualseg.commands.export",
    "dualseg.serve.cli": "dualseg.commands.serve",
    "dualseg.data.cli": "dualseg.commands.data",
}
HELPERS = {"dualseg._deprecated"}  # what the shims share
# deprecated aliases inside a library module: (module, imported module) -> why
ALLOWED: dict[tuple[str, str], str] = {}


def layer_table() -> dict[str, int]:
    """``{top-level part: layer}`` from the docs' ```layers``` block (higher imports lower)."""
    block = re.search(r"```text layers\n(.*?)```", DOC.read_text(), re.S)
    assert block, "docs/architecture.md lost its ```text layers block"
    table: dict[str, int] = {}
    for line in block.group(1).splitlines():
        m = re.match(r"\s*(\d+)\s+(.*)", line)
        if m:
            for token in m.group(2).split():  # "engine/" or "io.py"; prose is skipped
                part = re.fullmatch(r"(\w+)(?:/|\.py)", token)
                if part:
                    table[part.group(1)] = int(m.group(1))
    return table


def part_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "dualseg":  # from dualseg import x: x may be a subpackage
                out += [(node.lineno, f"dualseg.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, node.module))
    return [(n, m) for n, m in out if m == "dualseg" or m.startswith("dualseg.")]


def modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
        found.append((name, path))
    return found


def test_every_part_of_the_package_has_a_layer():
    table = layer_table()
    parts = {part_of(name) for name, _ in modules()}
    assert parts - set(table) == set(), "add these to the layers block of docs/architecture.md"


def test_no_import_reaches_up_a_layer():
    table = layer_table()
    bad = []
    for name, path in modules():
        if name in SHIMS or name in HELPERS:
            continue
        own = table[part_of(name)]
        for lineno, target in imports(path):
            if (name, target) in ALLOWED:
                continue
            if table.get(part_of(target), -1) > own:
                bad.append(f"{path.relative_to(ROOT)}:{lineno} ({name}) imports {target}")
    assert bad == []


def test_the_layer_check_sees_an_upward_import(tmp_path):
    # the walk must catch imports inside functions and "from dualseg import x"
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from dualseg.commands import refine\nfrom dualseg import refine\n")
    assert sorted(m for _, m in imports(f)) == ["dualseg.commands", "dualseg.refine"]


@pytest.mark.parametrize("old", sorted(SHIMS))
def test_old_command_paths_warn_and_reexport(old):
    import importlib
    import sys

    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    new = importlib.import_module(SHIMS[old])
    assert any(
        issubclass(w.category, DeprecationWarning) and SHIMS[old] in str(w.message) for w in caught
    )
    assert module.main is new.main
    for name in dir(new):  # everything the command module has, the old path still has
        if not name.startswith("__"):
            assert getattr(module, name) is getattr(new, name)
