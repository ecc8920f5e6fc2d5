"""ReNet recurrent module (spec S2, claim 2; initialization S31)."""

from __future__ import annotations

import math

import torch.nn.functional as F
from torch import Tensor, nn

from dualseg.errors import ConfigError


class ReNetLayer(nn.Module):
    """Two bidirectional GRU sweeps (claim 2): rows, then columns of the rows' output.

    The first GRU (``hidden`` units per direction) reads every row left→right and right→left;
    the second reads every column of its ``2·hidden``-channel output top→bottom and
    bottom→top. Output: ``2·hidden`` channels (300 for the spec's 150 units) at the input
    resolution, ``[B, C, H, W] -> [B, 2·hidden, H, W]``.

    Rows (columns) are folded into the batch, time-first: one cuDNN ``nn.GRU`` call a sweep.

    ``patch`` (spec Reading: 1, i.e. resolution kept) > 1 reads non-overlapping patch×patch
    blocks as one step (ReNet's patches: ``pixel_unshuffle``), and upsamples the result back to
    H×W bilinearly.

    Initialization (S31: "a uniform distribution"): ``init="scaled"`` (the Reading, PyTorch's
    GRU default made explicit) draws weights and biases from U(-b, b) with b = ``init_bound``,
    by default 1/√H (H = hidden); ``init="standard"`` is the claim's literal *standard*
    uniform U(0, 1).
    """

    def __init__(
        self,
        in_channels: int,
        hidden: int = 150,
        patch: int = 1,
        *,
        init: str = "scaled",
        init_bound: float | None = None,
    ) -> None:
        super().__init__()
        if hidden < 1:
            raise ConfigError(f"renet_hidden (GRU units per direction) must be >= 1, got {hidden}")
        if patch < 1:
            raise ConfigError(f"renet_patch must be >= 1, got {patch}")
        if init not in ("scaled", "standard"):
            raise ConfigError(f"renet_init must be 'scaled' or 'standard', got {init!r}")
        if init_bound is not None and (init != "scaled" or not 0 < init_bound < math.inf):
            raise ConfigError(f"renet_init_bound must be > 0 and finite, with renet_init='scaled'"
                              f", got {init_bound} with {init!r}")  # fmt: skip
        self.hidden, self.patch = hidden, patch
        self.init, self.init_bound = init, init_bound
        self.out_channels = 2 * hidden
        self.rows = nn.GRU(in_channels * patch * patch, hidden, bidirectional=True)
        self.cols = nn.GRU(2 * hidden, hidden, bidirectional=True)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.init == "standard":
            low, high = 0.0, 1.0
        else:
            high = self.init_bound if self.init_bound is not None else 1.0 / math.sqrt(self.hidden)
            low = -high
        for p in self.parameters():
            nn.init.uniform_(p, low, high)

    def sweep_rows(self, x: Tensor) -> Tensor:
        """Horizontal sweep: ``[B, C, H, W] -> [B, H, W, 2·hidden]`` (forward half first)."""
        b, c, h, w = x.shape
        seq = x.permute(3, 0, 2, 1).reshape(w, b * h, c)  # [W, B·H, C]: time = column
        out, _ = self.rows(seq)  # [W, B·H, 2h]
        return out.view(w, b, h, -1).permute(1, 2, 0, 3)  # [B, H, W, 2h]

    def sweep_cols(self, y: Tensor) -> Tensor:
        """Vertical sweep over the rows' output: ``[B, H, W, D] -> [B, 2·hidden, H, W]``."""
        b, h, w, d = y.shape
        seq = y.permute(1, 0, 2, 3).reshape(h, b * w, d)  # [H, B·W, D]: time = row
        out, _ = self.cols(seq)  # [H, B·W, 2h]
        return out.view(h, b, w, -1).permute(1, 3, 0, 2)  # [B, 2h, H, W]

    def forward(self, x: Tensor) -> Tensor:
        size = x.shape[-2:]
        if self.patch > 1:
            p = self.patch
            pad_h, pad_w = (-size[0]) % p, (-size[1]) % p
            x = F.pixel_unshuffle(F.pad(x, (0, pad_w, 0, pad_h)), p)
        out = self.sweep_cols(self.sweep_rows(x))
        if self.patch > 1:
            full = (out.shape[-2] * self.patch, out.shape[-1] * self.patch)
            out = F.interpolate(out, size=full, mode="bilinear", align_corners=False)
            out = out[..., : size[0], : size[1]]
        return out.contiguous()

    def extra_repr(self) -> str:
        return f"hidden={self.hidden}, patch={self.patch}, init={self.init!r}"
