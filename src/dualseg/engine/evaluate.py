"""Evaluation: run a model over a loader and report region and boundary metrics.

``evaluate`` is the one function the trainer (validation), ``dualseg eval`` and ``dualseg demo``
share. It streams a :class:`~dualseg.metrics.ConfusionMatrix` (mIoU, per-class IoU, pixel and
mean accuracy, frequency-weighted IoU) and :class:`~dualseg.metrics.BoundaryMetrics`
(boundary F1 at a tolerance of ``t`` px, trimap mIoU in a band of ``w`` px). Under DDP each
rank sees its shard of the data and the integer counters are summed with ``all_reduce``, so every
rank returns the metrics of the whole set.

With a method-B ``refiner`` the same pass also scores the refined labels, and counts how many
pixels refinement changed and how many of those changes fixed or broke a pixel.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dualseg.metrics import BoundaryMetrics, ConfusionMatrix

__all__ = ["Refiner", "evaluate", "format_metrics"]


class Refiner(Protocol):
    """What ``evaluate`` needs from a method-B refiner (``dualseg.refine.BoundaryRefiner``)."""

    def refine(
        self, images: Tensor, probs: Tensor, return_changed: bool = True
    ) -> tuple[Tensor, Tensor]: ...


# Called once per batch with (batch_index, images, labels, predictions[, refined]); used by
# ``dualseg eval --save-predictions`` to write label maps without a second pass.
BatchHook = Callable[[int, Tensor, Tensor, Tensor, "Tensor | None"], None]


class _Scores:
    """Confusion matrix + boundary metrics for one set of predictions."""

    def __init__(self, num_classes: int, ignore_index: int, tolerance: int, width: int, device):
        self.cm = ConfusionMatrix(num_classes, ignore_index=ignore_index, device=device)
        self.bm = BoundaryMetrics(
            num_classes,
            tolerance=tolerance,
            trimap_width=width,
            ignore_index=ignore_index,
            device=device,
        )

    def update(self, pred: Tensor, target: Tensor) -> None:
        self.cm.update(pred, target)
        self.bm.update(pred, target)

    def all_reduce(self) -> None:
        _all_reduce_(self.cm.mat)
        _all_reduce_(self.bm.state)

    def compute(self) -> dict[str, Any]:
        region = self.cm.compute()
        boundary = self.bm.compute()
        return {
            "miou": float(region["miou"]),
            "iou": [float(v) for v in region["iou"].tolist()],
            "pixel_acc": float(region["pixel_acc"]),
            "mean_acc": float(region["mean_acc"]),
            "fwiou": float(region["fwiou"]),
            "boundary_f1": float(boundary["boundary_f1"]),
            "boundary_f1_per_class": [float(v) for v in boundary["boundary_f1_per_class"].tolist()],
            "trimap_miou": float(boundary["trimap_miou"]),
        }


def _all_reduce_(t: Tensor) -> None:
    """Sum a counter tensor over all ranks, in place."""
    import torch.distributed as dist

    dist.all_reduce(t, op=dist.ReduceOp.SUM)


def _autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager:
    if not enabled:
        return contextlib.nullcontext()
    # bf16 needs no loss scaling and is what the trainer uses; fp16 on older GPUs is handled
    # by autocast's own fallback.
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Put ``model`` in eval mode, and give it back in the mode it came in (for validation)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable[tuple[Tensor, Tensor]],
    *,
    num_classes: int,
    ignore_index: int = 255,
    device: str | torch.device = "cpu",
    boundary_tolerance: int = 3,
    trimap_width: int = 5,
    refiner: Refiner | None = None,
    amp: bool = False,
    distributed: bool = False,
    on_batch: BatchHook | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Score ``model`` on every ``(images, labels)`` batch of ``loader``.

    ``images``: float ``[B,3,H,W]`` normalized; ``labels``: int64 ``[B,H,W]`` with
    ``ignore_index`` for unlabelled pixels. The model returns logits ``[B,C,H,W]``; logits of
    another size are bilinearly resized to the label size (spec S4).

    Returns ``{"miou", "iou" (per class, NaN for classes absent from prediction and ground
    truth), "pixel_acc", "mean_acc", "fwiou", "boundary_f1", "boundary_f1_per_class",
    "trimap_miou", "num_images"}``. With ``refiner`` it also returns ``"refined"`` (the same
    metrics for the refined labels) and ``"refine"`` = ``{"pixels", "changed",
    "changed_fraction", "fixed", "broke"}`` over labelled pixels: ``fixed`` counts changes that
    turned a wrong pixel right, ``broke`` changes that turned a right pixel wrong.

    With ``distributed=True`` (an initialized ``torch.distributed`` process group), counters are
    summed over ranks; every rank gets the same result.
    """
    device = torch.device(device)
    base = _Scores(num_classes, ignore_index, boundary_tolerance, trimap_width, device)
    refined = (
        _Scores(num_classes, ignore_index, boundary_tolerance, trimap_width, device)
        if refiner is not None
        else None
    )
    # pixels (labelled), changed, fixed, broke, images
    counts = torch.zeros(5, dtype=torch.int64, device=device)

    batches: Iterable = loader
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(loader, desc="eval", leave=False)

    with _eval_mode(model):
        for index, (images, labels) in enumerate(batches):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True).long()
            with _autocast(device, amp):
                logits = model(images)
            logits = logits.float()
            if logits.shape[-2:] != labels.shape[-2:]:
                logits = F.interpolate(
                    logits, size=labels.shape[-2:], mode="bilinear", align_corners=False
                )
            pred = logits.argmax(1)
            base.update(pred, labels)
            counts[4] += images.shape[0]

            new = None
            if refiner is not None and refined is not None:
                new, changed = refiner.refine(images, logits.softmax(1), return_changed=True)
                new = new.to(device).long()
                changed = changed.to(device).bool()
                refined.update(new, labels)
                valid = labels != ignore_index
                was_right = pred == labels
                is_right = new == labels
                counts[0] += valid.sum()
                counts[1] += (changed & valid).sum()
                counts[2] += (changed & valid & ~was_right & is_right).sum()
                counts[3] += (changed & valid & was_right & ~is_right).sum()

            if on_batch is not None:
                on_batch(index, images, labels, pred, new)

    if distributed:
        base.all_reduce()
        if refined is not None:
            refined.all_reduce()
        _all_reduce_(counts)

    result = base.compute()
    result["num_images"] = int(counts[4])
    if refined is not None:
        result["refined"] = refined.compute()
        pixels, changed_n, fixed, broke = (int(v) for v in counts[:4])
        result["refine"] = {
            "pixels": pixels,
            "changed": changed_n,
            "changed_fraction": changed_n / pixels if pixels else 0.0,
            "fixed": fixed,
            "broke": broke,
        }
    return result


def _pct(value: float) -> str:
    return "   n/a" if value is None or math.isnan(value) else f"{100 * value:6.2f}"


def format_metrics(metrics: dict[str, Any], class_names: Iterable[str] | None = None) -> str:
    """A human-readable report: summary lines and a per-class IoU table (refined side by side)."""
    refined = metrics.get("refined")
    names = list(class_names) if class_names is not None else []
    ious = metrics["iou"]
    names += [f"class_{i}" for i in range(len(names), len(ious))]
    width = max([len("class"), *(len(n) for n in names)])

    def row(label: str, key: str) -> str:
        line = f"{label:<{width + 2}}{_pct(metrics[key])}"
        if refined is not None:
            delta = refined[key] - metrics[key]
            line += f"  {_pct(refined[key])}  {100 * delta:+6.2f}"
        return line

    header = f"{'':<{width + 2}}{'base':>6}"
    if refined is not None:
        header += f"  {'refined':>6}  {'delta':>6}"
    lines = [header]
    lines += [
        row("mIoU", "miou"),
        row("pixel acc", "pixel_acc"),
        row("mean acc", "mean_acc"),
        row("fwIoU", "fwiou"),
        row("boundary F1", "boundary_f1"),
        row("trimap mIoU", "trimap_miou"),
        "",
        f"{'class':<{width + 2}}{'IoU':>6}" + (f"  {'refined':>6}" if refined else ""),
    ]
    for i, name in enumerate(names):
        line = f"{name:<{width + 2}}{_pct(ious[i])}"
        if refined is not None:
            line += f"  {_pct(refined['iou'][i])}"
        lines.append(line)
    if refined is not None:
        r = metrics["refine"]
        lines += [
            "",
            f"refinement changed {r['changed']} of {r['pixels']} labelled pixels "
            f"({100 * r['changed_fraction']:.3f}%): {r['fixed']} fixed, {r['broke']} broke",
        ]
    return "\n".join(lines)
