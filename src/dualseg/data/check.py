"""The dataset scan of ``dualseg data check`` and ``dualseg train``'s pre-flight check: every
pair of every split read, all problems listed, per-class pixel histograms."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dualseg.console import ProgressMode, track
from dualseg.data.datasets import (
    check_split_name,
    meta_path,
    one_class_set,
    one_class_warning,
    resolve_meta,
)
from dualseg.data.layouts import detect_any_split, discover, missing_split, unlabelled_split
from dualseg.data.presets import IGNORE_INDEX, DatasetMeta, IgnoreSetting
from dualseg.data.readers import inspect_pair
from dualseg.errors import DataError
from dualseg.imaging import wide_depth

DEFAULT_SPLITS = ("train", "val", "test")
BINARY_MASK_MIN_SHARE = 0.01  # a 0/255 mask read with 255 as ignore: 255's least pixel share


def _empty_histogram() -> np.ndarray:
    return np.zeros(256, np.int64)


@dataclass
class CheckReport:
    root: Path
    layout: str
    meta: DatasetMeta
    pairs: dict[str, int] = field(default_factory=dict)  # split -> pairs found
    problems: list[str] = field(default_factory=list)
    histogram: np.ndarray = field(default_factory=_empty_histogram)  # all splits
    split_histograms: dict[str, np.ndarray] = field(default_factory=dict)
    binary_mask: str | None = None  # "looks like a 0/255 binary mask: ..." (its fix), if so
    absent_classes: str | None = None  # the "class(es) ... have no pixels" problem, if found
    split_overlap: str | None = None  # the "split ... shares images with ..." problem, if found
    label_format: str = "index"  # how the labels were read ("color": palettes must agree)
    largest: dict[str, tuple[int, int]] = field(default_factory=dict)  # split -> max (H, W)
    folders: dict[str, str] = field(default_factory=dict)  # split -> the folders read
    values: dict[str, dict[str, Any]] = field(default_factory=dict)  # split -> image values
    collapsed: str | None = None  # "--label-map ... leaves one class": a warning

    def to_dict(self) -> dict[str, Any]:
        # "(ignore)" where a class is itself named "ignore"
        ignore = "(ignore)" if "ignore" in self.meta.class_names else "ignore"
        names = {**dict(enumerate(self.meta.class_names)), IGNORE_INDEX: ignore}
        return {
            "root": str(self.root),
            "layout": self.layout,
            "preset": self.meta.name,
            "pairs": self.pairs,
            "problems": self.problems,
            "histogram": {names[i]: int(self.histogram[i]) for i in names},
            "folders": self.folders,
            "image_values": self.values,
            "warnings": [w for w in (self.collapsed,) if w],
        }


def check_dataset(
    root: str | Path | Sequence[str | Path],
    *,
    splits: tuple[str, ...] | None = None,
    layout: str = "auto",
    preset: str | DatasetMeta | None = None,
    label_format: str = "index",
    label_map: Mapping[int, int] | None = None,
    ignore_value: IgnoreSetting = "auto",
    bit_depth: int | None = None,
    progress: ProgressMode = "off",
) -> CheckReport:
    """Read every pair of ``splits`` (default: those of train/val/test that exist; a list file
    as ``root``: its stem) of one root, or of several with the same classes (one report), 16-bit
    images at ``bit_depth`` (None: detected)."""
    for split in splits or ():
        check_split_name(split)
    report: CheckReport | None = None
    overlaps: list[str] = []
    for r in [root] if isinstance(root, str | Path) else root:
        r = Path(r)
        kind, scans, unlabelled = _scan_root(r, splits, layout)
        folders = {s: " + ".join(_shown_path(p, r) for p in (f.source, f.label_source) if p)
                   for s, f in scans.items() if f.source is not None}  # fmt: skip
        said: dict[str, list[str]] = {}  # what was read -> the splits it serves
        for s, f in scans.items():
            said.setdefault(f"{len(f.samples)} pairs in {folders.get(s, r)}", []).append(s)
        seen = ", ".join(f"{'/'.join(names)} {what}" for what, names in said.items())
        meta = resolve_meta(r, kind, preset, label_map=label_map, ignore_value=ignore_value,
                            found=f"found the {kind} layout ({seen}); ")  # fmt: skip
        report = report or CheckReport(r, kind, meta, label_format=label_format)
        one_class_set([(report.root, report.meta), (r, meta)], label_format=label_format)
        report.folders.update(folders)
        report.problems += unlabelled
        overlaps += _read_splits(report, r, kind, scans, bit_depth, progress)
    if report is None:
        raise DataError("no dataset root given; pass at least one folder")
    report.problems = _class_problems(report) + report.problems
    present = set(np.flatnonzero(report.histogram[: report.meta.num_classes]).tolist())
    report.collapsed = one_class_warning(label_map or {}, present, report.meta) or None
    report.split_overlap = "; ".join(overlaps) or None
    report.problems += overlaps
    return report


def _scan_root(
    root: Path, splits: tuple[str, ...] | None, layout: str
) -> tuple[str, dict, list[str]]:
    """``(layout, split -> scan, problems of train/val images without labels)``."""
    if layout == "auto":
        layout = detect_any_split(root, splits or DEFAULT_SPLITS)
    if splits is None and layout == "list" and root.is_file():
        splits = (root.stem,)
    unlabelled: list[str] = []
    scans = {}
    if splits is None:
        scans = {s: discover(root, split=s, layout=layout) for s in DEFAULT_SPLITS}
        splits = tuple(s for s, f in scans.items() if not f.split_missing) or ("train",)
        if layout == "folder":  # images/test without labels is usual: images to predict
            unlabelled = [
                m for s in ("train", "val") if s not in splits if (m := unlabelled_split(root, s))
            ]
    return (
        layout,
        {s: scans.get(s) or discover(root, split=s, layout=layout) for s in splits},
        unlabelled,
    )


def _read_splits(
    report: CheckReport, root: Path, layout: str, scans: dict, bit_depth: int | None,
    progress: ProgressMode,
) -> list[str]:  # fmt: skip
    """Read ``scans``' pairs into ``report``; return the split-overlap problem, if any."""
    sources: dict[Path, str] = {}
    images: dict[str, set[Path]] = {}  # per split, for the overlap check
    hists: dict[str, np.ndarray] = {}
    for split, found in scans.items():
        if found.source is not None and found.source in sources:  # a flat folder: checked once
            hist = hists[sources[found.source]]
            report.split_histograms[split] = report.split_histograms.get(split, 0) + hist
            report.folders.pop(split, None)
            continue
        if found.source is not None:
            sources[found.source] = split
        if found.split_missing and (m := missing_split(root, split, layout)):
            found.problems += [str(m)] if str(m) not in found.problems else []
        report.problems += found.problems
        report.pairs[split] = report.pairs.get(split, 0) + len(found.samples)
        if not found.samples and not found.problems:
            report.problems.append(f"{found.source or root}: split {split!r} is empty; add pairs")
        images[split] = {Path(img).resolve() for img, _ in found.samples}
        hist, (h, w), ranges = _empty_histogram(), report.largest.get(split, (0, 0)), []
        for img_path, label_path in track(found.samples, desc=f"check {split}", mode=progress):
            image, label, problems, values = inspect_pair(img_path, label_path, report.meta,
                label_format=report.label_format, bit_depth=bit_depth)  # fmt: skip
            report.problems += problems
            hist += np.bincount(label.ravel(), minlength=256) if label is not None else 0
            if image is not None:
                h, w = max(h, image.shape[0]), max(w, image.shape[1])
            ranges += [values] if values else []
        report.largest[split] = (h, w)
        report.split_histograms[split] = report.split_histograms.get(split, 0) + hist
        hists[split] = hist
        if ranges:
            report.values[split] = _value_range(ranges, bit_depth)
        report.histogram += hist
    return [o] if (o := _split_overlap(root, images)) else []


def _split_overlap(root: Path, images: Mapping[str, set[Path]]) -> str | None:
    """The first two of train / val / test that share images (other names, VOC's trainval, may)."""
    for a, b in itertools.combinations([s for s in DEFAULT_SPLITS if s in images], 2):
        if shared := images[a] & images[b]:
            return (
                f"{root}: split {b!r} shares {len(shared)} of its {len(images[b])} images with "
                f"split {a!r} (e.g. {min(shared).name}); keep each image in one split"
            )
    return None


def _shown_path(path: Path, root: Path) -> str:
    try:
        return f"{path.relative_to(root)}/" if path.is_dir() else path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


def _value_range(ranges: list[tuple[str, int, int]], bit_depth: int | None) -> dict[str, Any]:
    """One image set's stored values: dtypes, min, max and the bit depths they are read as."""
    wide = [hi for dtype, _, hi in ranges if dtype not in ("uint8", "bool")]
    depths = sorted({wide_depth(np.asarray([hi]), bit_depth) for hi in wide if hi > 255})
    return {
        "dtype": "/".join(sorted({d for d, _, _ in ranges})),
        "min": min(lo for _, lo, _ in ranges),
        "max": max(hi for _, _, hi in ranges),
        "bit_depth": depths or [8],
    }


def _class_problems(report: CheckReport) -> list[str]:
    """Dataset-level problems: a 0/255 binary mask read with 255 as ignore; absent classes."""
    meta, hist = report.meta, report.histogram
    total = int(hist.sum())
    if total == 0:
        return []
    names = meta.class_names
    absent = [c for c in range(meta.num_classes) if hist[c] == 0]
    present = set(np.flatnonzero(hist).tolist())
    problems = []
    ignore_share = hist[IGNORE_INDEX] / total
    if (
        present == {0, IGNORE_INDEX}
        and 1 in absent
        and meta.ignore_value == IGNORE_INDEX
        and ignore_share >= BINARY_MASK_MIN_SHARE
    ):
        absent.remove(1)
        meta_file = meta_path(report.root)
        report.binary_mask = (
            f"looks like a 0/255 binary mask: class 1 ({names[1]!r}) has no "
            f"pixels while value 255 (read as ignore) covers {100 * ignore_share:.1f}% and the "
            "only other value is 0; map 255 to class 1 with --label-map 255:1 (or "
            f'"label_map": {{"255": 1}} in {meta_file})'
        )
        problems.append(f"{report.root}: {report.binary_mask}")
    if absent:
        shown = ", ".join(f"{c} {names[c]!r}" for c in absent[:8])
        more = f" and {len(absent) - 8} more" if len(absent) > 8 else ""
        splits = ", ".join(report.split_histograms) or "the dataset"
        report.absent_classes = (
            f"{report.root}: class(es) {shown}{more} have no pixels in any split ({splits}); "
            "check the label mapping (--label-map, --preset, meta.json) or remove those classes"
        )
        problems.append(report.absent_classes)
    return problems


def require_trainable(report: CheckReport, train_split: str) -> None:
    """Raise one DataError when ``train_split``'s labels hold fewer than two classes or the
    report has problems (absent classes and split overlap are warnings)."""
    meta, hist = report.meta, report.split_histograms.get(train_split)
    present = [c for c in range(meta.num_classes) if hist is not None and hist[c] > 0]
    if hist is not None and hist.any() and len(present) < 2:
        total = max(int(hist.sum()), 1)
        shown = ", ".join(repr(meta.class_names[c]) for c in present) or "none"
        fix = report.binary_mask or (
            "check the label mapping (--label-map, --ignore-index, meta.json) with "
            f"'dualseg data check {report.root}'"
        )
        raise DataError(
            f"{report.root}: the {train_split!r} labels contain {len(present)} class(es) "
            f"({shown}; {100 * hist[IGNORE_INDEX] / total:.1f}% of pixels are ignore), so "
            f"training cannot learn to separate classes; {fix}"
        )
    problems = [
        p for p in report.problems if p not in (report.absent_classes, report.split_overlap)
    ]
    if problems:
        more = len(problems) - 1
        raise DataError(
            problems[0]
            + (f" (and {more} more problem(s))" if more else "")
            + f"; 'dualseg data check {report.root}' lists them all (or skip this scan with "
            "--data.check false)"
        )


def format_report(report: CheckReport) -> str:
    meta = report.meta
    lines = [
        f"dataset {report.root}  (layout {report.layout}, preset {meta.name}, "
        f"{meta.num_classes} classes, ignore {meta.describe_ignore()})",
        "pairs: " + ", ".join(f"{s} {n}" for s, n in report.pairs.items()),
    ]
    lines += [f"{split}: read {where}" for split, where in report.folders.items()]
    for split, v in report.values.items():
        depth = " and ".join(f"{b}-bit" for b in v["bit_depth"])
        mixed = " (mixed: pass the bit depth explicitly)" if len(v["bit_depth"]) > 1 else ""
        lines.append(
            f"{split} images: {v['dtype']} values {v['min']}..{v['max']}, read as {depth}{mixed}"
        )
    total = max(int(report.histogram.sum()), 1)
    lines.append(f"{'id':>4}  {'class':<16} {'pixels':>13} {'share':>7}")
    rows = [*enumerate(meta.class_names), (IGNORE_INDEX, "(ignore)")]
    for i, name in rows:
        n = int(report.histogram[i])
        absent = "   absent" if n == 0 and i != IGNORE_INDEX else ""
        lines.append(f"{i:>4}  {name:<16} {n:>13,} {100 * n / total:>6.2f}%{absent}")
    if report.problems:
        lines.append(f"{len(report.problems)} problem(s):")
        lines += [f"  - {p}" for p in report.problems]
    else:
        lines.append("no problems found")
    if report.collapsed:
        lines.append(f"warning: {report.collapsed}")
    return "\n".join(lines)
