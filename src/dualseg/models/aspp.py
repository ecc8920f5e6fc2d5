"""Atrous spatial pyramid pooling (spec S2, claim 3; initialization S31)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn
from torchvision.models.segmentation.deeplabv3 import ASPP as _TorchvisionASPP

from dualseg.errors import ConfigError


class ASPP(nn.Module):
    """DeepLab-v2 ASPP (claim 3 Reading): parallel 3×3 atrous convolutions, one per rate
    (default 4, 6, 8, 12), ``padding = rate``, each mapping to ``out_channels`` (class scores),
    summed. Weights N(0, ``init_std``²), bias 0 (S31 Reading, ``init_std = 0.01``).

    ``[B, in_channels, H, W] -> [B, out_channels, H, W]``. Method B reuses it as the multi-scale
    fusion of its embedding network (``out_channels`` = embedding size).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        rates: Sequence[int] = (4, 6, 8, 12),
        *,
        init_std: float = 0.01,
    ) -> None:
        super().__init__()
        self.rates = tuple(int(r) for r in rates)
        if not self.rates or min(self.rates) < 1:
            raise ConfigError(f"ASPP rates must be one or more dilations >= 1, got {list(rates)}")
        self.init_std = init_std
        self.convs = nn.ModuleList(
            nn.Conv2d(in_channels, out_channels, 3, padding=r, dilation=r) for r in self.rates
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for conv in self.convs:
            nn.init.normal_(conv.weight, 0.0, self.init_std)
            nn.init.zeros_(conv.bias)

    def forward(self, x: Tensor) -> Tensor:
        out = self.convs[0](x)
        for conv in self.convs[1:]:  # summed in place of stacking: no 4× activation memory
            out = out + conv(x)
        return out


class ASPPv3Head(nn.Sequential):
    """The alternative reading of claim 3 (``aspp_style="v3"``): torchvision's DeepLab-v3 ASPP
    (1×1 conv, atrous 3×3 convs and image pooling, concatenated, projected to 256 channels with
    BatchNorm) followed by a 1×1 classifier."""

    def __init__(
        self, in_channels: int, out_channels: int, rates: Sequence[int] = (4, 6, 8, 12)
    ) -> None:
        super().__init__(
            _TorchvisionASPP(in_channels, list(rates), 256),
            nn.Conv2d(256, out_channels, 1),
        )
        self.rates = tuple(int(r) for r in rates)
