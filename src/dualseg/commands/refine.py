"""``dualseg refine fit``, ``apply`` and ``layers`` (method B)."""

from __future__ import annotations

import argparse
import sys

from dualseg.augment_defaults import check_augment_settings
from dualseg.commands import common as c
from dualseg.console import argparse_kwargs, progress_mode
from dualseg.data.transforms import SCALE_RANGE
from dualseg.engine.outputs import check_image_outputs, collect_images
from dualseg.export.runtime import load_refiner
from dualseg.io import check_writable
from dualseg.refine import apply_run, fit_run
from dualseg.refine.base import describe_layers, load_base
from dualseg.refine.calibrate import METRICS
from dualseg.refine.config import RefinerConfig, add_flags
from dualseg.refine.taps import SAMPLE_SIZE


def _add_fit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fit",
        help="train the re-optimization model and compute class prototypes",
        description="Method B training (steps 1-5): triplet learning, then class prototypes.",
        **argparse_kwargs(
            "dualseg refine fit --data ROOT --base runs/camvid/best.pt -o runs/camvid/refiner.pt",
            "dualseg refine fit --data ROOT --base probs/ --steps 500 --device cuda --amp",
        ),
    )
    add = p.add_argument
    c.add_data_args(p, split="train")
    add("--base", help="the base model: a checkpoint or a 'dualseg predict --probs' folder")
    add("--out", "-o", default="refiner.pt", help="refiner file to write (refiner.pt)")
    c.add_label_args(p, source="the --base checkpoint")
    add("--crop-size", type=int, nargs=2, default=(256, 256), metavar=("H", "W"), help="(256 256)")
    add("--scale-range", type=float, nargs=2, default=SCALE_RANGE, metavar=("LO", "HI"))
    add("--init-backbone", choices=("imagenet", "base", "none"), default="imagenet")
    add("--weights", help="ImageNet weight file for the backbone (default: resolved)")
    add("--calibrate-split", help="a labelled split to choose the decision options on (--base)")
    add("--calibrate-metric", choices=METRICS, default=METRICS[0],
        help=f"what the choice maximizes (net_fixed: pixels fixed less twice those broken, for "
        f"fewer broken pixels) ({METRICS[0]})")  # fmt: skip
    add(
        "--calibrate-max-broken-ratio",
        type=c.nonnegative_float,
        metavar="R",
        help="choose only among settings breaking at most R pixels per pixel fixed (any)",
    )
    add_flags(p, c.REFINER_PARSED)
    add("--time-budget", type=float, metavar="MINUTES", help="stop the steps after MINUTES")
    add("--proto-images", type=c.nonnegative_int, default=0, help="prototype images (0: all)")
    c.add_runtime_args(p)
    add("--workers", type=c.nonnegative_int, default=0, help="data loader workers (0)")
    add("--checkpoint", help="training-state file, for --resume (default: OUT with .train.pt)")
    add("--checkpoint-every", type=c.positive_int, default=200, help="steps between saves (200)")
    add("--resume", action="store_true", help="continue from --checkpoint")
    add("--overwrite", action="store_true", help="replace an existing --out and --checkpoint")
    c.add_quiet_arg(p)
    add("--no-progress", action="store_true", help="no progress bar (see --quiet)")
    add("--log-every", type=c.nonnegative_int, default=50, help="loss line every N steps (50)")


def _add_apply(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "apply",
        help="refine a base model's segmentation of images",
        description="Method B inference (P1-P5): labels/, color/, overlay/ and changed/ PNGs.",
        **argparse_kwargs(
            "dualseg refine apply photos/ -r runs/camvid/refiner.pt -b runs/camvid/best.pt -o out/",
            "dualseg refine apply photos/ -r hf://org/camvid-model -b probs/ -o out/ --quiet",
        ),
    )
    add = p.add_argument
    add("inputs", nargs="+", metavar="INPUT", help="image files, folders or globs")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--refiner", "-r", help="refiner file from 'refine fit', or an exported one")
    how.add_argument("--crf", action="store_true", help="dense CRF instead (dualseg[crf] extra)")
    add("--base", "-b", required=True, help="checkpoint or 'dualseg predict --probs' folder")
    add("--out", "-o", required=True, help="output folder")
    c.add_overwrite_arg(p, what="output files in --out")
    c.add_dataset_check_options(p)
    c.add_refiner_overrides(p)
    c.add_runtime_args(p)
    c.add_quiet_arg(p)
    add("--alpha", type=c.fraction, default=0.5, help="overlay opacity, 0-1 (0.5)")
    c.add_inference_arguments(p)  # how a checkpoint base runs; the refiner reads its scores


def build_parser() -> argparse.ArgumentParser:
    parser = c.command_parser(
        "refine",
        "Method B: boundary re-optimization of any segmentation model.",
        "dualseg refine fit --data ROOT --base runs/camvid/best.pt --out refiner.pt",
        "dualseg refine apply photos/ -r refiner.pt -b runs/camvid/best.pt -o out/",
    )
    sub = parser.add_subparsers(dest="command", metavar="{fit,apply,layers}", required=True)
    _add_fit(sub)
    _add_apply(sub)
    p = sub.add_parser(
        "layers",
        help="list the modules of a base model a refiner can read (--base-features)",
        description="Lists the feature maps of the base model on a blank image (name, channels, "
        "stride): what --base-features LOW HIGH can name.",
        **argparse_kwargs(
            "dualseg refine layers --base runs/camvid/best.pt",
            "dualseg refine layers --base mymodel.py:model --size 512 512",
        ),
    )
    p.add_argument("--base", "-b", required=True, help="checkpoint, file.py:NAME or module:NAME")
    p.add_argument("--size", type=c.positive_int, nargs=2, default=SAMPLE_SIZE, metavar=("H", "W"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "layers":
        print(describe_layers(args.base, args.size))
        return 0
    return (fit_main if args.command == "fit" else apply_main)(args)


def _sweep_flags(args: argparse.Namespace) -> list[str]:
    """The flags given that choose among the --calibrate-split sweep's rows."""
    given = (
        ("--calibrate-metric", args.calibrate_metric != METRICS[0]),
        ("--calibrate-max-broken-ratio", args.calibrate_max_broken_ratio is not None),
    )
    return [flag for flag, on in given if on]


def fit_main(args: argparse.Namespace) -> int:
    cfg = RefinerConfig.from_flags(args)
    if cfg.top_n == 1:
        note("--top-n 1 leaves each pixel one candidate: this refiner changes no pixel")
    split = c.split_of(args.data, args.split, default="train")
    names = {"crop_size": "--crop-size", "scale_range": "--scale-range"}
    crop, scales = tuple(args.crop_size), tuple(args.scale_range)
    check_augment_settings(crop_size=crop, scale_range=scales, names=names)
    fit_run.check_options(
        cfg, split=split, calibrate_split=args.calibrate_split, crop_size=args.crop_size,
        weights=args.weights, init_backbone=args.init_backbone, has_base=bool(args.base),
        sweep_flags=_sweep_flags(args),
    )  # fmt: skip
    out, checkpoint = fit_run.fit_outputs(
        args.out, args.checkpoint, data=args.data, layout=args.layout, base=args.base,
        resume=args.resume, overwrite=args.overwrite,
    )  # fmt: skip
    device = c.apply_runtime(args)
    base = None if args.base is None else load_base(args.base, device=device)
    read_as = f"dualseg refine fit: note: labels read as {args.base} was trained"
    trained = getattr(base, "trained_data", None) or {}
    fmt, mapping, ignore = c.label_settings(args, trained, note=read_as)
    labels = {"label_format": fmt, "label_map": mapping, "ignore_value": ignore}
    where = {"split": split, "layout": args.layout, "preset": args.preset}
    data = fit_run.fit_datasets(
        args.data, **where, labels=labels, crop_size=args.crop_size, seed=cfg.seed,
        scale_range=args.scale_range, proto_images=args.proto_images,
        calibrate_split=args.calibrate_split, contract=getattr(base, "contract", None),
    )  # fmt: skip
    class_names = data.train.meta.class_names
    cfg.check_switches(len(class_names), f"pass --blocked-switches pairs of {args.data}'s classes")
    if cfg.top_n != RefinerConfig.top_n and cfg.top_n > len(class_names):  # not the default
        note(apply_run.top_n_over_classes(cfg.top_n, len(class_names)))
    refiner, report = fit_run.run_fit(
        cfg, data, base, root=args.data, base_name=args.base, where=where, labels=labels,
        crop_size=args.crop_size, scale_range=args.scale_range, init_backbone=args.init_backbone,
        weights=args.weights, device=device, amp=c.cuda_amp(args, device), workers=args.workers,
        checkpoint=checkpoint, checkpoint_every=args.checkpoint_every, resume=args.resume,
        overwrite=args.overwrite, progress="off" if args.no_progress else progress_mode(args.quiet),
        log_every=args.log_every, calibrate_metric=args.calibrate_metric,
        calibrate_max_broken_ratio=args.calibrate_max_broken_ratio,
        time_budget_s=None if args.time_budget is None else 60 * args.time_budget,
    )  # fmt: skip
    if report:
        print(report)
    refiner.save(out)
    print(fit_run.fit_summary(refiner, out))
    return 0


def note(text: str) -> None:
    print(f"dualseg refine fit: note: {text}", file=sys.stderr)


def apply_main(args: argparse.Namespace) -> int:
    overrides = c.refiner_overrides(args)
    crf = apply_run.crf_settings(overrides) if args.crf else None
    opts = c.inference_options(args)
    out = check_writable(args.out, kind="dir", what="--out")
    images = collect_images(args.inputs, out=out, command="refine apply")
    kinds = [(f, ".png") for f in apply_run.KINDS]
    check_image_outputs(out, images, kinds, overwrite=args.overwrite, data=args.data,
                          command="refine apply")  # fmt: skip
    device = c.apply_runtime(args)
    base = load_base(args.base, device=device)
    apply_run.require_a_model(base, opts, str(args.base))
    if crf is not None:
        refiner = crf
    else:
        refiner = load_refiner(args.refiner, device=device)
        c.static_export_note(args.refiner, refiner, "refine")
        c.check_dataset_classes(args, refiner.class_names, f"the refiner {args.refiner}")
        for line in apply_run.configure(refiner, base, overrides=overrides,
                                        refiner_name=args.refiner,
                                        base_name=str(args.base)):  # fmt: skip
            print(f"dualseg refine apply: {line}", file=sys.stderr)
    done = apply_run.apply_images(refiner, base, images, out, device=device, opts=opts,
                                  amp=args.amp, alpha=args.alpha, overwrite=args.overwrite,
                                  progress=progress_mode(args.quiet))  # fmt: skip
    frac = 100 * done.changed / done.pixels if done.pixels else 0.0
    print(f"refined {len(images) - len(done.failures)} image(s): {done.changed} pixels changed "
          f"({frac:.3f}%) -> {out}")  # fmt: skip
    c.skipped(done.failures, len(images))
    return 0
