"""Exported files, torch-free: their metadata and the :class:`Runner` that executes them.

Metadata: ONNX ``metadata_props`` ``dualseg.<key>`` (JSON values), TorchScript
``_extra_files["dualseg.json"]`` (a zip archive: read without torch).
"""

from __future__ import annotations

import importlib
import io
import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dualseg.engine.options import MAX_THREADS  # the cap the CLI's --threads has too
from dualseg.errors import CheckpointError, ConfigError, DualsegError
from dualseg.imaging import as_rgb, resize_bilinear
from dualseg.serialization import read_torchscript_meta, torch_file_format

EXPORT_FORMAT = "dualseg-export/1"
REFINER_FORMAT = "dualseg-refiner-export/1"
META_PREFIX = "dualseg."
ZIP_MAGIC = b"PK\x03\x04"
REEXPORT = "re-export it with 'dualseg export'"


def import_extra(module: str) -> Any:
    """Import a package of the ``export`` extra; missing, one line naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        if (err.name or "").split(".")[0] != module:
            raise  # the package is there but broken: its own error says more
        raise DualsegError(
            f"the optional package {module!r} is not installed; it comes with the 'export' "
            "extra: pip install 'dualseg[export]'"
        ) from err


@dataclass(frozen=True)
class ExportMeta:
    """``DatasetMeta``'s inference fields, without importing torch."""

    name: str
    class_names: tuple[str, ...]
    palette: tuple[tuple[int, int, int], ...]
    ignore_index: int = 255

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


def _starts_as_zip(path: Path) -> bool:
    """TorchScript or torch.save, even cut short (``zipfile.is_zipfile`` reads the end)."""
    with open(path, "rb") as f:
        return f.read(4) == ZIP_MAGIC


def refiner_sidecar_path(model_path: str | os.PathLike[str]) -> Path:
    """The JSON beside an exported embedding model: ``refiner.onnx`` -> ``refiner.json``."""
    return Path(model_path).with_suffix(".json")


def _torchscript_info(path: Path) -> dict[str, Any]:
    info = read_torchscript_meta(path)
    if info is None:  # a zip, but no TorchScript archive
        kind = torch_file_format(path)  # "": unreadable (cut short); None: not dualseg's
        what = (
            "a zip archive that cannot be read: cut short? Export it again" if kind == ""
            else "a method-B refiner: pass it as --refiner" if (kind or "").startswith(
                "dualseg-refiner") else "a PyTorch file (a checkpoint? pass it as -c)"
        )  # fmt: skip
        raise CheckpointError(f"{path} is no exported model: {what}")
    if not info:
        raise CheckpointError(f"{path} is a TorchScript file without dualseg metadata; {REEXPORT}")
    return info


def _onnx_info(path: Path) -> dict[str, Any]:
    ort = import_extra("onnxruntime")
    try:
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as err:  # onnxruntime raises its own exception types
        reason = str(err).splitlines()[0]
        raise CheckpointError(
            f"{path} is not a readable ONNX model ({reason}); {REEXPORT}"
        ) from err
    info = {}
    for key, text in sess.get_modelmeta().custom_metadata_map.items():
        if key.startswith(META_PREFIX):
            try:
                info[key.removeprefix(META_PREFIX)] = json.loads(text)
            except ValueError:
                raise CheckpointError(
                    f"{path}: its metadata {key} is not valid JSON; {REEXPORT}"
                ) from None
    return info


def read_export_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The metadata dict of an exported ONNX or TorchScript file (see ``export_info``)."""
    path = Path(path)
    if path.is_dir():
        kind = "a pretrained folder" if (path / "config.json").is_file() else "a folder"
        raise CheckpointError(
            f"{path} is {kind}, not an exported ONNX or TorchScript file; pass a pretrained "
            "folder as a checkpoint (-c), or export one with 'dualseg export'"
        )
    if not path.is_file():
        raise CheckpointError(f"exported model not found: {path} (check the path)")
    info = _torchscript_info(path) if _starts_as_zip(path) else _onnx_info(path)
    if info.get("format") != EXPORT_FORMAT:
        raise CheckpointError(f"{path} carries no dualseg export metadata; {REEXPORT}")
    return info


def _resize_chw_batch(x: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """Bilinear resize of a float ``[B,C,H,W]`` batch to ``hw`` (OpenCV, no torch)."""
    out = np.stack([resize_bilinear(a.transpose(1, 2, 0), hw) for a in x.astype(np.float32)])
    return out.reshape(*out.shape[:3], -1).transpose(0, 3, 1, 2)


class Runner:
    """``float32 [B,3,H,W] -> float32 output`` through onnxruntime (no torch) or TorchScript.
    A static export (``static_hw``) runs every batch at its one size: others are resized to it."""

    def __init__(
        self,
        source: Path | bytes,
        static_hw: Sequence[int] | None = None,
        providers: Sequence[str] | None = None,
        threads: int | None = None,
    ) -> None:
        ok = isinstance(threads, int | np.integer) and not isinstance(threads, bool)
        if threads is not None and not (ok and 0 <= threads <= MAX_THREADS):
            raise ConfigError(f"threads must be None or an int 0..{MAX_THREADS}, got {threads!r}")
        self.threads = int(threads) if threads else None
        self.static_hw = tuple(int(v) for v in static_hw) if static_hw else None
        data = source if isinstance(source, bytes) else None
        self.module: Any = None
        if data[:4] == ZIP_MAGIC if data is not None else _starts_as_zip(Path(source)):
            import torch

            with warnings.catch_warnings():  # torch.jit is deprecated, still supported
                warnings.filterwarnings("ignore", message=".*is deprecated.*")
                self.module = torch.jit.load(io.BytesIO(data) if data else str(source)).eval()
            return
        ort = import_extra("onnxruntime")
        opts = ort.SessionOptions()
        if self.threads:
            opts.intra_op_num_threads = self.threads
        self.session = ort.InferenceSession(
            data if data is not None else str(source),
            sess_options=opts,
            providers=list(providers or ["CPUExecutionProvider"]),
        )

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.static_hw is not None and tuple(x.shape[-2:]) != self.static_hw:
            x = _resize_chw_batch(x, self.static_hw)
        x = np.ascontiguousarray(x, np.float32)
        if self.module is None:
            return self.session.run(None, {"image": x})[0]
        import torch

        before = torch.get_num_threads()
        if self.threads:  # as onnxruntime's intra-op threads: for this run only
            torch.set_num_threads(self.threads)
        try:
            with torch.no_grad():
                return self.module(torch.from_numpy(x)).float().numpy()
        finally:
            torch.set_num_threads(before)


def _as_rgb(image: Any) -> np.ndarray:
    """uint8 ``HxWx3`` from a path, PIL image, numpy array (torch-free) or tensor."""
    if hasattr(image, "detach"):
        from dualseg.engine.predict import as_rgb_array  # tensors: torch is loaded anyway

        return as_rgb_array(image)
    return as_rgb(image)
