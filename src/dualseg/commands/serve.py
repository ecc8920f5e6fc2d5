"""``dualseg serve``: the local web page and JSON API (see :mod:`dualseg.serve.app`).

    dualseg serve --checkpoint runs/demo/last.pt [--refiner runs/demo/refiner.pt]
    dualseg serve --onnx model.onnx [--refiner refiner.onnx]      # onnxruntime, exported files

Binds to 127.0.0.1 (this machine only) unless --host says otherwise; the page has no login.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import ipaddress
import logging
import math
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dualseg.commands.common import (
    add_inference_arguments,
    add_runtime_args,
    apply_runtime,
    cuda_amp,
    inference_options,
    onnx_runtime,
    static_export_note,
)
from dualseg.console import ArgumentParser, argparse_kwargs
from dualseg.errors import ConfigError, DualsegError
from dualseg.serve.defaults import (
    DEFAULT_MAX_MEGAPIXELS,
    DEFAULT_MAX_UPLOAD_MB,
    DEFAULT_QUEUE_SIZE,
    DEFAULT_WORK_MEGAPIXELS,
    DEFAULT_WORKERS,
    EXTRA_HINT,
)

# The modules of the 'serve' extra (pyproject.toml), and those they bring.
SERVE_MODULES = ("fastapi", "uvicorn", "python_multipart", "starlette", "pydantic")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
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
    src.add_argument(
        "--onnx", help="an exported model (dualseg export): ONNX (onnxruntime) or TorchScript"
    )
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
        "--work-megapixels",
        type=float,
        default=DEFAULT_WORK_MEGAPIXELS,
        help="infer larger images downscaled to this many megapixels, then bring the result "
        f"back to the image's size; 0: always at full size ({DEFAULT_WORK_MEGAPIXELS:g})",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=DEFAULT_WORKERS,
        help=f"images segmented at the same time, on threads ({DEFAULT_WORKERS})",
    )
    p.add_argument(
        "--queue-size",
        type=int,
        default=DEFAULT_QUEUE_SIZE,
        help="requests that may wait for a worker; more get 503 with Retry-After "
        f"({DEFAULT_QUEUE_SIZE})",
    )
    p.add_argument(
        "--save-uploads",
        metavar="DIR",
        help="keep every uploaded file in DIR (default: uploads stay in memory only)",
    )
    add_runtime_args(p, device="cpu")
    add_inference_arguments(p)
    return p


class InferenceSegmenter:
    """A ``Segmenter`` whose ``predict_proba`` always runs with the command's sliding-window /
    test-time-augmentation options (the page and the API then serve those probabilities, and
    the refiner gets them). Everything else is the wrapped segmenter's."""

    def __init__(self, segmenter: Any, options: Any) -> None:
        self._segmenter, self._options = segmenter, options

    def __getattr__(self, name: str) -> Any:
        return getattr(self._segmenter, name)

    def predict_proba(self, image: Any) -> Any:
        o = self._options
        return self._segmenter.predict_proba(
            image,
            mode=o.mode,
            window=o.window,
            stride=o.stride,
            tta_scales=o.tta_scales,
            tta_flip=o.tta_flip,
            tile_batch=o.tile_batch,
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_port(host: str, port: int) -> None:
    """Bind ``host:port`` once, as uvicorn will, so that a taken port is one line, not a
    traceback after the banner. Raises :class:`ConfigError`."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as err:
        raise ConfigError(f"--host {host}: cannot resolve it ({err.strerror or err})") from err
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            sock.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRNOTAVAIL:  # no program to stop: not this machine's
                raise ConfigError(
                    f"cannot listen on {host}: it is no address of this machine; use "
                    "127.0.0.1 (this machine only), 0.0.0.0 (every interface) or one of its "
                    "addresses (--host)"
                ) from err
            if err.errno == errno.EACCES:
                raise ConfigError(
                    f"cannot listen on {host}:{port}: permission denied (ports below 1024 "
                    "need administrator rights); choose --port 1024 or above"
                ) from err
            raise ConfigError(
                f"cannot listen on {host}:{port} ({err.strerror or err}); stop the program "
                "using it or choose another --port"
            ) from err


def run_server(uvicorn: Any, app: Any, *, host: str, port: int, log_level: str) -> None:
    """Serve ``app`` until Ctrl-C / SIGTERM. On the signal, the requests still waiting for a
    worker are answered 503 at once (``app.state.workers.close``): uvicorn waits for every
    open request before it stops, which was the whole queue."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    stop = server.handle_exit

    def handle_exit(sig: int, frame: Any) -> None:
        with contextlib.suppress(RuntimeError):  # no loop running (yet): nothing waits
            asyncio.get_running_loop().call_soon_threadsafe(app.state.workers.close)
        stop(sig, frame)

    server.handle_exit = handle_exit
    server.run()


def _import_serve() -> tuple[Any, Any]:
    """``(uvicorn, create_app)``; a missing 'serve' extra is one line naming it."""
    try:
        import uvicorn

        from dualseg.serve.app import create_app
    except ImportError as err:
        if (err.name or "").split(".")[0] not in SERVE_MODULES:
            raise
        raise DualsegError(
            f"the optional package {err.name!r} is not installed; dualseg serve needs the "
            f"'serve' extra: {EXTRA_HINT}"
        ) from err
    return uvicorn, create_app


@contextlib.contextmanager
def _request_log_on_stderr() -> Iterator[None]:
    """While serving: one line per request (``dualseg.serve`` logger: method, path, status,
    ms) on stderr; the logger is left as it was afterwards."""
    logger = logging.getLogger("dualseg.serve")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


MIN_MEGAPIXELS = 0.001  # about 32x32 pixels
MIN_UPLOAD_MB = 0.01  # 10 KiB


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    limits = (args.max_megapixels, args.max_upload_mb, args.work_megapixels)
    if not all(math.isfinite(v) for v in limits):
        raise ConfigError(
            "--max-megapixels, --max-upload-mb and --work-megapixels must be finite numbers, "
            f"got {limits[0]}, {limits[1]}, {limits[2]}"
        )
    # below these every upload is refused, or segmented at a few pixels as one class
    if args.max_megapixels < MIN_MEGAPIXELS or args.max_upload_mb < MIN_UPLOAD_MB:
        raise ConfigError(
            f"--max-megapixels must be >= {MIN_MEGAPIXELS:g} and --max-upload-mb >= "
            f"{MIN_UPLOAD_MB:g}, got {args.max_megapixels:g} and {args.max_upload_mb:g}"
        )
    if args.work_megapixels != 0 and not args.work_megapixels >= MIN_MEGAPIXELS:
        raise ConfigError(
            f"--work-megapixels must be 0 (full size) or >= {MIN_MEGAPIXELS:g} (about 32x32), "
            f"got {args.work_megapixels:g}"
        )
    if args.workers < 1 or args.queue_size < 0:
        raise ConfigError(
            f"--workers must be >= 1 and --queue-size >= 0, got {args.workers}, {args.queue_size}"
        )
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}")
    opts = inference_options(args)
    augmented = opts.mode != "whole" or opts.uses_tta
    if augmented and args.onnx:
        raise ConfigError(
            "--mode slide and --tta-* need --checkpoint: an --onnx model runs whole images only"
        )
    uvicorn, create_app = _import_serve()
    from dualseg.serve.app import prepare_upload_folder

    if args.save_uploads is not None:  # before loading anything: fail in a second
        prepare_upload_folder(args.save_uploads)
    check_port(args.host, args.port)

    device = apply_runtime(args)
    if args.onnx:
        from dualseg.export.runtime import ExportedSegmenter

        segmenter: Any = ExportedSegmenter(args.onnx, **onnx_runtime(args, device))
        static_export_note(args.onnx, segmenter, "serve")
        name = f"{Path(args.onnx).name} ({segmenter.info.get('arch') or 'onnx'})"
    else:
        from dualseg.engine.predict import load_model

        segmenter = load_model(args.checkpoint, device=device, amp=cuda_amp(args, device))
        name = f"{Path(args.checkpoint).name} ({type(segmenter.model).__name__})"
        if augmented:
            segmenter = InferenceSegmenter(segmenter, opts)
    refiner = None
    if args.refiner:
        from dualseg.commands.refine import load_refiner

        refiner = load_refiner(args.refiner, device=device)  # create_app checks its classes
    app = create_app(
        segmenter,
        refiner=refiner,
        max_megapixels=args.max_megapixels,
        max_upload_bytes=int(args.max_upload_mb * 2**20),
        work_megapixels=args.work_megapixels,
        workers=args.workers,
        queue_size=args.queue_size,
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
    with _request_log_on_stderr():
        run_server(uvicorn, app, host=args.host, port=args.port, log_level="warning")
    return 0
