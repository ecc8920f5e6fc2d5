"""``dualseg data check ROOT``: every problem of a dataset at once and a per-class pixel
histogram (:mod:`dualseg.data.check`); exit 1 when anything is wrong. ``--json FILE`` writes the
report atomically, never over an existing FILE (without ``--overwrite``) or a dataset's file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dualseg.commands.common import (
    add_overwrite_arg,
    add_quiet_arg,
    bit_depth_arg,
    check_outputs,
    dataset_files,
    mode_of,
    parse_ignore_index,
    split_of,
)
from dualseg.console import ArgumentParser, argparse_kwargs
from dualseg.data.check import DEFAULT_SPLITS, check_dataset, format_report
from dualseg.data.datasets import LAYOUTS
from dualseg.data.infer import infer_meta, write_meta
from dualseg.data.presets import PRESETS, parse_label_map
from dualseg.data.readers import LABEL_FORMATS
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
    check.add_argument("root", type=Path, help="dataset folder (or a list file)")
    check.add_argument("--layout", choices=LAYOUTS, default="auto", help="(auto)")
    check.add_argument(
        "--split",
        action="append",
        help="split to check (repeatable; default: whichever of train/val/test exist; a list file "
        "as root: its name, val for val.txt)",
    )
    check.add_argument(
        "--preset", choices=sorted(PRESETS), help="class set (default: ROOT/meta.json or layout)"
    )
    check.add_argument("--label-format", choices=LABEL_FORMATS, default="index")
    check.add_argument(
        "--label-map",
        type=parse_label_map,
        metavar="RAW:CLASS[,...]",
        help="map raw label values to class ids, e.g. 255:1 for 0/255 binary masks "
        "(default: ROOT/meta.json's label_map, else none)",
    )
    check.add_argument(
        "--ignore-index",
        type=parse_ignore_index,
        default="auto",
        metavar="RAW|none",
        help="the raw label value meaning ignore; none: no value (default: the dataset's, 255)",
    )
    check.add_argument(
        "--bit-depth",
        type=bit_depth_arg,
        metavar="BITS",
        help="bits per sample of 16-bit images, 8..16 (default: detected from their values)",
    )
    check.add_argument("--json", type=Path, help="also write the report as JSON to this file")
    check.add_argument(
        "--write-meta",
        action="store_true",
        help="infer the classes from the label values and write ROOT/meta.json to review "
        "(0/255 masks: two classes, label_map 0:0,255:1)",
    )
    add_overwrite_arg(check, what="the --json file and, with --write-meta, meta.json")
    add_quiet_arg(check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for split in args.split or ():
        split_of(args.root, split, default=split, flag="ROOT")
    if args.json:
        check_writable(args.json, what="--json")
        check_outputs(
            [args.json],
            overwrite=args.overwrite,
            protected=[
                (f"a file of the dataset {args.root}", dataset_files(args.root, layout=args.layout))
            ],
            what="--json",
        )

    if args.write_meta:
        _write_meta(args)
    report = check_dataset(
        args.root,
        splits=tuple(args.split) if args.split else None,
        layout=args.layout,
        preset=args.preset,
        label_format=args.label_format,
        label_map=args.label_map,
        ignore_value=args.ignore_index,
        bit_depth=args.bit_depth,
        progress=mode_of(args),
    )
    print(format_report(report))
    if args.json:
        atomic_write_json(args.json, report.to_dict())
    return 1 if report.problems else 0


def _write_meta(args: argparse.Namespace) -> None:
    if args.preset or args.label_format != "index":
        raise DataError(
            "--write-meta infers classes from index label values: leave --preset and "
            "--label-format color out (colour labels need their palette described by hand)"
        )
    splits = tuple(args.split) if args.split else DEFAULT_SPLITS
    meta = infer_meta(args.root, layout=args.layout, splits=splits)
    path = write_meta(args.root, meta, overwrite=args.overwrite)
    mapping = f", {meta.describe_mapping()}" if meta.label_map else ""
    print(f"wrote {path}: {meta.num_classes} classes {list(meta.class_names)}{mapping}; review it")
