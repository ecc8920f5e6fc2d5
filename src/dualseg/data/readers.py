"""Reading label maps (and image/label pairs), with one DataError naming the file.

``read_label`` returns ``uint8 HxW`` class ids, 255 = ignore. Only unambiguous conversions are
made (1-, 2-, 4- and 16-bit indices, gray-looking RGB); colour labels read as indices, lossy
files, deep colour channels and an EXIF orientation the image has and its label lacks are
errors that say the fix. Images follow the image policy of :mod:`dualseg.imaging`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from dualseg.data.presets import IGNORE_INDEX, VOC_COLOURS, DatasetMeta
from dualseg.errors import DataError
from dualseg.imaging import (
    SIXTEEN_BIT_MODES,
    drop_opaque_alpha,
    exif_orientation,
    image_to_rgb,
    open_image,
)

LABEL_FORMATS = ("index", "color")
_EIGHT_BIT_MODES = {"L", "LA", "P", "RGB", "RGBA"}


def _raw_values(path: Path, im: Image.Image) -> np.ndarray:
    """Raw label values (any integer dtype, HxW) from an index-coded label image."""
    mode = im.mode
    if mode in {"L", "P", "1", *SIXTEEN_BIT_MODES}:  # P: the indices (VOC), not the colours
        raw = np.asarray(im).astype(np.int64 if mode in SIXTEEN_BIT_MODES else np.uint8)
        if mode == "L" and (bits := _bits_per_sample(path, im)) in (2, 4):
            raw = raw // (255 // (2**bits - 1))  # Pillow scales 2/4-bit samples to 0..255
        return raw
    if mode in {"LA", "RGB", "RGBA"}:
        arr = np.asarray(im)
        arr = arr if mode == "RGB" else drop_opaque_alpha(arr, path)
        if (arr == arr[..., :1]).all():  # one channel, or a gray-looking RGB label
            return arr[..., 0]
        raise DataError(
            f"{path}: this label is a colour image, not an index map; pass "
            "label_format='color' (CLI: --label-format color) to decode it through the palette"
        )
    raise DataError(
        f"{path}: unsupported label mode {mode!r}; save labels as 8-bit single-channel PNG "
        "holding class indices"
    )


def _rgb_keys(rgb: np.ndarray) -> np.ndarray:
    rgb = np.asarray(rgb, np.int64)
    return (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]


def decode_color_label(rgb: np.ndarray, meta: DatasetMeta, *, path: str | Path = "") -> np.ndarray:
    """HxWx3 uint8 colour label -> HxW uint8 class ids (void colours: 255; others: error)."""
    meta.require_distinct_colours()
    keys = _rgb_keys([*meta.palette, *meta.void_colors])
    values = np.asarray([*range(meta.num_classes)] + [IGNORE_INDEX] * len(meta.void_colors))
    order = np.argsort(keys)
    keys, values = keys[order], values[order].astype(np.uint8)
    pix = _rgb_keys(rgb)
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
    first = int(meta.reduce_zero_label)
    mapped = np.where((raw >= 0) & (raw <= 255), meta.lookup_table()[np.clip(raw, 0, 255)], -1)
    invalid = mapped < 0
    if invalid.any():
        bad = np.unique(raw[invalid]).tolist()
        raise DataError(
            f"{path}: label values {bad[:8]}{' ...' if len(bad) > 8 else ''} "
            f"({int(invalid.sum())} pixels) are neither a class of {meta.name!r} "
            f"({first}..{first + meta.num_classes - 1}) nor ignore ({meta.describe_ignore()}); "
            "choose the matching preset, map them with --label-map RAW:CLASS (meta.json: "
            '"label_map"), or fix the label'
        )
    return mapped.astype(np.uint8)


def _check_palette_indices(
    path: Path, pal: np.ndarray, used: np.ndarray, meta: DatasetMeta
) -> None:
    """Refuse a palette label drawn mostly in the dataset's colours at other indices: an
    editor's colour-coded label, whose indices mean nothing (VOC's colour map passes)."""
    colours = [tuple(int(v) for v in pal[i]) for i in used]
    if all(c == VOC_COLOURS[i] for i, c in zip(used.tolist(), colours)):
        return
    of_class = {tuple(c): k for k, c in enumerate(meta.palette)}
    void = {tuple(c) for c in meta.void_colors}
    strays = [c for c in colours if c not in of_class and c not in void]
    if 2 * len(strays) >= len(colours):
        return  # a palette of its own: the indices are the labels
    table = meta.lookup_table()
    for i, c in zip(used.tolist(), colours):
        k = int(table[i])
        if c not in strays and 0 <= k < meta.num_classes and of_class.get(c) != k:
            fix = f" and fix its colours of no class ({', '.join(map(str, strays[:3]))})"
            raise DataError(
                f"{path}: index {i} (class {meta.class_names[k]!r}) is drawn in another "
                f"{meta.name!r} colour {c}: a colour-coded label; pass --label-format color"
                + (fix if strays else "")
            )


def _check_grey_palette(path: Path, pal: np.ndarray, used: np.ndarray, meta: DatasetMeta) -> None:
    """Refuse a palette label whose grey levels are other classes than its indices (a
    quantizer's re-encoding: both readings are valid labels)."""
    grey = pal[used, 0]
    if not (pal[used] == grey[:, None]).all() or np.array_equal(grey, used):
        return  # colours of its own, or grey levels equal to the indices: unambiguous
    table, n = meta.lookup_table(), meta.num_classes  # raw value -> class, 255 or -1
    as_index, as_grey = table[used], table[grey]
    both = (as_index >= 0) & (as_index < n) & (as_grey >= 0) & (as_grey < n)
    if both.all() and (as_grey != as_index).any():
        i = int(np.flatnonzero(as_grey != as_index)[0])
        raise DataError(
            f"{path}: a palette label drawn in grey levels that are other classes than its "
            f"indices (index {used[i]} is drawn as grey {grey[i]}); save it as 8-bit greyscale "
            "(mode L) holding the class indices"
        )


def _bits_per_sample(path: Path, im: Image.Image) -> int | None:
    """Bits per channel as stored (TIFF tag 258, PNG's IHDR), else None."""
    if im.format == "TIFF":
        bits = getattr(im, "tag_v2", {}).get(258)
        if isinstance(bits, tuple):  # one entry per channel
            return max(bits, default=None)
        return bits if isinstance(bits, int) else None
    try:
        with path.open("rb") as f:
            head = f.read(26)
    except OSError:
        return None
    png = len(head) == 26 and head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return head[24] if png else None


def _webp_is_lossy(path: Path) -> bool:
    """Whether a WebP file holds a lossy ``VP8 `` chunk (animation frames too)."""
    try:
        data = path.read_bytes()
    except OSError:
        return False

    def lossy(pos: int, end: int) -> bool:  # walk the RIFF chunks (padded to even sizes)
        while pos + 8 <= end:
            kind, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
            if kind == b"VP8 " or (kind == b"ANMF" and lossy(pos + 24, pos + 8 + size)):
                return True
            pos += 8 + size + (size & 1)
        return False

    return data[8:12] == b"WEBP" and lossy(12, len(data))


def _refuse_lossy_or_deep(path: Path, im: Image.Image) -> None:
    """Refuse labels whose values cannot be read back exactly: lossy, or deeper than 8 bits
    in a mode Pillow reads as 8-bit."""
    if im.format in {"JPEG", "MPO"} or (im.format == "WEBP" and _webp_is_lossy(path)):
        raise DataError(
            f"{path}: a lossy {im.format} label changes class ids along every edge; labels "
            "must be lossless (PNG): re-export them from the source"
        )
    bits = _bits_per_sample(path, im)
    if bits is not None and bits > 8 and im.mode in _EIGHT_BIT_MODES:
        raise DataError(
            f"{path}: a {bits}-bit-per-channel {im.format} label with {len(im.getbands())} "
            "channels reads as its high byte only; save it as an 8-bit colour PNG, or as "
            "single-channel (8- or 16-bit) class indices"
        )


def raw_label_values(path: str | Path) -> np.ndarray:
    """The distinct raw values of an index label file (sorted), before any class mapping."""
    path = Path(path)
    im = open_image(path)
    _refuse_lossy_or_deep(path, im)
    return np.unique(_raw_values(path, im))


def read_label(path: str | Path, meta: DatasetMeta, *, label_format: str = "index") -> np.ndarray:
    """A label file as ``uint8 HxW`` class ids, 255 = ignore (``"index"``: raw values through
    the dataset's lookup table; ``"color"``: palette colours). Read as stored (no EXIF turn)."""
    path = Path(path)
    return _decode_label(path, open_image(path), meta, label_format)


def _decode_label(
    path: Path, im: Image.Image, meta: DatasetMeta, label_format: str, *, turn: bool = False
) -> np.ndarray:
    """``read_label`` of an opened file; ``turn``: apply its EXIF orientation (its image's)."""
    if label_format not in LABEL_FORMATS:
        raise DataError(f"unknown label_format {label_format!r}; use one of {LABEL_FORMATS}")
    _refuse_lossy_or_deep(path, im)  # before turning: the turned copy has no format
    if turn:
        im = ImageOps.exif_transpose(im)
    if label_format == "index":
        raw = _raw_values(path, im)
        if im.mode == "P" and (flat := im.getpalette()):  # colours [N,3], the indices used
            pal = np.asarray(flat, np.int64).reshape(-1, 3)
            used = np.asarray([int(i) for i in np.unique(raw) if i < len(pal)], np.int64)
            _check_palette_indices(path, pal, used, meta)
            _check_grey_palette(path, pal, used, meta)
        return _check_values(path, raw, meta)
    if im.mode not in {"RGB", "RGBA", "P", "L"}:
        raise DataError(
            f"{path}: unsupported mode {im.mode!r} for a colour label; save it as 8-bit RGB PNG"
        )
    if im.mode != "RGB":
        im = im.convert("RGBA" if im.mode == "RGBA" or "transparency" in im.info else "RGB")
    arr = np.asarray(im)
    if arr.shape[2] == 4:
        arr = drop_opaque_alpha(arr, path)
    return decode_color_label(arr, meta, path=path)


def _orientation_mismatch(img_path: Path, turn: int, label_path: Path, label_turn: int) -> str:
    a, ta, b, tb = (label_path, label_turn, img_path, turn) if turn == 1 else (
        img_path, turn, label_path, label_turn)  # fmt: skip
    has, its = "none" if tb == 1 else f"orientation {tb}", "label" if b == label_path else "image"
    return (
        f"{a}: its EXIF orientation {ta} would turn it relative to its {its} {b} "
        f"(which has {has}); strip the tag, or give both files the same one"
    )


def inspect_pair(
    img_path: str | Path,
    label_path: str | Path,
    meta: DatasetMeta,
    *,
    label_format: str = "index",
    bit_depth: int | None = None,
    max_megapixels: float | None = None,
) -> tuple[np.ndarray | None, np.ndarray | None, list[str], tuple[str, int, int] | None]:
    """``(image, label, problems, values)``: what :func:`read_pair` reads (None for a file that
    failed), every problem found, and the image's stored ``(dtype, min, max)``.
    ``max_megapixels``: the largest image and label read (None: Pillow's limit)."""
    img_path, label_path = Path(img_path), Path(label_path)
    problems: list[str] = []
    image = label = values = None
    im: Image.Image | None = None
    turn: int | None = None
    try:
        im = open_image(img_path, max_megapixels=max_megapixels)
        turn = exif_orientation(im, img_path)
        stored = np.asarray(im)
        if stored.size:
            values = (str(stored.dtype), int(stored.min()), int(stored.max()))
        image = image_to_rgb(im, img_path, bit_depth=bit_depth)
    except DataError as err:
        problems.append(str(err))
    try:
        lab = open_image(label_path, max_megapixels=max_megapixels)
        label_turn = exif_orientation(lab, label_path)
        # a tag-less label drawn on its 90°-turned image as displayed: the upright image's size
        if (
            image is not None
            and turn in (5, 6, 7, 8)
            and label_turn == 1
            and (
                lab.size[::-1] == image.shape[:2] != im.size[::-1]  # type: ignore[union-attr]
            )
        ):
            label = _decode_label(label_path, lab, meta, label_format)
        elif turn is not None and label_turn != turn:  # they would silently not line up
            problems.append(_orientation_mismatch(img_path, turn, label_path, label_turn))
        else:  # the same tag on both: turned alike
            label = _decode_label(label_path, lab, meta, label_format, turn=label_turn != 1)
    except DataError as err:
        problems.append(str(err))
    if image is not None and label is not None and image.shape[:2] != label.shape:
        (h, w), (lh, lw) = image.shape[:2], label.shape
        problems.append(
            f"{label_path}: label size {lw}x{lh} differs from image {img_path} size {w}x{h} "
            "(WxH); resize the label with nearest-neighbour or fix the pairing"
        )
    return image, label, problems, values


def read_pair(
    img_path: str | Path,
    label_path: str | Path,
    meta: DatasetMeta,
    *,
    label_format: str = "index",
    bit_depth: int | None = None,
    max_megapixels: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """An image and its label, turned alike by their EXIF orientation; the first problem as a
    DataError (sizes that differ too)."""
    image, label, problems, _ = inspect_pair(
        img_path, label_path, meta, label_format=label_format, bit_depth=bit_depth,
        max_megapixels=max_megapixels,
    )  # fmt: skip
    if problems:
        raise DataError(problems[0])
    return image, label  # type: ignore[return-value]
