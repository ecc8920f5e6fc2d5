"""Depthwise convolutions in fp32 under CPU bf16 autocast (``dualseg.engine.cpu_bf16``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dualseg.data import make_synthetic_dataset
from dualseg.engine.config import load_config
from dualseg.engine.cpu_bf16 import Fp32Conv2d, convs_in_fp32
from dualseg.engine.distributed import init_distributed
from dualseg.engine.train import _build

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_synthetic.yaml"


def _block(channels: int, dilation: int) -> nn.Sequential:
    """A dilated MobileNetV2 block's core: 1×1 expansion, dilated depthwise 3×3, BN (no conv
    biases, as there: a bias before BN has a zero gradient, which no relative error can test)."""
    return nn.Sequential(
        nn.Conv2d(channels, channels, 1, bias=False),
        nn.Conv2d(
            channels, channels, 3, padding=dilation, dilation=dilation, groups=channels, bias=False
        ),
        nn.BatchNorm2d(channels),
    )


def _grads(block: nn.Module, x: torch.Tensor, upstream: torch.Tensor, amp: bool) -> list:
    block.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = block(x)
    (out.float() * upstream).sum().backward()
    return [p.grad.clone() for p in block.parameters()]


@pytest.mark.parametrize(("channels", "size"), [(64, (24, 32)), (144, (23, 30))])
def test_dilated_depthwise_gradients_are_right_in_bf16_channels_last(channels, size) -> None:
    # the shapes where oneDNN's bf16 channels-last kernel gave NaN / 1e35 / errors above 1
    torch.manual_seed(0)
    block = _block(channels, dilation=2).train()
    x = torch.randn(1, channels, *size)
    upstream = torch.randn(1, channels, *size)
    expected = _grads(block, x, upstream, amp=False)

    assert convs_in_fp32(block) == 1
    assert type(block[1]) is Fp32Conv2d and type(block[0]) is nn.Conv2d
    block = block.to(memory_format=torch.channels_last)
    got = _grads(block, x.contiguous(memory_format=torch.channels_last), upstream, amp=True)
    for g, e in zip(got, expected, strict=True):
        assert torch.isfinite(g).all()
        # bf16 noise from the 1×1 convolution upstream only
        assert (g - e).norm() / e.norm() < 0.02


def test_dilated_dense_convolutions_off_a_multiple_of_16_run_in_fp32() -> None:
    # method A's ASPP on its 300 ReNet channels: NaN weight gradients in bf16 channels-last on
    # an AMD EPYC with AVX-512 BF16 (right on an Intel Xeon with AMX), at 23x30 and larger
    torch.manual_seed(0)
    conv = nn.Conv2d(300, 11, 3, padding=4, dilation=4)
    x, upstream = torch.randn(2, 300, 24, 32), torch.randn(2, 11, 24, 32)
    expected = _grads(conv, x, upstream, amp=False)
    assert convs_in_fp32(conv) == 1 and type(conv) is Fp32Conv2d
    conv = conv.to(memory_format=torch.channels_last)
    got = _grads(conv, x.contiguous(memory_format=torch.channels_last), upstream, amp=True)
    for g, e in zip(got, expected, strict=True):
        assert (g - e).norm() / e.norm() < 1e-5  # fp32 throughout
    # the kernels that were right keep bf16: a multiple of 16, no dilation, a 1x1
    kept = [
        nn.Conv2d(320, 11, 3, padding=4, dilation=4),
        nn.Conv2d(300, 11, 3, padding=1),
        nn.Conv2d(300, 11, 1, dilation=2),
    ]
    assert convs_in_fp32(nn.Sequential(*kept)) == 0


def test_the_swap_keeps_parameters_and_state_dict() -> None:
    block = _block(8, dilation=4)
    params = list(block.parameters())
    keys = list(block.state_dict())
    convs_in_fp32(block)
    assert list(block.parameters()) == params and list(block.state_dict()) == keys
    assert convs_in_fp32(block) == 0  # already swapped
    x = torch.randn(2, 8, 10, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert block[1](x.bfloat16()).dtype == torch.float32


@pytest.mark.parametrize(("amp", "swapped"), [("bf16", True), ("none", False)])
def test_training_in_cpu_bf16_swaps_the_depthwise_convolutions(tmp_path, amp, swapped) -> None:
    data = make_synthetic_dataset(tmp_path / "d", n_train=2, n_val=1, size=(32, 32))
    cfg = load_config(
        TINY,
        data={"root": str(data), "crop_size": [32, 32]},
        model={"renet_hidden": 10},  # the ASPP reads 2 x 10 ReNet channels: not a multiple of 16
        train={"out_dir": str(tmp_path / "run"), "amp": amp},
    )
    model = _build(cfg, init_distributed("cpu"), None).model
    depthwise = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.groups > 1]
    assert depthwise  # MobileNetV2: one per block
    assert all((type(m) is Fp32Conv2d) is swapped for m in depthwise)
    aspp = [m for name, m in model.named_modules() if ".aspp.convs." in name]
    assert aspp and all((type(m) is Fp32Conv2d) is swapped for m in aspp)
