"""dualseg.imaging: one RGB conversion and one input normalization for torch and the runtimes."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from dualseg.engine.predict import as_rgb_array
from dualseg.errors import DataError
from dualseg.export.runners import _as_rgb
from dualseg.imaging import IMAGENET_MEAN, IMAGENET_STD, as_rgb, normalize


def test_normalize_is_the_torchvision_normalization() -> None:
    rgb = np.random.default_rng(0).integers(0, 256, (2, 9, 7, 3), dtype=np.uint8)
    x = torch.from_numpy(rgb).permute(0, 3, 1, 2).float() / 255
    expected = (x - torch.tensor(IMAGENET_MEAN)[:, None, None]) / torch.tensor(IMAGENET_STD)[
        :, None, None
    ]
    out = normalize(list(rgb))
    assert out.dtype == np.float32 and out.shape == (2, 3, 9, 7)
    np.testing.assert_allclose(out, expected.numpy(), atol=1e-6)


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((9, 7, 3), np.float32),  # 0..1 floats: divided by 255 once more, silently
        np.zeros((3, 9, 7), np.uint8),  # CHW: a numpy broadcasting error
        np.zeros((9, 7), np.uint8),
    ],
)
def test_normalize_refuses_all_but_uint8_hwc_rgb(bad) -> None:
    with pytest.raises(DataError, match="normalize takes uint8 HxWx3 RGB arrays"):
        normalize([bad])
    with pytest.raises(DataError, match="arrays of one size"):
        normalize([np.zeros((9, 7, 3), np.uint8), np.zeros((7, 9, 3), np.uint8)])


def test_engine_and_runtime_see_the_same_pixels(tmp_path) -> None:
    rng = np.random.default_rng(1)
    rgba = rng.integers(0, 256, (5, 6, 4), dtype=np.uint8)
    rgba[:, :, 3] = 255  # opaque: the image policy drops the alpha channel
    gray_float = rng.random((5, 6))
    path = tmp_path / "x.png"
    Image.fromarray(rgba[:, :, :3]).save(path)
    for image in (rgba, gray_float, Image.fromarray(rgba[:, :, :3]), path):
        np.testing.assert_array_equal(as_rgb_array(image), _as_rgb(image))
    tensor = torch.from_numpy(rgba[:, :, :3]).permute(2, 0, 1).float() / 255
    np.testing.assert_array_equal(_as_rgb(tensor), rgba[:, :, :3])
    transparent = rgba.copy()
    transparent[0, 0, 3] = 0  # the image policy refuses transparency, in both
    for bad in (np.zeros((4, 4, 3), np.int32), np.full((4, 4, 3), 2.0), transparent, object()):
        for convert in (as_rgb_array, _as_rgb):
            with pytest.raises(DataError):
                convert(bad)


def test_imaging_never_imports_torch() -> None:
    code = "import dualseg.imaging, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_as_rgb_names_a_missing_file(tmp_path) -> None:
    with pytest.raises(DataError, match=r"nope\.png"):
        as_rgb(tmp_path / "nope.png")


def test_label_pngs_hold_every_class(tmp_path) -> None:
    """Label PNGs are 8-bit up to 256 classes and 16-bit beyond: class 300 stays 300."""
    from dualseg.io import atomic_save_image, label_png

    label = np.array([[0, 255], [256, 300]])
    atomic_save_image(tmp_path / "wide.png", label_png(label, 301))
    assert np.array_equal(np.asarray(Image.open(tmp_path / "wide.png")), label)
    assert label_png(label[:1], 256).dtype == np.uint8


def test_resize_bilinear_takes_any_channel_count_as_interpolate_does() -> None:
    """OpenCV refuses more than 128 channels in one resize: a 150-class static export
    (ADE20K) crashed on every image not at the export size."""
    import torch

    from dualseg.imaging import resize_bilinear

    rng = np.random.default_rng(0)
    scores = rng.random((6, 10, 150), dtype=np.float32)
    out = resize_bilinear(scores, (9, 25))
    ref = torch.nn.functional.interpolate(
        torch.from_numpy(scores).permute(2, 0, 1)[None], size=(9, 25), mode="bilinear"
    )[0].permute(1, 2, 0)
    assert out.shape == (9, 25, 150)
    np.testing.assert_allclose(out, ref.numpy(), atol=1e-5)
    assert resize_bilinear(scores[:, :, 0], (9, 25)).shape == (9, 25, 1)  # HxW: one channel
    assert resize_bilinear(scores, (6, 10)) is scores  # the size already: no copy


def test_a_multi_frame_file_is_refused_not_cut_to_its_first_frame(tmp_path) -> None:
    from PIL import Image

    from dualseg.errors import DataError
    from dualseg.imaging import decode_image, read_image

    pages = [Image.new("RGB", (8, 6), c) for c in ("red", "blue")]
    path = tmp_path / "two.tif"
    pages[0].save(path, save_all=True, append_images=pages[1:])
    with pytest.raises(DataError, match=r"two\.tif: has 2 frames \(pages\)"):
        read_image(path)
    with pytest.raises(DataError, match="has 2 frames"):
        decode_image(path.read_bytes(), source="two.tif")
    pages[0].save(tmp_path / "one.tif")
    assert read_image(tmp_path / "one.tif").shape == (6, 8, 3)


def test_an_oversized_file_says_downscale_and_a_closed_image_says_closed(
    tmp_path, monkeypatch
) -> None:
    from PIL import Image

    from dualseg.errors import DataError
    from dualseg.imaging import image_to_rgb, read_image

    path = tmp_path / "big.png"
    Image.new("RGB", (64, 64)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 64x64 is over twice that: an error
    with pytest.raises(DataError, match=r"big\.png: over Pillow's decompression-bomb limit.*"
                       "downscale it"):  # fmt: skip
        read_image(path)
    monkeypatch.undo()
    im = Image.open(path)
    im.close()
    with pytest.raises(DataError, match="unreadable, truncated or closed image"):
        image_to_rgb(im, "the PIL image")


def test_twelve_bit_data_in_a_16_bit_png_is_read_by_its_real_range(tmp_path) -> None:
    """Microscopy's 12-bit data in 16-bit PNGs: /257 read it as 0..16 (a black picture)."""
    import numpy as np
    from PIL import Image

    from dualseg.errors import DataError
    from dualseg.imaging import read_image

    path = tmp_path / "twelve.png"
    Image.fromarray(np.array([[0, 1000, 2048, 4095]] * 64, np.uint16)).save(path)
    assert read_image(path)[0, :, 0].tolist() == [0, 62, 128, 255]
    # an explicit depth wins: the same values as 16-bit data
    assert read_image(path, bit_depth=16)[0, :, 0].tolist() == [0, 4, 8, 16]
    narrow = tmp_path / "narrow.png"
    Image.fromarray(np.array([[0, 100, 255]] * 4, np.uint16)).save(narrow)
    assert read_image(narrow, bit_depth=8)[0, :, 0].tolist() == [0, 100, 255]
    with pytest.raises(DataError, match="exceed --bit-depth 10"):
        read_image(path, bit_depth=10)


def test_images_over_pillows_limit_are_an_explicit_opt_in(tmp_path, monkeypatch) -> None:
    from PIL import Image

    from dualseg.errors import DataError
    from dualseg.imaging import read_image

    path = tmp_path / "big.png"
    Image.new("RGB", (64, 64)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(DataError, match="pass --max-megapixels N") as err:
        read_image(path)
    assert "\n" not in str(err.value)
    assert read_image(path, max_megapixels=0.01).shape == (64, 64, 3)
    assert Image.MAX_IMAGE_PIXELS == 1000  # the process-wide setting is put back
    with pytest.raises(DataError, match=r"over the limit of 0\.001 megapixels \(--max-mega"):
        read_image(path, max_megapixels=0.001)
