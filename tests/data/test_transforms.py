"""Joint augmentation: seeded, labels nearest (no new values), padded with 255, aligned."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from dualseg.data import build_eval_transform, build_train_transform, denormalize
from dualseg.data.transforms import seeded

RNG = np.random.default_rng(0)
PALETTE = np.array([(230, 20, 20), (20, 230, 20), (20, 20, 230), (230, 230, 20)], np.uint8)


def blocky_label(size=(48, 64), classes=4, block=8) -> np.ndarray:
    small = RNG.integers(0, classes, (size[0] // block, size[1] // block), dtype=np.uint8)
    return np.kron(small, np.ones((block, block), np.uint8))


def test_same_seed_same_sample_other_seed_other_sample():
    t = build_train_transform(crop_size=(32, 32))
    image, label = RNG.integers(0, 256, (40, 50, 3), dtype=np.uint8), blocky_label((40, 48))
    label = np.pad(label, ((0, 0), (0, 2)))
    with seeded(7):
        a = t(image, label)
    with seeded(7):
        b = t(image, label)
    with seeded(8):
        c = t(image, label)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_seeded_restores_the_callers_generator():
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    with seeded(99):
        torch.rand(10)
    assert torch.equal(torch.rand(3), expected)


def test_labels_stay_nearest_and_pad_is_ignore():
    label = blocky_label()
    label[label == 1] = 3  # values {0, 2, 3}: any interpolation would create 1 or others
    image = PALETTE[label]
    t = build_train_transform(crop_size=(40, 56), scale_range=(0.5, 2.0))
    seen_pad = False
    for seed in range(12):
        with seeded(seed):
            out_img, out_lbl = t(image, label)
        assert out_img.shape == (3, 40, 56) and out_lbl.shape == (40, 56)
        assert out_lbl.dtype == torch.int64 and out_img.dtype == torch.float32
        assert set(out_lbl.unique().tolist()) <= {0, 2, 3, 255}
        seen_pad |= bool((out_lbl == 255).any())
    assert seen_pad


def test_padding_region_image_is_mean_and_label_255():
    label = np.zeros((20, 20), np.uint8)
    image = np.full((20, 20, 3), 255, np.uint8)
    t = build_train_transform(
        crop_size=(40, 40), scale_range=(1.0, 1.0), blur_prob=0, jitter=(0, 0, 0, 0)
    )
    with seeded(0):
        out_img, out_lbl = t(image, label)
    pad = out_lbl == 255
    assert pad.sum() == 40 * 40 - 20 * 20
    assert out_img[:, pad].abs().max() < 0.02  # the mean colour normalizes to ~0
    assert (out_img[:, ~pad] > 2).all()  # white stays white


def _decode(image_u8: np.ndarray) -> np.ndarray:
    d = ((image_u8[:, :, None, :].astype(int) - PALETTE[None, None].astype(int)) ** 2).sum(-1)
    return d.argmin(-1)


@pytest.mark.parametrize("seed", range(6))
def test_image_and_label_stay_aligned(seed):
    label = blocky_label((48, 72), block=12)
    t = build_train_transform(crop_size=(40, 48), blur_prob=0, jitter=(0, 0, 0, 0), image_fill=0)
    with seeded(seed):
        out_img, out_lbl = t(PALETTE[label], label)
    decoded = _decode(denormalize(out_img))
    lbl = out_lbl.numpy()
    inner = cv2.erode((lbl != 255).astype(np.uint8), np.ones((3, 3), np.uint8)) > 0
    # away from transitions (where bilinear blends colours) the image encodes the label
    flat = cv2.erode(lbl.astype(np.uint8), np.ones((5, 5), np.uint8)) == cv2.dilate(
        lbl.astype(np.uint8), np.ones((5, 5), np.uint8)
    )
    keep = inner & flat
    assert keep.sum() > 20
    assert (decoded[keep] == lbl[keep]).mean() == 1.0


def test_blur_and_jitter_never_touch_the_label():
    label = blocky_label()
    image = PALETTE[label]
    plain = build_train_transform(crop_size=(48, 64), blur_prob=0, jitter=(0, 0, 0, 0))
    noisy = build_train_transform(crop_size=(48, 64), blur_prob=1.0, jitter=(0.4, 0.4, 0.4, 0.1))
    for seed in range(4):
        with seeded(seed):
            a = plain(image, label)
        with seeded(seed):
            b = noisy(image, label)
        assert not torch.equal(a[0], b[0])
        # geometry is drawn before blur/jitter, so the labels agree exactly
        assert torch.equal(a[1], b[1])


def test_eval_transform_only_normalizes():
    label = blocky_label((13, 17), block=1)
    image = RNG.integers(0, 256, (13, 17, 3), dtype=np.uint8)
    out_img, out_lbl = build_eval_transform()(image, label)
    assert out_img.shape == (3, 13, 17) and torch.equal(out_lbl, torch.from_numpy(label).long())
    assert np.abs(denormalize(out_img).astype(int) - image).max() <= 1
