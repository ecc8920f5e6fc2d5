"""Flags shared by the commands that run a model: ``--device``, ``--threads``, ``--amp``,
``--quiet`` — added by one helper so that every command spells and means them the same way.

Also the output safety shared by ``predict``, ``eval --save-predictions``, ``refine apply`` and
``data check --json``: :func:`check_outputs` refuses, before any work, an output file that
already exists (unless ``--overwrite``) and one that is an input image or a dataset file
(always); :func:`unique_names` gives images that share a file name distinct output names.

``dualseg train`` has the same three as config fields (``--train.device``, ``--train.threads``,
``--train.amp``), since a run's YAML records them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from dualseg.console import ProgressMode, progress_mode

__all__ = [
    "add_label_args",
    "add_overwrite_arg",
    "add_quiet_arg",
    "add_runtime_args",
    "apply_runtime",
    "autocast",
    "check_outputs",
    "dataset_files",
    "fraction",
    "label_settings",
    "mode_of",
    "nonnegative_int",
    "parse_ignore_index",
    "positive_int",
    "split_of",
    "unique_names",
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
    from dualseg.data.readers import LABEL_FORMATS

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


def label_settings(
    args: argparse.Namespace, trained: dict[str, Any]
) -> tuple[str, dict[int, int] | None, Any, list[str]]:
    """How to read the labels: ``(label_format, label_map, ignore_value, taken)``.

    ``trained``: the ``data`` section of the model's training config (a pretrained folder
    keeps its label keys; empty when unknown, e.g. a torch module). Each of
    :func:`add_label_args`' flags not given takes the value the model was trained with, so a
    model trained on 0/255 masks with ``--data.label_map 255:1`` is scored on the classes it
    learnt; ``taken`` lists what was taken, for a note.
    """
    from dualseg.data.presets import parse_label_map

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
    return label_format, label_map, ignore, taken


def split_of(data: str | os.PathLike[str], split: str | None, *, default: str,
             flag: str = "--data") -> str:  # fmt: skip
    """The split that ``flag`` (the dataset) and ``--split`` name: ``--split`` (``default``
    when not given), but a list file as the dataset is one split, named by its stem
    (``test.txt`` is test), which a ``--split`` naming another refuses: the file's pairs were
    read whatever ``--split`` said (eval wrote them down as val's, refine fit and augment used
    val.txt's images for train)."""
    from dualseg.errors import ConfigError

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
    from dualseg.errors import ConfigError

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
    import sys

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
    import torch

    from dualseg.engine.config import MAX_THREADS
    from dualseg.engine.predict import resolve_device

    if not 0 <= args.threads <= MAX_THREADS:
        from dualseg.errors import ConfigError

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
    import contextlib

    import torch

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


def unique_names(found: Sequence[tuple[Path, str]]) -> list[tuple[Path, str]]:
    """``(path, name)`` pairs with names made distinct: distinct files that share a name get a
    numeric suffix (``x``, ``x_1``, ...); a file listed again keeps its first name.

    Every file whose own name is free keeps it (``x.jpg``, ``x.png`` and ``x_1.png`` give
    ``x``, ``x_2`` and ``x_1``: the suffix never takes another file's name), and names are
    compared case-insensitively (``X.png`` and ``x.png`` would be one file on macOS or
    Windows)."""
    keys = [path.resolve() for path, _ in found]
    by_file: dict[Path, str] = {}
    used: set[str] = set()
    for key, (_, name) in zip(keys, found):  # first: each free name to the first file with it
        if key not in by_file and name.casefold() not in used:
            by_file[key] = name
            used.add(name.casefold())
    for key, (_, name) in zip(keys, found):  # then the others, numbered past every name taken
        if key not in by_file:
            k = 1
            while f"{name}_{k}".casefold() in used:
                k += 1
            by_file[key] = f"{name}_{k}"
            used.add(by_file[key].casefold())
    return [(path, by_file[key]) for key, (path, _) in zip(keys, found)]


def dataset_files(root: str | os.PathLike[str], *, layout: str = "auto") -> Iterator[Path]:
    """The files of the dataset at ``root`` (any split): its list files, images, labels and
    ``meta.json`` — what an output must never replace. A generator: nothing is scanned unless
    it is read."""
    from dualseg.data.datasets import available_splits, discover
    from dualseg.errors import DataError

    root = Path(root)
    yield root if root.is_file() else root / "meta.json"
    for split in dict.fromkeys([*available_splits(root, layout), "train", "val", "test"]):
        try:
            found = discover(root, split=split, layout=layout)
        except DataError:
            continue
        if found.source is not None and found.source.is_file():
            yield found.source
        for image, label in found.samples:
            yield image
            yield label


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def check_outputs(
    outputs: Iterable[Path],
    *,
    overwrite: bool,
    protected: Iterable[tuple[str, Iterable[Path]]] = (),
    what: str = "--out",
) -> None:
    """Refuse (:class:`~dualseg.errors.OutputError`, one line) before any work when one of
    ``outputs`` already exists: always when it is one of the ``protected`` files (groups of
    ``(description, paths)``, e.g. ``("an input image", images)``; the same file by another
    path counts too), otherwise unless ``overwrite``. ``what`` names the option that chose the
    place (``--out``). The protected files are read only when some output exists."""
    from dualseg.errors import OutputError

    outputs = [Path(p) for p in outputs]
    for folder in {p.parent for p in outputs}:  # found mid-run otherwise, after some writes
        blocker = next((f for f in (folder, *folder.parents) if os.path.lexists(f)), None)
        if blocker is not None and not blocker.is_dir():
            raise OutputError(
                f"{what}: {blocker} is a file where an output folder goes; remove it or choose "
                f"another {what}"
            )
    existing = [p for p in outputs if os.path.lexists(p)]
    if not existing:
        return
    folders = [p for p in existing if p.is_dir()]
    if folders:
        raise OutputError(
            f"{what}: {folders[0]} is a folder where an output file goes; remove it or choose "
            f"another {what}"
        )
    ids = {_file_id(p): p for p in existing} if protected else {}
    ids.pop(None, None)
    for description, paths in protected:
        for source in paths:
            hit = ids.get(_file_id(Path(source)))
            if hit is not None:
                same = "" if os.path.abspath(hit) == os.path.abspath(source) else f" ({source})"
                raise OutputError(
                    f"{what}: {hit} is {description}{same}; it is never written over, not even "
                    f"with --overwrite: choose another {what}"
                )
    if not overwrite:
        more = f" (and {len(existing) - 1} more output files)" if len(existing) > 1 else ""
        raise OutputError(
            f"{what}: {existing[0]} already exists{more}; pass --overwrite to replace, "
            f"or choose another {what}"
        )
