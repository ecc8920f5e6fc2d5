"""A missing package of the ``export`` extra is one line naming the extra, before any work."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from PIL import Image

from dualseg.cli import main

HINT = "pip install 'dualseg[export]'"


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("missing", ["onnx", "onnxruntime"])
def test_export_without_onnx_packages_names_the_extra_and_writes_nothing(
    checkpoint, tmp_path, capsys, monkeypatch, missing
):
    monkeypatch.setitem(sys.modules, missing, None)  # as if it were not installed
    out = tmp_path / "model.onnx"
    assert main(["export", "-c", str(checkpoint), "--format", "onnx", "-o", str(out)]) == 1
    line = _one_line(capsys.readouterr().err)
    assert f"{missing!r} is not installed" in line and HINT in line
    assert list(tmp_path.iterdir()) == []


def test_export_without_onnxruntime_still_works_with_no_verify(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    out = tmp_path / "model.onnx"
    args = ["export", "-c", str(checkpoint), "-o", str(out), "--size", "32", "32", "--no-verify"]
    assert main(args) == 0 and out.stat().st_size > 0


def test_predict_onnx_without_onnxruntime_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    image = tmp_path / "x.png"
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(image)
    model = tmp_path / "model.onnx"
    model.write_bytes(b"onnx bytes are never read: onnxruntime is missing")
    out = tmp_path / "out"
    assert main(["predict", str(image), "--onnx", str(model), "-o", str(out)]) == 1
    line = _one_line(capsys.readouterr().err)
    assert "'onnxruntime' is not installed" in line and HINT in line
    assert not out.exists()
