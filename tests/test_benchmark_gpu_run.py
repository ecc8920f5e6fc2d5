"""benchmarks/gpu_run.py: an interrupted run is reported as what it trained, not as the whole
calibrated schedule, and a bad --data is one error before the GPU is calibrated."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmark_helpers import load_benchmark


@pytest.fixture(scope="module")
def gpu_run():
    return load_benchmark("gpu_run")


def test_an_interrupted_run_reports_the_iterations_it_trained(
    gpu_run, tmp_path: Path, monkeypatch
) -> None:
    data = tmp_path / "camvid"
    data.mkdir()
    for split in ("train", "val"):
        (data / f"{split}.txt").write_text("a.png b.png\n")
    out = tmp_path / "out"
    monkeypatch.setattr(gpu_run, "calibrate_iters", lambda cfg, minutes, device: (1000, 0.3))

    def fit(cfg, **kw):
        out.mkdir()
        return {"stop_reason": "interrupted", "iteration": 3, "signal": 15}

    monkeypatch.setattr(gpu_run, "fit", fit)
    clock = iter([100.0, 110.0])  # the training took 10 s
    monkeypatch.setattr(gpu_run, "time", SimpleNamespace(time=lambda: next(clock)))
    argv = ["--data", str(data), "--out", str(out), "--device", "cpu", "--batch-size", "2"]
    assert gpu_run.main(argv) == 143  # 128 + SIGTERM, as dualseg train
    report = json.loads((out / "gpu_run.json").read_text())
    assert report["iterations"] == 3 and report["planned_iterations"] == 1000
    assert report["stop_reason"] == "interrupted"
    assert report["train_seconds"] == 10.0 and report["train_images_per_s"] == 0.6  # 3 x 2 / 10
    assert "val_miou" not in report  # a partial run is not evaluated as the benchmark's


def test_a_folder_without_the_lists_is_refused_before_calibrating(
    gpu_run, tmp_path: Path, monkeypatch
) -> None:
    from dualseg.errors import DataError

    monkeypatch.setattr(gpu_run, "calibrate_iters", lambda *a: pytest.fail("calibrated"))
    with pytest.raises(DataError, match=r"no train\.txt / val\.txt there"):
        gpu_run.main(["--data", str(tmp_path), "--out", str(tmp_path / "out")])
