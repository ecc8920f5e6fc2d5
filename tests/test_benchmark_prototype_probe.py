"""benchmarks/prototype_probe.py: a user error is one line, not a traceback."""

from __future__ import annotations

from pathlib import Path

from benchmark_helpers import run_script


def test_a_missing_refiner_is_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    argv = ["--fit", "f.txt", "--eval", "e.txt", "--base", "b.pt",
            "--refiner", str(tmp_path / "nothing.pt")]  # fmt: skip
    assert run_script("prototype_probe", argv, monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: refiner not found: ") and len(err.splitlines()) == 1
