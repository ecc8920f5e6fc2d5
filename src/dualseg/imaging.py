"""Image arrays without torch: the image policy, the RGB conversion and the input
normalization, written once.

Everything that turns a user's picture into network input goes through here: dataset reading
(``dualseg.data.read_image``), the engine's ``Segmenter`` and ``BoundaryRefiner`` (torch), the
exported runtimes (numpy and onnxruntime only) and ``dualseg serve`` uploads
(:func:`decode_image`), so all of them see the same pixels. Importing this module never
imports torch.

**The image policy** (:func:`image_to_rgb`) is the one rule for every picture dualseg is given:
files (:func:`read_image`: datasets, ``dualseg predict``), uploaded bytes (:func:`decode_image`:
``dualseg serve``), PIL images and arrays passed to ``predict*`` (:func:`as_rgb`):

- the EXIF orientation is applied (as browsers, OpenCV's ``imread`` and image viewers do), so
  the result lines up with the picture as it is shown;
- an alpha channel that is fully opaque is dropped; **an image with transparent pixels is
  refused** (one line: flatten it onto a background first). dualseg never guesses the colour
  under a transparent pixel, because any background it picked would change the prediction;
- palette, grayscale, 1-bit, CMYK/YCbCr/LAB/HSV and 16-bit images become 8-bit RGB; a 16-bit
  (or 32-bit integer) image is scaled by its real range: 12-bit data (values <= 4095) by 4095,
  else 65535, or by an explicit ``bit_depth``; it is refused when all its values lie in 0..255
  (its scale is unknown then, and the wrong one gives a black picture).
"""

from __future__ import annotations

import io
import os
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from dualseg.errors import DataError

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "SIXTEEN_BIT_MODES",
    "UPLOAD_FORMATS",
    "ImageTooLargeError",
    "as_rgb",
    "decode_image",
    "drop_opaque_alpha",
    "exif_orientation",
    "image_to_rgb",
    "normalize",
    "numpy_to_rgb",
    "open_image",
    "read_image",
    "rgb_digest",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SIXTEEN_BIT_MODES = {"I;16", "I;16B", "I;16L", "I;16N", "I"}
_PIL_TO_RGB = {"P", "CMYK", "YCbCr", "LAB", "HSV"}
# Raster formats accepted from bytes (uploads): Pillow's other openers (EPS through Ghostscript,
# PDF, icons, ...) are no photos to segment, and some run external programs.
UPLOAD_FORMATS = ("PNG", "JPEG", "BMP", "TIFF", "WEBP", "GIF", "PPM")


class ImageTooLargeError(DataError):
    """An image has more pixels than the caller's limit (checked from its header)."""


def pillow_max_pixels() -> int:
    """The pixel count past which Pillow refuses an image itself (its decompression-bomb guard,
    ``PIL.Image.MAX_IMAGE_PIXELS``, a process-wide setting dualseg reads, never sets; 0: off):
    no caller's limit can reach past it."""
    return int(Image.MAX_IMAGE_PIXELS or 0)


def open_image(path: str | Path, *, max_megapixels: float | None = None) -> Image.Image:
    """A decoded PIL image of the file ``path``; :class:`DataError` naming it when missing,
    unreadable, truncated or over the pixel limit (``max_megapixels``; None: Pillow's
    decompression-bomb limit, which ``--max-megapixels`` lifts as an explicit opt-in)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found; check the path (or the list file naming it)")
    return _load(path, str(path), max_megapixels=max_megapixels)


def _load(
    fp: Path | io.BytesIO,
    source: str,
    *,
    max_megapixels: float | None,
    formats: Sequence[str] | None = None,
) -> Image.Image:
    """Open and decode ``fp`` (a file, or upload bytes in ``formats``); every failure a
    one-line :class:`DataError` naming ``source``."""
    said = f"{source}:" if isinstance(fp, Path) else f"{source} is"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            # a file's opt-in lifts Pillow's limit; an upload's limit is within it (serve)
            im = _open_header(fp, formats, lift=isinstance(fp, Path) and bool(max_megapixels))
            _refuse_larger(im, said, max_megapixels)
            _scale_low_bit_key(im)
            im.load()  # decode now: truncated / corrupt files fail here, not later
    except DataError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ImageTooLargeError(
            f"{said} over Pillow's decompression-bomb limit of "
            f"{pillow_max_pixels() / 1e6:.1f} megapixels; pass --max-megapixels N to read it "
            "(or downscale it)"
        ) from err
    except Exception as err:  # PIL raises OSError, SyntaxError, ValueError, ... for bad files
        if isinstance(err, UnidentifiedImageError) and formats:  # its text: a BytesIO's repr
            raise DataError(
                f"{said} not an image in a supported format ({', '.join(formats)}); upload one "
                "of those"
            ) from err
        raise DataError(
            f"{said} an unreadable or truncated image ({err}); re-export or replace it"
        ) from err
    single_frame(im, source)
    return im


_LIMIT_LOCK = threading.Lock()


def _open_header(
    fp: Path | io.BytesIO, formats: Sequence[str] | None, *, lift: bool
) -> Image.Image:
    """``Image.open`` (the header only); ``lift``: without Pillow's pixel limit, which the
    caller's replaces (:func:`_refuse_larger`). Pillow reads one process-wide setting: it is
    lifted for this header alone, under a lock."""
    if not lift:
        return Image.open(fp, formats=formats)
    with _LIMIT_LOCK:
        before, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        try:
            return Image.open(fp, formats=formats)
        finally:
            Image.MAX_IMAGE_PIXELS = before


def _refuse_larger(im: Image.Image, said: str, max_megapixels: float | None) -> None:
    """Refuse from the header an image over the caller's limit."""
    w, h = im.size
    if max_megapixels is not None and w * h > max_megapixels * 1e6:
        raise ImageTooLargeError(
            f"{said} {w}x{h} = {w * h / 1e6:.1f} megapixels, over the limit of "
            f"{max_megapixels:g} megapixels (--max-megapixels); raise it or downscale the image"
        )


def single_frame(im: Image.Image, source: str | Path) -> None:
    """Refuse a multi-page TIFF or an animated GIF/WebP/PNG: only its first frame would be
    read, silently."""
    frames = int(getattr(im, "n_frames", 1) or 1)
    if frames > 1:
        raise DataError(
            f"{source}: has {frames} frames (pages); dualseg reads single images: save the "
            "frame to segment as its own file"
        )


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


def read_image(
    path: str | Path, *, bit_depth: int | None = None, max_megapixels: float | None = None
) -> np.ndarray:
    """An image file as ``uint8 HxWx3`` RGB (:func:`image_to_rgb`; ``bit_depth`` and
    ``max_megapixels`` as there and in :func:`open_image`). Raises :class:`DataError` naming
    the file."""
    path = Path(path)
    im = open_image(path, max_megapixels=max_megapixels)
    return image_to_rgb(im, path, bit_depth=bit_depth)


def decode_image(
    data: bytes,
    *,
    source: str = "the upload",
    max_pixels: float | None = None,
    bit_depth: int | None = None,
) -> np.ndarray:
    """Image file bytes (an upload) as ``uint8 HxWx3`` RGB through :func:`image_to_rgb`.

    Only :data:`UPLOAD_FORMATS` are opened. ``max_pixels``: larger images raise
    :class:`ImageTooLargeError` from the header, before decoding; ``bit_depth``: of 16-bit
    images (None: detected). Other problems raise :class:`DataError` naming ``source``.
    """
    if not data:
        raise DataError(f"{source} is empty; choose an image file")
    limit = None if max_pixels is None else max_pixels / 1e6
    im = _load(io.BytesIO(data), source, max_megapixels=limit, formats=UPLOAD_FORMATS)
    return image_to_rgb(im, source, bit_depth=bit_depth)


_ORIENTATION_TAG = 0x0112


def exif_orientation(im: Image.Image, source: str | Path) -> int:
    """The EXIF orientation (2..8) that :func:`image_to_rgb` applies to ``im``, or 1 when it
    applies none (no tag, or a value Pillow's ``exif_transpose`` ignores)."""
    try:
        value = im.getexif().get(_ORIENTATION_TAG, 1)
    except Exception as err:  # a malformed EXIF block: Pillow raises various types
        raise DataError(
            f"{source}: unreadable EXIF orientation ({err}); re-save the image without EXIF"
        ) from err
    return value if isinstance(value, int) and 2 <= value <= 8 else 1


def _scale_low_bit_key(im: Image.Image) -> None:
    """Bring a 2- or 4-bit grayscale PNG's colour key (tRNS) to the scale of its pixels,
    reading the depth from the undecoded tile: Pillow scales such pixels to 0..255 (x85, x17)
    but not the key, and forgets the depth once the image is decoded, so key 1 of a 2-bit
    image would match no pixel and its transparent pixels would read as opaque."""
    rawmode = im.tile[0].args if im.format == "PNG" and im.tile else None
    key = im.info.get("transparency")
    if isinstance(rawmode, str) and rawmode in ("L;2", "L;4") and isinstance(key, int):
        im.info["transparency"] = key * (255 // (2 ** int(rawmode[2]) - 1))


def _key_fits_8_bits(im: Image.Image) -> bool:
    """Whether an L/RGB image's colour key is in the 8-bit pixels' own scale: a 16-bit PNG
    read as RGB keeps a 16-bit key (a 2- or 4-bit grayscale PNG's is scaled on opening,
    :func:`_scale_low_bit_key`)."""
    key = im.info["transparency"]
    values = key if isinstance(key, tuple) else (key,)
    if not all(isinstance(v, int) and 0 <= v <= 255 for v in values):
        return False
    bits = im.info.get("bits")  # not always set; a low-bit grayscale PNG says so in IHDR
    return bits in (None, 8)


def image_to_rgb(
    im: Image.Image, source: str | Path, *, bit_depth: int | None = None
) -> np.ndarray:
    """The image policy (module docstring): a decoded PIL image as ``uint8 HxWx3`` RGB.

    EXIF orientation applied; opaque alpha dropped, transparency refused; a 16-bit image
    scaled by its real range (:func:`wide_depth`; ``bit_depth`` says it); errors name
    ``source``.
    """
    _scale_low_bit_key(im)  # a PIL image the caller opened and has not decoded yet
    try:
        im.load()  # a caller's image: a truncated or closed one fails here, said as such
    except Exception as err:
        raise DataError(
            f"{source}: unreadable, truncated or closed image ({err}); re-open or replace it"
        ) from err
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
    elif "transparency" in im.info and mode in ("L", "RGB") and _key_fits_8_bits(im):
        # a PNG colour key (tRNS): pixels of that value are transparent, as a browser shows
        # them; as alpha, drop_opaque_alpha below refuses them when any pixel uses the key
        im = im.convert("LA" if mode == "L" else "RGBA")
        mode = im.mode
    elif "transparency" in im.info and mode != "P":
        # a key Pillow cannot match against the pixels it returns (16-bit, 1-bit grayscale,
        # a low-bit image decoded before dualseg saw it): which pixels are transparent is
        # unknown, so the image is refused
        raise DataError(
            f"{source}: has a transparency colour key (PNG tRNS) at {mode} that cannot be read "
            "reliably; flatten it onto a background (or drop the key) and save it as 8-bit RGB"
        )
    elif mode in _PIL_TO_RGB:
        im, mode = im.convert("RGB"), "RGB"
    elif mode == "PA":
        im, mode = im.convert("RGBA"), "RGBA"
    if mode == "1":
        im, mode = im.convert("L"), "L"
    arr = np.array(im)  # a writable copy: np.asarray of a PIL image is read-only
    if mode in SIXTEEN_BIT_MODES:
        arr, mode = _wide_to_8_bit(arr, source, mode, bit_depth), "L"
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


def wide_depth(arr: np.ndarray, bit_depth: int | None = None) -> int:
    """The bits a 16-bit image's values use: ``bit_depth`` when given, else 12 when every
    value is at most 4095 (microscopy and medical cameras store 12-bit data in 16-bit files;
    dividing those by 257 gives a black picture), else 16."""
    if bit_depth is not None:
        return bit_depth
    return 12 if arr.size and arr.max() <= 4095 else 16


def _wide_to_8_bit(
    arr: np.ndarray, source: str | Path, mode: str, bit_depth: int | None
) -> np.ndarray:
    if arr.size and (arr.min() < 0 or arr.max() > 65535):
        raise DataError(f"{source}: 32-bit image values outside 0..65535; save it as 8-bit RGB")
    if bit_depth is None and arr.size and 0 < arr.max() <= 255:
        # values in 0..255 say nothing of their scale: 8-bit data stored wide or a nearly
        # black 16-bit picture, and reading it the wrong way turns a photo black
        wide = "32-bit integer" if mode == "I" else "16-bit"
        raise DataError(
            f"{source}: {wide} image whose values all lie in 0..255: 8-bit or 16-bit data "
            "is unknown (read as 16-bit it is black); pass --bit-depth 8, or save it as 8-bit "
            "RGB (or grayscale)"
        )
    if bit_depth is not None and not 8 <= bit_depth <= 16:
        raise DataError(f"bit_depth {bit_depth}: give the bits per sample, 8 to 16")
    top = 2 ** wide_depth(arr, bit_depth) - 1
    if arr.size and arr.max() > top:
        raise DataError(
            f"{source}: values up to {int(arr.max())} exceed --bit-depth {bit_depth} "
            f"(at most {top}); pass the image's real bit depth"
        )
    return (arr.astype(np.float32) * (255.0 / top) + 0.5).astype(np.uint8)


def numpy_to_rgb(a: np.ndarray) -> np.ndarray:
    """``HxWx3`` (or ``HxW`` gray, ``HxWx1``, opaque ``HxWx4`` RGBA) uint8 or float in [0, 1]
    -> contiguous uint8 ``HxWx3``; a clear :class:`DataError` for anything else (transparent
    RGBA included: the image policy)."""
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if a.ndim == 2:
        a = np.repeat(a[:, :, None], 3, axis=2)
    if a.ndim != 3 or a.shape[2] not in (3, 4):
        raise DataError(f"expected an HxWx3 RGB image array, got shape {a.shape}")
    if a.shape[2] == 4:  # the image policy: opaque alpha is dropped, transparency refused
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
    """uint8 ``HxWx3`` from a numpy array, a PIL image or an image file path, through the
    image policy (torch-free). Tensors are the engine's business
    (``dualseg.engine.predict.as_rgb_array``)."""
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
    """A SHA-1 of a decoded ``HxWx3`` uint8 picture (its size and pixels): the same picture
    gives the same digest wherever its file lies (``predict --probs`` stores it, and method B
    matches saved probabilities to their image by it)."""
    import hashlib

    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    return hashlib.sha1(repr(rgb.shape).encode() + rgb.tobytes()).hexdigest()


def normalize(
    arrays: Sequence[np.ndarray],
    mean: Sequence[float] | np.ndarray = IMAGENET_MEAN,
    std: Sequence[float] | np.ndarray = IMAGENET_STD,
) -> np.ndarray:
    """uint8 ``HxWx3`` arrays of one size -> float32 ``[B,3,H,W]``, ``(x / 255 - mean) / std``.

    Anything else is refused: a float image in 0..1 would be divided by 255 once more, and a
    ``3xHxW`` array broadcast against the mean in a numpy error.
    """
    for a in arrays:
        if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3:
            what = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
            raise DataError(
                f"normalize takes uint8 HxWx3 RGB arrays, got {what}; read images with "
                "dualseg.imaging.as_rgb (any image, path or array to uint8 HxWx3)"
            )
    if len({a.shape for a in arrays}) > 1:
        raise DataError(
            f"normalize stacks arrays of one size, got {sorted({a.shape for a in arrays})}; "
            "normalize each size apart"
        )
    x = np.stack(arrays).astype(np.float32).transpose(0, 3, 1, 2) / 255.0
    m = np.asarray(mean, np.float32).reshape(1, -1, 1, 1)
    s = np.asarray(std, np.float32).reshape(1, -1, 1, 1)
    return (x - m) / s


# OpenCV's resize takes at most 128 channels in one call (cv2.error beyond): a safe chunk
CV_RESIZE_CHANNELS = 64


def resize_bilinear(array: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Bilinear resize of ``HxWxK`` (any K) to ``size = (H, W)`` with OpenCV (half-pixel
    centres, like ``F.interpolate(align_corners=False)``), in chunks of channels: a model with
    more than 128 classes (ADE20K's 150) is resized too."""
    import cv2

    if array.shape[:2] == tuple(size):
        return array
    h, w = int(size[0]), int(size[1])
    array = array if array.ndim == 3 else array[:, :, None]
    parts = [
        cv2.resize(
            np.ascontiguousarray(array[:, :, i : i + CV_RESIZE_CHANNELS]),
            (w, h),
            interpolation=cv2.INTER_LINEAR,
        ).reshape(h, w, -1)
        for i in range(0, array.shape[2], CV_RESIZE_CHANNELS)
    ]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=2)
