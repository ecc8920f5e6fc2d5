"""The local web page and JSON API behind ``dualseg serve``.

``create_app(segmenter)`` returns a FastAPI app with

- ``GET /``                 one static HTML/JS page (``static/index.html``, no build step):
                            drop an image, see input, colour segmentation, overlay, refined
                            result with changed pixels, legend and timings;
- ``GET /api/info``         class names, palette, limits, whether a refiner is loaded;
- ``POST /api/segment``     an image (multipart field ``file``, or the raw image bytes with an
                            ``image/*`` content type) -> label map as base64 PNG + class names +
                            timings (see :class:`SegmentResponse`; schema at ``/openapi.json``).

Uploads are read into memory only, never onto disk (Starlette's own form parser spools files
over 1 MiB to a temporary file, so the body is parsed here with python-multipart configured to
keep files in memory) — unless ``save_uploads`` names a folder. The body is counted while it
streams in: an upload over ``max_upload_bytes`` is refused (413) before it is fully read, and
an image over ``max_megapixels`` is refused (413) from its header, before it is decoded.
Images are decoded by :func:`dualseg.imaging.decode_image`: the image policy that the CLI
and the Python API follow too (EXIF orientation applied, transparent images refused with 400).

Decoding, inference and encoding run off the event loop on ``workers`` threads; at most
``queue_size`` requests wait for one, further ones get 503 with a ``Retry-After`` header. An
image over ``work_megapixels`` is inferred downscaled to that many pixels and its result brought
back to the image's size (probabilities bilinearly; the response's ``working_width`` /
``working_height`` say so). Every request is logged as one line (method, path, status, ms) on
the ``dualseg.serve`` logger.

``segmenter`` is anything with ``.meta`` (``class_names``, ``palette``, ``ignore_index``) and
``.predict_proba(rgb uint8 HxWx3) -> float [C,H,W]``: the engine's ``Segmenter`` or the
onnxruntime ``OnnxSegmenter``; it and the refiner are called from several threads at once.
``refiner`` (optional) is a method-B ``BoundaryRefiner`` or an exported one
(``dualseg.export.runtime.load_exported_refiner``); see :func:`refine_one`.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import logging
import math
import re
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

import cv2
import numpy as np
from PIL import Image

from dualseg.errors import ConfigError, DataError
from dualseg.imaging import (
    ImageTooLargeError,
    decode_image,
    pillow_max_pixels,
    resize_bilinear,
)
from dualseg.io import atomic_write_bytes
from dualseg.serve.defaults import (
    DEFAULT_MAX_MEGAPIXELS,
    DEFAULT_MAX_UPLOAD_MB,
    DEFAULT_QUEUE_SIZE,
    DEFAULT_WORK_MEGAPIXELS,
    DEFAULT_WORKERS,
    EXTRA_HINT,
)
from dualseg.viz import colorize, overlay

try:
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.responses import FileResponse
    from fastapi.staticfiles import StaticFiles
    from pydantic import BaseModel, Field
    from python_multipart.multipart import FormParser, parse_options_header
except ImportError as _err:  # the optional extra is missing: say which one
    raise ModuleNotFoundError(
        f"dualseg.serve needs the optional package {_err.name!r}: {EXTRA_HINT}", name=_err.name
    ) from _err

STATIC_DIR = Path(__file__).resolve().parent / "static"
CHANGED_COLOR = (255, 0, 255)  # magenta: refined pixels that differ from the base prediction
# Accepted upload types: raster image/* types, and what browsers and curl send for a file of an
# unknown extension. The bytes are then opened by their content (dualseg.imaging.UPLOAD_FORMATS).
_GENERIC_TYPE = "application/octet-stream"
_VECTOR_TYPES = {"image/svg+xml"}  # image/* types that are drawings, not pictures
log = logging.getLogger("dualseg.serve")
T = TypeVar("T")


class Segments(Protocol):
    """What the app needs from a segmenter (engine ``Segmenter`` or ``OnnxSegmenter``)."""

    meta: Any

    def predict_proba(self, image: np.ndarray) -> np.ndarray: ...


# ----------------------------------------------------------------------------- API schema
class RefinedResult(BaseModel):
    label_png: str = Field(description="base64 PNG, one byte per pixel = refined class index")
    color_png: str | None = Field(None, description="base64 PNG, refined labels in palette colours")
    changed_png: str | None = Field(
        None, description="base64 PNG, refined colours dimmed, changed pixels in magenta"
    )
    changed_pixels: int = Field(description="pixels whose label the refiner changed")


class SegmentResponse(BaseModel):
    width: int
    height: int
    working_width: int = Field(description="width the model ran at (< width: downscaled)")
    working_height: int = Field(description="height the model ran at (< height: downscaled)")
    num_classes: int
    class_names: list[str]
    palette: list[list[int]] = Field(description="one [r, g, b] per class")
    label_png: str = Field(
        description="base64 PNG (8-bit gray), pixel value = class index, 255 = ignore"
    )
    color_png: str | None = Field(None, description="base64 PNG, labels in palette colours")
    overlay_png: str | None = Field(None, description="base64 PNG, colours blended over the image")
    class_pixels: list[int] = Field(description="pixel count per class (index = class)")
    refined: RefinedResult | None = Field(None, description="present when a refiner is loaded")
    timings_ms: dict[str, float] = Field(
        description="decode, inference, refine (with a refiner), encode, total"
    )


class InfoResponse(BaseModel):
    class_names: list[str]
    palette: list[list[int]]
    refiner: bool
    max_megapixels: float
    max_upload_bytes: int
    work_megapixels: float = Field(description="larger images are inferred downscaled (0: never)")
    workers: int
    queue_size: int
    busy: int = Field(description="requests being segmented or waiting for a worker now")
    model: str


_UPLOAD_BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "properties": {"file": {"type": "string", "format": "binary"}},
                "required": ["file"],
            }
        },
        "image/*": {"schema": {"type": "string", "format": "binary"}},
    },
}
_ERRORS = {
    400: {
        "description": "the upload is not a decodable image, has transparent pixels, or the "
        "form lacks 'file'"
    },
    413: {"description": "upload larger than max_upload_bytes, or image over max_megapixels"},
    415: {"description": "content type missing, or neither multipart/form-data nor image/*"},
    503: {"description": "all workers busy and the queue full; retry after Retry-After seconds"},
}


# ----------------------------------------------------------------------------- helpers
def png_base64(array: np.ndarray) -> str:
    """uint8 ``HxW`` or ``HxWx3`` -> base64 PNG (fast compression: this is a local page)."""
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG", compress_level=1)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def highlight_changes(color: np.ndarray, changed: np.ndarray) -> np.ndarray:
    """Refined colours at 40 % brightness, changed pixels in :data:`CHANGED_COLOR`."""
    out = (color.astype(np.uint16) * 2 // 5).astype(np.uint8)
    out[changed] = CHANGED_COLOR
    return out


def refine_one(refiner: Any, image: np.ndarray, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(refined labels HxW, changed bool HxW)`` of one image, through the single-image form
    of ``refine`` that ``BoundaryRefiner`` and the exported refiner share: uint8 ``HxWx3``
    image and the base model's ``[C,H,W]`` probabilities."""
    labels, changed = refiner.refine(image, probs, return_changed=True)
    return np.asarray(labels), np.asarray(changed, dtype=bool)


def _too_large(what: str, limit: str, fix: str) -> HTTPException:
    return HTTPException(status_code=413, detail=f"{what} is over the limit of {limit}; {fix}")


def _check_image_type(ctype: str, what: str) -> None:
    """415 unless ``ctype`` is a raster ``image/*`` type or ``application/octet-stream``."""
    if ctype == _GENERIC_TYPE or (ctype.startswith("image/") and ctype not in _VECTOR_TYPES):
        return
    if not ctype:
        why = "has no content type"
    elif ctype in _VECTOR_TYPES:
        why = f"is {ctype!r}, a vector drawing (export it as PNG first)"
    else:
        why = f"has content type {ctype!r}, not an image"
    raise HTTPException(
        status_code=415,
        detail=f"{what} {why}; send multipart/form-data with the image in the field 'file', or "
        "the raw image as the body with its image/* content type (e.g. image/png)",
    )


class _UploadReader:
    """Streams a request body into memory, counting bytes; returns the image bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes

    async def read(self, request: Request) -> tuple[bytes, str]:
        """``(image bytes, file name)`` from a multipart form or a raw ``image/*`` body."""
        ctype, params = parse_options_header(request.headers.get("content-type", ""))
        ctype_s = ctype.decode("latin-1").lower()
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_bytes:
            raise self._over()
        if ctype_s == "multipart/form-data":
            return await self._read_form(request, params.get(b"boundary"))
        _check_image_type(ctype_s, "the request body")
        return await self._read_raw(request), ""

    def _over(self) -> HTTPException:
        mb = self.max_bytes / 2**20
        return _too_large(
            "the upload",
            f"{mb:g} MB",
            "send a smaller file or restart the server with a larger --max-upload-mb",
        )

    async def _chunks(self, request: Request):
        total = 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > self.max_bytes:
                raise self._over()
            yield chunk

    async def _read_raw(self, request: Request) -> bytes:
        return b"".join([c async for c in self._chunks(request)])

    async def _read_form(self, request: Request, boundary: bytes | None) -> tuple[bytes, str]:
        if not boundary:
            raise HTTPException(status_code=400, detail="multipart body without a boundary")
        files: dict[str, Any] = {}
        fields: set[str] = set()  # parts without a filename: text, not a file

        def on_file(f: Any) -> None:
            files.setdefault((f.field_name or b"").decode("latin-1"), f)

        def on_field(f: Any) -> None:
            fields.add((f.field_name or b"").decode("latin-1"))

        # MAX_MEMORY_FILE_SIZE=inf: python-multipart's File keeps everything in a BytesIO.
        parser = FormParser(
            "multipart/form-data",
            on_field=on_field,
            on_file=on_file,
            boundary=boundary,
            config={"MAX_MEMORY_FILE_SIZE": float("inf"), "MAX_BODY_SIZE": self.max_bytes},
        )
        try:
            async for chunk in self._chunks(request):
                parser.write(chunk)
            parser.finalize()
        except HTTPException:
            raise
        except Exception as err:  # python-multipart raises its own parse errors
            raise HTTPException(status_code=400, detail=f"malformed multipart body: {err}") from err
        part = files.get("file")
        if part is None and "file" in fields:
            raise HTTPException(
                status_code=400,
                detail="the field 'file' holds text, not a file (its part has no filename): "
                "send the image as a file upload (curl -F file=@image.png)",
            )
        if part is None:
            raise HTTPException(
                status_code=400, detail="no file in the form: send the image in the field 'file'"
            )
        ptype = getattr(part, "content_type", None) or b""
        ptype = ptype.decode("latin-1") if isinstance(ptype, bytes) else str(ptype)
        name = (part.file_name or b"").decode("utf-8", "replace")
        # a file part without a type (what Python's requests sends) is taken as octet-stream:
        # the bytes are decoded as an image anyway, and refused if they are none
        ptype = ptype.split(";")[0].strip().lower() or _GENERIC_TYPE
        _check_image_type(ptype, name or "the uploaded file")
        part.file_object.seek(0)
        return part.file_object.read(), name


def save_upload(folder: Path, data: bytes, name: str) -> Path:
    """Keep an upload (``--save-uploads``): ``<time>-<sha256 prefix><suffix>``, written atomically.

    The client's file name only contributes a short alphanumeric suffix (no path tricks).
    """
    suffix = Path(name).suffix.lower()
    if not re.fullmatch(r"\.[a-z0-9]{1,5}", suffix):  # a raw body has no name: its header says
        suffix = _sniffed_suffix(data)
    digest = hashlib.sha256(data).hexdigest()[:16]
    path = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{digest}{suffix}"
    atomic_write_bytes(path, data)
    return path


def _sniffed_suffix(data: bytes) -> str:
    """The image format the bytes' header names, as a file suffix (``.bin`` for none)."""
    try:
        with Image.open(io.BytesIO(data)) as im:  # the header only
            fmt = (im.format or "").lower()
    except Exception:  # not an image (decode_image says so to the client)
        return ".bin"
    return {"jpeg": ".jpg", "tiff": ".tif"}.get(fmt, f".{fmt}" if fmt else ".bin")


def prepare_upload_folder(folder: str | Path) -> Path:
    """Create ``folder`` (``--save-uploads``) and prove it writable now, not at the first upload.

    Raises :class:`ConfigError` naming the path.
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".dualseg-write-test-"):
            pass
    except OSError as err:
        raise ConfigError(
            f"--save-uploads {folder}: cannot write there ({err.strerror or err}); choose a "
            "writable folder"
        ) from err
    return folder


def working_size(height: int, width: int, max_pixels: float) -> tuple[int, int]:
    """``(h, w)`` an image is inferred at: its own size, or scaled down (aspect kept) to at most
    ``max_pixels`` pixels. ``max_pixels <= 0``: always its own size."""
    if max_pixels <= 0 or height * width <= max_pixels:
        return height, width
    scale = math.sqrt(max_pixels / (height * width))
    h, w = max(1, math.floor(height * scale)), max(1, math.floor(width * scale))
    if h * w > max_pixels:  # a side clamped up to 1 px (a very thin image): the other gives way
        if h == 1:
            w = max(1, math.floor(max_pixels))
        else:
            h = max(1, math.floor(max_pixels))
    return h, w


def _resize(array: np.ndarray, hw: tuple[int, int], interpolation: int) -> np.ndarray:
    """``HxW[xC]`` -> ``h x w [xC]`` with OpenCV."""
    return cv2.resize(array, (hw[1], hw[0]), interpolation=interpolation)


def upsample_probs(probs: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """``[C,h,w]`` -> ``[C,H,W]`` bilinear (half-pixel centres, as the engine's S4 tail)."""
    if probs.shape[1:] == hw:
        return probs
    return resize_bilinear(probs.transpose(1, 2, 0), hw).transpose(2, 0, 1)


SHUTTING_DOWN = "the server is shutting down; retry once it is back"
DISCONNECT_POLL_S = 0.25  # how often a waiting job asks whether its client is still there


class _Workers:
    """A fixed pool of inference threads with a bounded number of waiting jobs.

    ``run(fn, ...)`` awaits ``fn`` on a worker; when ``workers + queue_size`` jobs are already
    running or waiting it raises 503 at once, with a ``Retry-After`` estimated from the recent
    job durations.
    """

    def __init__(self, workers: int, queue_size: int) -> None:
        self.workers, self.queue_size = workers, queue_size
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="dualseg-serve")
        self._lock = threading.Lock()  # TestClient may drive the app from several loops
        self._pending = 0
        self._mean_s = 1.0  # running mean of a job's duration, for Retry-After
        self._waiting: set[Future[Any]] = set()  # submitted, not yet done
        self._closing = False

    async def run(
        self,
        fn: Callable[..., T],
        *args: Any,
        gone: Callable[[], Awaitable[bool]] | None = None,
    ) -> T:
        """``fn(*args)`` on a worker. ``gone``: whether the client has disconnected, asked
        while the job waits for a worker; a job whose client is gone never runs (it kept the
        queue full for requests nobody would read)."""
        with self._lock:
            if self._closing:
                raise HTTPException(status_code=503, detail=SHUTTING_DOWN)
            if self._pending >= self.workers + self.queue_size:
                wait = math.ceil(self._mean_s * (self._pending / self.workers))
                raise HTTPException(
                    status_code=503,
                    detail=f"the server is busy: {self._pending} requests are running or "
                    f"waiting (--workers {self.workers}, --queue-size {self.queue_size}); "
                    f"retry in {wait} s",
                    headers={"Retry-After": str(max(1, wait))},
                )
            self._pending += 1
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
                self._pending -= 1
                if not job.cancelled():
                    self._mean_s = 0.8 * self._mean_s + 0.2 * (time.perf_counter() - t)

    def close(self) -> None:
        """Refuse new jobs and cancel those still waiting for a worker (Ctrl-C: the server
        stops once the running ones end, where it worked through the whole queue first)."""
        self._closing = True
        for job in list(self._waiting):
            job.cancel()

    @property
    def pending(self) -> int:
        """Jobs running or waiting now."""
        return self._pending

    def shutdown(self) -> None:
        self._closing = True
        self._executor.shutdown(wait=False, cancel_futures=True)


class _RequestLog:
    """One log line per HTTP request (method, path, status, ms), as plain ASGI middleware:
    Starlette's ``@app.middleware("http")`` hides the client's disconnect from the endpoint,
    so a waiting job could never see that its client had gone."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t = time.perf_counter()
        status = 500  # an exception escaping the app is answered with 500

        async def send_and_note(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            log.info("%s %s %d %.1f ms", scope["method"], scope["path"], status, _ms(t))


# ----------------------------------------------------------------------------- the app
def create_app(
    segmenter: Segments,
    *,
    refiner: Any | None = None,
    max_megapixels: float = DEFAULT_MAX_MEGAPIXELS,
    max_upload_bytes: int = int(DEFAULT_MAX_UPLOAD_MB * 2**20),
    work_megapixels: float = DEFAULT_WORK_MEGAPIXELS,
    workers: int = DEFAULT_WORKERS,
    queue_size: int = DEFAULT_QUEUE_SIZE,
    save_uploads: str | Path | None = None,
    model_name: str = "",
) -> FastAPI:
    """The FastAPI app of ``dualseg serve`` (see the module docstring).

    ``save_uploads`` is created and checked writable here (:class:`ConfigError` if not).
    """
    if workers < 1 or queue_size < 0 or work_megapixels < 0:
        raise ConfigError(
            "workers must be >= 1, queue_size >= 0 and work_megapixels >= 0; got "
            f"{workers}, {queue_size}, {work_megapixels}"
        )
    pillow_limit = pillow_max_pixels()
    if pillow_limit and max_megapixels * 1e6 > pillow_limit:
        raise ConfigError(
            f"max_megapixels {max_megapixels:g} is over Pillow's decompression-bomb limit of "
            f"{pillow_limit / 1e6:.1f} megapixels, which refuses larger images anyway; choose "
            f"at most {int(pillow_limit / 1e5) / 10:g} (CLI: --max-megapixels), or raise "
            "PIL.Image.MAX_IMAGE_PIXELS first"
        )
    meta = segmenter.meta
    class_names = [str(c) for c in meta.class_names]
    if refiner is not None:  # a refiner of another class order would relabel silently
        if hasattr(refiner, "check_classes"):
            refiner.check_classes(tuple(class_names), len(class_names), what="the model")
        elif list(getattr(refiner, "class_names", class_names)) != class_names:
            raise ConfigError(
                f"the refiner's classes {list(refiner.class_names)} are not the model's "
                f"{class_names}; use a refiner fit for this model"
            )
    if len(class_names) > 255:  # the label maps it returns are 8-bit, as predict's PNGs
        raise ConfigError(
            f"the model has {len(class_names)} classes; dualseg serve returns 8-bit label "
            "maps, which hold at most 255"
        )
    palette = [[int(v) for v in rgb] for rgb in meta.palette]
    ignore_index = int(getattr(meta, "ignore_index", 255))
    save_dir = prepare_upload_folder(save_uploads) if save_uploads is not None else None
    reader = _UploadReader(int(max_upload_bytes))
    pool = _Workers(workers, queue_size)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        pool.shutdown()

    app = FastAPI(
        title="dualseg",
        version=_version(),
        description="Semantic segmentation of uploaded images (method A network, optional "
        "method B boundary refiner). Runs locally; uploads are kept in memory only.",
        lifespan=lifespan,
    )
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.state.workers = pool  # dualseg serve closes it on Ctrl-C (see commands/serve.py)

    app.add_middleware(_RequestLog)

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    @app.get("/api/info", response_model=InfoResponse)
    def info() -> InfoResponse:
        """The model's classes and the server's limits."""
        return InfoResponse(
            class_names=class_names,
            palette=palette,
            refiner=refiner is not None,
            max_megapixels=max_megapixels,
            max_upload_bytes=reader.max_bytes,
            work_megapixels=work_megapixels,
            workers=workers,
            queue_size=queue_size,
            busy=pool.pending,
            model=model_name,
        )

    def infer(image: np.ndarray) -> tuple[np.ndarray, Any, dict[str, float]]:
        """``(labels HxW, (refined HxW, changed HxW) or None, timings)`` at the image's size,
        computed at :func:`working_size`."""
        h, w = image.shape[:2]
        work = working_size(h, w, work_megapixels * 1e6)
        small = image if work == (h, w) else _resize(image, work, cv2.INTER_AREA)
        timings: dict[str, float] = {}
        t = time.perf_counter()
        probs = np.asarray(segmenter.predict_proba(small), dtype=np.float32)
        label = upsample_probs(probs, (h, w)).argmax(0).astype(np.uint8)
        timings["inference"] = _ms(t)
        if refiner is None:
            return label, None, timings
        t = time.perf_counter()
        r_small, changed = refine_one(refiner, small, probs)
        if work != (h, w):  # changed pixels take the refined label, the others keep the base
            up = _resize(r_small.astype(np.uint8), (h, w), cv2.INTER_NEAREST)
            changed = _resize(changed.astype(np.uint8), (h, w), cv2.INTER_NEAREST).astype(bool)
            r_label = np.where(changed, up, label)
        else:
            r_label = r_small.astype(np.uint8)
        timings["refine"] = _ms(t)
        return label, (r_label, r_label != label), timings

    def segment_upload(data: bytes, name: str, with_images: bool) -> dict[str, Any]:
        """Decode, segment and encode one upload (runs on a worker thread)."""
        if save_dir is not None:
            try:
                save_upload(save_dir, data, name)
            except OSError as err:  # a full disk: the client still gets its answer, said once
                log.warning("--save-uploads %s: upload not saved (%s)", save_dir, err.strerror)
        t = time.perf_counter()
        image = decode_image(data, source=name or "the upload", max_pixels=max_megapixels * 1e6)
        decode_ms = _ms(t)
        label, refined_pair, timings = infer(image)
        t = time.perf_counter()
        h, w = image.shape[:2]
        work_h, work_w = working_size(h, w, work_megapixels * 1e6)
        out: dict[str, Any] = {
            "width": w,
            "height": h,
            "working_width": work_w,
            "working_height": work_h,
            "label_png": png_base64(label),
            "class_pixels": np.bincount(label.ravel(), minlength=len(class_names))[
                : len(class_names)
            ].tolist(),
            "refined": None,
        }
        if with_images:
            out["color_png"] = png_base64(colorize(label, palette, ignore_index=ignore_index))
            out["overlay_png"] = png_base64(
                overlay(image, label, palette, ignore_index=ignore_index)
            )
        if refined_pair is not None:
            r_label, changed = refined_pair
            refined = {"label_png": png_base64(r_label), "changed_pixels": int(changed.sum())}
            if with_images:
                r_color = colorize(r_label, palette, ignore_index=ignore_index)
                refined["color_png"] = png_base64(r_color)
                refined["changed_png"] = png_base64(highlight_changes(r_color, changed))
            out["refined"] = refined
        out["timings_ms"] = {"decode": decode_ms, **timings, "encode": _ms(t)}
        return out

    @app.post(
        "/api/segment",
        response_model=SegmentResponse,
        openapi_extra={"requestBody": _UPLOAD_BODY},
        responses=_ERRORS,
    )
    async def segment(request: Request, images: bool = True) -> SegmentResponse:
        """Segment one image.

        Send it as multipart/form-data in the field ``file`` (``curl -F file=@street.png``) or
        as the raw body (``curl --data-binary @street.png -H 'Content-Type: image/png'``).
        ``images=false`` skips the colour/overlay PNGs (label map only).
        """
        t0 = time.perf_counter()
        data, name = await reader.read(request)
        try:
            result = await pool.run(
                segment_upload, data, name, images, gone=request.is_disconnected
            )
        except ImageTooLargeError as err:
            below = not pillow_max_pixels() or max_megapixels * 1e6 < pillow_max_pixels()
            raisable = below and "Pillow's" not in str(err)
            hint = ", or restart the server with a larger --max-megapixels" if raisable else ""
            raise HTTPException(status_code=413, detail=f"{err}{hint}") from err
        except DataError as err:  # the image policy's one-line reason
            raise HTTPException(status_code=400, detail=str(err)) from err
        result["timings_ms"]["total"] = _ms(t0)
        return SegmentResponse(
            num_classes=len(class_names), class_names=class_names, palette=palette, **result
        )

    return app


def _ms(t: float) -> float:
    return round((time.perf_counter() - t) * 1000.0, 2)


def _version() -> str:
    from dualseg._version import __version__

    return __version__
