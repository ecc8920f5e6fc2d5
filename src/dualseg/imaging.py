"""Image arrays without torch: the RGB conversion and the input normalization, written once.

Everything that turns a user's picture into network input goes through here: the engine's
``Segmenter`` and ``BoundaryRefiner`` (torch) as well as the exported runtimes (numpy and
onnxruntime only), so both sides see the same pixels. Importing this module never imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dualseg.errors import DataError

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "as_rgb", "normalize", "numpy_to_rgb"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def numpy_to_rgb(a: np.ndarray) -> np.ndarray:
    """``HxWx3`` (or ``HxW`` gray, ``HxWx1``, ``HxWx4`` RGBA) uint8 or float in [0, 1] ->
    contiguous uint8 ``HxWx3``; a clear :class:`DataError` for anything else."""
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if a.ndim == 2:
        a = np.repeat(a[:, :, None], 3, axis=2)
    if a.ndim != 3 or a.shape[2] not in (3, 4):
        raise DataError(f"expected an HxWx3 RGB image array, got shape {a.shape}")
    a = a[:, :, :3]
    if np.issubdtype(a.dtype, np.floating):
        if a.size and (a.min() < -1e-3 or a.max() > 1 + 1e-3):
            raise DataError("float image arrays must hold RGB values in [0, 1]; or pass uint8")
        a = np.round(np.clip(a, 0.0, 1.0) * 255)
    elif a.dtype != np.uint8:
        raise DataError(f"image arrays must be uint8 (or float in [0, 1]), got {a.dtype}")
    if a.shape[0] == 0 or a.shape[1] == 0:
        raise DataError(f"empty image of shape {a.shape}")
    return np.ascontiguousarray(a, dtype=np.uint8)


def as_rgb(image: Any) -> np.ndarray:
    """uint8 ``HxWx3`` from a numpy array, a PIL image or an image file path (torch-free).

    Tensors are the engine's business (``dualseg.engine.predict.as_rgb_array``), and so is the
    full-featured file reader (``dualseg.data.read_image``, which imports torch with its package).
    """
    if isinstance(image, np.ndarray):
        return numpy_to_rgb(image)
    if isinstance(image, str | os.PathLike):
        from PIL import Image

        path = Path(image)
        if not path.is_file():
            raise DataError(f"image not found: {path} (check the path)")
        try:
            with Image.open(path) as im:
                return np.array(im.convert("RGB"))
        except (OSError, ValueError, SyntaxError) as err:
            raise DataError(f"{path}: unreadable image ({err}); check the file") from err
    if hasattr(image, "convert") and hasattr(image, "size"):  # PIL image
        return np.array(image.convert("RGB"))
    raise DataError(
        f"cannot segment a {type(image).__name__}: pass a file path, a PIL image, an HxWx3 "
        "uint8 numpy array or a [3,H,W] tensor"
    )


def normalize(
    arrays: Sequence[np.ndarray],
    mean: Sequence[float] | np.ndarray = IMAGENET_MEAN,
    std: Sequence[float] | np.ndarray = IMAGENET_STD,
) -> np.ndarray:
    """uint8 ``HxWx3`` arrays of one size -> float32 ``[B,3,H,W]``, ``(x / 255 - mean) / std``."""
    x = np.stack(arrays).astype(np.float32).transpose(0, 3, 1, 2) / 255.0
    m = np.asarray(mean, np.float32).reshape(1, -1, 1, 1)
    s = np.asarray(std, np.float32).reshape(1, -1, 1, 1)
    return (x - m) / s
