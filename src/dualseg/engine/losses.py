"""The training objective of spec S32: L = L1 + L2, L1 the pixel cross-entropy over B·N pixels,
L2 = λ/(2·B·N)·Σw² over conv, linear and recurrent weights (λ = weight_decay·B·N by default).
Beyond S32, off by default: class weights and OHEM."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dualseg.data.datasets import label_histogram
from dualseg.errors import ConfigError

MEDIAN_FREQUENCY = "median_frequency"  # the class_weights value asking for SegNet's weights

# layers whose ``weight`` the L2 term covers, besides recurrent layers (S32 Reading)
DECAY_LAYERS = (nn.modules.conv._ConvNd, nn.Linear)


def decay_weights(model: nn.Module, *, recurrent: bool = True) -> list[Tensor]:
    """The trainable weights the L2 term covers, each once: conv / linear ``weight`` and, with
    ``recurrent``, every GRU weight matrix; never biases or norms."""
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
    ohem_min_kept: int = 100000,
) -> Tensor:
    """L1 of ``logits`` (resized to the labels): the CE sum over labelled pixels / B·N
    (``batch_pixels``) or / their count (weighted mean with ``class_weights``)."""
    if logits.shape[-2:] != target.shape[-2:]:
        logits = F.interpolate(logits, size=target.shape[-2:], mode="bilinear", align_corners=False)
    logits = logits.float()
    if ohem_thresh is not None:
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
    """OHEM (mmseg's): the labelled pixels whose true-class probability is below
    ``max(thresh, p_(k))``, ``p_(k)`` the (k+1)-th smallest, ``k = min_kept × B``."""
    valid = target != ignore_index
    prob = logits.float().softmax(1).gather(1, target.masked_fill(~valid, 0)[:, None])[:, 0]
    p = prob[valid]
    k = int(min_kept) * target.shape[0]
    if p.numel() <= k:
        return valid
    kth = float(p.kthvalue(k + 1).values) if k > 0 else 0.0
    return valid & (prob < max(float(thresh), kth))


def median_frequency_weights(counts: Any, image_pixels: Any) -> Tensor:
    """SegNet's ``w_c = median(f) / f_c``, ``f_c = counts[c] / image_pixels[c]``; absent: 0."""
    counts = torch.as_tensor(np.asarray(counts), dtype=torch.float64)
    image_pixels = torch.as_tensor(np.asarray(image_pixels), dtype=torch.float64)
    present = counts > 0
    if not present.any():
        raise ConfigError("median_frequency class weights: the training labels hold no class")
    freq = torch.where(present, counts / image_pixels.clamp_min(1), torch.ones_like(counts))
    # an even count's median is the mean of the middle two (torch.median takes the lower)
    median = torch.quantile(freq[present], 0.5)
    weights = torch.where(present, median / freq, torch.zeros_like(freq))
    return weights.float()


def class_weights_for(
    spec: str | Sequence[float] | None, num_classes: int, dataset: Any = None
) -> Tensor | None:
    """The ``class_weights`` option as a ``[C]`` tensor (or None)."""
    if spec is None:
        return None
    if spec == MEDIAN_FREQUENCY:
        return median_frequency_weights(*label_histogram(dataset))
    if len(spec) != num_classes:
        raise ConfigError(
            f"optim.class_weights has {len(spec)} values {list(spec)} but the dataset has "
            f"{num_classes} classes; give one weight per class"
        )
    return torch.tensor([float(w) for w in spec])


def l2_penalty(weights: list[Tensor], *, lam: float, batch_size: int, num_pixels: int) -> Tensor:
    """L2 = λ/(2·B·N)·Σ w² (computed in float32)."""
    squares = torch.stack([w.float().pow(2).sum() for w in weights]).sum()
    return squares * (lam / (2.0 * batch_size * num_pixels))


class SegmentationLoss:
    """S32 objective: ``loss, parts = criterion(logits, target)``; λ = ``l2_lambda`` or
    weight_decay·B·N."""

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
        ohem_min_kept: int = 100000,
    ) -> None:
        self.weights = decay_weights(model, recurrent=l2_recurrent)
        self.weight_decay, self.l2_lambda = weight_decay, l2_lambda
        weights = None if class_weights is None else torch.as_tensor(class_weights)
        self.l1 = partial(cross_entropy_loss, ignore_index=ignore_index, reduction=l1_reduction,
                          class_weights=weights, ohem_thresh=ohem_thresh,
                          ohem_min_kept=ohem_min_kept)  # fmt: skip

    def __call__(self, logits: Tensor, target: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        b, n = target.shape[0], target.shape[-2] * target.shape[-1]
        l1 = self.l1(logits, target)
        lam = self.weight_decay * b * n if self.l2_lambda is None else self.l2_lambda
        l2 = l2_penalty(self.weights, lam=lam, batch_size=b, num_pixels=n)
        loss = l1 + l2.to(l1.device)
        return loss, {"l1": l1.detach(), "l2": l2.detach(), "loss": loss.detach()}
