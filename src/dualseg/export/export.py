"""ONNX and TorchScript export of method A's network and of method B's embedding model.

The TorchScript-based ONNX exporter (``legacy``) is the default: it maps ``nn.GRU`` to ONNX
``GRU``, whose lengths are dynamic; torch 2.14's ``dynamo`` exporter fails on the GRU with
dynamic sizes. Metadata travels in the file (``dualseg.export.runners``). Each export is
built and checked in memory, then written atomically.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.onnx import _constants

from dualseg._version import __version__
from dualseg.data.contract import LabelContract, digests_to_hex
from dualseg.data.presets import DatasetMeta
from dualseg.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from dualseg.engine.checkpoint import build_model_from_checkpoint, contract_of
from dualseg.engine.pretrained import load_state
from dualseg.errors import ConfigError, DualsegError
from dualseg.export.runners import (
    EXPORT_FORMAT,
    META_PREFIX,
    REFINER_FORMAT,
    Runner,
    import_extra,
    refiner_sidecar_path,
)
from dualseg.io import atomic_write_bytes, atomic_write_json
from dualseg.models.base import eval_mode, model_logits, require_rgb_input
from dualseg.refine import BoundaryRefiner
from dualseg.serialization import TORCHSCRIPT_META
from dualseg.viz import default_palette

FORMATS = ("onnx", "torchscript")
OUTPUTS = ("logits", "probs")
EXPORTERS = ("legacy", "dynamo")
MIN_OPSET = {"legacy": 17, "dynamo": 18}  # dynamo has no opset-17 converter for Pad
MAX_SIDE = 8192  # the largest example size side


class ExportWrapper(nn.Module):
    """``image [B,3,H,W]`` (normalized) -> ``[B,C,H,W]`` logits (or probabilities).

    ``pad_multiple``: pad H and W up to a multiple of this (the output stride) before the
    model, crop after. ``input_scale`` resizes the image first (method B's embedding reads a
    resized copy); ``output="features"`` keeps the model's own output resolution.
    """

    def __init__(
        self, model: nn.Module, *, pad_multiple: int = 1, output: str = "logits",
        input_scale: float = 1.0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.model, self.pad_multiple, self.output = model, max(1, int(pad_multiple)), output
        self.input_scale = float(input_scale)

    def forward(self, x: Tensor) -> Tensor:
        if self.input_scale != 1.0:
            x = F.interpolate(
                x, scale_factor=self.input_scale, mode="bilinear", align_corners=False
            )
        h, w = x.shape[-2], x.shape[-1]
        k = self.pad_multiple
        if k > 1:  # (k - h % k) % k: traced size arithmetic, exact for every exported size
            x = F.pad(x, (0, (k - w % k) % k, 0, (k - h % k) % k))
        y = model_logits(self.model(x))  # a torchvision model's {"out": ...} too
        if self.output != "features":
            if y.shape[-2:] != x.shape[-2:]:  # logits below the input size: up to it, as predict
                y = F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)
            y = y[..., :h, :w]
        return y.softmax(1) if self.output == "probs" else y


class _Features(nn.Module):
    """``net.features`` as a forward (what the refiner reads, before upsampling)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        return self.net.features(x)


def export_info(
    kind: str,
    class_names: Sequence[str],
    palette: Sequence[Sequence[int]] | None,
    output: str,
    input_size: Sequence[int] | None,
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    """The metadata written into an exported file (read back by ``read_export_info``);
    ``extra`` overrides the defaults (arch, normalization, the label contract ...)."""
    palette = [[int(v) for v in c] for c in palette or default_palette(len(class_names))]
    names = [str(c) for c in class_names]
    if "label_contract" not in extra:  # what the names and palette say
        meta = DatasetMeta("exported", tuple(names), tuple(map(tuple, palette)))
        extra = {**extra, "label_contract": LabelContract(meta).to_dict()}
    info = {
        "format": EXPORT_FORMAT, "version": __version__, "kind": kind, "arch": "",
        "model_kwargs": {}, "class_names": names, "palette": palette, "ignore_index": 255,
        "dataset": "", "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD),
        "output": output, "dynamic": input_size is None,
        "input_size": None if input_size is None else list(input_size),
        "input_name": "image", "output_name": output, **extra,
    }  # fmt: skip
    return json.loads(json.dumps(info, default=str))  # plain JSON values only


def _example(size: Sequence[int], seed: int = 0) -> Tensor:
    return torch.randn(1, 3, *size, generator=torch.Generator().manual_seed(seed))


def check_onnx_options(exporter: str, opset: int | None, dynamic: bool) -> int:
    """The opset to write; a value this torch's ``exporter`` cannot write is one line."""
    if exporter not in EXPORTERS:
        raise ConfigError(f"exporter must be one of {EXPORTERS}, got {exporter!r}")
    least = MIN_OPSET[exporter]
    most = {
        "legacy": _constants.ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET,
        "dynamo": _constants.ONNX_MAX_OPSET,
    }[exporter]
    opset = least if opset is None else opset
    if not least <= opset <= most:
        raise ConfigError(
            f"opset must be in {least}..{most} with the {exporter} exporter, got {opset}"
        )
    if exporter == "dynamo" and dynamic:
        raise ConfigError(
            "the dynamo exporter cannot export the GRU sweeps with dynamic "
            "sizes; use exporter='legacy' (the default) or a static export"
        )
    return opset


def check_options(
    format: str, output: str, dynamic: bool, size: Sequence[int], opset: int | None,
    exporter: str, tolerance: float | None,
) -> None:  # fmt: skip
    """One line for an option no export can run with (or a missing extra), before any load."""
    if format not in FORMATS:
        raise ConfigError(f"format must be one of {FORMATS}, got {format!r}")
    if output not in OUTPUTS:
        raise ConfigError(f"output must be one of {OUTPUTS}, got {output!r}")
    if tolerance is not None and not tolerance >= 0:
        raise ConfigError(f"--tolerance must be >= 0, got {tolerance}")
    if min(size) < 8 or max(size) > MAX_SIDE:  # past it, tracing one image outgrows memory
        raise ConfigError(
            f"--size must be between 8x8 and {MAX_SIDE}x{MAX_SIDE}, got {size[0]}x{size[1]}"
        )
    if format == "onnx":
        import_extra("onnx")
        if tolerance is not None:
            import_extra("onnxruntime")
        check_onnx_options(exporter, opset, dynamic)


def _onnx_bytes(
    wrapper: nn.Module, info: Mapping[str, Any], x: Tensor, opset: int | None, exporter: str
) -> bytes:
    """``wrapper`` as an ONNX model with ``info`` in its metadata_props."""
    dynamic = info["input_size"] is None
    opset = check_onnx_options(exporter, opset, dynamic)
    onnx = import_extra("onnx")
    names = {"input_names": ["image"], "output_names": [info["output"]]}
    if exporter == "legacy":
        buf, axes = io.BytesIO(), {0: "batch", 2: "height", 3: "width"}
        torch.onnx.export(
            wrapper, (x,), buf, opset_version=opset, dynamo=False, do_constant_folding=True,
            dynamic_axes={"image": axes, info["output"]: axes} if dynamic else None, **names,
        )  # fmt: skip
        model = onnx.load_from_string(buf.getvalue())
    else:
        import_extra("onnxscript")  # the dynamo exporter builds the model with it
        model = torch.onnx.export(
            wrapper, (x,), None, opset_version=opset, dynamo=True, verbose=False, **names
        ).model_proto
    del model.metadata_props[:]
    for key, value in info.items():
        model.metadata_props.add(key=f"{META_PREFIX}{key}", value=json.dumps(value))
    model.doc_string = f"dualseg {info['kind']} ({info['arch'] or 'model'}), {info['output']}"
    onnx.checker.check_model(model)
    return model.SerializeToString()


def verify_export(wrapper: nn.Module, data: bytes, size: Sequence[int]) -> float:
    """Largest absolute difference between an exported model (``data``: ONNX in
    onnxruntime, or TorchScript) and ``wrapper`` on one random input of ``size``."""
    x = _example(size, seed=1)
    with torch.no_grad():
        want = wrapper(x).numpy()
    return float(np.abs(Runner(data)(x.numpy()) - want).max())


def _write(
    wrapper: nn.Module, path: str | os.PathLike[str], info: Mapping[str, Any], *, format: str,
    example_size: Sequence[int], opset: int | None, exporter: str, tolerance: float | None,
) -> float | None:  # fmt: skip
    """Export, check against PyTorch when ``tolerance`` is given, then write atomically."""
    wrapper, x = wrapper.eval(), _example(example_size)
    with warnings.catch_warnings(), torch.no_grad():
        # understood and harmless here: tracing freezes the models' own padding test (the
        # wrapper pads first), torch.jit's deprecation notes, the GRU batch note
        for category in (torch.jit.TracerWarning, DeprecationWarning, FutureWarning):
            warnings.simplefilter("ignore", category)
        for text in ("batch_size other than 1", "were assigned during export"):
            warnings.filterwarnings("ignore", message=f".*{text}")
        if format == "onnx":
            data = _onnx_bytes(wrapper, info, x, opset, exporter)
        else:  # traced: its size arithmetic recorded, so it runs at any size
            buf = io.BytesIO()
            traced = torch.jit.trace(wrapper, x, check_trace=False)
            torch.jit.save(traced, buf, _extra_files={TORCHSCRIPT_META: json.dumps(info)})
            data = buf.getvalue()
        diff = None if tolerance is None else verify_export(wrapper, data, example_size)
    if diff is not None and not diff <= tolerance:  # NaN fails too
        raise DualsegError(
            f"the export differs from PyTorch by {diff:.2e}, above --tolerance {tolerance:g}, "
            f"so it was removed (any earlier file at {path} is kept); try another --opset or "
            "--exporter, or a larger --tolerance"
        )
    atomic_write_bytes(path, data)
    return diff


def _export_segmenter(
    model: nn.Module, path: str | os.PathLike[str], class_names: Sequence[str],
    palette: Sequence[Sequence[int]] | None, extra: Mapping[str, Any], *, format: str,
    output: str, dynamic: bool, example_size: Sequence[int], opset: int | None, exporter: str,
    tolerance: float | None,
) -> float | None:  # fmt: skip
    """Method A's network with its metadata, in eval mode (the caller's keeps its modes)."""
    require_rgb_input(model, "an export")
    classes = getattr(model, "num_classes", None)
    if isinstance(classes, int) and len(class_names) != classes:
        raise ConfigError(f"{len(class_names)} class names for a model with {classes} classes")
    size = None if dynamic else tuple(example_size)
    info = export_info("segmenter", class_names, palette, output, size, extra)
    stride = int(getattr(model, "output_stride", 1) or 1)
    with eval_mode(model):
        return _write(
            ExportWrapper(model, pad_multiple=stride, output=output), path, info, format=format,
            example_size=example_size, opset=opset, exporter=exporter, tolerance=tolerance,
        )  # fmt: skip


def export_model(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    class_names: Sequence[str],
    palette: Sequence[Sequence[int]] | None = None,
    format: str = "onnx",
    output: str = "logits",
    dynamic: bool = True,
    example_size: tuple[int, int] = (64, 64),
    opset: int | None = None,
    exporter: str = "legacy",
    tolerance: float | None = None,
) -> Path:
    """Export a segmentation network (``model(x) -> logits [B,C,H,W]``, ImageNet-normalized
    input) with its class names and palette.

    ``dynamic=False`` fixes batch 1 at ``example_size``; the runtime then resizes each image
    to it and the result back. ``tolerance``: check the export against PyTorch before writing
    it, and refuse it above this difference.
    """
    check_options(format, output, dynamic, example_size, opset, exporter, tolerance)
    _export_segmenter(
        model, path, class_names, palette, {}, format=format, output=output, dynamic=dynamic,
        example_size=example_size, opset=opset, exporter=exporter, tolerance=tolerance,
    )  # fmt: skip
    return Path(path)


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    format: str = "onnx",
    output: str = "logits",
    dynamic: bool = True,
    example_size: tuple[int, int] = (64, 64),
    opset: int | None = None,
    exporter: str = "legacy",
    tolerance: float | None = None,
) -> float | None:
    """Export a checkpoint's network (``.pt``, pretrained folder or ``hf://org/name``) with
    its class names, palette, arch, normalization, label contract and training images'
    digests; returns the difference from PyTorch when ``tolerance`` asks for the check."""
    check_options(format, output, dynamic, example_size, opset, exporter, tolerance)
    ckpt = load_state(checkpoint)
    model, meta = build_model_from_checkpoint(ckpt, device="cpu")
    norm = ckpt.get("normalization") or {}  # the model's own (a folder may store another)
    extra = {
        "arch": str(ckpt["arch"]), "model_kwargs": ckpt.get("model_kwargs") or {},
        "ignore_index": meta.ignore_index, "dataset": meta.name,
        "mean": norm.get("mean") or IMAGENET_MEAN, "std": norm.get("std") or IMAGENET_STD,
        "label_contract": contract_of(ckpt).to_dict(),
    }  # fmt: skip
    if ckpt.get("train_images") is not None:  # eval warns on them, as for the checkpoint
        extra["train_images"] = digests_to_hex(ckpt["train_images"])
    return _export_segmenter(
        model, path, meta.class_names, meta.palette, extra, format=format, output=output,
        dynamic=dynamic, example_size=example_size, opset=opset, exporter=exporter,
        tolerance=tolerance,
    )  # fmt: skip


def export_refiner(
    refiner: Any,
    path: str | os.PathLike[str],
    *,
    format: str = "onnx",
    dynamic: bool = True,
    example_size: tuple[int, int] = (64, 64),
    opset: int | None = None,
    exporter: str = "legacy",
    tolerance: float | None = None,
) -> float | None:
    """Export method B: the embedding model to ``path`` and ``<path stem>.json`` beside it
    (prototypes, present classes, class names, configuration, calibration).

    ``refiner``: a ``BoundaryRefiner`` or its file. The exported network is exactly
    ``embed_features``: the image resized by ``input_scale``, padded to the stride, mapped to
    ``[B,C,h,w]``. Load the pair with ``load_exported_refiner``. Returns the difference from
    PyTorch when ``tolerance`` asked for the check.
    """
    check_options(format, "logits", dynamic, example_size, opset, exporter, tolerance)
    if not isinstance(refiner, BoundaryRefiner):
        refiner = BoundaryRefiner.load(refiner)
    if refiner.taps is not None:
        raise ConfigError(
            f"this refiner reads its base model's {' and '.join(refiner.taps.names)} during the "
            "base's forward, which an exported refiner cannot run; use the refiner file with "
            "its base (refine apply, BoundaryRefiner.load)"
        )
    cfg, device = refiner.config, refiner.device
    extra = {
        "arch": f"embedding:{cfg.backbone}",
        "embed_dim": int(cfg.embed_dim),
        "ignore_index": refiner.ignore_index,
        "label_contract": refiner.label_contract,
    }
    size = None if dynamic else tuple(example_size)
    info = export_info("embedding", refiner.class_names, refiner.palette, "features", size, extra)
    try:  # on the CPU in eval mode; the caller's refiner keeps its device and modes
        refiner.to("cpu")
        with eval_mode(refiner.net):
            wrapper = ExportWrapper(
                _Features(refiner.net), pad_multiple=cfg.output_stride, output="features",
                input_scale=cfg.input_scale,
            )  # fmt: skip
            diff = _write(
                wrapper, path, info, format=format, example_size=example_size, opset=opset,
                exporter=exporter, tolerance=tolerance,
            )  # fmt: skip
    finally:
        refiner.to(device)
    prototypes = refiner.prototypes.detach().cpu().float().tolist()
    atomic_write_json(
        refiner_sidecar_path(path),
        {"format": REFINER_FORMAT, "embedding": Path(path).name, "embedding_format": format,
         **refiner.description(), "prototypes": prototypes,
         "present": refiner.present.detach().cpu().bool().tolist()},
    )  # fmt: skip
    return diff
