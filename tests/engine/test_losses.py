"""S32 objective: L1 pixel cross-entropy (over B·N or the labelled pixels) + explicit L2 on the
weight parameters (conv, linear, recurrent)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dualseg.engine.losses import (
    SegmentationLoss,
    class_weights_for,
    cross_entropy_loss,
    decay_weights,
    median_frequency_weights,
    ohem_keep_mask,
)
from dualseg.errors import ConfigError


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.gru = nn.GRU(4, 2)
        self.head = nn.Conv2d(4, 3, 1)
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.conv(x)))


@pytest.mark.parametrize("reduction", ["batch_pixels", "valid_pixels"])
def test_l1_sums_labelled_pixels_and_divides_by_the_reading(reduction: str) -> None:
    logits = torch.randn(2, 3, 4, 5)
    target = torch.randint(0, 3, (2, 4, 5))
    target[0, :2] = 255
    valid = target != 255
    per_pixel = F.cross_entropy(logits, target.clamp_max(2), reduction="none")
    # S32: averaged over the B·N pixels (ignored ones add 0); or over the labelled ones.
    count = target.numel() if reduction == "batch_pixels" else int(valid.sum())
    expected = per_pixel[valid].sum() / count
    assert torch.allclose(cross_entropy_loss(logits, target, reduction=reduction), expected)
    # All pixels ignored: zero, not NaN.
    all_ignored = torch.full_like(target, 255)
    assert cross_entropy_loss(logits, all_ignored, reduction=reduction).item() == 0.0


def test_l1_default_is_the_claims_batch_average() -> None:
    logits = torch.randn(1, 3, 4, 4)
    target = torch.randint(0, 3, (1, 4, 4))
    target[0, 0] = 255
    criterion = SegmentationLoss(nn.Conv2d(1, 1, 1), weight_decay=0.0)
    _, parts = criterion(logits, target)
    assert torch.allclose(parts["l1"], cross_entropy_loss(logits, target, reduction="batch_pixels"))


def test_l1_resizes_logits_to_label_size() -> None:
    logits = torch.randn(1, 3, 4, 4)
    target = torch.randint(0, 3, (1, 8, 8))
    up = F.interpolate(logits, size=(8, 8), mode="bilinear", align_corners=False)
    assert torch.allclose(cross_entropy_loss(logits, target), F.cross_entropy(up, target))


def test_decay_weights_are_conv_linear_and_recurrent_weights_only() -> None:
    model = Tiny()
    plain = {id(model.conv.weight), id(model.head.weight), id(model.fc.weight)}
    recurrent = {id(model.gru.weight_ih_l0), id(model.gru.weight_hh_l0)}
    assert {id(w) for w in decay_weights(model)} == plain | recurrent  # no biases, no BN
    assert {id(w) for w in decay_weights(model, recurrent=False)} == plain


def test_l2_covers_every_gru_weight_matrix_of_method_a() -> None:
    from dualseg.models import build_model

    model = build_model("dualseg_mobilenet_v2", num_classes=3, renet_hidden=4)
    decayed = {id(w) for w in decay_weights(model)}
    grus = [m for m in model.modules() if isinstance(m, nn.GRU)]
    assert len(grus) == 8  # 2 branches x 2 ReNet layers x (rows, cols)
    for gru in grus:
        for name, p in gru.named_parameters():
            assert (id(p) in decayed) == name.startswith("weight"), name


@pytest.mark.parametrize("l2_lambda", [None, 0.5])
def test_l2_term_matches_the_formula(l2_lambda: float | None) -> None:
    model = Tiny()
    criterion = SegmentationLoss(model, weight_decay=1e-3, l2_lambda=l2_lambda)
    x = torch.randn(2, 3, 6, 7)
    target = torch.randint(0, 3, (2, 6, 7))
    loss, parts = criterion(model(x), target)
    b, n = 2, 6 * 7
    lam = 1e-3 * b * n if l2_lambda is None else l2_lambda
    decayed = (model.conv.weight, model.head.weight, model.fc.weight)
    decayed += (model.gru.weight_ih_l0, model.gru.weight_hh_l0)
    squares = sum(w.pow(2).sum() for w in decayed)
    assert torch.allclose(parts["l2"], lam / (2 * b * n) * squares)
    assert torch.allclose(parts["loss"], parts["l1"] + parts["l2"])
    assert torch.allclose(loss.detach(), parts["loss"])


def test_default_lambda_gradient_equals_weight_decay() -> None:
    # With lambda = wd * B * N, d(L2)/dw = wd * w: plain weight decay, for any batch / crop size.
    model = Tiny()
    criterion = SegmentationLoss(model, weight_decay=1e-4)
    logits = torch.zeros(3, 3, 5, 9, requires_grad=True)  # L1 independent of the weights
    loss, _ = criterion(logits, torch.zeros(3, 5, 9, dtype=torch.long))
    loss.backward()
    assert torch.allclose(model.conv.weight.grad, 1e-4 * model.conv.weight.detach())
    assert model.conv.bias.grad is None and model.bn.weight.grad is None


# ---------------------------------------------------------------- beyond S32: weights and OHEM
def _two_class_logits(p_true: list[float], target: list[int]) -> torch.Tensor:
    """[1,2,1,N] logits whose softmax gives each pixel probability p_true of its target class."""
    p = torch.tensor(p_true, dtype=torch.float64)
    p0 = torch.where(torch.tensor(target) == 1, 1 - p, p)
    return torch.stack([p0.log(), (1 - p0).log()])[None, :, None, :].float()


def test_defaults_are_the_s32_loss() -> None:
    logits, target = torch.randn(2, 3, 4, 5), torch.randint(0, 3, (2, 4, 5))
    target[1, 0] = 255
    _, parts = SegmentationLoss(Tiny())(logits, target)
    valid = target != 255
    per_pixel = F.cross_entropy(logits, target.clamp_max(2), reduction="none")
    s32 = per_pixel[valid].sum() / target.numel()  # the batch_pixels reading
    assert parts["l1"].item() == pytest.approx(s32.item(), rel=1e-6)


def test_class_weighted_cross_entropy_exact_value() -> None:
    # pixels: class 0 with p=3/4, class 1 with p=1/2, class 1 with p=1/4, one ignored
    logits = _two_class_logits([0.75, 0.5, 0.25, 0.9], [0, 1, 1, 0])
    target = torch.tensor([[[0, 1, 1, 255]]])
    weights = torch.tensor([1.0, 3.0])
    got = cross_entropy_loss(logits, target, class_weights=weights, reduction="valid_pixels")
    weighted_sum = 1 * math.log(4 / 3) + 3 * math.log(2) + 3 * math.log(4)
    assert got.item() == pytest.approx(weighted_sum / (1 + 3 + 3), rel=1e-6)
    # batch_pixels (the default): the weighted sum over all B·N = 4 pixels
    got = cross_entropy_loss(logits, target, class_weights=weights)
    assert got.item() == pytest.approx(weighted_sum / 4, rel=1e-6)
    # equal weights: the plain mean
    ones = cross_entropy_loss(
        logits, target, class_weights=torch.tensor([2.0, 2.0]), reduction="valid_pixels"
    )
    plain = cross_entropy_loss(logits, target, reduction="valid_pixels")
    assert ones.item() == pytest.approx(plain.item(), rel=1e-6)


def test_ohem_keeps_pixels_below_threshold_and_at_least_min_kept() -> None:
    p = [0.9, 0.6, 0.3, 0.1, 0.5]
    logits = _two_class_logits(p, [0, 1, 0, 1, 0])
    target = torch.tensor([[[0, 1, 0, 1, 255]]])  # the last pixel is ignored
    ce = [-math.log(v) for v in p]

    keep = ohem_keep_mask(logits, target, thresh=0.7, min_kept=1)
    assert keep.tolist() == [[[False, True, True, True, False]]]
    got = cross_entropy_loss(
        logits, target, ohem_thresh=0.7, ohem_min_kept=1, reduction="valid_pixels"
    )
    assert got.item() == pytest.approx((ce[1] + ce[2] + ce[3]) / 3, rel=1e-6)
    # batch_pixels: the dropped pixels add 0 and still count in B·N = 5
    got = cross_entropy_loss(logits, target, ohem_thresh=0.7, ohem_min_kept=1)
    assert got.item() == pytest.approx((ce[1] + ce[2] + ce[3]) / 5, rel=1e-6)

    # thresh 0.5 alone keeps 2 pixels; min_kept 3 raises the threshold to the 4th smallest p
    keep = ohem_keep_mask(logits, target, thresh=0.5, min_kept=3)
    assert keep.tolist() == [[[False, True, True, True, False]]]
    keep = ohem_keep_mask(logits, target, thresh=0.5, min_kept=0)
    assert keep.tolist() == [[[False, False, True, True, False]]]
    # min_kept at least the valid pixel count: every valid pixel counts (the plain mean)
    got = cross_entropy_loss(
        logits, target, ohem_thresh=0.5, ohem_min_kept=4, reduction="valid_pixels"
    )
    assert got.item() == pytest.approx(sum(ce[:4]) / 4, rel=1e-6)
    # min_kept is per image (mmseg): two copies of the image double it
    both = ohem_keep_mask(logits.repeat(2, 1, 1, 1), target.repeat(2, 1, 1), thresh=0.5,
                          min_kept=1)  # fmt: skip
    assert both.sum() == 4  # 2 per image below 0.5; k = 2 is reached already
    # OHEM with class weights: the weighted mean over the kept pixels
    w = torch.tensor([1.0, 2.0])
    got = cross_entropy_loss(
        logits, target, class_weights=w, ohem_thresh=0.7, ohem_min_kept=0, reduction="valid_pixels"
    )
    assert got.item() == pytest.approx((2 * ce[1] + 1 * ce[2] + 2 * ce[3]) / 5, rel=1e-6)


def test_median_frequency_weights_exact_values() -> None:
    # class 0 in images totalling 100 labelled px (40 of them), class 1: 10 of 50, class 2: 5
    # of 100, class 3 never appears
    w = median_frequency_weights([40, 10, 5, 0], [100, 50, 100, 0])
    freqs = [0.4, 0.2, 0.05]  # median 0.2
    assert w.tolist() == pytest.approx([0.2 / f for f in freqs] + [0.0])
    # an even number of classes present: the median is the mean of the two middle values
    # (numpy's and statistics'), not torch.median's lower one
    w = median_frequency_weights([40, 10, 5, 30], [100, 50, 100, 100])
    freqs = [0.4, 0.2, 0.05, 0.3]
    assert w.tolist() == pytest.approx([float(np.median(freqs)) / f for f in freqs])


def test_class_weights_for_median_frequency_reads_the_training_labels(tmp_path) -> None:
    import numpy as np
    from PIL import Image

    from dualseg.data import DatasetMeta, build_dataset

    meta = DatasetMeta("t", ("a", "b", "c"), ((0, 0, 0), (1, 1, 1), (2, 2, 2)))
    labels = [np.array([[0, 0, 0, 1]], np.uint8), np.array([[0, 2, 255, 2]], np.uint8)]
    lines = []
    for i, lab in enumerate(labels):
        Image.fromarray(np.zeros((1, 4, 3), np.uint8)).save(tmp_path / f"i{i}.png")
        Image.fromarray(lab).save(tmp_path / f"l{i}.png")
        lines.append(f"i{i}.png l{i}.png\n")
    (tmp_path / "train.txt").write_text("".join(lines))
    ds = build_dataset(tmp_path, preset=meta)
    # f_a = 4 / (4 + 3), f_b = 1 / 4, f_c = 2 / 3 (ignored pixels do not count); median f_c
    w = class_weights_for("median_frequency", 3, ds)
    f = [4 / 7, 1 / 4, 2 / 3]
    assert w.tolist() == pytest.approx([4 / 7 / x for x in f])  # median of f is 4/7
    assert class_weights_for(None, 3, ds) is None
    assert class_weights_for((1, 2, 3), 3).tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ConfigError, match=r"has 2 values .* 3 classes"):
        class_weights_for((1, 2), 3)
    from dualseg.engine.options import OptimConfig

    for bad in ((1, 2, -1), (0, 0, 0), (1, float("nan"))):  # refused where the option enters
        with pytest.raises(ConfigError, match=r"optim\.class_weights must be .* not all 0"):
            OptimConfig(class_weights=bad)
