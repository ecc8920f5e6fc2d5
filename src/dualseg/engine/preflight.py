"""Checks ``fit`` runs before its first step, and the notes it adds to what it reports:
the data scan (bad data fails in seconds, not at iteration 30,000), resume checks, and the
sanity notes of a validation (one scored class; not above the majority-class baseline)."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dualseg.console import ProgressMode
from dualseg.engine import checkpoint as ckpt_io
from dualseg.engine.config import DataConfig
from dualseg.errors import CheckpointError, ConfigError, RunExistsError
from dualseg.metrics import scores_from_confusion

__all__ = [
    "baseline_note",
    "check_resumable",
    "check_training_data",
    "label_mapping",
    "majority_baseline",
    "refuse_rewind",
    "scored_classes_note",
    "warn_missing_tensorboard",
]


def label_mapping(d: DataConfig) -> dict[str, Any]:
    """``{"label_map", "ignore_value"}`` for ``build_dataset`` / ``check_dataset``."""
    from dualseg.data.presets import parse_label_map

    return {
        "label_map": parse_label_map(d.label_map) if d.label_map else None,
        "ignore_value": d.ignore_index,
    }


def check_training_data(
    d: DataConfig, *, progress: ProgressMode = "off", warn: bool = True
) -> None:
    """Scan every pair of ``d``'s training and validation splits (of every root when
    ``data.root`` is a list); one ``DataError`` if bad.

    ``progress``: a :mod:`dualseg.console` mode. Classes with no pixels in these splits are a
    one-line warning (``warn``), not a refusal.
    """
    if not d.check or not d.root:
        return
    from dualseg.data.check import check_dataset, combine_reports, require_trainable

    # a held-out fraction is part of the training split's files
    named = (d.train_split,) if d.val_fraction > 0 else (d.train_split, d.val_split)
    splits = tuple(dict.fromkeys(s for s in named if s))
    roots = [d.root] if isinstance(d.root, str) else list(d.root)
    reports = [
        check_dataset(
            root,
            splits=splits,
            layout=d.layout,
            preset=d.preset,
            label_format=d.label_format,
            progress=progress,
            **label_mapping(d),
        )
        for root in roots
    ]
    report = combine_reports(reports)
    require_trainable(report, d.train_split)
    padded = padded_crop(d, report.largest.get(d.train_split))
    for warning in (report.absent_classes, report.split_overlap, padded):
        if warning and warn:
            print(f"dualseg train: warning: {warning}", file=sys.stderr)


def padded_crop(d: DataConfig, largest: tuple[int, int] | None) -> str | None:
    """A line when ``data.crop_size`` is so much larger than the largest training image, even
    at the largest scale of ``data.scale_range``, that over half of every crop is ignore
    padding: that weakens the loss (to 1/100 in a case seen) and slows every step, without a
    word. A crop a little larger than the images (some padding) is not worth a line."""
    if not largest or min(largest) == 0:
        return None
    hi = max(d.scale_range)
    h, w = (round(v * hi) for v in largest)
    ch, cw = d.crop_size
    if min(ch, h) * min(cw, w) >= 0.5 * ch * cw:
        return None
    return (
        f"data.crop_size [{ch}, {cw}] is larger than every training image ({largest[0]}x"
        f"{largest[1]} at most, {h}x{w} at the largest scale {hi:g}): over half of every crop "
        f"is ignore padding, which weakens the loss and slows each step; use a crop of at most "
        f"[{min(ch, h)}, {min(cw, w)}]"
    )


def scored_classes_note(metrics: Mapping[str, Any], class_names: Sequence[str]) -> str:
    """``" (1 class scored: 'a')"`` when the mIoU averages a single class, else ``""``."""
    iou = metrics.get("iou")
    if iou is None:
        return ""
    values = [float(v) for v in (iou.tolist() if hasattr(iou, "tolist") else iou)]
    scored = [i for i, v in enumerate(values) if not math.isnan(v)]
    if len(scored) != 1:
        return ""
    name = class_names[scored[0]] if scored[0] < len(class_names) else scored[0]
    return f" (1 class scored: {name!r}; the labels hold no other class)"


def warn_missing_tensorboard(enabled: bool) -> bool:
    """Print one warning line when TensorBoard logging is on but cannot be imported; return
    whether event files can be written."""
    if not enabled:
        return False
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        print(
            "dualseg train: warning: tensorboard is not installed, so no event files are "
            "written (pip install tensorboard, or --train.tensorboard false)",
            file=sys.stderr,
        )
        return False
    return True


def majority_baseline(confusion: Any) -> tuple[float, int]:
    """The mIoU of predicting the most frequent ground-truth class everywhere, scored as the
    model is (``confusion``: ``[C, C]`` pixel counts, rows = ground truth), and that class."""
    mat = torch.as_tensor(confusion, dtype=torch.float64)
    gt = mat.sum(1)
    k = int(gt.argmax())
    constant = torch.zeros_like(mat)
    constant[:, k] = gt
    return float(scores_from_confusion(constant)["miou"]), k


def baseline_note(
    confusion: Any, miou: float, class_names: Sequence[str], *, dominant: float = 0.95
) -> tuple[float, str]:
    """The majority-class baseline mIoU, and a note for the validation line: the baseline
    beside the model's mIoU, plainly saying when the model is not above it or predicts one
    class on more than ``dominant`` of the pixels."""
    mat = torch.as_tensor(confusion, dtype=torch.float64)
    total = float(mat.sum())
    if total == 0:
        return math.nan, ""
    baseline, k = majority_baseline(mat)
    note = f" (majority-class baseline {100 * baseline:.1f}%)"
    if not miou > baseline:
        note += f"; not above predicting {class_names[k]!r} everywhere"
    top = mat.sum(0)
    c = int(top.argmax())
    if float(top[c]) > dominant * total:
        note += (
            f"; the model predicts {class_names[c]!r} on {100 * float(top[c]) / total:.0f}% of "
            "the pixels"
        )
    return baseline, note


def check_resumable(state: dict, path: Path | None, max_iters: int) -> None:
    """A resume needs a training checkpoint (not weights alone) with iterations left."""
    needed = ("optimizer", "scheduler", "sampler", "iteration", "epoch", "rng", "progress")
    if missing := [k for k in needed if k not in state]:
        raise CheckpointError(
            f"{path} holds model weights without the training state a resume needs "
            f"(no {', '.join(missing)}): resume from a checkpoint that dualseg train wrote "
            "(the run's last.pt)"
        )
    try:
        done = int(state["iteration"])
    except (TypeError, ValueError):
        raise CheckpointError(
            f"{path} is a damaged training checkpoint (iteration {state['iteration']!r}); resume "
            "from another checkpoint of the run (best.pt, or an earlier one)"
        ) from None
    if max_iters < done:
        raise ConfigError(
            f"{path} is at iteration {done}, past train.max_iters {max_iters}: pass "
            f"--train.max_iters {done} or more to resume it, or evaluate it with dualseg eval"
        )


def refuse_rewind(out_dir: Path, resume: str | None) -> None:
    """Resuming a folder from its own older ``best.pt`` would replace its later ``last.pt``
    and log records: only with ``--overwrite``."""
    best, last = out_dir / ckpt_io.BEST_NAME, out_dir / ckpt_io.LAST_NAME
    if resume in (None, "auto") or not last.is_file() or Path(resume).resolve() != best.resolve():
        return
    at_best = int(ckpt_io.load_checkpoint(best).get("iteration", 0))
    try:
        at_last = int(ckpt_io.load_checkpoint(last).get("iteration", 0))
    except CheckpointError:  # a broken last.pt: best.pt is the way back
        return
    if at_last > at_best:
        raise RunExistsError(
            f"--resume {resume} (iteration {at_best}) would rewind the run in {out_dir}: its "
            f"{ckpt_io.LAST_NAME} (iteration {at_last}) and later log records would be "
            f"replaced; resume from {last}, pass --overwrite to go back to iteration {at_best}, "
            "or choose another --train.out_dir"
        )
