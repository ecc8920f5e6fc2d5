"""S32 objective: L1 cross-entropy over non-ignored pixels + explicit L2 on conv/linear weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dualseg.engine.losses import SegmentationLoss, cross_entropy_loss, decay_weights


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


def test_l1_averages_over_labelled_pixels_only() -> None:
    logits = torch.randn(2, 3, 4, 5)
    target = torch.randint(0, 3, (2, 4, 5))
    target[0, :2] = 255
    valid = target != 255
    per_pixel = F.cross_entropy(logits, target.clamp_max(2), reduction="none")
    expected = per_pixel[valid].mean()
    assert torch.allclose(cross_entropy_loss(logits, target), expected)
    # All pixels ignored: zero, not NaN.
    assert cross_entropy_loss(logits, torch.full_like(target, 255)).item() == 0.0


def test_l1_resizes_logits_to_label_size() -> None:
    logits = torch.randn(1, 3, 4, 4)
    target = torch.randint(0, 3, (1, 8, 8))
    up = F.interpolate(logits, size=(8, 8), mode="bilinear", align_corners=False)
    assert torch.allclose(cross_entropy_loss(logits, target), F.cross_entropy(up, target))


def test_decay_weights_are_conv_and_linear_weights_only() -> None:
    model = Tiny()
    got = {id(w) for w in decay_weights(model)}
    assert got == {id(model.conv.weight), id(model.head.weight), id(model.fc.weight)}


@pytest.mark.parametrize("l2_lambda", [None, 0.5])
def test_l2_term_matches_the_formula(l2_lambda: float | None) -> None:
    model = Tiny()
    criterion = SegmentationLoss(model, weight_decay=1e-3, l2_lambda=l2_lambda)
    x = torch.randn(2, 3, 6, 7)
    target = torch.randint(0, 3, (2, 6, 7))
    loss, parts = criterion(model(x), target)
    b, n = 2, 6 * 7
    lam = 1e-3 * b * n if l2_lambda is None else l2_lambda
    squares = sum(w.pow(2).sum() for w in (model.conv.weight, model.head.weight, model.fc.weight))
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
