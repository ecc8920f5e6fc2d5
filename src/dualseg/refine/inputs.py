"""Checks of what users hand a refiner: image batches, class lists, stored tensors."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dualseg.engine.checkpoint import placeholder_class_names
from dualseg.errors import CheckpointError, DataError
from dualseg.serialization import nonfinite_keys, short_list

NORMALIZE = "normalize the batch (dualseg.imaging.normalize)"


def check_finite_refiner(source: str | os.PathLike[str], tensors: Mapping[str, Any]) -> None:
    """Refuse NaN or infinite weights or prototypes: they would relabel at random."""
    if bad := nonfinite_keys(tensors):
        raise CheckpointError(
            f"{source} holds NaN or infinite values ({short_list(bad, 3)}): its fit diverged; "
            "fit it again (a lower --lr)"
        )


def check_normalized_batch(images: Tensor | np.ndarray) -> None:
    """The batch form reads ImageNet-normalized floats ``[B,3,H,W]``: refuse another shape or
    type (the values: :func:`check_normalized_values`, where the embedding reads them)."""
    images = as_tensor(images)
    if images.dim() != 4 or images.shape[1] != 3:
        raise DataError(
            f"refine(images) takes a batch [B,3,H,W] of normalized RGB images, got shape "
            f"{tuple(images.shape)}; pass one image as an HxWx3 uint8 array or a path instead"
        )
    if not images.is_floating_point():
        raise DataError(
            f"refine(images [B,3,H,W]) takes ImageNet-normalized float images, got "
            f"{images.dtype}; {NORMALIZE}"
        )


def check_normalized_values(images: Tensor) -> None:
    """Refuse raw pixels as floats, warn on floats all in [0, 1] (RGB before normalization)."""
    lo, hi = map(float, torch.aminmax(images)) if images.numel() else (0.0, 0.0)
    if hi > 20:  # normalized images lie in -2.12..2.64: raw 0..255 pixels as floats
        raise DataError(f"refine(images): values up to {hi:g} are no ImageNet-normalized image; "
                        f"{NORMALIZE}")  # fmt: skip
    if lo >= 0.0 and 0.0 < hi <= 1.0:
        warnings.warn(
            f"refine(images): every value lies in [0, 1], which looks like RGB before ImageNet "
            f"normalization; {NORMALIZE}",
            stacklevel=6,  # refine's caller, past candidates and two no_grad wrappers
        )


def name_differences(theirs: Sequence[str], ours: Sequence[str]) -> str:
    """Up to three ``i: 'a' vs 'b'`` where two class lists differ, else their counts."""
    pairs = enumerate(zip(theirs, ours, strict=False))
    diff = [f"{i}: {a!r} vs {b!r}" for i, (a, b) in pairs if a != b]
    return "; ".join(diff[:3]) or f"{len(theirs)} vs {len(ours)} classes"


def check_classes(
    names: Sequence[str], base_names: Sequence[str] | None, num_classes: int, *, what: str
) -> None:
    """Raise :class:`CheckpointError` when a base model's classes are not a refiner's ``names``."""
    names = tuple(names)
    fix = "fit a refiner on the base model's dataset (dualseg refine fit)"
    if num_classes != len(names):
        raise CheckpointError(
            f"{what} predicts {num_classes} classes but the refiner was fit for {len(names)}; {fix}"
        )
    if base_names is None or tuple(base_names) == names:
        return
    if tuple(base_names) == placeholder_class_names(num_classes):
        raise CheckpointError(
            f"{what} stores no class names (they read class_0 .. class_{num_classes - 1}); "
            f"save the base with its dataset's class names, or {fix}"
        )
    raise CheckpointError(
        f"{what}'s class names differ from the refiner's "
        f"({name_differences(base_names, names)}); {fix}"
    )


def as_tensor(x: Any) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    raise DataError(f"class probabilities must be a tensor or numpy array, got {type(x).__name__}")
