"""Dataset check (``dualseg data check ROOT``): every problem at once, plus a pixel count.

Unlike loading (which stops at the first bad file), the check reads every pair of every split
and lists all problems, then prints a per-class pixel histogram. Exit status 1 when anything is
wrong, so it can guard a training script.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from dualseg.data.datasets import detect_layout, discover, resolve_meta
from dualseg.data.presets import IGNORE_INDEX, DatasetMeta
from dualseg.data.readers import read_image, read_label
from dualseg.errors import DataError

DEFAULT_SPLITS = ("train", "val", "test")


@dataclass
class CheckReport:
    root: Path
    layout: str
    meta: DatasetMeta
    pairs: dict[str, int] = field(default_factory=dict)  # split -> pairs found
    problems: list[str] = field(default_factory=list)
    histogram: np.ndarray = field(default_factory=lambda: np.zeros(256, np.int64))

    def to_dict(self) -> dict:
        names = {**dict(enumerate(self.meta.class_names)), IGNORE_INDEX: "ignore"}
        return {
            "root": str(self.root),
            "layout": self.layout,
            "preset": self.meta.name,
            "pairs": self.pairs,
            "problems": self.problems,
            "histogram": {names[i]: int(self.histogram[i]) for i in names},
        }


def check_dataset(
    root: str | Path,
    *,
    splits: tuple[str, ...] | None = None,
    layout: str = "auto",
    preset: str | DatasetMeta | None = None,
    label_format: str = "index",
    progress: bool = False,
) -> CheckReport:
    """Read every pair of ``splits`` (default: those of train/val/test that exist)."""
    root = Path(root)
    if layout == "auto":
        layout = _detect_any_split(root, splits or DEFAULT_SPLITS)
    if splits is None:
        found = {s: discover(root, split=s, layout=layout) for s in DEFAULT_SPLITS}
        splits = tuple(s for s, f in found.items() if not f.split_missing) or ("train",)
    report = CheckReport(root, layout, resolve_meta(root, layout, preset))
    sources: set[Path | None] = set()
    for split in splits:
        found = discover(root, split=split, layout=layout)
        if found.source in sources and found.source is not None:
            continue  # a flat images/ folder serves every split: check it once
        sources.add(found.source)
        report.problems += found.problems
        report.pairs[split] = len(found.samples)
        if not found.samples and not found.problems:
            report.problems.append(f"{found.source or root}: split {split!r} is empty; add pairs")
        for img_path, label_path in tqdm(
            found.samples, desc=f"check {split}", disable=not progress
        ):
            report.problems += _check_pair(img_path, label_path, report, label_format)
    return report


def _detect_any_split(root: Path, splits: tuple[str, ...]) -> str:
    # The layout is the first split's that is recognisable; an error names the first split.
    for split in splits:
        try:
            return detect_layout(root, split)
        except DataError:
            continue
    return detect_layout(root, splits[0])


def _check_pair(img_path: Path, label_path: Path, report: CheckReport, label_format: str):
    problems, image, label = [], None, None
    try:
        image = read_image(img_path)
    except DataError as err:
        problems.append(str(err))
    try:
        label = read_label(label_path, report.meta, label_format=label_format)
    except DataError as err:
        problems.append(str(err))
    if image is not None and label is not None and image.shape[:2] != label.shape:
        problems.append(
            f"{label_path}: label size {label.shape[1]}x{label.shape[0]} differs from image "
            f"{img_path} size {image.shape[1]}x{image.shape[0]} (WxH); fix the pair"
        )
    if label is not None:
        report.histogram += np.bincount(label.ravel(), minlength=256)
    return problems


def format_report(report: CheckReport) -> str:
    meta = report.meta
    lines = [
        f"dataset {report.root}  (layout {report.layout}, preset {meta.name}, "
        f"{meta.num_classes} classes)",
        "pairs: " + ", ".join(f"{s} {n}" for s, n in report.pairs.items()),
    ]
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
    return "\n".join(lines)
