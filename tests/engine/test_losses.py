"""S32 objective: L1 pixel cross-entropy (over B·N or the labelled pixels) + explicit L2 on the
weight parameters (conv, linear, recurrent)."""

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
    with pytest.raises(ValueError, match="l1_reduction"):
        SegmentationLoss(nn.Conv2d(1, 1, 1), l1_reduction="mean")


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
