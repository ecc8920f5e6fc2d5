"""Spec S1 augmentation defaults, written once (a leaf: the training config reads them
without importing torch; ``dualseg.data.transforms`` re-exports them).

Also the one bound on seeds (:func:`seed_error`), checked by the training config, ``dualseg
augment``, ``dualseg demo`` and the refiner's options.

Random scale + crop, horizontal flip, filtering (Gaussian blur) and colour jitter. Used by
``build_train_transform`` (``dualseg refine fit``), ``augment_dataset`` (``dualseg augment``)
and the training config's ``data.*`` fields (``dualseg train``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

SCALE_RANGE = (0.5, 2.0)  # random scale factors
HFLIP_PROB = 0.5
BLUR_PROB = 0.5  # S1 "filtering": Gaussian blur
BLUR_SIGMA = (0.1, 2.0)
JITTER = (0.3, 0.3, 0.3, 0.0)  # colour jitter: brightness, contrast, saturation, hue

JITTER_PARTS = ("brightness", "contrast", "saturation", "hue")

# the largest crop side: a crop is allocated whole (padded past the image), and 100000 x 100000
# asked for 120 GB before failing with an allocator traceback
MAX_CROP_SIDE = 8192
# the largest random scale factor, for the same reason (recipes use 0.5..2, at most 4)
MAX_SCALE = 8.0

# the seed of every random draw (augmentation, sampling, initialization): numpy's legacy
# generators take seeds in 0..2**32-1, so every seed option is checked against this one bound
SEED_LIMIT = 2**32


def seed_error(seed: int, name: str) -> str | None:
    """The one-line error for the seed option ``name`` outside 0..2**32-1; None when valid."""
    if 0 <= seed < SEED_LIMIT:
        return None
    return f"{name} must be in 0..{SEED_LIMIT - 1}, got {seed}"


def _shown(name: str, value: object) -> str:
    """How the user wrote the setting: ``--scale-range 2 0.5`` (a flag) or
    ``data.scale_range=[2.0, 0.5]`` (a config key)."""
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
    """Raise one :class:`~dualseg.errors.ConfigError` for the first setting out of its range:
    ``crop_size`` H, W >= 1 (``None``: the source size), ``scale_range`` 0 < MIN <= MAX,
    probabilities in [0, 1], colour ``jitter`` strengths >= 0 with the hue shift in [0, 0.5]
    (``v2.ColorJitter``'s ranges; one number: brightness = contrast = saturation, no hue).

    ``names`` maps a keyword to how the caller's user writes it (``{"scale_range":
    "--scale-range"}``, ``{"scale_range": "data.scale_range"}``); the message names that and
    the value. Every augmentation entry point (``dualseg train``, ``refine fit``, ``augment``)
    calls it before it writes anything.
    """
    from dualseg.errors import ConfigError

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
            raise bad(
                "crop_size",
                crop_size,
                f"the crop size is H W, each from 1 to {MAX_CROP_SIDE} pixels",
            )
    if len(scale_range) != 2 or not all(number(v) for v in scale_range):
        raise bad("scale_range", scale_range, "give two finite scale factors MIN MAX")
    lo, hi = scale_range
    if not 0 < lo <= hi:
        raise bad(
            "scale_range", scale_range, "the scale factors must satisfy 0 < MIN <= MAX (e.g. 0.5 2)"
        )
    if hi > MAX_SCALE:
        raise bad(
            "scale_range",
            scale_range,
            f"MAX must be at most {MAX_SCALE:g} (the scaled image is "
            "allocated whole: 100000 asked for 46 TB before an allocator traceback)",
        )
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
