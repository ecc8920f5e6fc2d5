"""What every dualseg model shares: padding to the output stride, upsampling back, and the
``predict_proba`` / ``predict`` methods (spec S4: softmax, bilinear upsampling, argmax)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def pad_to_multiple(x: Tensor, multiple: int) -> Tensor:
    """Zero-pad the bottom and right of ``[B, C, H, W]`` so H and W are multiples of
    ``multiple``. Zero in a normalized image is the mean colour."""
    h, w = x.shape[-2:]
    pad_h, pad_w = (-h) % multiple, (-w) % multiple
    if pad_h or pad_w:
        x = F.pad(x, (0, pad_w, 0, pad_h))
    return x


def upsample_crop(scores: Tensor, padded: tuple[int, int], size: tuple[int, int]) -> Tensor:
    """Bilinearly upsample feature-resolution scores to the padded input size, then crop the
    padding away: logits at the caller's ``size``."""
    scores = F.interpolate(scores, size=padded, mode="bilinear", align_corners=False)
    return scores[..., : size[0], : size[1]]


class SegmentationModel(nn.Module):
    """Base of every model: ``forward`` returns logits ``[B, C, H, W]`` at input size."""

    num_classes: int

    def predict_proba(self, x: Tensor) -> Tensor:
        """Per-pixel class probabilities (softmax over classes), ``[B, C, H, W]``."""
        return torch.softmax(self(x), dim=1)

    @torch.no_grad()
    def predict(self, x: Tensor) -> Tensor:
        """Per-pixel class index (argmax), ``int64 [B, H, W]``."""
        return self(x).argmax(dim=1)
