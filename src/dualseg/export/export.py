"""ONNX and TorchScript export of method A's network and of method B's embedding model.

What is exported is :class:`ExportWrapper` around the network: it zero-pads the image to a
multiple of the model's output stride, runs the model and crops the logits back (optionally
turning them into probabilities). The models pad for themselves, but with a Python ``if`` on
the input size, which tracing freezes at the example size; padding first with size arithmetic
that the tracer records keeps odd sizes exact in the exported graph.

Exporter choice (torch 2.14): the TorchScript-based exporter (``dynamo=False``) is used by
default. It maps ``nn.GRU`` to the ONNX ``GRU`` op whose sequence length and batch are dynamic,
so the ReNet sweeps (rows and columns folded into the batch) run at any height and width. The
``torch.export``-based exporter (``dynamo=True``, torch's default since 2.9) exports the same
network only with static shapes: with dynamic height/width its decomposition of
``aten.gru.input`` fails ("The size of tensor a must match the size of tensor b"). It remains
available as ``exporter="dynamo"`` for static exports, at opset 18 or later (it builds opset 18
and has no converter down to 17 for ``Pad``).

Metadata travels inside the file: ONNX ``metadata_props`` (each value JSON, keys
``dualseg.<name>``) and TorchScript ``_extra_files["dualseg.json"]``; see :func:`export_info`.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dualseg.errors import ConfigError
from dualseg.export.runners import (
    EXPORT_FORMAT,
    META_PREFIX,
    REFINER_FORMAT,
    import_extra,
    refiner_sidecar_path,
)
from dualseg.io import atomic_write_bytes, atomic_write_json
from dualseg.models.base import eval_mode, model_logits, require_rgb_input
from dualseg.serialization import TORCHSCRIPT_META
from dualseg.viz import default_palette

__all__ = [
    "FORMATS",
    "OUTPUTS",
    "ExportWrapper",
    "export_checkpoint",
    "export_info",
    "export_model",
    "export_onnx",
    "export_refiner",
    "export_torchscript",
    "verify_export",
]

FORMATS = ("onnx", "torchscript")
OUTPUTS = ("logits", "probs")
EXPORTERS = ("legacy", "dynamo")
DEFAULT_OPSET = 17  # the legacy exporter's default; dynamo needs 18 (no opset-17 Pad adapter)
DYNAMO_MIN_OPSET = 18
# Warnings the exporters always raise for these networks, understood and harmless here:
# tracing freezes the models' own padding test (ExportWrapper pads first, so it is always
# False), the GRU batch warning (h0 is built from the input's shape, checked by the parity
# tests), and the deprecation notes of the TorchScript-based exporter / torch.jit.
_KNOWN_WARNINGS = (
    "Converting a tensor to a Python boolean",
    "Exporting a model to ONNX with a batch_size other than 1",
    "You are using the legacy TorchScript-based ONNX export",
    "is deprecated",
    "Iterating over a tensor might cause the trace to be incorrect",
    "Converting a tensor to a Python integer",
    "The feature will be removed",
    "were assigned during export",
)


class ExportWrapper(nn.Module):
    """``image [B,3,H,W]`` (normalized) -> ``[B,C,H,W]`` logits (or probabilities).

    ``pad_multiple``: pad H and W up to a multiple of this (the model's output stride) before
    the model, crop after — see the module docstring. ``input_scale`` resizes the image first
    (method B's embedding model reads a resized copy); ``crop=False`` keeps the model's own
    output resolution (the embedding model's low-resolution features).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        pad_multiple: int = 1,
        output: str = "logits",
        crop: bool = True,
        input_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if output not in (*OUTPUTS, "features"):
            raise ConfigError(f"output must be one of {OUTPUTS}, got {output!r}")
        self.model = model
        self.pad_multiple = max(1, int(pad_multiple))
        self.output = output
        self.crop = crop
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
        if self.crop:
            if y.shape[-2:] != x.shape[-2:]:  # logits below the input size: up to it, as predict
                y = F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)
            y = y[..., :h, :w]
        return y.softmax(1) if self.output == "probs" else y


def segmenter_wrapper(model: nn.Module, output: str = "logits") -> ExportWrapper:
    """What a method-A export holds: padding to the model's output stride, logits or probs."""
    if output not in OUTPUTS:
        raise ConfigError(f"output must be one of {OUTPUTS}, got {output!r}")
    pad = int(getattr(model, "output_stride", 1) or 1)
    return ExportWrapper(model.eval(), pad_multiple=pad, output=output).eval()


def embedding_wrapper(refiner: Any) -> ExportWrapper:
    """What a method-B export holds: ``refiner.net.features`` of the image resized by the
    refiner's ``input_scale`` and padded to its output stride (``embed_features`` of
    ``dualseg.refine.embedding``)."""
    return ExportWrapper(
        _Features(refiner.net.eval()),
        pad_multiple=refiner.config.output_stride,
        output="features",
        crop=False,
        input_scale=refiner.config.input_scale,
    ).eval()


def export_info(
    *,
    kind: str,
    class_names: Sequence[str],
    palette: Sequence[Sequence[int]] | None = None,
    arch: str = "",
    model_kwargs: Mapping[str, Any] | None = None,
    output: str = "logits",
    dynamic: bool = True,
    input_size: tuple[int, int] | None = None,
    ignore_index: int = 255,
    dataset: str = "",
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The metadata dict written into an exported file (read back by ``read_export_info``).

    ``kind``: ``"segmenter"`` (method A network) or ``"embedding"`` (method B). ``input_size``:
    the fixed ``(H, W)`` of a static export (``None`` when ``dynamic``).
    """
    from dualseg._version import __version__
    from dualseg.data.transforms import IMAGENET_MEAN, IMAGENET_STD

    info = {
        "format": EXPORT_FORMAT,
        "version": __version__,
        "kind": kind,
        "arch": arch,
        "model_kwargs": dict(model_kwargs or {}),
        "class_names": [str(c) for c in class_names],
        "palette": [
            [int(v) for v in rgb] for rgb in (palette or default_palette(len(class_names)))
        ],
        "ignore_index": int(ignore_index),
        "dataset": dataset,
        "mean": list(mean or IMAGENET_MEAN),
        "std": list(std or IMAGENET_STD),
        "output": output,
        "dynamic": bool(dynamic),
        "input_size": list(input_size) if input_size is not None else None,
        "input_name": "image",
        "output_name": output,
    }
    info.update(extra or {})
    return json.loads(json.dumps(info, default=str))  # plain JSON values only


def _example(size: tuple[int, int], batch: int = 1) -> Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 3, size[0], size[1], generator=g)


def _ignore_known_warnings() -> None:
    """Call inside ``warnings.catch_warnings()``: hide :data:`_KNOWN_WARNINGS` only."""
    for text in _KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{text}.*")


def export_onnx(
    wrapper: nn.Module,
    path: str | os.PathLike[str],
    info: Mapping[str, Any],
    *,
    example_size: tuple[int, int] = (64, 64),
    dynamic: bool = True,
    opset: int | None = None,
    exporter: str = "legacy",
) -> Path:
    """Export ``wrapper`` (image -> map) to an ONNX file with ``info`` in its metadata_props."""
    onnx = import_extra("onnx")
    if exporter == "dynamo":
        import_extra("onnxscript")  # torch.onnx's dynamo exporter builds the model with it

    if exporter not in EXPORTERS:
        raise ConfigError(f"exporter must be one of {EXPORTERS}, got {exporter!r}")
    least = DYNAMO_MIN_OPSET if exporter == "dynamo" else DEFAULT_OPSET
    opset = least if opset is None else opset
    most = _max_opset(exporter)
    if not least <= opset <= most:
        raise ConfigError(
            f"opset must be in {least}..{most} with the {exporter} exporter (this torch), "
            f"got {opset}"
        )
    if exporter == "dynamo" and dynamic:
        raise ConfigError(
            "the dynamo exporter cannot export the ReNet GRU sweeps with dynamic sizes in this "
            "torch version; use exporter='legacy' (the default) or a static export"
        )
    in_name, out_name = info["input_name"], info["output_name"]
    wrapper = wrapper.eval()
    x = _example(example_size)
    axes = {0: "batch", 2: "height", 3: "width"}
    with warnings.catch_warnings(), torch.no_grad():
        _ignore_known_warnings()
        if exporter == "legacy":
            buf = _legacy_export(wrapper, x, in_name, out_name, axes if dynamic else None, opset)
            model = onnx.load_from_string(buf)
        else:
            program = torch.onnx.export(
                wrapper, (x,), None, opset_version=opset, dynamo=True,
                input_names=[in_name], output_names=[out_name], verbose=False,
            )  # fmt: skip
            model = program.model_proto
    del model.metadata_props[:]
    for key, value in info.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = f"{META_PREFIX}{key}", json.dumps(value)
    model.doc_string = f"dualseg {info['kind']} ({info.get('arch') or 'model'}), {info['output']}"
    onnx.checker.check_model(model)
    path = Path(path)
    atomic_write_bytes(path, model.SerializeToString())
    return path


def _legacy_export(
    wrapper: nn.Module,
    x: Tensor,
    in_name: str,
    out_name: str,
    axes: dict[int, str] | None,
    opset: int,
) -> bytes:
    import io

    buf = io.BytesIO()
    torch.onnx.export(
        wrapper,
        (x,),
        buf,
        opset_version=opset,
        dynamo=False,
        input_names=[in_name],
        output_names=[out_name],
        dynamic_axes={in_name: axes, out_name: axes} if axes else None,
        do_constant_folding=True,
    )
    return buf.getvalue()


def export_torchscript(
    wrapper: nn.Module,
    path: str | os.PathLike[str],
    info: Mapping[str, Any],
    *,
    example_size: tuple[int, int] = (64, 64),
) -> Path:
    """Trace ``wrapper`` to a TorchScript file with ``info`` in ``_extra_files``.

    Tracing records the size arithmetic of :class:`ExportWrapper` and of the ReNet reshapes, so
    the traced module runs at any batch, height and width (checked by the parity tests).
    """
    import io

    wrapper = wrapper.eval()
    with warnings.catch_warnings(), torch.no_grad():
        _ignore_known_warnings()
        traced = torch.jit.trace(wrapper, _example(example_size), check_trace=False)
        buf = io.BytesIO()
        torch.jit.save(traced, buf, _extra_files={TORCHSCRIPT_META: json.dumps(dict(info))})
    path = Path(path)
    atomic_write_bytes(path, buf.getvalue())
    return path


def _write(
    wrapper: nn.Module,
    path: str | os.PathLike[str],
    info: Mapping[str, Any],
    *,
    format: str,
    example_size: tuple[int, int],
    dynamic: bool,
    opset: int | None,
    exporter: str,
) -> Path:
    if format == "onnx":
        return export_onnx(
            wrapper, path, info, example_size=example_size, dynamic=dynamic, opset=opset,
            exporter=exporter,
        )  # fmt: skip
    if format == "torchscript":
        return export_torchscript(wrapper, path, info, example_size=example_size)
    raise ConfigError(f"format must be one of {FORMATS}, got {format!r}")


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
    arch: str = "",
    model_kwargs: Mapping[str, Any] | None = None,
    dataset: str = "",
    ignore_index: int = 255,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> Path:
    """Export a segmentation network (``model(x) -> logits [B,C,H,W]``) with its metadata.

    ``dynamic=False`` fixes batch 1 and ``example_size`` ``(H, W)``; the onnxruntime predictor
    then resizes each image to that size and the result back (bilinear). ``mean`` / ``std``:
    the input normalization the model was trained with (default ImageNet's), which the
    runtime applies.
    """
    require_rgb_input(model, "an export")
    classes = getattr(model, "num_classes", None)
    if isinstance(classes, int) and len(class_names) != classes:
        raise ConfigError(
            f"{len(class_names)} class names for a model with {classes} classes; give one "
            "name per class"
        )
    # the export runs in eval mode; the caller's model (each module) keeps its own
    with eval_mode(model):
        wrapper = segmenter_wrapper(model, output)
        info = export_info(
            kind="segmenter",
            class_names=class_names,
            palette=palette,
            arch=arch,
            model_kwargs=model_kwargs,
            output=output,
            dynamic=dynamic,
            input_size=None if dynamic else tuple(example_size),
            dataset=dataset,
            ignore_index=ignore_index,
            mean=mean,
            std=std,
        )
        return _write(
            wrapper, path, info, format=format, example_size=example_size, dynamic=dynamic,
            opset=opset, exporter=exporter,
        )  # fmt: skip


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
) -> Path:
    """Export a dualseg checkpoint's network (class names, palette, arch in the metadata);
    ``checkpoint``: a ``.pt`` checkpoint, a pretrained folder or ``hf://org/name``."""
    from dualseg.engine.checkpoint import build_model_from_checkpoint
    from dualseg.engine.pretrained import load_state

    ckpt = load_state(checkpoint)
    model, meta = build_model_from_checkpoint(ckpt, device="cpu")
    norm = ckpt.get("normalization") or {}
    return export_model(
        model,
        path,
        class_names=meta.class_names,
        palette=meta.palette,
        format=format,
        output=output,
        dynamic=dynamic,
        example_size=example_size,
        opset=opset,
        exporter=exporter,
        arch=str(ckpt["arch"]),
        model_kwargs=ckpt.get("model_kwargs") or {},
        dataset=meta.name,
        ignore_index=meta.ignore_index,
        mean=norm.get("mean"),  # the model's own (a pretrained folder may store another)
        std=norm.get("std"),
    )


def export_refiner(
    refiner: Any,
    path: str | os.PathLike[str],
    *,
    format: str = "onnx",
    dynamic: bool = True,
    example_size: tuple[int, int] = (64, 64),
    opset: int | None = None,
    exporter: str = "legacy",
) -> tuple[Path, Path]:
    """Export method B: the embedding model to ``path`` and a JSON sidecar beside it.

    ``refiner``: a ``BoundaryRefiner`` or the path of a refiner file. The exported network maps
    an image to the low-resolution embedding ``[B,C,h,w]`` (the image resized by the refiner's
    ``input_scale`` and padded to its stride first), exactly ``embed_features``; the sidecar
    (``<path stem>.json``) holds prototypes, the present-class mask, class names and the
    configuration. Load the pair with ``dualseg.export.runtime.load_exported_refiner``.
    Returns ``(model path, sidecar path)``.
    """
    if not hasattr(refiner, "net"):
        from dualseg.refine import BoundaryRefiner

        refiner = BoundaryRefiner.load(refiner)
    # the export runs on the CPU in eval mode; the caller's refiner keeps its device and modes
    device = refiner.device
    try:
        refiner.to("cpu")
        with eval_mode(refiner.net):
            return _export_refiner(
                refiner,
                Path(path),
                format=format,
                dynamic=dynamic,
                example_size=example_size,
                opset=opset,
                exporter=exporter,
            )
    finally:
        refiner.to(device)


def _export_refiner(
    refiner: Any,
    path: Path,
    *,
    format: str,
    dynamic: bool,
    example_size: tuple[int, int],
    opset: int | None,
    exporter: str,
) -> tuple[Path, Path]:
    cfg = refiner.config
    wrapper = embedding_wrapper(refiner)
    info = export_info(
        kind="embedding",
        class_names=refiner.class_names,
        arch=f"embedding:{cfg.backbone}",
        output="features",
        dynamic=dynamic,
        input_size=None if dynamic else tuple(example_size),
        ignore_index=refiner.ignore_index,
        extra={"embed_dim": int(cfg.embed_dim)},
    )
    _write(
        wrapper, path, info, format=format, example_size=example_size, dynamic=dynamic,
        opset=opset, exporter=exporter,
    )  # fmt: skip
    sidecar = refiner_sidecar_path(path)
    atomic_write_json(
        sidecar,
        {
            "format": REFINER_FORMAT,
            "embedding": path.name,
            "embedding_format": format,
            "class_names": list(refiner.class_names),
            "ignore_index": int(refiner.ignore_index),
            "config": cfg.to_dict(),
            "prototypes": refiner.prototypes.detach().cpu().float().tolist(),
            "present": refiner.present.detach().cpu().bool().tolist(),
            # what the fit's --calibrate-split found and for which base: the notes and warnings
            # a refiner gives travel with its export
            "calibration": refiner.calibration,
            "palette": None if refiner.palette is None else [list(c) for c in refiner.palette],
        },
    )
    return path, sidecar


class _Features(nn.Module):
    """``net.features`` as a module's forward (what the refiner reads, before upsampling)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        return self.net.features(x)


def _max_opset(exporter: str) -> int:
    """The newest ONNX opset this torch's ``exporter`` writes."""
    from torch.onnx import _constants

    name = "ONNX_MAX_OPSET" if exporter == "dynamo" else "ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET"
    return int(getattr(_constants, name, getattr(_constants, "ONNX_MAX_OPSET", 17)))


def verify_export(
    path: str | os.PathLike[str],
    *,
    checkpoint: str | os.PathLike[str] | None = None,
    refiner: Any = None,
    size: tuple[int, int] = (64, 64),
) -> float:
    """Largest absolute difference between the exported file and PyTorch on one random input.

    The PyTorch side is rebuilt from ``checkpoint`` (method A) or ``refiner`` (a
    ``BoundaryRefiner`` or its file, method B), with the output kind read from the export.
    """
    import numpy as np

    from dualseg.export.runners import _open_runner, read_export_info

    info = read_export_info(path)
    if checkpoint is not None:
        from dualseg.engine.checkpoint import build_model_from_checkpoint
        from dualseg.engine.pretrained import load_state

        model, _ = build_model_from_checkpoint(load_state(checkpoint), device="cpu")
        wrapper = segmenter_wrapper(model, info["output"])
    elif refiner is not None:
        if not hasattr(refiner, "net"):
            from dualseg.refine import BoundaryRefiner

            refiner = BoundaryRefiner.load(refiner)
        wrapper = embedding_wrapper(refiner.to("cpu"))
    else:
        raise ConfigError("verify_export needs the checkpoint or the refiner it was exported from")
    x = torch.randn(1, 3, size[0], size[1], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = wrapper(x).numpy()
    got = _open_runner(Path(path), None, None)(x.numpy())
    if got.shape != ref.shape:
        raise ConfigError(f"{path}: exported output {got.shape} differs from PyTorch {ref.shape}")
    return float(np.abs(got - ref).max())
