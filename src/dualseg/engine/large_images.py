"""Images over Pillow's pixel limit in slide mode, read and labelled in row bands.

Whole-image slide mode holds float logits of the whole image (15 GB at 300 megapixels);
:func:`slide_labels` holds only the rows a tile still covers. TIFFs are decoded strip by strip
or tile by tile with ``tifffile`` (``pip install 'dualseg[tiff]'``); other formats, and TIFFs
it cannot band as Pillow reads them, are decoded whole by :func:`dualseg.imaging.read_image`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dualseg import imaging
from dualseg.engine.inference import InferenceOptions, slide_rows
from dualseg.errors import DataError
from dualseg.models.base import class_labels, eval_mode

# none, LZW, Deflate, PackBits, Adobe Deflate: lossless, so tifffile and Pillow agree bit for bit
LOSSLESS = {1, 5, 8, 32773, 32946}
# (photometric, samples, extra samples) Pillow reads as L, RGB and RGBA
LAYOUTS = {(1, 1, ()), (2, 3, ()), (2, 4, (2,))}


class Rows:
    """An image decoded whole, by row band: ``rows(y0, y1)`` or ``rows[y0:y1]`` is uint8
    ``[y1-y0, W, 3]`` RGB; ``size`` is ``(H, W)``."""

    def __init__(self, rgb: np.ndarray) -> None:
        self.rgb, self.size = rgb, (int(rgb.shape[0]), int(rgb.shape[1]))

    def rows(self, y0: int, y1: int) -> np.ndarray:
        return self.rgb[y0:y1]

    def __getitem__(self, band: slice) -> np.ndarray:
        y0, y1, _ = band.indices(self.size[0])
        return self.rows(y0, y1)

    def close(self) -> None:
        pass

    def __enter__(self) -> Rows:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TiffRows(Rows):
    """A TIFF read segment by segment: a band decodes only the strips or tiles it meets."""

    def __init__(self, tif: Any, path: Path, bit_depth: int | None) -> None:
        import tifffile

        self.tif, self.page, self.path = tif, tif.pages[0], path
        _, _, h, w, self.samples = self.page.shaped
        self.size, self.cache = (h, w), {}  # cache: the segments of the last band
        self.seg_h = self.page.tilelength if self.page.is_tiled else self.page.rowsperstrip
        self.across = math.ceil(w / self.page.tilewidth) if self.page.is_tiled else 1
        self.memmap = tifffile.memmap(str(path), mode="r") if self.page.is_memmappable else None
        self.depth = None
        if self.page.bitspersample == 16:  # scaled by the whole image's range, as read_image
            hi = int(self.memmap.max()) if self.memmap is not None else max(
                int(self._decode(i)[1].max()) for i in range(len(self.page.dataoffsets))
            )  # fmt: skip
            imaging.wide_to_8_bit(np.asarray([hi]), path, "I;16", bit_depth)  # the image's errors
            self.depth = imaging.wide_depth(np.asarray([hi]), bit_depth)
        elif self.memmap is None:
            self._decode(0)  # a codec tifffile lacks fails here, so the caller decodes whole

    def _decode(self, i: int) -> tuple[tuple[int, int], np.ndarray]:
        page, fh = self.page, self.tif.filehandle
        with fh.lock:
            fh.seek(page.dataoffsets[i])
            data = fh.read(page.databytecounts[i])
        segment, (_, _, y, x, _), _ = page.decode(data, i, jpegtables=page.jpegtables)
        return (y, x), segment[0]

    def _raw(self, y0: int, y1: int) -> np.ndarray:
        w = self.size[1]
        if self.memmap is not None:
            return np.asarray(self.memmap[y0:y1]).reshape(y1 - y0, w, self.samples)
        band = np.empty((y1 - y0, w, self.samples), self.page.dtype)
        first, last = y0 // self.seg_h * self.across, ((y1 - 1) // self.seg_h + 1) * self.across
        cache = {}
        for i in range(first, last):
            try:
                cache[i] = (y, x), seg = self.cache[i] if i in self.cache else self._decode(i)
            except Exception as err:  # tifffile raises ValueError, TiffFileError, ...
                raise DataError(f"{self.path}: unreadable TIFF data ({err}); replace it") from err
            top, bottom, right = max(y0, y), min(y1, y + seg.shape[0]), min(w, x + seg.shape[1])
            band[top - y0 : bottom - y0, x:right] = seg[top - y : bottom - y, : right - x]
        self.cache = cache
        return band

    def rows(self, y0: int, y1: int) -> np.ndarray:
        raw = self._raw(y0, y1)
        if self.depth is not None:
            raw = imaging.wide_to_8_bit(raw, self.path, "I;16", self.depth)
        if self.samples == 4:
            raw = imaging.drop_opaque_alpha(raw, self.path)
        return np.ascontiguousarray(np.repeat(raw, 3, axis=2) if raw.shape[2] == 1 else raw)

    def close(self) -> None:
        self.memmap = None
        self.tif.close()


def _tiff_rows(path: Path, bit_depth: int | None) -> TiffRows | None:
    """A banded reader of a TIFF tifffile reads as Pillow does, else None."""
    try:
        import tifffile

        tif = tifffile.TiffFile(path)
    except Exception:  # no tifffile, or a file only Pillow reads: decoded whole
        return None
    page = tif.pages[0]
    layout = (page.photometric, page.samplesperpixel, tuple(page.extrasamples))
    ok = (
        page.compression in LOSSLESS
        and page.planarconfig == 1
        and layout in LAYOUTS
        and page.sampleformat == 1  # unsigned integers
        and page.bitspersample in (8, 16)
        and (page.bitspersample == 8 or page.samplesperpixel == 1)  # Pillow: 16-bit grey only
        and page.imagedepth == 1
        and all(page.databytecounts)  # empty tiles: Pillow's fill is not tifffile's
    )
    try:
        return TiffRows(tif, path, bit_depth) if ok else tif.close()
    except DataError:
        tif.close()
        raise
    except Exception:  # a codec tifffile lacks: decoded whole
        return tif.close()


def needs_bands(path: str | Path, *, max_megapixels: float | None) -> bool:
    """Whether ``path`` is over Pillow's limit and the user opted in (``max_megapixels``);
    an unreadable header is False (reading the image then says why)."""
    if not max_megapixels or not imaging.pillow_max_pixels():
        return False
    try:
        with imaging.open_image(path, max_megapixels=max_megapixels, decode=False) as im:
            return im.size[0] * im.size[1] > imaging.pillow_max_pixels()
    except DataError:
        return False


def open_rows(
    path: str | Path, *, bit_depth: int | None = None, max_megapixels: float | None = None
) -> Rows:
    """A row-band reader of ``path`` by the image policy (close it, or use ``with``): a TIFF
    tifffile decodes in segments, else the image decoded whole."""
    path, limit = Path(path), max_megapixels
    with imaging.open_image(path, max_megapixels=limit, decode=False) as im:
        tiff = im.format == "TIFF" and imaging.exif_orientation(im, path) == 1  # else rotated
    reader = _tiff_rows(path, bit_depth) if tiff else None
    return reader or Rows(imaging.read_image(path, bit_depth=bit_depth, max_megapixels=limit))


def slide_labels(
    model: nn.Module,
    reader: Rows,
    *,
    window: tuple[int, int],
    stride: tuple[int, int],
    tile_batch: int,
    device: torch.device,
    amp: bool = False,
) -> np.ndarray:
    """Label map ``[H, W]`` (uint8 up to 255 classes, else int64) of slide mode streamed in
    row bands: the same labels as ``Segmenter.predict(mode="slide")``."""
    opts = InferenceOptions("slide", window, stride, tile_batch=tile_batch)

    def rows(y0: int, y1: int) -> torch.Tensor:
        return torch.from_numpy(imaging.normalize([reader.rows(y0, y1)])).to(device)

    labels: list[np.ndarray] = []
    with torch.no_grad(), eval_mode(model):
        for mean in slide_rows(model, rows, reader.size, 1, opts, amp):
            dtype = np.uint8 if mean.shape[1] <= 255 else np.int64
            labels.append(class_labels(mean.softmax(1))[0].cpu().numpy().astype(dtype))
    return np.concatenate(labels)
