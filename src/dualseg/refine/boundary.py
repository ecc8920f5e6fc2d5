"""Near-boundary mask of a label map (method B, training step 2 and inference P4)."""

from __future__ import annotations

from typing import overload

import cv2
import numpy as np
import torch
from torch import Tensor

from dualseg.errors import ConfigError
from dualseg.metrics import neighbour_transitions

EDGE_METHODS = ("canny", "canny_only", "neighbour")


def semantic_boundary(label: np.ndarray, *, method: str = "canny") -> np.ndarray:
    """Boundary pixels (bool HxW) of one integer label map; every label transition is found."""
    if method not in EDGE_METHODS:
        raise ConfigError(f"unknown boundary method {method!r}; choose one of {EDGE_METHODS}")
    label = np.asarray(label)
    if method == "neighbour":
        return _neighbour_transitions(label)
    edges = _canny(label)
    return edges if method == "canny_only" else edges | _neighbour_transitions(label)


def _canny(label: np.ndarray) -> np.ndarray:
    count, code = _codes(label)
    if count < 2:
        return np.zeros(label.shape, dtype=bool)
    if code is None:  # more distinct labels than 8-bit grey levels: no Canny possible
        return _neighbour_transitions(label)
    return cv2.Canny(code, 1, 1, L2gradient=True) > 0


def _codes(label: np.ndarray) -> tuple[int, np.ndarray | None]:
    """``(number of distinct labels, uint8 grey codes)``: each pixel's label rank times the smallest
    step >= 1 that spreads the ranks over 0..255 (so a Sobel response >= 4); codes ``None`` with
    fewer than 2 or more than 256 labels."""
    if label.dtype.kind in "ui" and label.size and label.min() >= 0 and label.max() < 65536:
        present = np.bincount(label.ravel()) > 0
        count = int(present.sum())
        rank = np.cumsum(present) - 1  # a lookup table: label -> rank
    else:
        values, inverse = np.unique(label, return_inverse=True)
        count, rank, label = len(values), np.arange(len(values)), inverse.reshape(label.shape)
    if count < 2 or count > 256:  # no boundary, or more labels than 8-bit grey levels
        return count, None
    step = 255 // max(count - 1, 1)
    return count, (rank * step).astype(np.uint8)[label]  # one lookup, straight to uint8


def _neighbour_transitions(label: np.ndarray) -> np.ndarray:
    return neighbour_transitions(label)  # ignore takes part: a class/void border is a boundary


# The widest near-boundary band: its dilation kernel is (2r+1)^2 pixels, and at r = 100000
# OpenCV asked for 40 GB; a band wider than 256 px covers whole images anyway.
MAX_RADIUS = 256


def _ellipse(radius: int) -> np.ndarray:
    return cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (2 * radius + 1, 2 * radius + 1))


@overload
def near_boundary_mask(
    labels: Tensor, *, radius: int = ..., ignore_index: int | None = ..., method: str = ...
) -> Tensor: ...
@overload
def near_boundary_mask(
    labels: np.ndarray, *, radius: int = ..., ignore_index: int | None = ..., method: str = ...
) -> np.ndarray: ...
def near_boundary_mask(
    labels: Tensor | np.ndarray, *, radius: int = 5, ignore_index: int | None = 255,
    method: str = "canny",
) -> Tensor | np.ndarray:  # fmt: skip
    """Bool mask of pixels near a label boundary: the boundary dilated with OpenCV's elliptical
    ``(2·radius+1)``-square kernel (which reaches a little past a Euclidean ``radius``: up to 5.4
    px at radius 5; the metrics' trimap band is the exact disk)."""
    if not 0 <= radius <= MAX_RADIUS:
        raise ConfigError(f"near-boundary radius must be in 0..{MAX_RADIUS}, got {radius}")
    is_tensor = isinstance(labels, Tensor)
    arr = labels.detach().cpu().numpy() if is_tensor else np.asarray(labels)
    if arr.ndim not in (2, 3):
        raise ConfigError(f"label map must be [H,W] or [B,H,W], got shape {tuple(arr.shape)}")
    batch = arr[None] if arr.ndim == 2 else arr
    kernel = _ellipse(radius) if radius > 0 else None
    out = np.empty(batch.shape, dtype=bool)
    for i, label in enumerate(batch):  # one OpenCV call per image; pixels stay vectorized
        edges = semantic_boundary(label, method=method).astype(np.uint8)
        if kernel is not None:
            edges = cv2.dilate(edges, kernel)
        out[i] = edges > 0
    if ignore_index is not None:
        out &= batch != ignore_index
    out = out[0] if arr.ndim == 2 else out
    if is_tensor:
        return torch.from_numpy(out).to(labels.device)
    return out
