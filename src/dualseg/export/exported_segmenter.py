"""``ExportedSegmenter`` / ``OnnxSegmenter``: an exported method-A network for raw images.

The engine ``Segmenter``'s interface (``predict``, ``predict_proba``, ``predict_batch``,
``meta``, ``num_classes``, ``class_names``), so ``dualseg predict --onnx`` and ``dualseg serve
--onnx`` can use it. Importing this module and running an ONNX model on numpy arrays, PIL
images or image files never imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dualseg.errors import CheckpointError
from dualseg.export.runners import (
    ExportMeta,
    _as_rgb,
    _is_torchscript,
    _open_runner,
    read_export_info,
)
from dualseg.imaging import normalize, resize_bilinear
from dualseg.predictor import Predictor, check_batch_size, require_image_list, size_batches
from dualseg.serialization import read_torchscript_meta
from dualseg.viz import default_palette


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _check_segmenter_info(path: Path, info: dict[str, Any]) -> None:
    """One :class:`CheckpointError` naming the metadata entry of an exported segmentation
    network that is missing or malformed (a file edited by hand, or by another tool), before
    any of it is used."""

    def number_list(value: Any, n: int) -> bool:
        return (
            isinstance(value, list)
            and len(value) == n
            and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
        )

    names, palette, size = info.get("class_names"), info.get("palette"), info.get("input_size")
    checks = [
        (
            isinstance(names, list) and bool(names) and all(isinstance(c, str) for c in names),
            "class_names",
            "a non-empty list of class names",
        ),
        (number_list(info.get("mean"), 3), "mean", "three numbers (RGB)"),
        (
            number_list(info.get("std"), 3) and all(v > 0 for v in info["std"]),
            "std",
            "three positive numbers (RGB)",
        ),
        (info.get("output") in ("logits", "probs"), "output", "'logits' or 'probs'"),
        (
            palette is None
            or (
                isinstance(palette, list)
                and all(
                    number_list(c, 3) and all(isinstance(v, int) and 0 <= v <= 255 for v in c)
                    for c in palette
                )
            ),
            "palette",
            "a list of [r, g, b] colours in 0..255",
        ),
        (
            isinstance(info.get("ignore_index", 255), int)
            and not isinstance(info.get("ignore_index", 255), bool),
            "ignore_index",
            "an integer",
        ),
        (
            size is None
            or (number_list(size, 2) and all(isinstance(v, int) and v >= 1 for v in size)),
            "input_size",
            "null or [height, width]",
        ),
    ]
    for ok, key, expected in checks:
        if not ok:
            shown = repr(info.get(key, "<missing>"))
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise CheckpointError(
                f"{path}: its metadata {key} must be {expected}, got {shown}; re-export it "
                "with 'dualseg export'"
            )


# ----------------------------------------------------------------------------- segmenter
class ExportedSegmenter(Predictor):
    """An exported method-A network (ONNX or TorchScript file) ready for raw images.

    Same interface as ``dualseg.engine.predict.Segmenter``: ``predict(image) -> HxW`` labels
    (uint8), ``predict_proba(image) -> float32 [C,H,W]``, ``predict_batch(images, *,
    batch_size, return_probs)``, ``meta``, ``num_classes``, ``class_names``. A dynamic export
    runs each image at its own size (equal sizes share a batch); a static one resizes each
    image to the exported size and the scores back (bilinear), one image per run.
    """

    accepts_torchscript = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        providers: Sequence[str] | None = None,
        threads: int | None = None,
    ) -> None:
        self.path = Path(path)
        if (
            not self.accepts_torchscript
            and self.path.is_file()
            and _is_torchscript(self.path)
            and read_torchscript_meta(self.path) is not None  # a checkpoint is a zip too
        ):
            raise CheckpointError(
                f"{path} is a TorchScript file; use ExportedSegmenter for it, or export ONNX "
                "with 'dualseg export --format onnx'"
            )
        self.info = read_export_info(self.path)
        if self.info.get("kind") != "segmenter":
            raise CheckpointError(
                f"{self.path} holds a {self.info.get('kind')!r} model, not a segmentation "
                "network: an exported refiner (CLI: pass it as --refiner; Python: "
                "load_exported_refiner)"
            )
        _check_segmenter_info(self.path, self.info)
        names = tuple(self.info["class_names"])
        palette = self.info.get("palette") or []
        if len(palette) != len(names):  # none stored (an export_model call without one)
            palette = default_palette(len(names))
        self.meta = ExportMeta(
            name=str(self.info.get("dataset") or "exported"),
            class_names=names,
            palette=tuple(tuple(int(v) for v in c) for c in palette),  # type: ignore[misc]
            ignore_index=int(self.info.get("ignore_index", 255)),
        )
        self.mean = np.asarray(self.info["mean"], np.float32).reshape(1, 3, 1, 1)
        self.std = np.asarray(self.info["std"], np.float32).reshape(1, 3, 1, 1)
        size = self.info.get("input_size")
        self.input_size: tuple[int, int] | None = tuple(size) if size else None  # type: ignore[assignment]
        self.runner = _open_runner(self.path, providers, threads)

    def __repr__(self) -> str:
        kind = "dynamic" if self.input_size is None else f"static {self.input_size}"
        return (
            f"{type(self).__name__}({self.path.name}: {self.info.get('arch')}, "
            f"{self.num_classes} classes, {kind}, {self.info['output']})"
        )

    def to_input(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """uint8 ``HxWx3`` arrays of one size -> normalized float32 ``[B,3,H,W]``."""
        return normalize(arrays, self.mean, self.std)

    def predict_batch(
        self, images: Sequence[Any], *, batch_size: int = 8, return_probs: bool = False
    ) -> list[Any]:
        """Labels (or ``(labels, probs)`` pairs) for several images, in input order."""
        require_image_list(images)
        check_batch_size(batch_size)  # a static export runs one image at a time, but -3 is no size
        arrays = [_as_rgb(im) for im in images]
        out: list[Any] = [None] * len(arrays)
        for indices, probs in self._run(arrays, batch_size):
            labels = probs.argmax(1).astype(np.uint8 if self.num_classes <= 255 else np.int64)
            for k, i in enumerate(indices):
                out[i] = (labels[k], probs[k]) if return_probs else labels[k]
        return out

    def _run(self, arrays: list[np.ndarray], batch_size: int):
        if self.input_size is not None:  # static export: batch 1 at the exported size
            for i, a in enumerate(arrays):
                scores = self.runner(self.to_input([resize_bilinear(a, self.input_size)]))[0]
                scores = resize_bilinear(scores.transpose(1, 2, 0), a.shape[:2]).transpose(2, 0, 1)
                yield [i], self._probs(scores[None])
            return
        for chunk in size_batches(arrays, batch_size):
            yield chunk, self._probs(self.runner(self.to_input([arrays[i] for i in chunk])))

    def _probs(self, scores: np.ndarray) -> np.ndarray:
        if scores.ndim != 4 or scores.shape[1] != self.num_classes:
            raise CheckpointError(
                f"{self.path} outputs scores of shape {tuple(scores.shape)} but its metadata "
                f"names {self.num_classes} classes; re-export it with 'dualseg export'"
            )
        scores = scores.astype(np.float32, copy=False)
        return scores if self.info["output"] == "probs" else _softmax(scores, axis=1)


class OnnxSegmenter(ExportedSegmenter):
    """:class:`ExportedSegmenter` for an ONNX file, run by onnxruntime (no torch).

    >>> seg = OnnxSegmenter("model.onnx")            # doctest: +SKIP
    >>> labels = seg.predict("street.png")           # HxW uint8
    """

    accepts_torchscript = False
