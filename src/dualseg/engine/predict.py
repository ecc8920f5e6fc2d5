"""Inference on ordinary images: ``dualseg.load_model(path).predict(image)``.

A :class:`Segmenter` wraps a trained network with what is needed to use it on raw pictures:
the dataset description (class names, palette), input conversion (path, PIL image, numpy array
or tensor -> normalized tensor), and the spec's S4 tail — softmax, bilinear resize to the
original size, argmax. Images are run at their own resolution; a batch groups images of equal
size, so the result for an image never depends on the other images in its batch (no padding).
Sliding-window inference and test-time augmentation are keyword options of every ``predict*``
method (:mod:`dualseg.engine.inference`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import torch
from torch import Tensor, nn

from dualseg.data.contract import LabelContract
from dualseg.engine.checkpoint import contract_of
from dualseg.engine.distributed import resolve_device
from dualseg.engine.inference import InferenceOptions, infer_logits
from dualseg.engine.pretrained import load_network, save_pretrained
from dualseg.errors import ConfigError, DataError
from dualseg.imaging import IMAGENET_MEAN, IMAGENET_STD, as_rgb, normalize, numpy_to_rgb, read_image
from dualseg.models.base import eval_mode, require_rgb_input
from dualseg.predictor import Predictor, require_image_list, size_batches

if TYPE_CHECKING:  # pragma: no cover
    from PIL.Image import Image as PILImage

    from dualseg.data import DatasetMeta

__all__ = ["ImageLike", "Segmenter", "as_rgb_array", "load_model", "resolve_device"]

_INFER = InferenceOptions()  # the inference defaults (written once, in engine/inference.py)

# Anything predict() accepts: a file path, a PIL image, an HxWx3 array, or a tensor.
ImageLike = Union[str, os.PathLike, "PILImage", np.ndarray, Tensor]


def as_rgb_array(image: ImageLike) -> np.ndarray:
    """Convert any accepted image form to a uint8 ``HxWx3`` RGB array.

    - path (str / PathLike): read with :func:`dualseg.data.read_image`;
    - PIL image: converted to RGB by the image policy (:func:`dualseg.imaging.image_to_rgb`:
      EXIF orientation applied, opaque alpha dropped, transparency refused);
    - numpy: ``HxWx3`` (or ``HxW`` gray, opaque ``HxWx4`` RGBA) uint8, or float in [0, 1];
    - tensor: ``[3,H,W]`` / ``[1,3,H,W]`` float in [0, 1] (torchvision ``to_tensor``
      convention) or uint8 ``[3,H,W]`` / ``[H,W,3]`` (a shape that reads both ways, such as
      ``[3,40,3]``, is refused). Already-normalized tensors are rejected: call
      ``segmenter.model`` directly for those.
    """
    if isinstance(image, Tensor):
        return _tensor_to_array(image)
    return as_rgb(image)  # path, PIL image or array: the image policy, or a clear error


def _tensor_to_array(t: Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dim() == 4 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 3:
        raise DataError(f"expected an image tensor [3,H,W], got shape {tuple(t.shape)}")
    if t.shape[0] in (1, 3) and t.shape[-1] in (1, 3):  # e.g. [3, 640, 3]: 640x3 or 3x640?
        raise DataError(
            f"image tensor of shape {tuple(t.shape)} reads both as [C,H,W] and as [H,W,C]; pass "
            "it as a numpy HxWx3 array (t.permute(1, 2, 0).numpy() if it is [3,H,W])"
        )
    if t.shape[0] in (1, 3):  # CHW (torchvision's convention)
        t = t.permute(1, 2, 0)
    elif t.shape[-1] not in (1, 3):
        raise DataError(f"expected an image tensor [3,H,W] or [H,W,3], got {tuple(t.shape)}")
    if t.is_floating_point():
        if t.numel() and not bool(torch.isfinite(t).all()):
            raise DataError("image tensor holds NaN or inf values; pass RGB in [0, 1] or uint8")
        lo, hi = float(t.min()), float(t.max())
        if lo < -1e-3 or hi > 1 + 1e-3:
            raise DataError(
                f"float image tensor has values in [{lo:.2f}, {hi:.2f}]; pass RGB in [0, 1] "
                "(torchvision to_tensor) or uint8; normalized input goes in a [B,3,H,W] batch "
                "(segmenter.model(x), refiner.refine(x, probs))"
            )
        t = (t * 255).round()
    elif t.dtype != torch.uint8:  # a cast would wrap other integers modulo 256
        raise DataError(
            f"image tensors must be uint8 (or float in [0, 1]), got {t.dtype}; convert with "
            "t.float() / 255 if it holds 0..255"
        )
    return numpy_to_rgb(t.to(torch.uint8).numpy())


class Segmenter(Predictor):
    """A trained network ready for raw images (see module docstring).

    ``model`` returns logits ``[B,C,H,W]`` for ImageNet-normalized input; ``meta`` is the
    :class:`~dualseg.data.DatasetMeta` (class names, palette, ignore index) it was trained on.
    ``model`` is moved to ``device`` (in place, as ``nn.Module.to`` moves it); every prediction
    runs it in eval mode and gives it back in the mode it was in (a model being fine-tuned
    stays in train mode, and predicting never updates its BatchNorm statistics).
    """

    def __init__(
        self,
        model: nn.Module,
        meta: DatasetMeta,
        *,
        device: str | torch.device | None = "cpu",
        amp: bool = False,
    ) -> None:
        require_rgb_input(model, "a Segmenter")
        declared = getattr(model, "num_classes", None)
        if isinstance(declared, int) and declared != meta.num_classes:
            raise ConfigError(
                f"the model predicts {declared} classes and the meta names {meta.num_classes} "
                f"({meta.name}): pass the meta of the dataset the model was trained on"
            )
        self.device = resolve_device(device)
        self.model = model.to(self.device)
        self.meta = meta
        self.amp = amp
        # build_model(arch, **model_kwargs) rebuilds ``model`` (set by load_model; for
        # save_pretrained). None: a model built elsewhere.
        self.arch: str | None = None
        self.model_kwargs: dict[str, Any] | None = None
        # how the training labels were read (data.label_map ...), for save_pretrained
        self.training_labels: dict[str, Any] = {}
        # how the training data was read (labels, bit depth): image files are read so too
        self.contract = LabelContract(meta)
        self.train_images: Any = None  # the training images' content digests, kept on save

    def __repr__(self) -> str:
        return (
            f"Segmenter({type(self.model).__name__}, {self.num_classes} classes "
            f"[{self.meta.name}], device={self.device})"
        )

    @property
    def bit_depth(self) -> int | None:
        """How 16-bit image files are read: as the training images were (None: detected)."""
        return self.contract.bit_depth

    # ------------------------------------------------------------------ public API
    # num_classes, class_names, __call__: from Predictor; predict / predict_proba take the
    # inference keywords here
    def predict(
        self,
        image: ImageLike,
        *,
        mode: str = _INFER.mode,
        window: Sequence[int] = _INFER.window,
        stride: Sequence[int] | None = _INFER.stride,
        tta_scales: Sequence[float] = _INFER.tta_scales,
        tta_flip: bool = _INFER.tta_flip,
        tile_batch: int = _INFER.tile_batch,
    ) -> np.ndarray:
        """Label map ``HxW`` (uint8 for up to 255 classes, else int64) at the original size.

        ``mode="slide"`` with ``window``/``stride`` segments tile by tile (logits averaged in
        the overlaps); ``tta_scales``/``tta_flip`` average the softmax probabilities of the
        resized / mirrored image (see :mod:`dualseg.engine.inference`).
        """
        return self.predict_batch(
            [image],
            mode=mode,
            window=window,
            stride=stride,
            tta_scales=tta_scales,
            tta_flip=tta_flip,
            tile_batch=tile_batch,
        )[0]

    def predict_proba(
        self,
        image: ImageLike,
        *,
        mode: str = _INFER.mode,
        window: Sequence[int] = _INFER.window,
        stride: Sequence[int] | None = _INFER.stride,
        tta_scales: Sequence[float] = _INFER.tta_scales,
        tta_flip: bool = _INFER.tta_flip,
        tile_batch: int = _INFER.tile_batch,
    ) -> np.ndarray:
        """Class probabilities ``float32 [C,H,W]`` at the original size (with TTA: the mean
        of the variants' probabilities). Options as :meth:`predict`."""
        return self.predict_batch(
            [image],
            return_probs=True,
            mode=mode,
            window=window,
            stride=stride,
            tta_scales=tta_scales,
            tta_flip=tta_flip,
            tile_batch=tile_batch,
        )[0][1]

    def predict_batch(
        self,
        images: Sequence[ImageLike],
        *,
        batch_size: int = 8,
        return_probs: bool = False,
        mode: str = _INFER.mode,
        window: Sequence[int] = _INFER.window,
        stride: Sequence[int] | None = _INFER.stride,
        tta_scales: Sequence[float] = _INFER.tta_scales,
        tta_flip: bool = _INFER.tta_flip,
        tile_batch: int = _INFER.tile_batch,
    ) -> list[Any]:
        """Segment several images, ``batch_size`` at a time (images of equal size share a batch).

        Returns, in input order, label maps — or ``(label, probs)`` pairs with
        ``return_probs=True``. Inference options as :meth:`predict`.
        """
        require_image_list(images)
        depth = self.bit_depth
        arrays = [read_image(im, bit_depth=depth) if isinstance(im, str | os.PathLike)
                  else as_rgb_array(im) for im in images]  # fmt: skip
        opts = dict(mode=mode, window=window, stride=stride, tta_scales=tta_scales,
                    tta_flip=tta_flip, tile_batch=tile_batch, amp=self.amp)  # fmt: skip
        out: list[Any] = [None] * len(arrays)
        for chunk in size_batches(arrays, batch_size):
            x = torch.from_numpy(normalize([arrays[i] for i in chunk])).to(self.device)
            with torch.no_grad(), eval_mode(self.model):  # eval: BatchNorm never updates
                logits = infer_logits(self.model, x, **opts)  # spec S4: at the original size
            if logits.shape[1] != self.num_classes:  # a model that declares no num_classes
                raise ConfigError(
                    f"the model returned {logits.shape[1]} class scores and the meta names "
                    f"{self.num_classes} classes ({self.meta.name}): pass the meta of the "
                    "dataset the model was trained on"
                )
            probs = logits.softmax(1)
            dtype = torch.uint8 if self.num_classes <= 255 else torch.int64
            labels = probs.argmax(1).to(dtype).cpu().numpy()
            probs_np = probs.cpu().numpy() if return_probs else None
            for k, i in enumerate(chunk):
                out[i] = (labels[k], probs_np[k]) if return_probs else labels[k]
        return out

    def save_pretrained(self, folder: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write ``folder/config.json`` + ``folder/model.safetensors``; ``load_model(folder)``
        reads it back (see :mod:`dualseg.engine.pretrained`)."""
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
            training_labels=self.training_labels,
            label_contract=self.contract.to_dict(),
            train_images=self.train_images,
            overwrite=overwrite,
        )


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
    dev = resolve_device(device)
    model, meta, ckpt = load_network(path, device=dev)
    seg = Segmenter(model, meta, device=dev, amp=amp)
    seg.contract, seg.train_images = contract_of(ckpt), ckpt.get("train_images")
    seg.arch, seg.model_kwargs = str(ckpt["arch"]), dict(ckpt["model_kwargs"])
    seg.training_labels = dict((ckpt.get("config") or {}).get("data") or {})
    return seg
