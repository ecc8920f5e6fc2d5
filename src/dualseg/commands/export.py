"""``dualseg export``: a checkpoint (method A) or a refiner (method B) to ONNX / TorchScript.

    dualseg export --checkpoint runs/demo/last.pt --format onnx --out model.onnx --dynamic
    dualseg export --refiner runs/demo/refiner.pt --format onnx --out refiner.onnx --dynamic
    dualseg export --checkpoint runs/demo/last.pt --format pretrained --out demo-model/

After writing, the exported file is run once (onnxruntime on CPU, or the TorchScript module)
on the example input and compared with PyTorch; the largest difference is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dualseg.console import ArgumentParser, argparse_kwargs
from dualseg.errors import ConfigError, DualsegError
from dualseg.export.runners import refiner_sidecar_path

MAX_SIDE = 8192  # the largest --size side: a static export's fixed size, a trace's example


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="dualseg export",
        description="Export a trained network to ONNX or TorchScript, with class names, palette "
        "and normalization in the file's metadata, or as a pretrained folder (safetensors).",
        **argparse_kwargs(
            "dualseg export -c runs/camvid/best.pt --format onnx --out model.onnx --dynamic",
            "dualseg export -c runs/camvid/best.pt --format pretrained --out camvid-model/",
        ),
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--checkpoint",
        "-c",
        help="a model to export: a dualseg checkpoint (.pt), a pretrained folder or hf://org/name",
    )
    src.add_argument(
        "--refiner",
        help="a method-B refiner file: exports its embedding model, plus <out stem>.json with "
        "prototypes and configuration",
    )
    p.add_argument(
        "--format",
        choices=("onnx", "torchscript", "pretrained"),
        default="onnx",
        help="onnx, torchscript, or pretrained: a folder with config.json + model.safetensors "
        "(refiner.json + refiner.safetensors for --refiner) that dualseg.load_model reads and "
        "the Hugging Face Hub hosts as is (onnx)",
    )
    p.add_argument("--out", "-o", required=True, help="output file (.onnx / .pt) or folder")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --out (with --refiner, also its <out stem>.json; --format "
        "pretrained: the files in the --out folder); never the checkpoint or refiner exported",
    )
    p.add_argument(
        "--dynamic",
        action="store_true",
        help="dynamic batch, height and width (otherwise batch 1 at --size)",
    )
    p.add_argument(
        "--output",
        choices=("logits", "probs"),
        default="logits",
        help="what the exported network returns (logits); --checkpoint exports only",
    )
    p.add_argument(
        "--size",
        type=int,
        nargs=2,
        metavar=("H", "W"),
        default=None,
        help="input size: the fixed size of a static export (512 512), the tracing size of a "
        "dynamic one (64 64)",
    )
    p.add_argument(
        "--opset", type=int, default=None, help="ONNX opset (17 with legacy, 18 with dynamo)"
    )
    p.add_argument(
        "--exporter",
        choices=("legacy", "dynamo"),
        default="legacy",
        help="torch.onnx exporter: legacy (TorchScript-based, handles the GRU sweeps with "
        "dynamic sizes) or dynamo (static exports only) (legacy)",
    )
    p.add_argument("--no-verify", action="store_true", help="skip the PyTorch comparison")
    p.add_argument(
        "--tolerance",
        type=float,
        default=1e-3,
        help="largest |exported - pytorch| the comparison accepts; above it the export is "
        "removed and the command fails (1e-3)",
    )
    return p


def _same_path(a: Path, b: Path) -> bool:
    """``a`` and ``b`` name the same file or folder (symlinks, ``..`` and hard links too)."""
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
        return a.resolve() == b.resolve()
    except OSError:
        return False


def check_outputs(args: argparse.Namespace) -> list[Path]:
    """The paths the export will write, refused (one line) when one of them is the checkpoint
    or refiner being exported, or, without ``--overwrite``, when one already exists.

    Nothing is written before this check: an export never replaces its own input, and never
    replaces an earlier export unless asked to.
    """
    source = args.checkpoint or args.refiner
    flag = "--checkpoint" if args.checkpoint else "--refiner"
    out = Path(args.out)
    if args.format == "pretrained":
        targets = [out]  # save_pretrained refuses existing files in the folder itself
    elif args.refiner:
        from dualseg.refine.pretrained import REFINER_CONFIG, REFINER_WEIGHTS

        sidecar = refiner_sidecar_path(out)
        if _same_path(out, sidecar):
            raise ConfigError(
                f"--out {out}: the refiner's sidecar is <out stem>.json, which would replace "
                "the exported model; name the model .onnx or .pt"
            )
        if sidecar.exists() and (sidecar.parent / REFINER_WEIGHTS).exists():
            # a pretrained folder's refiner.json: --overwrite would break that folder
            raise ConfigError(
                f"--out {out}: its sidecar {sidecar} is the {REFINER_CONFIG} of the pretrained "
                f"folder {sidecar.parent}; name the export otherwise (e.g. "
                f"{sidecar.parent / ('exported_' + out.name)})"
            )
        targets = [out, sidecar]
    else:
        targets = [out]
    if source and "://" not in str(source):
        for target in targets:
            # a pretrained folder being exported: none of its files is an output either
            inside = Path(source).is_dir() and _same_path(target.parent, Path(source))
            if _same_path(target, Path(source)) or (inside and target.exists()):
                raise ConfigError(
                    f"--out {args.out} would overwrite {flag} {source}"
                    f"{f' ({target.name})' if inside else ''}, the model being exported; "
                    "choose another --out"
                )
    if args.format != "pretrained":
        from dualseg.serialization import torch_file_format

        for target in targets:  # an earlier export may be replaced; a trained file never
            kind = torch_file_format(target) if target.is_file() else None
            if kind:
                raise ConfigError(
                    f"--out {target} is a dualseg file ({kind}), not an earlier export; "
                    "export never writes over it, not even with --overwrite: choose another --out"
                )
    if args.format != "pretrained" and not args.overwrite:
        present = [str(t) for t in targets if t.exists()]
        if present:
            raise ConfigError(
                f"{' and '.join(present)} already exist{'s' if len(present) == 1 else ''}; "
                "choose another --out, delete it, or pass --overwrite to replace it"
            )
    return targets


@contextlib.contextmanager
def _written_aside(out: Path) -> Iterator[Path]:
    """A path named as ``out`` in a temporary folder beside it: the export is written and
    verified there, and only then moved into place (each file by ``os.replace``), so an earlier
    export at ``out`` stays whole until the new one has passed its check, whatever stops the
    run (an error, Ctrl-C, SIGTERM or SIGKILL); a folder such a run left is removed by the
    next one."""
    import shutil
    import tempfile

    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.export-*"):
        shutil.rmtree(stale, ignore_errors=True)
    aside = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.export-"))
    try:
        yield aside / out.name
        for written in sorted(aside.iterdir()):  # the model (and a refiner's sidecar)
            os.replace(written, out.parent / written.name)
    finally:
        shutil.rmtree(aside, ignore_errors=True)


# options that only some formats read: given to another, they would be dropped silently
FORMAT_OPTIONS = {
    "--dynamic": ("dynamic", ("onnx", "torchscript")),
    "--output": ("output", ("onnx", "torchscript")),
    "--size": ("size", ("onnx", "torchscript")),
    "--no-verify": ("no_verify", ("onnx", "torchscript")),
    "--tolerance": ("tolerance", ("onnx", "torchscript")),
    "--opset": ("opset", ("onnx",)),
    "--exporter": ("exporter", ("onnx",)),
}


def check_format_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse an option given with a ``--format`` that does not read it."""
    for flag, (dest, formats) in FORMAT_OPTIONS.items():
        if args.format not in formats and getattr(args, dest) != parser.get_default(dest):
            raise ConfigError(
                f"{flag} does not apply to --format {args.format} (only to "
                f"{' / '.join(formats)}): drop it"
            )
    if args.refiner and args.output != parser.get_default("output"):
        raise ConfigError(
            f"--output {args.output} applies to a --checkpoint export (a refiner's export "
            "returns its embedding): drop it"
        )


def check_suffix(args: argparse.Namespace) -> None:
    """Refuse an ``--out`` whose suffix says another format: dualseg's readers take a ``.onnx``
    file for ONNX by its name, so a TorchScript file named ``.onnx``, or an ONNX file named
    ``.pt``, would be misread later with a confusing message."""
    out = Path(args.out)
    if args.format == "pretrained" or out.name in ("", ".", "..") or out.is_dir():
        return  # a folder: check_writable refuses it with its own line
    is_onnx = out.suffix.lower() == ".onnx"
    if args.format == "onnx" and not is_onnx:
        raise ConfigError(
            f"--out {out}: --format onnx writes an ONNX file, which is read by its .onnx "
            f"suffix; name it {_renamed(out, '.onnx')} (or pass --format torchscript)"
        )
    if args.format == "torchscript" and is_onnx:
        raise ConfigError(
            f"--out {out}: --format torchscript writes a TorchScript file, which a .onnx name "
            f"would pass off as ONNX; name it {_renamed(out, '.pt')} (or pass --format onnx)"
        )


def _renamed(out: Path, suffix: str) -> Path:
    """``out`` with a model file's suffix replaced (model.pt -> model.onnx), or ``suffix``
    appended to any other name (model.v2 -> model.v2.onnx)."""
    if out.suffix.lower() in (".pt", ".pth", ".onnx"):
        return out.with_suffix(suffix)
    return out.with_name(out.name + suffix)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_format_options(args, parser)
    check_outputs(args)
    check_suffix(args)
    if args.format == "pretrained":
        return _export_pretrained(args)
    from dualseg.export.runtime import import_extra
    from dualseg.io import check_writable

    if args.format == "onnx":  # missing extras: one line now, not after the export
        import_extra("onnx")
        if not args.no_verify:
            import_extra("onnxruntime")

    out = check_writable(args.out, kind="file", what="--out")
    size = tuple(args.size) if args.size else ((64, 64) if args.dynamic else (512, 512))
    if not args.tolerance >= 0:
        raise ConfigError(f"--tolerance must be >= 0, got {args.tolerance}")
    if min(size) < 8 or max(size) > MAX_SIDE:
        # past a few thousand pixels a side, tracing one image takes more memory than a
        # machine has (100000x100000: a 120 GB input), and a traceback instead of this line
        raise ConfigError(
            f"--size must be between 8x8 and {MAX_SIDE}x{MAX_SIDE}, got {size[0]}x{size[1]}"
        )
    options = dict(
        format=args.format,
        dynamic=args.dynamic,
        example_size=size,
        opset=args.opset,
        exporter=args.exporter,
    )
    with _written_aside(out) as aside:
        _export_and_verify(args, aside, size, options, shown=out)
    return 0


def _export_and_verify(
    args: argparse.Namespace,
    out: Path,
    size: tuple[int, int],
    options: dict[str, Any],
    *,
    shown: Path,
) -> None:
    """Export to ``out`` and verify it there; messages name ``shown``, where it will be."""
    from dualseg.export.export import export_checkpoint, export_refiner, verify_export

    if args.checkpoint:
        path = export_checkpoint(args.checkpoint, out, output=args.output, **options)
        print(f"exported {args.checkpoint} -> {shown} ({args.format}, {args.output}, "
              f"{'dynamic' if args.dynamic else f'static {size[0]}x{size[1]}'})")  # fmt: skip
    else:
        path, sidecar = export_refiner(args.refiner, out, **options)
        print(f"exported {args.refiner} -> {shown} + {shown.parent / sidecar.name}")
    if not args.no_verify:
        diff = verify_export(path, checkpoint=args.checkpoint, refiner=args.refiner, size=size)
        print(f"max |exported - pytorch| on a {size[0]}x{size[1]} input: {diff:.2e}")
        if not diff <= args.tolerance:  # NaN fails too: the new files go, earlier ones stay
            raise DualsegError(
                f"the export differs from PyTorch by {diff:.2e}, above --tolerance "
                f"{args.tolerance:g}, so it was removed (any earlier export at --out is kept); "
                "try another --opset or --exporter, or pass a larger --tolerance if that is "
                "expected"
            )
    if not args.dynamic:  # the one size where it matches: everything else is resized
        print(
            f"note: a static export runs every image at {size[0]}x{size[1]} (resized there and "
            "back), so at other sizes its labels differ from the checkpoint's; --dynamic runs "
            "each image at its own size"
        )


def _export_pretrained(args: argparse.Namespace) -> int:
    """``--format pretrained``: a folder ``dualseg.load_model`` / ``BoundaryRefiner.load`` read."""
    if args.checkpoint:
        from dualseg.engine.pretrained import save_pretrained_from_checkpoint

        out = save_pretrained_from_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite)
        print(f"exported {args.checkpoint} -> {out}/ (config.json + model.safetensors)")
        print(f"load it with dualseg.load_model({str(out)!r}) or --checkpoint {out}")
    else:
        from dualseg.refine import BoundaryRefiner

        refiner = BoundaryRefiner.load(args.refiner)
        out = refiner.save_pretrained(args.out, overwrite=args.overwrite)
        print(f"exported {args.refiner} -> {out}/ (refiner.json + refiner.safetensors)")
    return 0
