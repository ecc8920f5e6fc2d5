"""``dualseg data check ROOT``: scan a dataset, report every problem at once, count pixels.

Unlike loading (which stops at the first bad file), the check reads every pair of every split
and lists all problems, then prints a per-class pixel histogram. Exit status 1 when anything is
wrong, so it can guard a training script.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dualseg.commands.common import add_quiet_arg, mode_of
from dualseg.console import ProgressMode, argparse_kwargs, track
from dualseg.data.datasets import LAYOUTS, detect_layout, discover, resolve_meta
from dualseg.data.presets import IGNORE_INDEX, PRESETS, DatasetMeta
from dualseg.data.readers import LABEL_FORMATS, read_image, read_label
from dualseg.errors import DataError
from dualseg.io import atomic_write_json

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
    progress: ProgressMode = "off",
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
        for img_path, label_path in track(found.samples, desc=f"check {split}", mode=progress):
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


def main(argv: list[str] | None = None) -> int:
    usage = argparse_kwargs(
        "dualseg data check ../shared/data/camvid --preset camvid",
        "dualseg data check data/ADEChallengeData2016 --split train --json report.json",
    )
    parser = argparse.ArgumentParser(prog="dualseg data", description="dataset tools", **usage)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check",
        help="report every problem in a dataset plus a per-class pixel histogram",
        description="Read every pair of every split, list all problems, count pixels per class.",
        **usage,
    )
    check.add_argument("root", type=Path, help="dataset folder (or a list file)")
    check.add_argument("--layout", choices=LAYOUTS, default="auto")
    check.add_argument(
        "--split",
        action="append",
        help="split to check (repeatable; default: whichever of train/val/test exist)",
    )
    check.add_argument(
        "--preset", choices=sorted(PRESETS), help="class set (default: ROOT/meta.json or layout)"
    )
    check.add_argument("--label-format", choices=LABEL_FORMATS, default="index")
    check.add_argument("--json", type=Path, help="also write the report as JSON to this file")
    add_quiet_arg(check)
    args = parser.parse_args(argv)

    report = check_dataset(
        args.root,
        splits=tuple(args.split) if args.split else None,
        layout=args.layout,
        preset=args.preset,
        label_format=args.label_format,
        progress=mode_of(args),
    )
    print(format_report(report))
    if args.json:
        atomic_write_json(args.json, report.to_dict())
    return 1 if report.problems else 0
