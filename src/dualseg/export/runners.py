"""Exported files, torch-free: their metadata and the runners that execute them.

ONNX ``metadata_props`` ``dualseg.<key>`` (JSON values) and TorchScript
``_extra_files["dualseg.json"]`` are both read by :func:`read_export_info` (a TorchScript file
is a zip archive, so no torch is needed to read it). :func:`_open_runner` gives a callable
``float32 [B,3,H,W] -> float32 output`` through onnxruntime (no torch) or TorchScript.
"""

from __future__ import annotations

import importlib
import json
import numbers
import os
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dualseg.errors import CheckpointError, ConfigError, DualsegError
from dualseg.imaging import as_rgb
from dualseg.serialization import read_torchscript_meta

EXPORT_FORMAT = "dualseg-export/1"
REFINER_FORMAT = "dualseg-refiner-export/1"
META_PREFIX = "dualseg."


def import_extra(module: str) -> Any:
    """Import an optional package of the ``export`` extra (``onnx``, ``onnxruntime``,
    ``onnxscript``); missing, it is one :class:`DualsegError` line naming the extra."""
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
    """The dataset description of an exported model (the fields of ``DatasetMeta`` that
    inference uses; a separate class so that this module does not import torch)."""

    name: str
    class_names: tuple[str, ...]
    palette: tuple[tuple[int, int, int], ...]
    ignore_index: int = 255

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


def refiner_sidecar_path(model_path: str | os.PathLike[str]) -> Path:
    """The JSON beside an exported embedding model: ``refiner.onnx`` -> ``refiner.json``."""
    return Path(model_path).with_suffix(".json")


def _is_torchscript(path: Path) -> bool:
    """A zip archive: TorchScript (ONNX files are protobuf); never handed to onnxruntime."""
    return zipfile.is_zipfile(path)


def _starts_as_zip(path: Path) -> bool:
    """The zip local-file signature: a TorchScript or torch.save file, even one cut short (its
    central directory, at the end, is what ``zipfile.is_zipfile`` looks for)."""
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


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
    if not _is_torchscript(path) and _starts_as_zip(path):  # else read as ONNX, and blamed so
        raise CheckpointError(
            f"{path} is a zip archive (TorchScript or PyTorch) that cannot be read: cut short? "
            "Copy or export it again"
        )
    if _is_torchscript(path):
        info = read_torchscript_meta(path)
        if info is None:  # a zip, but no TorchScript archive: a torch.save file, say
            from dualseg.serialization import torch_file_format

            kind = torch_file_format(path)  # "": unreadable (cut short); None: not dualseg's
            if kind == "":
                what = "a zip archive that cannot be read (cut short?); export it again"
            elif kind is not None and kind.startswith("dualseg-refiner"):
                what = "a method-B refiner: pass it as --refiner"
            else:
                what = (
                    "a PyTorch file (a checkpoint? pass it as -c), or export one with "
                    "'dualseg export'"
                )

            raise CheckpointError(f"{path} is no exported model: {what}")
        if not info:
            raise CheckpointError(
                f"{path} is a TorchScript file without dualseg metadata; export it with "
                "'dualseg export'"
            )
    else:
        ort = import_extra("onnxruntime")

        try:
            meta = ort.InferenceSession(
                str(path), providers=["CPUExecutionProvider"]
            ).get_modelmeta()
        except Exception as err:  # onnxruntime raises its own exception types
            raise CheckpointError(
                f"{path} is not a readable ONNX model ({str(err).splitlines()[0]}); "
                "re-export it with 'dualseg export'"
            ) from err
        info = {}
        for key, text in meta.custom_metadata_map.items():
            if not key.startswith(META_PREFIX):
                continue
            try:
                info[key[len(META_PREFIX) :]] = json.loads(text)
            except ValueError:
                raise CheckpointError(
                    f"{path}: its metadata {key} is not valid JSON ({text[:40]!r}); re-export "
                    "it with 'dualseg export'"
                ) from None
    if info.get("format") != EXPORT_FORMAT:
        raise CheckpointError(
            f"{path} carries no dualseg export metadata (format {info.get('format')!r}, "
            f"expected {EXPORT_FORMAT!r}); export it with 'dualseg export'"
        )
    return info


def is_exported_torchscript(path: Path) -> bool:
    """True for a TorchScript file written by ``dualseg export`` (it carries dualseg metadata)."""
    return path.is_file() and bool(read_torchscript_meta(path))


# ----------------------------------------------------------------------------- runners
class _OnnxRunner:
    """``image batch float32 [B,3,H,W] -> output float32`` through onnxruntime."""

    def __init__(self, path: Path, providers: Sequence[str] | None, threads: int | None) -> None:
        ort = import_extra("onnxruntime")

        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = int(threads)
        self.session = ort.InferenceSession(
            str(path), sess_options=opts, providers=list(providers or ["CPUExecutionProvider"])
        )
        first = self.session.get_inputs()[0]
        self.input_name = first.name
        # A static export (no --dynamic) takes one image size: other sizes are resized to it
        # (callers that sample the output at their own pixel grid, as the refiner does, work).
        hw = first.shape[2:]
        self.static_hw = tuple(hw) if all(isinstance(d, int) for d in hw) else None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.static_hw is not None and tuple(x.shape[-2:]) != self.static_hw:
            x = _resize_chw_batch(x, self.static_hw)
        return self.session.run(None, {self.input_name: np.ascontiguousarray(x, np.float32)})[0]


def _resize_chw_batch(x: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """Bilinear resize of a float ``[B,C,H,W]`` batch to ``hw`` (OpenCV, no torch)."""
    import cv2

    h, w = hw
    return np.stack(
        [cv2.resize(img.transpose(1, 2, 0), (w, h), interpolation=cv2.INTER_LINEAR)
         .reshape(h, w, -1).transpose(2, 0, 1) for img in x.astype(np.float32)]
    )  # fmt: skip


class _TorchScriptRunner:
    """The same with a TorchScript file (imports torch)."""

    def __init__(self, path: Path, device: str = "cpu", threads: int | None = None) -> None:
        import warnings

        import torch

        from dualseg.serialization import read_torchscript_meta

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is deprecated.*")
            self.module = torch.jit.load(str(path), map_location=device).eval()
        self.device = device
        # a static export runs at its exported size, as the ONNX runner's does (a TorchScript
        # trace would run other sizes too, and answer otherwise than its ONNX twin)
        size = (read_torchscript_meta(path) or {}).get("input_size")
        self.static_hw = tuple(int(v) for v in size) if size else None
        # as onnxruntime's intra-op threads: torch's, for each run only (the count is global)
        self.threads = threads

    def __call__(self, x: np.ndarray) -> np.ndarray:
        import torch

        if self.static_hw is not None and tuple(x.shape[-2:]) != self.static_hw:
            x = _resize_chw_batch(x, self.static_hw)
        before = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            with torch.no_grad():
                x_t = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(self.device)
                out = self.module(x_t)
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)
        return out.float().cpu().numpy()


def _open_runner(path: Path, providers: Sequence[str] | None, threads: int | None) -> Any:
    from dualseg.engine.config import MAX_THREADS  # the one cap the CLI's --threads has too

    if threads is not None and (
        isinstance(threads, bool)
        or not isinstance(threads, numbers.Integral)
        or not 0 <= threads <= MAX_THREADS
    ):
        raise ConfigError(
            f"threads must be None or an int 0..{MAX_THREADS} (None or 0: the runtime's "
            f"default), got {threads!r}"
        )
    threads = int(threads) if threads else None  # numpy ints too; 0: default
    if _is_torchscript(path):
        return _TorchScriptRunner(path, threads=threads)
    return _OnnxRunner(path, providers, threads)


# ----------------------------------------------------------------------------- images
def _as_rgb(image: Any) -> np.ndarray:
    """uint8 ``HxWx3`` from a path, PIL image or numpy array (torch-free,
    :func:`dualseg.imaging.as_rgb`); a tensor goes through the engine's ``as_rgb_array``."""
    if hasattr(image, "detach"):
        from dualseg.engine.predict import as_rgb_array  # tensors: torch is loaded anyway

        return as_rgb_array(image)
    return as_rgb(image)
