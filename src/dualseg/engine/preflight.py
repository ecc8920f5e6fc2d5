"""Checks ``fit`` runs before its first step, and notes it adds to what it reports.

- :func:`check_training_data`: the ``dualseg data check`` scan of the training and validation
  splits (:mod:`dualseg.data.check`; every root of a list), so bad data fails in seconds,
  not at iteration 30,000; it also refuses training labels with fewer than two classes.
  ``data.check false`` skips it.
- :func:`label_mapping`: the ``build_dataset`` arguments of ``data.label_map`` /
  ``data.ignore_index``.
- :func:`scored_classes_note`: says so when a score is the mean over a single class.
- :func:`warn_missing_tensorboard`: ``train.tensorboard`` without tensorboard installed is
  said at the start (one line), not discovered after the run.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from dualseg.console import ProgressMode
from dualseg.engine.config import DataConfig

__all__ = [
    "check_training_data",
    "label_mapping",
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

    splits = tuple(dict.fromkeys(s for s in (d.train_split, d.val_split) if s))
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
