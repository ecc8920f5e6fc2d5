"""Spec S1 augmentation defaults and their checks, and the one bound on seeds (a torch-free
leaf: the training config, ``dualseg augment`` and ``refine fit`` read them)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

from dualseg.errors import ConfigError

SCALE_RANGE = (0.5, 2.0)  # random scale factors
HFLIP_PROB = 0.5
BLUR_PROB = 0.5  # S1 "filtering": Gaussian blur
BLUR_SIGMA = (0.1, 2.0)
JITTER = (0.3, 0.3, 0.3, 0.0)  # colour jitter: brightness, contrast, saturation, hue

JITTER_PARTS = ("brightness", "contrast", "saturation", "hue")

# crops and scaled images are allocated whole: larger ones fail in the allocator
MAX_CROP_SIDE = 8192
MAX_SCALE = 8.0
SEED_LIMIT = 2**32  # numpy's legacy generators take seeds in 0..2**32-1


def seed_error(seed: int, name: str) -> str | None:
    """The one-line error for the seed option ``name`` out of range; None when valid."""
    if 0 <= seed < SEED_LIMIT:
        return None
    return f"{name} must be in 0..{SEED_LIMIT - 1}, got {seed}"


def _shown(name: str, value: object) -> str:
    """The setting as the user wrote it: ``--scale-range 2 0.5`` or ``data.scale_range=[2, 1]``."""
    values = list(value) if isinstance(value, list | tuple) else [value]
    if name.startswith("--"):
        return f"{name} {' '.join(f'{v:g}' if isinstance(v, float) else str(v) for v in values)}"
    return f"{name}={values if isinstance(value, list | tuple) else value}"


def check_augment_settings(
    *,
    crop_size: Sequence[int] | None = None,
    scale_range: Sequence[float] = SCALE_RANGE,
    hflip_prob: float = HFLIP_PROB,
    blur_prob: float = BLUR_PROB,
    jitter: float | Sequence[float] = JITTER,
    names: Mapping[str, str] | None = None,
) -> None:
    """Raise one ConfigError for the first setting out of ``v2``'s ranges (``jitter`` as one
    number: brightness = contrast = saturation); ``names``: how the user writes each key."""
    names = dict(names or {})

    def bad(key: str, value: object, rule: str) -> ConfigError:
        return ConfigError(f"{_shown(names.get(key, key), value)}: {rule}")

    def number(v: object) -> bool:
        return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)

    if crop_size is not None:
        whole = [isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in crop_size]
        if len(crop_size) != 2 or not all(
            w and 1 <= v <= MAX_CROP_SIDE for w, v in zip(whole, crop_size, strict=True)
        ):
            rule = f"the crop size is H W, each from 1 to {MAX_CROP_SIDE} pixels"
            raise bad("crop_size", crop_size, rule)
    if len(scale_range) != 2 or not all(number(v) for v in scale_range):
        raise bad("scale_range", scale_range, "give two finite scale factors MIN MAX")
    lo, hi = scale_range
    if not 0 < lo <= hi:
        rule = "the scale factors must satisfy 0 < MIN <= MAX (e.g. 0.5 2)"
        raise bad("scale_range", scale_range, rule)
    if hi > MAX_SCALE:
        rule = f"MAX must be at most {MAX_SCALE:g} (the scaled image is allocated whole)"
        raise bad("scale_range", scale_range, rule)
    for key, p in (("hflip_prob", hflip_prob), ("blur_prob", blur_prob)):
        if not (number(p) and 0 <= p <= 1):
            raise bad(key, p, "a probability must be in [0, 1]")
    parts = [jitter] * 3 + [0.0] if not isinstance(jitter, list | tuple) else list(jitter)
    if len(parts) != 4:
        raise bad("jitter", jitter, "give 4 colour jitter strengths: " + " ".join(JITTER_PARTS))
    one = not isinstance(jitter, list | tuple)  # one strength: brightness, contrast, saturation
    for part, v in zip(JITTER_PARTS, parts, strict=True):
        limit = 0.5 if part == "hue" else math.inf
        if not (number(v) and 0 <= v <= limit):
            rule = "in [0, 0.5]" if part == "hue" else "finite and >= 0 (0: off)"
            raise bad("jitter", jitter, f"the {'colour' if one else part} jitter must be {rule}")
