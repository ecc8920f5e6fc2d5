"""Photos stored turned (an EXIF orientation tag): read upright and aligned with their label,
or refused naming the file, never silently misaligned."""

from __future__ import annotations

import numpy as np
import pytest
from datahelpers import TINY

from dualseg.data import build_dataset
from dualseg.data.check import check_dataset
from dualseg.errors import DataError


def _exif_pair(root, orientation, label_orientation=None, shape=(30, 40)):
    """A folder dataset of one pair: the image stored with EXIF ``orientation``, its label
    drawn on the stored pixels (optionally carrying ``label_orientation`` too)."""
    from PIL import Image

    rng = np.random.default_rng(6)
    (root / "images").mkdir(parents=True)
    (root / "labels").mkdir()
    image = Image.fromarray(rng.integers(0, 256, (*shape, 3), dtype=np.uint8))
    exif = image.getexif()
    exif[0x0112] = orientation
    image.save(root / "images" / "a.jpg", exif=exif)
    label = np.zeros(shape, np.uint8)
    label[: shape[0] // 2, : shape[1] // 3] = 2  # a corner block: a turn moves it
    labels = Image.fromarray(label)
    if label_orientation is not None:
        exif = labels.getexif()
        exif[0x0112] = label_orientation
        labels.save(root / "labels" / "a.png", exif=exif)
    else:
        labels.save(root / "labels" / "a.png")
    return root / "images" / "a.jpg", label


@pytest.mark.parametrize("orientation", [3, 2, 6])
def test_an_exif_orientation_the_label_lacks_is_refused(tmp_path, orientation):
    """The image is read upright, its label as stored: 180 degrees or a mirror keep the size,
    so this was silently misaligned; now loading and data check name the image file."""
    img_path, _ = _exif_pair(tmp_path, orientation)
    ds = build_dataset(tmp_path, preset=TINY)
    expected = f"its EXIF orientation {orientation} would .* relative to its label"
    with pytest.raises(DataError, match=expected) as err:
        ds[0]
    assert str(err.value).startswith(str(img_path)) and "which has none" in str(err.value)
    report = check_dataset(tmp_path, preset=TINY)
    assert [p for p in report.problems if "EXIF orientation" in p] == [str(err.value)]


def test_a_label_drawn_on_the_upright_photo_is_read_as_drawn(tmp_path):
    """Labelling tools draw on the photo as shown: a tag-less label of the upright image's
    size (orientation 6 turns 30x40 into 40x30) is aligned with the image as read."""
    from PIL import Image

    _exif_pair(tmp_path, 6)
    upright = np.zeros((40, 30), np.uint8)
    upright[:20, :10] = 2
    Image.fromarray(upright).save(tmp_path / "labels" / "a.png")
    image, label = build_dataset(tmp_path, preset=TINY).load_pair(0)
    assert image.shape[:2] == (40, 30) and np.array_equal(label, upright)
    assert not [p for p in check_dataset(tmp_path, preset=TINY).problems if "EXIF" in p]


def test_a_label_with_its_images_exif_orientation_is_turned_alike(tmp_path):
    _exif_pair(tmp_path / "same", 3, label_orientation=3)
    _, label = build_dataset(tmp_path / "same", preset=TINY).load_pair(0)
    _, stored = _exif_pair(tmp_path / "stored", 1)
    assert np.array_equal(label, stored[::-1, ::-1])  # turned 180 degrees, as its image
    report = check_dataset(tmp_path / "same", preset=TINY)
    assert report.problems == [report.absent_classes]  # classes 1 and 3: no EXIF problem
    _exif_pair(tmp_path / "other", 3, label_orientation=6)
    with pytest.raises(DataError, match=r"orientation 3 .* \(which has orientation 6\)"):
        build_dataset(tmp_path / "other", preset=TINY).load_pair(0)
    _exif_pair(tmp_path / "label_only", 1, label_orientation=3)
    with pytest.raises(DataError, match=r"labels/a\.png: its EXIF orientation 3 .* has none"):
        build_dataset(tmp_path / "label_only", preset=TINY).load_pair(0)
