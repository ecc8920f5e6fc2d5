"""``dualseg eval``: score a checkpoint on a dataset split; ``metrics.json`` + figures in --out."""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from dualseg.commands import common as c
from dualseg.console import progress_mode, track
from dualseg.data import read_label
from dualseg.data.collate import SameSizeCollate
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
from dualseg.engine.pretrained import is_hub_source, load_network
from dualseg.errors import ConfigError, DataError
from dualseg.export.runtime import load_refiner
from dualseg.io import atomic_write_json
from dualseg.metrics import BOUNDARY_TOLERANCE, MAX_WIDTH, TRIMAP_WIDTH, to_jsonable
from dualseg.refine.apply_run import crf_settings, flags_of, override
from dualseg.refine.base import python_model
from dualseg.refine.refiner import evaluation_notes
from dualseg.refine.taps import is_py_spec

ONE_SIZE = "use --batch-size 1 (eval runs each image at its own size)"


def build_parser() -> argparse.ArgumentParser:
    p = c.command_parser(
        "eval",
        "Evaluate a checkpoint: mIoU, per-class IoU, pixel accuracy, "
        "boundary F1 and trimap mIoU; writes metrics.json.",
        "dualseg eval -c runs/camvid/best.pt --data ../shared/data/camvid --split val",
        "dualseg eval -c runs/camvid/best.pt --data ROOT --refiner runs/camvid/refiner.pt",
        "dualseg eval -c runs/camvid/best.pt --data ROOT --crf",
    )
    add = p.add_argument
    add(
        "--checkpoint",
        "-c",
        required=True,
        help="checkpoint, pretrained folder, hf://org/name, or any PyTorch "
        "model as FILE.py:NAME (classes from --preset or the data's meta.json)",
    )
    c.add_data_args(p, split="val")
    c.add_label_args(p, source="the checkpoint")
    c.add_pixel_args(p, source="the checkpoint")
    add("--out", "-o", help="folder for metrics.json (default: eval_SPLIT[_NAME] beside the "
        "checkpoint, + _refined / _crf / _slide / _tta)")  # fmt: skip
    add("--save-predictions", metavar="DIR", help="write DIR/labels/ and DIR/color/ PNGs")
    c.add_overwrite_arg(p, what="an earlier evaluation in OUT, and --save-predictions files")
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--refiner", help="a method-B refiner (dualseg refine fit), or an exported one"
    )
    how.add_argument("--crf", action="store_true", help="score dense CRF on the base's "
                     "probabilities instead, default kernels (the dualseg[crf] extra)")  # fmt: skip
    c.add_refiner_overrides(p)
    add("--batch-size", type=c.positive_int, default=1, help="images per batch (1)")
    add("--workers", type=c.nonnegative_int, default=0, help="DataLoader worker processes (0)")
    c.add_runtime_args(p)
    c.add_quiet_arg(p)
    width = c.int_in(0, MAX_WIDTH, " pixels")
    add("--boundary-tolerance", type=width, default=BOUNDARY_TOLERANCE,
        help=f"boundary F1 tolerance px ({BOUNDARY_TOLERANCE})")  # fmt: skip
    add("--trimap-width", type=width, default=TRIMAP_WIDTH,
        help=f"trimap band width px ({TRIMAP_WIDTH})")  # fmt: skip
    c.add_inference_arguments(p)
    return p


def warn(text: str) -> None:
    print(f"dualseg eval: {text}", file=sys.stderr)


def _network(args: argparse.Namespace, device: torch.device) -> tuple[Any, dict[str, Any]]:
    """The model and its checkpoint; a Python model (``FILE.py:NAME``) has none (empty)."""
    if is_py_spec(args.checkpoint) and not is_hub_source(args.checkpoint):
        return python_model(args.checkpoint, flag="--checkpoint").to(device), {}
    model, _, ckpt = load_network(args.checkpoint, device=device)
    return model, ckpt


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Evaluate as the command line describes; returns the metrics (also written to disk)."""
    args.split = c.split_of(args.data, args.split, default="val")
    overrides = c.refiner_overrides(args)
    crf = crf_settings(overrides) if args.crf else None  # refuses method B's options
    if overrides and not args.refiner:
        raise ConfigError(f"{flags_of(overrides)} set a method-B refiner's options: pass --refiner")
    opts = c.inference_options(args)
    variant = "".join(v for v, on in (("_refined", args.refiner), ("_crf", args.crf),
                      ("_slide", opts.mode == "slide"), ("_tta", opts.uses_tta)) if on)  # fmt: skip
    out = Path(args.out) if args.out else default_out(args.checkpoint, args.split, variant=variant)
    stale = check_eval_outputs(
        out, args.save_predictions, data=args.data, split=args.split, layout=args.layout,
        refined=bool(args.refiner) or args.crf, overwrite=args.overwrite,
    )  # fmt: skip
    device = c.apply_runtime(args)
    model, ckpt = _network(args, device)
    trained = (ckpt.get("config") or {}).get("data") or {}
    read_as = f"dualseg eval: note: labels read as {args.checkpoint} was trained"
    label_format, label_map, ignore = c.label_settings(args, trained, note=read_as)
    contract = contract_of(ckpt) if ckpt else None  # a Python model: the data's contract
    flags = (args.label_format, args.label_map, args.bit_depth)
    dataset = model_dataset(
        args.data, split=args.split, layout=args.layout, preset=args.preset, contract=contract,
        checkpoint=args.checkpoint,
        explicit=flags != (None,) * 3 or args.ignore_index is not c.FROM_TRAINING,
        label_format=label_format, label_map=label_map, ignore_value=ignore,
        bit_depth=args.bit_depth, max_megapixels=args.max_megapixels, trained=trained,
        train_images=ckpt.get("train_images"),
    )  # fmt: skip
    if args.batch_size > 1 and (mixed := mixed_size_batch(dataset.samples, args.batch_size)):
        raise DataError(f"{mixed}; {ONE_SIZE}")
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, num_workers=args.workers,
        pin_memory=device.type == "cuda", collate_fn=SameSizeCollate(ONE_SIZE),
    )  # fmt: skip
    refiner: Any = crf
    if args.refiner:
        refiner = load_refiner(args.refiner, device=device)  # fitted or exported
        notes = override(refiner, overrides, refiner_name=args.refiner)
        for note in notes + evaluation_notes(  # said once every check has passed
            refiner, model, [image for image, _ in dataset.samples],
            class_names=dataset.meta.class_names, contract=contract, refiner_name=args.refiner,
            model_name=f"the checkpoint {args.checkpoint}",
        ):  # fmt: skip
            warn(note)
    hook = None
    if args.save_predictions:  # every label read before the first prediction is written
        for _, label_path in dataset.samples:
            read_label(label_path, dataset.meta, label_format=dataset.label_format)
        folder, palette = Path(args.save_predictions), dataset.meta.palette
        hook = PredictionWriter(dataset.samples, folder, palette, args.batch_size)
    mode = progress_mode(args.quiet)
    try:
        metrics = evaluate(
            model, loader if mode == "bar" else track(loader, desc="eval", unit="batch", mode=mode),
            num_classes=dataset.meta.num_classes, ignore_index=dataset.meta.ignore_index,
            device=device, boundary_tolerance=args.boundary_tolerance,
            trimap_width=args.trimap_width, refiner=refiner, amp=c.cuda_amp(args, device),
            on_batch=hook, progress=mode == "bar", **asdict(opts),
        )  # fmt: skip
    except BaseException:  # an unreadable image, Ctrl-C: no partial set of predictions stays
        if hook is not None and (removed := hook.undo()):
            warn(f"note: removed the {removed} prediction files written to {args.save_predictions}")
        raise
    _report(args, metrics, dataset.meta.class_names, opts, device, out, refiner)
    for path in stale:
        path.unlink(missing_ok=True)
    return metrics


def _report(
    args: argparse.Namespace, metrics: dict, names: Any, opts: Any, device: torch.device,
    out: Path, refiner: Any,
) -> None:  # fmt: skip
    """Print the scores and warnings, then write metrics.json and the figures."""
    print(f"{args.checkpoint} on {args.data} [{args.split}], {metrics['num_images']} images, "
          f"batch size {args.batch_size}, {device}, {opts.describe()}")  # fmt: skip
    print(format_metrics(metrics, names, batch_size=args.batch_size))
    if note := scored_classes_note(metrics, names):
        print(f"note: mIoU {100 * metrics['miou']:.1f}%{note}")
    sys.stdout.flush()  # the scores are on screen before anything can fail writing them
    for warning in sanity_warnings(metrics, names):
        warn(f"warning: {warning}")
    record = {
        "checkpoint": str(args.checkpoint), "data": str(args.data), "split": args.split,
        "class_names": list(names), "boundary_tolerance": args.boundary_tolerance,
        "trimap_width": args.trimap_width, "refiner": args.refiner,
        "refiner_options": refiner.config.to_dict() if args.refiner else None,
        "crf": asdict(refiner) if args.crf else None, "inference": opts.record(),
        "batch_size": args.batch_size, "device": str(device), "amp": c.cuda_amp(args, device),
        **metrics,
    }  # fmt: skip
    # metrics.json first: a folder that cannot be written gets no figures without their scores
    atomic_write_json(out / "metrics.json", to_jsonable(record))
    figures = write_figures(out, metrics, names, refined_by="dense CRF" if args.crf else "method B")
    for stale in {out / name for name in FIGURES} - set(figures):
        stale.unlink(missing_ok=True)  # an earlier evaluation's (--overwrite)
    print(f"metrics -> {out / 'metrics.json'}; figures -> {', '.join(p.name for p in figures)}")


def main(argv: list[str] | None = None) -> int:
    run(build_parser().parse_args(argv))
    return 0
