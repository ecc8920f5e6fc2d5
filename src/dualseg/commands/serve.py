"""``dualseg serve``: the local web page and JSON API (:mod:`dualseg.serve.app`), bound to
127.0.0.1 unless --host says otherwise (the page has no login)."""

from __future__ import annotations

import argparse
import functools
import ipaddress
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dualseg.commands.common import (
    add_inference_arguments,
    add_runtime_args,
    apply_runtime,
    command_parser,
    inference_options,
    int_in,
    load_segmenter,
    nonnegative_int,
    number_in,
    positive_int,
)
from dualseg.errors import DualsegError
from dualseg.export.runtime import load_refiner
from dualseg.refine.base import pairing_notes
from dualseg.serve import defaults as d
from dualseg.serve.server import check_port, request_log_on_stderr, run_server

SERVE_MODULES = ("fastapi", "uvicorn", "python_multipart", "starlette", "pydantic")
MIN_MEGAPIXELS = 0.001  # about 32x32 pixels: below, every image is refused or one class


def at_least(low: float, *, zero: str = "") -> Callable[[str], float]:
    """argparse ``type=``: a finite number >= ``low`` (or 0, meaning ``zero``)."""
    rule = f"0 ({zero}) or >= {low:g}" if zero else f">= {low:g}"
    return lambda text: number_in(text, lambda v: v >= low or (bool(zero) and v == 0), rule)


def build_parser() -> argparse.ArgumentParser:
    p = command_parser(
        "serve",
        "Serve a local web page (drop an image, see its segmentation) and a JSON "
        "API (POST /api/segment; schema at /docs and /openapi.json).",
        "dualseg serve -c runs/camvid/best.pt --refiner runs/camvid/refiner.pt",
        "dualseg serve --onnx model.onnx --port 8080",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", "-c", help="checkpoint, pretrained folder or hf://org/name")
    src.add_argument("--onnx", help="an exported model (dualseg export): ONNX or TorchScript")
    p.add_argument("--refiner", help="method B: a refiner file, or an exported one (its .json)")
    add = p.add_argument
    add("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    add("--port", type=int_in(1, 65535), default=8000, help="port (8000)")
    add("--max-megapixels", type=at_least(MIN_MEGAPIXELS), default=d.DEFAULT_MAX_MEGAPIXELS,
        help="refuse larger images (%(default)g)")  # fmt: skip
    add("--max-upload-mb", type=at_least(0.01), default=d.DEFAULT_MAX_UPLOAD_MB,
        help="refuse larger uploads (%(default)g)")  # fmt: skip
    add("--work-megapixels", type=at_least(MIN_MEGAPIXELS, zero="full size"),
        default=d.DEFAULT_WORK_MEGAPIXELS,
        help="infer larger images downscaled to this size, labels brought back to the image's; "
        "0: always at full size (%(default)g)")  # fmt: skip
    add("--workers", type=positive_int, default=d.DEFAULT_WORKERS,
        help="images segmented at the same time, on threads (%(default)d)")  # fmt: skip
    add("--queue-size", type=nonnegative_int, default=d.DEFAULT_QUEUE_SIZE,
        help="requests that may wait for a worker; more get 503 (%(default)d)")  # fmt: skip
    add("--save-uploads", metavar="DIR", help="keep every uploaded file in DIR (off)")
    add_runtime_args(p, device="cpu")
    add_inference_arguments(p)
    return p


def _load(args: argparse.Namespace, options: Any) -> tuple[Any, Any, str]:
    """``(segmenter, refiner or None, model name)`` for the page."""
    device = apply_runtime(args)
    segmenter = load_segmenter(args, device, "serve")
    if args.onnx:
        name = f"{Path(args.onnx).name} ({segmenter.info.get('arch') or 'onnx'})"
    else:
        name = f"{Path(args.checkpoint).name} ({type(segmenter.model).__name__})"
        if options.augmented:  # the page gets the averaged probs
            segmenter.predict_proba = functools.partial(segmenter.predict_proba, **asdict(options))
    refiner = load_refiner(args.refiner, device=device) if args.refiner else None
    return segmenter, refiner, name  # create_app checks the refiner's classes


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    options = inference_options(args)
    try:
        import uvicorn

        from dualseg.serve.app import create_app, prepare_upload_folder
    except ImportError as err:
        if (err.name or "").split(".")[0] not in SERVE_MODULES:
            raise
        raise DualsegError(
            f"the optional package {err.name!r} is not installed; dualseg serve needs the "
            f"'serve' extra: {d.EXTRA_HINT}"
        ) from err
    if args.save_uploads is not None:  # before loading anything: fail in a second
        prepare_upload_folder(args.save_uploads)
    check_port(args.host, args.port)
    segmenter, refiner, name = _load(args, options)
    app = create_app(
        segmenter, refiner=refiner, max_megapixels=args.max_megapixels,
        max_upload_bytes=int(args.max_upload_mb * 2**20), work_megapixels=args.work_megapixels,
        workers=args.workers, queue_size=args.queue_size, save_uploads=args.save_uploads,
        model_name=name,
    )  # fmt: skip
    model = getattr(segmenter, "model", None)
    for line in pairing_notes(refiner, model, args.refiner) if refiner else ():  # pair checked
        print(f"dualseg serve: {line}", file=sys.stderr)
    try:
        loopback = args.host == "localhost" or ipaddress.ip_address(args.host).is_loopback
    except ValueError:  # a host name
        loopback = False
    if not loopback:
        print(f"warning: binding {args.host}: the page has no login, anyone who can reach "
              "this address can use it", file=sys.stderr)  # fmt: skip
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"dualseg serve: http://{shown}:{args.port}/  (API docs: /docs; Ctrl+C stops)")
    with request_log_on_stderr():
        run_server(uvicorn, app, host=args.host, port=args.port, log_level="warning")
    return 0
