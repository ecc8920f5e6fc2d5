"""Spec S1 augmentation: one set of defaults for train, refine fit and augment."""

from __future__ import annotations

import inspect

from dualseg.commands.refine import build_parser as refine_parser
from dualseg.data import transforms as T
from dualseg.data.augment import augment_dataset
from dualseg.engine.config import DataConfig


def _defaults(fn) -> dict:
    return {k: p.default for k, p in inspect.signature(fn).parameters.items()}


def test_one_set_of_s1_defaults() -> None:
    want = {
        "scale_range": T.SCALE_RANGE,
        "hflip_prob": T.HFLIP_PROB,
        "blur_prob": T.BLUR_PROB,
        "jitter": T.JITTER,
    }
    for fn in (T.build_train_transform, T.build_augment_pipeline, augment_dataset):
        got = _defaults(fn)
        assert {k: got[k] for k in want} == want, fn.__name__
    d = DataConfig()
    b, c, s, h = T.JITTER
    assert (d.scale_range, d.hflip_prob, d.blur_prob) == (
        T.SCALE_RANGE,
        T.HFLIP_PROB,
        T.BLUR_PROB,
    )
    assert d.jitter == b == c == s and h == 0.0  # DataConfig's one strength: no hue
    fit = refine_parser().parse_args(["fit", "--data", "x"])
    assert tuple(fit.scale_range) == T.SCALE_RANGE
