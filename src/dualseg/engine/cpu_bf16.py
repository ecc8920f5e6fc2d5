"""CPU mixed precision: which ``train.amp`` applies, and the convolutions that run in fp32
under CPU bf16 autocast (oneDNN computes the bf16 weight gradient of dilated depthwise ones,
and of dilated ones whose input channels are not a multiple of 16, wrong: up to NaN)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from dualseg.errors import ConfigError

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
    it natively, else none."""
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
    """A depthwise convolution, or a dilated one whose input channels per group are not a
    multiple of 16."""
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
    """Make every convolution that :func:`needs_fp32` an :class:`Fp32Conv2d` in place (only
    the class changes); returns how many."""
    convs = [m for m in model.modules() if needs_fp32(m) and type(m) is nn.Conv2d]
    for conv in convs:
        conv.__class__ = Fp32Conv2d
    return len(convs)
