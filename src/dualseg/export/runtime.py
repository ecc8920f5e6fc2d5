"""Run exported models: onnxruntime (no torch) or TorchScript, with the metadata they carry.

- :class:`OnnxSegmenter` — method A's exported network with the engine ``Segmenter``'s
  interface (``predict``, ``predict_proba``, ``predict_batch``, ``meta``, ``num_classes``,
  ``class_names``), so ``dualseg predict --onnx`` and ``dualseg serve --onnx`` can use it.
  Importing this module and running an ONNX model on numpy arrays, PIL images or image files
  never imports torch.
- :func:`load_exported_refiner` — method B from an exported embedding model plus its JSON
  sidecar (prototypes, configuration), with ``BoundaryRefiner.refine``'s contract. The
  embedding runs in onnxruntime; the configuration (``RefinerConfig``) and the near-boundary
  mask (:func:`dualseg.refine.boundary.near_boundary_mask`, numpy path) come from
  ``dualseg.refine``, which imports torch. :func:`load_refiner` opens either kind of refiner.

Export metadata: ONNX ``metadata_props`` ``dualseg.<key>`` (JSON values), TorchScript
``_extra_files["dualseg.json"]``; both read by :func:`read_export_info` (torch-free: a
TorchScript file is a zip archive).
"""

from __future__ import annotations

import importlib
import json
import os
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dualseg.errors import CheckpointError, ConfigError, DataError, DualsegError

__all__ = [
    "ExportMeta",
    "ExportedRefiner",
    "ExportedSegmenter",
    "OnnxSegmenter",
    "import_extra",
    "load_exported_refiner",
    "load_refiner",
    "read_export_info",
    "refiner_sidecar_path",
]

EXPORT_FORMAT = "dualseg-export/1"
REFINER_FORMAT = "dualseg-refiner-export/1"
META_PREFIX = "dualseg."
TORCHSCRIPT_META = "dualseg.json"


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


def refiner_sidecar_path(model_path: str | os.PathLike[str]) -> Path:
    """The JSON beside an exported embedding model: ``refiner.onnx`` -> ``refiner.json``."""
    return Path(model_path).with_suffix(".json")


def _is_torchscript(path: Path) -> bool:
    return zipfile.is_zipfile(path)


def read_export_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The metadata dict of an exported ONNX or TorchScript file (see ``export_info``)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"exported model not found: {path} (check the path)")
    if _is_torchscript(path):
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.endswith(f"extra/{TORCHSCRIPT_META}")]
            if not names:
                raise CheckpointError(
                    f"{path} is a TorchScript file without dualseg metadata; export it with "
                    "'dualseg export'"
                )
            info = json.loads(z.read(names[0]))
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
        props = meta.custom_metadata_map
        info = {
            k[len(META_PREFIX) :]: json.loads(v)
            for k, v in props.items()
            if k.startswith(META_PREFIX)
        }
    if info.get("format") != EXPORT_FORMAT:
        raise CheckpointError(
            f"{path} carries no dualseg export metadata (format {info.get('format')!r}, "
            f"expected {EXPORT_FORMAT!r}); export it with 'dualseg export'"
        )
    return info


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

    def __init__(self, path: Path, device: str = "cpu") -> None:
        import warnings

        import torch

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is deprecated.*")
            self.module = torch.jit.load(str(path), map_location=device).eval()
        self.device = device

    def __call__(self, x: np.ndarray) -> np.ndarray:
        import torch

        with torch.no_grad():
            out = self.module(torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(self.device))
        return out.float().cpu().numpy()


def _open_runner(path: Path, providers: Sequence[str] | None, threads: int | None) -> Any:
    if _is_torchscript(path):
        return _TorchScriptRunner(path)
    return _OnnxRunner(path, providers, threads)


# ----------------------------------------------------------------------------- images
def _as_rgb(image: Any) -> np.ndarray:
    """uint8 ``HxWx3`` from a path, PIL image or numpy array (torch-free); a tensor goes
    through the engine's ``as_rgb_array``."""
    if isinstance(image, np.ndarray):
        a = image
        if a.ndim == 2:
            a = np.repeat(a[:, :, None], 3, axis=2)
        if a.ndim != 3 or a.shape[2] not in (3, 4) or 0 in a.shape:
            raise DataError(f"expected an HxWx3 RGB image array, got shape {image.shape}")
        a = a[:, :, :3]
        if np.issubdtype(a.dtype, np.floating):
            a = np.round(np.clip(a, 0.0, 1.0) * 255)
        elif a.dtype != np.uint8:
            raise DataError(f"image arrays must be uint8 (or float in [0, 1]), got {a.dtype}")
        return np.ascontiguousarray(a, dtype=np.uint8)
    if isinstance(image, str | os.PathLike):
        from PIL import Image

        path = Path(image)
        try:
            with Image.open(path) as im:
                return np.array(im.convert("RGB"))
        except (OSError, ValueError, SyntaxError) as err:
            raise DataError(f"{path}: unreadable image ({err}); check the file") from err
    if hasattr(image, "convert") and hasattr(image, "size"):  # PIL image
        return np.array(image.convert("RGB"))
    from dualseg.engine.predict import as_rgb_array  # tensors: torch is loaded anyway

    return as_rgb_array(image)


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _resize(array: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Bilinear resize of ``HxWxK`` to ``size = (H, W)`` (half-pixel centres, like
    ``F.interpolate(align_corners=False)``)."""
    import cv2

    if array.shape[:2] == tuple(size):
        return array
    out = cv2.resize(array, (size[1], size[0]), interpolation=cv2.INTER_LINEAR)
    return out[:, :, None] if out.ndim == 2 else out


# ----------------------------------------------------------------------------- segmenter
class ExportedSegmenter:
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
        if not self.accepts_torchscript and self.path.is_file() and _is_torchscript(self.path):
            raise CheckpointError(
                f"{path} is a TorchScript file; use ExportedSegmenter for it, or export ONNX "
                "with 'dualseg export --format onnx'"
            )
        self.info = read_export_info(self.path)
        if self.info.get("kind") != "segmenter":
            raise CheckpointError(
                f"{self.path} holds a {self.info.get('kind')!r} model, not a segmentation "
                "network; load an exported refiner with load_exported_refiner"
            )
        self.meta = ExportMeta(
            name=str(self.info.get("dataset") or "exported"),
            class_names=tuple(self.info["class_names"]),
            palette=tuple(tuple(int(v) for v in c) for c in self.info["palette"]),  # type: ignore[misc]
            ignore_index=int(self.info.get("ignore_index", 255)),
        )
        self.mean = np.asarray(self.info["mean"], np.float32).reshape(1, 3, 1, 1)
        self.std = np.asarray(self.info["std"], np.float32).reshape(1, 3, 1, 1)
        size = self.info.get("input_size")
        self.input_size: tuple[int, int] | None = tuple(size) if size else None  # type: ignore[assignment]
        self.runner = _open_runner(self.path, providers, threads)

    @property
    def num_classes(self) -> int:
        return self.meta.num_classes

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.meta.class_names

    def __repr__(self) -> str:
        kind = "dynamic" if self.input_size is None else f"static {self.input_size}"
        return (
            f"{type(self).__name__}({self.path.name}: {self.info.get('arch')}, "
            f"{self.num_classes} classes, {kind}, {self.info['output']})"
        )

    def to_input(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """uint8 ``HxWx3`` arrays of one size -> normalized float32 ``[B,3,H,W]``."""
        x = np.stack(arrays).astype(np.float32).transpose(0, 3, 1, 2) / 255.0
        return (x - self.mean) / self.std

    def predict(self, image: Any) -> np.ndarray:
        """Label map ``HxW`` uint8 at the image's size."""
        return self.predict_batch([image])[0]

    def predict_proba(self, image: Any) -> np.ndarray:
        """Class probabilities float32 ``[C,H,W]`` at the image's size."""
        return self.predict_batch([image], return_probs=True)[0][1]

    __call__ = predict

    def predict_batch(
        self, images: Sequence[Any], *, batch_size: int = 8, return_probs: bool = False
    ) -> list[Any]:
        """Labels (or ``(labels, probs)`` pairs) for several images, in input order."""
        arrays = [_as_rgb(im) for im in images]
        out: list[Any] = [None] * len(arrays)
        for indices, probs in self._run(arrays, max(1, batch_size)):
            labels = probs.argmax(1).astype(np.uint8 if self.num_classes <= 255 else np.int64)
            for k, i in enumerate(indices):
                out[i] = (labels[k], probs[k]) if return_probs else labels[k]
        return out

    def _run(self, arrays: list[np.ndarray], batch_size: int):
        if self.input_size is not None:  # static export: batch 1 at the exported size
            for i, a in enumerate(arrays):
                scores = self.runner(self.to_input([_resize(a, self.input_size)]))[0]
                scores = _resize(scores.transpose(1, 2, 0), a.shape[:2]).transpose(2, 0, 1)
                yield [i], self._probs(scores[None])
            return
        by_size: dict[tuple[int, ...], list[int]] = {}
        for i, a in enumerate(arrays):
            by_size.setdefault(a.shape[:2], []).append(i)
        for indices in by_size.values():
            for start in range(0, len(indices), batch_size):
                chunk = indices[start : start + batch_size]
                yield chunk, self._probs(self.runner(self.to_input([arrays[i] for i in chunk])))

    def _probs(self, scores: np.ndarray) -> np.ndarray:
        scores = scores.astype(np.float32, copy=False)
        return scores if self.info["output"] == "probs" else _softmax(scores, axis=1)


class OnnxSegmenter(ExportedSegmenter):
    """:class:`ExportedSegmenter` for an ONNX file, run by onnxruntime (no torch).

    >>> seg = OnnxSegmenter("model.onnx")            # doctest: +SKIP
    >>> labels = seg.predict("street.png")           # HxW uint8
    """

    accepts_torchscript = False


# ----------------------------------------------------------------------------- refiner
def _sample_bilinear(features: np.ndarray, ys: np.ndarray, xs: np.ndarray, size: tuple[int, int]):
    """Features ``[C,h,w]`` read at full-resolution pixels ``(ys, xs)`` of an ``H x W`` map:
    ``[M,C]``, the values of bilinear upsampling (``align_corners=False``, border clamp) —
    what ``EmbeddingNet.sample`` computes."""
    _, h, w = features.shape
    H, W = size

    def axis(idx: np.ndarray, n: int, N: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src = np.clip((idx.astype(np.float32) + 0.5) * (n / N) - 0.5, 0, n - 1)
        lo = np.floor(src).astype(np.int64)
        return lo, np.minimum(lo + 1, n - 1), (src - lo).astype(np.float32)

    y0, y1, wy = axis(ys, h, H)
    x0, x1, wx = axis(xs, w, W)
    f = features
    top = f[:, y0, x0] * (1 - wx) + f[:, y0, x1] * wx
    bottom = f[:, y1, x0] * (1 - wx) + f[:, y1, x1] * wx
    return (top * (1 - wy) + bottom * wy).T  # [M,C]


class ExportedRefiner:
    """Method B from an exported embedding model + sidecar; ``BoundaryRefiner.refine``'s
    contract (P2-P5), run with numpy and onnxruntime (or TorchScript)."""

    def __init__(self, runner: Any, sidecar: Mapping[str, Any], *, source: str = "") -> None:
        self.runner = runner
        self.source = source
        from dualseg.refine.refiner import RefinerConfig  # the same options as BoundaryRefiner

        self.class_names = tuple(str(c) for c in sidecar["class_names"])
        # a RefinerConfig, so that overrides work as for BoundaryRefiner:
        # refiner.config = dataclasses.replace(refiner.config, top_n=3)
        self.config = RefinerConfig.from_dict(sidecar["config"])
        self.ignore_index = int(sidecar.get("ignore_index", 255))
        self.prototypes = np.asarray(sidecar["prototypes"], np.float32)
        self.present = np.asarray(sidecar["present"], bool)
        if self.prototypes.shape[0] != len(self.class_names) or self.present.shape != (
            len(self.class_names),
        ):
            raise CheckpointError(
                f"{source}: {self.prototypes.shape[0]} prototypes for {len(self.class_names)} "
                "classes; re-export the refiner"
            )

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def __repr__(self) -> str:
        return (
            f"ExportedRefiner({self.source}: {self.num_classes} classes, "
            f"top_n={self.config.top_n}, radius={self.config.radius})"
        )

    def check_classes(
        self, base_names: Sequence[str] | None, num_classes: int, *, what: str = "the base model"
    ) -> None:
        """Raise :class:`CheckpointError` when the base model's classes are not the refiner's."""
        if num_classes != self.num_classes or (
            base_names is not None and tuple(base_names) != self.class_names
        ):
            raise CheckpointError(
                f"{what} has classes {list(base_names or [])[:5] or num_classes} but the "
                f"refiner was fit for {self.num_classes} ({', '.join(self.class_names)}); use a "
                "refiner fit on the base model's dataset and class order"
            )

    def refine(self, images: Any, probs: Any, *, return_changed: bool = False) -> Any:
        """Refined labels, as ``BoundaryRefiner.refine``.

        Batch form: ``images`` float ``[B,3,H,W]`` normalized (numpy or tensor), ``probs``
        ``[B,C,H,W]`` -> int64 ``[B,H,W]`` (a tensor when ``probs`` is one). Single-image
        form: ``images`` uint8 ``HxWx3`` / path / PIL image, ``probs`` ``[C,H,W]`` -> numpy
        ``HxW`` int64. With ``return_changed``: ``(labels, changed bool mask)``.
        """
        p = _numpy(probs)
        x = _numpy(images) if _is_batch(images) else None
        if x is None:
            rgb = _as_rgb(images)
            mean = np.asarray([0.485, 0.456, 0.406], np.float32)
            std = np.asarray([0.229, 0.224, 0.225], np.float32)
            x = ((rgb.astype(np.float32) / 255.0 - mean) / std).transpose(2, 0, 1)[None]
            labels, changed = self._refine_batch(x, p[None] if p.ndim == 3 else p)
            labels, changed = labels[0], changed[0]
        else:
            labels, changed = self._refine_batch(x, p)
            if hasattr(probs, "detach"):  # tensors in, tensors out (on probs' device)
                import torch

                labels = torch.from_numpy(labels).to(probs.device)
                changed = torch.from_numpy(changed).to(probs.device)
        return (labels, changed) if return_changed else labels

    def _refine_batch(self, x: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        from dualseg.refine.boundary import near_boundary_mask  # numpy path (module needs torch)

        if probs.ndim != 4 or x.shape[0] != probs.shape[0] or x.shape[-2:] != probs.shape[-2:]:
            raise DataError(
                f"class probabilities of shape {probs.shape} do not match images of shape "
                f"{x.shape}; resize the base model's output to the image size before refining"
            )
        self.check_classes(None, probs.shape[1])
        pred = probs.argmax(1)  # P2
        n = min(self.config.top_n, probs.shape[1])
        top = np.argsort(-probs, axis=1, kind="stable")[:, :n]  # P3 [B,N,H,W]
        edge = near_boundary_mask(
            pred, radius=self.config.radius, ignore_index=None, method=self.config.edge_method
        )
        out = pred.copy()
        for b in np.flatnonzero(edge.reshape(edge.shape[0], -1).any(1)):
            feats = self.runner(x[b : b + 1])[0].astype(np.float32)  # [C,h,w]
            # nearest prototype = argmin of |p|^2 - 2 e.p, affine in e: sample that K-channel
            # map instead of the C-channel embedding (as BoundaryRefiner does)
            p = self.prototypes
            scores = np.einsum("chw,kc->khw", feats, -2 * p) + (p * p).sum(1)[:, None, None]
            ys, xs = np.nonzero(edge[b])
            s = _sample_bilinear(scores, ys, xs, edge.shape[-2:])  # [M,K]
            cand = top[b][:, ys, xs].T  # [M,N]
            out[b, ys, xs] = self._nearest(s, cand)  # P5
        return out.astype(np.int64), out != pred

    def _nearest(self, scores: np.ndarray, cand: np.ndarray) -> np.ndarray:
        """The candidate with the lowest score (prototype distance); ``scores`` [M,K]."""
        d2 = scores.copy()
        d2[:, ~self.present] = np.inf
        dc = np.take_along_axis(d2, cand, axis=1)  # [M,N]
        best = np.take_along_axis(cand, dc.argmin(1)[:, None], axis=1)[:, 0]
        return np.where(np.isfinite(dc.min(1)), best, cand[:, 0])


def _numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().float().cpu().numpy()
    return np.asarray(x)


def _is_batch(images: Any) -> bool:
    shape = getattr(images, "shape", None)
    return shape is not None and len(shape) == 4


def load_exported_refiner(
    path: str | os.PathLike[str],
    *,
    providers: Sequence[str] | None = None,
    threads: int | None = None,
) -> ExportedRefiner:
    """Load an exported refiner: ``path`` is its sidecar JSON or its embedding model (the
    sidecar is then ``<stem>.json`` beside it)."""
    path = Path(path)
    sidecar_path = path if path.suffix.lower() == ".json" else refiner_sidecar_path(path)
    if not sidecar_path.is_file():
        raise CheckpointError(
            f"refiner sidecar not found: {sidecar_path} (export writes it beside the model: "
            "dualseg export --refiner R --out refiner.onnx)"
        )
    try:
        sidecar = json.loads(sidecar_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{sidecar_path} is not readable JSON ({err}); re-export") from err
    if not isinstance(sidecar, dict) or sidecar.get("format") != REFINER_FORMAT:
        raise CheckpointError(
            f"{sidecar_path} is not an exported dualseg refiner (expected format "
            f"{REFINER_FORMAT!r}); re-export with 'dualseg export --refiner'"
        )
    model_path = sidecar_path.parent / str(sidecar["embedding"])
    info = read_export_info(model_path)
    if info.get("kind") != "embedding":
        raise ConfigError(f"{model_path} is not an exported embedding model")
    return ExportedRefiner(
        _open_runner(model_path, providers, threads), sidecar, source=str(sidecar_path)
    )


def _is_exported_torchscript(path: Path) -> bool:
    if not (path.is_file() and zipfile.is_zipfile(path)):
        return False
    with zipfile.ZipFile(path) as z:
        return any(n.endswith(f"extra/{TORCHSCRIPT_META}") for n in z.namelist())


def load_refiner(path: str | os.PathLike[str], *, device: Any = "cpu") -> Any:
    """Either refiner: a ``dualseg refine fit`` file (``BoundaryRefiner.load``) or an exported
    pair (its ``.json`` sidecar, ``.onnx`` model or exported TorchScript ``.pt``)."""
    path = Path(path)
    if path.suffix.lower() in (".json", ".onnx") or _is_exported_torchscript(path):
        return load_exported_refiner(path)
    from dualseg.refine import BoundaryRefiner

    return BoundaryRefiner.load(path, device=device)
