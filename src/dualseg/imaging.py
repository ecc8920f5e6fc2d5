"""Image arrays without torch: the image policy (:func:`image_to_rgb`: EXIF orientation
applied, opaque alpha dropped, transparency refused, every mode to 8-bit RGB, 16-bit images
scaled by their real range), RGB conversion and input normalization."""

from __future__ import annotations

import hashlib
import io
import os
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cv2
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from dualseg.errors import DataError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SIXTEEN_BIT_MODES = {"I;16", "I;16B", "I;16L", "I;16N", "I"}
# Raster formats accepted from uploads: Pillow's other openers (EPS, PDF, ...) may run programs.
UPLOAD_FORMATS = ("PNG", "JPEG", "BMP", "TIFF", "WEBP", "GIF", "PPM")
_LIMIT_LOCK = threading.Lock()


class ImageTooLargeError(DataError):
    """An image has more pixels than the caller's limit (checked from its header)."""


def pillow_max_pixels() -> int:
    """Pillow's decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``; 0: off), read, never set."""
    return int(Image.MAX_IMAGE_PIXELS or 0)


def open_image(
    path: str | Path, *, max_megapixels: float | None = None, decode: bool = True
) -> Image.Image:
    """A PIL image of ``path``, decoded unless ``decode`` is False (its header alone, checked);
    ``max_megapixels`` replaces Pillow's pixel limit."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found; check the path (or the list file naming it)")
    return _load(path, str(path), max_megapixels=max_megapixels, decode=decode)


def _load(
    fp: Path | io.BytesIO,
    source: str,
    *,
    max_megapixels: float | None,
    formats: Sequence[str] | None = None,
    decode: bool = True,
) -> Image.Image:
    """Open and decode a file or upload bytes; every failure a one-line DataError."""
    said = f"{source}:" if isinstance(fp, Path) else f"{source} is"
    lift = isinstance(fp, Path) and bool(max_megapixels)  # an upload's limit stays within Pillow's
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            if lift:  # Pillow's limit is process-wide: lifted for this header alone
                with _LIMIT_LOCK:
                    before, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
                    try:
                        im = Image.open(fp, formats=formats)
                    finally:
                        Image.MAX_IMAGE_PIXELS = before
            else:
                im = Image.open(fp, formats=formats)
            w, h = im.size
            if max_megapixels is not None and w * h > max_megapixels * 1e6:
                raise ImageTooLargeError(
                    f"{said} {w}x{h} = {w * h / 1e6:.1f} megapixels, over the limit of "
                    f"{max_megapixels:g} megapixels (--max-megapixels); raise it or downscale it"
                )
            _scale_low_bit_key(im)
            if decode:
                im.load()  # truncated / corrupt files fail here, not later
    except DataError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ImageTooLargeError(
            f"{said} over Pillow's decompression-bomb limit of {pillow_max_pixels() / 1e6:.1f} "
            "megapixels; pass --max-megapixels N to read it (or downscale it)"
        ) from err
    except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, ...
        if isinstance(err, UnidentifiedImageError) and formats:  # its text: a BytesIO's repr
            raise DataError(f"{said} not an image of {', '.join(formats)}") from err
        raise DataError(f"{said} an unreadable or truncated image ({err}); replace it") from err
    if (frames := int(getattr(im, "n_frames", 1) or 1)) > 1:  # else the first, silently
        raise DataError(f"{source}: has {frames} frames (pages); save the one to segment alone")
    return im


def drop_opaque_alpha(array: np.ndarray, source: str | Path) -> np.ndarray:
    """``array`` without its last (alpha) channel; transparent pixels raise DataError."""
    kind = array.dtype
    opaque = 1.0 if kind.kind == "f" else float(np.iinfo(kind).max) if kind.kind == "u" else 255.0
    if array.size and array[..., -1].min() < opaque:
        raise DataError(
            f"{source}: has transparent pixels (alpha < {opaque:g}), so the colour under them is "
            "undefined; flatten it onto a background (or save it without alpha)"
        )
    return array[..., :-1]


def read_image(
    path: str | Path, *, bit_depth: int | None = None, max_megapixels: float | None = None
) -> np.ndarray:
    """An image file as ``uint8 HxWx3`` RGB (the image policy)."""
    im = open_image(path, max_megapixels=max_megapixels)
    return image_to_rgb(im, Path(path), bit_depth=bit_depth)


def decode_image(
    data: bytes,
    *,
    source: str = "the upload",
    max_pixels: float | None = None,
    bit_depth: int | None = None,
) -> np.ndarray:
    """Upload bytes (one of :data:`UPLOAD_FORMATS`) as ``uint8 HxWx3`` RGB (``bit_depth``: of
    16-bit images; None: detected)."""
    if not data:
        raise DataError(f"{source} is empty; choose an image file")
    limit = None if max_pixels is None else max_pixels / 1e6
    im = _load(io.BytesIO(data), source, max_megapixels=limit, formats=UPLOAD_FORMATS)
    return image_to_rgb(im, source, bit_depth=bit_depth)


def exif_orientation(im: Image.Image, source: str | Path) -> int:
    """The EXIF orientation (2..8) :func:`image_to_rgb` applies, or 1 when none."""
    try:
        value = im.getexif().get(0x0112, 1)
    except Exception as err:  # a malformed EXIF block: Pillow raises various types
        raise DataError(f"{source}: unreadable EXIF orientation ({err}); re-save it") from err
    return value if isinstance(value, int) and 2 <= value <= 8 else 1


def _scale_low_bit_key(im: Image.Image) -> None:
    """Scale a 2/4-bit grayscale PNG's tRNS key as Pillow scales its pixels (it forgets the
    depth once decoded, and the unscaled key would match no pixel)."""
    rawmode = im.tile[0].args if im.format == "PNG" and im.tile else None
    key = im.info.get("transparency")
    if isinstance(rawmode, str) and rawmode in ("L;2", "L;4") and isinstance(key, int):
        im.info["transparency"] = key * (255 // (2 ** int(rawmode[2]) - 1))


def image_to_rgb(
    im: Image.Image, source: str | Path, *, bit_depth: int | None = None
) -> np.ndarray:
    """The image policy: a PIL image as ``uint8 HxWx3`` RGB; errors name ``source``."""
    _scale_low_bit_key(im)  # a PIL image the caller opened and has not decoded yet
    try:
        im.load()
        im = ImageOps.exif_transpose(im)
    except Exception as err:
        raise DataError(
            f"{source}: unreadable, truncated or closed image, or unreadable EXIF orientation "
            f"({err}); re-save it (without EXIF) or replace it"
        ) from err
    key = im.info.get("transparency")
    has_key = key is not None
    # a colour key on the 8-bit pixels' scale (a 16-bit PNG's is not) makes keyed pixels alpha 0
    keys = key if isinstance(key, tuple) else (key,)
    fits = all(isinstance(v, int) and 0 <= v <= 255 for v in keys)
    fits = fits and im.info.get("bits") in (None, 8)
    if im.mode == "P":
        im = im.convert("RGBA" if has_key else "RGB")
    elif has_key and im.mode in ("L", "RGB") and fits:
        im = im.convert("LA" if im.mode == "L" else "RGBA")
    elif has_key:  # a key Pillow cannot match against the pixels it returns
        raise DataError(
            f"{source}: has a transparency colour key (PNG tRNS) at {im.mode} that cannot be "
            "read reliably; flatten it onto a background and save it as 8-bit RGB"
        )
    elif im.mode in {"CMYK", "YCbCr", "LAB", "HSV", "PA"}:
        im = im.convert("RGBA" if im.mode == "PA" else "RGB")
    elif im.mode == "1":
        im = im.convert("L")
    mode, arr = im.mode, np.array(im)  # a writable copy
    if mode in SIXTEEN_BIT_MODES:
        arr, mode = wide_to_8_bit(arr, source, mode, bit_depth), "L"
    if mode in ("LA", "RGBA"):
        arr, mode = drop_opaque_alpha(arr, source), mode[:-1]
    if mode == "L":
        return np.ascontiguousarray(np.repeat(arr.reshape(*arr.shape[:2], 1), 3, axis=2))
    if mode == "RGB":
        return np.ascontiguousarray(arr)
    raise DataError(
        f"{source}: unsupported image mode {im.mode!r}; save it as 8-bit RGB (or grayscale) "
        "PNG/JPEG"
    )


def wide_depth(arr: np.ndarray, bit_depth: int | None = None) -> int:
    """The bits a 16-bit image uses: ``bit_depth``, else 12 when every value <= 4095, else 16."""
    if bit_depth is not None:
        return bit_depth
    return 12 if arr.size and arr.max() <= 4095 else 16


def wide_to_8_bit(
    arr: np.ndarray, source: str | Path, mode: str, bit_depth: int | None
) -> np.ndarray:
    """A 16-bit (or ``I``) grey array as uint8, scaled by its real range (:func:`wide_depth`)."""
    if arr.size and (arr.min() < 0 or arr.max() > 65535):
        raise DataError(f"{source}: 32-bit image values outside 0..65535; save it as 8-bit RGB")
    if bit_depth is None and arr.size and 0 < arr.max() <= 255:  # 8-bit data or a black photo?
        raise DataError(
            f"{source}: {'32-bit integer' if mode == 'I' else '16-bit'} image whose values all "
            "lie in 0..255: 8-bit or 16-bit data is unknown; pass --bit-depth 8"
        )
    top = 2 ** wide_depth(arr, bit_depth) - 1
    if arr.size and arr.max() > top:
        raise DataError(
            f"{source}: values up to {int(arr.max())} exceed --bit-depth {bit_depth} "
            f"(at most {top}); pass the image's real bit depth"
        )
    return (arr.astype(np.float32) * (255.0 / top) + 0.5).astype(np.uint8)


def numpy_to_rgb(a: np.ndarray) -> np.ndarray:
    """``HxW``/``HxWx1``/``HxWx3``/opaque ``HxWx4``, uint8 or float in [0, 1] -> uint8 ``HxWx3``."""
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if a.ndim == 2:
        a = np.repeat(a[:, :, None], 3, axis=2)
    if a.ndim != 3 or a.shape[2] not in (3, 4):
        raise DataError(f"expected an HxWx3 RGB image array, got shape {a.shape}")
    if a.shape[2] == 4:
        a = drop_opaque_alpha(a, "the image array")
    if np.issubdtype(a.dtype, np.floating):
        if a.size and not np.isfinite(a).all():
            raise DataError("the image array holds NaN or inf values; pass RGB in [0, 1] or uint8")
        if a.size and (a.min() < -1e-3 or a.max() > 1 + 1e-3):
            raise DataError("float image arrays must hold RGB values in [0, 1]; or pass uint8")
        a = np.round(np.clip(a, 0.0, 1.0) * 255)
    elif a.dtype != np.uint8:
        raise DataError(f"image arrays must be uint8 (or float in [0, 1]), got {a.dtype}")
    if a.shape[0] == 0 or a.shape[1] == 0:
        raise DataError(f"empty image of shape {a.shape}")
    return np.ascontiguousarray(a, dtype=np.uint8)


def as_rgb(image: Any) -> np.ndarray:
    """uint8 ``HxWx3`` from a numpy array, a PIL image or a file path (torch-free)."""
    if isinstance(image, np.ndarray):
        return numpy_to_rgb(image)
    if isinstance(image, str | os.PathLike):
        return read_image(image)
    if isinstance(image, Image.Image):
        return image_to_rgb(image, "the PIL image")
    raise DataError(
        f"cannot segment a {type(image).__name__}: pass a file path, a PIL image, an HxWx3 "
        "uint8 numpy array or a [3,H,W] tensor"
    )


def rgb_digest(rgb: np.ndarray) -> str:
    """SHA-1 of a decoded picture's size and pixels (``predict --probs`` matches by it)."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    return hashlib.sha1(repr(rgb.shape).encode() + rgb.tobytes()).hexdigest()


def normalize(
    arrays: Sequence[np.ndarray],
    mean: Sequence[float] | np.ndarray = IMAGENET_MEAN,
    std: Sequence[float] | np.ndarray = IMAGENET_STD,
) -> np.ndarray:
    """uint8 ``HxWx3`` arrays of one size -> float32 ``[B,3,H,W]``, ``(x / 255 - mean) / std``."""
    if not all(isinstance(a, np.ndarray) and a.dtype == np.uint8 and a.shape[2:] == (3,)
               and a.ndim == 3 for a in arrays):  # fmt: skip
        raise DataError("normalize takes uint8 HxWx3 RGB arrays; read images with as_rgb")
    if len({a.shape for a in arrays}) > 1:
        raise DataError("normalize stacks arrays of one size; normalize each size apart")
    x = np.stack(arrays).astype(np.float32).transpose(0, 3, 1, 2) / 255.0
    m = np.asarray(mean, np.float32).reshape(1, -1, 1, 1)
    s = np.asarray(std, np.float32).reshape(1, -1, 1, 1)
    return (x - m) / s


def resize_bilinear(array: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Bilinear resize of ``HxWxK`` to ``(H, W)`` like ``F.interpolate(align_corners=False)``,
    64 channels per OpenCV call (it takes at most 128: ADE20K has 150 classes)."""
    if array.shape[:2] == tuple(size):
        return array
    h, w = int(size[0]), int(size[1])
    array = array if array.ndim == 3 else array[:, :, None]
    parts = [
        cv2.resize(np.ascontiguousarray(array[:, :, i : i + 64]), (w, h)).reshape(h, w, -1)
        for i in range(0, array.shape[2], 64)
    ]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=2)
