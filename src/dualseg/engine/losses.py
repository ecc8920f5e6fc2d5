"""The training objective of spec S32: L(θ) = L1(θ) + L2(θ).

* L1: pixel cross-entropy averaged over the B·N pixels of the batch, as the claim says
  (``l1_reduction="batch_pixels"``; ignored pixels add 0 to the sum and count in B·N), so L1
  and L2 share the normalization 1/(B·N) and their balance does not move with the share of
  ignored pixels in a batch. ``"valid_pixels"`` averages over the non-ignored pixels instead
  (PyTorch's ``ignore_index`` mean; the reading used before this option existed).
* L2: λ/(2·B·N)·Σ_s w_s² over the weight parameters — the weights of convolutions, linear
  layers and recurrent layers (every GRU weight matrix), not biases, not normalization layers
  (Reading of S32; ``l2_recurrent=False`` leaves the recurrent weights out). It is added to the
  objective explicitly, so the optimizer runs without weight decay of its own.

Default λ = weight_decay·B·N with ``weight_decay = 1e-4``: then L2 = weight_decay/2·Σw² and
its gradient is exactly weight decay 1e-4, whatever the batch and crop size. Setting λ itself
(``l2_lambda``) keeps the spec's 1/(B·N) normalization literally.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["L1_REDUCTIONS", "SegmentationLoss", "cross_entropy_loss", "decay_weights", "l2_penalty"]

L1_REDUCTIONS = ("batch_pixels", "valid_pixels")

# Layers whose ``weight`` the L2 term covers, besides recurrent layers (S32 Reading).
DECAY_LAYERS: tuple[type[nn.Module], ...] = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.Linear,
)


def decay_weights(model: nn.Module, *, recurrent: bool = True) -> list[Tensor]:
    """The trainable weight tensors the L2 term covers, each once.

    The ``weight`` of every conv / linear layer and, with ``recurrent=True``, every weight
    matrix of a recurrent layer (``weight_ih_l0``, ``weight_hh_l0_reverse``, ... of an
    ``nn.GRU``); never biases, never normalization layers.
    """
    seen: set[int] = set()
    weights = []
    for module in model.modules():
        if isinstance(module, DECAY_LAYERS):
            candidates = [module.weight]
        elif recurrent and isinstance(module, nn.RNNBase):
            candidates = [p for n, p in module.named_parameters() if n.startswith("weight")]
        else:
            continue
        for w in candidates:
            if w is not None and w.requires_grad and id(w) not in seen:
                seen.add(id(w))
                weights.append(w)
    return weights


def cross_entropy_loss(
    logits: Tensor,
    target: Tensor,
    *,
    ignore_index: int = 255,
    reduction: str = "batch_pixels",
) -> Tensor:
    """L1: pixel cross-entropy summed over the non-ignored pixels, divided by B·N
    (``reduction="batch_pixels"``) or by the count of non-ignored pixels (``"valid_pixels"``);
    0 when every pixel is ignored.

    ``logits`` ``[B,C,H,W]`` (resized bilinearly when not at label size), ``target`` ``[B,H,W]``.
    """
    if reduction not in L1_REDUCTIONS:
        raise ValueError(f"reduction must be one of {L1_REDUCTIONS}, got {reduction!r}")
    if logits.shape[-2:] != target.shape[-2:]:
        logits = F.interpolate(logits, size=target.shape[-2:], mode="bilinear", align_corners=False)
    total = F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction="sum")
    if reduction == "batch_pixels":
        return total / target.numel()
    return total / (target != ignore_index).sum().clamp_min(1)


def l2_penalty(weights: list[Tensor], *, lam: float, batch_size: int, num_pixels: int) -> Tensor:
    """L2 = λ/(2·B·N)·Σ w² (computed in float32)."""
    if not weights:
        return torch.zeros(())
    squares = torch.stack([w.float().pow(2).sum() for w in weights]).sum()
    return squares * (lam / (2.0 * batch_size * num_pixels))


class SegmentationLoss:
    """S32 objective for one model: ``loss, parts = criterion(logits, target)``.

    ``parts`` holds detached ``l1``, ``l2`` and ``loss`` for logging. ``weight_decay`` sets the
    default λ = weight_decay·B·N; ``l2_lambda`` overrides λ. ``l1_reduction`` and
    ``l2_recurrent``: the S32 readings above.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        weight_decay: float = 1e-4,
        l2_lambda: float | None = None,
        ignore_index: int = 255,
        l1_reduction: str = "batch_pixels",
        l2_recurrent: bool = True,
    ) -> None:
        if l1_reduction not in L1_REDUCTIONS:
            raise ValueError(f"l1_reduction must be one of {L1_REDUCTIONS}, got {l1_reduction!r}")
        self.weights = decay_weights(model, recurrent=l2_recurrent)
        self.weight_decay = weight_decay
        self.l2_lambda = l2_lambda
        self.ignore_index = ignore_index
        self.l1_reduction = l1_reduction

    def lam(self, batch_size: int, num_pixels: int) -> float:
        """λ for a batch of ``batch_size`` images with ``num_pixels`` pixels each."""
        if self.l2_lambda is not None:
            return self.l2_lambda
        return self.weight_decay * batch_size * num_pixels

    def __call__(self, logits: Tensor, target: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        b, n = target.shape[0], target.shape[-2] * target.shape[-1]
        l1 = cross_entropy_loss(
            logits, target, ignore_index=self.ignore_index, reduction=self.l1_reduction
        )
        l2 = l2_penalty(self.weights, lam=self.lam(b, n), batch_size=b, num_pixels=n)
        loss = l1 + l2.to(l1.device)
        return loss, {"l1": l1.detach(), "l2": l2.detach(), "loss": loss.detach()}
