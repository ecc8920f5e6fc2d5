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
import glob
import io
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dualseg.commands.common import (
    add_overwrite_arg,
    add_quiet_arg,
    add_runtime_args,
    apply_runtime,
    check_outputs,
    cuda_amp,
    dataset_files,
    fraction,
    mode_of,
    onnx_runtime,
    static_export_note,
    unique_names,
)
from dualseg.console import ArgumentParser, Progress, argparse_kwargs
from dualseg.errors import ConfigError, DataError, DualsegError

if TYPE_CHECKING:  # pragma: no cover
    from dualseg.engine.inference import InferenceOptions

# what folder and glob inputs pick up: every format the image readers open (a file named
# on the command line is read whatever its suffix)
IMAGE_EXTENSIONS = (
    ".png", ".jpg", ".jpeg", ".jfif", ".bmp", ".tif", ".tiff", ".webp", ".gif", ".ppm", ".pgm",
)  # fmt: skip
# The folders of OUT that predict writes (refine apply adds "changed"); never read as inputs.
OUTPUT_FOLDERS = ("labels", "color", "overlay", "probs")
# what predict and refine apply write into OUT (refine apply: "changed" too): never inputs,
# whichever of the two wrote the folder given as input
OWN_FOLDERS = (*OUTPUT_FOLDERS, "changed")

# Keys of each --probs npz file. Method B (`dualseg refine apply --base <folder>`) reads these
# as the output of a base model.
PROBS_KEYS = {
    "probs": "float16 [C, H, W] softmax class probabilities at the original size (with TTA: "
    "their mean over the augmentations)",
    "class_names": "str [C] class names, in channel order",
    "source": "str, the input image path",
    "image_sha1": "str, dualseg.imaging.rgb_digest of the decoded input image (matches a map "
    "to its image where the source path does not exist)",
}


def add_inference_arguments(p: argparse.ArgumentParser) -> None:
    """``--mode --window --stride --tta-scales --tta-flip --tile-batch`` (shared by ``eval``,
    ``predict`` and ``refine apply``); defaults from :class:`InferenceOptions`."""
    from dualseg.engine.inference import MODES, InferenceOptions

    d = InferenceOptions()
    g = p.add_argument_group(
        "inference", "sliding window and test-time augmentation (dualseg.engine.inference)"
    )
    g.add_argument(
        "--mode",
        choices=MODES,
        default=d.mode,
        help=f"whole: one pass over each image; slide: tiles of --window every --stride px, "
        f"logits averaged where tiles overlap ({d.mode})",
    )
    g.add_argument(
        "--window",
        type=int,
        nargs=2,
        default=None,  # None: InferenceOptions' window; given without --mode slide: an error
        metavar=("H", "W"),
        help=f"tile size of --mode slide ({d.window[0]} {d.window[1]})",
    )
    g.add_argument(
        "--stride",
        type=int,
        nargs=2,
        default=d.stride,
        metavar=("H", "W"),
        help="tile step of --mode slide, at most the window (default: 2/3 of the window)",
    )
    g.add_argument(
        "--tta-scales",
        type=float,
        nargs="+",
        default=list(d.tta_scales),
        metavar="S",
        help="test-time augmentation: run the image resized by each of these factors and "
        "average the softmax probabilities at the image size, e.g. 0.75 1.0 1.25 "
        f"({' '.join(str(v) for v in d.tta_scales)}: the image as it is)",
    )
    g.add_argument(
        "--tta-flip",
        action="store_true",
        default=d.tta_flip,
        help="test-time augmentation: also average the left-right mirrored image (off)",
    )
    g.add_argument(
        "--tile-batch",
        type=int,
        default=d.tile_batch,
        help=f"tiles per forward pass in --mode slide ({d.tile_batch})",
    )


def inference_options(args: argparse.Namespace) -> InferenceOptions:
    """The validated options of :func:`add_inference_arguments` (ConfigError when invalid)."""
    from dualseg.engine.inference import InferenceOptions

    if args.mode != "slide" and (args.window is not None or args.stride is not None):
        raise ConfigError("--window and --stride set the tiles of --mode slide; add --mode slide")
    window = InferenceOptions.window if args.window is None else tuple(args.window)
    return InferenceOptions(
        mode=args.mode,
        window=(window[0], window[1]),
        stride=None if args.stride is None else (args.stride[0], args.stride[1]),
        tta_scales=tuple(args.tta_scales),
        tta_flip=args.tta_flip,
        tile_batch=args.tile_batch,
    )


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
    add_inference_arguments(p)
    return p


def add_dataset_check_options(p: argparse.ArgumentParser) -> None:
    """``--data`` / ``--preset``: the dataset whose classes the model must have."""
    p.add_argument(
        "--data",
        metavar="ROOT",
        help="the dataset the inputs belong to: refuse a model whose classes differ from "
        "ROOT's (ROOT/meta.json or its layout's preset)",
    )
    p.add_argument("--preset", help="with --data: the dataset's class preset instead")


def check_dataset_classes(args: argparse.Namespace, class_names: Sequence[str], model: str) -> None:
    """Refuse (one line, both class lists) when ``--data``'s classes differ from the model's."""
    if not args.data and not args.preset:
        return
    from dualseg.data.datasets import dataset_meta, preset_for
    from dualseg.data.presets import require_same_classes

    if args.data and not Path(args.data).exists():
        raise DataError(f"--data {args.data}: no such file or folder; check the path")
    own = preset_for(args.data, args.preset) if args.preset else dataset_meta(args.data)
    if own is None:
        raise DataError(
            f"{args.data}: says nothing about its classes; add a meta.json (name, class_names, "
            "palette) or pass --preset"
        )
    where = f"the dataset {args.data or args.preset} ({own.name})"
    require_same_classes(tuple(class_names), own.class_names, model=model, data=where)


def collect_images(
    inputs: Sequence[str], *, out: Path | None = None, command: str = "predict"
) -> list[tuple[Path, str]]:
    """Expand files, folders (recursively) and globs into ``(path, output name)`` pairs.

    Never inputs, when folders and globs find them (a file named as such is kept): files
    under ``out``'s own folders (``OWN_FOLDERS``), and those under the own folders of an
    earlier output found inside an input folder (a ``labels/`` beside an ``overlay/``, which
    datasets do not have): a second run into ``photos/run2`` would otherwise segment the
    first run's PNGs in ``photos/run1``; said in one note. Raises :class:`DataError` for an
    input that matches nothing, listing all such inputs.
    """
    skipped = [] if out is None else [(out / f).resolve() for f in OWN_FOLDERS]
    earlier: set[Path] = set()  # earlier outputs whose files were left out

    def earlier_output(folder: Path) -> bool:
        return (
            folder.name in OWN_FOLDERS
            and (folder.parent / "overlay").is_dir()
            and (folder.parent / "labels").is_dir()
        )

    def wanted(f: Path, root: Path | None = None) -> bool:
        if not f.is_file() or f.suffix.lower() not in IMAGE_EXTENSIONS:
            return False
        real = f.resolve()
        if any(real.is_relative_to(s) for s in skipped):
            return False
        if root is not None:
            for folder in f.relative_to(root).parents[:-1]:  # below the input folder only
                if earlier_output(root / folder):
                    earlier.add((root / folder).parent)
                    return False
        return True

    found: list[tuple[Path, str]] = []
    missing: list[str] = []
    for item in inputs:
        if not item.strip():  # an unset shell variable: as a path, the whole current folder
            raise DataError("an input is an empty path; name an image file, a folder or a glob")
        path = Path(item)
        if path.is_dir():
            files = sorted(f for f in path.rglob("*") if wanted(f, path))
            if not files:
                why = (
                    "its images are this command's outputs under --out, never inputs"
                    if out is not None and any(path.resolve().is_relative_to(s) for s in skipped)
                    else f"a folder with no {'/'.join(IMAGE_EXTENSIONS)} images"
                )
                missing.append(f"{item} ({why})")
            found += [(f, f.relative_to(path).with_suffix("").as_posix()) for f in files]
        elif path.is_file():
            found.append((path, path.stem))
        elif glob.has_magic(item):
            matches = sorted(Path(f) for f in glob.glob(item, recursive=True))
            files = [(f, f.stem) for f in matches if wanted(f)]
            for folder in (m for m in matches if m.is_dir()):  # as the shell's expansion gives
                files += [
                    (f, (folder.name / f.relative_to(folder)).with_suffix("").as_posix())
                    for f in sorted(folder.rglob("*"))
                    if wanted(f, folder)
                ]
            if not files:
                missing.append(f"{item} (no image matches this pattern)")
            found += files
        else:
            missing.append(f"{item} (no such file or folder)")
    if missing:
        raise DataError("input not found: " + "; ".join(missing))
    if earlier:
        shown = ", ".join(str(f) for f in sorted(earlier)[:3])
        more = f" and {len(earlier) - 3} more" if len(earlier) > 3 else ""
        print(
            f"dualseg {command}: note: left out the outputs of an earlier run found among the "
            f"inputs ({shown}{more}: its {'/, '.join(OWN_FOLDERS)}/ folders)",
            file=sys.stderr,
        )
    return _unique_names(found)


def _unique_names(found: list[tuple[Path, str]]) -> list[tuple[Path, str]]:
    """Drop repeated files; give distinct files that share a name a numeric suffix."""
    kept: dict[str, tuple[Path, str]] = {}
    for path, name in unique_names(found):
        kept.setdefault(name, (path, name))
    return list(kept.values())


def check_image_outputs(
    args: argparse.Namespace,
    out: Path,
    images: Sequence[tuple[Path, str]],
    files: Sequence[tuple[str, str]],
    *,
    command: str = "predict",
) -> None:
    """Refuse, before any work, outputs ``out/<folder>/<name><suffix>`` (``files``: ``(folder,
    suffix)`` pairs, e.g. ``("labels", ".png")``) that exist (unless ``--overwrite``) or are
    an input image or a file of the ``--data`` dataset or of a dataset at ``out`` (always); see
    :func:`dualseg.commands.common.check_outputs`."""
    outputs = [out / folder / f"{name}{suffix}" for _, name in images for folder, suffix in files]
    protected = [("an input image", [path for path, _ in images])]
    if args.data:
        protected.append((f"a file of the dataset {args.data}", dataset_files(args.data)))
    # --out may itself be a dataset (its labels/ folder is where predictions go): its files too,
    # when it says so (meta.json or a list file), or when the inputs are its images/ and no
    # overlay/ or changed/ folder (which datasets do not have) shows that this command wrote
    # its labels/: they are then the ground truth of the very images being segmented. Labels
    # an earlier run wrote beside its inputs are that run's output, which --overwrite replaces.
    images_dir = (out / "images").resolve()
    paired = any(path.resolve().is_relative_to(images_dir) for path, _ in images)
    earlier_run = (out / "overlay").is_dir() or (out / "changed").is_dir()
    if (out / "meta.json").is_file() or any(out.glob("*.txt")) or (paired and not earlier_run):
        protected.append((f"a file of the dataset {out}", dataset_files(out)))
    check_outputs(outputs, overwrite=args.overwrite, protected=protected)
    if earlier_run:  # an earlier predict / refine apply output (a dataset has no overlay/)
        note_other_outputs(command, out, outputs, [folder for folder, _ in files])


def note_other_outputs(
    command: str, out: Path, outputs: Sequence[Path], folders: Sequence[str]
) -> None:
    """Say when ``out``'s own folders hold outputs this run will not write: an earlier run's,
    of other images (perhaps by another model), which stay beside this run's without a word
    otherwise. Nothing is removed: they may be the earlier chunks of one job."""
    ours = {p.resolve() for p in outputs}
    others = sorted(
        f
        for folder in folders
        if (out / folder).is_dir()
        for f in (out / folder).rglob("*")
        if f.is_file() and f.suffix in (".png", ".npz") and f.resolve() not in ours
    )
    if others:
        names = sorted({f.relative_to(out).with_suffix("").as_posix() for f in others})
        print(
            f"dualseg {command}: note: "
            f"{out} also holds {len(others)} output files of images this run does not segment "
            f"(e.g. {names[0]}), from an earlier run: they stay beside this run's; use a new "
            "--out to keep the two apart",
            file=sys.stderr,
        )


def save_probs(
    path: Path,
    probs: np.ndarray,
    class_names: Iterable[str],
    source: str,
    image_sha1: str | None = None,
) -> None:
    """Write one ``--probs`` file (keys: :data:`PROBS_KEYS`), compressed and atomically."""
    from dualseg.io import atomic_write_bytes

    buf = io.BytesIO()
    digest = {} if image_sha1 is None else {"image_sha1": np.asarray(image_sha1)}
    np.savez_compressed(
        buf,
        probs=probs.astype(np.float16),
        class_names=np.asarray(list(class_names), dtype=str),
        source=np.asarray(source),
        **digest,
    )
    atomic_write_bytes(path, buf.getvalue())


def write_outputs(
    out: Path,
    name: str,
    image: np.ndarray,
    label: np.ndarray,
    palette: Any,
    *,
    alpha: float = 0.5,
) -> None:
    """``labels/``, ``color/`` and ``overlay/`` PNGs of one image (atomic writes)."""
    from dualseg import viz
    from dualseg.io import atomic_save_image, label_png

    atomic_save_image(out / "labels" / f"{name}.png", label_png(label, len(palette)))
    atomic_save_image(out / "color" / f"{name}.png", viz.colorize(label, palette))
    atomic_save_image(
        out / "overlay" / f"{name}.png", viz.overlay(image, label, palette, alpha=alpha)
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.batch_size < 1:
        raise DualsegError(f"--batch-size must be >= 1, got {args.batch_size}")
    from dualseg.io import check_writable

    out = check_writable(args.out, kind="dir", what="--out")
    from dualseg.engine.predict import as_rgb_array, load_model
    from dualseg.imaging import rgb_digest

    device = apply_runtime(args)
    opts = inference_options(args)
    if args.onnx and (opts.mode != "whole" or opts.uses_tta):
        raise ConfigError(
            "--mode slide and --tta-* need --checkpoint: an --onnx model runs whole images "
            "only (drop those options, or pass the checkpoint)"
        )
    images = collect_images(args.inputs, out=out)
    files = [(f, ".npz" if f == "probs" else ".png") for f in OUTPUT_FOLDERS]
    check_image_outputs(args, out, images, files if args.probs else files[:-1])
    if args.onnx:
        from dualseg.export.runtime import ExportedSegmenter

        seg = ExportedSegmenter(args.onnx, **onnx_runtime(args, device))  # ONNX or TorchScript
        static_export_note(args.onnx, seg, "predict")
    else:
        seg = load_model(args.checkpoint, device=device, amp=cuda_amp(args, device))
    if seg.num_classes > 255:
        raise DualsegError(
            f"{args.checkpoint or args.onnx} has {seg.num_classes} classes; "
            "label PNGs hold at most 255"
        )
    check_dataset_classes(args, seg.class_names, f"the model {args.checkpoint or args.onnx}")
    failures: list[str] = []
    bar = Progress(total=len(images), desc="predict", unit="img", mode=mode_of(args))
    # Read a few batches' worth at a time: images of equal size share a forward pass.
    chunk = args.batch_size * 4
    for start in range(0, len(images), chunk):
        part = []
        for path, name in images[start : start + chunk]:
            try:
                part.append((path, name, as_rgb_array(path)))
            except DualsegError as err:
                failures.append(str(err))
                for folder, suffix in files if args.overwrite else []:
                    # an earlier run's outputs of this image: another model's, now stale
                    (out / folder / f"{name}{suffix}").unlink(missing_ok=True)
                bar.update(1)
        arrays = [a for _, _, a in part]
        if args.onnx:
            results = seg.predict_batch(arrays, batch_size=args.batch_size, return_probs=args.probs)
        else:
            results = seg.predict_batch(
                arrays,
                batch_size=args.batch_size,
                return_probs=args.probs,
                mode=opts.mode,
                window=opts.window,
                stride=opts.stride,
                tta_scales=opts.tta_scales,
                tta_flip=opts.tta_flip,
                tile_batch=opts.tile_batch,
            )
        for (path, name, array), res in zip(part, results):
            label, probs = res if args.probs else (res, None)
            write_outputs(out, name, array, label, seg.meta.palette, alpha=args.alpha)
            if probs is not None:
                # the resolved path: refine apply matches it from any working folder
                source = str(Path(path).resolve())
                save_probs(
                    out / "probs" / f"{name}.npz",
                    probs,
                    seg.class_names,
                    source,
                    image_sha1=rgb_digest(array),
                )
            elif args.overwrite:  # an earlier --probs run's scores: another model's, now stale
                (out / "probs" / f"{name}.npz").unlink(missing_ok=True)
            bar.update(1)
    bar.close()
    done = len(images) - len(failures)
    print(f"segmented {done} image(s) with {seg.num_classes} classes -> {out}")
    if failures:
        for message in failures:
            print(f"  skipped: {message}", file=sys.stderr)
        raise DataError(f"{len(failures)} of {len(images)} input image(s) could not be read")
    return 0
