"""A DeepLabV3+-style decoder for method B's embedding (beyond the claim; off by default,
``RefinerConfig.decoder_channels = 0``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dualseg.errors import ConfigError

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

    def forward_at(self, high: Tensor, low: Tensor, at: Tensor) -> Tensor:
        """``forward``'s output at the ``at`` cells alone (bool ``[B,H/4,W/4]``): ``[M,C]`` rows in
        ``at.nonzero()`` order, with BatchNorm's running statistics (inference)."""
        n, _, h, w = low.shape
        # the conv's input at the cells it reads: `at` and their 8 neighbours ([R] rows)
        near = F.max_pool2d(at[:, None].float(), 3, stride=1, padding=1)[:, 0] > 0
        nb, ny, nx = near.nonzero(as_tuple=True)
        # the upsampling stays dense: on the small ASPP map it costs less than 4 gathers
        high = F.interpolate(high, size=(h, w), mode="bilinear", align_corners=False)
        x = torch.cat([cells_of(high, nb, ny, nx), self._project_at(low, nb, ny, nx)], 1)
        x = torch.cat([x, x.new_zeros(1, x.shape[1])])  # [R+1,C+P]: the last row is the zero pad
        # row of x of each cell of the zero-padded map (the zero row where nothing was computed)
        row = torch.full((n * (h + 2) * (w + 2),), len(nb), dtype=torch.long, device=low.device)
        row[(nb * (h + 2) + ny + 1) * (w + 2) + nx + 1] = torch.arange(len(nb), device=low.device)
        # each `at` cell's 3×3 window of the padded map, taps in (ky, kx) order
        b, y, xx = at.nonzero(as_tuple=True)  # the M cells
        corner = (b * (h + 2) + y) * (w + 2) + xx
        taps = torch.tensor(
            [dy * (w + 2) + dx for dy in range(3) for dx in range(3)], device=low.device
        )
        window = row[corner[:, None] + taps].flatten()  # [M·9]
        # index_select copies whole rows; x[2-D index] takes a slow path (up to ~3 ms here)
        patches = x.index_select(0, window).view(len(corner), 9 * x.shape[1])  # [M,9·(C+P)]
        conv, bn, last = self.fuse[0], self.fuse[1], self.fuse[3]
        out = patches @ conv.weight.permute(0, 2, 3, 1).flatten(1).T  # [M,C], the same order
        # BN, ReLU, the 1×1 conv as a linear map
        return F.linear(_batch_norm_rows(out, bn).relu_(), last.weight.flatten(1), last.bias)

    def _project_at(self, low: Tensor, b: Tensor, y: Tensor, x: Tensor) -> Tensor:
        """``self.project(low)`` (1×1 conv, BN with running statistics, ReLU) at the cells
        ``(b, y, x)``: ``[R,P]``."""
        conv, bn = self.project[0], self.project[1]
        out = F.linear(cells_of(low, b, y, x), conv.weight.flatten(1))  # [R,P]
        return _batch_norm_rows(out, bn).relu_()


def _batch_norm_rows(rows: Tensor, bn: nn.BatchNorm2d) -> Tensor:
    """``bn`` with its running statistics on ``[rows, channels]`` (as at inference)."""
    return F.batch_norm(rows, bn.running_mean, bn.running_var, bn.weight, bn.bias, eps=bn.eps)


def cells_of(features: Tensor, b: Tensor, y: Tensor, x: Tensor) -> Tensor:
    """``features[b, :, y, x]`` (``[B,C,h,w]``): ``[R,C]``, as one row gather of the
    channels-last map (indexing with the channel slice in the middle is several times slower)."""
    n, c, h, w = features.shape
    if n == 1 and features.is_contiguous():  # one NCHW map: its columns, not a channels-last copy
        return features[0].flatten(1).index_select(1, y * w + x).T
    rows = features.permute(0, 2, 3, 1).reshape(n * h * w, c)  # a view when channels-last
    return rows.index_select(0, (b * h + y) * w + x)
