"""Joint image/label transforms (spec S1, method B step 1) on torchvision v2: the label is a
``tv_tensors.Mask`` (resized nearest, padded with ignore, never blurred or jittered).
:func:`seeded` runs a transform under one seed per sample, so workers and resumes replay it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import cv2
import numpy as np
import torch
from torch import Tensor
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from dualseg.augment_defaults import (  # spec S1 defaults, written once
    BLUR_PROB,
    BLUR_SIGMA,
    HFLIP_PROB,
    JITTER,
    SCALE_RANGE,
)
from dualseg.imaging import IMAGENET_MEAN, IMAGENET_STD  # defined once, torch-free

JointTransform = Callable[[np.ndarray, np.ndarray], tuple[Tensor, Tensor]]


class RandomScale(v2.Transform):
    """Resize by a factor drawn uniformly from ``scale_range`` (image bilinear, label nearest)."""

    def __init__(self, scale_range: tuple[float, float] = (0.5, 2.0)) -> None:
        super().__init__()
        self.scale_range = (float(scale_range[0]), float(scale_range[1]))

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        h, w = v2.query_size(flat_inputs)
        s = float(torch.empty(1).uniform_(*self.scale_range))
        return {"size": [max(1, round(h * s)), max(1, round(w * s))]}

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        return self._call_kernel(F.resize, inpt, params["size"], antialias=True)


class RandomGaussianBlur(v2.Transform):
    """Gaussian blur of the image (never the label) with probability ``p``, run by OpenCV
    (torchvision's takes ~25 ms on a 360x480 image on one core, OpenCV's under 1 ms)."""

    def __init__(self, p: float = BLUR_PROB, sigma: tuple[float, float] = BLUR_SIGMA) -> None:
        super().__init__()
        self.p, self.sigma = float(p), tuple(sigma)

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        apply = bool(torch.rand(1) < self.p)  # both draws always happen: a fixed stream
        sigma = float(torch.empty(1).uniform_(*self.sigma))
        return {"apply": apply, "sigma": sigma}

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        if not params["apply"] or not isinstance(inpt, tv_tensors.Image):
            return inpt
        hwc = inpt.permute(1, 2, 0).contiguous().numpy()
        out = cv2.GaussianBlur(hwc, (5, 5), params["sigma"], borderType=cv2.BORDER_REFLECT_101)
        out = out.reshape(hwc.shape)  # cv2 drops a trailing channel axis of size 1
        return tv_tensors.wrap(torch.from_numpy(out).permute(2, 0, 1).contiguous(), like=inpt)


class _Joint:
    """Apply a v2 pipeline to (numpy image, numpy label); return (image tensor, label tensor)."""

    def __init__(self, pipeline: v2.Transform) -> None:
        self.pipeline = pipeline

    def __call__(self, image: np.ndarray, label: np.ndarray) -> tuple[Tensor, Tensor]:
        img = tv_tensors.Image(torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1))
        lbl = tv_tensors.Mask(torch.from_numpy(np.ascontiguousarray(label)))
        img, lbl = self.pipeline(img, lbl)
        return img.as_subclass(Tensor), lbl.as_subclass(Tensor)


def build_augment_pipeline(
    *,
    crop_size: tuple[int, int],
    scale_range: tuple[float, float] = SCALE_RANGE,
    hflip_prob: float = HFLIP_PROB,
    blur_prob: float = BLUR_PROB,
    blur_sigma: tuple[float, float] = BLUR_SIGMA,
    jitter: tuple[float, float, float, float] = JITTER,
    image_fill: str | float = "mean",
    mean: Sequence[float] = IMAGENET_MEAN,
    ignore_index: int = 255,
) -> v2.Compose:
    """Training augmentation on uint8 ``Image``/``Mask`` tv_tensors: random scale -> random
    crop (padded: image ``image_fill``, label ``ignore_index``) -> flip -> blur -> jitter.
    The values are checked where they enter (``check_augment_settings``)."""
    ops: list[v2.Transform] = []
    if scale_range != (1.0, 1.0):
        ops.append(RandomScale(scale_range))
    # "mean" pads with the colour that normalizes to 0: "nothing" to the network
    pad = [round(255 * m) for m in mean] if image_fill == "mean" else [float(image_fill)] * 3
    fill = {tv_tensors.Image: pad, tv_tensors.Mask: ignore_index}
    ops.append(v2.RandomCrop(tuple(crop_size), pad_if_needed=True, fill=fill))
    if hflip_prob > 0:
        ops.append(v2.RandomHorizontalFlip(hflip_prob))
    if blur_prob > 0:
        ops.append(RandomGaussianBlur(blur_prob, sigma=blur_sigma))
    if any(jitter):
        b, c, s, h = jitter
        ops.append(v2.ColorJitter(brightness=b, contrast=c, saturation=s, hue=h))
    return v2.Compose(ops)


def _normalize(mean: Sequence[float], std: Sequence[float]) -> list[v2.Transform]:
    dtypes = {tv_tensors.Image: torch.float32, tv_tensors.Mask: torch.int64, "others": None}
    return [v2.ToDtype(dtypes, scale=True), v2.Normalize(mean=list(mean), std=list(std))]


def build_train_transform(
    *,
    crop_size: tuple[int, int],
    scale_range: tuple[float, float] = SCALE_RANGE,
    hflip_prob: float = HFLIP_PROB,
    blur_prob: float = BLUR_PROB,
    blur_sigma: tuple[float, float] = BLUR_SIGMA,
    jitter: tuple[float, float, float, float] = JITTER,
    image_fill: str | float = "mean",
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    ignore_index: int = 255,
) -> JointTransform:
    """:func:`build_augment_pipeline` then normalization (``jitter``: ``v2.ColorJitter``'s
    brightness, contrast, saturation, hue; hue 0 by default: slow, and it recolours sky)."""
    aug = build_augment_pipeline(
        crop_size=crop_size,
        scale_range=scale_range,
        hflip_prob=hflip_prob,
        blur_prob=blur_prob,
        blur_sigma=blur_sigma,
        jitter=jitter,
        image_fill=image_fill,
        mean=mean,
        ignore_index=ignore_index,
    )
    return _Joint(v2.Compose([*aug.transforms, *_normalize(mean, std)]))


def build_eval_transform(
    *, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD
) -> JointTransform:
    """Evaluation transform: no geometry change, only conversion and normalization."""
    return _Joint(v2.Compose(_normalize(mean, std)))


def sample_seed(seed: int, *, index: int, epoch: int = 0) -> int:
    """A well-mixed 31-bit seed (every generator takes it) for one sample of one epoch."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1)[0] >> 1)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block with torch's CPU generator seeded, restoring the caller's state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
