"""What every segmenter offers, torch-free: the engine's ``Segmenter`` (PyTorch) and the
exported runtime's ``ExportedSegmenter`` (onnxruntime / TorchScript) share this base.

A subclass sets ``meta`` (class names, palette, ignore index) and implements
``predict_batch``; ``predict``, ``predict_proba``, ``num_classes`` and ``class_names`` follow.
:func:`size_batches` is their common batching rule: images of equal size share a batch, so an
image's result never depends on the other images (no padding).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from dualseg.errors import ConfigError, DataError


def require_image_list(images: Any) -> None:
    """Refuse one image where ``predict_batch`` takes several (iterating it would read rows,
    channels or characters as images)."""
    one = isinstance(images, str | bytes | os.PathLike) or type(images).__module__.startswith(
        "PIL."
    )
    if one or getattr(images, "ndim", 4) <= 3:  # an array or tensor of one image
        raise DataError(
            f"predict_batch takes a list of images, got one {type(images).__name__}: wrap it in "
            "a list, or call predict"
        )


class Predictor:
    """``predict(image) -> HxW`` labels, ``predict_proba(image) -> float32 [C,H,W]``."""

    meta: Any  # DatasetMeta or ExportMeta

    @property
    def num_classes(self) -> int:
        return self.meta.num_classes

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.meta.class_names

    def predict(self, image: Any) -> np.ndarray:
        """Label map ``HxW`` (uint8 for up to 255 classes, else int64) at the original size."""
        return self.predict_batch([image])[0]

    def predict_proba(self, image: Any) -> np.ndarray:
        """Class probabilities ``float32 [C,H,W]`` at the original size."""
        return self.predict_batch([image], return_probs=True)[0][1]

    def __call__(self, image: Any) -> np.ndarray:
        return self.predict(image)

    def predict_batch(
        self, images: Sequence[Any], *, batch_size: int = 8, return_probs: bool = False
    ) -> list[Any]:
        """Labels (or ``(labels, probs)`` pairs with ``return_probs``), in input order."""
        raise NotImplementedError


def check_batch_size(batch_size: int) -> int:
    """``batch_size`` when it is an int >= 1; else one :class:`ConfigError`."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be an int >= 1, got {batch_size!r}")
    return batch_size


def size_batches(arrays: Sequence[np.ndarray], batch_size: int) -> Iterator[list[int]]:
    """Indices of ``arrays`` in batches of at most ``batch_size`` images of one size."""
    check_batch_size(batch_size)
    by_size: dict[tuple[int, ...], list[int]] = {}
    for i, a in enumerate(arrays):
        by_size.setdefault(a.shape[:2], []).append(i)
    for indices in by_size.values():
        for start in range(0, len(indices), batch_size):
            yield indices[start : start + batch_size]
