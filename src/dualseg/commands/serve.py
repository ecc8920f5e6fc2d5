"""``dualseg serve``: the local web page and JSON API (see :mod:`dualseg.serve.app`).

    dualseg serve --checkpoint runs/demo/last.pt [--refiner runs/demo/refiner.pt]
    dualseg serve --onnx model.onnx [--refiner refiner.onnx]      # onnxruntime, exported files

Binds to 127.0.0.1 (this machine only) unless --host says otherwise; the page has no login.
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from pathlib import Path
from typing import Any

from dualseg.commands.common import add_runtime_args, apply_runtime
from dualseg.console import argparse_kwargs
from dualseg.errors import ConfigError
from dualseg.serve.app import DEFAULT_MAX_MEGAPIXELS, DEFAULT_MAX_UPLOAD_MB


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dualseg serve",
        description="Serve a local web page (drop an image, see its segmentation) and a JSON "
        "API (POST /api/segment; schema at /docs and /openapi.json).",
        **argparse_kwargs(
            "dualseg serve -c runs/camvid/best.pt --refiner runs/camvid/refiner.pt",
            "dualseg serve --onnx model.onnx --port 8080",
        ),
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--checkpoint",
        "-c",
        help="a dualseg checkpoint (.pt), a pretrained folder or hf://org/name",
    )
    src.add_argument("--onnx", help="an exported model (dualseg export --format onnx)")
    p.add_argument(
        "--refiner",
        help="method B: a refiner file (dualseg refine fit), or an exported one (.onnx with "
        "its .json beside it, or the .json)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (8000)")
    p.add_argument(
        "--max-megapixels",
        type=float,
        default=DEFAULT_MAX_MEGAPIXELS,
        help=f"refuse larger images ({DEFAULT_MAX_MEGAPIXELS:g})",
    )
    p.add_argument(
        "--max-upload-mb",
        type=float,
        default=DEFAULT_MAX_UPLOAD_MB,
        help=f"refuse larger uploads ({DEFAULT_MAX_UPLOAD_MB:g})",
    )
    p.add_argument(
        "--save-uploads",
        metavar="DIR",
        help="keep every uploaded file in DIR (default: uploads stay in memory only)",
    )
    add_runtime_args(p, device="cpu")
    return p


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_megapixels <= 0 or args.max_upload_mb <= 0:
        raise ConfigError("--max-megapixels and --max-upload-mb must be positive")
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    import uvicorn

    from dualseg.serve.app import create_app

    device = apply_runtime(args)
    if args.onnx:
        from dualseg.export.runtime import OnnxSegmenter

        segmenter: Any = OnnxSegmenter(args.onnx)
        name = f"{Path(args.onnx).name} ({segmenter.info.get('arch') or 'onnx'})"
    else:
        from dualseg.engine.predict import load_model

        segmenter = load_model(args.checkpoint, device=device, amp=args.amp)
        name = f"{Path(args.checkpoint).name} ({type(segmenter.model).__name__})"
    refiner = None
    if args.refiner:
        from dualseg.export.runtime import load_refiner

        refiner = load_refiner(args.refiner, device=device)
        refiner.check_classes(segmenter.class_names, segmenter.num_classes)
    app = create_app(
        segmenter,
        refiner=refiner,
        max_megapixels=args.max_megapixels,
        max_upload_bytes=int(args.max_upload_mb * 2**20),
        save_uploads=args.save_uploads,
        model_name=name,
    )
    if not _is_loopback(args.host):
        print(
            f"warning: binding {args.host}: the page has no login, anyone who can reach this "
            "address can use it",
            file=sys.stderr,
        )
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"dualseg serve: http://{shown}:{args.port}/  (API docs: /docs; Ctrl+C stops)")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
