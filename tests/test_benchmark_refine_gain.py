"""benchmarks/refine_gain.py: the paired timing works on any split size; dense CRF is
reported beside method B, its settings chosen on dev."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from benchmark_helpers import load_benchmark
from dualseg.data import make_synthetic_dataset
from dualseg.errors import ConfigError, DualsegError
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
    loader = [(torch.randn(1, 3, 8, 8), None) for _ in range(images)]
    refiner = Refiner()
    out = refine_gain.time_ratio(torch.nn.Conv2d(3, 4, 1), refiner, loader, torch.device("cpu"), 3)
    assert refiner.calls == min(images, 5)  # every image read, up to two only to warm up
    assert out["base_s"] > 0 and not out["shares_base_features"]
    assert out["extra_time_ratio"] == out["refine_s"] / out["base_s"]
    assert "refine_own_backbone_s" not in out  # it never ran on the base's features


class Shared:
    """The base's features for every image, as a refiner on its frozen backbone reads them."""

    def __enter__(self) -> Shared:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def take(self, images: torch.Tensor) -> torch.Tensor:
        return images


class SharingRefiner(Refiner):
    def __init__(self) -> None:
        super().__init__()
        self.features: list[object] = []

    def refine(self, images: torch.Tensor, scores: torch.Tensor, features: object = None) -> None:
        super().refine(images, scores, features)
        self.features.append(features)

    def shared_features(self, model: torch.nn.Module) -> Shared:
        return Shared()


def test_a_refiner_on_the_bases_features_is_also_timed_on_its_own(refine_gain) -> None:
    loader = [(torch.randn(1, 3, 8, 8), None) for _ in range(4)]
    refiner = SharingRefiner()
    out = refine_gain.time_ratio(torch.nn.Conv2d(3, 4, 1), refiner, loader, torch.device("cpu"), 2)
    assert out["shares_base_features"]
    assert all(f is x for f, (x, _) in zip(refiner.features[:4], loader))  # the base's
    assert all(f is None for f in refiner.features[4:])  # then none: its own backbone
    assert len(refiner.features) == 8  # a second pass, paired with its own base times
    assert isinstance(out["refine_own_backbone_s"], float)
    assert isinstance(out["extra_time_ratio_own_backbone"], float)


def test_no_timed_image_is_refused_before_any_work(refine_gain, capsys) -> None:
    argv = ["--data", "d", "--eval", "e", "--base", "b.pt", "--time-images", "0"]
    assert refine_gain.main(argv) == 2
    assert "--time-images must be >= 1" in capsys.readouterr().err


HAVE_CRF = importlib.util.find_spec("pydensecrf") is not None


def test_without_pydensecrf2_the_crf_is_one_line_before_any_work(
    refine_gain, monkeypatch, tmp_path
) -> None:
    monkeypatch.setitem(sys.modules, "pydensecrf", None)
    monkeypatch.setitem(sys.modules, "pydensecrf.densecrf", None)
    argv = ["--data", str(tmp_path / "d"), "--eval", "e", "--base", "b.pt"]
    with pytest.raises(DualsegError, match=r"pip install 'dualseg\[crf\]', or --crf off"):
        refine_gain.main([*argv, "--out", str(tmp_path / "gain.json")])
    assert not (tmp_path / "gain.json").exists()
    with pytest.raises(ConfigError, match="drop --crf off"):  # --crf off: the CRF is not needed
        refine_gain.main([*argv, "--crf", "off", "--crf-dev", "dev.txt"])


def test_crf_settings_are_never_chosen_on_the_evaluation_split(refine_gain, tmp_path) -> None:
    data = make_synthetic_dataset(tmp_path / "data", n_train=2, n_val=1, size=(16, 16))
    base = ["--data", str(data), "--preset", "synthetic", "--base", "b.pt"]
    for argv in (
        [*base, "--eval", str(data / "val.txt"), "--crf-dev", str(data / "val.txt")],
        [*base, "--eval", str(data), "--crf-dev", "val"],  # a split of --data, as fit names one
    ):
        with pytest.raises(ConfigError, match="is the evaluation split"):
            refine_gain.crf_dev_dataset(refine_gain.parse_args(argv))
    args = refine_gain.parse_args([*base, "--eval", str(data), "--crf-dev", "train"])
    assert len(refine_gain.crf_dev_dataset(args)) == 2
    assert refine_gain.crf_dev_dataset(refine_gain.parse_args([*base, "--eval", "e"])) is None
    # the kernel is chosen by any of method B's metrics, as the decision is
    args = refine_gain.parse_args([*base, "--eval", "e", "--crf-metric", "net_fixed"])
    assert args.crf_metric == "net_fixed"


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_CRF, reason="pydensecrf2 not installed (dualseg[crf])")
def test_dense_crf_is_reported_beside_method_b_for_every_base(
    refine_gain, tmp_path, capsys
) -> None:
    """Same base probabilities, same figures, settings chosen on dev (not on the eval split)."""
    from checkpoint_helpers import write_synthetic_checkpoint
    from dualseg.refine.crf import CRF_GRID, CRFSettings

    data = make_synthetic_dataset(tmp_path / "data", n_train=4, n_val=2, size=(48, 64))
    train = (data / "train.txt").read_text().splitlines()
    (data / "dev.txt").write_text("\n".join(train[:2]) + "\n")
    base = str(write_synthetic_checkpoint(tmp_path / "base.pt"))
    out = tmp_path / "gain.json"
    argv = ["--data", str(data), "--preset", "synthetic", "--eval", str(data), "--base", base]
    argv += ["--init-from", base, "--steps", "2", "--batch-size", "2", "--crop-size", "32", "32"]
    argv += ["--refiner-out", str(tmp_path / "refiner.pt"), "--time-images", "1"]
    argv += ["--device", "cpu", "--crf-dev", "dev", "--out", str(out)]
    assert refine_gain.main(argv) == 0
    row = json.loads(out.read_text())["bases"][base]
    crf = row["crf"]
    assert CRFSettings(**crf["settings"]) in CRF_GRID and crf["chosen_on_dev"]
    assert len(crf["dev_sweep"]) == len(CRF_GRID)
    for key in ("miou", "boundary_f1", "trimap_miou"):
        assert 0 <= crf[key] <= 1 and 0 <= row[key]["refined"] <= 1
    assert crf["fixed"] >= 0 and crf["broke"] >= 0 and crf["ms_per_image"] > 0
    assert {"fixed", "broke"} <= set(row["refine"])
    printed = capsys.readouterr().out
    assert "dense CRF" in printed and "fixed/broken" in printed and "chosen on --crf-dev" in printed
