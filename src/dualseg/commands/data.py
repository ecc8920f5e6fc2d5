"""``dualseg data check ROOT``: every problem of a dataset at once and a per-class pixel
histogram (:mod:`dualseg.data.check`); exit 1 when anything is wrong."""

from __future__ import annotations

import argparse
from pathlib import Path

from dualseg.commands.common import (
    add_overwrite_arg,
    add_quiet_arg,
    bit_depth,
    parse_ignore_index,
    split_of,
)
from dualseg.console import ArgumentParser, argparse_kwargs, progress_mode
from dualseg.data.check import DEFAULT_SPLITS, check_dataset, format_report
from dualseg.data.infer import infer_meta, write_meta
from dualseg.data.layouts import LAYOUTS
from dualseg.data.presets import PRESETS, parse_label_map
from dualseg.data.readers import LABEL_FORMATS
from dualseg.engine.outputs import check_outputs, dataset_files
from dualseg.errors import DataError
from dualseg.io import atomic_write_json, check_writable


def build_parser() -> argparse.ArgumentParser:
    usage = argparse_kwargs(
        "dualseg data check ../shared/data/camvid --preset camvid",
        "dualseg data check data/ADEChallengeData2016 --split train --json report.json",
    )
    parser = ArgumentParser(prog="dualseg data", description="dataset tools", **usage)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check",
        help="report every problem in a dataset plus a per-class pixel histogram",
        description="Read every pair of every split, list all problems, count pixels per class.",
        **usage,
    )
    add = check.add_argument
    add("root", type=Path, help="dataset folder (or a list file)")
    add("--layout", choices=LAYOUTS, default="auto", help="(auto)")
    add("--split", action="append", help="split to check (repeatable; default: train/val/test)")
    add("--preset", choices=sorted(PRESETS), help="class set (default: meta.json or layout)")
    add("--label-format", choices=LABEL_FORMATS, default="index")
    add("--label-map", type=parse_label_map, metavar="RAW:CLASS[,...]",
        help="map raw label values to class ids, e.g. 255:1 (default: meta.json's)")  # fmt: skip
    add("--ignore-index", type=parse_ignore_index, default="auto", metavar="RAW|none",
        help="the raw label value meaning ignore (default: the dataset's, 255)")  # fmt: skip
    add("--bit-depth", type=bit_depth, metavar="BITS", help="of 16-bit images (detected)")
    add("--json", type=Path, help="also write the report as JSON to this file")
    add("--write-meta", action="store_true",
        help="infer the classes from the label values and write ROOT/meta.json")  # fmt: skip
    add_overwrite_arg(check, what="the --json file and, with --write-meta, meta.json")
    add_quiet_arg(check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for split in args.split or ():
        split_of(args.root, split, default=split, flag="ROOT")
    if args.json:
        check_writable(args.json, what="--json")
        dataset = (
            f"a file of the dataset {args.root}",
            dataset_files(args.root, layout=args.layout),
        )
        check_outputs([args.json], overwrite=args.overwrite, protected=[dataset], what="--json")
    if args.write_meta:
        if args.preset or args.label_format != "index":
            raise DataError("--write-meta infers classes from index label values: leave "
                            "--preset and --label-format color out")  # fmt: skip
        meta = infer_meta(args.root, layout=args.layout, splits=args.split or DEFAULT_SPLITS)
        path = write_meta(args.root, meta, overwrite=args.overwrite)
        mapping = f", {meta.describe_mapping()}" if meta.label_map else ""
        print(
            f"wrote {path}: {meta.num_classes} classes {list(meta.class_names)}{mapping}; review it"
        )
    report = check_dataset(
        args.root, splits=tuple(args.split) if args.split else None, layout=args.layout,
        preset=args.preset, label_format=args.label_format, label_map=args.label_map,
        ignore_value=args.ignore_index, bit_depth=args.bit_depth,
        progress=progress_mode(args.quiet),
    )  # fmt: skip
    print(format_report(report))
    if args.json:
        atomic_write_json(args.json, report.to_dict())
    return 1 if report.problems else 0
