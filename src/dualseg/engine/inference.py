"""How a network is run on a batch of images: whole image or sliding window, with or without
test-time augmentation (TTA). Every caller (``evaluate``, ``Segmenter``, ``dualseg eval /
predict / refine apply``) goes through :func:`infer_logits`.

- ``mode="whole"``: one forward pass; logits of another size are resized bilinearly (spec S4).
- ``mode="slide"`` (mmsegmentation's ``slide``): tiles of ``window`` every ``stride`` pixels,
  the last tile of a row or column shifted back to end at the border (no padding; an image
  smaller than the window is one tile). **Logits are averaged** where tiles overlap. Tiles run
  ``tile_batch`` at a time, so peak memory follows the window, not the image.
- TTA: each factor of ``tta_scales`` (and, with ``tta_flip``, the mirrored image) is run, its
  logits flipped back and resized, and **softmax probabilities are averaged** (mmseg's
  ``aug_test``); the result is ``log(mean probability)``. Without TTA the model's own logits
  are returned untouched.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from dualseg.errors import ConfigError
from dualseg.models.base import model_logits

MODES = ("whole", "slide")
TTA_SCALE_RANGE = (0.1, 8.0)  # TTA resize factors accepted (mmseg uses 0.5-1.75)
Model = Callable[[Tensor], Tensor]


def _whole(v: object) -> bool:
    """A whole number >= 1 of any number type (numpy's too), but no bool: 8.7 is not cut to 8."""
    real = isinstance(v, numbers.Real) and not isinstance(v, bool | np.bool_)
    return real and math.isfinite(v) and float(v).is_integer() and v >= 1  # type: ignore[arg-type]


def _pair(name: str, values: Any) -> tuple[int, int]:
    pair = tuple(values) if isinstance(values, Sequence | np.ndarray) else (values,)
    if len(pair) != 2 or not all(_whole(v) for v in pair):
        raise ConfigError(f"{name} (--{name}) needs two positive integers H W, got {values!r}")
    return (int(pair[0]), int(pair[1]))


def _scales(values: Any) -> tuple[float, ...]:
    values = values.tolist() if hasattr(values, "tolist") else values  # arrays, tensors
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise ConfigError(f"tta_scales takes a sequence of factors, got {values!r}; one factor: "
                          f"({values!r},)")  # fmt: skip
    if not all(isinstance(s, numbers.Real) and not isinstance(s, bool) for s in values):
        raise ConfigError(f"tta_scales (--tta-scales) must be numbers, got {values!r}")
    return tuple(float(s) for s in values)


@dataclass(frozen=True)
class InferenceOptions:
    """How to run a model on an image; the defaults are dualseg's defaults.

    ``window``/``stride``: tile size and step ``(H, W)`` of ``slide`` mode (stride ``None``:
    two thirds of the window, rounded up, set here). ``tta_scales``: resize factors averaged by TTA
    (``(1.0,)``: none). ``tta_flip``: also average the mirrored image. ``tile_batch``: tiles per
    forward pass. Values are checked (and made ints / floats) here, once.
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
        if not _whole(batch := self.tile_batch):
            raise ConfigError(f"tile_batch (--tile-batch) must be an int >= 1, got {batch!r}")
        window, scales = _pair("window", self.window), _scales(self.tta_scales)
        stride = None if self.stride is None else _pair("stride", self.stride)
        if self.mode == "whole" and (window != (512, 512) or stride is not None):
            raise ConfigError("window / stride are for slide mode: add mode='slide' (--mode slide)")
        if stride is not None and any(s > w for s, w in zip(stride, window)):
            raise ConfigError(
                f"--stride {stride[0]} {stride[1]} is larger than --window {window[0]} "
                f"{window[1]}; use a stride of at most the window"
            )
        lo, hi = TTA_SCALE_RANGE
        if not scales or not all(lo <= s <= hi for s in scales):  # NaN too
            shown = " ".join(str(s) for s in scales) or "none"
            raise ConfigError(f"--tta-scales must be factors from {lo:g} to {hi:g}, got {shown}")
        if self.mode == "slide" and stride is None:  # two thirds of the window, rounded up
            stride = tuple(math.ceil(2 * w / 3) for w in window)
        fixed = {"window": window, "stride": stride, "tta_scales": scales,
                 "tta_flip": bool(self.tta_flip), "tile_batch": int(batch)}  # fmt: skip
        for key, value in fixed.items():
            object.__setattr__(self, key, value)

    @property
    def uses_tta(self) -> bool:
        return self.tta_scales != (1.0,) or self.tta_flip

    @property
    def augmented(self) -> bool:
        """Whether the model runs other than once on the whole image (its scores averaged)."""
        return self.mode != "whole" or self.uses_tta

    def describe(self) -> str:
        """In words, e.g. ``sliding window 512x512, stride 342x342, TTA scales 1,1.5``."""
        text = "whole images"
        if self.mode == "slide":
            (wh, ww), (sh, sw) = self.window, self.stride
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
            "stride": list(self.stride) if slide else None,
            "tta_scales": list(self.tta_scales),
            "tta_flip": self.tta_flip,
        }


_DEFAULT = InferenceOptions()


def slide_tiles(
    size: tuple[int, int], window: tuple[int, int], stride: tuple[int, int]
) -> tuple[list[int], list[int], tuple[int, int]]:
    """Tile origins ``(ys, xs, (tile_h, tile_w))``: ``tile = min(window, size)``, origins step
    by ``stride`` and the last one is ``size - tile`` (tiles cover the image, never leave it)."""

    def starts(n: int, tile: int, step: int) -> list[int]:
        count = max(math.ceil((n - tile) / step), 0) + 1
        return sorted({min(i * step, n - tile) for i in range(count)})

    th, tw = min(window[0], size[0]), min(window[1], size[1])
    return starts(size[0], th, stride[0]), starts(size[1], tw, stride[1]), (th, tw)


def forward_logits(model: Model, x: Tensor, amp: bool) -> Tensor:
    """Model logits (float32) resized to ``x``'s size."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        logits = model_logits(model(x)).float()  # a torchvision model's {"out": ...} too
    if logits.shape[-2:] != x.shape[-2:]:
        logits = F.interpolate(logits, size=x.shape[-2:], mode="bilinear", align_corners=False)
    return logits


def slide_rows(
    model: Model,
    rows: Callable[[int, int], Tensor],
    size: tuple[int, int],
    batch: int,
    opts: InferenceOptions,
    amp: bool,
) -> Iterator[Tensor]:
    """Slide mode walked down the image: the mean logits of each run of rows, top to bottom,
    as soon as no later tile reaches them; ``rows(y0, y1)`` is the input ``[B,3,y1-y0,W]``.
    Only the rows a tile still covers are held."""
    (h, w), b0, band = size, 0, None
    ys, xs, (th, tw) = slide_tiles(size, opts.window, opts.stride)
    jobs = [(y, x, i) for y in ys for x in xs for i in range(batch)]  # every (tile, image)
    acc, top = None, 0  # acc: the sums of rows top.. still open
    for start in range(0, len(jobs), opts.tile_batch):
        chunk = jobs[start : start + opts.tile_batch]
        y0, y1 = chunk[0][0], chunk[-1][0] + th
        if band is None or y0 < b0 or y1 > b0 + band.shape[2]:
            band, b0 = rows(y0, y1), y0
        tiles = torch.stack([band[i, :, y - b0 : y - b0 + th, x : x + tw] for y, x, i in chunk])
        logits = forward_logits(model, tiles, amp)
        if acc is None:
            acc = logits.new_zeros(batch, logits.shape[1], 0, w)
            hits = [torch.zeros(n, device=acc.device) for n in (h, w)]  # tiles per row, column
            for count, starts, n in zip(hits, (ys, xs), (th, tw)):
                for s in starts:
                    count[s : s + n] += 1
        if y1 - top > acc.shape[2]:
            acc = torch.cat([acc, acc.new_zeros(*acc.shape[:2], y1 - top - acc.shape[2], w)], 2)
        for k, (y, x, i) in enumerate(chunk):
            acc[i, :, y - top : y - top + th, x : x + tw] += logits[k]
        done = jobs[start + opts.tile_batch][0] if start + opts.tile_batch < len(jobs) else h
        if done > top:
            yield acc[:, :, : done - top] / torch.outer(hits[0][top:done], hits[1])
            acc, top = acc[:, :, done - top :], done


def _run(model: Model, images: Tensor, opts: InferenceOptions, amp: bool) -> Tensor:
    b, _, h, w = images.shape
    ys, xs, _ = slide_tiles((h, w), opts.window, opts.stride or opts.window)
    if opts.mode == "whole" or len(ys) == len(xs) == 1:  # one pass on the images as given
        return forward_logits(model, images, amp)
    parts = slide_rows(model, lambda y0, y1: images[:, :, y0:y1], (h, w), b, opts, amp)
    return torch.cat(list(parts), 2)


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
    """Logits ``float32 [B,C,H,W]`` at the size of normalized ``images`` ``[B,3,H,W]`` (see
    the module docstring). Call under ``torch.no_grad()`` with the model in eval mode; raises
    :class:`~dualseg.errors.ConfigError` for invalid options."""
    opts = InferenceOptions(mode, window, stride, tta_scales, tta_flip, tile_batch)  # type: ignore[arg-type]
    if not opts.uses_tta:
        return _run(model, images, opts, amp)
    h, w = images.shape[-2:]
    total = torch.zeros(())
    for scale in opts.tta_scales:
        size = (max(1, round(h * scale)), max(1, round(w * scale)))
        x = (
            images
            if size == (h, w)
            else F.interpolate(images, size=size, mode="bilinear", align_corners=False)
        )
        for flip in (False, True) if opts.tta_flip else (False,):
            logits = _run(model, x.flip(-1) if flip else x, opts, amp)
            logits = logits.flip(-1) if flip else logits
            if size != (h, w):
                logits = F.interpolate(logits, size=(h, w), mode="bilinear", align_corners=False)
            total = total + logits.softmax(1)
    n = len(opts.tta_scales) * (2 if opts.tta_flip else 1)
    return (total / n).clamp_min(torch.finfo(torch.float32).tiny).log()
