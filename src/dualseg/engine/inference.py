"""How a network is run on a batch of images: whole image or sliding window, with or without
test-time augmentation (TTA). Plain functions; every caller (``evaluate``, ``Segmenter``,
``dualseg eval / predict / refine apply``) goes through :func:`infer_logits`.

- ``mode="whole"`` (the default, today's behaviour): one forward pass over the whole image;
  logits of another size are resized bilinearly to the image size (spec S4).
- ``mode="slide"`` (mmsegmentation's ``slide`` mode): tiles of ``window = (H, W)`` every
  ``stride = (H, W)`` pixels; the last tile of a row or column is shifted back so that it ends
  at the image border (every tile has the window's size, none is padded). An image smaller
  than the window in a dimension gets one tile of the image's size in that dimension. Each
  tile's logits are resized to the tile, summed into the image, and divided by the number of
  tiles covering each pixel: **logits are averaged** in the overlaps, as in mmseg. Tiles run
  ``tile_batch`` at a time, so peak memory follows the window, not the image.
- TTA: the image is resized by every factor of ``tta_scales`` (bilinear, relative to the
  image's own size) and, with ``tta_flip``, also mirrored left-right; each variant is run
  (whole or slide, as above), its logits flipped back and resized to the image size, and
  **softmax probabilities are averaged** over the variants (mmseg's ``aug_test`` /
  ``SegTTAModel``). The returned "logits" are then ``log(mean probability)``, so
  ``softmax(result)`` is exactly the averaged probabilities and ``argmax`` the TTA label.
  Without TTA (``tta_scales=(1.0,)``, no flip) the model's own logits are returned untouched.

Defaults live in :class:`InferenceOptions` (the one place that writes them).
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from dualseg.errors import ConfigError
from dualseg.models.base import model_logits

__all__ = ["MODES", "InferenceOptions", "autocast", "infer_logits", "slide_tiles"]

MODES = ("whole", "slide")

Model = Callable[[Tensor], Tensor]


TTA_SCALE_RANGE = (0.1, 8.0)  # TTA resize factors accepted (mmseg uses 0.5-1.75)


def _is_whole(v: object) -> bool:
    """An integer value of any number type (numpy's too), but no bool."""
    return (
        not isinstance(v, bool | np.bool_)
        and isinstance(v, numbers.Real)
        and math.isfinite(v)
        and float(v).is_integer()
    )


def _pixels(name: str, values: Sequence[int]) -> tuple[int, int]:
    """``values`` as two ints: a fraction (8.7) is refused, not cut."""
    pair = tuple(values) if isinstance(values, Sequence | np.ndarray) else (values,)
    if len(pair) != 2 or not all(_is_whole(v) and v >= 1 for v in pair):
        shown = tuple(v.item() if isinstance(v, np.generic) else v for v in pair)
        raise ConfigError(
            f"{name} (--{name}) needs two positive integers H W, got "
            f"{shown if len(shown) != 1 else shown[0]}"
        )
    return (int(pair[0]), int(pair[1]))


def _scales(values: Sequence[float]) -> tuple[float, ...]:
    """``tta_scales`` as floats, from any sequence or iterable (a list, tuple, range, numpy
    array or tensor); a bare number or a string is refused (a TypeError from ``tuple``)."""
    if hasattr(values, "tolist"):  # a numpy array or tensor; 0-d gives a bare number
        values = values.tolist()
    if isinstance(values, str | bytes | Mapping) or not isinstance(values, Iterable):
        raise ConfigError(
            f"tta_scales (--tta-scales) takes a sequence of factors, e.g. (0.75, 1.0, 1.25), "
            f"got {values!r}; one factor: ({values!r},)"
        )
    values = list(values)
    if not all(isinstance(s, numbers.Real) and not isinstance(s, bool) for s in values):
        raise ConfigError(f"tta_scales (--tta-scales) must be numbers, got {values!r}")
    return tuple(float(s) for s in values)


def _count(name: str, value: int) -> int:
    """A whole count >= 1: 2.7 is refused, not cut to 2."""
    if not (_is_whole(value) and value >= 1):
        raise ConfigError(f"{name} (--{name.replace('_', '-')}) must be an int >= 1, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class InferenceOptions:
    """How to run a model on an image; the defaults are dualseg's defaults.

    ``mode``: ``"whole"`` | ``"slide"``. ``window``: tile size ``(H, W)`` in pixels for
    ``slide``. ``stride``: tile step ``(H, W)``; ``None`` = two thirds of the window, rounded
    up (512 -> 342). ``tta_scales``: resize factors averaged by TTA (``(1.0,)``: no
    multi-scale). ``tta_flip``: also average the left-right mirrored image. ``tile_batch``:
    tiles per forward pass in ``slide`` mode.
    """

    mode: str = "whole"
    window: tuple[int, int] = (512, 512)
    stride: tuple[int, int] | None = None
    tta_scales: tuple[float, ...] = (1.0,)
    tta_flip: bool = False
    tile_batch: int = 4

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"inference mode {self.mode!r} is not one of {' | '.join(MODES)}")
        _pixels("window", self.window)  # 8.7 was cut to 8 without a word
        if self.stride is not None:
            _pixels("stride", self.stride)
        if self.mode == "whole" and (self.window != (512, 512) or self.stride is not None):
            raise ConfigError(  # else silently unused: the whole image in one pass
                "window / stride apply to sliding-window inference only: add mode='slide' "
                "(--mode slide), or drop them"
            )
        if self.stride is not None and any(s > w for s, w in zip(self.stride, self.window)):
            raise ConfigError(
                f"--stride {self.stride[0]} {self.stride[1]} is larger than --window "
                f"{self.window[0]} {self.window[1]}: pixels between tiles would get no "
                "prediction; use a stride of at most the window"
            )
        lo, hi = TTA_SCALE_RANGE
        if not self.tta_scales or not all(lo <= s <= hi for s in self.tta_scales):  # NaN too
            raise ConfigError(
                f"--tta-scales must be factors from {lo:g} to {hi:g} (e.g. 0.75 1.0 1.25; "
                "smaller ones shrink an image to a few pixels), got "
                f"{' '.join(str(s) for s in self.tta_scales) or 'none'}"
            )
        _count("tile_batch", self.tile_batch)

    @property
    def effective_stride(self) -> tuple[int, int]:
        """``stride``, or two thirds of ``window`` (rounded up) when it is ``None``."""
        if self.stride is not None:
            return (int(self.stride[0]), int(self.stride[1]))
        return (math.ceil(2 * self.window[0] / 3), math.ceil(2 * self.window[1] / 3))

    @property
    def uses_tta(self) -> bool:
        return tuple(self.tta_scales) != (1.0,) or self.tta_flip

    def describe(self) -> str:
        """In words, e.g. ``sliding window 512x512, stride 342x342, TTA scales 1,1.5``."""
        text = "whole images"
        if self.mode == "slide":
            (wh, ww), (sh, sw) = self.window, self.effective_stride
            text = f"sliding window {wh}x{ww}, stride {sh}x{sw}"
        if self.uses_tta:
            text += f", TTA scales {','.join(f'{s:g}' for s in self.tta_scales)}"
            text += " + flip" if self.tta_flip else ""
        return text

    def record(self) -> dict[str, Any]:
        """As ``metrics.json`` states them (window and stride in slide mode only)."""
        slide = self.mode == "slide"
        return {
            "mode": self.mode,
            "window": list(self.window) if slide else None,
            "stride": list(self.effective_stride) if slide else None,
            "tta_scales": list(self.tta_scales),
            "tta_flip": self.tta_flip,
        }


_DEFAULT = InferenceOptions()


def autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager:
    """bf16 autocast on ``device`` when ``enabled`` (what the trainer uses), else a no-op."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def slide_tiles(
    size: tuple[int, int], window: tuple[int, int], stride: tuple[int, int]
) -> tuple[list[int], list[int], tuple[int, int]]:
    """Tile origins of ``slide`` mode: ``(ys, xs, (tile_h, tile_w))`` for an image of ``size``.

    ``tile = min(window, size)`` per dimension; origins step by ``stride`` and the last one is
    ``size - tile`` (so tiles never leave the image and always cover it).
    """

    def starts(n: int, tile: int, step: int) -> list[int]:
        count = max(math.ceil((n - tile) / step), 0) + 1
        return sorted({min(i * step, n - tile) for i in range(count)})

    th, tw = min(window[0], size[0]), min(window[1], size[1])
    return starts(size[0], th, stride[0]), starts(size[1], tw, stride[1]), (th, tw)


def _forward(model: Model, x: Tensor, amp: bool) -> Tensor:
    """Model logits (float32) resized to ``x``'s size."""
    with autocast(x.device, amp):
        logits = model_logits(model(x))  # a torchvision model's {"out": ...} too
    logits = logits.float()
    if logits.shape[-2:] != x.shape[-2:]:
        logits = F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)
    return logits


def _slide(model: Model, images: Tensor, opts: InferenceOptions, amp: bool) -> Tensor:
    b, _, h, w = images.shape
    ys, xs, (th, tw) = slide_tiles((h, w), opts.window, opts.effective_stride)
    if len(ys) == len(xs) == 1:  # the image fits in the window: one tile, the whole image
        return _forward(model, images, amp)
    # every (image, tile) pair, run tile_batch at a time; tiles all have the size (th, tw)
    jobs = [(i, y, x) for y in ys for x in xs for i in range(b)]
    out: Tensor | None = None
    for start in range(0, len(jobs), opts.tile_batch):
        chunk = jobs[start : start + opts.tile_batch]
        tiles = torch.stack([images[i, :, y : y + th, x : x + tw] for i, y, x in chunk])
        logits = _forward(model, tiles, amp)
        if out is None:
            out = logits.new_zeros(b, logits.shape[1], h, w)
        for k, (i, y, x) in enumerate(chunk):
            out[i, :, y : y + th, x : x + tw] += logits[k]
    assert out is not None  # at least one tile per image
    # tiles covering each pixel = (tiles covering its row) x (tiles covering its column)
    rows = torch.zeros(h, device=out.device)
    cols = torch.zeros(w, device=out.device)
    for y in ys:
        rows[y : y + th] += 1
    for x in xs:
        cols[x : x + tw] += 1
    return out / (rows[:, None] * cols[None, :])


def _run(model: Model, images: Tensor, opts: InferenceOptions, amp: bool) -> Tensor:
    if opts.mode == "slide":
        return _slide(model, images, opts, amp)
    return _forward(model, images, amp)


def infer_logits(
    model: Model,
    images: Tensor,
    *,
    mode: str = _DEFAULT.mode,
    window: Sequence[int] = _DEFAULT.window,
    stride: Sequence[int] | None = _DEFAULT.stride,
    tta_scales: Sequence[float] = _DEFAULT.tta_scales,
    tta_flip: bool = _DEFAULT.tta_flip,
    tile_batch: int = _DEFAULT.tile_batch,
    amp: bool = False,
) -> Tensor:
    """Logits ``float32 [B,C,H,W]`` at the size of ``images`` (normalized ``[B,3,H,W]``).

    See the module docstring for ``mode``/``window``/``stride`` (sliding window, logits
    averaged in overlaps) and ``tta_scales``/``tta_flip`` (softmax probabilities averaged;
    the result is their log). Call under ``torch.no_grad()`` with the model in eval mode.
    Raises :class:`~dualseg.errors.ConfigError` for invalid options.
    """
    opts = InferenceOptions(
        mode=mode,
        window=_pixels("window", window),
        stride=None if stride is None else _pixels("stride", stride),
        tta_scales=_scales(tta_scales),
        tta_flip=bool(tta_flip),
        tile_batch=_count("tile_batch", tile_batch),
    )
    if not opts.uses_tta:
        return _run(model, images, opts, amp)
    h, w = images.shape[-2:]
    total: Tensor | None = None
    for scale in opts.tta_scales:
        size = (max(1, round(h * scale)), max(1, round(w * scale)))
        x = images
        if size != (h, w):
            x = F.interpolate(images, size=size, mode="bilinear", align_corners=False)
        for flip in (False, True) if opts.tta_flip else (False,):
            logits = _run(model, x.flip(-1) if flip else x, opts, amp)
            if flip:
                logits = logits.flip(-1)
            if size != (h, w):
                logits = F.interpolate(logits, size=(h, w), mode="bilinear", align_corners=False)
            probs = logits.softmax(1)
            total = probs if total is None else total + probs
    assert total is not None
    n = len(opts.tta_scales) * (2 if opts.tta_flip else 1)
    return (total / n).clamp_min(torch.finfo(torch.float32).tiny).log()
