"""Joint image/label transforms (spec S1 and method B step 1), built on torchvision v2.

A transform is a callable ``(image uint8 HxWx3, label uint8 HxW) -> (image float32 [3,H,W]
normalized, label int64 [H,W])``. The label is wrapped as ``tv_tensors.Mask`` so torchvision
resizes it nearest-neighbour, pads it with the ignore index and leaves it out of blur and colour
jitter. Randomness comes from torch's global generator; :func:`seeded` runs a transform under a
fixed seed (the datasets use one seed per sample index, so workers and resumed runs replay the
same stream).
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
    check_augment_settings,
)
from dualseg.imaging import IMAGENET_MEAN, IMAGENET_STD  # defined once, torch-free

JointTransform = Callable[[np.ndarray, np.ndarray], tuple[Tensor, Tensor]]


class RandomScale(v2.Transform):
    """Resize by a factor drawn uniformly from ``scale_range`` (image bilinear, label nearest)."""

    def __init__(self, scale_range: tuple[float, float] = (0.5, 2.0)) -> None:
        super().__init__()
        check_augment_settings(scale_range=scale_range)  # ConfigError, a ValueError
        lo, hi = scale_range
        self.scale_range = (float(lo), float(hi))

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        h, w = v2.query_size(flat_inputs)
        s = float(torch.empty(1).uniform_(*self.scale_range))
        return {"size": [max(1, round(h * s)), max(1, round(w * s))]}

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        # F.resize dispatches on the tv_tensor type: Image -> bilinear, Mask -> nearest.
        return self._call_kernel(F.resize, inpt, params["size"], antialias=True)


class RandomGaussianBlur(v2.Transform):
    """Gaussian blur of the image (never the label) with probability ``p``.

    Same parameters as ``v2.GaussianBlur`` but run by OpenCV: torchvision's float convolution
    costs ~25 ms on a 360x480 image on one core, OpenCV's under 1 ms, and blur is applied to
    every other training sample.
    """

    def __init__(
        self,
        p: float = BLUR_PROB,
        kernel_size: int = 5,
        sigma: tuple[float, float] = BLUR_SIGMA,
    ) -> None:
        super().__init__()
        if kernel_size % 2 != 1:
            raise ValueError(f"kernel_size must be odd, got {kernel_size}")
        self.p, self.kernel_size, self.sigma = float(p), int(kernel_size), tuple(sigma)

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        apply = bool(torch.rand(1) < self.p)  # both draws always happen: a fixed stream
        sigma = float(torch.empty(1).uniform_(*self.sigma))
        return {"apply": apply, "sigma": sigma}

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        if not params["apply"] or not isinstance(inpt, tv_tensors.Image):
            return inpt
        hwc = inpt.permute(1, 2, 0).contiguous().numpy()
        k = self.kernel_size
        out = cv2.GaussianBlur(hwc, (k, k), params["sigma"], borderType=cv2.BORDER_REFLECT_101)
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

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.pipeline})"


def _fill_value(image_fill: str | float, mean: Sequence[float]) -> list[float]:
    # Padding happens on uint8 pixels before normalization; "mean" pads with the colour that
    # normalizes to 0, so padding looks like "nothing" to the network.
    if image_fill == "mean":
        return [round(255 * m) for m in mean]
    return [float(image_fill)] * 3


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
    """The random part of training augmentation, on uint8 ``Image``/``Mask`` tv_tensors.

    Order: random scale -> random crop (padded when smaller: image with ``image_fill``, label
    with ``ignore_index``) -> horizontal flip -> Gaussian blur (probability ``blur_prob``) ->
    colour jitter (brightness, contrast, saturation, hue). Labels: nearest, never blurred or
    jittered. ``dualseg augment`` uses this to write uint8 pairs. A setting out of its range
    is a one-line :class:`~dualseg.errors.ConfigError` (:func:`check_augment_settings`).
    """
    check_augment_settings(
        crop_size=tuple(crop_size),
        scale_range=scale_range,
        hflip_prob=hflip_prob,
        blur_prob=blur_prob,
        jitter=tuple(jitter),
    )
    ops: list[v2.Transform] = []
    if scale_range != (1.0, 1.0):
        ops.append(RandomScale(scale_range))
    fill = {tv_tensors.Image: _fill_value(image_fill, mean), tv_tensors.Mask: ignore_index}
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
    """Training transform: :func:`build_augment_pipeline` followed by ImageNet normalization.

    ``jitter`` is (brightness, contrast, saturation, hue) as in ``v2.ColorJitter``; hue defaults
    to 0 because a hue shift is slow on CPU and turns sky/vegetation colours into others.
    """
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
    """A well-mixed 31-bit seed for one sample of one epoch: the same inputs give the same seed
    in any process, rank or worker. Keyword-only (index and epoch are easy to swap); 31 bits
    so that Python's, numpy's and torch's generators all accept it."""
    return int(np.random.SeedSequence([seed, epoch, index]).generate_state(1)[0] >> 1)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block with torch's CPU generator seeded, restoring the caller's state afterwards."""
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(state)


def denormalize(
    image: Tensor, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD
) -> np.ndarray:
    """Normalized float ``[3,H,W]`` -> ``uint8 HxWx3`` (for viewing and for writing to disk)."""
    m = torch.tensor(mean, dtype=image.dtype).view(3, 1, 1)
    s = torch.tensor(std, dtype=image.dtype).view(3, 1, 1)
    out = (image * s + m).clamp(0, 1).mul(255).round().to(torch.uint8)
    return out.permute(1, 2, 0).contiguous().numpy()
