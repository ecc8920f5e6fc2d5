"""The training objective of spec S32: L(θ) = L1(θ) + L2(θ).

* L1: pixel cross-entropy averaged over the non-ignored pixels of the batch.
* L2: λ/(2·B·N)·Σ_s w_s² over the weights of convolutions and linear layers — not biases, not
  normalization layers (Reading of S32). It is added to the objective explicitly, so the
  optimizer runs without weight decay of its own.

Default λ = weight_decay·B·N with ``weight_decay = 1e-4``: then L2 = weight_decay/2·Σw² and
its gradient is exactly weight decay 1e-4, whatever the batch and crop size. Setting λ itself
(``l2_lambda``) keeps the spec's 1/(B·N) normalization literally.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["SegmentationLoss", "cross_entropy_loss", "decay_weights", "l2_penalty"]

# Layers whose ``weight`` the L2 term covers (S32 Reading: conv and linear weights only).
DECAY_LAYERS: tuple[type[nn.Module], ...] = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Linear,
)


def decay_weights(model: nn.Module) -> list[Tensor]:
    """The trainable ``weight`` tensors of every conv / linear layer of ``model`` (each once)."""
    seen: set[int] = set()
    weights = []
    for module in model.modules():
        w = getattr(module, "weight", None)
        usable = isinstance(module, DECAY_LAYERS) and w is not None and w.requires_grad
        if usable and id(w) not in seen:
            seen.add(id(w))
            weights.append(w)
    return weights


def cross_entropy_loss(logits: Tensor, target: Tensor, *, ignore_index: int = 255) -> Tensor:
    """L1: mean pixel cross-entropy over the non-ignored pixels (0 when all are ignored).

    ``logits`` ``[B,C,H,W]`` (resized bilinearly when not at label size), ``target`` ``[B,H,W]``.
    """
    if logits.shape[-2:] != target.shape[-2:]:
        logits = F.interpolate(logits, size=target.shape[-2:], mode="bilinear", align_corners=False)
    total = F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction="sum")
    count = (target != ignore_index).sum().clamp_min(1)
    return total / count


def l2_penalty(weights: list[Tensor], *, lam: float, batch_size: int, num_pixels: int) -> Tensor:
    """L2 = λ/(2·B·N)·Σ w² (computed in float32)."""
    if not weights:
        return torch.zeros(())
    squares = torch.stack([w.float().pow(2).sum() for w in weights]).sum()
    return squares * (lam / (2.0 * batch_size * num_pixels))


class SegmentationLoss:
    """S32 objective for one model: ``loss, parts = criterion(logits, target)``.

    ``parts`` holds detached ``l1``, ``l2`` and ``loss`` for logging. ``weight_decay`` sets the
    default λ = weight_decay·B·N; ``l2_lambda`` overrides λ.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        weight_decay: float = 1e-4,
        l2_lambda: float | None = None,
        ignore_index: int = 255,
    ) -> None:
        self.weights = decay_weights(model)
        self.weight_decay = weight_decay
        self.l2_lambda = l2_lambda
        self.ignore_index = ignore_index

    def lam(self, batch_size: int, num_pixels: int) -> float:
        """λ for a batch of ``batch_size`` images with ``num_pixels`` pixels each."""
        if self.l2_lambda is not None:
            return self.l2_lambda
        return self.weight_decay * batch_size * num_pixels

    def __call__(self, logits: Tensor, target: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        b, n = target.shape[0], target.shape[-2] * target.shape[-1]
        l1 = cross_entropy_loss(logits, target, ignore_index=self.ignore_index)
        l2 = l2_penalty(self.weights, lam=self.lam(b, n), batch_size=b, num_pixels=n)
        loss = l1 + l2.to(l1.device)
        return loss, {"l1": l1.detach(), "l2": l2.detach(), "loss": loss.detach()}
