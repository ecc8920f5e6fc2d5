"""``dualseg export``: a checkpoint or a refiner to ONNX / TorchScript (checked against PyTorch
before it is written), or to a pretrained folder."""

from __future__ import annotations

import argparse
from pathlib import Path

from dualseg.commands.common import command_parser
from dualseg.engine.pretrained import save_pretrained_from_checkpoint
from dualseg.errors import ConfigError
from dualseg.export import export as library
from dualseg.export.outputs import check_outputs
from dualseg.refine import BoundaryRefiner

# options a format does not read: given to it, they would be dropped silently
ONNX_ONLY = ("--opset", "--exporter")
TRACED = ("--dynamic", "--output", "--size", "--no-verify", "--tolerance")
UNREAD = {"torchscript": ONNX_ONLY, "pretrained": TRACED + ONNX_ONLY}


def build_parser() -> argparse.ArgumentParser:
    p = command_parser(
        "export",
        "Export a trained network to ONNX or TorchScript, with class names, palette "
        "and normalization in the file's metadata, or as a pretrained folder (safetensors).",
        "dualseg export -c runs/camvid/best.pt --format onnx --out model.onnx --dynamic",
        "dualseg export -c runs/camvid/best.pt --format pretrained --out camvid-model/",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", "-c", help="checkpoint, pretrained folder or hf://org/name")
    src.add_argument("--refiner", help="a method-B refiner file: its embedding model, plus "
                     "<out stem>.json with prototypes and configuration")  # fmt: skip
    add = p.add_argument
    add("--format", choices=("onnx", "torchscript", "pretrained"), default="onnx",
        help="onnx, torchscript, or pretrained: a folder of config.json + model.safetensors "
        "(refiner.json + refiner.safetensors) that dualseg.load_model reads (onnx)")  # fmt: skip
    add("--out", "-o", required=True, help="output file (.onnx / .pt) or folder")
    add("--overwrite", action="store_true", help="replace an existing --out (and its .json, "
        "or the folder's files); never the checkpoint or refiner exported")  # fmt: skip
    add("--dynamic", action="store_true", help="dynamic batch, height and width (else batch 1)")
    add("--output", choices=("logits", "probs"), default="logits",
        help="what the exported network returns, --checkpoint only (logits)")  # fmt: skip
    add("--size", type=int, nargs=2, metavar=("H", "W"), help="input size of a static export "
        "(512 512), tracing size of a dynamic one (64 64)")  # fmt: skip
    add("--opset", type=int, help="ONNX opset (17 with legacy, 18 with dynamo)")
    add("--exporter", choices=("legacy", "dynamo"), default="legacy",
        help="torch.onnx exporter; dynamo: static exports only (legacy)")  # fmt: skip
    add("--no-verify", action="store_true", help="skip the PyTorch comparison")
    add("--tolerance", type=float, default=1e-3,
        help="largest |exported - pytorch| accepted, else nothing is written (1e-3)")  # fmt: skip
    return p


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Path]:
    """Refuse an option its format does not read, then the outputs; the files to write."""
    for flag in UNREAD.get(args.format, ()):
        dest = flag[2:].replace("-", "_")
        if getattr(args, dest) != parser.get_default(dest):
            raise ConfigError(f"{flag} does not apply to --format {args.format}: drop it")
    if args.refiner and args.output != "logits":
        raise ConfigError(f"--output {args.output} applies to a --checkpoint export: drop it")
    source, refiner = args.checkpoint or args.refiner, bool(args.refiner)
    return check_outputs(
        Path(args.out), source=source, refiner=refiner, format=args.format, overwrite=args.overwrite
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    targets = check_args(args, parser)
    if args.format == "pretrained":
        return _export_pretrained(args)
    size = tuple(args.size) if args.size else ((64, 64) if args.dynamic else (512, 512))
    tolerance = None if args.no_verify else args.tolerance
    options = dict(format=args.format, dynamic=args.dynamic, example_size=size, opset=args.opset,
                   exporter=args.exporter, tolerance=tolerance)  # fmt: skip
    if args.checkpoint:
        diff = library.export_checkpoint(args.checkpoint, args.out, output=args.output, **options)
    else:
        diff = library.export_refiner(args.refiner, args.out, **options)
    shape = "dynamic" if args.dynamic else f"static {size[0]}x{size[1]}"
    what = args.output if args.checkpoint else "embedding"
    shown = " + ".join(map(str, targets))
    print(f"exported {args.checkpoint or args.refiner} -> {shown} ({args.format}, {what}, {shape})")
    if diff is not None:
        print(f"max |exported - pytorch| on a {size[0]}x{size[1]} input: {diff:.2e}")
    if not args.dynamic:  # the one size where it matches: everything else is resized
        print(f"note: a static export runs every image at {size[0]}x{size[1]} (resized there "
              "and back); --dynamic runs each image at its own size")  # fmt: skip
    return 0


def _export_pretrained(args: argparse.Namespace) -> int:
    """``--format pretrained``: a folder ``dualseg.load_model`` / ``BoundaryRefiner.load`` read."""
    if args.checkpoint:
        out = save_pretrained_from_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite)
        print(f"exported {args.checkpoint} -> {out}/ (config.json + model.safetensors)")
        print(f"load it with dualseg.load_model({str(out)!r}) or --checkpoint {out}")
    else:
        out = BoundaryRefiner.load(args.refiner).save_pretrained(args.out, overwrite=args.overwrite)
        print(f"exported {args.refiner} -> {out}/ (refiner.json + refiner.safetensors)")
    return 0
