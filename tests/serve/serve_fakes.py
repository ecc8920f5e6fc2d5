"""A tiny fake segmenter and refiner: the app is tested without training a network."""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

NAMES = ["road", "car", "sky"]  # classes of the tiny checkpoint of conftest.files


@dataclass(frozen=True)
class FakeMeta:
    name: str = "fake"
    class_names: tuple[str, ...] = ("dark", "mid", "bright")
    palette: tuple[tuple[int, int, int], ...] = ((0, 0, 255), (0, 255, 0), (255, 0, 0))
    ignore_index: int = 255


class BrightnessSegmenter:
    """Class = brightness third of the pixel (0: dark, 1: mid, 2: bright)."""

    meta = FakeMeta()

    def predict_proba(self, image: np.ndarray) -> np.ndarray:
        gray = image.astype(np.float32).mean(axis=2)
        label = np.minimum(gray // 86, 2).astype(np.int64)
        probs = np.full((3, *label.shape), 0.1, np.float32)
        np.put_along_axis(probs, label[None], 0.8, axis=0)
        return probs


class TopRowRefiner:
    """Single-image form of BoundaryRefiner.refine: relabels the first row as class 0."""

    def __init__(self, class_names: tuple[str, ...] = ("dark", "mid", "bright")) -> None:
        self.class_names = class_names

    def check_classes(self, base_names, num_classes, *, what="the base model"):
        from dualseg.refine.inputs import check_classes

        check_classes(self.class_names, base_names, num_classes, what=what)

    def refine(self, image, probs, *, return_changed=False):
        assert image.dtype == np.uint8 and image.shape[:2] == probs.shape[1:]
        labels = probs.argmax(0)
        refined = labels.copy()
        refined[0, :] = 0
        return (refined, refined != labels) if return_changed else refined


def gradient_png(h: int = 48, w: int = 64) -> bytes:
    """Left-to-right gray ramp: all three brightness classes are present."""
    ramp = np.tile(np.linspace(0, 255, w, dtype=np.float32), (h, 1)).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(np.stack([ramp] * 3, axis=2)).save(buf, format="PNG")
    return buf.getvalue()
