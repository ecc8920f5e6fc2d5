"""The re-optimization (embedding) model of method B, training step 3.

backbone (ResNet / MobileNetV2 / any timm model) -> ASPP fusing multi-scale features into a
C-dimensional embedding (default C = 256) -> bilinear upsampling to the input size. The set
{(Feat_i, Label_i)} is the embedding at the near-boundary pixels; since only those pixels are
ever used, :meth:`EmbeddingNet.sample` reads them straight from the low-resolution map with the
same bilinear weights as the full upsampling (no ``[B,C,H,W]`` tensor at input size needed).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)


class EmbeddingNet(nn.Module):
    """``x [B,3,H,W]`` (normalized) -> embedding ``[B,C,H,W]`` (spec method B, step 3).

    ``backbone(x)`` must return one feature map ``[B, backbone_channels, H/s, W/s]``;
    ``fuse`` maps it to ``[B, C, H/s, W/s]`` (dualseg's ASPP by default).

    ``freeze_backbone=True`` (method B with the base model's own backbone, frozen): the backbone
    keeps its weights and its normalization statistics (it stays in eval mode when the net is
    put in training mode) and runs without autograd; only ``fuse`` learns.
    """

    def __init__(
        self, backbone: nn.Module, fuse: nn.Module, embed_dim: int, *, freeze_backbone: bool = False
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.fuse = fuse
        self.embed_dim = embed_dim
        self.freeze_backbone = freeze_backbone
        if freeze_backbone:
            self.backbone.requires_grad_(False)
            self.backbone.eval()

    def train(self, mode: bool = True) -> EmbeddingNet:
        super().train(mode)
        if self.freeze_backbone:
            self.backbone.eval()  # frozen: BatchNorm running statistics stay the base's
        return self

    def features(self, x: Tensor) -> Tensor:
        """Low-resolution embedding ``[B,C,h,w]`` (before the upsampling)."""
        if self.freeze_backbone:
            with torch.no_grad():
                local = self.backbone(x)
            return self.fuse(local)
        return self.fuse(self.backbone(x))

    def forward(self, x: Tensor) -> Tensor:
        f = self.features(x)  # [B,C,h,w]
        return F.interpolate(f, size=x.shape[-2:], mode="bilinear", align_corners=False)

    @staticmethod
    def sample(features: Tensor, mask: Tensor) -> Tensor:
        """Embeddings ``[M,C]`` of the ``mask`` pixels (``[B,H,W]`` bool, input size), in
        ``mask.nonzero()`` order — equal to ``upsample(features)[b, :, y, x]`` for each pixel.
        """
        b, c = features.shape[:2]
        H, W = mask.shape[-2:]
        idx = mask.nonzero()  # [M,3] (b, y, x)
        if idx.numel() == 0:
            return features.new_zeros(0, c)
        # align_corners=False: source coordinate (x + 0.5) * w / W - 0.5, clamped at the border
        gx = (idx[:, 2].to(features.dtype) + 0.5) / W * 2 - 1
        gy = (idx[:, 1].to(features.dtype) + 0.5) / H * 2 - 1
        # one row of sample points per image: pad to the largest count, then drop the padding
        counts = torch.bincount(idx[:, 0], minlength=b)
        m = int(counts.max())
        offset = torch.cumsum(counts, 0) - counts
        slot = torch.arange(idx.shape[0], device=idx.device) - offset[idx[:, 0]]
        grid = features.new_zeros(b, 1, m, 2)
        grid[idx[:, 0], 0, slot, 0] = gx
        grid[idx[:, 0], 0, slot, 1] = gy
        out = F.grid_sample(
            features, grid, mode="bilinear", padding_mode="border", align_corners=False
        )
        return out[:, :, 0, :].permute(0, 2, 1)[idx[:, 0], slot]  # [M,C]


def p1_filter(images: Tensor, sigma: float) -> Tensor:
    """P1's filtering of the (normalized) input images ``[B,3,H,W]``: a Gaussian blur of
    standard deviation ``sigma`` px (kernel ±3σ, reflected borders); ``sigma == 0`` returns
    the images unfiltered. Blur commutes with the per-channel normalization, so it may come
    after it."""
    if sigma <= 0:
        return images
    from torchvision.transforms.v2 import functional as TF

    k = 2 * math.ceil(3 * sigma) + 1
    return TF.gaussian_blur(images, kernel_size=[k, k], sigma=[sigma, sigma])


def embed_features(net: EmbeddingNet, images: Tensor, input_scale: float = 1.0) -> Tensor:
    """Low-resolution embedding of ``images``, optionally of a resized copy (``input_scale``)."""
    if input_scale != 1.0:
        images = F.interpolate(
            images, scale_factor=input_scale, mode="bilinear", align_corners=False
        )
    return net.features(images)


def build_embedding_net(
    backbone: str = "mobilenet_v2",
    *,
    embed_dim: int = 256,
    output_stride: int = 8,
    aspp_rates: Sequence[int] = (4, 6, 8, 12),
    weights: str | os.PathLike[str] | None = None,
    freeze_backbone: bool = False,
) -> EmbeddingNet:
    """Backbone from :func:`dualseg.models.build_backbone` + :class:`dualseg.models.ASPP`.

    ``weights``: ``None`` (random init), ``"imagenet"`` or a file, as for ``build_backbone``.
    ``freeze_backbone``: see :class:`EmbeddingNet` (freeze after loading the base's weights).
    """
    from dualseg.models import ASPP, build_backbone

    net, channels = build_backbone(backbone, output_stride=output_stride, weights=weights)
    fuse = ASPP(channels, embed_dim, tuple(aspp_rates))
    return EmbeddingNet(net, fuse, embed_dim, freeze_backbone=freeze_backbone)


def init_backbone_from(backbone: nn.Module, source: nn.Module | Mapping[str, Tensor]) -> int:
    """Copy a base model's backbone weights into ``backbone``; returns how many tensors matched.

    Works on names, not on a fixed layout: a backbone tensor ``layer1.0.conv1.weight`` takes the
    base model's tensor whose name ends with ``.layer1.0.conv1.weight`` and has the same shape
    (the RGB branch first for method A's dual-branch network, then the first match in order).
    """
    state = source.state_dict() if isinstance(source, nn.Module) else dict(source)
    names = sorted(state, key=lambda k: (0 if "rgb" in k.lower() else 1, k))
    target = backbone.state_dict()
    copied: dict[str, Tensor] = {}
    for key, value in target.items():
        for cand in names:
            if (cand == key or cand.endswith("." + key)) and state[cand].shape == value.shape:
                copied[key] = state[cand]
                break
    backbone.load_state_dict(copied, strict=False)
    log.info("backbone initialized from the base model: %d of %d tensors", len(copied), len(target))
    return len(copied)
