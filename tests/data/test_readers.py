"""read_image / read_label: conversions where unambiguous, one clear DataError otherwise."""

from __future__ import annotations

import numpy as np
import pytest
from datahelpers import TINY, save
from PIL import Image

from dualseg.data import DatasetMeta, get_preset, read_image, read_label
from dualseg.errors import DataError

RNG = np.random.default_rng(0)
RGB = RNG.integers(0, 256, (8, 10, 3), dtype=np.uint8)


def test_rgb_and_grayscale_and_palette_images(tmp_path):
    assert np.array_equal(read_image(save(tmp_path / "rgb.png", RGB)), RGB)
    gray = RGB[..., 0]
    out = read_image(save(tmp_path / "gray.png", gray))
    assert out.shape == (8, 10, 3) and all(np.array_equal(out[..., c], gray) for c in range(3))
    pal = Image.fromarray(RGB).quantize(16)
    pal.save(tmp_path / "p.png")
    assert np.array_equal(read_image(tmp_path / "p.png"), np.asarray(pal.convert("RGB")))
    assert np.array_equal(read_image(save(tmp_path / "x.jpg", RGB)).shape, RGB.shape)


def test_opaque_alpha_is_dropped_transparent_is_an_error(tmp_path):
    rgba = np.dstack([RGB, np.full((8, 10), 255, np.uint8)])
    assert np.array_equal(read_image(save(tmp_path / "a.png", rgba)), RGB)
    rgba[0, 0, 3] = 10
    path = save(tmp_path / "t.png", rgba)
    with pytest.raises(DataError, match="transparent") as err:
        read_image(path)
    assert str(path) in str(err.value)


def test_sixteen_bit_image_scaled_to_eight_bit(tmp_path):
    values = np.array([[0, 257, 65535, 32896]], dtype=np.uint16)
    Image.fromarray(values).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode.startswith("I")
    assert read_image(tmp_path / "g16.png")[0, :, 0].tolist() == [0, 1, 255, 128]


def test_a_16_or_32_bit_image_of_8_bit_values_is_refused_not_read_black(tmp_path):
    wide = tmp_path / "wide.tif"  # what Image.fromarray(uint8_array.astype(np.int32)) saves
    Image.fromarray(RGB[..., 0].astype(np.int32)).save(wide)
    assert Image.open(wide).mode == "I"
    with pytest.raises(DataError, match="8-bit or 16-bit data is unknown") as err:
        read_image(wide)  # read as 16-bit, 0..255 / 257 is a black picture
    assert str(wide) in str(err.value)
    sixteen = tmp_path / "sixteen.tif"  # values above 255: 16-bit data, scaled as I;16 is
    Image.fromarray(np.array([[0, 257, 65535]], np.int32)).save(sixteen)
    assert read_image(sixteen)[0, :, 0].tolist() == [0, 1, 255]
    for suffix in ("png", "tif"):  # 16-bit files of 8-bit values: read black, without a word
        narrow = tmp_path / f"narrow.{suffix}"
        Image.fromarray(RGB[..., 0].astype(np.uint16)).save(narrow)
        assert Image.open(narrow).mode.startswith("I;16")
        with pytest.raises(DataError, match=r"16-bit image whose values all lie in 0\.\.255"):
            read_image(narrow)
    black = tmp_path / "black.tif"  # all 0: black whatever the scale
    Image.fromarray(np.zeros((2, 2), np.int32)).save(black)
    assert read_image(black).max() == 0


@pytest.mark.parametrize("kind", ["truncated", "not_an_image", "missing", "float_mode"])
def test_bad_images_name_the_file(tmp_path, kind):
    path = tmp_path / "bad.png"
    if kind == "truncated":
        save(path, RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8))
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif kind == "not_an_image":
        path.write_text("hello")
    elif kind == "float_mode":
        path = tmp_path / "bad.tif"
        Image.fromarray(RNG.random((4, 4)).astype(np.float32)).save(path)
    with pytest.raises(DataError) as err:
        read_image(path)
    assert str(path) in str(err.value)
    msg = str(err.value)
    expected = {"truncated": "truncated", "not_an_image": "unreadable", "missing": "not found"}
    assert expected.get(kind, "unsupported image mode") in msg


def test_index_label_maps_source_ignore_to_255(tmp_path):
    label = np.array([[0, 1, 10, 11, 255]], np.uint8)
    out = read_label(save(tmp_path / "l.png", label), get_preset("camvid"))
    assert out.dtype == np.uint8 and out.tolist() == [[0, 1, 10, 255, 255]]


def test_out_of_range_label_names_file_and_values(tmp_path):
    path = save(tmp_path / "l.png", np.array([[0, 12, 40]], np.uint8))
    with pytest.raises(DataError, match=r"\[12, 40\]") as err:
        read_label(path, get_preset("camvid"))
    assert str(path) in str(err.value) and "preset" in str(err.value)


def test_palette_mode_label_reads_indices_not_colours(tmp_path):
    # VOC's SegmentationClass PNGs: mode P whose pixel values are the class indices
    label = np.array([[0, 1, 20, 255]], np.uint8)
    im = Image.fromarray(label)
    im.putpalette([v for c in get_preset("voc").palette for v in c])
    im.save(tmp_path / "voc.png")
    assert read_label(tmp_path / "voc.png", get_preset("voc")).tolist() == label.tolist()


def test_palette_label_drawn_in_the_class_colours_at_other_indices_is_refused(tmp_path):
    """An editor's colour label saved as a palette image: its colours are CamVid's, its indices
    arbitrary. Read as indices it would be silently wrong; it is refused, and reads as colours."""
    camvid = get_preset("camvid")
    truth = np.array([[3, 3, 0, 0], [8, 8, 1, 5]], np.uint8)
    rgb = np.asarray(camvid.palette, np.uint8)[truth]
    path = tmp_path / "quantized.png"
    Image.fromarray(rgb).quantize(8).save(path)  # palette order: whatever quantize picks
    assert Image.open(path).mode == "P"
    with pytest.raises(DataError, match=r"colour-coded label; pass --label-format color"):
        read_label(path, camvid)
    assert read_label(path, camvid, label_format="color").tolist() == truth.tolist()


def test_palette_label_in_the_class_colours_with_a_stray_colour_is_refused(tmp_path):
    """One colour outside the dataset's palette (an antialiased edge) turned the check off: the
    label's indices, which mean nothing, were read as classes without a word."""
    camvid = get_preset("camvid")
    order = [5, 0, 3, 1]  # index i is drawn in class order[i]'s colour; index 2 is a stray
    colours = [camvid.palette[k] for k in order]
    colours[2] = (1, 2, 3)
    indices = np.array([[0, 0, 1, 1], [2, 3, 3, 0]], np.uint8)
    im = Image.fromarray(indices, mode="P")
    im.putpalette([v for c in colours for v in c])
    im.save(tmp_path / "stray.png")
    with pytest.raises(DataError, match=r"colour-coded label.*--label-format color.*\(1, 2, 3\)"):
        read_label(tmp_path / "stray.png", camvid)
    # a stray at an index that is no class: the fix was "map them with --label-map"
    far = Image.fromarray(np.where(indices == 2, 40, indices).astype(np.uint8), mode="P")
    far.putpalette([v for c in [*colours, *[(9, 9, 9)] * 36, (1, 2, 3)] for v in c])
    far.save(tmp_path / "far.png")
    with pytest.raises(DataError, match=r"--label-format color.*\(1, 2, 3\)") as err:
        read_label(tmp_path / "far.png", camvid)
    assert "--label-map" not in str(err.value)
    # a palette mostly of its own colours keeps its indices (two of four are CamVid's here)
    colours[1] = (4, 5, 6)
    im.putpalette([v for c in colours for v in c])
    im.save(tmp_path / "own.png")
    assert read_label(tmp_path / "own.png", camvid).tolist() == indices.tolist()


def test_an_index_label_in_the_voc_colour_map_reads_under_another_preset(tmp_path):
    """Most tools save index labels with the VOC colour map whatever the dataset: under CamVid
    a few classes' VOC colours are CamVid colours of other classes (black is its void), which
    the colour-coded check took for an editor's label and refused."""
    from dualseg.data.presets import voc_palette

    camvid = get_preset("camvid")
    for classes in ([0, 1, 2, 3, 7], [1, 3, 5, 7], [0, 1, 3, 7, 8, 10]):
        label = np.array([classes * 2], np.uint8)
        im = Image.fromarray(label, mode="P")
        im.putpalette([v for c in voc_palette(256) for v in c])
        im.save(tmp_path / "voc_map.png")
        assert read_label(tmp_path / "voc_map.png", camvid).tolist() == label.tolist()


def test_palette_label_in_grey_levels_that_are_other_classes_is_refused(tmp_path):
    """An index label re-encoded by a quantizer: grey 0, 1, 2 on screen, stored as indices
    2, 1, 0. Both readings are labels, and the indices were read silently (classes swapped)."""
    camvid = get_preset("camvid")
    truth = np.array([[0, 0, 1, 1, 2, 2]], np.uint8)
    path = tmp_path / "quantized.png"
    Image.fromarray(truth).convert("RGB").quantize(colors=8).save(path)
    im = Image.open(path)
    assert im.mode == "P" and np.asarray(im).tolist() != truth.tolist()  # reordered indices
    with pytest.raises(DataError, match=r"grey levels that are other classes.*mode L"):
        read_label(path, camvid)
    # grey levels that are no class, or the same classes, keep the indices: a mask drawn white
    # (255: ignore) or grey 128 (no class), a ramp of i * 50, white mapped to class 1
    two = DatasetMeta("bin", ("bg", "fg"), ((0, 0, 0), (255, 0, 0)))
    five = DatasetMeta("f", tuple("abcde"), tuple((i, 0, 0) for i in range(5)))
    cases = [
        ([[0, 1, 1]], [0, 255], camvid),
        ([[0, 1, 1]], [0, 128], two),
        (
            [[0, 1, 1]],
            [0, 255],
            DatasetMeta("bin", two.class_names, two.palette, label_map=((255, 1),)),
        ),
        ([[0, 1, 2, 3, 4]], [i * 50 for i in range(5)], five),
    ]
    for k, (indices, greys, meta) in enumerate(cases):
        mask = Image.fromarray(np.array(indices, np.uint8), mode="P")
        mask.putpalette([v for g in greys for v in (g, g, g)])
        mask.save(tmp_path / f"mask{k}.png")
        assert read_label(tmp_path / f"mask{k}.png", meta).tolist() == indices, k


def test_sixteen_bit_and_gray_rgb_labels_converted(tmp_path):
    Image.fromarray(np.array([[0, 3, 255]], np.uint16)).save(tmp_path / "l16.png")
    assert read_label(tmp_path / "l16.png", TINY).tolist() == [[0, 3, 255]]
    Image.fromarray(np.array([[0, 300]], np.uint16)).save(tmp_path / "big.png")
    with pytest.raises(DataError, match="300"):
        read_label(tmp_path / "big.png", TINY)
    gray_rgb = np.repeat(np.array([[1, 2]], np.uint8)[..., None], 3, axis=2)
    assert read_label(save(tmp_path / "g.png", gray_rgb), TINY).tolist() == [[1, 2]]


def test_colour_label_needs_color_format_and_decodes(tmp_path):
    idx = np.array([[0, 1, 2, 3], [3, 2, 1, 0]], np.uint8)
    rgb = np.asarray(TINY.palette, np.uint8)[idx]
    rgb[1, 3] = 0  # void colour -> ignore
    path = save(tmp_path / "c.png", rgb)
    with pytest.raises(DataError, match="label_format='color'"):
        read_label(path, TINY)
    expected = idx.copy()
    expected[1, 3] = 255
    assert np.array_equal(read_label(path, TINY, label_format="color"), expected)
    rgb[0, 0] = (1, 2, 3)
    with pytest.raises(DataError, match=r"\(1, 2, 3\)") as err:
        read_label(save(tmp_path / "u.png", rgb), TINY, label_format="color")
    assert "u.png" in str(err.value)


def test_unsupported_label_mode(tmp_path):
    path = tmp_path / "f.tif"
    Image.fromarray(np.zeros((3, 3), np.float32)).save(path)
    with pytest.raises(DataError, match="unsupported label mode") as err:
        read_label(path, TINY)
    assert str(path) in str(err.value)


def test_sixteen_bit_colour_label_is_refused_not_read_as_zeros(tmp_path):
    import cv2

    label = np.zeros((4, 6, 3), np.uint16)
    label[:, 3:] = 3  # class 3 in every channel: Pillow keeps the high byte, 0
    cv2.imwrite(str(tmp_path / "l48.png"), label)
    with pytest.raises(DataError, match="16-bit-per-channel PNG label"):
        read_label(tmp_path / "l48.png", TINY)


def test_sixteen_bit_rgb_tiff_label_is_refused_not_read_as_zeros(tmp_path):
    """Pillow reads a 48-bit RGB TIFF as 8-bit RGB (the high bytes): class 3 would read as 0."""
    import cv2

    label = np.zeros((4, 6, 3), np.uint16)
    label[:, 3:] = 3
    path = tmp_path / "l48.tif"
    cv2.imwrite(str(path), label)
    assert Image.open(path).mode == "RGB"
    with pytest.raises(DataError, match="16-bit-per-channel TIFF label") as err:
        read_label(path, TINY)
    assert str(path) in str(err.value)
    # the image of such a pair is fine: the high byte is its 8-bit value
    assert read_image(path).shape == (4, 6, 3)


def test_lossy_labels_are_refused_lossless_webp_is_read(tmp_path):
    label = np.zeros((16, 16), np.uint8)
    label[:, 8:] = 3
    jpeg = save(tmp_path / "l.jpg", label)
    with pytest.raises(DataError, match=r"lossy JPEG label.*lossless \(PNG\)") as err:
        read_label(jpeg, TINY)
    assert str(jpeg) in str(err.value)
    assert read_image(jpeg).shape == (16, 16, 3)  # JPEG images are fine
    Image.fromarray(label).convert("RGB").save(tmp_path / "lossy.webp", quality=90)
    with pytest.raises(DataError, match="lossy WEBP label"):
        read_label(tmp_path / "lossy.webp", TINY)
    Image.fromarray(label).convert("RGB").save(tmp_path / "lossless.webp", lossless=True)
    assert np.array_equal(read_label(tmp_path / "lossless.webp", TINY), label)


def _low_bit_gray_png(path, bits: int, samples: np.ndarray, key: int | None = None):
    """A 2- or 4-bit grayscale PNG (Pillow cannot write one), optionally with a tRNS key."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    h, w = samples.shape
    rows = b""
    for row in samples:
        text = "".join(format(int(v), f"0{bits}b") for v in row)
        text += "0" * (-len(text) % 8)
        rows += b"\x00" + int(text, 2).to_bytes(len(text) // 8, "big")
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, bits, 0, 0, 0, 0))
    if key is not None:
        png += chunk(b"tRNS", struct.pack(">H", key))
    path.write_bytes(png + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    return path


@pytest.mark.parametrize("bits", [2, 4])
def test_low_bit_gray_png_label_values_are_its_samples(tmp_path, bits):
    samples = np.array([[0, 1, 2, 3], [3, 2, 1, 0]])
    path = _low_bit_gray_png(tmp_path / "l.png", bits, samples)
    assert Image.open(path).mode == "L"  # Pillow reads 0, 85, 170, 255 (2-bit) ...
    # ... but a label's values are its samples, as for 1- and 16-bit labels: class 3 is no
    # ignore, class 1 no 85
    assert read_label(path, get_preset("camvid")).tolist() == samples.tolist()
    assert read_image(path)[0, :, 0].tolist() == [v * (255 // (2**bits - 1)) for v in range(4)]


@pytest.mark.parametrize("bits", [2, 4])
def test_low_bit_gray_png_colour_key_is_matched_at_the_pixels_scale(tmp_path, bits):
    from dualseg.imaging import as_rgb, decode_image

    samples = np.array([[0, 1, 1, 0], [1, 0, 0, 1]])
    used = _low_bit_gray_png(tmp_path / "used.png", bits, samples, key=1)
    for read in (
        lambda: read_image(used),
        lambda: as_rgb(Image.open(used)),  # opened by the caller, not yet decoded
        lambda: decode_image(used.read_bytes(), source="upload"),
    ):
        with pytest.raises(DataError, match="transparent pixels"):
            read()  # the key's pixels are transparent (a browser shows them so)
    unused = _low_bit_gray_png(tmp_path / "unused.png", bits, samples, key=2)
    scale = 255 // (2**bits - 1)
    assert read_image(unused)[0, :, 0].tolist() == [0, scale, scale, 0]
