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

Two options beyond S32, both off by default (then L1 is exactly the S32 term):

* class weights ``w_c``: each pixel's CE is multiplied by w_y; with ``"valid_pixels"`` L1 is
  Σ w_y·CE / Σ w_y over the pixels used (PyTorch's weighted mean), with ``"batch_pixels"`` the
  weighted sum is divided by B·N as above; :func:`median_frequency_weights` gives SegNet's
  median frequency balancing.
* OHEM (mmsegmentation's ``OHEMPixelSampler``): only the pixels whose softmax probability of
  their true class is below ``ohem_thresh`` count — raised, when that keeps fewer, to the
  (k+1)-th smallest probability with k = ``ohem_min_kept`` × batch size, so at least k pixels
  count (all of them when the batch has fewer). The dropped pixels are treated as ignored:
  with ``"valid_pixels"`` L1 is the mean over the kept pixels, with ``"batch_pixels"`` they
  add 0 and still count in B·N.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dualseg.errors import ConfigError

__all__ = [
    "L1_REDUCTIONS",
    "MEDIAN_FREQUENCY",
    "SegmentationLoss",
    "class_weights_for",
    "cross_entropy_loss",
    "decay_weights",
    "l2_penalty",
    "median_frequency_weights",
    "ohem_keep_mask",
]

MEDIAN_FREQUENCY = "median_frequency"  # the class_weights value asking for SegNet's weights

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
    class_weights: Tensor | None = None,
    ohem_thresh: float | None = None,
    ohem_min_kept: int | None = None,
) -> Tensor:
    """L1: pixel cross-entropy summed over the non-ignored pixels, divided by B·N
    (``reduction="batch_pixels"``) or by the count of non-ignored pixels (``"valid_pixels"``);
    0 when every pixel is ignored.

    ``logits`` ``[B,C,H,W]`` (resized bilinearly when not at label size), ``target`` ``[B,H,W]``.
    ``class_weights`` ``[C]``: each pixel's CE times w_y; ``"valid_pixels"`` then divides by
    Σ w_y over the pixels used (the weighted mean), ``"batch_pixels"`` still by B·N.
    ``ohem_thresh``: only the pixels :func:`ohem_keep_mask` keeps count, the others are
    treated as ignored (then ``ohem_min_kept`` is required; the config's
    ``optim.ohem_min_kept`` holds the default). Defaults: the S32 term.
    """
    if reduction not in L1_REDUCTIONS:
        raise ValueError(f"reduction must be one of {L1_REDUCTIONS}, got {reduction!r}")
    if logits.shape[-2:] != target.shape[-2:]:
        logits = F.interpolate(logits, size=target.shape[-2:], mode="bilinear", align_corners=False)
    logits = logits.float()
    if ohem_thresh is not None:
        if ohem_min_kept is None:
            raise ConfigError("ohem_thresh needs ohem_min_kept too (see optim.ohem_min_kept)")
        keep = ohem_keep_mask(
            logits, target, thresh=ohem_thresh, min_kept=ohem_min_kept, ignore_index=ignore_index
        )
        target = target.masked_fill(~keep, ignore_index)
    weight = None if class_weights is None else class_weights.to(logits.device, torch.float32)
    total = F.cross_entropy(
        logits, target, weight=weight, ignore_index=ignore_index, reduction="sum"
    )
    if reduction == "batch_pixels":  # every pixel of the batch counts 1 in the divisor
        return total / target.numel()
    valid = target != ignore_index
    if weight is None:
        return total / valid.sum().clamp_min(1)
    return total / weight[target[valid]].sum().clamp_min(1e-12)


@torch.no_grad()
def ohem_keep_mask(
    logits: Tensor, target: Tensor, *, thresh: float, min_kept: int, ignore_index: int = 255
) -> Tensor:
    """OHEM pixel selection (mmseg ``OHEMPixelSampler``): bool ``[B,H,W]``, True = counts.

    Keeps the valid pixels whose probability of the true class is below
    ``max(thresh, p_(k))``, where ``p_(k)`` is the (k+1)-th smallest such probability and
    ``k = min_kept × B``; all valid pixels when there are at most k.
    """
    valid = target != ignore_index
    prob = logits.float().softmax(1).gather(1, target.masked_fill(~valid, 0)[:, None])[:, 0]
    p = prob[valid]
    k = int(min_kept) * target.shape[0]
    if p.numel() <= k:
        return valid
    kth = float(p.kthvalue(k + 1).values) if k > 0 else 0.0
    return valid & (prob < max(float(thresh), kth))


def median_frequency_weights(counts: Any, image_pixels: Any) -> Tensor:
    """SegNet's median frequency balancing: ``w_c = median(f) / f_c``.

    ``counts[c]``: labelled pixels of class c over the training set; ``image_pixels[c]``:
    labelled pixels of the images where c appears, so ``f_c = counts[c] / image_pixels[c]``.
    A class that never appears gets weight 0 and is left out of the median.
    """
    counts = torch.as_tensor(np.asarray(counts), dtype=torch.float64)
    image_pixels = torch.as_tensor(np.asarray(image_pixels), dtype=torch.float64)
    present = counts > 0
    if not present.any():
        raise ConfigError("median_frequency class weights: the training labels hold no class")
    freq = torch.where(present, counts / image_pixels.clamp_min(1), torch.ones_like(counts))
    # the median of an even count is the mean of the two middle values (torch.median's is the
    # lower one, which scaled every weight down, by 0.78 on the synthetic data)
    median = torch.quantile(freq[present], 0.5)
    weights = torch.where(present, median / freq, torch.zeros_like(freq))
    return weights.float()


def class_weights_for(
    spec: str | Sequence[float] | None, num_classes: int, dataset: Any = None
) -> Tensor | None:
    """The ``class_weights`` option as a ``[C]`` tensor: ``None`` (unweighted), one weight per
    class, or ``"median_frequency"`` computed from ``dataset``'s training labels."""
    if spec is None:
        return None
    if isinstance(spec, str):
        if spec != MEDIAN_FREQUENCY:
            raise ConfigError(
                f"class_weights={spec!r}: use {MEDIAN_FREQUENCY!r}, a list of one weight per "
                "class, or null"
            )
        from dualseg.data.datasets import label_histogram

        counts, image_pixels = label_histogram(dataset)
        return median_frequency_weights(counts, image_pixels)
    weights = torch.tensor([float(w) for w in spec])
    if not weights.isfinite().all():  # NaN or inf: the loss is non-finite at step 1
        raise ConfigError(
            f"class_weights {weights.tolist()} holds NaN or infinite values; give one finite, "
            "non-negative weight per class"
        )
    if weights.numel() != num_classes:
        raise ConfigError(
            f"class_weights has {weights.numel()} values {weights.tolist()} but the dataset has "
            f"{num_classes} classes; give one non-negative weight per class (not all 0)"
        )
    if (weights < 0).any() or weights.sum() <= 0:
        raise ConfigError(
            f"class_weights {weights.tolist()} "
            + ("holds a negative weight" if (weights < 0).any() else "are all 0")
            + "; give one non-negative weight per class (not all 0)"
        )
    return weights


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
    ``l2_recurrent``: the S32 readings above. ``class_weights`` ``[C]`` and ``ohem_thresh`` /
    ``ohem_min_kept`` change L1 as :func:`cross_entropy_loss` says (default off: the S32 loss).
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
        class_weights: Tensor | Sequence[float] | None = None,
        ohem_thresh: float | None = None,
        ohem_min_kept: int | None = None,
    ) -> None:
        if l1_reduction not in L1_REDUCTIONS:
            raise ValueError(f"l1_reduction must be one of {L1_REDUCTIONS}, got {l1_reduction!r}")
        self.weights = decay_weights(model, recurrent=l2_recurrent)
        self.weight_decay = weight_decay
        self.l2_lambda = l2_lambda
        self.ignore_index = ignore_index
        self.l1_reduction = l1_reduction
        self.class_weights = None if class_weights is None else torch.as_tensor(class_weights)
        self.ohem_thresh = ohem_thresh
        self.ohem_min_kept = ohem_min_kept

    def lam(self, batch_size: int, num_pixels: int) -> float:
        """λ for a batch of ``batch_size`` images with ``num_pixels`` pixels each."""
        if self.l2_lambda is not None:
            return self.l2_lambda
        return self.weight_decay * batch_size * num_pixels

    def __call__(self, logits: Tensor, target: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        b, n = target.shape[0], target.shape[-2] * target.shape[-1]
        l1 = cross_entropy_loss(
            logits,
            target,
            ignore_index=self.ignore_index,
            reduction=self.l1_reduction,
            class_weights=self.class_weights,
            ohem_thresh=self.ohem_thresh,
            ohem_min_kept=self.ohem_min_kept,
        )
        l2 = l2_penalty(self.weights, lam=self.lam(b, n), batch_size=b, num_pixels=n)
        loss = l1 + l2.to(l1.device)
        return loss, {"l1": l1.detach(), "l2": l2.detach(), "loss": loss.detach()}
