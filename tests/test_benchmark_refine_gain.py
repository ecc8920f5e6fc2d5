"""benchmarks/refine_gain.py: the paired timing works on any split size."""

from __future__ import annotations

import pytest
import torch

from benchmark_helpers import load_benchmark
from dualseg.refine.shared import SharedFeatures


@pytest.fixture(scope="module")
def refine_gain():
    return load_benchmark("refine_gain")


class Refiner:
    def __init__(self) -> None:
        self.calls = 0

    def refine(self, images: torch.Tensor, scores: torch.Tensor, features: object = None) -> None:
        self.calls += 1

    def shared_features(self, model: torch.nn.Module) -> SharedFeatures:
        return SharedFeatures(model)


@pytest.mark.parametrize("images", [1, 2, 5])
def test_timing_warms_up_only_when_there_is_a_second_image(refine_gain, images) -> None:
    """A one-image split once ended in a StatisticsError after the whole evaluation."""
    dataset = [(torch.randn(3, 8, 8), None) for _ in range(images)]
    refiner = Refiner()
    out = refine_gain.time_ratio(torch.nn.Conv2d(3, 4, 1), refiner, dataset, torch.device("cpu"), 3)
    assert refiner.calls == min(images, 4)  # every image read, the first only to warm up
    assert out["base_s"] > 0 and out["extra_time_ratio"] >= 0 and not out["shares_base_features"]


def test_no_timed_image_is_refused_before_any_work(refine_gain, capsys) -> None:
    argv = ["--data", "d", "--eval", "e", "--base", "b.pt", "--time-images", "0"]
    assert refine_gain.main(argv) == 2
    assert "--time-images must be >= 1" in capsys.readouterr().err
