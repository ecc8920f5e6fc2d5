"""The re-optimization (embedding) model of method B, training step 3."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.transforms.v2 import functional as TF

from dualseg.errors import ConfigError
from dualseg.models import ASPP, build_backbone
from dualseg.models.base import pad_to_multiple
from dualseg.refine.decoder import LowLevelDecoder, low_level_tap
from dualseg.refine.taps import BaseTaps, TapRecord

log = logging.getLogger(__name__)


class EmbeddingNet(nn.Module):
    """``x [B,3,H,W]`` (normalized) -> embedding ``[B,C,H,W]`` (spec method B, step 3)."""

    def __init__(
        self, backbone: nn.Module, fuse: nn.Module, embed_dim: int, *,
        freeze_backbone: bool = False, decoder: nn.Module | None = None,
        low_level: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.backbone = backbone
        self.fuse = fuse
        self.decoder = decoder
        self.low_level = low_level
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
        local, low = self.backbone_features(x)
        return self.head(local, low)

    def backbone_features(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """The backbone's output ``[B,L,H/s,W/s]`` and, with a decoder, its ``low_level``
        submodule's stride-4 features."""
        if isinstance(self.backbone, BaseTaps):
            return self.backbone(x)
        x = self._layout(x)
        taps: list[Tensor] = []
        tap = self.backbone.get_submodule(self.low_level) if self.low_level else nn.Identity()
        handle = tap.register_forward_hook(lambda _m, _a, out: taps.append(out))
        try:
            with torch.no_grad() if self.freeze_backbone else contextlib.nullcontext():
                local = self.backbone(x)
        finally:
            handle.remove()
        return local, (taps[-1] if taps else None)

    def head(self, local: Tensor, low: Tensor | None = None) -> Tensor:
        """What learns on top of the backbone: ``fuse`` (ASPP), then the decoder if any."""
        f = self.fuse(self._layout(local))  # [B,C,H/s,W/s]
        if self.decoder is not None:
            f = self.decoder(f, low)  # [B,C,H/4,W/4]
        return f

    def head_at(self, local: Tensor, low: Tensor, at: Tensor) -> Tensor:
        """:meth:`head` at the ``at`` cells alone (bool ``[B,H/4,W/4]``; inference): ``[M,C]``."""
        return self.decoder.forward_at(self.fuse(self._layout(local)), low, at)

    def _layout(self, x: Tensor) -> Tensor:
        """``x`` channels-last at inference, where oneDNN's convolutions on the CPU run 1.3-2.5x
        faster (the refiner's weights are too); training keeps its layout and its numbers."""
        return x if self.training else x.contiguous(memory_format=torch.channels_last)

    def forward(self, x: Tensor) -> Tensor:
        f = self.features(x)  # [B,C,h,w]
        return F.interpolate(f, size=x.shape[-2:], mode="bilinear", align_corners=False)

    @staticmethod
    def sampled_cells(
        mask: Tensor, size: tuple[int, int], covered: tuple[float, float] | None = None
    ) -> Tensor:
        """The cells (bool ``[B,h,w]``) of a ``size`` map that :meth:`sample` reads for the
        ``mask`` pixels (``[B,H,W]``), with a margin for float rounding at cell edges."""
        H, W = covered if covered is not None else mask.shape[-2:]
        rows = _neighbour_matrix(mask.shape[-2], size[0], H, mask.device)  # [h,H]
        cols = _neighbour_matrix(mask.shape[-1], size[1], W, mask.device)  # [w,W]
        # a cell is read if some mask pixel of a row and a column reading it is set
        b, n, m = mask.shape
        per_row = rows @ mask.float().transpose(0, 1).reshape(n, b * m)  # [h,B·W]
        per_row = per_row.view(-1, b, m).transpose(0, 1).reshape(-1, m)  # [B·h,W]
        return (per_row @ cols.T).view(b, -1, cols.shape[0]) > 0  # [B,h,w]

    @staticmethod
    def sample(
        features: Tensor, mask: Tensor, covered: tuple[float, float] | None = None
    ) -> Tensor:
        """Embeddings ``[M,C]`` of the ``mask`` pixels (``[B,H,W]`` bool, input size), in
        ``mask.nonzero()`` order — equal to ``upsample(features)[b, :, y, x]`` for each pixel."""
        b, c = features.shape[:2]
        H, W = covered if covered is not None else mask.shape[-2:]
        idx = mask.nonzero()  # [M,3] (b, y, x)
        if idx.numel() == 0:
            return features.new_zeros(0, c)
        # align_corners=False: source coordinate (x + 0.5) * w / W - 0.5, clamped at the border
        gx = (idx[:, 2].to(features.dtype) + 0.5) / W * 2 - 1
        gy = (idx[:, 1].to(features.dtype) + 0.5) / H * 2 - 1
        if b == 1:  # one image (the usual inference batch): its points are the one row
            grid = torch.stack([gx, gy], dim=1)[None, None]  # [1,1,M,2]
        else:  # one row of sample points per image, padded to the largest count
            counts = torch.bincount(idx[:, 0], minlength=b)
            m = int(counts.max())
            offset = torch.cumsum(counts, 0) - counts
            slot = torch.arange(idx.shape[0], device=idx.device) - offset[idx[:, 0]]
            grid = features.new_zeros(b, 1, m, 2)
            grid[idx[:, 0], 0, slot, 0] = gx
            grid[idx[:, 0], 0, slot, 1] = gy
        out = F.grid_sample(
            features, grid, mode="bilinear", padding_mode="border", align_corners=False
        )[:, :, 0, :].permute(0, 2, 1)  # [B,m,C]
        return out[0] if b == 1 else out[idx[:, 0], slot]  # [M,C], without the padding


@functools.lru_cache(maxsize=16)  # one per image size seen: inference repeats a few sizes
def _neighbour_matrix(n: int, cells: int, span: float, device: torch.device) -> Tensor:
    """``[cells, n]``: 1 where pixel ``i`` reads cell ``c`` (of ``cells`` spanning ``span`` px)
    bilinearly, as :meth:`EmbeddingNet.sample`, with a 1e-4 margin."""
    src = ((torch.arange(n, dtype=torch.float64) + 0.5) * (cells / span) - 0.5).clamp(0, cells - 1)
    first = (src - 1e-4).floor().clamp(0, cells - 1)
    last = ((src + 1e-4).floor() + 1).clamp(0, cells - 1)
    c = torch.arange(cells, dtype=torch.float64)[:, None]
    return ((c >= first) & (c <= last)).float().to(device)


def p1_filter(images: Tensor, sigma: float) -> Tensor:
    """P1's filter of normalized images ``[B,3,H,W]``: a Gaussian blur of ``sigma`` px
    (kernel ±3σ, reflected borders; 0: none)."""
    if sigma <= 0:
        return images
    k = 2 * math.ceil(3 * sigma) + 1
    # reflection needs a half-kernel shorter than the side: cut the kernel to the image
    h, w = images.shape[-2:]
    kh, kw = min(k, 2 * h - 1), min(k, 2 * w - 1)
    return TF.gaussian_blur(images, kernel_size=[kw, kh], sigma=[sigma, sigma])  # (x, y)


def embed_features(
    net: EmbeddingNet, images: Tensor, input_scale: float, output_stride: int
) -> Tensor:
    """Low-resolution embedding of ``images`` resized by ``input_scale`` and padded at the bottom
    and right to a multiple of ``output_stride``: it spans :func:`embedding_cover` pixels."""
    return net.head(*embed_backbone(net, images, input_scale, output_stride))


def embed_backbone(
    net: EmbeddingNet, images: Tensor, input_scale: float, output_stride: int
) -> tuple[Tensor, Tensor | None]:
    """:meth:`EmbeddingNet.backbone_features` of the resized, padded input."""
    if input_scale != 1.0:
        images = F.interpolate(
            images, scale_factor=input_scale, mode="bilinear", align_corners=False
        )
    return net.backbone_features(pad_to_multiple(images, output_stride))


def embed_pixels(
    net: EmbeddingNet, images: Tensor, mask: Tensor, input_scale: float, output_stride: int
) -> Tensor:
    """Embeddings ``[M,C]`` of the ``mask`` pixels of ``images`` (``mask.nonzero()`` order)."""
    feats = embed_features(net, images, input_scale, output_stride)
    covered = embedding_cover(images.shape[-2:], input_scale, output_stride)
    return EmbeddingNet.sample(feats, mask, covered)


def embedding_cover(
    size: tuple[int, int], input_scale: float, output_stride: int
) -> tuple[float, float]:
    """The pixels of an image of ``size`` that :func:`embed_features`' map spans: the resized
    image (``floor(H·s)`` rows) padded to a multiple of the stride, mapped back by ``1/s``."""
    k = max(1, output_stride)
    h, w = (math.floor(n * input_scale) if input_scale != 1.0 else n for n in size)
    return math.ceil(h / k) * k / input_scale, math.ceil(w / k) * k / input_scale


def build_embedding_net(
    backbone: str, *, embed_dim: int, output_stride: int, aspp_rates: Sequence[int],
    weights: str | os.PathLike[str] | None = None, freeze_backbone: bool = False,
    decoder_channels: int = 0,
) -> EmbeddingNet:  # fmt: skip
    """Backbone from :func:`dualseg.models.build_backbone` + :class:`dualseg.models.ASPP`."""
    low_level, low_channels = low_level_tap(backbone) if decoder_channels else (None, 0)
    net, channels = build_backbone(backbone, output_stride=output_stride, weights=weights)
    fuse = ASPP(channels, embed_dim, tuple(aspp_rates))
    decoder = LowLevelDecoder(low_channels, embed_dim, decoder_channels) if low_level else None
    return EmbeddingNet(net, fuse, embed_dim, freeze_backbone=freeze_backbone, decoder=decoder,
                        low_level=low_level)  # fmt: skip


def tap_embedding_net(
    record: TapRecord, *, embed_dim: int, aspp_rates: Sequence[int], decoder_channels: int
) -> EmbeddingNet:
    """ASPP on the high tap, the stride-4 decoder on the low one (base: :meth:`BaseTaps.attach`)."""
    fuse = ASPP(record.channels[1], embed_dim, tuple(aspp_rates))
    decoder = LowLevelDecoder(record.channels[0], embed_dim, decoder_channels)
    return EmbeddingNet(BaseTaps(record), fuse, embed_dim, freeze_backbone=True, decoder=decoder,
                        low_level=record.names[0])  # fmt: skip


def init_backbone_from(
    backbone: nn.Module, source: nn.Module | Mapping[str, Tensor], *, strict: bool = False
) -> int:
    """Copy a base model's backbone weights into ``backbone``; returns how many tensors matched."""
    state = source.state_dict() if isinstance(source, nn.Module) else dict(source)
    names = sorted(state, key=lambda k: (0 if "rgb" in k.lower() else 1, k))
    target = backbone.state_dict()
    copied: dict[str, Tensor] = {}
    prefixes: set[str] = set()
    for key, value in target.items():
        for cand in names:
            if (cand == key or cand.endswith("." + key)) and state[cand].shape == value.shape:
                copied[key] = state[cand]
                prefixes.add(cand[: len(cand) - len(key)])
                break
    if strict:
        theirs = sum(1 for k in state if any(k.startswith(p) for p in prefixes))
        if len(copied) < len(target) or theirs > len(copied):
            raise ConfigError(
                f"the base model's backbone is not the embedding's: {len(copied)} of the "
                f"embedding backbone's {len(target)} tensors found in the base, which holds "
                f"{theirs} there; pass the base's backbone name (--backbone)"
            )
    backbone.load_state_dict(copied, strict=False)
    log.info("backbone initialized from the base model: %d of %d tensors", len(copied), len(target))
    return len(copied)
