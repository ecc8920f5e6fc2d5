"""Run exported models: onnxruntime (no torch) or TorchScript, with the metadata they carry.

- :class:`OnnxSegmenter` / :class:`ExportedSegmenter`: method A's exported network with the
  engine ``Segmenter``'s interface; an ONNX model on arrays, PIL images or files never
  imports torch.
- :func:`load_exported_refiner`: method B from an exported embedding model and its JSON
  sidecar, with ``BoundaryRefiner.refine``'s contract.
- :func:`read_export_info`: the metadata of an ONNX or TorchScript export (torch-free).
"""

from __future__ import annotations

from dualseg.export.exported_refiner import ExportedRefiner, load_exported_refiner
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
    "read_export_info",
    "refiner_sidecar_path",
]
