"""Inference on ordinary images: ``dualseg.load_model(path).predict(image)``.

A :class:`Segmenter` is a trained network with its dataset description and the spec's S4 tail
(softmax, bilinear resize to the original size, argmax). Images run at their own resolution;
a batch groups images of one size, so an image's result never depends on the others.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict
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
from dualseg.models.base import class_labels, eval_mode, require_rgb_input
from dualseg.predictor import Predictor, require_image_list, size_batches

if TYPE_CHECKING:  # pragma: no cover
    from PIL.Image import Image as PILImage

    from dualseg.data import DatasetMeta

_INFER = InferenceOptions()  # the inference defaults (written once, in engine/inference.py)

# Anything predict() accepts: a file path, a PIL image, an HxWx3 array, or a tensor.
ImageLike = Union[str, os.PathLike, "PILImage", np.ndarray, Tensor]


def as_rgb_array(image: ImageLike) -> np.ndarray:
    """Any accepted image form as a uint8 ``HxWx3`` RGB array: a path, a PIL image or an array
    by the image policy (:func:`dualseg.imaging.as_rgb`); a tensor ``[3,H,W]`` / ``[1,3,H,W]``
    / ``[H,W,3]``, uint8 or float in [0, 1] (torchvision ``to_tensor``; normalized tensors are
    refused: call ``segmenter.model`` for those)."""
    if not isinstance(image, Tensor):
        return as_rgb(image)
    t = image.detach().cpu()
    t = t[0] if t.dim() == 4 and t.shape[0] == 1 else t
    chw, hwc = (t.dim() == 3 and t.shape[k] in (1, 3) for k in (0, -1))
    if chw == hwc:  # e.g. [3, 640, 3]: 640x3 or 3x640?
        why = "reads both as [C,H,W] and as [H,W,C]" if chw else "is not [3,H,W] or [H,W,3]"
        raise DataError(f"image tensor of shape {tuple(t.shape)} {why}; pass a numpy HxWx3 array")
    return numpy_to_rgb((t.permute(1, 2, 0) if chw else t).numpy())


class Segmenter(Predictor):
    """A trained network ready for raw images (see module docstring).

    ``model`` returns logits ``[B,C,H,W]`` for ImageNet-normalized input; ``meta`` is the
    :class:`~dualseg.data.DatasetMeta` it was trained on. ``model`` is moved to ``device`` in
    place; every prediction runs it in eval mode and gives it back in the mode it was in.
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
        self.model, self.meta, self.amp = model.to(self.device), meta, amp
        # set by load_model, for save_pretrained: build_model(arch, **model_kwargs), how the
        # training labels were read, their contract and the training images' digests
        self.arch: str | None = None
        self.model_kwargs: dict[str, Any] | None = None
        self.training_labels: dict[str, Any] = {}
        self.contract = LabelContract(meta)
        self.train_images: Any = None

    def __repr__(self) -> str:
        return (
            f"Segmenter({type(self.model).__name__}, {self.num_classes} classes "
            f"[{self.meta.name}], device={self.device})"
        )

    @property
    def bit_depth(self) -> int | None:
        """How 16-bit image files are read: as the training images were (None: detected)."""
        return self.contract.bit_depth

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
        """Label map ``HxW`` (uint8 for up to 255 classes, else int64) at the original size;
        ``mode="slide"``, ``window`` ... ``tile_batch``: see :mod:`dualseg.engine.inference`."""
        return self.predict_batch([image], mode=mode, window=window, stride=stride,
                                  tta_scales=tta_scales, tta_flip=tta_flip,
                                  tile_batch=tile_batch)[0]  # fmt: skip

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
        return self.predict_batch([image], return_probs=True, mode=mode, window=window,
                                  stride=stride, tta_scales=tta_scales, tta_flip=tta_flip,
                                  tile_batch=tile_batch)[0][1]  # fmt: skip

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
        """Label maps (or ``(label, probs)`` pairs with ``return_probs``) in input order,
        ``batch_size`` images of one size at a time. Inference options as :meth:`predict`."""
        require_image_list(images)
        opts = InferenceOptions(mode, window, stride, tta_scales, tta_flip, tile_batch)  # type: ignore[arg-type]
        arrays = [read_image(im, bit_depth=self.bit_depth) if isinstance(im, str | os.PathLike)
                  else as_rgb_array(im) for im in images]  # fmt: skip
        out: list[Any] = [None] * len(arrays)
        for chunk in size_batches(arrays, batch_size):
            x = torch.from_numpy(normalize([arrays[i] for i in chunk])).to(self.device)
            with torch.no_grad(), eval_mode(self.model):  # eval: BatchNorm never updates
                logits = infer_logits(self.model, x, amp=self.amp, **asdict(opts))
            if logits.shape[1] != self.num_classes:  # a model that declares no num_classes
                raise ConfigError(
                    f"the model returned {logits.shape[1]} class scores and the meta names "
                    f"{self.num_classes} classes ({self.meta.name}): pass the meta of the "
                    "dataset the model was trained on"
                )
            probs = logits.softmax(1)
            dtype = torch.uint8 if self.num_classes <= 255 else torch.int64
            labels = class_labels(probs).to(dtype).cpu().numpy()
            probs_np = probs.cpu().numpy() if return_probs else None
            for k, i in enumerate(chunk):
                out[i] = (labels[k], probs_np[k]) if return_probs else labels[k]
        return out

    def save_pretrained(self, folder: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write ``folder/config.json`` + ``folder/model.safetensors``; ``load_model(folder)``
        reads it back (see :mod:`dualseg.engine.pretrained`)."""
        if self.arch is None or self.model_kwargs is None:
            raise ConfigError(
                "this Segmenter's model was not built by dualseg.load_model; call "
                "dualseg.engine.pretrained.save_pretrained(model, folder, arch=..., ...)"
            )
        return save_pretrained(
            self.model, folder, arch=self.arch, model_kwargs=self.model_kwargs, meta=self.meta,
            mean=IMAGENET_MEAN, std=IMAGENET_STD, training_labels=self.training_labels,
            label_contract=self.contract.to_dict(), train_images=self.train_images,
            overwrite=overwrite,
        )  # fmt: skip


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
