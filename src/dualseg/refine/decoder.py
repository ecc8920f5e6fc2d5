"""A DeepLabV3+-style decoder for method B's embedding (issue 15, beyond the claim; off by
default, ``RefinerConfig.decoder_channels = 0``).

Why: the claim's embedding is the ASPP output at the backbone's output stride (16 on the CPU
protocol), bilinearly upsampled — the same resolution as the base model's own class scores, so
at a boundary it sees what the base saw. DeepLabV3+ (Chen et al., ECCV 2018, §3.2) sharpens
boundaries by fusing the upsampled ASPP output with the backbone's stride-4 features, projected
to a few channels (48 there) so that they do not outweigh the ASPP's. The same fusion here
gives each near-boundary pixel an embedding that reads stride-4 detail.

``[B,C,h,w]`` (ASPP, stride s) + ``[B,L,H/4,W/4]`` (backbone tap) -> ``[B,C,H/4,W/4]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dualseg.errors import ConfigError

__all__ = ["LOW_LEVEL_TAPS", "LowLevelDecoder", "low_level_tap"]

# backbone name -> (the submodule whose output is the stride-4 feature map, its channels)
LOW_LEVEL_TAPS: dict[str, tuple[str, int]] = {
    "mobilenet_v2": ("features.3", 24),  # the last inverted-residual block at stride 4
    "resnet18": ("layer1", 64),
    "resnet34": ("layer1", 64),
    "resnet50": ("layer1", 256),
    "resnet101": ("layer1", 256),
}


def low_level_tap(backbone: str) -> tuple[str, int]:
    """``(submodule name, channels)`` of ``backbone``'s stride-4 features, or a ConfigError."""
    if backbone not in LOW_LEVEL_TAPS:
        raise ConfigError(
            f"decoder_channels > 0 needs a backbone with a known stride-4 tap "
            f"({', '.join(LOW_LEVEL_TAPS)}), got {backbone!r}; use decoder_channels 0"
        )
    return LOW_LEVEL_TAPS[backbone]


class LowLevelDecoder(nn.Module):
    """DeepLabV3+'s decoder with the embedding as its output: project the stride-4 features
    to ``proj_channels`` (1×1 conv, BN, ReLU), concatenate with the upsampled embedding, one
    3×3 conv (BN, ReLU) and a linear 1×1 conv back to ``embed_dim`` (the triplet loss reads
    distances, so the last layer stays linear as the ASPP's is)."""

    def __init__(self, low_channels: int, embed_dim: int, proj_channels: int = 48) -> None:
        super().__init__()
        self.project = nn.Sequential(
            nn.Conv2d(low_channels, proj_channels, 1, bias=False),
            nn.BatchNorm2d(proj_channels),
            nn.ReLU(inplace=True),
        )
        self.fuse = nn.Sequential(
            nn.Conv2d(embed_dim + proj_channels, embed_dim, 3, padding=1, bias=False),
            nn.BatchNorm2d(embed_dim),
            nn.ReLU(inplace=True),
            nn.Conv2d(embed_dim, embed_dim, 1),
        )

    def forward(self, high: Tensor, low: Tensor) -> Tensor:
        # high [B,C,h,w] at the output stride; low [B,L,H/4,W/4]
        high = F.interpolate(high, size=low.shape[-2:], mode="bilinear", align_corners=False)
        return self.fuse(torch.cat([high, self.project(low)], dim=1))  # [B,C,H/4,W/4]
