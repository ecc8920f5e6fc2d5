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
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dualseg.engine.inference import InferenceOptions, infer_logits
from dualseg.metrics import (
    BOUNDARY_TOLERANCE,
    TRIMAP_WIDTH,
    BoundaryMetrics,
    ConfusionMatrix,
    format_table,
)
from dualseg.models.base import eval_mode

__all__ = ["Refiner", "evaluate", "format_metrics"]

_INFER = InferenceOptions()  # the inference defaults (written once, in engine/inference.py)


class SharedFeatures(Protocol):
    """A context keeping the base's backbone output (``dualseg.refine.shared``)."""

    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: object) -> Any: ...
    def take(self, images: Tensor | None = None) -> Any: ...


class Refiner(Protocol):
    """What ``evaluate`` needs from a method-B refiner (``dualseg.refine.BoundaryRefiner``).
    A refiner may also offer ``shared_features(model) -> SharedFeatures``; ``evaluate`` then
    passes what it kept to ``refine(..., features=...)`` (the base's backbone output)."""

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
        """Scalars as floats, per-class scores as lists (NaN for absent classes)."""
        scores = {**self.cm.compute(), **self.bm.compute()}
        out: dict[str, Any] = {
            k: [float(x) for x in v.tolist()] if isinstance(v, Tensor) else float(v)
            for k, v in scores.items()
        }
        out["confusion_matrix"] = self.cm.mat.cpu().tolist()
        return out


def _all_reduce_(t: Tensor) -> None:
    """Sum a counter tensor over all ranks, in place."""
    import torch.distributed as dist

    dist.all_reduce(t, op=dist.ReduceOp.SUM)


class _Timer:
    """Milliseconds per image of each batch's inference (CUDA work included: synchronized)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ms: list[float] = []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def time(self, images: int) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.ms.append(1000 * (time.perf_counter() - start) / max(images, 1))

    def median(self) -> float:
        return float(statistics.median(self.ms)) if self.ms else math.nan


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable[tuple[Tensor, Tensor]],
    *,
    num_classes: int,
    ignore_index: int = 255,
    device: str | torch.device = "cpu",
    boundary_tolerance: int = BOUNDARY_TOLERANCE,
    trimap_width: int = TRIMAP_WIDTH,
    refiner: Refiner | None = None,
    amp: bool = False,
    distributed: bool = False,
    on_batch: BatchHook | None = None,
    progress: bool = False,
    mode: str = _INFER.mode,
    window: Sequence[int] = _INFER.window,
    stride: Sequence[int] | None = _INFER.stride,
    tta_scales: Sequence[float] = _INFER.tta_scales,
    tta_flip: bool = _INFER.tta_flip,
    tile_batch: int = _INFER.tile_batch,
) -> dict[str, Any]:
    """Score ``model`` on every ``(images, labels)`` batch of ``loader``.

    ``images``: float ``[B,3,H,W]`` normalized; ``labels``: int64 ``[B,H,W]`` with
    ``ignore_index`` for unlabelled pixels. The model returns logits ``[B,C,H,W]``; logits of
    another size are bilinearly resized to the label size (spec S4). ``mode``, ``window``,
    ``stride``, ``tta_scales``, ``tta_flip``, ``tile_batch``: how the model is run
    (sliding window, test-time augmentation; :func:`dualseg.engine.inference.infer_logits`).

    Returns ``{"miou", "iou" (per class, NaN for classes absent from prediction and ground
    truth), "pixel_acc", "mean_acc", "fwiou", "boundary_f1", "trimap_miou", "num_images",
    "ms_per_image", "confusion_matrix", "loss"}`` plus the per-class lists ``class_acc``,
    ``boundary_f1_per_class``, ``boundary_precision``, ``boundary_recall``, ``trimap_iou``
    (definitions: :mod:`dualseg.metrics`). Scores are fractions in [0, 1];
    ``confusion_matrix`` is the ``[C][C]`` pixel counts (rows: ground truth, columns:
    prediction); ``ms_per_image`` is the median over batches of the model's inference time
    (TTA and sliding window included; data loading and metrics excluded) divided by the batch
    size, in milliseconds (on this rank); ``loss`` the pixel cross-entropy of the logits
    averaged over the labelled pixels (the validation objective that ``train.monitor
    val_loss`` watches, spec S33).

    With ``refiner`` it also returns ``"refined"`` (the same metrics for the refined labels,
    which the refiner computes from the (TTA-averaged) softmax scores) and ``"refine"`` =
    ``{"pixels", "changed", "changed_fraction", "fixed", "broke", "ms_per_image"}`` over
    labelled pixels: ``fixed`` counts changes that turned a wrong pixel right, ``broke``
    changes that turned a right pixel wrong, ``ms_per_image`` the refiner's own time.

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
    # labelled pixels, changed, fixed, broke, images, images refined on the base's features
    counts = torch.zeros(6, dtype=torch.int64, device=device)
    timer, refine_timer = _Timer(device), _Timer(device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # cross-entropy, summed

    batches: Iterable = loader
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(loader, desc="eval", leave=False)

    # a refiner on the base's own frozen backbone reads the features the base computed
    share = getattr(refiner, "shared_features", None)
    plain = (  # one whole-image forward per batch, in float32: what the refiner would compute
        mode == "whole"
        and not amp
        and not InferenceOptions(tta_scales=tuple(tta_scales), tta_flip=tta_flip).uses_tta
    )
    shared: SharedFeatures | None = share(model) if share is not None and plain else None
    with eval_mode(model), shared if shared is not None else contextlib.nullcontext():
        for index, (images, labels) in enumerate(batches):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True).long()
            with timer.time(images.shape[0]):
                logits = infer_logits(
                    model,
                    images,
                    mode=mode,
                    window=window,
                    stride=stride,
                    tta_scales=tta_scales,
                    tta_flip=tta_flip,
                    tile_batch=tile_batch,
                    amp=amp,
                )
            if logits.shape[-2:] != labels.shape[-2:]:
                logits = F.interpolate(
                    logits, size=labels.shape[-2:], mode="bilinear", align_corners=False
                )
            pred = logits.argmax(1)
            base.update(pred, labels)
            counts[4] += images.shape[0]
            # labels were range-checked by the update above; ignored pixels add nothing
            loss_sum += F.cross_entropy(
                logits, labels, ignore_index=ignore_index, reduction="sum"
            ).double()

            new = None
            if refiner is not None and refined is not None:
                with refine_timer.time(images.shape[0]):
                    probs = logits.softmax(1)
                    if shared is not None:
                        kept = shared.take(images)  # None where they do not match
                        new, changed = refiner.refine(  # type: ignore[call-arg]
                            images, probs, return_changed=True, features=kept
                        )
                        counts[5] += images.shape[0] if kept is not None else 0
                    else:
                        new, changed = refiner.refine(images, probs, return_changed=True)
                # the refiner takes its own base labels from the probabilities; where it does
                # not relabel, keep exactly the labels scored as the base (argmax of logits and
                # of softmax differ at float ties), so fixed/broke add up against both matrices
                changed = changed.to(device).bool()
                new = torch.where(changed, new.to(device).long(), pred)
                changed = new != pred
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
        _all_reduce_(loss_sum)

    result = base.compute()
    result["num_images"] = int(counts[4])
    result["ms_per_image"] = timer.median()
    labelled = int(base.cm.mat.sum())
    result["loss"] = float(loss_sum) / labelled if labelled else float("nan")
    if refined is not None:
        result["refined"] = refined.compute()
        pixels, changed_n, fixed, broke = (int(v) for v in counts[:4])
        result["refine"] = {
            "pixels": pixels,
            "changed": changed_n,
            "changed_fraction": changed_n / pixels if pixels else 0.0,
            "fixed": fixed,
            "broke": broke,
            "ms_per_image": refine_timer.median(),
            # images whose refiner read the base's backbone output instead of running its own
            "shared_images": int(counts[5]),
        }
    return result


def format_metrics(
    metrics: dict[str, Any],
    class_names: Sequence[str] | None = None,
    *,
    batch_size: int | None = None,
) -> str:
    """A human-readable report: per-class table and means in percent (one decimal), then the
    median inference time per image (``batch_size``: the batch it was measured at, when
    known); with refinement, both side by side."""
    names = list(class_names or [f"class_{i}" for i in range(len(metrics["iou"]))])
    refined = metrics.get("refined")
    lines = [format_table(names, metrics)]
    if refined is not None:
        lines = ["base model:", *lines, "", "refined:", format_table(names, refined), ""]
        lines.append(f"{'(%)':<12}{'base':>8}{'refined':>9}{'delta':>8}")
        for key, label in (
            ("miou", "mIoU"),
            ("boundary_f1", "boundary F1"),
            ("trimap_miou", "trimap mIoU"),
            ("pixel_acc", "pixel acc"),
        ):
            b, r = 100 * metrics[key], 100 * refined[key]
            lines.append(f"{label:<12}{b:8.1f}{r:9.1f}{r - b:+8.1f}")
        c = metrics["refine"]
        lines.append(
            f"refinement changed {c['changed']} of {c['pixels']} labelled pixels "
            f"({100 * c['changed_fraction']:.3f}%): {c['fixed']} fixed, {c['broke']} broke"
        )
    ms = metrics.get("ms_per_image")
    if ms is not None and math.isfinite(ms):
        at = f", batch {batch_size}" if batch_size is not None else ""
        line = f"inference: {ms:.1f} ms/image (median{at})"
        r_ms = (metrics.get("refine") or {}).get("ms_per_image")
        if r_ms is not None and math.isfinite(r_ms):
            line += f", refinement: {r_ms:.1f} ms/image"
            shared = metrics["refine"].get("shared_images", 0)
            if shared:  # the refiner ran only its head, on the base's backbone output
                line += f" (on the base's features for {shared} of {metrics['num_images']} images)"
        lines.append(line)
    return "\n".join(lines)


class _CallableModule(types.ModuleType):
    """This module called as the function it is named after. ``dualseg.engine`` offers
    ``evaluate`` the function, but once this module is imported (by ``fit``, or by that very
    lookup) Python binds the package's ``evaluate`` attribute to the module: the README's
    ``dualseg.engine.evaluate(model, loader, ...)`` then called a module (a TypeError)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return evaluate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
