"""Depthwise convolutions in fp32 when a model trains in bf16 autocast on CPU.

Two measured reasons (torch 2.14.1, oneDNN, an Intel Xeon with AMX-BF16 and AVX-512 BF16;
``tests/engine/test_cpu_bf16.py`` checks the first):

- **A wrong kernel.** Under bf16 autocast in channels-last memory format, the weight gradient
  of a *dilated* depthwise convolution comes out as garbage — relative errors of 1.2–1.8, or
  1e26 up to inf and NaN — at many feature-map sizes (24×32, 23×30, 45×60, 48×64; 12×16 and
  smaller happened to be right), for every dilation (2–12) and channel count tried. Its output
  and input gradient are right, and so are fp32 channels-last, bf16 NCHW, and grouped or dense
  convolutions. A dilated MobileNetV2 has one in every block past its output stride, so a bf16
  run at output stride 8 (or at 16 with crops larger than 192×256) trained on wrong gradients,
  or diverged at its third step.
- **Speed.** A depthwise convolution is memory-bound, and oneDNN's fp32 kernels for it are the
  fast ones: forward + backward of a dilated 576-channel one at 24×32, batch 4, one thread,
  takes 25 ms in fp32 channels-last against 97 ms in bf16; a stride-2 one 12 ms against 60 ms.

:func:`depthwise_in_fp32` gives those convolutions a forward that leaves autocast and computes
in fp32; their parameters, and so the state dict and the optimizer, stay the same objects.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Fp32DepthwiseConv2d", "depthwise_in_fp32", "is_depthwise"]


def is_depthwise(m: nn.Module) -> bool:
    """A 2-D convolution with one group per input channel (more than one channel)."""
    return isinstance(m, nn.Conv2d) and m.groups > 1 and m.groups == m.in_channels


class Fp32DepthwiseConv2d(nn.Conv2d):
    """An ``nn.Conv2d`` that computes in fp32 even inside an autocast region."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return super().forward(x.float())  # fp32 out: the next layer casts as autocast does


def depthwise_in_fp32(model: nn.Module) -> int:
    """Make every depthwise convolution of ``model`` an :class:`Fp32DepthwiseConv2d`, in place;
    returns how many. Only the class changes: parameters, buffers and hooks stay as they are."""
    convs = [m for m in model.modules() if is_depthwise(m) and type(m) is nn.Conv2d]
    for conv in convs:
        conv.__class__ = Fp32DepthwiseConv2d
    return len(convs)
