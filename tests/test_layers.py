"""The package's import graph follows the layer order written in docs/architecture.md.

Every ``import dualseg.X`` / ``from dualseg.X import ...`` in ``src/dualseg`` (inside functions
and ``TYPE_CHECKING`` blocks too) is read with ``ast``: a module imports its own layer or the
layers below, never one above; the modules import no cycle; an import inside a function is for
an optional extra only. The layer table is parsed from the docs, so picture and code agree.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "dualseg"
DOC = ROOT / "docs" / "architecture.md"

# what a function may import: extras that are optional (or heavy) and absent from a plain install
OPTIONAL_EXTRAS = {
    "onnx",
    "onnxruntime",
    "onnxscript",
    "fastapi",
    "uvicorn",
    "starlette",
    "timm",
    "tensorboard",
    "huggingface_hub",
    "playwright",
    "pydensecrf",
    "pydensecrf2",
    "segmentation_models_pytorch",
    "matplotlib",
    "tifffile",
}
# leaves the torch-free runtime (onnxruntime) imports: torch only inside what saves or loads it
TORCH_FREE = {"dualseg.io", "dualseg.serialization"}
# (module, imported module) -> why an upward import is tolerated; empty is the goal
ALLOWED: dict[tuple[str, str], str] = {}
# modules reached only through torch that a function may import: tensorboard is an extra
OPTIONAL_SUBMODULES = ("torch.utils.tensorboard",)
# (module, imported module or package) -> why a function imports it instead of the module top:
# the module stays importable without torch (or without an extra) and pays only when used
LAZY: dict[tuple[str, str], str] = {
    ("dualseg.commands.serve", "dualseg.serve.app"): "imports fastapi; its absence is one line",
    ("dualseg.engine.options", "dualseg.data"): "dualseg.data imports torch; config must not",
    ("dualseg.export.runners", "torch"): "torch only for a TorchScript file; ONNX is torch-free",
    ("dualseg.export.runners", "dualseg.engine.predict"): "imports torch; only for a tensor",
    ("dualseg.export.runtime", "dualseg.refine"): "imports torch; only for a refiner file",
    ("dualseg.export.runtime", "dualseg.data"): "imports torch; only for the label contract",
    ("dualseg.export.runtime", "dualseg.export.exported_refiner"): "imports torch (refine/); "
    "the ONNX segmenter path is torch-free",
}


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


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = path
    return found


def all_imports(path: Path) -> list[tuple[int, str, bool]]:
    """``(line, module, inside a function)`` for every absolute import in ``path``; ``from
    dualseg.x import y`` names ``dualseg.x.y`` (y may be a module; :func:`resolve` decides)."""
    out: list[tuple[int, str, bool]] = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import):
                out.extend((child.lineno, a.name, local) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                out.extend((child.lineno, f"{child.module}.{a.name}", local) for a in child.names)
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return out


def imports(path: Path) -> list[tuple[int, str]]:
    """The dualseg modules ``path`` imports: ``(line, module)``."""
    known = modules()
    return [
        (n, resolve(m, known))
        for n, m, _ in all_imports(path)
        if m == "dualseg" or m.startswith("dualseg.")
    ]


def resolve(name: str, known: dict[str, Path] | None = None) -> str:
    """The module ``name`` is, or the one it is an attribute of (``dualseg.models.build_model``
    -> ``dualseg.models``)."""
    known = modules() if known is None else known
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {m for _, m in imports(path)} - {name} for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(found)


def test_every_part_of_the_package_has_a_layer():
    table = layer_table()
    parts = {part_of(name) for name in modules()}
    assert parts - set(table) == set(), "add these to the layers block of docs/architecture.md"


def test_no_import_reaches_up_a_layer():
    table = layer_table()
    bad = []
    for name, path in modules().items():
        own = table[part_of(name)]
        for lineno, target in imports(path):
            if (name, target) not in ALLOWED and table.get(part_of(target), -1) > own:
                bad.append(f"{path.relative_to(ROOT)}:{lineno} ({name}) imports {target}")
    assert bad == []


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def may_import_locally(name: str, module: str) -> bool:
    """Whether a function of module ``name`` may import ``module``."""
    return (
        module.split(".")[0] in OPTIONAL_EXTRAS
        or any(within(module, extra) for extra in OPTIONAL_SUBMODULES)
        or (name in TORCH_FREE and within(module, "torch"))
        or any(name == owner and within(module, lazy) for owner, lazy in LAZY)
    )


def test_function_local_imports_are_for_optional_extras_only():
    bad = [
        f"{path.relative_to(ROOT)}:{lineno} imports {module}"
        for name, path in modules().items()
        for lineno, module, local in all_imports(path)
        if local and not may_import_locally(name, module)
    ]
    assert not bad, "function-local imports of non-optional modules:\n" + "\n".join(bad)


def test_the_walk_sees_local_upward_imports_and_cycles(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from dualseg.engine import train\n"
        "def f():\n    from dualseg.commands import refine\n    import onnx\n"
        "from dualseg import models\nfrom dualseg.models import build_model\n"
    )
    found = {(m, local) for _, m, local in all_imports(f)}
    assert found >= {
        ("dualseg.engine.train", False),
        ("dualseg.commands.refine", True),
        ("onnx", True),
        ("dualseg.models", False),
        ("dualseg.models.build_model", False),
    }
    assert sorted(m for _, m in imports(f)) == [
        "dualseg.commands.refine",
        "dualseg.engine.train",
        "dualseg.models",
        "dualseg.models",
    ]
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_lazy_import_listed_is_still_there():
    found = modules()
    used = {
        (owner, lazy)
        for owner, lazy in LAZY
        for _, module, local in all_imports(found[owner])
        if local and within(module, lazy)
    }
    assert set(LAZY) - used == set(), "drop these stale entries from LAZY"
