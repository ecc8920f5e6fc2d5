"""DualBranchNet (spec S2/S4) and its ablation switches."""

from __future__ import annotations

import pytest
import torch

from dualseg.models import CoordChannels, DualBranchNet, ReNetLayer, build_model
from dualseg.models.dualbranch import BT601, IMAGENET_MEAN, IMAGENET_STD

SMALL = {"num_classes": 3, "renet_hidden": 16}


@pytest.fixture(scope="module")
def net() -> DualBranchNet:
    torch.manual_seed(0)
    return build_model("dualseg_mobilenet_v2", **SMALL)


def test_output_matches_odd_input_size(net: DualBranchNet) -> None:
    with torch.no_grad():
        assert net.eval()(torch.randn(1, 3, 97, 131)).shape == (1, 3, 97, 131)


def test_branches_share_no_parameters(net: DualBranchNet) -> None:
    rgb = {p.data_ptr() for p in net.rgb.parameters()}
    gray = {p.data_ptr() for p in net.gray.parameters()}
    assert rgb and gray and not rgb & gray
    assert net.rgb.backbone.features[0][0].weight.shape[1] == 3
    assert net.gray.backbone.features[0][0].weight.shape[1] == 1  # gray fed as one channel


def test_backward_reaches_both_branches_and_the_fusion(net: DualBranchNet) -> None:
    net.train().zero_grad()
    net(torch.randn(2, 3, 64, 64)).square().mean().backward()
    for branch in (net.rgb, net.gray):
        assert sum(p.grad.abs().sum().item() for p in branch.parameters()) > 0
        assert branch.backbone.features[0][0].weight.grad.abs().sum() > 0
        assert branch.context.renet1.rows.weight_ih_l0.grad.abs().sum() > 0
    assert net.fusion.weight.grad.abs().min() > 0


def test_fusion_weights_start_equal_and_fuse_by_weighted_sum(net: DualBranchNet) -> None:
    assert torch.equal(net.fusion.weight, torch.full((2, 1), 0.5))
    a, b = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    assert torch.allclose(net.fusion(a, b), 0.5 * a + 0.5 * b)
    with torch.no_grad():
        x = torch.randn(1, 3, 64, 64)
        net.eval()
        expected = net.fusion(net.rgb(x), net.gray(net.to_gray(x)))
        # S44 (default order): softmax of the fused scores, then bilinear upsampling.
        up = torch.nn.functional.interpolate(expected.softmax(1), size=(64, 64), mode="bilinear")
        assert torch.allclose(net(x).exp(), up, atol=1e-5)
        assert torch.allclose(net(x).softmax(1), up, atol=1e-5)  # log-probabilities are logits
        net.upsample_order = "logits_first"  # DeepLab's order: upsample the scores themselves
        up = torch.nn.functional.interpolate(expected, size=(64, 64), mode="bilinear")
        assert torch.allclose(net(x), up, atol=1e-5)


def test_gray_is_bt601_luma_of_the_unnormalized_image(net: DualBranchNet) -> None:
    rgb01 = torch.rand(2, 3, 5, 6)
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    x = (rgb01 - mean) / std
    luma = sum(c * rgb01[:, k : k + 1] for k, c in enumerate(BT601))
    gray_mean = sum(c * m for c, m in zip(BT601, IMAGENET_MEAN))
    gray_std = sum(c * s for c, s in zip(BT601, IMAGENET_STD))
    assert torch.allclose(net.to_gray(x), (luma - gray_mean) / gray_std, atol=1e-5)
    # a mid-gray image at the mean maps to ~0 in both normalizations
    grey = ((torch.full((1, 3, 2, 2), gray_mean) - mean) / std).float()
    assert net.to_gray(grey).abs().max() < 1e-5


def test_single_branch_ablation_has_no_gray_parameters() -> None:
    net = build_model("dualseg_mobilenet_v2", gray_branch=False, **SMALL)
    assert net.gray is None and net.fusion is None
    assert not [n for n, _ in net.named_parameters() if not n.startswith("rgb.")]
    with torch.no_grad():
        assert net.eval()(torch.randn(1, 3, 40, 56)).shape == (1, 3, 40, 56)


@pytest.mark.parametrize("layers", [0, 1, 2])
@pytest.mark.parametrize("coord", [True, False])
def test_renet_and_coord_switches(layers: int, coord: bool) -> None:
    net = build_model(
        "dualseg_resnet18", renet_layers=layers, coord_channels=coord, gray_branch=False, **SMALL
    )
    renets = [m for m in net.modules() if isinstance(m, ReNetLayer)]
    coords = [m for m in net.modules() if isinstance(m, CoordChannels)]
    assert len(renets) == layers
    assert len(coords) == (layers if coord else 0)
    if layers:
        assert renets[0].rows.input_size == 512 + (3 if coord else 0)
    assert net.rgb.aspp.convs[0].in_channels == (32 if layers else 512)
    with torch.no_grad():
        assert net.eval()(torch.randn(1, 3, 32, 40)).shape == (1, 3, 32, 40)


def test_aspp_rates_style_and_output_stride_options() -> None:
    net = build_model("dualseg_mobilenet_v2", aspp_rates=[2, 3], output_stride=16, **SMALL)
    assert [c.dilation[0] for c in net.rgb.aspp.convs] == [2, 3]
    assert net.output_stride == 16
    x = torch.randn(1, 3, 50, 70)
    with torch.no_grad():
        assert net.eval()(x).shape == (1, 3, 50, 70)
        assert net.rgb.backbone(torch.randn(1, 3, 64, 64)).shape[-2:] == (4, 4)
    v3 = build_model("dualseg_mobilenet_v2", aspp_style="v3", fusion="per_class", **SMALL)
    assert v3.fusion.weight.shape == (2, 3)
    with torch.no_grad():
        assert v3.eval()(torch.randn(1, 3, 32, 32)).shape == (1, 3, 32, 32)


def test_a_double_precision_model_answers_in_double_precision() -> None:
    model = build_model("dualseg_mobilenet_v2", num_classes=3, renet_hidden=4).eval().double()
    with torch.no_grad():
        out = model(torch.randn(1, 3, 32, 32, dtype=torch.float64))
    assert out.dtype == torch.float64
