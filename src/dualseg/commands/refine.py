"""``dualseg refine fit`` and ``dualseg refine apply`` (method B).

dualseg refine fit --data ROOT --base CKPT_OR_PROBS_DIR --out refiner.pt [options]
dualseg refine apply --refiner refiner.pt --base CKPT_OR_PROBS_DIR INPUTS... --out DIR
dualseg refine layers --base CKPT_OR_FILE.py:NAME
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dualseg.augment_defaults import check_augment_settings
from dualseg.commands import common as c
from dualseg.console import ArgumentParser, argparse_kwargs, track
from dualseg.data.presets import require_same_classes
from dualseg.data.transforms import SCALE_RANGE
from dualseg.engine.predict import as_rgb_array
from dualseg.errors import ConfigError, DataError, DualsegError
from dualseg.export.runtime import load_refiner
from dualseg.imaging import normalize
from dualseg.io import atomic_save_image, check_writable
from dualseg.refine import BoundaryRefiner, fit_run
from dualseg.refine.apply_run import base_scores, configure, top_n_over_classes
from dualseg.refine.base import load_base
from dualseg.refine.boundary import MAX_RADIUS
from dualseg.refine.calibrate import METRICS
from dualseg.refine.config import OptionError, RefinerConfig
from dualseg.refine.crf import CRFSettings, import_pydensecrf
from dualseg.refine.taps import SAMPLE_SIZE, list_taps, pick_taps
from dualseg.viz import default_palette


def radius_arg(text: str) -> int:
    """argparse ``type=`` of ``--radius``: 0..MAX_RADIUS pixels, refused at parsing."""
    return c.pixels_at_most(text, MAX_RADIUS)


# refine fit's flags checked at parsing, as refine apply's overrides of them are
PARSED = {"radius": radius_arg, "top_n": c.positive_int}


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """One flag per :class:`RefinerConfig` field: ``--embed-dim`` for ``embed_dim``."""
    for f in fields(RefinerConfig):
        kind = float if f.type == float | None else f.type
        kw: dict[str, Any] = {"type": PARSED.get(f.name, kind), "default": f.default}
        if f.type == tuple[int, ...]:
            kw.update(type=int, nargs="+", default=list(f.default))
        if f.type == tuple[str, ...] | None:
            kw.update(type=str, nargs="+", metavar="MODULE")
        shown = " ".join(map(str, f.default)) if f.type == tuple[int, ...] else f.default
        help = f.metadata["help"] + (f" ({shown})" if f.default is not None else "")
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        p.add_argument(f"--{f.name.replace('_', '-')}", help=help, **kw)


def _add_fit(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "fit",
        help="train the re-optimization model and compute class prototypes",
        description="Method B training (steps 1-5): triplet metric learning on the near-boundary "
        "pixels of DATA, then the mean embedding of each class. Writes one refiner file.",
        **argparse_kwargs(
            "dualseg refine fit --data ../shared/data/camvid --preset camvid "
            "--base runs/camvid/best.pt --out runs/camvid/refiner.pt",
            "dualseg refine fit --data ROOT --base probs/ --steps 500 --device cuda --amp",
        ),
    )
    add = p.add_argument
    add("--data", required=True, help="dataset root (any layout build_dataset reads)")
    add("--base", help="the base model: a dualseg checkpoint or a 'dualseg predict --probs' "
        "folder; its class names must match the dataset's")  # fmt: skip
    add("--out", "-o", default="refiner.pt", help="refiner file to write (refiner.pt)")
    add("--split", help="split to fit on (train; a list file as --data: its name)")
    add("--layout", default="auto", help="dataset layout (auto)")
    add("--preset", help="class preset: camvid, voc, cityscapes, ade20k, synthetic")
    c.add_label_args(p, source="the --base checkpoint")
    add("--crop-size", type=int, nargs=2, default=(256, 256), metavar=("H", "W"), help="(256 256)")
    add("--scale-range", type=float, nargs=2, default=SCALE_RANGE, metavar=("LO", "HI"),
        help=f"random scale of step 1 {SCALE_RANGE}")  # fmt: skip
    add("--init-backbone", choices=("imagenet", "base", "none"), default="imagenet",
        help="backbone initialization: ImageNet weights, the base checkpoint's backbone (same "
        "backbone name), or random (imagenet)")  # fmt: skip
    add("--weights", help="ImageNet weight file for the backbone (default: resolved)")
    add("--calibrate-split", help="a labelled split of --data held out of --split: sweep the "
        "decision options on it with --base, keep the best (gate 0: never relabel)")  # fmt: skip
    add("--calibrate-metric", choices=METRICS, default=METRICS[0],
        help=f"what --calibrate-split maximizes ({METRICS[0]})")  # fmt: skip
    add_config_flags(p)
    add("--time-budget", type=float, metavar="MINUTES",
        help="stop the triplet steps after this many minutes, even before --steps")  # fmt: skip
    add("--proto-images", type=c.nonnegative_int, default=0,
        help="use only the first N training images for the prototypes (0: all)")  # fmt: skip
    c.add_runtime_args(p)
    add("--workers", type=c.nonnegative_int, default=0, help="data loader workers (0)")
    add("--checkpoint", help="training-state file, for --resume (default: OUT with .train.pt)")
    add("--checkpoint-every", type=c.positive_int, default=200, help="steps between saves (200)")
    add("--resume", action="store_true", help="continue from --checkpoint")
    add("--overwrite", action="store_true",
        help="replace an existing --out and its --checkpoint with a new fit")  # fmt: skip
    c.add_quiet_arg(p)
    add("--no-progress", action="store_true", help="no progress bar (see --quiet)")
    add("--log-every", type=c.nonnegative_int, default=50,
        help="print a loss line every N steps (50; 0: off)")  # fmt: skip


def _add_apply(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "apply",
        help="refine a base model's segmentation of images",
        description="Method B inference (P1-P5): label PNGs (labels/), colour PNGs (color/), "
        "overlays (overlay/) and the changed pixels (changed/) per input image.",
        **argparse_kwargs(
            "dualseg refine apply photos/ -r runs/camvid/refiner.pt -b runs/camvid/best.pt -o out/",
            "dualseg refine apply photos/ -r hf://org/camvid-model -b probs/ -o out/ --quiet",
        ),
    )
    add = p.add_argument
    add("inputs", nargs="+", metavar="INPUT", help="image files, folders or globs")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument(
        "--refiner",
        "-r",
        help="refiner file from 'refine fit', or an exported "
        "one ('dualseg export --refiner': its .onnx/.json pair or TorchScript .pt)",
    )
    how.add_argument("--crf", action="store_true", help="dense CRF on the base's probabilities "
                     "in place of method B, to compare on your images (needs pydensecrf2: pip "
                     "install 'dualseg[crf]')")  # fmt: skip
    add("--base", "-b", required=True, help="checkpoint or 'dualseg predict --probs' folder")
    add("--out", "-o", required=True, help="output folder")
    c.add_overwrite_arg(p, what="output files in --out")
    c.add_dataset_check_options(p)
    add("--top-n", type=c.positive_int, help="override the refiner's Top-N")
    add("--radius", type=radius_arg, help="override the refiner's near-boundary radius")
    c.add_runtime_args(p)
    c.add_quiet_arg(p)
    add("--alpha", type=c.fraction, default=0.5, help="overlay opacity, 0-1 (0.5)")
    c.add_inference_arguments(p)  # how a checkpoint base runs; the refiner reads its scores


def _add_layers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "layers",
        help="list the modules of a base model a refiner can read (--base-features)",
        description="Runs the base model once on a blank sample image and lists each module "
        "whose output is a feature map: its name, channels and stride. A refiner fitted with "
        "--base-features LOW HIGH reads two of them: LOW at stride 4, HIGH at 16 or 32.",
        **argparse_kwargs(
            "dualseg refine layers --base runs/camvid/best.pt",
            "dualseg refine layers --base mymodel.py:model --size 512 512",
        ),
    )
    p.add_argument("--base", "-b", required=True, help="a dualseg checkpoint, or a model of "
                   "your own: file.py:NAME or package.module:NAME (a model, or a function "
                   "returning one)")  # fmt: skip
    p.add_argument("--size", type=c.positive_int, nargs=2, default=SAMPLE_SIZE,
                   metavar=("H", "W"), help="the sample image's size (256 256)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="dualseg refine",
        description="Method B: boundary re-optimization of any segmentation model.",
        **argparse_kwargs(
            "dualseg refine fit --data ROOT --base runs/camvid/best.pt --out refiner.pt",
            "dualseg refine apply photos/ -r refiner.pt -b runs/camvid/best.pt -o out/",
        ),
    )
    sub = p.add_subparsers(dest="command", metavar="{fit,apply,layers}")
    sub.required = True
    _add_fit(sub)
    _add_apply(sub)
    _add_layers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"fit": fit_main, "apply": apply_main, "layers": layers_main}[args.command](args)


# ---------------------------------------------------------------------- fit
def check_fit(args: argparse.Namespace) -> tuple[RefinerConfig, str, Path, Path]:
    """``refine fit``'s refusals before any data is read: ``(config, split, out, checkpoint)``."""
    try:
        cfg = RefinerConfig(**{f.name: getattr(args, f.name) for f in fields(RefinerConfig)})
    except OptionError as err:  # named as the command line gives it
        raise ConfigError(err.named(f"--{err.option.replace('_', '-')}")) from None
    if cfg.top_n == 1:
        note("fit", "--top-n 1 leaves each pixel one candidate, the base's label: this refiner "
             "can change no pixel (refine apply --top-n overrides it)")  # fmt: skip
    split = c.split_of(args.data, args.split, default="train")
    names = {"crop_size": "--crop-size", "scale_range": "--scale-range"}
    check_augment_settings(crop_size=tuple(args.crop_size), scale_range=tuple(args.scale_range),
                           names=names)  # fmt: skip
    has_base = args.base is not None
    fit_run.check_options(cfg, split=split, calibrate_split=args.calibrate_split,
                          crop_size=args.crop_size, weights=args.weights,
                          init_backbone=args.init_backbone, has_base=has_base)  # fmt: skip
    out, checkpoint = fit_run.fit_paths(args.out, args.checkpoint)
    # never the --base model or a file of the dataset, even with --overwrite
    protected = [
        (f"a file of the dataset {args.data}", c.dataset_files(args.data, layout=args.layout))
    ]
    if args.base is not None and Path(args.base).is_file():
        protected.insert(0, ("the --base model", [Path(args.base)]))
    for path, what in ((out, "--out"), (checkpoint, "--checkpoint")):
        c.check_outputs([path], overwrite=True, protected=protected, what=what)
    fit_run.check_fit_targets(out, checkpoint)
    fit_run.check_earlier_fit(out, checkpoint, resume=args.resume, overwrite=args.overwrite)
    return cfg, split, out, checkpoint


def fit_main(args: argparse.Namespace) -> int:
    cfg, split, out, checkpoint = check_fit(args)
    device = c.apply_runtime(args)
    base = None if args.base is None else load_base(args.base, device=device)
    # the labels read as the base was trained, as eval reads them
    fmt, mapping, ignore, taken = c.label_settings(args, getattr(base, "trained_data", None) or {})
    if taken:
        note("fit", f"labels read as {args.base} was trained: {', '.join(taken)} "
             "(--label-format / --label-map / --ignore-index change it)")  # fmt: skip
    labels = {"label_format": fmt, "label_map": mapping, "ignore_value": ignore}
    where = {"split": split, "layout": args.layout, "preset": args.preset}
    data = fit_run.fit_datasets(args.data, **where, labels=labels, crop_size=args.crop_size,
                                scale_range=args.scale_range, seed=cfg.seed,
                                proto_images=args.proto_images,
                                calibrate_split=args.calibrate_split)  # fmt: skip
    class_names = data.train.meta.class_names
    if cfg.top_n != RefinerConfig.top_n and cfg.top_n > len(class_names):  # not the default
        note("fit", top_n_over_classes(cfg.top_n, len(class_names)))
    if base is not None and base.class_names is not None:
        require_same_classes(tuple(base.class_names), tuple(class_names),
                             model=f"the base model {args.base}", data=f"{args.data}")  # fmt: skip
    files = None
    if data.held_out is not None:  # named as predict names them: how a folder base finds them
        files = c.unique_names([(Path(i), Path(i).stem) for i, _ in data.held_out.samples])
        if hasattr(base, "require"):  # a probability folder: every map, before the fit
            base.require([name for _, name in files], [str(path) for path, _ in files])
    weights, init_from = fit_run.backbone_init(args.init_backbone, args.weights,
                                               cfg.backbone_source, base)  # fmt: skip
    taps_of = getattr(base, "module", None) if cfg.base_features else None
    reads_base = init_from is not None or taps_of is not None
    inputs = fit_run.fit_inputs(args.data, **where, crop_size=args.crop_size, labels=labels,
                                scale_range=args.scale_range,
                                base=args.base if reads_base else None)  # fmt: skip
    if args.overwrite:  # every input checked: the earlier fit's state goes now
        checkpoint.unlink(missing_ok=True)
    mode = "off" if args.no_progress else c.mode_of(args)
    with c.autocast(args, device):
        refiner = BoundaryRefiner.fit(
            data.train, class_names=class_names, config=cfg, prototype_dataset=data.prototypes,
            weights=weights, init_from=init_from, base=taps_of, device=device,
            num_workers=args.workers,
            checkpoint=checkpoint, checkpoint_every=args.checkpoint_every, resume=args.resume,
            time_budget_s=None if args.time_budget is None else 60 * args.time_budget,
            progress=mode == "bar", log_every=0 if mode == "off" else args.log_every,
            fit_inputs=inputs,
        )  # fmt: skip
    if data.held_out is not None:
        split, metric = args.calibrate_split, args.calibrate_metric
        rows = fit_run.calibrate(refiner, base, data.held_out, files, split=split,
                                 metric=metric, device=device)  # fmt: skip
        print(fit_run.calibration_report(rows, refiner.config, split=split, metric=metric,
                                         images=len(data.held_out)))  # fmt: skip
    refiner.save(out)
    print(fit_run.fit_summary(refiner, out))
    return 0


def note(command: str, text: str) -> None:
    print(f"dualseg refine {command}: note: {text}", file=sys.stderr)


# ---------------------------------------------------------------------- apply
def crf_refiner(args: argparse.Namespace) -> CRFSettings:
    """``refine apply --crf``: dense CRF with its default kernels, the options of method B
    refused (they would be ignored)."""
    given = [f for f, v in (("--top-n", args.top_n), ("--radius", args.radius)) if v is not None]
    if given:
        raise ConfigError(
            f"{' and '.join(given)} set method B's refiner; --crf has none: drop them"
        )
    import_pydensecrf()  # before any output: one line saying how to install it
    return CRFSettings()


def apply_main(args: argparse.Namespace) -> int:
    opts = c.inference_options(args)
    out = check_writable(args.out, kind="dir", what="--out")
    images = c.collect_images(args.inputs, out=out, command="refine apply")
    kinds = ("labels", "color", "overlay", "changed")
    c.check_image_outputs(
        out,
        images,
        [(f, ".png") for f in kinds],
        overwrite=args.overwrite,
        data=args.data,
        command="refine apply",
    )
    device = c.apply_runtime(args)
    augmented = opts.mode != "whole" or opts.uses_tta
    if args.crf:
        refiner, base = crf_refiner(args), load_base(args.base, device=device)
    else:
        refiner = load_refiner(args.refiner, device=device)
        c.static_export_note(args.refiner, refiner, "refine")
        c.check_dataset_classes(args, refiner.class_names, f"the refiner {args.refiner}")
        base = load_base(args.base, device=device)
        for line in configure(refiner, base, top_n=args.top_n, radius=args.radius,
                              augmented=augmented, refiner_name=args.refiner,
                              base_name=str(args.base)):  # fmt: skip
            print(f"dualseg refine apply: {line}", file=sys.stderr)
    if hasattr(base, "require"):  # a probability folder: every image's map, before any output
        base.require([name for _, name in images], [str(path) for path, _ in images])
    # the base's colours, else those refine fit stored (an exported refiner has none)
    palette = base.palette or getattr(refiner, "palette", None)
    changed_total = pixels_total = 0
    failures: list[str] = []
    # a model on a plain forward: its backbone output is read, not rerun (a tap refiner
    # reads the base's modules on any forward: it holds the base to rerun it otherwise)
    plain = (not augmented and not args.amp) or getattr(refiner, "taps", None) is not None
    module = getattr(base, "module", None) if plain else None
    share = getattr(refiner, "shared_features", None)
    kept = share(module) if module is not None and share else contextlib.nullcontext()
    with kept as shared:
        for path, name in track(images, desc="refine", unit="img", mode=c.mode_of(args)):
            try:
                rgb = as_rgb_array(path)
            except DualsegError as err:
                failures.append(str(err))
                for folder in kinds if args.overwrite else ():  # an earlier run's, now stale
                    (out / folder / f"{name}.png").unlink(missing_ok=True)
                continue
            x = torch.from_numpy(normalize([rgb])).to(device)
            with torch.no_grad(), c.autocast(args, device):
                scores = base_scores(base, x, name, path, opts)
                if args.crf:  # probabilities: a model's logits, averaged ones are already
                    probs = (
                        scores.softmax(1) if hasattr(base, "module") and not augmented else scores
                    )
                    labels, changed = refiner.refine(x, probs)
                else:
                    features = shared.take(x) if shared is not None else None
                    labels, changed = refiner.refine(x, scores, return_changed=True,
                                                     features=features)  # fmt: skip
                palette = palette or default_palette(scores.shape[1])
            c.write_outputs(out, name, rgb, labels[0].cpu().numpy(), palette, alpha=args.alpha)
            mask = changed[0].cpu().numpy().astype(np.uint8) * 255
            atomic_save_image(out / "changed" / f"{name}.png", mask)
            changed_total += int(changed.sum())
            pixels_total += changed.numel()
    frac = 100 * changed_total / pixels_total if pixels_total else 0.0
    print(f"refined {len(images) - len(failures)} image(s): {changed_total} pixels changed "
          f"({frac:.3f}%) -> {out}")  # fmt: skip
    for message in failures:
        print(f"  skipped: {message}", file=sys.stderr)
    if failures:
        raise DataError(f"{len(failures)} of {len(images)} input image(s) could not be read")
    return 0


# ---------------------------------------------------------------------- layers
def layers_main(args: argparse.Namespace) -> int:
    base = load_base(args.base)
    model = getattr(base, "module", None)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"--base {args.base} holds saved probabilities, not a model: pass a checkpoint "
            "or file.py:NAME"
        )
    try:
        taps = list_taps(model, torch.zeros(1, 3, *args.size))
    except DualsegError:
        raise
    except Exception as err:  # the user's model on a blank image
        raise ConfigError(
            f"the base model failed on a 1x3x{args.size[0]}x{args.size[1]} sample "
            f"({type(err).__name__}: {err}); try another --size"
        ) from None
    print(f"{'module':<44} {'channels':>8} {'stride':>6}  size")
    for t in taps:
        print(f"{t.name:<44} {t.channels:>8} {t.stride:>6}  {t.size[0]}x{t.size[1]}")
    picked = pick_taps(model, taps)
    if picked:
        print(f"suggested: --base-features {picked[0]} {picked[1]} (or --base-features auto)")
    else:
        print("no taps picked for this layout: choose LOW (stride 4) and HIGH (stride 16 or 32)")
    return 0
