"""Method A's network (spec S2, S4): two branches (RGB and grayscale) fused by learnable weights.

RGB ─┬─────────────────────────→ Branch(rgb)  ─┐
     └─ gray (BT.601 luma) ───→ Branch(gray) ─┴→ Fusion → softmax → upsample → log → logits
Branch: backbone → CoordChannels → ReNetLayer → CoordChannels → ReNetLayer → ASPP
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from dualseg.errors import ConfigError
from dualseg.imaging import IMAGENET_MEAN, IMAGENET_STD
from dualseg.models.aspp import ASPP, ASPPv3Head
from dualseg.models.base import SegmentationModel, pad_to_multiple, upsample_crop
from dualseg.models.coord import CoordChannels
from dualseg.models.renet import ReNetLayer

# ITU-R BT.601 luma coefficients (R, G, B).
BT601 = (0.299, 0.587, 0.114)
UPSAMPLE_ORDERS = ("softmax_first", "logits_first")
RENET_NORMS = ("none", "batch")


class Branch(nn.Module):
    """One branch of spec S2: backbone → (CoordChannels → ReNetLayer) × ``renet_layers`` →
    ASPP, ``[B, in, H, W] -> [B, num_classes, H/os, W/os]``.

    ``renet_norm="batch"`` (beyond the claims) normalizes the features each ReNetLayer reads:
    MobileNetV2's (std ~0.19 on CamVid) are faint beside the coordinates (std ~0.6).
    """

    def __init__(
        self,
        backbone: nn.Module,
        backbone_channels: int,
        num_classes: int,
        *,
        coord_channels: bool = True,
        coord_radius: str = "scaled",
        renet_layers: int = 2,
        renet_hidden: int = 150,
        renet_patch: int = 1,
        renet_init: str = "scaled",
        renet_init_bound: float | None = None,
        renet_norm: str = "none",
        renet_skip: bool = False,
        aspp_rates: Sequence[int] = (4, 6, 8, 12),
        aspp_style: str = "v2",
        aspp_init_std: float = 0.01,
    ) -> None:
        super().__init__()
        if renet_layers not in (0, 1, 2):
            raise ConfigError(f"renet_layers must be 0, 1 or 2, got {renet_layers}")
        if renet_norm not in RENET_NORMS:
            raise ConfigError(f"renet_norm must be one of {RENET_NORMS}, got {renet_norm!r}")
        self.backbone = backbone
        context: OrderedDict[str, nn.Module] = OrderedDict()
        channels = backbone_channels
        for k in range(1, renet_layers + 1):
            if renet_norm == "batch":  # on the features only: the coordinates stay as claim 4
                context[f"norm{k}"] = nn.BatchNorm2d(channels)
            if coord_channels:
                context[f"coord{k}"] = CoordChannels(coord_radius)
                channels += 3
            context[f"renet{k}"] = ReNetLayer(
                channels, renet_hidden, renet_patch, init=renet_init, init_bound=renet_init_bound
            )
            channels = 2 * renet_hidden
        self.context = nn.Sequential(context)
        self.renet_skip = renet_skip and renet_layers > 0
        if self.renet_skip:
            channels += backbone_channels
        if aspp_style == "v2":
            self.aspp: nn.Module = ASPP(channels, num_classes, aspp_rates, init_std=aspp_init_std)
        elif aspp_style == "v3":
            self.aspp = ASPPv3Head(channels, num_classes, aspp_rates)
        else:
            raise ConfigError(f"aspp_style must be 'v2' or 'v3', got {aspp_style!r}")

    def forward(self, x: Tensor) -> Tensor:
        x = self.backbone(x)  # [B, C_bb, H/os, W/os] local features
        context = self.context(x)  # coord1 → renet1 → coord2 → renet2: [B, 300, H/os, W/os]
        if self.renet_skip:  # local features beside their context: [B, C_bb + 300, H/os, W/os]
            context = torch.cat([x, context], dim=1)
        return self.aspp(context)  # [B, num_classes, H/os, W/os]


class Fusion(nn.Module):
    """Weighted sum of the branches' scores: two learnable scalars initialized equal (spec S2
    Reading), a pair per class (``"per_class"``) or a fixed 0.5/0.5 (``"fixed"``)."""

    def __init__(self, num_classes: int, mode: str = "scalar") -> None:
        super().__init__()
        shapes = {"scalar": (2, 1), "per_class": (2, num_classes), "fixed": (2, 1)}
        if mode not in shapes:
            raise ConfigError(f"fusion must be one of {', '.join(shapes)}, got {mode!r}")
        self.mode = mode
        init = torch.full(shapes[mode], 0.5)
        if mode == "fixed":
            self.register_buffer("weight", init)
        else:
            self.weight = nn.Parameter(init)

    def forward(self, rgb: Tensor, gray: Tensor) -> Tensor:
        w = self.weight[:, None, :, None, None]  # [2, 1, C or 1, 1, 1]
        return w[0] * rgb + w[1] * gray

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}"


class DualBranchNet(SegmentationModel):
    """Spec S2/S4: RGB and grayscale branches (the BT.601 luma computed inside; ``gray=None``
    for one branch), fused, upsampled to the input size: ``[B, 3, H, W] -> [B, C, H, W]``.

    ``upsample_order`` (S44): ``"softmax_first"``, the claim's, upsamples the probabilities
    and returns their log (logits whose softmax is that map); ``"logits_first"`` upsamples
    the scores (DeepLab's order).
    """

    def __init__(
        self,
        rgb: Branch,
        gray: Branch | None,
        num_classes: int,
        *,
        output_stride: int = 8,
        fusion: str = "scalar",
        upsample_order: str = "softmax_first",
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        if upsample_order not in UPSAMPLE_ORDERS:
            raise ConfigError(
                f"upsample_order must be one of {UPSAMPLE_ORDERS}, got {upsample_order!r}"
            )
        self.num_classes, self.output_stride = num_classes, output_stride
        self.upsample_order, self.in_channels = upsample_order, in_channels
        self.rgb, self.gray = rgb, gray
        self.fusion = Fusion(num_classes, fusion) if gray is not None else None
        for name, values in (("mean", mean), ("std", std), ("luma", BT601)):  # constants
            t = torch.tensor(values, dtype=torch.float32).view(1, 3, 1, 1)
            self.register_buffer(name, t, persistent=False)
        self.gray_mean = sum(c * m for c, m in zip(BT601, mean))
        self.gray_std = sum(c * s for c, s in zip(BT601, std))

    def to_gray(self, x: Tensor) -> Tensor:
        """Normalized RGB ``[B, 3, H, W]`` -> normalized BT.601 luma ``[B, 1, H, W]``."""
        rgb = x * self.std + self.mean  # un-normalize to [0, 1]
        gray = (rgb * self.luma).sum(1, keepdim=True)
        return (gray - self.gray_mean) / self.gray_std

    def forward(self, x: Tensor) -> Tensor:
        self.check_input(x)
        size = (x.shape[-2], x.shape[-1])
        x = pad_to_multiple(x, self.output_stride)
        scores = self.rgb(x)  # [B, C, H'/os, W'/os]
        if self.gray is not None and self.fusion is not None:
            scores = self.fusion(scores, self.gray(self.to_gray(x)))
        padded = (x.shape[-2], x.shape[-1])
        if self.upsample_order == "logits_first":
            return upsample_crop(scores, padded, size)
        if scores.dtype in (torch.float16, torch.bfloat16):  # autocast: softmax in fp32
            scores = scores.float()
        probs = upsample_crop(scores.softmax(1), padded, size)  # S44: softmax, upsample
        # A bilinear mix of positive values stays positive; the floor guards exp underflow.
        return probs.clamp_min(torch.finfo(probs.dtype).tiny).log()
