"""Run exported models: onnxruntime (no torch) or TorchScript, with the metadata they carry.

- :class:`OnnxSegmenter` — method A's exported network with the engine ``Segmenter``'s
  interface (``predict``, ``predict_proba``, ``predict_batch``, ``meta``, ``num_classes``,
  ``class_names``), so ``dualseg predict --onnx`` and ``dualseg serve --onnx`` can use it.
  Importing this module and running an ONNX model on numpy arrays, PIL images or image files
  never imports torch.
- :func:`load_exported_refiner` — method B from an exported embedding model plus its JSON
  sidecar (prototypes, configuration), with ``BoundaryRefiner.refine``'s contract. The
  embedding runs in onnxruntime; the configuration (``RefinerConfig``) and P2-P5 are
  ``BoundaryRefiner``'s own code from ``dualseg.refine``, which imports torch.

This module gathers them; the code is in :mod:`~dualseg.export.runners` (metadata, runners),
:mod:`~dualseg.export.exported_segmenter` and :mod:`~dualseg.export.exported_refiner`.

Export metadata: ONNX ``metadata_props`` ``dualseg.<key>`` (JSON values), TorchScript
``_extra_files["dualseg.json"]``; both read by :func:`read_export_info` (torch-free: a
TorchScript file is a zip archive).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dualseg.export.exported_segmenter import ExportedSegmenter, OnnxSegmenter
from dualseg.export.runners import (
    EXPORT_FORMAT,
    META_PREFIX,
    REFINER_FORMAT,
    ExportMeta,
    import_extra,
    is_exported_torchscript,
    read_export_info,
    refiner_sidecar_path,
)
from dualseg.serialization import TORCHSCRIPT_META

if TYPE_CHECKING:  # imported on first use by __getattr__ below
    from dualseg.export.exported_refiner import ExportedRefiner, load_exported_refiner

__all__ = [
    "EXPORT_FORMAT",
    "META_PREFIX",
    "REFINER_FORMAT",
    "TORCHSCRIPT_META",
    "ExportMeta",
    "ExportedRefiner",
    "ExportedSegmenter",
    "OnnxSegmenter",
    "import_extra",
    "is_exported_torchscript",
    "load_exported_refiner",
    "load_refiner",
    "read_export_info",
    "refiner_sidecar_path",
]


def load_refiner(path: str | os.PathLike[str], *, device: Any = "cpu") -> Any:
    """Either refiner: a ``dualseg refine fit`` file or folder (``BoundaryRefiner.load``) or
    an exported one (its ``.json`` sidecar, ``.onnx`` model or exported TorchScript ``.pt``):
    what ``--refiner`` accepts in ``refine apply``, ``eval`` and ``serve``."""
    from dualseg.export.exported_refiner import load_exported_refiner
    from dualseg.refine import BoundaryRefiner

    p = Path(path)
    if p.suffix.lower() in (".json", ".onnx") or is_exported_torchscript(p):
        return load_exported_refiner(p)
    return BoundaryRefiner.load(path, device=device)  # as given: Path() would break hf://


def __getattr__(name: str) -> Any:
    """The refiner names, imported on first use: they import torch, which the ONNX segmenter
    path never needs."""
    if name in ("ExportedRefiner", "load_exported_refiner"):
        from dualseg.export import exported_refiner

        return getattr(exported_refiner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
