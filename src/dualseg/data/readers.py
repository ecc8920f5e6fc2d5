"""Reading images and label maps, with one clear :class:`DataError` naming the file.

``read_image`` always returns ``uint8 HxWx3`` RGB; ``read_label`` returns ``uint8 HxW`` class
indices with 255 for ignore. Inputs are converted only where the conversion is unambiguous:
grayscale -> RGB, palette -> RGB, fully opaque RGBA/LA -> RGB/L, 16-bit -> 8-bit (images, by
/257), gray-looking RGB label -> index. Anything else (transparency, float images, colour
labels read as indices, ...) is an error that says how to fix it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
from PIL import Image

from dualseg.data.presets import IGNORE_INDEX, DatasetMeta
from dualseg.errors import DataError

LABEL_FORMATS = ("index", "color")
_SIXTEEN_BIT = {"I;16", "I;16B", "I;16L", "I;16N", "I"}
_PIL_TO_RGB = {"P", "CMYK", "YCbCr", "LAB", "HSV"}


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


def _drop_opaque_alpha(path: Path, arr: np.ndarray) -> np.ndarray:
    # arr HxWx2 (LA) or HxWx4 (RGBA): the alpha channel carries no information only if opaque.
    if arr[..., -1].min() != 255:
        raise DataError(
            f"{path}: has transparent pixels (alpha < 255), so its colours are ambiguous; "
            "flatten it onto a background and save it without alpha"
        )
    return arr[..., :-1]


def read_image(path: str | Path) -> np.ndarray:
    """An image file as ``uint8 HxWx3`` RGB. Raises :class:`DataError` naming the file."""
    path = Path(path)
    im = _open(path)
    mode = im.mode
    if mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
        mode = im.mode
    elif mode in _PIL_TO_RGB:
        im, mode = im.convert("RGB"), "RGB"
    if mode == "1":
        im, mode = im.convert("L"), "L"
    arr = np.array(im)  # a writable copy: np.asarray of a PIL image is read-only
    if mode in _SIXTEEN_BIT:
        if arr.min() < 0 or arr.max() > 65535:
            raise DataError(f"{path}: 32-bit image values outside 0..65535; save it as 8-bit RGB")
        arr = ((arr.astype(np.float32) / 257.0) + 0.5).astype(np.uint8)
        mode = "L"
    if mode == "LA":
        arr, mode = _drop_opaque_alpha(path, arr)[..., 0], "L"
    elif mode == "RGBA":
        arr, mode = _drop_opaque_alpha(path, arr), "RGB"
    if mode == "L":
        return np.ascontiguousarray(np.repeat(arr[:, :, None], 3, axis=2))
    if mode == "RGB":
        return np.ascontiguousarray(arr)
    raise DataError(
        f"{path}: unsupported image mode {im.mode!r}; save it as 8-bit RGB (or grayscale) PNG/JPEG"
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
    """Map source_ignore -> 255, then require every value to be a class or 255."""
    if raw.dtype != np.uint8:
        if raw.size and (raw.min() < 0 or raw.max() > 255):
            bad = np.unique(raw[(raw < 0) | (raw > 255)])[:8].tolist()
            raise DataError(
                f"{path}: label values {bad} are neither a class of {meta.name!r} "
                f"(0..{meta.num_classes - 1}) nor ignore (255); fix the label or choose the "
                "matching preset"
            )
        raw = raw.astype(np.uint8)
    lut = meta.raw_lut()  # source_ignore -> 255; ADE20K-style reduce_zero_label
    label = lut[raw]
    counts = np.bincount(raw.ravel(), minlength=256)  # per raw value
    counts[(lut < meta.num_classes) | (lut == IGNORE_INDEX)] = 0
    if counts.any():
        bad = np.flatnonzero(counts).tolist()
        first = 1 if meta.reduce_zero_label else 0
        raise DataError(
            f"{path}: label values {bad[:8]}{' ...' if len(bad) > 8 else ''} "
            f"({int(counts.sum())} pixels) are neither a class of {meta.name!r} "
            f"({first}..{meta.num_classes - 1 + first}) nor ignore (255"
            + "".join(f", {v}" for v in meta.source_ignore)
            + "); choose the matching preset, list the value in source_ignore, or fix the label"
        )
    return label


def read_label(path: str | Path, meta: DatasetMeta, *, label_format: str = "index") -> np.ndarray:
    """A label file as ``uint8 HxW`` class indices, 255 = ignore.

    ``label_format="index"``: pixel values are class indices (``meta.source_ignore`` values map
    to 255). ``"color"``: pixels are palette colours, decoded through ``meta.palette``.
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
