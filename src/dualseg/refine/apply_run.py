"""``refine apply``'s library side: a refiner set up for one base, and the base's scores.

Both refiners (``BoundaryRefiner`` and an exported one) are read through the same attributes
(``config``, ``calibration``, ``calibration_note``, ``check_classes``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from dualseg.engine.inference import InferenceOptions, infer_logits
from dualseg.errors import ConfigError
from dualseg.refine.base import OTHER_BASE, other_calibration_base


def configure(
    refiner: Any, base: Any, *, top_n: int | None, radius: int | None, refiner_name: str,
    base_name: str, augmented: bool,
) -> list[str]:  # fmt: skip
    """Apply the ``top_n`` / ``radius`` overrides and check ``base`` against ``refiner``;
    returns the notes and warnings to show (``"note: ..."``, ``"warning: ..."``)."""
    notes = [f"note: {text}"] if (text := refiner.calibration_note()) else []
    overrides = {k: v for k, v in (("top_n", top_n), ("radius", radius)) if v is not None}
    if overrides and refiner.calibration is not None:  # the sweep ran at the stored ones
        stored = ", ".join(f"{k} {getattr(refiner.config, k)}" for k in overrides)
        notes.append(
            f"note: {refiner_name}'s decision options were chosen (--calibrate-split) at "
            f"{stored}; at other values they may no longer be the best"
        )
    refiner.config = dataclasses.replace(refiner.config, **overrides)
    if top_n is not None and top_n > refiner.num_classes:  # a stored one was noted by fit
        notes.append(f"note: {top_n_over_classes(top_n, refiner.num_classes)}")
    if refiner.config.top_n == 1:
        notes.append(
            "note: Top-N 1 leaves each pixel one candidate, the base's label: no pixel can change"
        )
    if base.class_names is not None:
        refiner.check_classes(base.class_names, len(base.class_names), what=base_name)
    if other_calibration_base(refiner, getattr(base, "module", None)):
        notes.append(f"warning: {OTHER_BASE.format(refiner=refiner_name)}")
    if augmented and not hasattr(base, "module"):
        raise ConfigError(
            f"--mode slide and --tta-* run the base model, but --base {base_name} holds saved "
            "probabilities; pass a checkpoint, or save them with 'dualseg predict --probs' "
            "and the same options"
        )
    return notes


def top_n_over_classes(top_n: int, num_classes: int) -> str:
    return (
        f"Top-N {top_n} is more than the {num_classes} classes: every class is a candidate, "
        f"as at Top-N {num_classes}"
    )


def base_scores(
    base: Any, x: torch.Tensor, name: str, path: Path, opts: InferenceOptions
) -> torch.Tensor:
    """The base's class scores for one image, with ``opts``' sliding window and TTA."""
    scores = infer_logits(
        lambda t: base.scores(t, [name] * t.shape[0], sources=[str(path)] * t.shape[0]),
        x,
        mode=opts.mode,
        window=opts.window,
        stride=opts.stride,
        tta_scales=opts.tta_scales,
        tta_flip=opts.tta_flip,
        tile_batch=opts.tile_batch,
    ).float()
    augmented = opts.mode != "whole" or opts.uses_tta
    return scores.softmax(1) if augmented else scores  # the averaged log-probabilities came back
