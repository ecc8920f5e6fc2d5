"""Helpers of the benchmark tests: a script of ``benchmarks/`` imported as a module."""

from __future__ import annotations

import importlib
import runpy
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as module ``name`` (the folder is no package; its scripts
    import their siblings, such as ``camvid_protocols``, by plain name)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def run_script(name: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> object:
    """Run ``benchmarks/<name>.py`` as a script with ``argv``; the code it exits with (it must
    exit)."""
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *argv])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(BENCHMARKS / f"{name}.py"), run_name="__main__")
    return stop.value.code
