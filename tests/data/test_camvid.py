"""Real CamVid (../shared/data/camvid; skipped when absent): loading, ignore, alignment."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from dualseg.data import (
    build_dataset,
    build_train_transform,
    denormalize,
    get_preset,
    read_label,
)
from dualseg.data.transforms import seeded

pytestmark = pytest.mark.camvid
CAMVID = get_preset("camvid")


def test_every_val_pair_loads_with_camvid_classes(camvid_root):
    ds = build_dataset(camvid_root, split="val", preset="camvid")
    assert len(ds) == len((camvid_root / "val.txt").read_text().split("\n")) - 1 == 101
    counts = np.zeros(256, np.int64)
    for i in range(len(ds)):
        image, label = ds.load_pair(i)
        assert image.shape == (360, 480, 3) and label.shape == (360, 480)
        counts += np.bincount(label.ravel(), minlength=256)
    assert (counts[:11] > 0).all()  # all 11 classes present in val
    assert counts[11] == 0 and counts[255] > 0  # raw 11 (unlabelled) became 255
    assert counts[12:255].sum() == 0
    image, label = ds[0]
    assert image.shape == (3, 360, 480) and label.dtype == torch.int64


def test_raw_unlabelled_pixels_become_ignore(camvid_root):
    from PIL import Image

    path = camvid_root / "valannot" / "0016E5_07959.png"
    if not path.is_file():
        path = sorted((camvid_root / "valannot").glob("*.png"))[0]
    raw = np.asarray(Image.open(path))
    label = read_label(path, CAMVID)
    assert np.array_equal(label == 255, raw == 11)
    assert np.array_equal(label[raw != 11], raw[raw != 11])


@pytest.mark.parametrize("index", [0, 50])
def test_augmentation_keeps_real_pairs_aligned(camvid_root, index):
    ds = build_dataset(camvid_root, split="val", preset="camvid")
    image, label = ds.load_pair(index)
    # an image that encodes its label: class colours, black for ignore (= the pad colour)
    palette = np.array([*CAMVID.palette, *[(0, 0, 0)] * 245], np.uint8)
    encoded = palette[label]
    geometry_only = build_train_transform(
        crop_size=(240, 320), blur_prob=0, jitter=(0, 0, 0, 0), image_fill=0
    )
    full = build_train_transform(crop_size=(240, 320), image_fill=0)
    colours = np.array([*CAMVID.palette, (0, 0, 0)], np.int64)
    values = np.array([*range(11), 255])
    for seed in range(3):
        with seeded(seed):
            enc_img, enc_lbl = geometry_only(encoded, label)
        with seeded(seed):
            _, real_lbl = full(image, label)
        # same seed: the real image's label went through the same flip/scale/crop
        assert torch.equal(real_lbl, enc_lbl)
        out = denormalize(enc_img).astype(np.int64)
        decoded = values[((out[:, :, None] - colours[None, None]) ** 2).sum(-1).argmin(-1)]
        lbl = enc_lbl.numpy().astype(np.uint8)
        k = np.ones((5, 5), np.uint8)
        interior = cv2.erode(lbl, k) == cv2.dilate(lbl, k)
        assert (decoded[interior] == lbl[interior]).mean() > 0.999
        # transitions coincide: label edges have decoded-image edges within 1 px, and far
        # fewer once the image edges are shifted by 3 px (so the check can tell misalignment)
        assert _edge_agreement(lbl, decoded, 0) > 0.95
        assert _edge_agreement(lbl, decoded, 3) < _edge_agreement(lbl, decoded, 0) - 0.2


def _edge_agreement(label: np.ndarray, decoded: np.ndarray, shift: int) -> float:
    label_edges = cv2.Canny(label, 0.5, 0.5) > 0
    image_edges = np.roll(cv2.Canny(decoded.astype(np.uint8), 0.5, 0.5), shift, axis=1)
    near = cv2.dilate(image_edges, np.ones((3, 3), np.uint8)) > 0
    return float(near[label_edges].mean())
