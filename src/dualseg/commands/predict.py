"""``dualseg predict``: segment image files, folders or globs with a trained checkpoint.

For each input image ``<name>`` it writes, at the image's original resolution::

    OUT/labels/<name>.png    class index per pixel (8-bit grayscale PNG)
    OUT/color/<name>.png     the label map in the dataset palette
    OUT/overlay/<name>.png   the colours blended over the image
    OUT/probs/<name>.npz     with --probs: class probabilities (see PROBS_KEYS)

``--mode slide --window H W --stride H W`` segments large images tile by tile, ``--tta-scales``
/ ``--tta-flip`` average test-time augmentations (:mod:`dualseg.engine.inference`); with
``--probs`` the saved probabilities are the averaged ones.

``<name>`` is the file stem; images found inside a folder keep their path relative to it (so
``a/x.png`` and ``b/x.png`` do not collide; other repeats get ``_1``, ``_2`` ...). Files under
``OUT``'s own folders (``labels/``, ``color/`` ...) are never inputs, so a second run does not
segment the first one's outputs, nor are those of an earlier output found inside an input
folder (said in a note); a note also says when ``OUT`` holds outputs of other images. Every
file is written atomically; ``OUT`` is checked before the model is loaded: an unwritable
place, and an output file that already exists, are refused (``--overwrite`` replaces the
latter, but never an input image or a ``--data`` dataset file). ``--data ROOT`` names the
dataset the images come from: a model whose classes differ from the ones ROOT describes
(``meta.json``, ``--preset``) is refused with both lists.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dualseg.commands.common import (
    add_dataset_check_options,
    add_inference_arguments,
    add_overwrite_arg,
    add_pixel_args,
    add_quiet_arg,
    add_runtime_args,
    apply_runtime,
    check_dataset_classes,
    cuda_amp,
    fraction,
    inference_options,
    mode_of,
    onnx_runtime,
    static_export_note,
)
from dualseg.console import ArgumentParser, Progress, argparse_kwargs
from dualseg.engine.outputs import (
    OUTPUT_FOLDERS,
    check_image_outputs,
    collect_images,
    save_probs,
    write_outputs,
)
from dualseg.engine.predict import load_model
from dualseg.errors import ConfigError, DataError, DualsegError
from dualseg.export.runtime import ExportedSegmenter
from dualseg.imaging import read_image, rgb_digest
from dualseg.io import check_writable


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="dualseg predict",
        description="Segment images with a trained checkpoint: label PNG, colour PNG, overlay "
        "(and optionally class probabilities) per image, at the original resolution.",
        **argparse_kwargs(
            "dualseg predict street.png photos/ -c runs/camvid/best.pt -o out/",
            "dualseg predict 'photos/*.jpg' -c hf://org/camvid-model -o out/ --probs",
        ),
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="image files, folders or globs")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--checkpoint",
        "-c",
        help="a dualseg checkpoint (.pt), a pretrained folder or hf://org/name",
    )
    src.add_argument(
        "--onnx",
        help="an exported model ('dualseg export'): ONNX, run by onnxruntime, or TorchScript",
    )
    p.add_argument("--out", "-o", required=True, help="output folder")
    add_overwrite_arg(p, what="output files in --out")
    add_dataset_check_options(p)
    p.add_argument(
        "--probs", action="store_true", help="also save class probabilities (probs/<name>.npz)"
    )
    p.add_argument("--batch-size", type=int, default=4, help="images per forward pass (4)")
    add_runtime_args(p)
    add_quiet_arg(p)
    p.add_argument(
        "--alpha", type=fraction, default=0.5, help="overlay opacity of the colours, 0-1 (0.5)"
    )
    add_pixel_args(p, source="the model")
    add_inference_arguments(p)
    return p


def _load(args: argparse.Namespace, device) -> Any:
    """The ``--checkpoint`` segmenter, or the ``--onnx`` exported one (ONNX or TorchScript)."""
    if not args.onnx:
        return load_model(args.checkpoint, device=device, amp=cuda_amp(args, device))

    seg = ExportedSegmenter(args.onnx, **onnx_runtime(args, device))
    static_export_note(args.onnx, seg, "predict")
    return seg


def main(argv: list[str] | None = None) -> int:

    args = build_parser().parse_args(argv)
    if args.batch_size < 1:
        raise DualsegError(f"--batch-size must be >= 1, got {args.batch_size}")
    out = check_writable(args.out, kind="dir", what="--out")
    device = apply_runtime(args)
    opts = inference_options(args)
    if args.onnx and (opts.mode != "whole" or opts.uses_tta):
        raise ConfigError(
            "--mode slide and --tta-* need --checkpoint: an --onnx model runs whole images "
            "only (drop those options, or pass the checkpoint)"
        )
    images = collect_images(args.inputs, out=out)
    files = [(f, ".npz" if f == "probs" else ".png") for f in OUTPUT_FOLDERS]
    files = files if args.probs else files[:-1]
    check_image_outputs(out, images, files, overwrite=args.overwrite, data=args.data)
    seg = _load(args, device)
    source = args.checkpoint or args.onnx
    if seg.num_classes > 255:
        raise DualsegError(f"{source} has {seg.num_classes} classes; label PNGs hold at most 255")
    check_dataset_classes(args, seg.class_names, f"the model {source}")
    depth = seg.bit_depth if args.bit_depth is None else args.bit_depth  # as in training
    infer = {} if args.onnx else dict(mode=opts.mode, window=opts.window, stride=opts.stride,
        tta_scales=opts.tta_scales, tta_flip=opts.tta_flip, tile_batch=opts.tile_batch)  # fmt: skip
    failures: list[str] = []
    bar = Progress(total=len(images), desc="predict", unit="img", mode=mode_of(args))
    chunk = args.batch_size * 4  # a few batches read at a time: equal sizes share a pass
    for start in range(0, len(images), chunk):
        part = []
        for path, name in images[start : start + chunk]:
            try:
                array = read_image(path, bit_depth=depth, max_megapixels=args.max_megapixels)
                part.append((path, name, array))
            except DualsegError as err:
                failures.append(str(err))
                for folder, suffix in files if args.overwrite else []:
                    (out / folder / f"{name}{suffix}").unlink(missing_ok=True)  # now stale
                bar.update(1)
        results = seg.predict_batch(
            [a for _, _, a in part], batch_size=args.batch_size, return_probs=args.probs, **infer
        )
        for (path, name, array), res in zip(part, results):
            label, probs = res if args.probs else (res, None)
            write_outputs(out, name, array, label, seg.meta.palette, alpha=args.alpha)
            npz = out / "probs" / f"{name}.npz"
            if probs is not None:  # the resolved path: refine apply finds it from anywhere
                save_probs(npz, probs, seg.class_names, str(Path(path).resolve()),
                           image_sha1=rgb_digest(array))  # fmt: skip
            elif args.overwrite:  # an earlier --probs run's scores: another model's
                npz.unlink(missing_ok=True)
            bar.update(1)
    bar.close()
    print(
        f"segmented {len(images) - len(failures)} image(s) with {seg.num_classes} classes -> {out}"
    )
    if failures:
        for message in failures:
            print(f"  skipped: {message}", file=sys.stderr)
        raise DataError(f"{len(failures)} of {len(images)} input image(s) could not be read")
    return 0
