"""Reading images and label maps, with one clear :class:`DataError` naming the file.

``read_image`` always returns ``uint8 HxWx3`` RGB; ``read_label`` returns ``uint8 HxW`` class
indices with 255 for ignore. Inputs are converted only where the conversion is unambiguous:
grayscale -> RGB, palette -> RGB, fully opaque RGBA/LA -> RGB/L, 16-bit -> 8-bit (images, by
/257), gray-looking RGB label -> index. Anything else (transparency, float images, colour
labels read as indices, ...) is an error that says how to fix it.

**The image policy** (:func:`image_to_rgb`) is the one rule for every picture dualseg is given:
files (``read_image``: datasets, ``dualseg predict``), uploaded bytes (:func:`decode_image`:
``dualseg serve``), PIL images and arrays passed to ``Segmenter.predict*``:

- the EXIF orientation is applied (as browsers, OpenCV's ``imread`` and image viewers do), so
  the result lines up with the picture as it is shown;
- an alpha channel that is fully opaque is dropped; **an image with transparent pixels is
  refused** (one line: flatten it onto a background first). dualseg never guesses the colour
  under a transparent pixel, because any background it picked would change the prediction;
- palette, grayscale, 1-bit, CMYK/YCbCr/LAB/HSV and 16-bit images become 8-bit RGB.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from dualseg.data.presets import IGNORE_INDEX, DatasetMeta
from dualseg.errors import DataError

LABEL_FORMATS = ("index", "color")
_SIXTEEN_BIT = {"I;16", "I;16B", "I;16L", "I;16N", "I"}
_PIL_TO_RGB = {"P", "CMYK", "YCbCr", "LAB", "HSV"}
# Raster formats accepted from bytes (uploads): Pillow's other openers (EPS through Ghostscript,
# PDF, icons, ...) are no photos to segment, and some run external programs.
UPLOAD_FORMATS = ("PNG", "JPEG", "BMP", "TIFF", "WEBP", "GIF", "PPM")


class ImageTooLargeError(DataError):
    """An image has more pixels than the caller's limit (checked from its header)."""


def _open(path: Path) -> Image.Image:
    if not path.is_file():
        raise DataError(f"{path}: file not found; check the path (or the list file naming it)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(path)
            im.load()  # decode now: truncated / corrupt files fail here, not later
    except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, ... for bad files
        raise DataError(
            f"{path}: unreadable or truncated image ({err}); re-export or replace the file"
        ) from err
    return im


def drop_opaque_alpha(array: np.ndarray, source: str | Path) -> np.ndarray:
    """``HxWx2`` (LA) / ``HxWx4`` (RGBA) -> without its alpha channel, if every pixel is opaque.

    Part of the image policy (module docstring): transparent pixels raise :class:`DataError`
    naming ``source``. Opaque is 1.0 for float arrays, the maximum of an unsigned dtype (255
    for uint8), else 255.
    """
    if np.issubdtype(array.dtype, np.floating):
        opaque: float = 1.0
    elif np.issubdtype(array.dtype, np.unsignedinteger):
        opaque = float(np.iinfo(array.dtype).max)
    else:
        opaque = 255.0
    if array.size and array[..., -1].min() < opaque:
        raise DataError(
            f"{source}: has transparent pixels (alpha < {opaque:g}), so the colour under them is "
            "undefined; flatten it onto a background (or save it without alpha) and try again"
        )
    return array[..., :-1]


def _drop_opaque_alpha(path: Path, arr: np.ndarray) -> np.ndarray:  # label reading's spelling
    return drop_opaque_alpha(arr, path)


def read_image(path: str | Path) -> np.ndarray:
    """An image file as ``uint8 HxWx3`` RGB (:func:`image_to_rgb`). Raises :class:`DataError`
    naming the file."""
    path = Path(path)
    return image_to_rgb(_open(path), path)


def decode_image(
    data: bytes, *, source: str = "the upload", max_pixels: float | None = None
) -> np.ndarray:
    """Image file bytes (an upload) as ``uint8 HxWx3`` RGB through :func:`image_to_rgb`.

    Only :data:`UPLOAD_FORMATS` are opened. ``max_pixels``: larger images raise
    :class:`ImageTooLargeError` from the header, before decoding. Other problems raise
    :class:`DataError` naming ``source``.
    """
    if not data:
        raise DataError(f"{source} is empty; choose an image file")
    formats = ", ".join(UPLOAD_FORMATS)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=UPLOAD_FORMATS)  # reads the header only
            w, h = im.size
            if max_pixels is not None and w * h > max_pixels:
                raise ImageTooLargeError(
                    f"{source} ({w}x{h} = {w * h / 1e6:.1f} megapixels) is over the limit of "
                    f"{max_pixels / 1e6:g} megapixels; downscale it"
                )
            im.load()
    except DataError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ImageTooLargeError(f"{source}: {err}") from err
    except UnidentifiedImageError as err:  # its message is the repr of the BytesIO: not shown
        raise DataError(
            f"{source} is not an image in a supported format ({formats}); upload one of those"
        ) from err
    except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, ... for bad data
        raise DataError(
            f"{source} is an unreadable or truncated image ({err}); re-export or replace it"
        ) from err
    return image_to_rgb(im, source)


def image_to_rgb(im: Image.Image, source: str | Path) -> np.ndarray:
    """The image policy (module docstring): a decoded PIL image as ``uint8 HxWx3`` RGB.

    EXIF orientation applied; opaque alpha dropped, transparency refused; errors name
    ``source``.
    """
    try:
        im = ImageOps.exif_transpose(im)
    except Exception as err:  # a malformed EXIF block: Pillow raises various types
        raise DataError(
            f"{source}: unreadable EXIF orientation ({err}); re-save the image without EXIF"
        ) from err
    mode = im.mode
    if mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
        mode = im.mode
    elif mode in _PIL_TO_RGB:
        im, mode = im.convert("RGB"), "RGB"
    elif mode == "PA":
        im, mode = im.convert("RGBA"), "RGBA"
    if mode == "1":
        im, mode = im.convert("L"), "L"
    arr = np.array(im)  # a writable copy: np.asarray of a PIL image is read-only
    if mode in _SIXTEEN_BIT:
        if arr.min() < 0 or arr.max() > 65535:
            raise DataError(f"{source}: 32-bit image values outside 0..65535; save it as 8-bit RGB")
        arr = ((arr.astype(np.float32) / 257.0) + 0.5).astype(np.uint8)
        mode = "L"
    if mode == "LA":
        arr, mode = drop_opaque_alpha(arr, source)[..., 0], "L"
    elif mode == "RGBA":
        arr, mode = drop_opaque_alpha(arr, source), "RGB"
    if mode == "L":
        return np.ascontiguousarray(np.repeat(arr[:, :, None], 3, axis=2))
    if mode == "RGB":
        return np.ascontiguousarray(arr)
    raise DataError(
        f"{source}: unsupported image mode {im.mode!r}; save it as 8-bit RGB (or grayscale) "
        "PNG/JPEG"
    )


def _label_array(path: Path, im: Image.Image) -> np.ndarray:
    """Raw label values (any integer dtype, HxW) from an index-coded label image."""
    mode = im.mode
    if mode in {"L", "P"}:  # P: the pixel values are the indices (VOC), not the colours
        return np.asarray(im)
    if mode == "1":
        return np.asarray(im).astype(np.uint8)
    if mode in _SIXTEEN_BIT:
        return np.asarray(im).astype(np.int64)
    if mode in {"LA", "RGB", "RGBA"}:
        arr = np.asarray(im)
        if mode != "RGB":
            arr = _drop_opaque_alpha(path, arr)
        if arr.shape[2] == 1:
            return arr[..., 0]
        if np.array_equal(arr[..., 0], arr[..., 1]) and np.array_equal(arr[..., 0], arr[..., 2]):
            return arr[..., 0]  # a gray-looking RGB label: the channels agree, so unambiguous
        raise DataError(
            f"{path}: this label is a colour image, not an index map; pass "
            "label_format='color' (CLI: --label-format color) to decode it through the palette"
        )
    raise DataError(
        f"{path}: unsupported label mode {mode!r}; save labels as 8-bit single-channel PNG "
        "holding class indices"
    )


def decode_color_label(rgb: np.ndarray, meta: DatasetMeta, *, path: str | Path = "") -> np.ndarray:
    """HxWx3 uint8 colour label -> HxW uint8 indices through ``meta.palette`` (vectorized).

    ``meta.void_colors`` decode to 255; any other colour is an error naming ``path``.
    """
    colors = np.asarray(list(meta.palette) + list(meta.void_colors), dtype=np.int64)
    values = np.asarray(
        list(range(meta.num_classes)) + [IGNORE_INDEX] * len(meta.void_colors), dtype=np.uint8
    )
    keys = (colors[:, 0] << 16) | (colors[:, 1] << 8) | colors[:, 2]
    order = np.argsort(keys)
    keys, values = keys[order], values[order]
    rgb = rgb.astype(np.int64)
    pix = (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]
    pos = np.clip(np.searchsorted(keys, pix), 0, len(keys) - 1)
    known = keys[pos] == pix
    if not known.all():
        unknown = np.unique(pix[~known])
        shown = ", ".join(f"({k >> 16}, {(k >> 8) & 255}, {k & 255})" for k in unknown[:8])
        more = f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""
        raise DataError(
            f"{path}: {int((~known).sum())} label pixels have colours outside the "
            f"{meta.name!r} palette: {shown}{more}; choose the matching preset, or add these "
            "colours to the palette (or to void_colors to ignore them)"
        )
    return values[pos]


def _check_values(path: Path, raw: np.ndarray, meta: DatasetMeta) -> np.ndarray:
    """Raw values -> class ids through the dataset's mapping (:meth:`DatasetMeta.lookup_table`);
    any other value is an error."""
    first = meta.first_class_value
    if raw.dtype != np.uint8:
        if raw.size and (raw.min() < 0 or raw.max() > 255):
            bad = np.unique(raw[(raw < 0) | (raw > 255)])[:8].tolist()
            raise DataError(
                f"{path}: label values {bad} are neither a class of {meta.name!r} "
                f"({first}..{first + meta.num_classes - 1}) nor ignore "
                f"({meta.describe_ignore()}); fix the label or choose the matching preset"
            )
        raw = raw.astype(np.uint8)
    mapped = meta.lookup_table()[raw]
    invalid = mapped < 0
    if invalid.any():
        counts = np.bincount(raw[invalid].ravel(), minlength=256)
        bad = np.flatnonzero(counts).tolist()
        raise DataError(
            f"{path}: label values {bad[:8]}{' ...' if len(bad) > 8 else ''} "
            f"({int(counts.sum())} pixels) are neither a class of {meta.name!r} "
            f"({first}..{first + meta.num_classes - 1}) nor ignore ({meta.describe_ignore()}); "
            "choose the matching preset, map them with --label-map RAW:CLASS (meta.json: "
            '"label_map"), or fix the label'
        )
    return mapped.astype(np.uint8)


def read_label(path: str | Path, meta: DatasetMeta, *, label_format: str = "index") -> np.ndarray:
    """A label file as ``uint8 HxW`` class indices, 255 = ignore.

    ``label_format="index"``: pixel values are raw values, mapped to classes / 255 by the
    dataset's lookup table (:meth:`DatasetMeta.lookup_table`). ``"color"``: pixels are palette
    colours, decoded through ``meta.palette``.
    """
    if label_format not in LABEL_FORMATS:
        raise DataError(f"unknown label_format {label_format!r}; use one of {LABEL_FORMATS}")
    path = Path(path)
    im = _open(path)
    if label_format == "index":
        return _check_values(path, _label_array(path, im), meta)
    if im.mode not in {"RGB", "RGBA", "P", "L"}:
        raise DataError(
            f"{path}: unsupported mode {im.mode!r} for a colour label; save it as 8-bit RGB PNG"
        )
    if im.mode != "RGB":
        im = im.convert("RGBA" if im.mode == "RGBA" or "transparency" in im.info else "RGB")
    arr = np.asarray(im)
    if arr.shape[2] == 4:
        arr = _drop_opaque_alpha(path, arr)
    return decode_color_label(arr, meta, path=path)
