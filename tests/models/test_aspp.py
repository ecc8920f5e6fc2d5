"""ASPP (claim 3, S31): four 3×3 atrous convolutions, class scores summed, N(0, 0.01²)."""

from __future__ import annotations

import torch
from torch import nn

from dualseg.models import ASPP


def test_four_atrous_convs_with_the_spec_rates() -> None:
    aspp = ASPP(300, 11)
    convs = [m for m in aspp.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 4
    assert [c.dilation for c in convs] == [(4, 4), (6, 6), (8, 8), (12, 12)]
    assert [c.padding for c in convs] == [(4, 4), (6, 6), (8, 8), (12, 12)]
    assert all(c.kernel_size == (3, 3) and c.out_channels == 11 for c in convs)


def test_initialization_gaussian_001_bias_zero() -> None:
    aspp = ASPP(300, 11)
    w = torch.cat([c.weight.flatten() for c in aspp.convs])
    assert 0.008 <= w.std().item() <= 0.012
    assert abs(w.mean().item()) < 1e-3
    assert all(torch.equal(c.bias, torch.zeros(11)) for c in aspp.convs)


def test_output_is_the_sum_of_the_branches_at_input_resolution() -> None:
    aspp = ASPP(6, 3, rates=(1, 2))
    x = torch.randn(2, 6, 9, 10)
    out = aspp(x)
    assert out.shape == (2, 3, 9, 10)
    assert torch.allclose(out, aspp.convs[0](x) + aspp.convs[1](x), atol=1e-6)
