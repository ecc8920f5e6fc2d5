"""benchmarks/prototype_probe.py: a user error is one line, not a traceback."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

from benchmark_helpers import BENCHMARKS


def test_a_missing_refiner_is_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    argv = ["--fit", "f.txt", "--eval", "e.txt", "--base", "b.pt",
            "--refiner", str(tmp_path / "nothing.pt")]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["prototype_probe.py", *argv])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(BENCHMARKS / "prototype_probe.py"), run_name="__main__")
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: refiner not found: ") and len(err.splitlines()) == 1
