"""Convolutions that oneDNN gets wrong or slow in CPU bf16 run in fp32 when a model trains in
bf16 autocast on CPU.

Measured with torch 2.14.1 (``tests/engine/test_cpu_bf16.py`` checks both kernels, layer by
layer):

- **Dilated depthwise convolutions: a wrong kernel** (an Intel Xeon with AMX-BF16, and an AMD
  EPYC with AVX-512 BF16). Under bf16 autocast in channels-last memory format, the weight
  gradient of a *dilated* depthwise convolution comes out as garbage — relative errors of
  1.2–1.8, or 1e26 up to inf and NaN — at many feature-map sizes (24×32, 23×30, 45×60, 48×64;
  12×16 and smaller happened to be right), for every dilation (2–12) and channel count tried.
  Its output and input gradient are right, and so are fp32 channels-last and bf16 NCHW. A
  dilated MobileNetV2 has one in every block past its output stride, so a bf16 run at output
  stride 8 (or at 16 with crops larger than 192×256) trained on wrong gradients, or diverged
  at its third step.
- **Dilated dense convolutions whose input channels are not a multiple of 16: a wrong kernel
  on the AMD EPYC** (AVX-512 BF16 without AMX; the Intel Xeon got them right). The same
  weight gradient is NaN (or off by 0.3) at 23×30 and larger for dilations 2–8, from 24, 100,
  150, 296, 300 or 600 input channels; 256, 288, 304, 320 and 960 were right, and so were
  dilation 1 and NCHW. Method A's ASPP reads the 300 channels of its bidirectional ReNet (2 ×
  150 GRU units): at output stride 8 every ASPP weight gradient but the rate-12 one was NaN.
- **Speed.** A depthwise convolution is memory-bound, and oneDNN's fp32 kernels for it are the
  fast ones: forward + backward of a dilated 576-channel one at 24×32, batch 4, one thread,
  takes 25 ms in fp32 channels-last against 97 ms in bf16; a stride-2 one 12 ms against 60 ms.
  So every depthwise convolution runs in fp32, dilated or not.

:func:`convs_in_fp32` gives those convolutions a forward that leaves autocast and computes in
fp32; their parameters, and so the state dict and the optimizer, stay the same objects.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from dualseg.errors import ConfigError

__all__ = ["Fp32Conv2d", "amp_dtype_for", "convs_in_fp32", "cpu_has_native_bf16", "needs_fp32"]

log = logging.getLogger(__name__)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 or AMX); Linux flags, else False."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def amp_dtype_for(mode: str, device: torch.device) -> torch.dtype | None:
    """``train.amp`` on ``device``: auto is bf16 (else fp16) on CUDA, bf16 on CPUs computing
    it natively (docs/training.md), else none; bf16 asked for on another CPU is warned about."""
    if device.type == "cuda":
        if mode == "auto":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]
    if mode == "fp16":
        raise ConfigError("train.amp=fp16 needs a GPU; use --train.amp bf16 or none on CPU")
    if mode == "none" or (mode == "auto" and not cpu_has_native_bf16()):
        return None
    if mode == "bf16" and not cpu_has_native_bf16():
        log.warning(
            "train.amp=bf16 on a CPU without AVX-512 BF16/AMX: bf16 is emulated here and runs "
            "far slower than fp32 (measured ~40x on an AVX2 EPYC); use --train.amp none"
        )
    return torch.bfloat16


def is_depthwise(m: nn.Module) -> bool:
    """A 2-D convolution with one group per input channel (more than one channel)."""
    return isinstance(m, nn.Conv2d) and m.groups > 1 and m.groups == m.in_channels


def needs_fp32(m: nn.Module) -> bool:
    """Whether ``m`` is a convolution to run in fp32 under CPU bf16 autocast: a depthwise one,
    or a dilated one whose input channels (per group) are not a multiple of 16."""
    if not isinstance(m, nn.Conv2d):
        return False
    dilated = max(m.dilation) > 1 and max(m.kernel_size) > 1
    return is_depthwise(m) or (dilated and (m.in_channels // m.groups) % 16 != 0)


class Fp32Conv2d(nn.Conv2d):
    """An ``nn.Conv2d`` that computes in fp32 even inside an autocast region."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return super().forward(x.float())  # fp32 out: the next layer casts as autocast does


def convs_in_fp32(model: nn.Module) -> int:
    """Make every convolution of ``model`` that :func:`needs_fp32` an :class:`Fp32Conv2d`, in
    place; returns how many. Only the class changes: parameters, buffers and hooks stay."""
    convs = [m for m in model.modules() if needs_fp32(m) and type(m) is nn.Conv2d]
    for conv in convs:
        conv.__class__ = Fp32Conv2d
    return len(convs)
