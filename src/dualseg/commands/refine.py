"""``dualseg refine fit`` and ``dualseg refine apply`` (method B).

dualseg refine fit --data ROOT --base CKPT_OR_PROBS_DIR --out refiner.pt [options]
dualseg refine apply --refiner refiner.pt --base CKPT_OR_PROBS_DIR INPUTS... --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dualseg.commands.common import (
    add_dataset_check_options,
    add_label_args,
    add_overwrite_arg,
    add_quiet_arg,
    add_runtime_args,
    apply_runtime,
    autocast,
    check_outputs,
    dataset_files,
    fraction,
    label_settings,
    mode_of,
    nonnegative_int,
    pixels_at_most,
    positive_int,
    split_of,
    static_export_note,
    unique_names,
)
from dualseg.console import ArgumentParser, argparse_kwargs, track
from dualseg.data.transforms import SCALE_RANGE
from dualseg.errors import ConfigError, DataError, DualsegError, OutputError, RunExistsError


def load_refiner(path: str | os.PathLike[str], *, device: Any = "cpu") -> Any:
    """Either refiner: a ``dualseg refine fit`` file (``BoundaryRefiner.load``) or an exported
    pair (its ``.json`` sidecar, ``.onnx`` model or exported TorchScript ``.pt``); what
    ``--refiner`` accepts in ``refine apply`` and ``serve``."""
    from dualseg.export.runtime import is_exported_torchscript, load_exported_refiner
    from dualseg.refine import BoundaryRefiner

    p = Path(path)
    if p.suffix.lower() in (".json", ".onnx") or is_exported_torchscript(p):
        exported = load_exported_refiner(p)
        static_export_note(p, exported, "refine")
        return exported
    return BoundaryRefiner.load(path, device=device)  # as given: Path() would break hf://


def _config_defaults():
    from dualseg.refine.refiner import RefinerConfig

    return RefinerConfig()


def _add_fit(sub: argparse._SubParsersAction) -> None:
    from dualseg.refine.calibrate import METRICS

    d = _config_defaults()
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
    p.add_argument("--data", required=True, help="dataset root (any layout build_dataset reads)")
    p.add_argument(
        "--base",
        help="the base model: a dualseg checkpoint or a 'dualseg predict --probs' folder; its "
        "class names must match the dataset's (and --init-backbone base copies its backbone)",
    )
    p.add_argument("--out", "-o", default="refiner.pt", help="refiner file to write (refiner.pt)")
    p.add_argument(
        "--split", help="split to fit on (train; a list file as --data: its name, val for val.txt)"
    )
    p.add_argument("--layout", default="auto", help="dataset layout (auto)")
    p.add_argument("--preset", help="class preset: camvid, voc, cityscapes, ade20k, synthetic")
    add_label_args(p, source="the --base checkpoint")
    p.add_argument(
        "--crop-size", type=int, nargs=2, default=(256, 256), metavar=("H", "W"), help="(256 256)"
    )
    p.add_argument(
        "--scale-range",
        type=float,
        nargs=2,
        default=SCALE_RANGE,
        metavar=("LO", "HI"),
        help=f"random scale of step 1 {SCALE_RANGE}",
    )
    p.add_argument("--backbone", default=d.backbone, help=f"embedding backbone ({d.backbone})")
    p.add_argument(
        "--init-backbone",
        choices=("imagenet", "base", "none"),
        default="imagenet",
        help="backbone initialization: ImageNet weights, the base checkpoint's backbone (same "
        "backbone name), or random (imagenet)",
    )
    p.add_argument(
        "--backbone-source",
        choices=("independent", "base-frozen", "base-finetune"),
        default=d.backbone_source,
        help="step 3: the embedding's own backbone, or the --base checkpoint's backbone weights "
        f"frozen (only the ASPP head learns) or fine-tuned ({d.backbone_source})",
    )
    p.add_argument(
        "--gate-margin",
        type=float,
        default=d.gate_margin,
        help="beyond the claim: relabel only where the base's top-1 minus top-2 probability is "
        "below this (default: no gate, the claim)",
    )
    p.add_argument(
        "--prior-weight",
        type=float,
        default=d.prior_weight,
        help="beyond the claim: add this times the base's negative log-probability to each "
        "candidate's squared distance (in units of the mean squared distance between "
        f"prototypes; {d.prior_weight:g}: the claim, nearest prototype)",
    )
    p.add_argument(
        "--min-prob",
        type=float,
        default=d.min_prob,
        help="beyond the claim: a Top-N candidate other than the base's top-1 needs at least "
        f"this base probability ({d.min_prob:g}: the claim)",
    )
    p.add_argument(
        "--p1-blur-sigma",
        type=float,
        default=d.p1_blur_sigma,
        help="P1's filtering: Gaussian blur (px) of the image the embedding model sees at "
        f"inference ({d.p1_blur_sigma:g}: none, normalization only)",
    )
    p.add_argument(
        "--calibrate-split",
        help="a labelled split of --data held out of --split (e.g. a list file's name): sweep "
        "gate, prior weight, probability floor and P1 blur on it with --base, keep the best "
        "(gate 0 = never relabel, when nothing helps)",
    )
    p.add_argument(
        "--calibrate-metric",
        choices=METRICS,
        default=METRICS[0],
        help=f"what --calibrate-split maximizes ({METRICS[0]}; boundary_f1: for the edges, at "
        "some cost in mIoU)",
    )
    p.add_argument("--weights", help="ImageNet weight file for the backbone (default: resolved)")
    p.add_argument("--embed-dim", type=int, default=d.embed_dim, help=f"C ({d.embed_dim})")
    p.add_argument(
        "--output-stride", type=int, default=d.output_stride, help=f"({d.output_stride})"
    )
    p.add_argument(
        "--aspp-rates", type=int, nargs="+", default=list(d.aspp_rates), help="(4 6 8 12)"
    )
    p.add_argument(
        "--decoder-channels",
        type=int,
        default=d.decoder_channels,
        help="beyond the claim: a DeepLabV3+ decoder fusing the backbone's stride-4 features, "
        f"projected to this many channels (DeepLabV3+ uses 48), into the embedding (default "
        f"{d.decoder_channels}: none)",
    )
    p.add_argument(
        "--input-scale",
        type=float,
        default=d.input_scale,
        help=f"the embedding model sees the image resized by this factor ({d.input_scale})",
    )
    p.add_argument(
        "--radius",
        type=radius_arg,
        default=d.radius,
        help=f"near-boundary radius ({d.radius})",
    )
    p.add_argument("--edge-method", default=d.edge_method, help=f"({d.edge_method})")
    p.add_argument(
        "--top-n", type=positive_int, default=d.top_n, help=f"Top-N at inference ({d.top_n})"
    )
    p.add_argument("--margin", type=float, default=d.margin, help=f"triplet margin Δ ({d.margin})")
    p.add_argument("--num-triplets", type=int, default=d.num_triplets, help=f"({d.num_triplets})")
    p.add_argument("--reduction", default=d.reduction, help="all | violating (all)")
    p.add_argument(
        "--mining",
        default=d.mining,
        help=f"false example F0: random (the claim) | semi-hard, among --mining-pool ({d.mining})",
    )
    p.add_argument(
        "--mining-pool",
        type=int,
        default=d.mining_pool,
        help=f"false examples per anchor for --mining semi-hard ({d.mining_pool})",
    )
    p.add_argument("--steps", type=int, default=d.steps, help=f"training steps ({d.steps})")
    p.add_argument(
        "--time-budget",
        type=float,
        metavar="MINUTES",
        help="stop the triplet steps after this many minutes, even before --steps (default: none)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=d.batch_size,
        help=f"crops per step, 2 or more ({d.batch_size})",
    )
    p.add_argument("--optimizer", default=d.optimizer, help="adamw | sgd (adamw)")
    p.add_argument("--lr", type=float, default=d.lr, help=f"({d.lr})")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help=f"({d.weight_decay})")
    p.add_argument("--momentum", type=float, default=d.momentum, help="SGD momentum (0.9)")
    p.add_argument("--seed", type=int, default=d.seed, help="(0)")
    p.add_argument(
        "--proto-images",
        type=nonnegative_int,
        default=0,
        help="use only the first N training images for the prototypes (0: all)",
    )
    add_runtime_args(p)
    p.add_argument("--workers", type=nonnegative_int, default=0, help="data loader workers (0)")
    p.add_argument(
        "--checkpoint", help="training-state file, for --resume (default: OUT with .train.pt)"
    )
    p.add_argument(
        "--checkpoint-every", type=positive_int, default=200, help="steps between saves (200)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from --checkpoint (when there is none yet: a new fit, said in one line)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out and its --checkpoint with a new fit from step 0 "
        "(without it, or --resume, an existing one is refused)",
    )
    add_quiet_arg(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (see --quiet)")
    p.add_argument(
        "--log-every",
        type=nonnegative_int,
        default=50,
        help="print a loss line every N steps (50; 0: off)",
    )


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
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="image files, folders or globs")
    p.add_argument(
        "--refiner",
        "-r",
        required=True,
        help="refiner file from 'refine fit', or an exported one ('dualseg export --refiner': "
        "its .onnx/.json pair or TorchScript .pt)",
    )
    p.add_argument(
        "--base",
        "-b",
        required=True,
        help="dualseg checkpoint or 'dualseg predict --probs' folder",
    )
    p.add_argument("--out", "-o", required=True, help="output folder")
    add_overwrite_arg(p, what="output files in --out")
    add_dataset_check_options(p)
    p.add_argument("--top-n", type=positive_int, help="override the refiner's Top-N")
    p.add_argument("--radius", type=radius_arg, help="override the refiner's near-boundary radius")
    add_runtime_args(p)
    add_quiet_arg(p)
    p.add_argument("--alpha", type=fraction, default=0.5, help="overlay opacity, 0-1 (0.5)")
    from dualseg.commands.common import add_inference_arguments

    add_inference_arguments(p)  # how a checkpoint base runs; the refiner gets its (TTA) scores


def radius_arg(text: str) -> int:
    """argparse ``type=`` of ``--radius``: 0..MAX_RADIUS pixels, refused at parsing."""
    from dualseg.refine.boundary import MAX_RADIUS

    return pixels_at_most(text, MAX_RADIUS)


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
# split names that are for reporting: never where method B's decision options are chosen
EVALUATION_SPLITS = ("val", "test")
MIN_CROP = 16  # px a side: the smallest fit crop that can hold a boundary band


def fit_main(args: argparse.Namespace) -> int:
    from dualseg.augment_defaults import check_augment_settings
    from dualseg.data import build_dataset, build_eval_transform, build_train_transform
    from dualseg.data.presets import require_same_classes
    from dualseg.io import check_writable
    from dualseg.refine.base import ProbsFolderBase, load_base
    from dualseg.refine.calibrate import DECISION_KEYS
    from dualseg.refine.refiner import BoundaryRefiner, RefinerConfig

    args.split = split_of(args.data, args.split, default="train")
    if args.batch_size < 2:  # found at the first step, as a BatchNorm traceback
        raise ConfigError(
            f"--batch-size {args.batch_size} cannot fit the embedding: its ASPP image-pooling "
            "BatchNorm needs 2 or more crops per step; use --batch-size 2 or more"
        )
    if args.steps < 1:
        raise ConfigError(
            f"--steps must be >= 1 (got {args.steps}): a refiner with no training steps "
            "would re-label pixels with an untrained embedding"
        )
    check_augment_settings(
        crop_size=tuple(args.crop_size),
        scale_range=tuple(args.scale_range),
        names={"crop_size": "--crop-size", "scale_range": "--scale-range"},
    )
    if min(args.crop_size) < MIN_CROP:  # found only after every step had drawn nothing
        raise ConfigError(
            f"--crop-size {args.crop_size[0]} {args.crop_size[1]} is too small to hold a class "
            f"boundary to draw triplets from; use at least {MIN_CROP} {MIN_CROP} (256 256)"
        )
    if args.weights and args.init_backbone == "none" and args.backbone_source == "independent":
        # none never reads the file (a base-* source reads it, then takes the base's backbone)
        raise ConfigError(
            f"--weights {args.weights} and --init-backbone none conflict: none starts the "
            "backbone from random weights and never reads the file; drop --weights, or drop "
            "--init-backbone none to initialize the backbone from it"
        )
    if args.calibrate_split and args.base is None:
        raise ConfigError("--calibrate-split scores the refiner on top of a base model: add --base")
    if args.top_n == 1:
        print(
            "dualseg refine fit: note: --top-n 1 leaves each pixel one candidate, the base's "
            "label: this refiner can change no pixel (refine apply --top-n overrides it)",
            file=sys.stderr,
        )
    defaults = RefinerConfig()
    given = [
        f"--{k.replace('_', '-')}"
        for k in DECISION_KEYS
        if getattr(args, k) != getattr(defaults, k)
    ]
    if args.calibrate_split and given:  # the sweep would replace them without a word
        raise ConfigError(
            f"{' and '.join(given)} and --calibrate-split both set the decision: "
            f"--calibrate-split chooses {', '.join(DECISION_KEYS[:-1])} and {DECISION_KEYS[-1]} "
            f"on held-out images; drop {' and '.join(given)}, or drop --calibrate-split to use "
            "your values"
        )
    if args.calibrate_split in EVALUATION_SPLITS:
        raise ConfigError(
            f"--calibrate-split {args.calibrate_split} is an evaluation split: choosing the "
            "decision options on it would report them on the images they were tuned on; carve "
            "a split from train (a list file, e.g. dev.txt) and calibrate on that"
        )
    if args.calibrate_split and args.calibrate_split == args.split:
        raise ConfigError(
            f"--calibrate-split {args.calibrate_split} is the --split the refiner is fitted on; "
            "the decision options must be chosen on labelled images held out of the fit: "
            "name another split (e.g. fit on train_fit, calibrate on dev)"
        )
    out = check_writable(args.out, kind="file", what="--out")
    checkpoint = Path(args.checkpoint) if args.checkpoint else out.with_suffix(".train.pt")
    check_writable(checkpoint, kind="file", what="--checkpoint")
    if out.resolve() == checkpoint.resolve():  # found at the first save, after the whole fit
        raise ConfigError(
            f"--checkpoint {checkpoint} is --out: the training state and the refiner need two "
            "files; drop --checkpoint (default: <out>.train.pt) or name another"
        )
    check_fit_files(out, checkpoint, base=args.base, data=args.data, layout=args.layout)
    check_earlier_fit(out, checkpoint, resume=args.resume, overwrite=args.overwrite)

    with options_as_flags():
        cfg = refiner_config(args)
    device = apply_runtime(args)
    mode = "off" if args.no_progress else mode_of(args)
    train_tf = build_train_transform(
        crop_size=tuple(args.crop_size), scale_range=tuple(args.scale_range)
    )
    base = None if args.base is None else load_base(args.base, device=device)
    # the labels read as the base was trained (its checkpoint's data.label_map ...), as eval
    # reads them: a refiner fit under another mapping would learn other classes than it refines
    label_format, label_map, ignore_value, taken = label_settings(
        args, getattr(base, "trained_data", None) or {}
    )
    if taken:
        print(
            f"dualseg refine fit: note: labels read as {args.base} was trained: "
            f"{', '.join(taken)} (--label-format / --label-map / --ignore-index change it)",
            file=sys.stderr,
        )
    common = {"split": args.split, "layout": args.layout, "preset": args.preset}
    labels = {"label_format": label_format, "label_map": label_map, "ignore_value": ignore_value}
    train = build_dataset(args.data, transform=train_tf, seed=args.seed, **common, **labels)
    held_out = calibration_dataset(args, train, labels) if args.calibrate_split else None
    protos = build_dataset(args.data, transform=build_eval_transform(), **common, **labels)
    if args.proto_images > 0:
        protos = torch.utils.data.Subset(protos, range(min(args.proto_images, len(protos))))
    class_names = train.meta.class_names
    if args.top_n != defaults.top_n:  # the default on a few-class dataset says nothing
        note_top_n_over_classes("fit", args.top_n, len(class_names))

    if base is not None and base.class_names is not None:
        require_same_classes(
            tuple(base.class_names),
            tuple(class_names),
            model=f"the base model {args.base}",
            data=f"{args.data}",
        )
    if held_out is not None and isinstance(base, ProbsFolderBase):  # before the fit, not after
        files = held_out_names(held_out)
        base.require([name for _, name in files], [str(path) for path, _ in files])
    from_base = args.init_backbone == "base" or args.backbone_source != "independent"
    if from_base and not hasattr(base, "module"):
        raise ConfigError(
            "--init-backbone base / --backbone-source base-* need --base to be a dualseg checkpoint"
        )

    weights = None if args.init_backbone == "none" else (args.weights or "imagenet")
    init_from = None
    if from_base:
        weights = args.weights  # ImageNet first only when a file is given explicitly
        init_from = base.module  # type: ignore[union-attr]

    if args.overwrite:
        # every input checked: the earlier fit's training state goes now, or a new fit stopped
        # before its first save would leave it for a later --resume to continue
        checkpoint.unlink(missing_ok=True)
    with autocast(args, device):
        refiner = BoundaryRefiner.fit(
            train,
            class_names=class_names,
            config=cfg,
            prototype_dataset=protos,
            weights=weights,
            init_from=init_from,
            device=device,
            num_workers=args.workers,
            checkpoint=checkpoint,
            checkpoint_every=args.checkpoint_every,
            resume=args.resume,
            time_budget_s=None if args.time_budget is None else 60 * args.time_budget,
            progress=mode == "bar",
            log_every=0 if mode == "off" else args.log_every,
            fit_inputs=fit_inputs(args, from_base=from_base, labels=labels),
        )
    if held_out is not None:
        calibrate(refiner, base, args, device, held_out=held_out)
    refiner.save(out)
    last = refiner.history[-1] if refiner.history else None
    if last is not None:
        print(
            f"step {last['step']}: loss {last['loss']:.4f}, violating triplets "
            f"{100 * last['violating']:.1f}%, mean margin {last['margin']:.3f}"
        )
    missing = [n for n, p in zip(class_names, refiner.present.tolist()) if not p]
    print(
        f"refiner ({cfg.backbone}, C={cfg.embed_dim}, {refiner.num_classes} classes"
        + (f"; no prototype for {missing}" if missing else "")
        + f") -> {out}"
    )
    return 0


def note_top_n_over_classes(command: str, top_n: int, num_classes: int) -> None:
    """Say so when Top-N is more than the classes: every class is then a candidate, as at
    Top-N = C (the decision takes the top ``min(N, C)``), which a user asking for more did
    not see before."""
    if top_n > num_classes:
        print(
            f"dualseg refine {command}: note: Top-N {top_n} is more than the {num_classes} "
            f"classes: every class is a candidate, as at Top-N {num_classes}",
            file=sys.stderr,
        )


@contextlib.contextmanager
def options_as_flags() -> Iterator[None]:
    """A :class:`RefinerConfig` value error names the option as the command line gives it
    (``--margin``, not ``margin``)."""
    from dualseg.refine import RefinerConfig

    try:
        yield
    except ConfigError as err:
        text = str(err)
        field = text.split(" ", 1)[0]
        if field in {f.name for f in dataclasses.fields(RefinerConfig)}:
            text = f"--{field.replace('_', '-')}{text[len(field) :]}"
        raise ConfigError(text) from None


def refiner_config(args: argparse.Namespace) -> Any:
    """The :class:`RefinerConfig` of ``refine fit``'s flags."""
    from dualseg.refine import RefinerConfig

    return RefinerConfig(
        backbone=args.backbone,
        embed_dim=args.embed_dim,
        output_stride=args.output_stride,
        aspp_rates=tuple(args.aspp_rates),
        input_scale=args.input_scale,
        radius=args.radius,
        edge_method=args.edge_method,
        top_n=args.top_n,
        margin=args.margin,
        num_triplets=args.num_triplets,
        reduction=args.reduction,
        mining=args.mining,
        mining_pool=args.mining_pool,
        steps=args.steps,
        batch_size=args.batch_size,
        optimizer=args.optimizer,
        lr=args.lr,
        weight_decay=args.weight_decay,
        momentum=args.momentum,
        seed=args.seed,
        backbone_source=args.backbone_source,
        gate_margin=args.gate_margin,
        prior_weight=args.prior_weight,
        min_prob=args.min_prob,
        p1_blur_sigma=args.p1_blur_sigma,
        decoder_channels=args.decoder_channels,
    )


def fit_inputs(
    args: argparse.Namespace, *, from_base: bool, labels: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What the triplet steps of a fit read beyond its RefinerConfig — the data stream, how
    its labels are read, and the base a ``base-*`` fit is built on (by its path or hub name) —
    so that a ``--resume`` must give the same. The backbone initialization and
    ``--proto-images`` are left out: a resume loads the whole network from its state, and the
    prototypes are computed after it. ``labels`` (``label_format`` / ``label_map`` /
    ``ignore_value``) is recorded only when it differs from the dataset's own reading, which
    is what a state written before it was recorded used."""
    from dualseg.engine.pretrained import is_hub_source

    base = None
    if from_base:
        base = args.base if is_hub_source(args.base) else str(Path(args.base).resolve())
    inputs: dict[str, Any] = {
        "data": str(Path(args.data).resolve()),
        "split": args.split,
        "layout": args.layout,
        "preset": args.preset,
        "crop_size": list(args.crop_size),
        "scale_range": list(args.scale_range),
        "base": base,
    }
    if labels is not None:
        fmt, mapping, ignore = labels["label_format"], labels["label_map"], labels["ignore_value"]
        if (fmt, mapping or None, ignore) != ("index", None, "auto"):
            inputs["labels"] = {
                "label_format": fmt,
                "label_map": sorted([int(k), int(v)] for k, v in (mapping or {}).items()),
                "ignore_value": ignore,
            }
    return inputs


def check_fit_files(
    out: Path, checkpoint: Path, *, base: str | None, data: str, layout: str = "auto"
) -> None:
    """Refuse, even with ``--overwrite``, an ``--out`` or ``--checkpoint`` that is the
    ``--base`` model, a file of the ``--data`` dataset, or an existing file of another kind
    than the one ``refine fit`` writes there (a refiner; its training state)."""
    from dualseg.engine.checkpoint import FORMAT as MODEL_FORMAT
    from dualseg.refine.formats import FORMAT, TRAIN_FORMAT
    from dualseg.serialization import torch_file_format

    protected = [(f"a file of the dataset {data}", dataset_files(data, layout=layout))]
    if base is not None and Path(base).is_file():
        protected.insert(0, ("the --base model", [Path(base)]))
    kinds = (
        (out, "--out", FORMAT, "a method-B refiner"),
        (checkpoint, "--checkpoint", TRAIN_FORMAT, "the training state of a refine fit"),
    )
    for path, what, fmt, kind in kinds:
        check_outputs([path], overwrite=True, protected=protected, what=what)
        if not path.is_file():
            continue
        found = torch_file_format(path)
        if found not in (fmt, ""):
            model = " (a dualseg model checkpoint: pass it as --base)"
            model = model if found == MODEL_FORMAT else ""
            raise OutputError(
                f"{what} {path} exists and is not {kind}{model}; refine fit never writes over "
                f"another kind of file, not even with --overwrite: choose another {what}"
            )


def check_earlier_fit(out: Path, checkpoint: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse to replace an earlier fit by accident: an existing ``out`` (refiner) or
    ``checkpoint`` (its training state) needs ``resume`` or ``overwrite``. ``resume`` with no
    training state starts a new fit, said in one line, unless that would replace ``out``."""
    if overwrite and resume:
        raise ConfigError(
            "--resume continues the earlier fit and --overwrite replaces it with a new one: "
            "pass one of them"
        )
    if overwrite:  # the earlier state goes when the new fit starts (fit_main), not before
        return
    if resume:
        if checkpoint.is_file():
            return
        if out.exists():
            raise RunExistsError(
                f"--resume: no training state {checkpoint} to continue {out} from, and a new "
                "fit would replace it; pass --overwrite to fit a new refiner in its place, "
                "--checkpoint FILE for its state, or another --out"
            )
        print(
            f"dualseg refine fit: note: --resume: no training state {checkpoint} yet; "
            "starting a new fit from step 0",
            file=sys.stderr,
        )
        return
    if out.exists():
        raise RunExistsError(
            f"--out {out} already holds a refiner; replace it with --overwrite, continue its "
            "training with --resume, or choose another --out"
        )
    if checkpoint.exists():
        raise RunExistsError(
            f"{checkpoint} holds the training state of an earlier fit; continue it with "
            "--resume, start over with --overwrite, or choose another --out / --checkpoint"
        )


def calibration_dataset(args: argparse.Namespace, train: Any, labels: dict[str, Any]) -> Any:
    """The ``--calibrate-split`` dataset (labels read as ``labels`` says, as the fit's), built
    (and checked) before the fit: it must exist and hold none of the ``--split`` images the
    refiner is fitted on."""
    import re

    from dualseg.data import build_dataset, build_eval_transform

    try:
        held_out = build_dataset(
            args.data,
            split=args.calibrate_split,
            layout=args.layout,
            preset=args.preset,
            transform=build_eval_transform(),
            **labels,
        )
    except DataError as err:  # the dataset's messages name --split: here it is this flag
        raise DataError(re.sub(r"--split\b", "--calibrate-split", str(err))) from None

    def images(ds: Any) -> set[Path]:
        return {Path(image).resolve() for image, _ in getattr(ds, "samples", [])}

    calibrating = [image for image, _ in getattr(held_out, "samples", [])]
    others = [(f"--split {args.split}", "held out of the fit", images(train))]
    for split in EVALUATION_SPLITS:  # val under another name would be tuned on, then scored
        try:
            evaluated = build_dataset(args.data, split=split, layout=args.layout,
                                      preset=args.preset, **labels)  # fmt: skip
        except DataError:  # no such split: nothing to keep apart
            continue
        others.append((f"the {split} split", f"apart from {split}, where it is scored",
                       images(evaluated)))  # fmt: skip
    for name, why, taken in others:
        shared = [image for image in calibrating if Path(image).resolve() in taken]
        if shared:
            raise ConfigError(
                f"{len(shared)} of the {len(held_out)} --calibrate-split {args.calibrate_split} "
                f"images are also in {name} (e.g. {shared[0]}); the decision options must be "
                f"chosen on images {why}: carve the calibration split from train"
            )
    return held_out


def held_out_names(held_out: Any) -> list[tuple[Path, str]]:
    """``(image path, name)`` of every ``--calibrate-split`` image, named as ``dualseg predict``
    names its outputs (file stem, ``_<k>`` for repeats): how a probability folder is read."""
    return unique_names([(Path(image), Path(image).stem) for image, _ in held_out.samples])


def calibrate(
    refiner: Any,
    base: Any,
    args: argparse.Namespace,
    device: Any,
    *,
    held_out: Any,
) -> None:
    """Choose the decision options (gate τ, prior weight λ, probability floor) on
    ``--calibrate-split`` (``held_out``: that dataset, built and checked before the fit by
    :func:`calibration_dataset`), store them in the refiner with the sweep's table, and print
    the best rows."""
    from dualseg.io import file_digest
    from dualseg.refine.base import model_fingerprint
    from dualseg.refine.calibrate import choose_decision, sweep_decision

    files = held_out_names(held_out)
    at: list[tuple[Path, str]] = []  # the image the sweep scores now: a folder base needs it

    def batches() -> Any:
        for i in range(len(held_out)):
            image, label = held_out[i]
            at[:] = files[i : i + 1]
            yield image[None], label[None]

    def base_scores(x: torch.Tensor) -> torch.Tensor:  # logits or probabilities: both read
        ((path, name),) = at
        return base.scores(x, [name], sources=[str(path)])

    module = getattr(base, "module", None)  # a model's backbone output is read, not rerun
    kept = refiner.shared_features(module) if module is not None else contextlib.nullcontext()
    with kept as shared:
        rows = sweep_decision(
            refiner,
            base_scores,
            batches(),
            num_classes=refiner.num_classes,
            ignore_index=held_out.meta.ignore_index,
            device=device,
            shared=shared,
        )
    metric = args.calibrate_metric
    chosen = choose_decision(rows, metric=metric)
    refiner.config = dataclasses.replace(refiner.config, **chosen)
    refiner.calibration = {
        "split": args.calibrate_split,
        "images": len(held_out),
        # by content: eval finds these images under any split name, root or file name
        "image_digests": [file_digest(path) for path, _ in files],
        "metric": metric,
        "rows": rows,
        # the base these options were chosen for (a model's; a probability folder: unknown)
        "base_fingerprint": None if module is None else model_fingerprint(module),
    }
    print(f"decision sweep on {args.calibrate_split} ({len(held_out)} held-out images):")
    print(format_sweep(rows, metric=metric))
    if chosen["gate_margin"] == 0:
        print("chosen: gate_margin 0, never relabel (refinement did not help this base)")
    else:
        print("chosen: " + ", ".join(f"{k} {v}" for k, v in chosen.items()))


def format_sweep(rows: list[dict[str, Any]], *, metric: str, best: int = 5) -> str:
    """The base row, the claim's row and the ``best`` rows by ``metric``, one line each."""
    from dualseg.refine.calibrate import CLAIM_DECISION
    from dualseg.refine.decision import describe_decision

    def setting(r: dict[str, Any]) -> dict[str, Any]:  # a reading missing from a row: default
        return {k: r.get(k, v) for k, v in CLAIM_DECISION.items()}

    base = [r for r in rows if r["gate_margin"] == "base"]
    claims = [r for r in rows if r not in base and setting(r) == CLAIM_DECISION]
    rest = sorted((r for r in rows if r not in base), key=lambda r: (-r[metric], r["changed"]))
    lines = []
    for r in [*base, *claims, *[r for r in rest[:best] if r not in claims]]:
        name = "base model" if r in base else describe_decision(**setting(r))
        lines.append(
            f"  {name:>32}: mIoU {100 * r['miou']:.1f}  boundary F1 "
            f"{100 * r['boundary_f1']:.1f}  changed {100 * r['changed']:.2f}%"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- apply
def apply_main(args: argparse.Namespace) -> int:
    from dualseg.commands.common import (
        check_dataset_classes,
        check_image_outputs,
        collect_images,
        inference_options,
        write_outputs,
    )
    from dualseg.engine.inference import infer_logits
    from dualseg.engine.predict import as_rgb_array
    from dualseg.imaging import normalize
    from dualseg.io import atomic_save_image, check_writable
    from dualseg.refine.base import OTHER_BASE, load_base, other_calibration_base
    from dualseg.viz import default_palette

    opts = inference_options(args)
    out = check_writable(args.out, kind="dir", what="--out")
    images = collect_images(args.inputs, out=out, command="refine apply")
    kinds = ("labels", "color", "overlay", "changed")
    check_image_outputs(
        out, images, [(f, ".png") for f in kinds], overwrite=args.overwrite, data=args.data,
        command="refine apply",
    )
    device = apply_runtime(args)
    refiner = load_refiner(args.refiner, device=device)
    check_dataset_classes(args, refiner.class_names, f"the refiner {args.refiner}")
    note = getattr(refiner, "calibration_note", lambda: None)()
    if note:
        print(f"dualseg refine apply: note: {note}", file=sys.stderr)
    overrides = {k: getattr(args, k) for k in ("top_n", "radius") if getattr(args, k) is not None}
    if overrides:
        if getattr(refiner, "calibration", None) is not None:  # the sweep ran at the stored ones
            stored = ", ".join(f"{k} {getattr(refiner.config, k)}" for k in overrides)
            print(
                f"dualseg refine apply: note: {args.refiner}'s decision options were chosen "
                f"(--calibrate-split) at {stored}; at other values they may no longer be the best",
                file=sys.stderr,
            )
        refiner.config = dataclasses.replace(refiner.config, **overrides)
    if "top_n" in overrides:  # the stored one was noted (if at all) by refine fit
        note_top_n_over_classes("apply", refiner.config.top_n, refiner.num_classes)
    if refiner.config.top_n == 1:
        print(
            "dualseg refine apply: note: Top-N 1 leaves each pixel one candidate, the base's "
            "label: no pixel can change",
            file=sys.stderr,
        )
    base = load_base(args.base, device=device)
    if base.class_names is not None:
        refiner.check_classes(base.class_names, len(base.class_names), what=str(args.base))
    if other_calibration_base(refiner, getattr(base, "module", None)):
        print(
            f"dualseg refine apply: warning: {OTHER_BASE.format(refiner=args.refiner)}",
            file=sys.stderr,
        )
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
    palette = (
        base.palette or getattr(refiner, "palette", None) or default_palette(refiner.num_classes)
    )
    changed_total = pixels_total = 0
    failures: list[str] = []
    # a model on a plain forward: its backbone output is read, not rerun
    module = getattr(base, "module", None) if not augmented and not args.amp else None
    kept = refiner.shared_features(module) if module is not None else contextlib.nullcontext()
    with kept as shared:
        for path, name in track(images, desc="refine", unit="img", mode=mode_of(args)):
            try:
                rgb = as_rgb_array(path)
            except DualsegError as err:
                failures.append(str(err))
                for folder in kinds if args.overwrite else ():
                    # an earlier run's outputs of this image: another refiner's, now stale
                    (out / folder / f"{name}.png").unlink(missing_ok=True)
                continue
            x = torch.from_numpy(normalize([rgb])).to(device)
            with torch.no_grad(), autocast(args, device):
                scores = infer_logits(
                    lambda t, name=name, path=path: base.scores(
                        t, [name] * t.shape[0], sources=[str(path)] * t.shape[0]
                    ),
                    x,
                    mode=opts.mode,
                    window=opts.window,
                    stride=opts.stride,
                    tta_scales=opts.tta_scales,
                    tta_flip=opts.tta_flip,
                    tile_batch=opts.tile_batch,
                )
                scores = scores.float()
                if augmented:  # the averaged probabilities (their log came back)
                    scores = scores.softmax(1)
                features = shared.take() if shared is not None else None
                labels, changed = refiner.refine(x, scores, return_changed=True, features=features)
            label = labels[0].cpu().numpy()
            write_outputs(out, name, rgb, label, palette, alpha=args.alpha)
            atomic_save_image(
                out / "changed" / f"{name}.png", changed[0].cpu().numpy().astype(np.uint8) * 255
            )
            changed_total += int(changed.sum())
            pixels_total += changed.numel()
    done = len(images) - len(failures)
    frac = 100 * changed_total / pixels_total if pixels_total else 0.0
    print(f"refined {done} image(s): {changed_total} pixels changed ({frac:.3f}%) -> {out}")
    if failures:
        for message in failures:
            print(f"  skipped: {message}", file=sys.stderr)
        raise DataError(f"{len(failures)} of {len(images)} input image(s) could not be read")
    return 0
