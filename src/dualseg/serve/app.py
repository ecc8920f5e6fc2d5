"""The local web page and JSON API behind ``dualseg serve`` (docs/export_serve.md).

``GET /`` (one static page), ``GET /api/info``, ``POST /api/segment`` (multipart field ``file``
or a raw ``image/*`` body -> base64 PNGs, class shares, timings). Work runs on ``workers``
threads; ``segmenter`` (``.meta``, ``.predict_proba``) and ``refiner`` are called from several
threads at once.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import cv2
import numpy as np

from dualseg._version import __version__
from dualseg.errors import ConfigError, DataError
from dualseg.imaging import ImageTooLargeError, decode_image, pillow_max_pixels, resize_bilinear
from dualseg.io import encode_image
from dualseg.refine.formats import check_contract
from dualseg.serve import defaults as d
from dualseg.viz import colorize, overlay

try:
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import FileResponse
    from fastapi.staticfiles import StaticFiles
    from pydantic import BaseModel

    from dualseg.serve.uploads import prepare_upload_folder, read_upload, save_upload
except ImportError as _err:  # the optional extra is missing: say which one
    raise ModuleNotFoundError(
        f"dualseg.serve needs the optional package {_err.name!r}: {d.EXTRA_HINT}", name=_err.name
    ) from _err

STATIC_DIR = Path(__file__).resolve().parent / "static"
CHANGED_COLOR = (255, 0, 255)  # magenta: refined pixels that differ from the base prediction
SHUTTING_DOWN = "the server is shutting down; retry once it is back"
DISCONNECT_POLL_S = 0.25  # how often a waiting job asks whether its client is still there
log = logging.getLogger("dualseg.serve")
T = TypeVar("T")


class RefinedResult(BaseModel):
    label_png: str
    color_png: str | None = None
    changed_png: str | None = None  # refined colours dimmed, changed pixels in magenta
    changed_pixels: int


class SegmentResponse(BaseModel):
    width: int
    height: int
    working_width: int  # the size the model ran at
    working_height: int
    num_classes: int
    class_names: list[str]
    palette: list[list[int]]
    label_png: str  # base64 PNG (8-bit gray), pixel value = class index, 255 = ignore
    color_png: str | None = None
    overlay_png: str | None = None
    class_pixels: list[int]
    refined: RefinedResult | None = None
    timings_ms: dict[str, float]


_BINARY = {"type": "string", "format": "binary"}
_UPLOAD_BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {"type": "object", "properties": {"file": _BINARY}, "required": ["file"]}
        },
        "image/*": {"schema": _BINARY},
    },
}
_ERRORS = {
    400: {"description": "not a decodable image, transparent pixels, or no 'file' field"},
    413: {"description": "upload over max_upload_bytes, or image over max_megapixels"},
    415: {"description": "content type missing, or neither multipart/form-data nor image/*"},
    503: {"description": "workers busy and queue full; retry after Retry-After seconds"},
}


def _ms(t: float) -> float:
    return round((time.perf_counter() - t) * 1000.0, 2)


def png_base64(array: np.ndarray) -> str:
    """uint8 ``HxW`` or ``HxWx3`` -> base64 PNG (fast compression: a local page)."""
    return base64.b64encode(encode_image(array)).decode("ascii")


def working_size(height: int, width: int, max_pixels: float) -> tuple[int, int]:
    """``(h, w)`` an image is inferred at: its own, or scaled down (aspect kept) to at most
    ``max_pixels`` pixels (``<= 0``: its own)."""
    if max_pixels <= 0 or height * width <= max_pixels:
        return height, width
    scale = math.sqrt(max_pixels / (height * width))
    h, w = max(1, math.floor(height * scale)), max(1, math.floor(width * scale))
    if h * w > max_pixels:  # a side clamped up to 1 px (a very thin image): the other gives way
        return (1, math.floor(max_pixels)) if h == 1 else (math.floor(max_pixels), 1)
    return h, w


def upsample_probs(probs: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """``[C,h,w]`` -> ``[C,H,W]`` bilinear (half-pixel centres, as the engine's S4 tail)."""
    return resize_bilinear(probs.transpose(1, 2, 0), hw).transpose(2, 0, 1)


class _Workers:
    """A fixed pool of inference threads with a bounded number of waiting jobs: beyond
    ``workers + queue_size`` jobs, 503 at once with a ``Retry-After`` from recent durations."""

    def __init__(self, workers: int, queue_size: int) -> None:
        self.workers, self.queue_size = workers, queue_size
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="dualseg-serve")
        self._lock = threading.Lock()  # TestClient may drive the app from several loops
        self.pending, self._mean_s = 0, 1.0  # jobs running or waiting; mean duration (s)
        self._waiting: set[Any] = set()
        self._closing = False

    async def run(
        self, fn: Callable[..., T], *args: Any, gone: Callable[[], Awaitable[bool]] | None = None
    ) -> T:
        """``fn(*args)`` on a worker. ``gone``: whether the client has disconnected, asked while
        the job waits; a job whose client is gone never runs (499)."""
        with self._lock:
            if self._closing:
                raise HTTPException(status_code=503, detail=SHUTTING_DOWN)
            if self.pending >= self.workers + self.queue_size:
                wait = max(1, math.ceil(self._mean_s * self.pending / self.workers))
                raise HTTPException(
                    status_code=503,
                    detail=f"the server is busy: {self.pending} requests (--workers "
                    f"{self.workers}, --queue-size {self.queue_size}); retry in {wait} s",
                    headers={"Retry-After": str(wait)},
                )
            self.pending += 1
        t = time.perf_counter()
        job = self._executor.submit(fn, *args)
        self._waiting.add(job)
        try:
            done = asyncio.wrap_future(job)
            while gone is not None and not job.running() and not job.done():
                await asyncio.wait({done}, timeout=DISCONNECT_POLL_S)
                if not job.running() and not job.done() and await gone() and job.cancel():
                    raise HTTPException(status_code=499, detail="the client disconnected")
            try:
                return await done
            except asyncio.CancelledError:
                if job.cancelled():  # by close(): answered, not an ASGI error
                    raise HTTPException(status_code=503, detail=SHUTTING_DOWN) from None
                raise
        finally:
            self._waiting.discard(job)
            with self._lock:
                self.pending -= 1
                if not job.cancelled():
                    self._mean_s = 0.8 * self._mean_s + 0.2 * (time.perf_counter() - t)

    def close(self) -> None:
        """Ctrl-C: refuse new jobs and cancel the waiting ones (the running ones finish)."""
        self._closing = True
        for job in list(self._waiting):
            job.cancel()

    def shutdown(self) -> None:
        self.close()
        self._executor.shutdown(wait=False, cancel_futures=True)


class _RequestLog:
    """One log line per request, as plain ASGI middleware (Starlette's would hide the
    client's disconnect)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t, status = time.perf_counter(), 500  # an exception escaping the app is a 500

        async def send_and_note(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            log.info("%s %s %d %.1f ms", scope["method"], scope["path"], status, _ms(t))


class _Segmentation:
    """Decode, segment (at the working size), refine and encode one upload."""

    def __init__(
        self,
        segmenter: Any,
        refiner: Any,
        max_megapixels: float,
        work_megapixels: float,
        save_dir: Path | None,
    ) -> None:
        self.segmenter, self.refiner, self.save_dir = segmenter, refiner, save_dir
        self.max_pixels, self.work_pixels = max_megapixels * 1e6, work_megapixels * 1e6
        self.class_names = [str(c) for c in segmenter.meta.class_names]
        self.palette = [[int(v) for v in rgb] for rgb in segmenter.meta.palette]
        self.bit_depth = getattr(segmenter, "bit_depth", None)  # 16-bit uploads read as trained

    def labels(self, image: np.ndarray, work: tuple[int, int], timings: dict[str, float]) -> Any:
        """``(labels HxW, refined HxW or None)`` at the image's size, inferred at ``work``;
        pixels the refiner changed take its label, the others the base."""
        h, w = image.shape[:2]
        area = cv2.INTER_AREA  # a downscale: each small pixel the mean of the ones it covers
        small = image if work == (h, w) else cv2.resize(image, work[::-1], interpolation=area)
        t = time.perf_counter()
        probs = np.asarray(self.segmenter.predict_proba(small), dtype=np.float32)
        label = upsample_probs(probs, (h, w)).argmax(0).astype(np.uint8)
        timings["inference"] = _ms(t)
        if self.refiner is None:
            return label, None
        t = time.perf_counter()
        refined, changed = self.refiner.refine(small, probs, return_changed=True)
        refined = np.asarray(refined, np.uint8)
        if work != (h, w):
            up = lambda a: cv2.resize(a, (w, h), interpolation=cv2.INTER_NEAREST)  # noqa: E731
            refined = np.where(up(np.asarray(changed, np.uint8)) > 0, up(refined), label)
        timings["refine"] = _ms(t)
        return label, refined

    def __call__(self, data: bytes, name: str, with_images: bool) -> dict[str, Any]:
        if self.save_dir is not None:
            try:
                save_upload(self.save_dir, data, name)
            except OSError as err:  # a full disk: the client still gets its answer
                log.warning("--save-uploads %s: upload not saved (%s)", self.save_dir, err.strerror)
        t = time.perf_counter()
        image = decode_image(
            data, source=name or "the upload", max_pixels=self.max_pixels, bit_depth=self.bit_depth
        )
        timings = {"decode": _ms(t)}
        (h, w), n = image.shape[:2], len(self.class_names)
        work = working_size(h, w, self.work_pixels)
        label, refined = self.labels(image, work, timings)
        t = time.perf_counter()
        out: dict[str, Any] = {
            "width": w, "height": h, "working_width": work[1], "working_height": work[0],
            "label_png": png_base64(label),
            "class_pixels": np.bincount(label.ravel(), minlength=n)[:n].tolist(),
        }  # fmt: skip
        if with_images:
            out["color_png"] = png_base64(colorize(label, self.palette))
            out["overlay_png"] = png_base64(overlay(image, label, self.palette))
        if refined is not None:
            changed = refined != label
            out["refined"] = {
                "label_png": png_base64(refined),
                "changed_pixels": int(changed.sum()),
            }
            if with_images:
                color = colorize(refined, self.palette)
                dimmed = (color.astype(np.uint16) * 2 // 5).astype(np.uint8)
                dimmed[changed] = CHANGED_COLOR
                out["refined"].update(color_png=png_base64(color), changed_png=png_base64(dimmed))
        out["timings_ms"] = {**timings, "encode": _ms(t)}
        return out


def _check_model(segmenter: Any, refiner: Any, max_megapixels: float) -> None:
    limit = pillow_max_pixels()
    if limit and max_megapixels * 1e6 > limit:
        raise ConfigError(
            f"--max-megapixels {max_megapixels:g} is over Pillow's decompression-bomb limit; "
            f"choose at most {int(limit / 1e5) / 10:g}"
        )
    names = tuple(str(c) for c in segmenter.meta.class_names)
    if len(names) > 255:
        raise ConfigError(f"the model has {len(names)} classes; serve's label maps hold 255")
    if refiner is not None:  # a refiner of another class order would relabel silently
        refiner.check_classes(names, len(names), what="the model")
        check_contract(refiner, getattr(segmenter, "contract", None), refiner_name="--refiner",
                       model_name="the model")  # fmt: skip


def create_app(
    segmenter: Any,
    *,
    refiner: Any | None = None,
    max_megapixels: float = d.DEFAULT_MAX_MEGAPIXELS,
    max_upload_bytes: int = int(d.DEFAULT_MAX_UPLOAD_MB * 2**20),
    work_megapixels: float = d.DEFAULT_WORK_MEGAPIXELS,
    workers: int = d.DEFAULT_WORKERS,
    queue_size: int = d.DEFAULT_QUEUE_SIZE,
    save_uploads: str | Path | None = None,
    model_name: str = "",
) -> FastAPI:
    """The FastAPI app of ``dualseg serve``; ``save_uploads`` is created and checked here."""
    _check_model(segmenter, refiner, max_megapixels)
    save_dir = prepare_upload_folder(save_uploads) if save_uploads is not None else None
    segment_one = _Segmentation(segmenter, refiner, max_megapixels, work_megapixels, save_dir)
    names, palette = segment_one.class_names, segment_one.palette
    pool = _Workers(workers, queue_size)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        pool.shutdown()

    app = FastAPI(
        title="dualseg",
        version=__version__,
        description="Semantic segmentation of uploaded images, run locally; uploads are kept "
        "in memory only.",
        lifespan=lifespan,
    )
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.state.workers = pool  # dualseg serve closes it on Ctrl-C
    app.add_middleware(_RequestLog)

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    @app.get("/api/info")
    def info() -> dict[str, Any]:
        """The model's classes and the server's limits."""
        return dict(
            class_names=names, palette=palette, refiner=refiner is not None,
            max_megapixels=max_megapixels, max_upload_bytes=max_upload_bytes,
            work_megapixels=work_megapixels, workers=workers, queue_size=queue_size,
            busy=pool.pending, model=model_name,
        )  # fmt: skip

    @app.post(
        "/api/segment",
        response_model=SegmentResponse,
        openapi_extra={"requestBody": _UPLOAD_BODY},
        responses=_ERRORS,
    )
    async def segment(request: Request, images: bool = True) -> SegmentResponse:
        """Segment one image: multipart field ``file`` (``curl -F file=@street.png``) or the
        raw body with its ``image/*`` type; ``images=false``: the label map only."""
        t = time.perf_counter()
        data, name = await read_upload(request, max_upload_bytes)
        try:
            result = await pool.run(segment_one, data, name, images, gone=request.is_disconnected)
        except ImageTooLargeError as err:
            hint = "" if "Pillow's" in str(err) else ", or restart with a larger --max-megapixels"
            raise HTTPException(status_code=413, detail=f"{err}{hint}") from err
        except DataError as err:  # the image policy's one-line reason
            raise HTTPException(status_code=400, detail=str(err)) from err
        result["timings_ms"]["total"] = _ms(t)
        return SegmentResponse(num_classes=len(names), class_names=names, palette=palette, **result)

    return app
