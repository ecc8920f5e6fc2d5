"""Inference on ordinary images: ``dualseg.load_model(path).predict(image)``.

A :class:`Segmenter` wraps a trained network with what is needed to use it on raw pictures:
the dataset description (class names, palette), input conversion (path, PIL image, numpy array
or tensor -> normalized tensor), and the spec's S4 tail — softmax, bilinear resize to the
original size, argmax. Images are run at their own resolution; a batch groups images of equal
size, so the result for an image never depends on the other images in its batch (no padding).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dualseg.errors import DataError

if TYPE_CHECKING:  # pragma: no cover
    from PIL.Image import Image as PILImage

    from dualseg.data import DatasetMeta

__all__ = ["ImageLike", "Segmenter", "as_rgb_array", "load_model", "resolve_device"]

# Anything predict() accepts: a file path, a PIL image, an HxWx3 array, or a tensor.
ImageLike = Union[str, os.PathLike, "PILImage", np.ndarray, Tensor]


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"`` / ``None`` -> CUDA when available, else CPU; anything else as given."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def as_rgb_array(image: ImageLike) -> np.ndarray:
    """Convert any accepted image form to a uint8 ``HxWx3`` RGB array.

    - path (str / PathLike): read with :func:`dualseg.data.read_image`;
    - PIL image: converted to RGB;
    - numpy: ``HxWx3`` (or ``HxW`` gray, opaque ``HxWx4`` RGBA) uint8, or float in [0, 1];
    - tensor: ``[3,H,W]`` / ``[1,3,H,W]`` float in [0, 1] (torchvision ``to_tensor``
      convention) or uint8 ``[3,H,W]`` / ``[H,W,3]``. Already-normalized tensors are rejected:
      call ``segmenter.model`` directly for those.
    """
    if isinstance(image, str | os.PathLike):
        from dualseg.data import read_image

        path = Path(image)
        if not path.is_file():
            raise DataError(f"image not found: {path} (check the path)")
        return read_image(path)
    if isinstance(image, Tensor):
        return _tensor_to_array(image)
    if isinstance(image, np.ndarray):
        return _numpy_to_rgb(image)
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency
        Image = None
    if Image is not None and isinstance(image, Image.Image):
        from dualseg.data.readers import image_to_rgb  # the image policy (EXIF, alpha, modes)

        return image_to_rgb(image, "the PIL image")
    raise DataError(
        f"cannot segment a {type(image).__name__}: pass a file path, a PIL image, an HxWx3 "
        "uint8 numpy array or a [3,H,W] tensor"
    )


def _tensor_to_array(t: Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dim() == 4 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 3:
        raise DataError(f"expected an image tensor [3,H,W], got shape {tuple(t.shape)}")
    if t.shape[0] in (1, 3):  # CHW (torchvision's convention) unless clearly HWC
        t = t.permute(1, 2, 0)
    elif t.shape[-1] not in (1, 3):
        raise DataError(f"expected an image tensor [3,H,W] or [H,W,3], got {tuple(t.shape)}")
    if t.is_floating_point():
        lo, hi = float(t.min()), float(t.max())
        if lo < -1e-3 or hi > 1 + 1e-3:
            raise DataError(
                f"float image tensor has values in [{lo:.2f}, {hi:.2f}]; pass RGB in [0, 1] "
                "(torchvision to_tensor) or uint8 — for normalized input call .model directly"
            )
        t = (t * 255).round()
    return _numpy_to_rgb(t.to(torch.uint8).numpy())


def _numpy_to_rgb(a: np.ndarray) -> np.ndarray:
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if a.ndim == 2:
        a = np.repeat(a[:, :, None], 3, axis=2)
    if a.ndim != 3 or a.shape[2] not in (3, 4):
        raise DataError(f"expected an HxWx3 RGB image array, got shape {a.shape}")
    if a.shape[2] == 4:  # the image policy: opaque alpha is dropped, transparency refused
        from dualseg.data.readers import drop_opaque_alpha

        a = drop_opaque_alpha(a, "the image array")
    if np.issubdtype(a.dtype, np.floating):
        if a.size and (a.min() < -1e-3 or a.max() > 1 + 1e-3):
            raise DataError("float image arrays must hold RGB values in [0, 1]; or pass uint8")
        a = np.round(a * 255)
    elif a.dtype != np.uint8:
        raise DataError(f"image arrays must be uint8 (or float in [0, 1]), got {a.dtype}")
    if a.shape[0] == 0 or a.shape[1] == 0:
        raise DataError(f"empty image of shape {a.shape}")
    return np.ascontiguousarray(a, dtype=np.uint8)


class Segmenter:
    """A trained network ready for raw images (see module docstring).

    ``model`` returns logits ``[B,C,H,W]`` for ImageNet-normalized input; ``meta`` is the
    :class:`~dualseg.data.DatasetMeta` (class names, palette, ignore index) it was trained on.
    """

    def __init__(
        self,
        model: nn.Module,
        meta: DatasetMeta,
        *,
        device: str | torch.device | None = "cpu",
        amp: bool = False,
    ) -> None:
        from dualseg.data.transforms import IMAGENET_MEAN, IMAGENET_STD

        self.device = resolve_device(device)
        self.model = model.to(self.device).eval()
        self.meta = meta
        self.amp = amp
        # build_model(arch, **model_kwargs) rebuilds ``model`` (set by load_model; for
        # save_pretrained). None: a model built elsewhere.
        self.arch: str | None = None
        self.model_kwargs: dict[str, Any] | None = None
        self._mean = torch.tensor(IMAGENET_MEAN, device=self.device).view(1, 3, 1, 1)
        self._std = torch.tensor(IMAGENET_STD, device=self.device).view(1, 3, 1, 1)

    @property
    def num_classes(self) -> int:
        return self.meta.num_classes

    @property
    def class_names(self) -> tuple[str, ...]:
        return self.meta.class_names

    def __repr__(self) -> str:
        return (
            f"Segmenter({type(self.model).__name__}, {self.num_classes} classes "
            f"[{self.meta.name}], device={self.device})"
        )

    # ------------------------------------------------------------------ public API
    def predict(self, image: ImageLike) -> np.ndarray:
        """Label map ``HxW`` (uint8 for up to 255 classes, else int64) at the original size."""
        return self.predict_batch([image])[0]

    def predict_proba(self, image: ImageLike) -> np.ndarray:
        """Class probabilities ``float32 [C,H,W]`` at the original size."""
        return self.predict_batch([image], return_probs=True)[0][1]

    __call__ = predict

    def predict_batch(
        self,
        images: Sequence[ImageLike],
        *,
        batch_size: int = 8,
        return_probs: bool = False,
    ) -> list[Any]:
        """Segment several images, ``batch_size`` at a time (images of equal size share a batch).

        Returns, in input order, label maps — or ``(label, probs)`` pairs with
        ``return_probs=True``.
        """
        arrays = [as_rgb_array(im) for im in images]
        out: list[Any] = [None] * len(arrays)
        for indices, probs in self._run(arrays, batch_size):
            labels = probs.argmax(1)
            labels = labels.to(torch.uint8 if self.num_classes <= 255 else torch.int64).cpu()
            probs_np = probs.cpu().numpy() if return_probs else None
            for k, i in enumerate(indices):
                out[i] = (labels[k].numpy(), probs_np[k]) if return_probs else labels[k].numpy()
        return out

    def save_pretrained(self, folder: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write ``folder/config.json`` + ``folder/model.safetensors``; ``load_model(folder)``
        reads it back (see :mod:`dualseg.engine.pretrained`)."""
        from dualseg.data.transforms import IMAGENET_MEAN, IMAGENET_STD
        from dualseg.engine.pretrained import save_pretrained
        from dualseg.errors import ConfigError

        if self.arch is None or self.model_kwargs is None:
            raise ConfigError(
                "this Segmenter's model was not built by dualseg.load_model, so its arch and "
                "options are unknown; call dualseg.engine.pretrained.save_pretrained(model, "
                "folder, arch=..., model_kwargs=..., meta=...)"
            )
        return save_pretrained(
            self.model,
            folder,
            arch=self.arch,
            model_kwargs=self.model_kwargs,
            meta=self.meta,
            mean=IMAGENET_MEAN,
            std=IMAGENET_STD,
            overwrite=overwrite,
        )

    # ------------------------------------------------------------------ internals
    def to_tensor(self, array: np.ndarray) -> Tensor:
        """uint8 ``HxWx3`` -> normalized float ``[1,3,H,W]`` on the segmenter's device."""
        if not array.flags.writeable:  # e.g. np.asarray(PIL image); torch wants writable
            array = array.copy()
        x = torch.from_numpy(array).to(self.device).permute(2, 0, 1)[None].float() / 255.0
        return (x - self._mean) / self._std

    @torch.no_grad()
    def _run(self, arrays: list[np.ndarray], batch_size: int) -> Iterator[tuple[list[int], Tensor]]:
        """Yield ``(input indices, probs [b,C,H,W])`` for groups of equal-size images."""
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, a in enumerate(arrays):
            by_size.setdefault(a.shape[:2], []).append(i)
        autocast = (
            torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
            if self.amp
            else contextlib.nullcontext()
        )
        for (h, w), indices in by_size.items():
            for start in range(0, len(indices), max(1, batch_size)):
                chunk = indices[start : start + batch_size]
                x = torch.cat([self.to_tensor(arrays[i]) for i in chunk])
                with autocast:
                    logits = self.model(x)
                logits = logits.float()
                if logits.shape[-2:] != (h, w):  # spec S4: bilinear up to the original size
                    logits = F.interpolate(
                        logits, size=(h, w), mode="bilinear", align_corners=False
                    )
                yield chunk, logits.softmax(1)


def load_model(
    path: str | os.PathLike[str], *, device: str | torch.device | None = "cpu", amp: bool = False
) -> Segmenter:
    """Load a trained model as a :class:`Segmenter` (``dualseg.load_model``).

    ``path``: a dualseg checkpoint (``last.pt`` / ``best.pt``), a pretrained folder
    (``config.json`` + ``model.safetensors``, written by ``Segmenter.save_pretrained`` or
    ``dualseg export --format pretrained``), or ``hf://org/name[@revision]`` (the same folder on
    the Hugging Face Hub; needs ``pip install 'dualseg[hub]'``).

    >>> seg = dualseg.load_model("runs/demo/last.pt")      # doctest: +SKIP
    >>> labels = seg.predict("street.png")                  # HxW uint8 at the image's size
    """
    from dualseg.data.transforms import IMAGENET_MEAN, IMAGENET_STD
    from dualseg.engine.checkpoint import build_model_from_checkpoint
    from dualseg.engine.pretrained import check_normalization, load_state

    dev = resolve_device(device)
    ckpt = load_state(path)
    check_normalization(ckpt, IMAGENET_MEAN, IMAGENET_STD)
    model, meta = build_model_from_checkpoint(ckpt, device=dev)
    seg = Segmenter(model, meta, device=dev, amp=amp)
    seg.arch, seg.model_kwargs = str(ckpt["arch"]), dict(ckpt["model_kwargs"])
    return seg
