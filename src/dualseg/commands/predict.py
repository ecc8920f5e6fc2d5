"""``dualseg predict``: segment images into ``OUT/labels/``, ``color/``, ``overlay/`` (and
``probs/``) at their own resolution; outputs are checked before the model loads."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dualseg.commands import common as c
from dualseg.console import Progress, progress_mode
from dualseg.engine.large_images import needs_bands, open_rows, slide_labels
from dualseg.engine.outputs import (
    OUTPUT_FOLDERS,
    check_image_outputs,
    collect_images,
    save_probs,
    write_outputs,
)
from dualseg.errors import ConfigError, DualsegError
from dualseg.imaging import read_image, rgb_digest
from dualseg.io import check_writable


def build_parser() -> argparse.ArgumentParser:
    p = c.command_parser(
        "predict",
        "Segment images with a trained checkpoint: label PNG, colour PNG, overlay "
        "(and optionally class probabilities) per image, at the original resolution.",
        "dualseg predict street.png photos/ -c runs/camvid/best.pt -o out/",
        "dualseg predict 'photos/*.jpg' -c hf://org/camvid-model -o out/ --probs",
    )
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="image files, folders or globs")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", "-c", help="checkpoint, pretrained folder or hf://org/name")
    src.add_argument("--onnx", help="an exported model (dualseg export): ONNX or TorchScript")
    p.add_argument("--out", "-o", required=True, help="output folder")
    c.add_overwrite_arg(p, what="output files in --out")
    c.add_dataset_check_options(p)
    p.add_argument("--probs", action="store_true", help="also save probs/<name>.npz")
    p.add_argument("--batch-size", type=c.positive_int, default=4, help="images per pass (4)")
    c.add_runtime_args(p)
    c.add_quiet_arg(p)
    p.add_argument("--alpha", type=c.fraction, default=0.5, help="overlay opacity, 0-1 (0.5)")
    c.add_pixel_args(p, source="the model")
    c.add_inference_arguments(p)
    return p


def _write_large(args: argparse.Namespace, o: Any, seg: Any, path: Path, out: Path, name: str,
                 depth: int | None) -> None:  # fmt: skip
    """Slide mode (options ``o``) on an image above Pillow's limit: read, labelled and written
    in row bands."""
    with open_rows(path, bit_depth=depth, max_megapixels=args.max_megapixels) as rows:
        label = slide_labels(seg.model, rows, window=o.window, stride=o.stride,
                             tile_batch=o.tile_batch, device=seg.device, amp=seg.amp)  # fmt: skip
        write_outputs(out, name, rows, label, seg.meta.palette, alpha=args.alpha)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = check_writable(args.out, kind="dir", what="--out")
    device = c.apply_runtime(args)
    opts = c.inference_options(args)
    images = collect_images(args.inputs, out=out)
    files = [(f, ".npz" if f == "probs" else ".png") for f in OUTPUT_FOLDERS]
    files = files if args.probs else files[:-1]
    check_image_outputs(out, images, files, overwrite=args.overwrite, data=args.data)
    slide = opts.mode == "slide"
    large = {p for p, _ in images if slide and needs_bands(p, max_megapixels=args.max_megapixels)}
    if large and (args.probs or opts.uses_tta):
        flag = "--probs" if args.probs else "--tta-*"
        raise ConfigError(f"{min(large)}: over Pillow's pixel limit, so read in row bands; "
                          f"{flag} needs the whole image's probabilities: drop it")  # fmt: skip
    seg = c.load_segmenter(args, device, "predict")
    source = args.checkpoint or args.onnx
    if seg.num_classes > 255:
        raise DualsegError(f"{source} has {seg.num_classes} classes; label PNGs hold at most 255")
    c.check_dataset_classes(args, seg.class_names, f"the model {source}")
    depth = seg.bit_depth if args.bit_depth is None else args.bit_depth  # as in training
    infer = {} if args.onnx else asdict(opts)
    failures: list[str] = []
    bar = Progress(total=len(images), desc="predict", unit="img", mode=progress_mode(args.quiet))
    chunk = args.batch_size * 4  # a few batches read at a time: equal sizes share a pass
    for start in range(0, len(images), chunk):
        part = []
        for path, name in images[start : start + chunk]:
            try:
                if path in large:
                    _write_large(args, opts, seg, path, out, name, depth)
                    bar.update(1)
                    continue
                array = read_image(path, bit_depth=depth, max_megapixels=args.max_megapixels)
                part.append((path, name, array))
            except DualsegError as err:
                failures.append(str(err))
                for folder, suffix in files if args.overwrite else []:
                    (out / folder / f"{name}{suffix}").unlink(missing_ok=True)  # now stale
                bar.update(1)
        arrays = [a for _, _, a in part]
        results = seg.predict_batch(arrays, batch_size=args.batch_size, return_probs=args.probs,
                                    **infer)  # fmt: skip
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
    c.skipped(failures, len(images))
    return 0
