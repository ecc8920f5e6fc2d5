"""Checks of what users hand a refiner: image batches, class lists, palettes, stored tensors."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dualseg.engine.checkpoint import placeholder_class_names
from dualseg.errors import CheckpointError, ConfigError, DataError
from dualseg.serialization import nonfinite_keys, short_list


def check_finite_refiner(source: str | os.PathLike[str], tensors: Mapping[str, Any]) -> None:
    """Refuse a stored refiner with NaN or infinite weights or prototypes: its distances would
    relabel near-boundary pixels at random, without an error anywhere after."""
    if bad := nonfinite_keys(tensors):
        raise CheckpointError(
            f"{source} holds NaN or infinite values ({short_list(bad, 3)}): its fit diverged; "
            "fit it again (a lower --lr)"
        )


# ImageNet-normalized images lie in -2.12..2.64; far above that is raw 0..255 pixels as floats
# (random test images, or another normalization, may pass 2.64 a little, so only far above)
RAW_PIXELS_ABOVE = 20.0


def check_normalized_batch(images: Tensor | np.ndarray) -> None:
    """The batch form reads ImageNet-normalized floats ``[B,3,H,W]`` (a tensor, or a numpy
    array for the exported refiner): refuse another shape and integer images (raw pixels), and
    warn on floats all in [0, 1] (``to_tensor`` output, which normalization would take below
    0 wherever a channel is darker than its ImageNet mean)."""
    if isinstance(images, np.ndarray):
        images = torch.from_numpy(np.ascontiguousarray(images))
    if images.dim() != 4 or images.shape[1] != 3:
        raise DataError(
            f"refine(images) takes a batch [B,3,H,W] of normalized RGB images, got shape "
            f"{tuple(images.shape)}; pass one image as an HxWx3 uint8 array, a path or a PIL "
            "image instead"
        )
    if not images.is_floating_point():
        raise DataError(
            f"refine(images [B,3,H,W]) takes ImageNet-normalized float images, got {images.dtype}"
            "; pass one image as an HxWx3 uint8 array, a path or a PIL image instead, or "
            "normalize the batch (dualseg.imaging.normalize)"
        )
    lo, hi = map(float, torch.aminmax(images)) if images.numel() else (0.0, 0.0)  # one pass
    if hi > RAW_PIXELS_ABOVE:
        raise DataError(
            f"refine(images [B,3,H,W]): values up to {hi:g} are no ImageNet-normalized image "
            "(those lie in -2.12..2.64), raw 0..255 pixels? normalize the batch "
            "(dualseg.imaging.normalize)"
        )
    if lo >= 0.0 and 0.0 < hi <= 1.0:
        warnings.warn(
            "refine(images [B,3,H,W]): every value lies in [0, 1], which looks like RGB before "
            "ImageNet normalization; the batch form expects normalized images "
            "(dualseg.imaging.normalize)",
            stacklevel=3,
        )


def as_palette(
    palette: Sequence[Sequence[int]] | None, num_classes: int
) -> tuple[tuple[int, int, int], ...] | None:
    """A stored palette as RGB tuples, one per class (``None`` stays ``None``)."""
    if palette is None:
        return None
    rgb = tuple(tuple(int(v) for v in c) for c in palette)
    if len(rgb) != num_classes or any(len(c) != 3 for c in rgb):
        raise ConfigError(
            f"a refiner palette needs one RGB colour per class ({num_classes}), got {len(rgb)}"
        )
    return rgb  # type: ignore[return-value]


def name_differences(theirs: Sequence[str], ours: Sequence[str]) -> str:
    """Where two class lists differ, for a message: up to three ``i: 'a' vs 'b'``, or the two
    counts when one list only extends the other."""
    pairs = enumerate(zip(theirs, ours, strict=False))
    diff = [f"{i}: {a!r} vs {b!r}" for i, (a, b) in pairs if a != b]
    return "; ".join(diff[:3]) or f"{len(theirs)} vs {len(ours)} classes"


def check_classes(
    names: Sequence[str], base_names: Sequence[str] | None, num_classes: int, *, what: str
) -> None:
    """Raise :class:`CheckpointError` when a base model's classes are not a refiner's
    ``names`` (shared by ``BoundaryRefiner`` and the exported refiner)."""
    names = tuple(names)
    if num_classes != len(names):
        raise CheckpointError(
            f"{what} predicts {num_classes} classes but the refiner was fit for "
            f"{len(names)} ({', '.join(names)}); fit a refiner on the base "
            "model's dataset (dualseg refine fit)"
        )
    if base_names is not None and tuple(base_names) != names:
        if tuple(base_names) == placeholder_class_names(num_classes):
            raise CheckpointError(  # the base's checkpoint stored no names
                f"{what} stores no class names (they read class_0 .. class_{num_classes - 1}), "
                f"so its classes cannot be matched to the refiner's ({', '.join(names)}); save "
                "the base with its dataset's class names, or fit a refiner on it"
            )
        raise CheckpointError(
            f"{what}'s class names differ from the refiner's "
            f"({name_differences(base_names, names)}); "
            "use a refiner fit on the same dataset and class order"
        )


def as_tensor(x: Any) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    raise DataError(f"class probabilities must be a tensor or numpy array, got {type(x).__name__}")
