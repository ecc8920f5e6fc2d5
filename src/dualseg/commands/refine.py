"""``dualseg refine fit`` and ``dualseg refine apply`` (method B).

dualseg refine fit --data ROOT --base CKPT_OR_PROBS_DIR --out refiner.pt [options]
dualseg refine apply --refiner refiner.pt --base CKPT_OR_PROBS_DIR INPUTS... --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dualseg.commands import common as c
from dualseg.commands.predict import add_dataset_check_options
from dualseg.console import ArgumentParser, argparse_kwargs, track
from dualseg.data.transforms import SCALE_RANGE
from dualseg.errors import ConfigError, DataError, DualsegError, OutputError
from dualseg.refine.boundary import MAX_RADIUS
from dualseg.refine.config import OptionError, RefinerConfig


def radius_arg(text: str) -> int:
    """argparse ``type=`` of ``--radius``: 0..MAX_RADIUS pixels, refused at parsing."""
    return c.pixels_at_most(text, MAX_RADIUS)


# refine fit's flags checked at parsing, as refine apply's overrides of them are
PARSED = {"radius": radius_arg, "top_n": c.positive_int}


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """One flag per :class:`RefinerConfig` field: ``--embed-dim`` for ``embed_dim``."""
    for f in dataclasses.fields(RefinerConfig):
        kind = float if f.type == float | None else f.type
        kw: dict[str, Any] = {"type": PARSED.get(f.name, kind), "default": f.default}
        if f.type == tuple[int, ...]:
            kw.update(type=int, nargs="+", default=list(f.default))
        shown = " ".join(map(str, f.default)) if f.type == tuple[int, ...] else f.default
        help = f.metadata["help"] + (f" ({shown})" if f.default is not None else "")
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        p.add_argument(f"--{f.name.replace('_', '-')}", help=help, **kw)


def _add_fit(sub: argparse._SubParsersAction) -> None:
    from dualseg.refine.calibrate import METRICS

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
        "decision options on it with --base and keep the best (gate 0 = never relabel)")  # fmt: skip
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
        help="replace an existing --out and its --checkpoint with a new fit from step 0")  # fmt: skip
    c.add_quiet_arg(p)
    add("--no-progress", action="store_true", help="no progress bar (see --quiet)")
    add("--log-every", type=c.nonnegative_int, default=50,
        help="print a loss line every N steps (50; 0: off)")  # fmt: skip


def _add_apply(sub: argparse._SubParsersAction) -> None:
    from dualseg.commands.predict import add_inference_arguments

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
    add("--refiner", "-r", required=True, help="refiner file from 'refine fit', or an exported "
        "one ('dualseg export --refiner': its .onnx/.json pair or TorchScript .pt)")  # fmt: skip
    add(
        "--base", "-b", required=True, help="dualseg checkpoint or 'dualseg predict --probs' folder"
    )
    add("--out", "-o", required=True, help="output folder")
    c.add_overwrite_arg(p, what="output files in --out")
    add_dataset_check_options(p)
    add("--top-n", type=c.positive_int, help="override the refiner's Top-N")
    add("--radius", type=radius_arg, help="override the refiner's near-boundary radius")
    c.add_runtime_args(p)
    c.add_quiet_arg(p)
    add("--alpha", type=c.fraction, default=0.5, help="overlay opacity, 0-1 (0.5)")
    add_inference_arguments(p)  # how a checkpoint base runs; the refiner gets its (TTA) scores


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="dualseg refine",
        description="Method B: boundary re-optimization of any segmentation model.",
        **argparse_kwargs(
            "dualseg refine fit --data ROOT --base runs/camvid/best.pt --out refiner.pt",
            "dualseg refine apply photos/ -r refiner.pt -b runs/camvid/best.pt -o out/",
        ),
    )
    sub = p.add_subparsers(dest="command", metavar="{fit,apply}")
    sub.required = True
    _add_fit(sub)
    _add_apply(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return fit_main(args) if args.command == "fit" else apply_main(args)


# ---------------------------------------------------------------------- fit
def fit_main(args: argparse.Namespace) -> int:
    from dualseg.augment_defaults import check_augment_settings
    from dualseg.data.presets import require_same_classes
    from dualseg.io import check_writable
    from dualseg.refine import BoundaryRefiner, fit_run
    from dualseg.refine.base import load_base

    try:
        cfg = RefinerConfig(
            **{f.name: getattr(args, f.name) for f in dataclasses.fields(RefinerConfig)}
        )
    except OptionError as err:  # named as the command line gives it
        raise ConfigError(err.named(f"--{err.option.replace('_', '-')}")) from None
    if cfg.top_n == 1:
        note("fit", "--top-n 1 leaves each pixel one candidate, the base's label: this refiner "
             "can change no pixel (refine apply --top-n overrides it)")  # fmt: skip
    split = c.split_of(args.data, args.split, default="train")
    check_augment_settings(crop_size=tuple(args.crop_size), scale_range=tuple(args.scale_range),
                           names={"crop_size": "--crop-size", "scale_range": "--scale-range"})  # fmt: skip
    fit_run.check_options(cfg, split=split, calibrate_split=args.calibrate_split,
                          crop_size=args.crop_size, weights=args.weights,
                          init_backbone=args.init_backbone, has_base=args.base is not None)  # fmt: skip
    out = check_writable(args.out, kind="file", what="--out")
    checkpoint = Path(args.checkpoint) if args.checkpoint else out.with_suffix(".train.pt")
    check_writable(checkpoint, kind="file", what="--checkpoint")
    if out.resolve() == checkpoint.resolve():  # found at the first save, after the whole fit
        raise ConfigError(
            f"--checkpoint {checkpoint} is --out: the training state and the refiner need two "
            "files; drop --checkpoint (default: <out>.train.pt) or name another"
        )
    check_fit_files(out, checkpoint, base=args.base, data=args.data, layout=args.layout)
    fit_run.check_earlier_fit(out, checkpoint, resume=args.resume, overwrite=args.overwrite)
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
    if cfg.top_n != RefinerConfig.top_n:  # the default on a few-class dataset says nothing
        note_top_n_over_classes("fit", cfg.top_n, len(class_names))
    if base is not None and base.class_names is not None:
        require_same_classes(tuple(base.class_names), tuple(class_names),
                             model=f"the base model {args.base}", data=f"{args.data}")  # fmt: skip
    files = None if data.held_out is None else held_out_names(data.held_out)
    if files is not None and hasattr(base, "require"):  # a probability folder: before the fit
        base.require([name for _, name in files], [str(path) for path, _ in files])
    from_base = args.init_backbone == "base" or cfg.backbone_source != "independent"
    if from_base and not hasattr(base, "module"):
        raise ConfigError(
            "--init-backbone base / --backbone-source base-* need --base to be a dualseg checkpoint"
        )
    weights = None if args.init_backbone == "none" else (args.weights or "imagenet")
    if from_base:
        weights = args.weights  # ImageNet first only when a file is given explicitly
    inputs = fit_run.fit_inputs(args.data, **where, crop_size=args.crop_size, labels=labels,
                                scale_range=args.scale_range,
                                base=args.base if from_base else None)  # fmt: skip
    if args.overwrite:  # every input checked: the earlier fit's state goes now
        checkpoint.unlink(missing_ok=True)
    mode = "off" if args.no_progress else c.mode_of(args)
    with c.autocast(args, device):
        refiner = BoundaryRefiner.fit(
            data.train, class_names=class_names, config=cfg, prototype_dataset=data.prototypes,
            weights=weights, init_from=base.module if from_base else None, device=device,
            num_workers=args.workers, checkpoint=checkpoint,
            checkpoint_every=args.checkpoint_every, resume=args.resume,
            time_budget_s=None if args.time_budget is None else 60 * args.time_budget,
            progress=mode == "bar", log_every=0 if mode == "off" else args.log_every,
            fit_inputs=inputs,
        )  # fmt: skip
    if data.held_out is not None:
        print_calibration(refiner, base, data.held_out, files, args, device)
    refiner.save(out)
    if refiner.history:
        last = refiner.history[-1]
        print(f"step {last['step']}: loss {last['loss']:.4f}, violating triplets "
              f"{100 * last['violating']:.1f}%, mean margin {last['margin']:.3f}")  # fmt: skip
    missing = [n for n, p in zip(class_names, refiner.present.tolist()) if not p]
    print(f"refiner ({cfg.backbone}, C={cfg.embed_dim}, {refiner.num_classes} classes"
          + (f"; no prototype for {missing}" if missing else "") + f") -> {out}")  # fmt: skip
    return 0


def print_calibration(refiner: Any, base: Any, held_out: Any, files: Any, args: Any,
                      device: Any) -> None:  # fmt: skip
    from dualseg.refine.fit_run import calibrate, format_sweep

    split, metric = args.calibrate_split, args.calibrate_metric
    rows = calibrate(refiner, base, held_out, files, split=split, metric=metric, device=device)
    print(f"decision sweep on {split} ({len(held_out)} held-out images):")
    print(format_sweep(rows, metric=metric))
    cfg = refiner.config
    if cfg.gate_margin == 0:
        print("chosen: gate_margin 0, never relabel (refinement did not help this base)")
    else:
        from dualseg.refine.calibrate import DECISION_KEYS

        print("chosen: " + ", ".join(f"{k} {getattr(cfg, k)}" for k in DECISION_KEYS))


def note(command: str, text: str) -> None:
    print(f"dualseg refine {command}: note: {text}", file=sys.stderr)


def note_top_n_over_classes(command: str, top_n: int, num_classes: int) -> None:
    """Top-N above the classes makes every class a candidate, as at Top-N = C."""
    if top_n > num_classes:
        note(command, f"Top-N {top_n} is more than the {num_classes} classes: every class is "
             f"a candidate, as at Top-N {num_classes}")  # fmt: skip


def held_out_names(held_out: Any) -> list[tuple[Path, str]]:
    """``(path, name)`` of every held-out image, named as ``dualseg predict`` names outputs."""
    return c.unique_names([(Path(image), Path(image).stem) for image, _ in held_out.samples])


def check_fit_files(out: Path, checkpoint: Path, *, base: str | None, data: str,
                    layout: str = "auto") -> None:  # fmt: skip
    """Refuse, even with ``--overwrite``, an ``--out`` or ``--checkpoint`` that is the
    ``--base`` model, a file of the ``--data`` dataset, or an existing file of another kind
    than the one ``refine fit`` writes there (a refiner; its training state)."""
    from dualseg.engine.checkpoint import FORMAT as MODEL_FORMAT
    from dualseg.refine.formats import FORMAT, TRAIN_FORMAT
    from dualseg.serialization import torch_file_format

    protected = [(f"a file of the dataset {data}", c.dataset_files(data, layout=layout))]
    if base is not None and Path(base).is_file():
        protected.insert(0, ("the --base model", [Path(base)]))
    kinds = ((out, "--out", FORMAT, "a method-B refiner"),
             (checkpoint, "--checkpoint", TRAIN_FORMAT, "the training state of a refine fit"))  # fmt: skip
    for path, what, fmt, kind in kinds:
        c.check_outputs([path], overwrite=True, protected=protected, what=what)
        found = torch_file_format(path) if path.is_file() else ""
        if found not in (fmt, ""):
            model = " (a dualseg model checkpoint: pass it as --base)"
            model = model if found == MODEL_FORMAT else ""
            raise OutputError(
                f"{what} {path} exists and is not {kind}{model}; refine fit never writes over "
                f"another kind of file, not even with --overwrite: choose another {what}"
            )


# ---------------------------------------------------------------------- apply
def apply_main(args: argparse.Namespace) -> int:
    from dualseg.commands import predict
    from dualseg.engine.predict import as_rgb_array
    from dualseg.export.runtime import load_refiner
    from dualseg.imaging import normalize
    from dualseg.io import atomic_save_image, check_writable
    from dualseg.refine.base import OTHER_BASE, load_base, other_calibration_base
    from dualseg.viz import default_palette

    opts = predict.inference_options(args)
    out = check_writable(args.out, kind="dir", what="--out")
    images = predict.collect_images(args.inputs, out=out, command="refine apply")
    kinds = ("labels", "color", "overlay", "changed")
    predict.check_image_outputs(args, out, images, [(f, ".png") for f in kinds],
                                command="refine apply")  # fmt: skip
    device = c.apply_runtime(args)
    refiner = load_refiner(args.refiner, device=device)
    c.static_export_note(args.refiner, refiner, "refine")
    predict.check_dataset_classes(args, refiner.class_names, f"the refiner {args.refiner}")
    if text := refiner.calibration_note():
        note("apply", text)
    overrides = {k: getattr(args, k) for k in ("top_n", "radius") if getattr(args, k) is not None}
    if overrides and refiner.calibration is not None:  # the sweep ran at the stored ones
        stored = ", ".join(f"{k} {getattr(refiner.config, k)}" for k in overrides)
        note("apply", f"{args.refiner}'s decision options were chosen (--calibrate-split) at "
             f"{stored}; at other values they may no longer be the best")  # fmt: skip
    refiner.config = dataclasses.replace(refiner.config, **overrides)
    if "top_n" in overrides:  # the stored one was noted (if at all) by refine fit
        note_top_n_over_classes("apply", refiner.config.top_n, refiner.num_classes)
    if refiner.config.top_n == 1:
        note("apply", "Top-N 1 leaves each pixel one candidate, the base's label: no pixel "
             "can change")  # fmt: skip
    base = load_base(args.base, device=device)
    if base.class_names is not None:
        refiner.check_classes(base.class_names, len(base.class_names), what=str(args.base))
    if other_calibration_base(refiner, getattr(base, "module", None)):
        print(f"dualseg refine apply: warning: {OTHER_BASE.format(refiner=args.refiner)}",
              file=sys.stderr)  # fmt: skip
    if hasattr(base, "require"):  # a probability folder: every image's map, before any output
        base.require([name for _, name in images], [str(path) for path, _ in images])
    augmented = opts.mode != "whole" or opts.uses_tta
    if augmented and not hasattr(base, "module"):
        raise ConfigError(
            f"--mode slide and --tta-* run the base model, but --base {args.base} holds saved "
            "probabilities; pass a checkpoint, or save them with 'dualseg predict --probs' "
            "and the same options"
        )
    # the base's colours, else those refine fit stored (an exported refiner has none)
    palette = base.palette or refiner.palette or default_palette(refiner.num_classes)
    changed_total = pixels_total = 0
    failures: list[str] = []
    # a model on a plain forward: its backbone output is read, not rerun
    module = getattr(base, "module", None) if not augmented and not args.amp else None
    kept = refiner.shared_features(module) if module is not None else contextlib.nullcontext()
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
                scores = base_scores(base, x, name, path, opts, augmented)
                features = shared.take() if shared is not None else None
                labels, changed = refiner.refine(x, scores, return_changed=True, features=features)
            predict.write_outputs(
                out, name, rgb, labels[0].cpu().numpy(), palette, alpha=args.alpha
            )
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


def base_scores(base: Any, x: torch.Tensor, name: str, path: Path, opts: Any,
                augmented: bool) -> torch.Tensor:  # fmt: skip
    """The base's class scores for one image, with ``opts``' sliding window and TTA."""
    from dualseg.engine.inference import infer_logits

    scores = infer_logits(
        lambda t: base.scores(t, [name] * t.shape[0], sources=[str(path)] * t.shape[0]),
        x, mode=opts.mode, window=opts.window, stride=opts.stride, tta_scales=opts.tta_scales,
        tta_flip=opts.tta_flip, tile_batch=opts.tile_batch,
    ).float()  # fmt: skip
    return scores.softmax(1) if augmented else scores  # the averaged log-probabilities came back
