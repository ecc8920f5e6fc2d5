"""Method B's decision rule, chosen on held-out labelled images (beyond the claim).

The claim (P5) relabels every near-boundary pixel with the nearest of its Top-N prototypes,
whatever the base model's confidence; on a strong base that overrides pixels the base had right.
``gate_margin`` τ relabels only where the base's top-1 minus top-2 probability is below τ
(``None``: no gate, the claim). :func:`sweep_gate` scores a grid of τ on labelled images in one
pass — the base model and the embedding run once per image, each τ is a mask on their outputs —
and :func:`choose_gate` picks the τ with the best mIoU. τ = 0 never relabels, so the choice is
never below the base *on the images that chose it*; choose on images held out of the training
split, and report on another split.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from dualseg.metrics import BoundaryMetrics, ConfusionMatrix

__all__ = ["DEFAULT_GATES", "choose_gate", "gate_mask", "sweep_gate"]

# τ grid of the sweep; None is the claim (no gate).
DEFAULT_GATES: tuple[float | None, ...] = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, None)


class _Refines(Protocol):
    def refine(self, images: Tensor, probs: Tensor, *, return_changed: bool = False) -> Any: ...


def gate_mask(probs: Tensor, gate_margin: float | None) -> Tensor:
    """Pixels where the base is unsure enough to be relabelled: top-1 − top-2 < τ, ``[B,H,W]``.

    ``probs`` ``[B,C,H,W]``: probabilities, or logits (turned into probabilities by a softmax
    first: the margin is one of probabilities); ``None`` lets every pixel through (the claim).
    """
    if gate_margin is None:
        return torch.ones(probs.shape[0], *probs.shape[2:], dtype=torch.bool, device=probs.device)
    if probs.shape[1] < 2:
        return torch.zeros(probs.shape[0], *probs.shape[2:], dtype=torch.bool, device=probs.device)
    sums = probs.sum(1)
    if probs.min() < 0 or not torch.allclose(sums, torch.ones_like(sums), atol=1e-3):
        probs = probs.softmax(1)  # logits
    top2 = probs.topk(2, dim=1).values  # [B,2,H,W]
    return (top2[:, 0] - top2[:, 1]) < gate_margin


@torch.no_grad()
def sweep_gate(
    refiner: _Refines,
    base: Callable[[Tensor], Tensor],
    batches: Iterable[tuple[Tensor, Tensor]],
    *,
    num_classes: int,
    gates: Sequence[float | None] = DEFAULT_GATES,
    ignore_index: int = 255,
    device: str | torch.device = "cpu",
) -> list[dict[str, Any]]:
    """Score the base model and the refiner gated at each τ on labelled ``batches``.

    ``refiner`` must be ungated (``gate_margin=None``): each τ is applied here.
    ``base(images)`` returns class probabilities ``[B,C,H,W]`` at image size; ``batches``
    yields ``(images [B,3,H,W] normalized, labels [B,H,W])``. Returns one row per τ (and a
    ``"base"`` row first): ``{"gate_margin", "miou", "boundary_f1", "pixel_acc", "changed"}``
    with the fraction of labelled pixels changed.
    """
    dev = torch.device(device)
    keys: list[Any] = ["base", *gates]
    conf = {k: ConfusionMatrix(num_classes, ignore_index=ignore_index, device=dev) for k in keys}
    bnd = {k: BoundaryMetrics(num_classes, ignore_index=ignore_index, device=dev) for k in keys}
    changed = dict.fromkeys(keys, 0)
    labelled = 0
    for images, labels in batches:
        images, labels = images.to(dev), labels.to(dev)
        probs = base(images).float()
        pred = probs.max(1).indices
        new, moved = refiner.refine(images, probs, return_changed=True)
        new, moved = new.to(dev), moved.to(dev)
        valid = labels != ignore_index
        labelled += int(valid.sum())
        for k in keys:
            out = pred if k == "base" else torch.where(moved & gate_mask(probs, k), new, pred)
            conf[k].update(out, labels)
            bnd[k].update(out, labels)
            changed[k] += int(((out != pred) & valid).sum())
    rows = []
    for k in keys:
        scores = conf[k].compute()
        rows.append(
            {
                "gate_margin": k,
                "miou": float(scores["miou"]),
                "pixel_acc": float(scores["pixel_acc"]),
                "boundary_f1": float(bnd[k].compute()["boundary_f1"]),
                "changed": changed[k] / max(labelled, 1),
            }
        )
    return rows


def choose_gate(rows: Sequence[dict[str, Any]], *, key: str = "miou") -> float | None:
    """The τ of the best row by ``key`` (mIoU); on a tie the smaller τ, changing fewer pixels.

    The ``"base"`` row is not a candidate, but τ = 0 (which changes nothing) is, when swept.
    """
    candidates = [r for r in rows if r["gate_margin"] != "base"]
    if not candidates:
        raise ValueError("no gated rows to choose from")

    def order(r: dict[str, Any]) -> tuple[float, float]:
        tau = r["gate_margin"]
        score = r[key] if math.isfinite(r[key]) else -math.inf
        return (-score, math.inf if tau is None else tau)

    return min(candidates, key=order)["gate_margin"]
