"""Pictures of segmentations: colourized label maps, overlays, panels, curves.

Images are ``HxWx3`` (or ``HxW``) uint8, label maps ``HxW`` integers with 255 = ignore (arrays
or tensors); files are written atomically; figures use matplotlib's Agg canvas, not pyplot.

>>> palette = [(128, 64, 128), (70, 70, 70)]
>>> colorize(np.array([[0, 1, 255]]), palette).tolist()
[[[128, 64, 128], [70, 70, 70], [0, 0, 0]]]
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from dualseg.imaging import IMAGENET_MEAN, IMAGENET_STD
from dualseg.io import atomic_save_image, atomic_write_bytes

Palette = Sequence[Sequence[int]]

IGNORE_INDEX = 255
TITLE_HEIGHT = 20  # px of the title strip above each panel tile
GAP = 4  # px of white between tiles
CHANGED_COLOR = (255, 0, 255)  # magenta: pixels method B changed (as on the serve page)


def default_palette(n: int) -> list[tuple[int, int, int]]:
    """Distinct-enough colours for ``n`` classes when no palette is stored."""
    return [((37 * i) % 256, (97 * i) % 256, (173 * i) % 256) for i in range(n)]


def _numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def colorize(label: Any, palette: Palette) -> np.ndarray:
    """Label map ``HxW`` -> ``HxWx3`` uint8 RGB, class ``k`` -> ``palette[k]``, ignore -> black."""
    lab = _numpy(label)
    if lab.ndim != 2 or not np.issubdtype(lab.dtype, np.integer):
        raise ValueError(f"label must be an integer HxW map, got {lab.dtype} {lab.shape}")
    lab = lab.astype(np.int64)
    bad = (lab != IGNORE_INDEX) & ((lab < 0) | (lab >= len(palette)))
    if bad.any():
        raise ValueError(
            f"label values {np.unique(lab[bad])[:10].tolist()} have no palette "
            f"colour ({len(palette)} colours) and are not the ignore index"
        )
    values = np.asarray(palette, dtype=np.float64).reshape(-1, 3)
    if values.size and (values.min() < 0 or values.max() > 255 or (values % 1).any()):
        raise ValueError(
            "palette colours must be integer RGB triples in [0, 255], got fractions "
            "or values outside; a palette in 0..1: multiply by 255 and round"
        )
    lut = np.concatenate([values, np.zeros((1, 3))]).astype(np.uint8)  # black for ignore
    return lut[np.where(lab == IGNORE_INDEX, len(palette), lab)]


def _rgb(image: Any) -> np.ndarray:
    img = _numpy(image)
    if img.dtype != np.uint8:
        fix = (
            "a label map? colourize it first with dualseg.viz.colorize"
            if img.ndim == 2 and np.issubdtype(img.dtype, np.integer)
            else "dualseg.viz.denormalize a normalized tensor, or convert a 0..1 float image"
        )
        raise TypeError(f"image must be uint8 (got {img.dtype} {img.shape}); {fix}")
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    if img.ndim != 3 or img.shape[2] not in (3, 4):
        raise ValueError(f"image must be HxW, HxWx3 or HxWx4, got shape {img.shape}")
    return np.ascontiguousarray(img[:, :, :3])


def overlay(image: Any, label: Any, palette: Palette, alpha: float = 0.5) -> np.ndarray:
    """``(1 - alpha) * image + alpha * colorize(label)``; ignore pixels keep the image."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    img, lab = _rgb(image), _numpy(label)
    if img.shape[:2] != lab.shape:
        raise ValueError(f"image {img.shape[:2]} and label {lab.shape} sizes differ")
    col = colorize(lab, palette).astype(np.float32)
    out = img.astype(np.float32)
    out = np.where((lab != IGNORE_INDEX)[:, :, None], (1.0 - alpha) * out + alpha * col, out)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def mark_changed(picture: Any, changed: Any, color: Sequence[int] = CHANGED_COLOR) -> np.ndarray:
    """A copy of ``picture`` with the pixels where ``changed`` is true painted ``color``."""
    img = _rgb(picture).copy()
    mask = _numpy(changed).astype(bool)
    if mask.shape != img.shape[:2]:
        raise ValueError(f"picture {img.shape[:2]} and mask {mask.shape} sizes differ")
    img[mask] = np.asarray(color, np.uint8)
    return img


def denormalize(
    image: Any, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD
) -> np.ndarray:
    """Normalized ``[3, H, W]`` float image -> ``HxWx3`` uint8 RGB (ImageNet stats default)."""
    x = _numpy(image).astype(np.float32)
    if x.ndim != 3 or x.shape[0] != len(mean):
        raise ValueError(f"expected a [{len(mean)}, H, W] image, got shape {x.shape}")
    x = x * np.asarray(std, np.float32)[:, None, None] + np.asarray(mean, np.float32)[:, None, None]
    return np.clip(np.rint(x.transpose(1, 2, 0) * 255.0), 0, 255).astype(np.uint8)


def _text_width(draw: ImageDraw.ImageDraw, text: str, font: Any) -> int:
    left, _, right, _ = draw.textbbox((0, 0), text, font=font)
    return math.ceil(right - left)


def _fit_title(draw: ImageDraw.ImageDraw, title: str, width: int) -> tuple[str, Any, int]:
    """(text, font, width): the largest font (14 to 8) that fits, else cut with an ellipsis."""
    for size in range(14, 7, -1):
        font = ImageFont.load_default(size=size)
        if (tw := _text_width(draw, title, font)) <= width:
            return title, font, tw
    while len(title) > 1 and _text_width(draw, title + "…", font) > width:
        title = title[:-1]
    return title + "…", font, _text_width(draw, title + "…", font)


def make_legend(class_names: Sequence[str], palette: Palette, *, width: int = 640) -> np.ndarray:
    """Legend strip ``hxWx3`` uint8: a swatch and a name per class, in rows of ``width`` px."""
    if len(class_names) != len(palette):
        raise ValueError(f"{len(class_names)} class names but {len(palette)} palette colours")
    swatch = 14  # px
    font = ImageFont.load_default(size=swatch - 2)
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    row_h, pad = swatch + 6, 6
    # lay out first: the strip's height depends on the rows
    items, x, row = [], pad, 0
    for name, colour in zip(class_names, palette):
        w = swatch + 4 + _text_width(probe, name, font) + 12
        if x + w > width and x > pad:
            x, row = pad, row + 1
        items.append((x, row, name, tuple(int(v) for v in colour)))
        x += w
    canvas = Image.new("RGB", (width, (row + 1) * row_h + pad), "white")
    draw = ImageDraw.Draw(canvas)
    for x, r, name, colour in items:
        y = pad // 2 + r * row_h
        draw.rectangle([x, y, x + swatch - 1, y + swatch - 1], fill=colour, outline=(0, 0, 0))
        draw.text((x + swatch + 4, y), name, fill="black", font=font)
    return np.asarray(canvas)


def make_panel(
    images: Sequence[Any],
    titles: Sequence[str],
    *,
    class_names: Sequence[str] | None = None,
    palette: Palette | None = None,
) -> np.ndarray:
    """Tiles side by side, pixel for pixel below their titles, optionally a legend below."""
    if len(images) == 0 or len(images) != len(titles):
        raise ValueError(
            f"need one title per image, got {len(images)} images, {len(titles)} titles"
        )
    tiles = [_rgb(im) for im in images]
    height = TITLE_HEIGHT + max(t.shape[0] for t in tiles)
    width = sum(t.shape[1] for t in tiles) + GAP * (len(tiles) - 1)
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    x = 0
    for tile, title in zip(tiles, titles):
        w = tile.shape[1]
        canvas.paste(Image.fromarray(tile), (x, TITLE_HEIGHT))
        text, font, tw = _fit_title(draw, title, w)
        draw.text((x + max((w - tw) // 2, 0), 2), text, fill="black", font=font)
        x += w + GAP
    panel = np.asarray(canvas)
    if class_names is not None or palette is not None:
        if class_names is None or palette is None:
            raise ValueError("a legend needs both class_names and palette")
        legend = make_legend(class_names, palette, width=width)
        panel = np.concatenate([panel, legend], axis=0)
    return panel


def save_panel(
    path: str | os.PathLike[str],
    images: Sequence[Any],
    titles: Sequence[str],
    *,
    class_names: Sequence[str] | None = None,
    palette: Palette | None = None,
) -> None:
    """Write :func:`make_panel`'s picture to ``path``, atomically."""
    atomic_save_image(path, make_panel(images, titles, class_names=class_names, palette=palette))


_X_KEYS = ("iteration", "iter", "step", "epoch")


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def save_figure(fig: Any, path: str | os.PathLike[str]) -> None:
    """Write a matplotlib figure to ``path`` as PNG, atomically."""
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())


def curves_figure(
    history: Sequence[Mapping[str, Any]],
    keys: Sequence[str | Sequence[str]],
    *,
    x_key: str | None = None,
    title: str | None = None,
    ylabels: Sequence[str | None] | None = None,
    scale: Mapping[str, float] | None = None,
    names: Mapping[str, str] | None = None,
) -> Any:
    """Training curves from ``history`` (a dict per point): a subplot per entry of ``keys``,
    a sequence of keys sharing one; x is ``x_key``, else iteration/iter/step/epoch, else the
    index; None/NaN points are skipped; ``ylabels`` per subplot, ``scale``/``names`` per key."""
    if len(keys) == 0:
        raise ValueError("save_curves needs at least one key to plot")
    groups = [[k] if isinstance(k, str) else list(k) for k in keys]
    if ylabels is not None and len(ylabels) != len(groups):
        raise ValueError(f"{len(ylabels)} y labels for {len(groups)} subplots")
    scale, names = scale or {}, names or {}
    if x_key is None:
        x_key = next((k for k in _X_KEYS if any(k in h for h in history)), None)

    fig = _figure(5.0 * len(groups), 3.6)
    axes = fig.subplots(1, len(groups), squeeze=False)[0]
    for g, (ax, group) in enumerate(zip(axes, groups)):
        plotted = 0
        for key in group:
            at = [(i if x_key is None else h.get(x_key), h.get(key)) for i, h in enumerate(history)]
            pts = [(float(x), float(v) * scale.get(key, 1.0)) for x, v in at
                   if x is not None and v is not None and math.isfinite(float(v))]  # fmt: skip
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=names.get(key, key))
                plotted += 1
        if not plotted:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set(xlabel=x_key or "point", title=", ".join(names.get(k, k) for k in group))
        ax.set_ylabel((ylabels or [""] * len(groups))[g] or "")
        ax.grid(True, alpha=0.3)
        if plotted and len(group) > 1:
            ax.legend()
    if title:
        fig.suptitle(title)
    return fig


def save_curves(
    path: str | os.PathLike[str],
    history: Sequence[Mapping[str, Any]],
    keys: Sequence[str | Sequence[str]],
    *,
    x_key: str | None = None,
    title: str | None = None,
    ylabels: Sequence[str | None] | None = None,
    scale: Mapping[str, float] | None = None,
    names: Mapping[str, str] | None = None,
) -> None:
    """Write :func:`curves_figure` (same arguments) to a PNG at ``path``, atomically."""
    fig = curves_figure(
        history, keys, x_key=x_key, title=title, ylabels=ylabels, scale=scale, names=names
    )
    save_figure(fig, path)


def confusion_matrix_figure(
    matrix: Any, class_names: Sequence[str], *, title: str | None = None
) -> Any:
    """Heat map of a confusion matrix in percent of each ground-truth row (empty rows grey)."""
    counts = _numpy(matrix).astype(np.float64)
    if counts.ndim != 2 or counts.shape[0] != counts.shape[1]:
        raise ValueError(f"a confusion matrix must be [C, C], got shape {counts.shape}")
    c = counts.shape[0]
    if len(class_names) != c:
        raise ValueError(f"{len(class_names)} class names for {c} classes")
    rows = counts.sum(1, keepdims=True)
    share = np.divide(100 * counts, rows, out=np.full_like(counts, np.nan), where=rows > 0)

    side = min(4.0 + 0.45 * c, 40.0)
    fig = _figure(side + 1.5, side)
    ax = fig.subplots()
    from matplotlib import colormaps

    cmap = colormaps["Blues"].with_extremes(bad="#dddddd")  # a copy: no global state changes
    im = ax.imshow(np.ma.masked_invalid(share), cmap=cmap, vmin=0, vmax=100)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="% of the ground-truth row")
    ticks = np.arange(c)
    font = max(4, 10 - c // 10)
    ax.set_xticks(ticks, [str(n) for n in class_names], rotation=45, ha="right", fontsize=font)
    ax.set_yticks(ticks, [str(n) for n in class_names], fontsize=font)
    ax.set(xlabel="predicted class", ylabel="ground-truth class")
    if c <= 30:
        for i, j in zip(*np.nonzero(np.nan_to_num(share) > 0)):  # empty cells stay blank
            v = share[i, j]
            ax.text(j, i, f"{v:.1f}", ha="center", va="center", fontsize=max(4, font - 2),
                    color="white" if v > 50 else "black")  # fmt: skip
    ax.set_title(title or "confusion matrix (row-normalized, %)")
    return fig


def save_confusion_matrix(
    path: str | os.PathLike[str],
    matrix: Any,
    class_names: Sequence[str],
    *,
    title: str | None = None,
) -> None:
    """Write :func:`confusion_matrix_figure` to a PNG at ``path``, atomically."""
    save_figure(confusion_matrix_figure(matrix, class_names, title=title), path)


def class_iou_figure(
    series: Mapping[str, Sequence[float | None]],
    class_names: Sequence[str],
    *,
    title: str | None = None,
) -> Any:
    """Bars of per-class IoU in percent, one per entry of ``series`` (label -> IoUs), ``n/a``
    for None / NaN."""
    if not series:
        raise ValueError("save_class_iou needs at least one series")
    c = len(class_names)
    fig = _figure(max(6.0, 0.6 * c * max(1, len(series)) ** 0.5 + 2), 4.5)
    ax = fig.subplots()
    width = 0.8 / len(series)
    x = np.arange(c)
    for k, (label, iou) in enumerate(series.items()):
        if len(iou) != c:
            raise ValueError(f"series {label!r} has {len(iou)} values for {c} classes")
        v = np.array([np.nan if a is None else float(a) for a in iou]) * 100
        pos = x + (k - (len(series) - 1) / 2) * width
        bars = ax.bar(pos, np.nan_to_num(v), width, label=label)
        ax.bar_label(bars, labels=["n/a" if np.isnan(a) else f"{a:.1f}" for a in v],
                     fontsize=6, rotation=90 if c > 12 else 0, padding=2)  # fmt: skip
    ax.set_xticks(x, [str(n) for n in class_names], rotation=45 if c > 6 else 0,
                  ha="right" if c > 6 else "center")  # fmt: skip
    ax.set(ylim=(0, 110), ylabel="IoU (%)", xlabel="class", title=title or "per-class IoU")
    if len(series) > 1:
        ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return fig


def save_class_iou(
    path: str | os.PathLike[str],
    series: Mapping[str, Sequence[float | None]],
    class_names: Sequence[str],
    *,
    title: str | None = None,
) -> None:
    """Write :func:`class_iou_figure` to a PNG at ``path``, atomically."""
    save_figure(class_iou_figure(series, class_names, title=title), path)
