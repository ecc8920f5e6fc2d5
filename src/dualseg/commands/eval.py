"""``dualseg eval``: score a checkpoint on a dataset split.

Prints mIoU, a per-class IoU table, pixel / mean accuracy, boundary F1 and trimap mIoU (in
percent) and the median inference time per image, and writes into ``OUT``:

    metrics.json              every score (fractions in [0, 1]; units: docs/metrics.md), NaN -> null
    confusion_matrix.png      the confusion matrix, row-normalized, class names on both axes
    per_class_iou.png         per-class IoU bars (base and refined side by side with --refiner)
    confusion_matrix_refined.png   with --refiner

``--save-predictions DIR`` writes each image's label and colour PNGs (``DIR/labels/<name>.png``,
``DIR/color/<name>.png``; ``<name>`` is the image's stem, with ``_1``, ``_2`` ... for images
that share one); files there that already exist are refused before any work unless
``--overwrite``, and a file of the dataset never is written over. An earlier evaluation in
``OUT`` (its ``metrics.json`` and figures) is refused the same way. ``--refiner R``
(method B) adds the refined scores side by side. ``--mode slide`` and ``--tta-*`` choose how
the model runs (:mod:`dualseg.engine.inference`); the refiner gets the averaged scores.

Refusals before any work: an unwritable ``OUT`` or ``--save-predictions`` folder, and a dataset
whose own classes (``ROOT/meta.json``, ``--preset`` or its layout) differ from the checkpoint's.
The metrics are printed before they are written.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

from dualseg.commands.common import (
    NO_MAP,
    add_label_args,
    add_overwrite_arg,
    add_quiet_arg,
    add_runtime_args,
    apply_runtime,
    check_outputs,
    cuda_amp,
    dataset_files,
    label_settings,
    mode_of,
    nonnegative_int,
    pixels_at_most,
    split_of,
    unique_names,
)
from dualseg.commands.predict import add_inference_arguments, inference_options
from dualseg.console import ArgumentParser, argparse_kwargs, track
from dualseg.errors import CheckpointError, DataError, DualsegError


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
    p.add_argument(
        "--checkpoint",
        "-c",
        required=True,
        help="a dualseg checkpoint (.pt), a pretrained folder or hf://org/name",
    )
    p.add_argument("--data", "-d", required=True, help="dataset root folder")
    p.add_argument(
        "--split",
        default=None,
        help="split to evaluate (val; a list file as --data: its name, test for test.txt)",
    )
    p.add_argument(
        "--layout", default="auto", help="auto | list | folder | voc | cityscapes | ade20k (auto)"
    )
    p.add_argument(
        "--preset",
        default=None,
        help="dataset preset (camvid, voc, cityscapes, ade20k, synthetic); default: "
        "ROOT/meta.json, else the classes stored in the checkpoint",
    )
    add_label_args(p, source="the checkpoint")
    p.add_argument(
        "--out",
        "-o",
        default=None,
        help="folder for metrics.json (<checkpoint dir>/eval_SPLIT for best.pt, eval_SPLIT_NAME "
        "for another checkpoint, + _refined / _slide / _tta for those evaluations; "
        "./eval_SPLIT_NAME for hf://org/NAME)",
    )
    p.add_argument(
        "--save-predictions",
        metavar="DIR",
        default=None,
        help="write label and colour PNGs (DIR/labels/<name>.png, DIR/color/<name>.png)",
    )
    add_overwrite_arg(p, what="an earlier evaluation in OUT, and --save-predictions files")
    p.add_argument("--refiner", default=None, help="a method-B refiner file (dualseg refine fit)")
    p.add_argument("--batch-size", type=int, default=1, help="images per batch (1)")
    p.add_argument(
        "--workers", type=nonnegative_int, default=0, help="DataLoader worker processes (0)"
    )
    add_runtime_args(p)
    add_quiet_arg(p)
    from dualseg.metrics import BOUNDARY_TOLERANCE, TRIMAP_WIDTH

    p.add_argument(
        "--boundary-tolerance",
        type=width_arg,
        default=BOUNDARY_TOLERANCE,
        help=f"boundary F1 tolerance px ({BOUNDARY_TOLERANCE})",
    )
    p.add_argument(
        "--trimap-width",
        type=width_arg,
        default=TRIMAP_WIDTH,
        help=f"trimap band width px ({TRIMAP_WIDTH})",
    )
    add_inference_arguments(p)
    return p


def width_arg(text: str) -> int:
    """argparse ``type=`` of ``--boundary-tolerance`` / ``--trimap-width``: 0..MAX_WIDTH px."""
    from dualseg.metrics import MAX_WIDTH

    return pixels_at_most(text, MAX_WIDTH)


def _load_refiner(
    path: str, class_names: tuple[str, ...], device: Any, split: str, model: Any, images: list
) -> Any:
    from dualseg.refine import BoundaryRefiner
    from dualseg.refine.base import OTHER_BASE, other_calibration_base
    from dualseg.refine.calibrate import calibrated_on

    refiner = BoundaryRefiner.load(path, device=device)
    if other_calibration_base(refiner, model):
        print(f"dualseg eval: warning: {OTHER_BASE.format(refiner=path)}", file=sys.stderr)
    note = refiner.calibration_note()
    if note:
        print(f"dualseg eval: note: {note}", file=sys.stderr)
    shared = calibrated_on(refiner.calibration, images)
    if shared is None and (refiner.calibration or {}).get("split") == split:
        shared = len(images)  # a refiner stored before the digests: known by its split's name
    if shared:
        chosen = (refiner.calibration or {}).get("split")
        print(
            f"dualseg eval: warning: {path}'s decision options were chosen (--calibrate-split "
            f"{chosen}) on {shared} of the {len(images)} images evaluated here: its refined "
            "scores are optimistic; evaluate on images held out of the calibration, or "
            "calibrate on a split carved from train",
            file=sys.stderr,
        )
    refiner.check_classes(class_names, len(class_names), what=f"the checkpoint (refiner {path})")
    return refiner


def prediction_names(samples: list) -> list[str]:
    """The output name of each ``(image_path, label_path)`` sample: the image's stem, with a
    numeric suffix for distinct images that share one (as ``dualseg predict`` names them)."""
    return [name for _, name in unique_names([(Path(img), Path(img).stem) for img, _ in samples])]


def prediction_files(out: Path, names: list[str], *, refined: bool) -> list[Path]:
    """Every file :func:`prediction_writer` writes for these names."""
    kinds = ("", "refined_") if refined else ("",)
    return [out / f"{k}{f}" / f"{n}.png" for n in names for k in kinds for f in ("labels", "color")]


def check_prediction_outputs(args: argparse.Namespace) -> list[Path]:
    """``--save-predictions``: refuse, before any work, files that exist (unless
    ``--overwrite``) and any file of the ``--data`` dataset (always). Returns the earlier
    evaluation's files this one replaces by leaving them out, to remove once it has written
    its own."""
    from dualseg.data.datasets import discover

    samples = discover(args.data, split=args.split, layout=args.layout).samples
    out, names = Path(args.save_predictions), prediction_names(samples)
    protected = [
        (f"a file of the dataset {args.data}", dataset_files(args.data, layout=args.layout))
    ]
    check_outputs(
        prediction_files(out, names, refined=bool(args.refiner)),
        overwrite=args.overwrite,
        protected=protected,
        what="--save-predictions",
    )
    if not (args.overwrite and not args.refiner):
        return []
    # an earlier evaluation's refined_labels/ and refined_color/ files would stay beside this
    # one's predictions, as if this model's refined output: removed after it wrote its own
    # (never a dataset file), as eval removes an earlier evaluation's figures
    stale = [
        p
        for p in prediction_files(out, names, refined=True)
        if p.parent.name.startswith("refined_")
    ]
    check_outputs(stale, overwrite=True, protected=protected, what="--save-predictions")
    return [p for p in stale if p.exists()]


def prediction_writer(samples: list, out: Path, palette: Any, batch_size: int):
    """``evaluate(on_batch=...)`` hook writing ``labels/`` and ``color/`` PNGs per sample.

    ``samples`` are the dataset's ``(image_path, label_path)`` pairs in loader order (the eval
    loader is not shuffled), so batch ``i`` row ``k`` is sample ``i * batch_size + k``; each is
    written under its :func:`prediction_names` name.
    """
    from dualseg import viz
    from dualseg.io import atomic_save_image, label_png

    names = prediction_names(samples)
    created: list[Path] = []  # the files this evaluation added (not replaced): see write.undo

    def save(path: Path, array: Any) -> None:
        if not path.exists():
            created.append(path)
        atomic_save_image(path, array)

    def undo() -> int:
        """Remove the files this evaluation added; the number removed. An evaluation that
        stops on an error (an unreadable image, Ctrl-C) leaves no partial set of predictions
        behind, which the corrected rerun would otherwise need --overwrite to replace."""
        for path in created:
            path.unlink(missing_ok=True)
        for folder in {path.parent for path in created}:
            with contextlib.suppress(OSError):  # a folder this evaluation made, now empty
                folder.rmdir()
        return len(created)

    def write(index, images, labels, pred, refined) -> None:
        for k in range(pred.shape[0]):
            name = names[index * batch_size + k]
            for kind, lab in (
                ("", pred[k]),
                ("refined_", refined[k] if refined is not None else None),
            ):
                if lab is None:
                    continue
                arr = label_png(lab.to("cpu").numpy(), len(palette))
                save(out / f"{kind}labels" / f"{name}.png", arr)
                save(out / f"{kind}color" / f"{name}.png", viz.colorize(arr, palette))

    write.undo = undo  # type: ignore[attr-defined]
    return write


def mixed_size_batch(samples: list, batch_size: int) -> str | None:
    """The first batch of ``samples`` (in loader order) whose images differ in size, read from
    the file headers (EXIF rotation included), said in a line; ``None`` when there is none.
    Found before the run, not at that batch, after the predictions before it were written."""
    from PIL import Image

    from dualseg.imaging import exif_orientation

    def size(path: str) -> tuple[int, int] | None:
        try:
            with Image.open(path) as im:
                w, h = im.size
                return (w, h) if exif_orientation(im, path) < 5 else (h, w)
        except Exception:  # unreadable: the run itself names the file
            return None

    for start in range(0, len(samples), batch_size):
        sizes = [(img, s) for img, _ in samples[start : start + batch_size] if (s := size(img))]
        other = next(((img, s) for img, s in sizes if s != sizes[0][1]), None)
        if other is not None:
            (a, (wa, ha)), (b, (wb, hb)) = sizes[0], other
            return (
                f"two images of one batch differ in size ({wa}x{ha} and {wb}x{hb} px: {a} and "
                f"{b}), and images of different sizes cannot be batched"
            )
    return None


def default_out(checkpoint: str, split: str, *, variant: str = "") -> Path:
    """``--out``'s default: ``eval_SPLIT`` (+ ``variant``, e.g. ``_refined_tta``) beside a
    run's ``best.pt``; ``eval_SPLIT_NAME`` beside any other checkpoint file or pretrained
    folder (``last.pt``: ``eval_val_last``), so two checkpoints of one folder keep both
    evaluations; in the current folder for ``hf://org/name`` (``eval_SPLIT_name``: it has no
    folder of its own to sit beside)."""
    from dualseg.engine.pretrained import is_hub_source

    if is_hub_source(checkpoint):
        repo = str(checkpoint).rstrip("/").rsplit("/", 1)[-1].split("@", 1)[0]
        return Path(f"eval_{split}_{repo}{variant}")
    path = Path(checkpoint)
    tag = "" if path.name == "best.pt" else f"_{path.stem if path.is_file() else path.name}"
    return path.parent / f"eval_{split}{tag}{variant}"


def out_variant(args: argparse.Namespace, opts: Any) -> str:
    """What the default ``--out`` adds for an evaluation other than the plain one, so that
    ``eval`` and ``eval --refiner R`` (or ``--mode slide``, TTA) of one checkpoint keep both."""
    parts = ["_refined"] if args.refiner else []
    parts += ["_slide"] if opts.mode == "slide" else []
    parts += ["_tta"] if opts.uses_tta else []
    return "".join(parts)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Evaluate as the command line describes; returns the metrics (also written to disk)."""
    import torch

    from dualseg.data import PRESETS, build_dataset, read_label
    from dualseg.data.collate import SameSizeCollate
    from dualseg.data.datasets import dataset_meta, preset_for
    from dualseg.data.presets import parse_label_map, require_same_classes
    from dualseg.data.transforms import build_eval_transform
    from dualseg.engine.checkpoint import build_model_from_checkpoint
    from dualseg.engine.evaluation import evaluate, format_metrics
    from dualseg.engine.preflight import scored_classes_note
    from dualseg.engine.pretrained import check_normalization, load_state
    from dualseg.io import atomic_write_json, check_writable
    from dualseg.metrics import to_jsonable

    if args.batch_size < 1:
        raise DualsegError(f"--batch-size must be >= 1, got {args.batch_size}")
    args.split = split_of(args.data, args.split, default="val")
    opts = inference_options(args)
    out = (
        Path(args.out)
        if args.out
        else default_out(args.checkpoint, args.split, variant=out_variant(args, opts))
    )
    check_writable(out, kind="dir", what="--out")
    stale_predictions: list[Path] = []
    if args.save_predictions:
        check_writable(args.save_predictions, kind="dir", what="--save-predictions")
        stale_predictions = check_prediction_outputs(args)
    # an earlier evaluation's scores and figures in OUT are a result: replaced only when asked
    check_outputs([out / name for name in EVAL_FILES], overwrite=args.overwrite, what="--out")
    if args.label_map and args.label_map.lower() not in NO_MAP:
        parse_label_map(args.label_map)  # a bad value: one line before the model loads
    device = apply_runtime(args)
    amp = cuda_amp(args, device)
    ckpt = load_state(args.checkpoint)  # a .pt file, a pretrained folder or hf://org/name
    trained = (ckpt.get("config") or {}).get("data") or {}
    label_format, label_map, ignore_value, taken = label_settings(args, trained)
    if taken:
        print(
            f"dualseg eval: note: labels read as {args.checkpoint} was trained: "
            f"{', '.join(taken)} (--label-format / --label-map / --ignore-index change it)",
            file=sys.stderr,
        )
    check_normalization(ckpt)  # the eval transform applies dualseg's (ImageNet) normalization
    model, meta = build_model_from_checkpoint(ckpt, device=device)
    own = (
        preset_for(args.data, args.preset)
        if args.preset
        else dataset_meta(args.data, layout=args.layout, split=args.split)
    )
    if own is not None:
        require_same_classes(
            meta.class_names,
            own.class_names,
            model=f"the checkpoint {args.checkpoint}",
            data=f"the dataset {args.data} ({own.name})",
        )
        meta = own
    elif meta.name in PRESETS and PRESETS[meta.name].class_names == meta.class_names:
        meta = PRESETS[meta.name]  # the preset also knows the raw ignore values (CamVid: 11)
    dataset = build_dataset(
        args.data,
        split=args.split,
        layout=args.layout,
        preset=meta,
        transform=build_eval_transform(),
        label_format=label_format,
        label_map=label_map,
        ignore_value=ignore_value,
    )
    n_model = int(ckpt["model_kwargs"].get("num_classes", meta.num_classes))
    if dataset.meta.num_classes != n_model:
        raise CheckpointError(
            f"{args.checkpoint} predicts {n_model} classes but the dataset {args.data} "
            f"({dataset.meta.name}) has {dataset.meta.num_classes}; pick the matching --preset "
            "or a checkpoint trained on this dataset"
        )
    if len(dataset) == 0:
        raise DualsegError(f"split {args.split!r} of {args.data} has no images")
    if label_format != "color" and (lost := dataset.meta.unreachable_classes()):
        names = ", ".join(f"{k} {dataset.meta.class_names[k]!r}" for k in lost)
        print(
            f"dualseg eval: warning: no raw label value means class {names} (the ignore value, "
            f"{dataset.meta.describe_ignore()}, or a label map takes it), so it is never scored; "
            "check --ignore-index / --label-map / meta.json",
            file=sys.stderr,
        )
    if args.batch_size > 1 and (mixed := mixed_size_batch(dataset.samples, args.batch_size)):
        raise DataError(f"{mixed}; use --batch-size 1 (eval runs each image at its own size)")
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=False,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        # images of different sizes in one batch: one line saying --batch-size 1, no traceback
        collate_fn=SameSizeCollate("use --batch-size 1 (eval runs each image at its own size)"),
    )
    refiner = (
        _load_refiner(
            args.refiner,
            dataset.meta.class_names,
            device,
            args.split,
            model,
            [image for image, _ in dataset.samples],
        )
        if args.refiner
        else None
    )
    hook = None
    if args.save_predictions:
        # every label read before the first prediction is written: a bad one found mid-run left
        # part of the predictions behind, and the corrected run then needed --overwrite
        for _, label_path in dataset.samples:
            read_label(label_path, dataset.meta, label_format=dataset.label_format)
        hook = prediction_writer(
            dataset.samples, Path(args.save_predictions), dataset.meta.palette, args.batch_size
        )
    mode = mode_of(args)
    try:
        metrics = evaluate(
            model,
            loader if mode == "bar" else track(loader, desc="eval", unit="batch", mode=mode),
            num_classes=dataset.meta.num_classes,
            ignore_index=dataset.meta.ignore_index,
            device=device,
            boundary_tolerance=args.boundary_tolerance,
            trimap_width=args.trimap_width,
            refiner=refiner,
            amp=amp,
            on_batch=hook,
            progress=mode == "bar",
            mode=opts.mode,
            window=opts.window,
            stride=opts.stride,
            tta_scales=opts.tta_scales,
            tta_flip=opts.tta_flip,
            tile_batch=opts.tile_batch,
        )
    except BaseException:  # an unreadable image, Ctrl-C: no partial set of predictions stays
        if hook is not None and (removed := hook.undo()):
            print(
                f"dualseg eval: note: removed the {removed} prediction files this evaluation "
                f"had written to {args.save_predictions}",
                file=sys.stderr,
            )
        raise
    names = dataset.meta.class_names
    record = {
        "checkpoint": str(args.checkpoint),
        "data": str(args.data),
        "split": args.split,
        "class_names": list(names),
        "boundary_tolerance": args.boundary_tolerance,
        "trimap_width": args.trimap_width,
        "refiner": args.refiner,
        "inference": {
            "mode": opts.mode,
            "window": list(opts.window) if opts.mode == "slide" else None,
            "stride": list(opts.effective_stride) if opts.mode == "slide" else None,
            "tta_scales": list(opts.tta_scales),
            "tta_flip": opts.tta_flip,
        },
        "batch_size": args.batch_size,
        "device": str(device),
        "amp": amp,
        **metrics,
    }
    print(
        f"{args.checkpoint} on {args.data} [{args.split}], {metrics['num_images']} images, "
        f"batch size {args.batch_size}, {device}, {_describe(opts)}"
    )
    print(format_metrics(metrics, names, batch_size=args.batch_size))
    note = scored_classes_note(metrics, names)
    if note:
        print(f"note: mIoU {100 * metrics['miou']:.1f}%{note}")
    sys.stdout.flush()  # the scores are on screen before anything can fail writing them
    # metrics.json first: a folder that cannot be written gets no figures without their scores
    atomic_write_json(out / "metrics.json", to_jsonable(record))
    figures = write_figures(out, metrics, names)
    for stale in {out / name for name in FIGURES} - set(figures):
        stale.unlink(missing_ok=True)  # an earlier evaluation's (--overwrite), not this one's
    for stale in stale_predictions:
        stale.unlink(missing_ok=True)
    print(f"metrics -> {out / 'metrics.json'}; figures -> {', '.join(p.name for p in figures)}")
    return metrics


def _describe(opts: Any) -> str:
    """The inference settings in words, e.g. ``sliding window 512x512, stride 342x342``."""
    text = "whole images"
    if opts.mode == "slide":
        (wh, ww), (sh, sw) = opts.window, opts.effective_stride
        text = f"sliding window {wh}x{ww}, stride {sh}x{sw}"
    if opts.uses_tta:
        scales = ",".join(f"{s:g}" for s in opts.tta_scales)
        text += f", TTA scales {scales}" + (" + flip" if opts.tta_flip else "")
    return text


FIGURES = ("confusion_matrix.png", "per_class_iou.png", "confusion_matrix_refined.png")
EVAL_FILES = ("metrics.json", *FIGURES)  # what an evaluation writes into OUT


def write_figures(out: Path, metrics: dict[str, Any], class_names: Any) -> list[Path]:
    """``confusion_matrix.png`` and ``per_class_iou.png`` (+ ``confusion_matrix_refined.png``
    with a refiner) in ``out``; returns the paths written."""
    from dualseg import viz

    written = [out / FIGURES[0], out / FIGURES[1]]
    viz.save_confusion_matrix(written[0], metrics["confusion_matrix"], class_names)
    series = {"model": metrics["iou"]}
    refined = metrics.get("refined")
    if refined is not None:
        series["model + method B"] = refined["iou"]
        written.append(out / FIGURES[2])
        viz.save_confusion_matrix(
            written[-1],
            refined["confusion_matrix"],
            class_names,
            title="method B: confusion matrix (row-normalized, %)",
        )
    viz.save_class_iou(written[1], series, class_names)
    return written


def main(argv: list[str] | None = None) -> int:
    run(build_parser().parse_args(argv))
    return 0
