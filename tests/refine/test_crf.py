"""dualseg.refine.crf: dense CRF, the baseline beside method B (pydensecrf2: an optional extra)."""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest
import torch

from dualseg.errors import ConfigError, DualsegError
from dualseg.imaging import IMAGENET_MEAN, IMAGENET_STD
from dualseg.refine.crf import CRF_GRID, CRFSettings, choose_crf, dense_crf, import_pydensecrf

HAVE_CRF = importlib.util.find_spec("pydensecrf") is not None
needs_crf = pytest.mark.skipif(not HAVE_CRF, reason="pydensecrf2 not installed (dualseg[crf])")


def two_regions(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A noisy image, dark left and bright right of column 20, the true labels, and noisy
    probabilities that agree with the edge only on average (a blurred, flipped-in-places map)."""
    rng = np.random.default_rng(seed)
    h, w = 32, 40
    truth = np.zeros((h, w), dtype=np.int64)
    truth[:, 20:] = 1
    image = np.where(truth[..., None] == 1, 200, 50) + rng.normal(0, 12, (h, w, 3))
    image = image.clip(0, 255).astype(np.uint8)
    p1 = np.clip(
        0.5 + 0.12 * np.tanh((np.arange(w) - 20) / 4) + rng.normal(0, 0.15, (h, w)), 0.02, 0.98
    )
    probs = np.stack([1 - p1, p1]).astype(np.float32)
    return image, probs, truth


def test_settings_are_checked_where_they_enter() -> None:
    assert CRFSettings().iterations == 5 and CRFSettings().compat_bilateral == 10
    with pytest.raises(ConfigError, match="sxy_bilateral must be > 0"):
        CRFSettings(sxy_bilateral=0)
    assert len(set(CRF_GRID)) == len(CRF_GRID) >= 4 and CRF_GRID[0] == CRFSettings()


def test_without_pydensecrf2_it_is_one_line_naming_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "pydensecrf", None)  # import fails as if absent
    monkeypatch.setitem(sys.modules, "pydensecrf.densecrf", None)
    with pytest.raises(DualsegError, match=r"pip install 'dualseg\[crf\]'") as err:
        import_pydensecrf()
    assert "\n" not in str(err.value)
    image, probs, _ = two_regions()
    with pytest.raises(DualsegError, match=r"dualseg\[crf\]"):
        dense_crf(image, probs)


@needs_crf
def test_crf_pulls_noisy_probabilities_onto_the_image_edge() -> None:
    image, probs, truth = two_regions()
    before = (probs.argmax(0) == truth).mean()
    out = dense_crf(image, probs)
    assert out.shape == probs.shape and out.dtype == np.float32
    np.testing.assert_allclose(out.sum(0), 1.0, atol=1e-4)
    after = (out.argmax(0) == truth).mean()
    assert before < 0.9 and after > before + 0.05 and after > 0.95


@needs_crf
def test_as_a_refiner_it_scores_beside_method_b_and_is_chosen_on_dev() -> None:
    image, probs, truth = two_regions()
    x = torch.from_numpy(image).permute(2, 0, 1).float() / 255
    x = (x - torch.tensor(IMAGENET_MEAN)[:, None, None]) / torch.tensor(IMAGENET_STD)[:, None, None]
    p = torch.from_numpy(probs)[None]
    labels, changed = CRFSettings().refine(x[None], p)
    assert labels.shape == changed.shape == (1, 32, 40)
    assert torch.equal(changed, labels != p.argmax(1)) and changed.any()
    np.testing.assert_array_equal(labels[0].numpy(), dense_crf(image, probs).argmax(0))

    class Fixed(torch.nn.Module):  # a "base model" whose logits are the noisy map
        def forward(self, images: torch.Tensor) -> torch.Tensor:
            return p.log().expand(images.shape[0], -1, -1, -1)

    loader = [(x[None], torch.from_numpy(truth)[None])]
    best, rows = choose_crf(
        Fixed(), loader, num_classes=2, device=torch.device("cpu"), grid=CRF_GRID[:2]
    )
    assert best in CRF_GRID[:2] and len(rows) == 2
    assert max(r["miou"] for r in rows) == rows[CRF_GRID.index(best)]["miou"]
    assert all(r["miou"] > r["base_miou"] and r["fixed"] > r["broke"] for r in rows)
    # the kernel can be chosen by method B's every metric, net_fixed among them
    assert all(r["net_fixed"] == r["fixed"] - 2 * r["broke"] for r in rows)
    best, rows = choose_crf(Fixed(), loader, num_classes=2, device=torch.device("cpu"),
                            grid=CRF_GRID[:2], metric="net_fixed")  # fmt: skip
    assert max(r["net_fixed"] for r in rows) == rows[CRF_GRID.index(best)]["net_fixed"]
