"""Flags shared by the commands, each added by one helper so that every command spells and
means it the same way, and the checks and notes that go with them."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from dualseg.console import ArgumentParser, argparse_kwargs
from dualseg.data.datasets import dataset_meta, preset_for
from dualseg.data.presets import parse_label_map, require_same_classes
from dualseg.data.readers import LABEL_FORMATS
from dualseg.engine.inference import MODES, InferenceOptions
from dualseg.engine.options import MAX_THREADS
from dualseg.engine.predict import load_model, resolve_device
from dualseg.errors import ConfigError, DataError
from dualseg.export.runtime import ExportedSegmenter
from dualseg.refine.apply_run import OVERRIDABLE
from dualseg.refine.boundary import MAX_RADIUS
from dualseg.refine.config import RefinerConfig, switch_pairs


def command_parser(name: str, description: str, *examples: str) -> argparse.ArgumentParser:
    """``dualseg NAME``'s parser: one-line usage errors (exit 1) and its examples as epilog."""
    return ArgumentParser(
        prog=f"dualseg {name}", description=description, **argparse_kwargs(*examples)
    )


def int_in(low: int, high: int | None = None, unit: str = "") -> Callable[[str], int]:
    """argparse ``type=``: an integer in ``low..high``, refused while the line is parsed."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {low}, got {text!r}"
            ) from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}{unit}, got {value}")
        return value

    return parse


nonnegative_int = int_in(0)
positive_int = int_in(1)
threads = int_in(0, MAX_THREADS)  # OpenMP fails to start more


def number_in(text: str, ok: Callable[[float], bool], rule: str) -> float:
    """argparse ``type=`` helper: a finite number for which ``ok`` holds, refused at parsing."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number {rule}, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number {rule}, got {text!r}")
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
    return value


def fraction(text: str) -> float:
    """argparse ``type=``: a number in [0, 1] (``--alpha``)."""
    return number_in(text, lambda v: 0 <= v <= 1, "in [0, 1]")


def nonnegative_float(text: str) -> float:
    """argparse ``type=``: a finite number >= 0 (``--calibrate-max-broken-ratio``)."""
    return number_in(text, lambda v: v >= 0, ">= 0")


def megapixels(text: str) -> float:
    """``--max-megapixels``: a positive finite number."""
    return number_in(text, lambda v: v > 0, "positive (megapixels)")


# refiner options whose flags check more than their type, as the line is parsed
REFINER_PARSED = {
    "radius": int_in(0, MAX_RADIUS, " pixels"), "top_n": positive_int,
    "blocked_switches": switch_pairs,
}  # fmt: skip


def add_refiner_overrides(p: argparse.ArgumentParser) -> None:
    """``--top-n --radius`` and the decision flags (``--gate-margin`` ...): this run's values
    for a refiner's stored options (:data:`OVERRIDABLE`), each checked by the option's rule as
    the line is parsed; a flag not given is absent from ``args`` (:func:`refiner_overrides`)."""
    group = p.add_argument_group(
        "method B",
        "set the refiner's options for this run "
        "(default: the refiner's own; 'dualseg refine fit --help')",
    )
    fields = {f.name: f for f in dataclasses.fields(RefinerConfig)}
    for name in OVERRIDABLE:
        meta, optional = fields[name].metadata, fields[name].type == float | None
        parse = REFINER_PARSED.get(name) or _option_number(meta["ok"], meta["rule"], optional)
        help = meta["help"] + (" (none: off)" if optional else "")
        group.add_argument(f"--{name.replace('_', '-')}", type=parse, default=argparse.SUPPRESS,
                           help=help)  # fmt: skip


def _option_number(ok: Callable[[Any], bool], rule: str, optional: bool) -> Callable[[str], Any]:
    def parse(text: str) -> float | None:
        return None if optional and text.lower() == "none" else number_in(text, ok, rule)

    return parse


def refiner_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The options :func:`add_refiner_overrides`' flags set on this command line."""
    return {k: getattr(args, k) for k in OVERRIDABLE if hasattr(args, k)}


def bit_depth(text: str) -> int:
    """``--bit-depth``: bits per sample of 16-bit images, 8..16."""
    value = nonnegative_int(text)
    if not 8 <= value <= 16:
        raise argparse.ArgumentTypeError(f"expected 8..16 bits per sample, got {value}")
    return value


def parse_ignore_index(text: str) -> int | str | None:
    """``--ignore-index``: a raw label value 0..255, ``none`` / ``null`` (no value) or ``auto``."""
    if text.lower() in NO_MAP:
        return None
    if text == "auto":
        return text
    if not text.isdigit() or int(text) > 255:
        raise argparse.ArgumentTypeError(f"expected 0..255, none or auto, got {text!r}")
    return int(text)


# --ignore-index's default where a trained model is scored: the model's own value (an object,
# so that argparse does not pass it through the flag's parser)
FROM_TRAINING = object()
NO_MAP = ("none", "null")


def add_label_args(p: argparse.ArgumentParser, *, source: str) -> None:
    """``--label-format --label-map --ignore-index``; each not given takes ``source``'s
    training value (:func:`label_settings`)."""
    add = p.add_argument
    add("--label-format", choices=LABEL_FORMATS,
        help=f"index | color (default: {source}'s training data.label_format)")  # fmt: skip
    add("--label-map", metavar="RAW:CLASS[,...]|none", help="map raw label values to class ids, "
        f"e.g. 255:1 (default: {source}'s training data.label_map; none: none)")  # fmt: skip
    add("--ignore-index", type=parse_ignore_index, default=FROM_TRAINING, metavar="RAW|none|auto",
        help=f"the raw label value meaning ignore (default: {source}'s)")  # fmt: skip


def add_pixel_args(p: argparse.ArgumentParser, *, source: str) -> None:
    """``--bit-depth`` (default: ``source``'s training bit depth) and ``--max-megapixels``."""
    add = p.add_argument
    add("--bit-depth", type=bit_depth, metavar="BITS",
        help=f"bits per sample of 16-bit images, 8..16 (default: {source}'s)")  # fmt: skip
    add("--max-megapixels", type=megapixels, metavar="N",
        help="read images of up to N megapixels (above Pillow's limit)")  # fmt: skip


def label_settings(
    args: argparse.Namespace, trained: dict[str, Any], *, note: str | None = None
) -> tuple[str, dict[int, int] | None, Any]:
    """``(label_format, label_map, ignore_value)``: each label flag not given takes the value
    of ``trained`` (the model's training ``data`` section), said on stderr after ``note``."""
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
        flags = "--label-format / --label-map / --ignore-index change it"
        print(f"{note}: {', '.join(taken)} ({flags})", file=sys.stderr)
    return label_format, label_map, ignore


def split_of(data: Any, split: str | None, *, default: str, flag: str = "--data") -> str:
    """``--split`` (else ``default``); a list file as the dataset is the one split its stem
    names, and a ``--split`` naming another is refused."""
    path = Path(data)
    if data and path.is_file() and path.suffix.lower() == ".txt":
        if split is not None and split != path.stem:
            raise ConfigError(
                f"{flag} {data} is one split, {path.stem!r}; drop --split {split}, or pass the "
                "dataset's folder to read another split"
            )
        return path.stem
    return default if split is None else split


def add_data_args(p: argparse.ArgumentParser, *, split: str) -> None:
    """``--data`` (required), ``--split`` (default ``split``), ``--layout`` and ``--preset``."""
    p.add_argument("--data", "-d", required=True, help="dataset root folder (or a list file)")
    p.add_argument("--split", help=f"split to read ({split}; a list file as --data: its name)")
    p.add_argument("--layout", default="auto", help="dataset layout (auto)")
    p.add_argument("--preset", help="class preset (default: ROOT/meta.json, else the model's)")


def skipped(failures: Sequence[str], total: int) -> None:
    """Say which inputs could not be read; then one error when any could not."""
    for message in failures:
        print(f"  skipped: {message}", file=sys.stderr)
    if failures:
        raise DataError(f"{len(failures)} of {total} input image(s) could not be read")


def add_runtime_args(p: argparse.ArgumentParser, *, device: str = "auto") -> None:
    """``--device`` (default ``device``), ``--threads`` (0) and ``--amp`` (off)."""
    g = p.add_argument_group("device")
    g.add_argument("--device", default=device, help=f"auto | cpu | cuda | cuda:N ({device})")
    g.add_argument("--threads", type=threads, default=0, help="torch CPU threads (0: one per core)")
    g.add_argument("--amp", action="store_true", help="bf16 autocast on CUDA (off; CPU: ignored)")


def apply_runtime(args: argparse.Namespace) -> torch.device:
    """Apply ``--threads`` and return the resolved ``--device``."""
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    return resolve_device(args.device)


def cuda_amp(args: argparse.Namespace, device: torch.device) -> bool:
    """Whether ``--amp`` applies: bf16 autocast on CUDA only (ignored on the CPU)."""
    return bool(args.amp) and device.type == "cuda"


def onnx_runtime(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """``--device`` / ``--threads`` for an ``--onnx`` model: onnxruntime's providers and
    intra-op threads; ``--amp`` and a GPU this onnxruntime cannot use are refused."""
    if args.amp:
        raise ConfigError("--amp applies to --checkpoint models only: drop it with --onnx")
    providers = None
    if device.type == "cuda":
        import onnxruntime as ort

        if "CUDAExecutionProvider" in ort.get_available_providers():
            providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
        elif args.device != "auto":
            raise ConfigError(
                f"--device {args.device} with --onnx needs onnxruntime-gpu; pass --device cpu, "
                "or the checkpoint"
            )
    return {"providers": providers, "threads": args.threads or None}


def static_export_note(path: Any, model: Any, command: str) -> None:
    """A note when ``model`` is a static export: every image is resized to its one size."""
    size = getattr(model, "input_size", None) or getattr(
        getattr(model, "runner", None), "static_hw", None
    )
    if size:
        note = f"{path} is a static export at {size[0]}x{size[1]}: every image is resized to it"
        print(f"dualseg {command}: note: {note} and back (export --dynamic keeps sizes)",
              file=sys.stderr)  # fmt: skip


def add_quiet_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", "-q", action="store_true", help="no progress output (default: "
                   "bars on a terminal, a plain line every 30 s in a log)")  # fmt: skip


def add_overwrite_arg(p: argparse.ArgumentParser, *, what: str = "output files") -> None:
    p.add_argument("--overwrite", action="store_true", help=f"replace {what} that already "
                   "exist (off: refused); never an input or a dataset file")  # fmt: skip


def add_inference_arguments(p: argparse.ArgumentParser) -> None:
    """``--mode --window --stride --tta-scales --tta-flip --tile-batch``."""
    d = InferenceOptions()
    g = p.add_argument_group("inference", "sliding window and test-time augmentation")
    add = g.add_argument
    add("--mode", choices=MODES, default=d.mode, help="whole: one pass per image; slide: tiles "
        f"of --window every --stride px, logits averaged ({d.mode})")  # fmt: skip
    add("--window", type=int, nargs=2, metavar=("H", "W"), help=f"tile size ({d.window[0]} "
        f"{d.window[1]})")  # fmt: skip
    add("--stride", type=int, nargs=2, metavar=("H", "W"), help="tile step (2/3 of the window)")
    add("--tta-scales", type=float, nargs="+", default=list(d.tta_scales), metavar="S",
        help="average the softmax over these resize factors, e.g. 0.75 1 1.25 (1)")  # fmt: skip
    add("--tta-flip", action="store_true", help="also average the mirrored image")
    add("--tile-batch", type=int, default=d.tile_batch, help=f"tiles per pass ({d.tile_batch})")


def inference_options(args: argparse.Namespace) -> InferenceOptions:
    """The options of :func:`add_inference_arguments` (ConfigError when invalid)."""
    if args.mode != "slide" and (args.window is not None or args.stride is not None):
        raise ConfigError("--window and --stride set the tiles of --mode slide; add --mode slide")
    opts = InferenceOptions(
        mode=args.mode,
        window=InferenceOptions.window if args.window is None else tuple(args.window),
        stride=None if args.stride is None else tuple(args.stride),
        tta_scales=tuple(args.tta_scales),
        tta_flip=args.tta_flip,
        tile_batch=args.tile_batch,
    )
    if getattr(args, "onnx", None) and opts.augmented:
        raise ConfigError("--mode slide and --tta-* need --checkpoint: --onnx runs whole images")
    return opts


def load_segmenter(args: argparse.Namespace, device: torch.device, command: str) -> Any:
    """The ``--checkpoint`` segmenter, or the ``--onnx`` exported one (ONNX or TorchScript)."""
    if not args.onnx:
        return load_model(args.checkpoint, device=device, amp=cuda_amp(args, device))
    segmenter = ExportedSegmenter(args.onnx, **onnx_runtime(args, device))
    static_export_note(args.onnx, segmenter, command)
    return segmenter


def add_dataset_check_options(p: argparse.ArgumentParser) -> None:
    """``--data`` / ``--preset``: the dataset whose classes the model must have."""
    p.add_argument("--data", metavar="ROOT", help="refuse a model whose classes differ from "
                   "ROOT's (ROOT/meta.json or its layout's preset)")  # fmt: skip
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
