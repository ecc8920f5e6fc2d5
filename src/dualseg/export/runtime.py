"""Run exported models: onnxruntime (no torch) or TorchScript, with the metadata they carry.

- :class:`OnnxSegmenter` / :class:`ExportedSegmenter`: method A's exported network with the
  engine ``Segmenter``'s interface (``predict``, ``predict_proba``, ``predict_batch``,
  ``meta``, ``num_classes``, ``class_names``); an ONNX model on arrays, PIL images or files
  never imports torch.
- :func:`load_exported_refiner`: method B from an exported embedding model and its JSON sidecar
  (``BoundaryRefiner.refine``'s contract; P2-P5 are ``dualseg.refine``'s code, with torch).
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dualseg.errors import CheckpointError, DataError
from dualseg.export.runners import (
    REEXPORT,
    ExportMeta,
    Runner,
    _as_rgb,
    read_export_info,
)
from dualseg.imaging import normalize, read_image, resize_bilinear
from dualseg.predictor import Predictor, check_batch_size, require_image_list, size_batches
from dualseg.serialization import read_torchscript_meta
from dualseg.viz import default_palette

if TYPE_CHECKING:  # imported on first use by __getattr__ below
    from dualseg.data.contract import LabelContract
    from dualseg.export.exported_refiner import ExportedRefiner, load_exported_refiner

__all__ = [
    "ExportedRefiner",
    "ExportedSegmenter",
    "OnnxSegmenter",
    "load_exported_refiner",
    "load_refiner",
    "read_export_info",
]


def _numbers(value: Any, n: int, kind: type | tuple[type, ...] = (int, float)) -> bool:
    ok = isinstance(value, list) and len(value) == n
    return ok and all(isinstance(v, kind) and not isinstance(v, bool) for v in value)


def _colour(c: Any) -> bool:
    return _numbers(c, 3, int) and 0 <= min(c) <= max(c) <= 255


# metadata entry -> (whether a value is fine, what it must be); a file edited by hand (or by
# another tool) is one error naming its first bad entry, before any of it is used
METADATA_RULES: dict[str, tuple[Any, str]] = {
    "class_names": (
        lambda v: isinstance(v, list) and bool(v) and all(isinstance(c, str) for c in v),
        "a non-empty list of class names",
    ),
    "mean": (lambda v: _numbers(v, 3), "three numbers (RGB)"),
    "std": (lambda v: _numbers(v, 3) and min(v) > 0, "three positive numbers"),
    "output": (lambda v: v in ("logits", "probs"), "'logits' or 'probs'"),
    "palette": (
        lambda v: v is None or (isinstance(v, list) and all(map(_colour, v))),
        "a list of [r, g, b] colours in 0..255",
    ),
    "ignore_index": (lambda v: _numbers([v], 1, int), "an integer"),
    "input_size": (lambda v: v is None or (_numbers(v, 2, int) and min(v) >= 1), "[H, W] or null"),
}


class ExportedSegmenter(Predictor):
    """An exported method-A network (ONNX or TorchScript file) ready for raw images.

    A dynamic export runs each image at its own size (equal sizes share a batch); a static one
    resizes each image to the exported size and the scores back (bilinear).
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
        self.info = read_export_info(self.path)
        if not self.accepts_torchscript and zipfile.is_zipfile(self.path):
            raise CheckpointError(f"{path} is a TorchScript file; use ExportedSegmenter for it")
        if self.info.get("kind") != "segmenter":
            raise CheckpointError(
                f"{self.path} is an exported refiner, not a segmentation network: pass it as "
                "--refiner (Python: load_exported_refiner)"
            )
        for key, (ok, expected) in METADATA_RULES.items():
            if not ok(self.info.get(key)):
                shown = repr(self.info.get(key, "<missing>"))[:60]
                raise CheckpointError(
                    f"{path}: its metadata {key} must be {expected}, got {shown}; {REEXPORT}"
                )
        names = tuple(self.info["class_names"])
        palette = self.info.get("palette") or []
        if len(palette) != len(names):  # none stored
            palette = default_palette(len(names))
        self.meta = ExportMeta(
            name=str(self.info.get("dataset") or "exported"),
            class_names=names,
            palette=tuple(tuple(int(v) for v in c) for c in palette),  # type: ignore[misc]
            ignore_index=self.info["ignore_index"],
        )
        contract = self.info.get("label_contract") or {}  # how the training data was read
        depth = contract.get("bit_depth") if isinstance(contract, dict) else None
        self.bit_depth: int | None = depth if isinstance(depth, int) else None
        self.mean = np.asarray(self.info["mean"], np.float32)
        self.std = np.asarray(self.info["std"], np.float32)
        size = self.info.get("input_size")
        self.input_size: tuple[int, int] | None = tuple(size) if size else None  # type: ignore[assignment]
        self.runner = Runner(self.path, self.input_size, providers, threads)

    @property
    def contract(self) -> LabelContract | None:
        """The label contract of the model's training data, from the metadata (None: none)."""
        from dualseg.data.contract import LabelContract  # imports torch: on first use only

        stored = self.info.get("label_contract")
        try:
            return None if stored is None else LabelContract.from_dict(stored)
        except (DataError, TypeError, ValueError) as err:
            raise CheckpointError(
                f"{self.path}: its label_contract is invalid ({err}); {REEXPORT}"
            ) from None

    def __repr__(self) -> str:
        kind = "dynamic" if self.input_size is None else f"static {self.input_size}"
        return (
            f"{type(self).__name__}({self.path.name}: {self.info.get('arch')}, "
            f"{self.num_classes} classes, {kind}, {self.info['output']})"
        )

    def predict_batch(
        self, images: Sequence[Any], *, batch_size: int = 8, return_probs: bool = False
    ) -> list[Any]:
        """Labels (or ``(labels, probs)`` pairs) for several images, in input order; image
        files are read at the export's stored bit depth, as its training images were."""
        require_image_list(images)
        check_batch_size(batch_size)
        arrays = [read_image(im, bit_depth=self.bit_depth) if isinstance(im, str | os.PathLike)
                  else _as_rgb(im) for im in images]  # fmt: skip
        out: list[Any] = [None] * len(arrays)
        for indices, probs in self._run(arrays, batch_size):
            labels = probs.argmax(1).astype(np.uint8 if self.num_classes <= 255 else np.int64)
            for k, i in enumerate(indices):
                out[i] = (labels[k], probs[k]) if return_probs else labels[k]
        return out

    def _run(self, arrays: list[np.ndarray], batch_size: int) -> Iterator[Any]:
        if self.input_size is not None:  # static export: batch 1 at the exported size
            for i, a in enumerate(arrays):
                x = normalize([resize_bilinear(a, self.input_size)], self.mean, self.std)
                scores = resize_bilinear(self.runner(x)[0].transpose(1, 2, 0), a.shape[:2])
                yield [i], self._probs(scores.transpose(2, 0, 1)[None])
            return
        for chunk in size_batches(arrays, batch_size):
            x = normalize([arrays[i] for i in chunk], self.mean, self.std)
            yield chunk, self._probs(self.runner(x))

    def _probs(self, scores: np.ndarray) -> np.ndarray:
        if scores.ndim != 4 or scores.shape[1] != self.num_classes:
            raise CheckpointError(
                f"{self.path} outputs scores of shape {tuple(scores.shape)} but its metadata "
                f"names {self.num_classes} classes; {REEXPORT}"
            )
        if self.info["output"] == "probs":
            return scores.astype(np.float32, copy=False)
        e = np.exp(scores - scores.max(axis=1, keepdims=True))
        return (e / e.sum(axis=1, keepdims=True)).astype(np.float32, copy=False)


class OnnxSegmenter(ExportedSegmenter):
    """:class:`ExportedSegmenter` for an ONNX file, run by onnxruntime (no torch)."""

    accepts_torchscript = False


def load_refiner(path: str | os.PathLike[str], *, device: Any = "cpu") -> Any:
    """Either refiner: a ``dualseg refine fit`` file or folder (``BoundaryRefiner.load``) or
    an exported one (its ``.json`` sidecar, ``.onnx`` model or exported TorchScript ``.pt``):
    what ``--refiner`` accepts in ``refine apply``, ``eval`` and ``serve``."""
    from dualseg.export.exported_refiner import load_exported_refiner
    from dualseg.refine import BoundaryRefiner

    p = Path(path)
    if p.suffix.lower() in (".json", ".onnx") or (p.is_file() and read_torchscript_meta(p)):
        return load_exported_refiner(p)
    return BoundaryRefiner.load(path, device=device)  # as given: Path() would break hf://


def __getattr__(name: str) -> Any:
    """The refiner names, imported on first use: they import torch, which the ONNX segmenter
    path never needs."""
    if name in ("ExportedRefiner", "load_exported_refiner"):
        from dualseg.export import exported_refiner

        return getattr(exported_refiner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
