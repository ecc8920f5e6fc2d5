"""Helpers of the benchmark tests: a script of ``benchmarks/`` imported as a module."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (the folder is no package), as ``bench_<name>``."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
