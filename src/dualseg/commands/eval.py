"""``dualseg eval``: score a checkpoint on a dataset split.

Prints mIoU beside the majority-class baseline, a per-class IoU table, pixel / mean accuracy,
boundary F1 and trimap mIoU (percent) and the median time per image, and writes into ``OUT``
``metrics.json`` (every score as a fraction, NaN -> null), ``confusion_matrix.png`` and
``per_class_iou.png`` (+ ``confusion_matrix_refined.png`` with ``--refiner``).
``--save-predictions DIR`` writes ``DIR/labels/<name>.png`` and ``DIR/color/<name>.png``.
An earlier evaluation in ``OUT`` and existing prediction files are refused unless
``--overwrite``; a dataset file never is written over.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from dualseg.commands.common import (
    NO_MAP,
    add_inference_arguments,
    add_label_args,
    add_overwrite_arg,
    add_pixel_args,
    add_quiet_arg,
    add_runtime_args,
    apply_runtime,
    cuda_amp,
    explicit_label_args,
    inference_options,
    label_settings,
    mode_of,
    nonnegative_int,
    pixels_at_most,
    split_of,
)
from dualseg.console import ArgumentParser, argparse_kwargs, track
from dualseg.data import read_label
from dualseg.data.collate import SameSizeCollate
from dualseg.data.contract import count_seen
from dualseg.data.presets import parse_label_map
from dualseg.engine.checkpoint import contract_of
from dualseg.engine.evaluation import evaluate, format_metrics, model_dataset, sanity_warnings
from dualseg.engine.outputs import (
    FIGURES,
    PredictionWriter,
    check_eval_outputs,
    default_out,
    mixed_size_batch,
    write_figures,
)
from dualseg.engine.preflight import scored_classes_note
from dualseg.engine.pretrained import load_network
from dualseg.errors import DataError, DualsegError
from dualseg.io import atomic_write_json
from dualseg.metrics import BOUNDARY_TOLERANCE, MAX_WIDTH, TRIMAP_WIDTH, to_jsonable
from dualseg.refine import BoundaryRefiner
from dualseg.refine.base import OTHER_BASE, other_calibration_base
from dualseg.refine.calibrate import calibrated_on
from dualseg.refine.formats import check_contract


def build_parser() -> argparse.ArgumentParser:

    p = ArgumentParser(
        prog="dualseg eval",
        description="Evaluate a checkpoint: mIoU, per-class IoU, pixel accuracy, "
        "boundary F1 and trimap mIoU; writes metrics.json.",
        **argparse_kwargs(
            "dualseg eval -c runs/camvid/best.pt --data ../shared/data/camvid --split val",
            "dualseg eval -c runs/camvid/best.pt --data ROOT --refiner runs/camvid/refiner.pt",
        ),
    )
    add = p.add_argument
    add("--checkpoint", "-c", required=True, help="a dualseg checkpoint (.pt), a pretrained "
        "folder or hf://org/name")  # fmt: skip
    add("--data", "-d", required=True, help="dataset root folder")
    add("--split", help="split to evaluate (val; a list file as --data: its name)")
    add("--layout", default="auto", help="auto | list | folder | voc | cityscapes | ade20k")
    add("--preset", help="dataset preset (camvid, voc, cityscapes, ade20k, synthetic); default: "
        "ROOT/meta.json, else the classes stored in the checkpoint")  # fmt: skip
    add_label_args(p, source="the checkpoint")
    add_pixel_args(p, source="the checkpoint")
    add("--out", "-o", help="folder for metrics.json (<checkpoint dir>/eval_SPLIT for best.pt, "
        "eval_SPLIT_NAME for another checkpoint, + _refined / _slide / _tta for those "
        "evaluations; ./eval_SPLIT_NAME for hf://org/NAME)")  # fmt: skip
    add("--save-predictions", metavar="DIR", help="write label and colour PNGs "
        "(DIR/labels/<name>.png, DIR/color/<name>.png)")  # fmt: skip
    add_overwrite_arg(p, what="an earlier evaluation in OUT, and --save-predictions files")
    add("--refiner", help="a method-B refiner file (dualseg refine fit)")
    add("--batch-size", type=int, default=1, help="images per batch (1)")
    add("--workers", type=nonnegative_int, default=0, help="DataLoader worker processes (0)")
    add_runtime_args(p)
    add_quiet_arg(p)
    add("--boundary-tolerance", type=width_arg, default=BOUNDARY_TOLERANCE,
        help=f"boundary F1 tolerance px ({BOUNDARY_TOLERANCE})")  # fmt: skip
    add("--trimap-width", type=width_arg, default=TRIMAP_WIDTH,
        help=f"trimap band width px ({TRIMAP_WIDTH})")  # fmt: skip
    add_inference_arguments(p)
    return p


def width_arg(text: str) -> int:
    """``--boundary-tolerance`` / ``--trimap-width``: 0..MAX_WIDTH px."""
    return pixels_at_most(text, MAX_WIDTH)


def _load_refiner(
    args: argparse.Namespace, dataset: Any, device: Any, model: Any, contract: Any
) -> Any:
    """``--refiner``, with a warning when it was calibrated for another base or on the images
    evaluated here (its refined scores would be optimistic)."""
    refiner = BoundaryRefiner.load(args.refiner, device=device)
    if other_calibration_base(refiner, model):
        print(f"dualseg eval: warning: {OTHER_BASE.format(refiner=args.refiner)}", file=sys.stderr)
    if note := refiner.calibration_note():
        print(f"dualseg eval: note: {note}", file=sys.stderr)
    images = [image for image, _ in dataset.samples]
    calibration = refiner.calibration or {}
    shared = calibrated_on(refiner.calibration, images)
    if shared is None and calibration.get("split") == args.split:
        shared = len(images)  # a refiner stored before the digests: known by its split's name
    if shared:
        print(
            f"dualseg eval: warning: {args.refiner}'s decision options were chosen "
            f"(--calibrate-split {calibration.get('split')}) on {shared} of the {len(images)} "
            "images evaluated here: its refined scores are optimistic; evaluate on images held "
            "out of the calibration, or calibrate on a split carved from train",
            file=sys.stderr,
        )
    names = dataset.meta.class_names
    refiner.check_classes(names, len(names), what=f"the checkpoint (refiner {args.refiner})")
    check_contract(refiner, contract, refiner_name=args.refiner,
                   model_name=f"the checkpoint {args.checkpoint}")  # fmt: skip
    return refiner


def _warn_training_images(args: argparse.Namespace, dataset: Any, ckpt: dict) -> None:
    """A warning when evaluated images are training images of the checkpoint (by content)."""
    if (seen := ckpt.get("train_images")) is None:
        return
    images = [image for image, _ in dataset.samples]
    if shared := count_seen(images, seen):
        print(
            f"dualseg eval: warning: {shared} of the {len(images)} images evaluated here were "
            f"training images of {args.checkpoint} (same file content): its scores on them are "
            "optimistic; evaluate on images held out of training",
            file=sys.stderr,
        )


def _held_out_fraction(args: argparse.Namespace, trained: dict[str, Any]) -> float:
    """The model's ``data.val_fraction`` when ``--split val`` names the share training held out
    of this very root (it has no val split of its own), else 0: all its images would be read."""
    fraction = float(trained.get("val_fraction") or 0)
    roots = trained.get("root") or ()
    roots = [roots] if isinstance(roots, str) else list(roots)
    here = Path(args.data).resolve()
    if not fraction or args.split != "val" or all(Path(r).resolve() != here for r in roots):
        return 0.0
    print(
        f"dualseg eval: note: split val is the {fraction:g} of {args.data}'s images that "
        f"{args.checkpoint} held out of training (data.val_fraction), chosen by file name",
        file=sys.stderr,
    )
    return fraction


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Evaluate as the command line describes; returns the metrics (also written to disk)."""
    if args.batch_size < 1:
        raise DualsegError(f"--batch-size must be >= 1, got {args.batch_size}")
    args.split = split_of(args.data, args.split, default="val")
    opts = inference_options(args)
    variant = "".join(v for v, on in (("_refined", args.refiner), ("_slide", opts.mode == "slide"),
                                      ("_tta", opts.uses_tta)) if on)  # fmt: skip
    out = Path(args.out) if args.out else default_out(args.checkpoint, args.split, variant=variant)
    stale = check_eval_outputs(
        out, args.save_predictions, data=args.data, split=args.split, layout=args.layout,
        refined=bool(args.refiner), overwrite=args.overwrite,
    )  # fmt: skip
    if args.label_map and args.label_map.lower() not in NO_MAP:
        parse_label_map(args.label_map)  # a bad value: one line before the model loads
    device = apply_runtime(args)
    model, _, ckpt = load_network(args.checkpoint, device=device)
    trained = (ckpt.get("config") or {}).get("data") or {}
    note = f"dualseg eval: note: labels read as {args.checkpoint} was trained"
    label_format, label_map, ignore, _ = label_settings(args, trained, note=note)
    contract = contract_of(ckpt)
    dataset = model_dataset(
        args.data, split=args.split, layout=args.layout, preset=args.preset, contract=contract,
        stored="label_contract" in ckpt, explicit=explicit_label_args(args),
        model_name=f"the checkpoint {args.checkpoint}", label_format=label_format,
        label_map=label_map, ignore_value=ignore,
        bit_depth=contract.bit_depth if args.bit_depth is None else args.bit_depth,
        max_megapixels=args.max_megapixels, val_fraction=_held_out_fraction(args, trained),
    )  # fmt: skip
    _warn_training_images(args, dataset, ckpt)
    if args.batch_size > 1 and (mixed := mixed_size_batch(dataset.samples, args.batch_size)):
        raise DataError(f"{mixed}; use --batch-size 1 (eval runs each image at its own size)")
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
        pin_memory=device.type == "cuda",
        collate_fn=SameSizeCollate("use --batch-size 1 (eval runs each image at its own size)"),
    )  # fmt: skip
    refiner = _load_refiner(args, dataset, device, model, contract) if args.refiner else None
    hook = None
    if args.save_predictions:  # every label read before the first prediction is written
        for _, label_path in dataset.samples:
            read_label(label_path, dataset.meta, label_format=dataset.label_format)
        hook = PredictionWriter(dataset.samples, Path(args.save_predictions),
                                dataset.meta.palette, args.batch_size)  # fmt: skip
    mode = mode_of(args)
    try:
        metrics = evaluate(
            model, loader if mode == "bar" else track(loader, desc="eval", unit="batch", mode=mode),
            num_classes=dataset.meta.num_classes, ignore_index=dataset.meta.ignore_index,
            device=device, boundary_tolerance=args.boundary_tolerance,
            trimap_width=args.trimap_width, refiner=refiner, amp=cuda_amp(args, device),
            on_batch=hook, progress=mode == "bar", mode=opts.mode, window=opts.window,
            stride=opts.stride, tta_scales=opts.tta_scales, tta_flip=opts.tta_flip,
            tile_batch=opts.tile_batch,
        )  # fmt: skip
    except BaseException:  # an unreadable image, Ctrl-C: no partial set of predictions stays
        if hook is not None and (removed := hook.undo()):
            print(
                f"dualseg eval: note: removed the {removed} prediction files this evaluation "
                f"had written to {args.save_predictions}",
                file=sys.stderr,
            )
        raise
    _report(args, metrics, dataset.meta.class_names, opts, device, out)
    for path in stale:
        path.unlink(missing_ok=True)
    return metrics


def _report(args: argparse.Namespace, metrics: dict, names: Any, opts: Any, device: Any,
            out: Path) -> None:  # fmt: skip
    """Print the scores and warnings, then write metrics.json and the figures."""
    print(
        f"{args.checkpoint} on {args.data} [{args.split}], {metrics['num_images']} images, "
        f"batch size {args.batch_size}, {device}, {opts.describe()}"
    )
    print(format_metrics(metrics, names, batch_size=args.batch_size))
    if note := scored_classes_note(metrics, names):
        print(f"note: mIoU {100 * metrics['miou']:.1f}%{note}")
    sys.stdout.flush()  # the scores are on screen before anything can fail writing them
    for warning in sanity_warnings(metrics, names):
        print(f"dualseg eval: warning: {warning}", file=sys.stderr)
    record = {
        "checkpoint": str(args.checkpoint), "data": str(args.data), "split": args.split,
        "class_names": list(names), "boundary_tolerance": args.boundary_tolerance,
        "trimap_width": args.trimap_width, "refiner": args.refiner,
        "inference": opts.record(),
        "batch_size": args.batch_size, "device": str(device), "amp": cuda_amp(args, device),
        **metrics,
    }  # fmt: skip
    # metrics.json first: a folder that cannot be written gets no figures without their scores
    atomic_write_json(out / "metrics.json", to_jsonable(record))
    figures = write_figures(out, metrics, names)
    for stale in {out / name for name in FIGURES} - set(figures):
        stale.unlink(missing_ok=True)  # an earlier evaluation's (--overwrite)
    print(f"metrics -> {out / 'metrics.json'}; figures -> {', '.join(p.name for p in figures)}")


def main(argv: list[str] | None = None) -> int:
    run(build_parser().parse_args(argv))
    return 0
