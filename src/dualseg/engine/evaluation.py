"""Evaluation: run a model over a loader and report region and boundary metrics (and, with a
method-B refiner, the refined labels' and what refinement changed, fixed and broke)."""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from dualseg.data import build_dataset
from dualseg.data.contract import LabelContract, count_seen
from dualseg.data.datasets import dataset_meta, preset_for
from dualseg.data.presets import require_same_classes
from dualseg.data.transforms import build_eval_transform
from dualseg.engine.inference import InferenceOptions, infer_logits
from dualseg.errors import ConfigError, DataError
from dualseg.metrics import (
    BOUNDARY_TOLERANCE,
    TRIMAP_WIDTH,
    BoundaryMetrics,
    ConfusionMatrix,
    change_counts,
    format_table,
    scores_from_confusion,
)
from dualseg.models.base import class_labels, eval_mode

_INFER = InferenceOptions()
ONE_CLASS_SHARE = 0.95  # a model predicting one class on more of the pixels is flagged


class _Scores:
    """Confusion matrix + boundary metrics for one set of predictions."""

    def __init__(self, num_classes: int, ignore_index: int, tolerance: int, width: int, device):
        self.cm = ConfusionMatrix(num_classes, ignore_index=ignore_index, device=device)
        self.bm = BoundaryMetrics(num_classes, tolerance=tolerance, trimap_width=width,
                                  ignore_index=ignore_index, device=device)  # fmt: skip

    def update(self, pred: Tensor, target: Tensor) -> None:
        self.cm.update(pred, target)
        self.bm.update(pred, target)

    def compute(self) -> dict[str, Any]:
        """Scalars as floats, per-class scores as lists (NaN for absent classes)."""
        scores = {**self.cm.compute(), **self.bm.compute()}
        out = {k: v.tolist() if isinstance(v, Tensor) else float(v) for k, v in scores.items()}
        out["confusion_matrix"] = self.cm.mat.cpu().tolist()
        out["majority_baseline_miou"] = majority_baseline_miou(self.cm.mat)
        return out


def majority_baseline_miou(confusion: Any) -> float:
    """The mIoU of the most frequent ground-truth class everywhere (rows: ground truth)."""
    gt = torch.as_tensor(confusion, dtype=torch.float64).sum(1)
    if gt.sum() == 0:
        return math.nan
    majority = torch.zeros(len(gt), len(gt), dtype=torch.float64)
    majority[:, int(gt.argmax())] = gt
    return float(scores_from_confusion(majority)["miou"])


def sanity_warnings(metrics: dict[str, Any], class_names: Sequence[str]) -> list[str]:
    """Warnings about a result no better than a trivial model: mIoU not above the
    majority-class baseline, or one class predicted on over 95% of the labelled pixels."""
    out = []
    mat = torch.as_tensor(metrics["confusion_matrix"], dtype=torch.float64)
    if float(mat.sum()) == 0:
        return out
    base, miou = metrics.get("majority_baseline_miou", math.nan), metrics["miou"]
    if math.isfinite(base) and not miou > base:
        out.append(
            f"mIoU {100 * miou:.1f}% is not above the majority-class baseline "
            f"({100 * base:.1f}%); train longer or check the labels"
        )
    shares = mat.sum(0) / mat.sum()
    top = int(shares.argmax())
    if float(shares[top]) > ONE_CLASS_SHARE:
        out.append(
            f"the model predicts one class, {class_names[top]!r}, on "
            f"{100 * float(shares[top]):.1f}% of the labelled pixels"
        )
    return out


@contextlib.contextmanager
def _timed(device: torch.device, ms: list[float], images: int) -> Iterator[None]:
    """Time the block: milliseconds per image appended to ``ms`` (CUDA work synchronized)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda _: None
    sync(device)
    start = time.perf_counter()
    yield
    sync(device)
    ms.append(1000 * (time.perf_counter() - start) / images)


def _median(ms: list[float]) -> float:
    return float(statistics.median(ms)) if ms else math.nan


def _shared_features(refiner: Any, model: nn.Module, opts: InferenceOptions, amp: bool) -> Any:
    """The refiner's hold on the base's backbone output, where it sees the same forward."""
    share = getattr(refiner, "shared_features", None)
    plain = not opts.augmented and not amp
    taps = getattr(refiner, "taps", None) is not None  # reads the base's forward in any mode
    return share(model) if share is not None and (plain or taps) else None


def _refine(refiner: Any, shared: Any, images: Tensor, logits: Tensor) -> tuple[Tensor, ...]:
    """Method B's labels, where they changed, and 1 when refined on the base's features (the
    logits: method B softmaxes only the near-boundary pixels it reads)."""
    if shared is None:
        return (*refiner.refine(images, logits, return_changed=True), 0)
    kept = shared.take(images)  # None where they do not match
    new, changed = refiner.refine(images, logits, return_changed=True, features=kept)
    return new, changed, int(kept is not None)


def _at_labels(logits: Tensor, labels: Tensor, num_classes: int) -> Tensor:
    """``logits`` checked against the data's classes and resized to the labels (spec S4)."""
    if logits.shape[1] != num_classes:  # a model that carries no class names
        raise ConfigError(
            f"the model gives {logits.shape[1]} class scores and the data names "
            f"{num_classes} classes: evaluate it on the classes it was trained on"
        )
    if logits.shape[-2:] == labels.shape[-2:]:
        return logits
    return F.interpolate(logits, labels.shape[-2:], mode="bilinear", align_corners=False)


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
    refiner: Any = None,
    amp: bool = False,
    distributed: bool = False,
    on_batch: Callable[..., None] | None = None,
    progress: bool = False,
    mode: str = _INFER.mode,
    window: Sequence[int] = _INFER.window,
    stride: Sequence[int] | None = _INFER.stride,
    tta_scales: Sequence[float] = _INFER.tta_scales,
    tta_flip: bool = _INFER.tta_flip,
    tile_batch: int = _INFER.tile_batch,
) -> dict[str, Any]:
    """Score ``model`` on ``(images, labels)`` batches, logits resized to the labels (spec S4):
    the :mod:`dualseg.metrics` scores, ``confusion_matrix``, ``num_images``, ``ms_per_image``,
    ``loss``; with ``refiner`` (a ``BoundaryRefiner``) also ``refined`` and ``refine`` (changed /
    fixed / broke). ``on_batch(index, images, labels, pred, refined or None)`` sees each batch."""
    device = torch.device(device)
    opts = InferenceOptions(mode, window, stride, tta_scales, tta_flip, tile_batch)  # type: ignore[arg-type]
    scores = [_Scores(num_classes, ignore_index, boundary_tolerance, trimap_width, device)
              for _ in range(1 if refiner is None else 2)]  # fmt: skip
    shared = _shared_features(refiner, model, opts, amp)
    ms: list[float] = []
    refine_ms: list[float] = []
    # images, loss sum; labelled pixels, changed, fixed, broke, images refined on shared features
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    counts = torch.zeros(5, dtype=torch.int64, device=device)
    with eval_mode(model), shared if shared is not None else contextlib.nullcontext():
        for index, (images, labels) in enumerate(
            tqdm(loader, "eval", leave=False, disable=not progress)
        ):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True).long()
            n = images.shape[0]
            with _timed(device, ms, n):
                logits = infer_logits(model, images, amp=amp, **asdict(opts))
            logits = _at_labels(logits, labels, num_classes)
            pred = class_labels(logits)
            scores[0].update(pred, labels)  # range-checks the labels before the loss reads them
            totals[0] += n
            totals[1] += F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
            new = None
            if refiner is not None:
                with _timed(device, refine_ms, n):
                    new, changed, on_shared = _refine(refiner, shared, images, logits)
                # where the refiner does not relabel, keep exactly the labels scored as the
                # base (argmax of logits and of softmax differ at float ties)
                new = torch.where(changed.to(device).bool(), new.to(device).long(), pred)
                scores[1].update(new, labels)
                counts[:4] += change_counts(new, pred, labels, ignore_index)
                counts[4] += n * on_shared
            if on_batch is not None:
                on_batch(index, images, labels, pred, new)
    if distributed:
        for t in (totals, counts, *(x for s in scores for x in (s.cm.mat, s.bm.state))):
            dist.all_reduce(t)
    result = scores[0].compute()
    labelled = int(scores[0].cm.mat.sum())
    loss = float(totals[1]) / labelled if labelled else math.nan
    result.update(num_images=int(totals[0]), ms_per_image=_median(ms), loss=loss)
    if refiner is not None:
        pixels, changed, fixed, broke, on_shared = (int(v) for v in counts)
        result["refined"] = scores[1].compute()
        result["refine"] = {
            "pixels": pixels, "changed": changed,
            "changed_fraction": changed / pixels if pixels else 0.0,
            "fixed": fixed, "broke": broke, "ms_per_image": _median(refine_ms),
            "shared_images": on_shared,  # images refined on the base's own backbone output
        }  # fmt: skip
    return result


def format_metrics(
    metrics: dict[str, Any], class_names: Sequence[str] | None = None, *,
    batch_size: int | None = None,
) -> str:  # fmt: skip
    """A per-class table and the means in percent, then the median time per image."""
    names = list(class_names or [f"class_{i}" for i in range(len(metrics["iou"]))])
    refined = metrics.get("refined")
    lines = [format_table(names, metrics)]
    if refined is not None:
        lines = ["base model:", *lines, "", "refined:", format_table(names, refined), ""]
        lines.append(f"{'(%)':<12}{'base':>8}{'refined':>9}{'delta':>8}")
        for key, label in (("miou", "mIoU"), ("boundary_f1", "boundary F1"),
                           ("trimap_miou", "trimap mIoU"), ("pixel_acc", "pixel acc")):  # fmt: skip
            b, r = 100 * metrics[key], 100 * refined[key]
            lines.append(f"{label:<12}{b:8.1f}{r:9.1f}{r - b:+8.1f}")
        c = metrics["refine"]
        lines.append(
            f"refinement changed {c['changed']} of {c['pixels']} labelled pixels "
            f"({100 * c['changed_fraction']:.3f}%): {c['fixed']} fixed, {c['broke']} broke"
        )
    if math.isfinite(base := metrics.get("majority_baseline_miou", math.nan)):
        lines.append(
            f"mIoU {100 * metrics['miou']:.1f}% vs majority-class baseline {100 * base:.1f}%"
        )
    if math.isfinite(ms := metrics.get("ms_per_image", math.nan)):
        at = f", batch {batch_size}" if batch_size is not None else ""
        line = f"inference: {ms:.1f} ms/image (median{at})"
        refine = metrics.get("refine") or {}
        if math.isfinite(r_ms := refine.get("ms_per_image", math.nan)):
            line += f", refinement: {r_ms:.1f} ms/image"
            if shared := refine.get("shared_images", 0):
                line += f" (on the base's features for {shared} of {metrics['num_images']} images)"
        lines.append(line)
    return "\n".join(lines)


def model_dataset(
    root: str, *, split: str, layout: str, preset: str | None, contract: Any, explicit: bool,
    checkpoint: str, label_format: str, label_map: dict[int, int] | None,
    ignore_value: Any, bit_depth: int | None, max_megapixels: float | None = None,
    trained: Mapping[str, Any] | None = None, train_images: Any = None,
) -> Any:  # fmt: skip
    """The ``split`` of ``root`` read for a model of label ``contract``: a dataset that
    describes itself must have the model's classes and (unless ``explicit``) read labels as
    the model's training data did. Warns of unscorable classes and of training images."""
    model_name = f"the checkpoint {checkpoint}"
    own = preset_for(root, preset) if preset else dataset_meta(root, layout=layout, split=split)
    if contract is None:  # a model that carries no label contract (FILE.py:NAME): the data's
        if own is None:
            raise ConfigError(
                f"{checkpoint} carries no class names: pass --preset, or describe {root} with "
                f"a meta.json ('dualseg data check {root} --write-meta')"
            )
        contract = LabelContract(own, label_format, bit_depth)
    bit_depth = contract.bit_depth if bit_depth is None else bit_depth
    meta = contract.meta
    if own is not None:
        where = f"the dataset {root} ({own.name})"
        require_same_classes(meta.class_names, own.class_names, model=model_name, data=where)
        meta = own
    dataset = build_dataset(
        root, split=split, layout=layout, preset=meta, transform=build_eval_transform(),
        label_format=label_format, label_map=label_map, ignore_value=ignore_value,
        bit_depth=bit_depth, max_megapixels=max_megapixels,
        val_fraction=_held_out_fraction(root, split, trained or {}, checkpoint),
    )  # fmt: skip
    read = LabelContract(dataset.meta, label_format, bit_depth)
    if own is not None and not explicit and (diff := contract.differences(read)):
        source = "ROOT/meta.json" if preset is None else f"--preset {preset}"
        raise DataError(
            f"{root} describes its labels otherwise than {model_name} was trained on: "
            f"{'; '.join(diff)}; fix {source} to match the model's, or pass --label-map / "
            "--ignore-index / --label-format / --bit-depth to say how to read it"
        )
    if label_format != "color" and (lost := dataset.meta.unreachable_classes()):
        names = ", ".join(f"{k} {dataset.meta.class_names[k]!r}" for k in lost)
        print(
            f"dualseg eval: warning: no raw label value means class {names} (the ignore value, "
            f"{dataset.meta.describe_ignore()}, or a label map takes it), so it is never scored; "
            "check --ignore-index / --label-map / meta.json",
            file=sys.stderr,
        )
    images = [image for image, _ in dataset.samples]
    if train_images is not None and (seen := count_seen(images, train_images)):
        print(f"dualseg eval: warning: {seen} of the {len(images)} images evaluated here were "
              f"training images of {checkpoint}: its scores are optimistic; use held-out images",
              file=sys.stderr)  # fmt: skip
    return dataset


def _held_out_fraction(root: str, split: str, trained: Mapping[str, Any], checkpoint: str) -> float:
    """The model's ``data.val_fraction`` when ``split`` val is what it held out of ``root``."""
    fraction = float(trained.get("val_fraction") or 0)
    roots = trained.get("root") or ()
    roots = [roots] if isinstance(roots, str) else roots
    here = Path(root).resolve()
    if not fraction or split != "val" or all(Path(r).resolve() != here for r in roots):
        return 0.0
    print(f"dualseg eval: note: split val is the {fraction:g} of {root}'s images that "
          f"{checkpoint} held out of training (data.val_fraction), chosen by file name",
          file=sys.stderr)  # fmt: skip
    return fraction
