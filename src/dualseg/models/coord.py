"""Coordinate channels (spec S2, claim 4)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dualseg.errors import ConfigError

RADII = ("scaled", "index", "centred")


class CoordChannels(nn.Module):
    """Append three e×f channels ``i``, ``j``, ``r`` to a feature map (claim 4).

    ``i`` is the row index 0..e-1 and ``j`` the column index 0..f-1, both linearly scaled to
    [-1, 1]; a map with a single row (column) gets ``i = 0`` (``j = 0``), never NaN.
    ``r = sqrt(m² + n²)`` with ``radius="scaled"`` (the spec's Reading: m, n are the scaled
    i, j, so r ∈ [0, √2], 0 at the centre); ``radius="index"`` uses the raw indices instead
    (0 at the top-left corner); ``radius="centred"`` is CoordConv's (Liu et al. 2018) radius,
    the distance in raw indices from the map's centre, ``sqrt((a - (e-1)/2)² + (b - (f-1)/2)²)``.

    ``[B, C, e, f] -> [B, C + 3, e, f]``.
    """

    def __init__(self, radius: str = "scaled") -> None:
        super().__init__()
        if radius not in RADII:
            raise ConfigError(f"coord_radius must be one of {', '.join(RADII)}, got {radius!r}")
        self.radius = radius

    @staticmethod
    def _axis(n: int, like: Tensor) -> Tensor:
        """``linspace(-1, 1, n)``, and 0 for a single row/column (it sits at the centre), in
        tensor arithmetic only: an export traced at one size keeps no Python branch on n."""
        k = torch.arange(n, device=like.device, dtype=like.dtype)
        last = k[-1:]  # n - 1, as a tensor
        return (2 * k - last) / last.clamp(min=1)

    def forward(self, x: Tensor) -> Tensor:
        b, _, e, f = x.shape
        i = self._axis(e, x)[:, None].expand(e, f)  # [e, f], constant along a row
        j = self._axis(f, x)[None, :].expand(e, f)  # [e, f], constant along a column
        if self.radius == "scaled":
            r = torch.sqrt(i * i + j * j)
        else:  # raw indices, from the corner ("index") or from the centre ("centred")
            ri = torch.arange(e, device=x.device, dtype=x.dtype)[:, None]
            rj = torch.arange(f, device=x.device, dtype=x.dtype)[None, :]
            if self.radius == "centred":
                ri, rj = ri - (e - 1) / 2, rj - (f - 1) / 2
            r = torch.sqrt(ri * ri + rj * rj)
        coords = torch.stack([i, j, r.expand(e, f)])  # [3, e, f]
        return torch.cat([x, coords.unsqueeze(0).expand(b, -1, -1, -1)], dim=1)

    def extra_repr(self) -> str:
        return f"radius={self.radius!r}"
