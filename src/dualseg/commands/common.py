"""Flags shared by the commands, each added by one helper so that every command spells and
means it the same way: ``--device --threads --amp --quiet --overwrite``, the label flags, the
inference flags (``--mode --window --stride --tta-*``) and ``--data`` / ``--preset`` as a class
check. The output-safety helpers live in :mod:`dualseg.engine.outputs` (re-exported here).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dualseg.console import ProgressMode, progress_mode
from dualseg.data.datasets import dataset_meta, preset_for
from dualseg.data.presets import parse_label_map, require_same_classes
from dualseg.data.readers import LABEL_FORMATS
from dualseg.engine.config import MAX_THREADS
from dualseg.engine.inference import MODES, InferenceOptions
from dualseg.engine.outputs import (
    check_image_outputs,
    check_outputs,
    collect_images,
    dataset_files,
    unique_names,
    write_outputs,
)
from dualseg.engine.predict import resolve_device
from dualseg.errors import ConfigError, DataError

__all__ = [
    "add_dataset_check_options",
    "add_inference_arguments",
    "add_label_args",
    "add_overwrite_arg",
    "add_pixel_args",
    "add_quiet_arg",
    "add_runtime_args",
    "apply_runtime",
    "autocast",
    "check_dataset_classes",
    "check_image_outputs",
    "check_outputs",
    "collect_images",
    "dataset_files",
    "fraction",
    "inference_options",
    "label_settings",
    "mode_of",
    "nonnegative_int",
    "parse_ignore_index",
    "positive_int",
    "split_of",
    "unique_names",
    "write_outputs",
]

DEVICE_HELP = "auto | cpu | cuda | cuda:N (auto: CUDA when available)"


def nonnegative_int(text: str) -> int:
    """argparse ``type=``: an integer >= 0 (``--workers``, pixel widths), refused at parsing."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def pixels_at_most(text: str, limit: int) -> int:
    """An integer 0..``limit`` pixels (a band width, a radius), refused at parsing: the body of
    the bounded pixel ``type=`` functions, which import their limit lazily."""
    value = nonnegative_int(text)
    if value > limit:
        raise argparse.ArgumentTypeError(f"must be at most {limit} pixels, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer >= 1 (a step interval), refused at parsing."""
    return _int_at_least(text, 1)


def parse_ignore_index(text: str) -> int | str | None:
    """``--ignore-index``: a raw label value 0..255, ``none`` / ``null`` (no value) or ``auto``."""
    if text.lower() in {"none", "null"}:
        return None
    if text == "auto":
        return text
    if not text.isdigit() or int(text) > 255:
        raise argparse.ArgumentTypeError(f"expected 0..255, none or auto, got {text!r}")
    return int(text)


# --ignore-index's default in commands that score a trained model: the model's training value.
# Not a string (argparse would pass a string default through the flag's parser), none of the
# flag's values.
FROM_TRAINING = object()
NO_MAP = ("none", "null")  # --label-map spellings of "no extra map" (as --ignore-index's)


def add_label_args(p: argparse.ArgumentParser, *, source: str) -> None:
    """``--label-format``, ``--label-map`` and ``--ignore-index`` for a command that reads
    labels for a trained model (``source``: e.g. "the checkpoint"); each not given takes the
    model's training value (:func:`label_settings`)."""
    p.add_argument(
        "--label-format",
        choices=LABEL_FORMATS,
        default=None,
        help=f"index | color (default: {source}'s training data.label_format, else index)",
    )
    p.add_argument(
        "--label-map",
        default=None,
        metavar="RAW:CLASS[,...]|none",
        help="map raw label values to class ids, e.g. 255:1, on top of ROOT/meta.json's "
        f"(default: {source}'s training data.label_map; none: no extra map)",
    )
    p.add_argument(
        "--ignore-index",
        type=parse_ignore_index,
        default=FROM_TRAINING,
        metavar="RAW|none|auto",
        help="the raw label value meaning ignore; none: no value; auto: the dataset's "
        f"(default: {source}'s training data.ignore_index, else auto)",
    )


def bit_depth_arg(text: str) -> int:
    """``--bit-depth``: bits per sample of 16-bit images, 8..16."""
    value = nonnegative_int(text)
    if not 8 <= value <= 16:
        raise argparse.ArgumentTypeError(f"expected 8..16 bits per sample, got {value}")
    return value


def megapixels_arg(text: str) -> float:
    """``--max-megapixels``: a positive number."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of megapixels, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def add_pixel_args(p: argparse.ArgumentParser, *, source: str) -> None:
    """``--bit-depth`` (default: ``source``'s training bit depth) and ``--max-megapixels``."""
    p.add_argument(
        "--bit-depth",
        type=bit_depth_arg,
        default=None,
        metavar="BITS",
        help="bits per sample of 16-bit images, 8..16 (default: as "
        f"{source}'s training images were read; detected when it says nothing)",
    )
    p.add_argument(
        "--max-megapixels",
        type=megapixels_arg,
        default=None,
        metavar="N",
        help="read images of up to N megapixels, above Pillow's limit (default: Pillow's "
        "limit); use with --mode slide, which segments them tile by tile",
    )


def explicit_label_args(args: argparse.Namespace) -> bool:
    """Whether the user said how to read labels or pixels (a label or pixel flag given)."""
    return (
        args.label_format is not None
        or args.label_map is not None
        or args.ignore_index is not FROM_TRAINING
        or args.bit_depth is not None
    )


def label_settings(
    args: argparse.Namespace, trained: dict[str, Any], *, note: str | None = None
) -> tuple[str, dict[int, int] | None, Any, list[str]]:
    """How to read the labels: ``(label_format, label_map, ignore_value, taken)``.

    ``trained``: the ``data`` section of the model's training config (a pretrained folder
    keeps its label keys; empty when unknown, e.g. a torch module). Each of
    :func:`add_label_args`' flags not given takes the value the model was trained with, so a
    model trained on 0/255 masks with ``--data.label_map 255:1`` is scored on the classes it
    learnt; ``taken`` lists what was taken. ``note`` (e.g. ``"dualseg eval: note: labels
    read as best.pt was trained"``): said on stderr, with what was taken.
    """
    taken: list[str] = []
    label_format = args.label_format
    if label_format is None:
        label_format = trained.get("label_format") or "index"
        if label_format != "index":
            taken.append(f"data.label_format {label_format}")
    text = args.label_map
    if text is None and trained.get("label_map"):
        text = str(trained["label_map"])
        taken.append(f"data.label_map {text}")
    label_map = None if text is None or text.lower() in NO_MAP else parse_label_map(text)
    ignore = args.ignore_index
    if ignore is FROM_TRAINING:
        ignore = trained.get("ignore_index", "auto")
        if ignore != "auto":
            taken.append(f"data.ignore_index {'none' if ignore is None else ignore}")
    if note and taken:
        print(
            f"{note}: {', '.join(taken)} (--label-format / --label-map / --ignore-index change it)",
            file=sys.stderr,
        )
    return label_format, label_map, ignore, taken


def split_of(data: str | os.PathLike[str], split: str | None, *, default: str,
             flag: str = "--data") -> str:  # fmt: skip
    """The split that ``flag`` (the dataset) and ``--split`` name: ``--split`` (``default``
    when not given), but a list file as the dataset is one split, named by its stem
    (``test.txt`` is test), which a ``--split`` naming another refuses: the file's pairs were
    read whatever ``--split`` said (eval wrote them down as val's, refine fit and augment used
    val.txt's images for train)."""
    path = Path(data)
    if data and path.is_file() and path.suffix.lower() == ".txt":
        if split is not None and split != path.stem:
            raise ConfigError(
                f"{flag} {data} is one split, {path.stem!r}; drop --split {split}, or pass the "
                "dataset's folder to read another split"
            )
        return path.stem
    return default if split is None else split


def fraction(text: str) -> float:
    """argparse ``type=``: a number in [0, 1] (``--alpha``), refused at parsing, so that no
    output is written before a bad value is noticed."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:  # also NaN
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def add_runtime_args(p: argparse.ArgumentParser, *, device: str = "auto") -> None:
    """``--device`` (default ``device``), ``--threads`` (0) and ``--amp`` (off)."""
    g = p.add_argument_group("device")
    g.add_argument("--device", default=device, help=f"{DEVICE_HELP} ({device})")
    g.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (0: torch's default, one per core)",
    )
    g.add_argument("--amp", action="store_true", help="bf16 autocast on CUDA (off; CPU: ignored)")


def onnx_runtime(args: argparse.Namespace, device: Any) -> dict[str, Any]:
    """``--device`` / ``--threads`` for an ``--onnx`` model (onnxruntime, not torch): CUDA's
    provider when a GPU is named, the thread count as onnxruntime's intra-op threads. ``--amp``
    (torch autocast) has no meaning there and is refused, as is a named GPU this onnxruntime
    cannot use; ``auto`` takes what it can."""
    if args.amp:
        raise ConfigError("--amp applies to --checkpoint models only: drop it with --onnx")
    providers = None
    if device.type == "cuda":
        import onnxruntime as ort

        if "CUDAExecutionProvider" in ort.get_available_providers():
            providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
        elif args.device != "auto":
            raise ConfigError(
                f"--device {args.device} with --onnx needs onnxruntime-gpu (this onnxruntime "
                "runs on the CPU only); pass --device cpu, or the checkpoint"
            )
    return {"providers": providers, "threads": args.threads or None}


def static_export_note(path: Any, model: Any, command: str) -> None:
    """One note on stderr when ``model`` (an exported segmenter or refiner) is a static export:
    it resizes every image to its one size and back, so its labels differ from the
    checkpoint's at any other size, which nothing else in the run would say."""
    size = getattr(model, "input_size", None) or getattr(
        getattr(model, "runner", None), "static_hw", None
    )
    if size:
        print(
            f"dualseg {command}: note: {path} is a static export at {size[0]}x{size[1]}: every "
            "image is resized to it and back, so its labels differ from the checkpoint's at "
            "other sizes (export with --dynamic to run each image at its own size)",
            file=sys.stderr,
        )


def add_quiet_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        help="no progress output (default: bars on a terminal, a plain line every 30 s in a log)",
    )


def apply_runtime(args: argparse.Namespace) -> Any:
    """Apply ``--threads`` and return the resolved ``--device`` (a ``torch.device``)."""
    if not 0 <= args.threads <= MAX_THREADS:
        raise ConfigError(
            f"--threads must be 0..{MAX_THREADS} (0: torch's default, one per core), got "
            f"{args.threads}"
        )
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    return resolve_device(args.device)


def mode_of(args: argparse.Namespace) -> ProgressMode:
    """The progress mode of a command run with these arguments (see :mod:`dualseg.console`)."""
    return progress_mode(getattr(args, "quiet", False))


def cuda_amp(args: argparse.Namespace, device: Any) -> bool:
    """Whether ``--amp`` applies: bf16 autocast runs on CUDA only (on the CPU it is ignored,
    as its help says)."""
    return bool(args.amp) and device.type == "cuda"


def autocast(args: argparse.Namespace, device: Any) -> Any:
    """``--amp``: a bf16 autocast context on CUDA; a no-op context otherwise."""
    if cuda_amp(args, device):
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def add_overwrite_arg(p: argparse.ArgumentParser, *, what: str = "output files") -> None:
    """``--overwrite`` (off): replace ``what`` that already exist; see :func:`check_outputs`."""
    p.add_argument(
        "--overwrite",
        action="store_true",
        help=f"replace {what} that already exist (off: an existing one is refused before any "
        "work); an input image or a dataset file is never replaced",
    )


def add_inference_arguments(p: argparse.ArgumentParser) -> None:
    """``--mode --window --stride --tta-scales --tta-flip --tile-batch`` (shared by ``eval``,
    ``predict`` and ``refine apply``); defaults from :class:`InferenceOptions`."""
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


def inference_options(args: argparse.Namespace) -> Any:
    """The validated options of :func:`add_inference_arguments` (ConfigError when invalid)."""
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
