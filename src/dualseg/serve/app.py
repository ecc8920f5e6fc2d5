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

``segmenter`` is anything with ``.meta`` (``class_names``, ``palette``, ``ignore_index``) and
``.predict_proba(rgb uint8 HxWx3) -> float [C,H,W]``: the engine's ``Segmenter`` or the
onnxruntime ``OnnxSegmenter``. ``refiner`` (optional) is a method-B ``BoundaryRefiner`` or an
exported one (``dualseg.export.runtime.load_exported_refiner``); see :func:`refine_one`.
"""

from __future__ import annotations

import base64
import hashlib
import io
import re
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from PIL import Image, ImageOps, UnidentifiedImageError
from pydantic import BaseModel, Field
from python_multipart.multipart import FormParser, parse_options_header
from starlette.concurrency import run_in_threadpool

from dualseg.io import atomic_write_bytes
from dualseg.viz import colorize, overlay

STATIC_DIR = Path(__file__).resolve().parent / "static"
DEFAULT_MAX_MEGAPIXELS = 20.0
DEFAULT_MAX_UPLOAD_MB = 25.0
CHANGED_COLOR = (255, 0, 255)  # magenta: refined pixels that differ from the base prediction
# Part/body content types accepted besides image/*: what browsers and curl send for unknown files.
_GENERIC_TYPES = {"application/octet-stream", ""}


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
    400: {"description": "the upload is not a decodable image, or the form lacks 'file'"},
    413: {"description": "upload larger than max_upload_bytes, or image over max_megapixels"},
    415: {"description": "content type is neither multipart/form-data nor image/*"},
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
        if ctype_s.startswith("image/") or ctype_s in _GENERIC_TYPES:
            return await self._read_raw(request), ""
        raise HTTPException(
            status_code=415,
            detail=(
                f"unsupported content type {ctype_s!r}: send the image as multipart/form-data "
                "(field 'file') or as the raw body with an image/* content type"
            ),
        )

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

        def on_file(f: Any) -> None:
            files.setdefault((f.field_name or b"").decode("latin-1"), f)

        # MAX_MEMORY_FILE_SIZE=inf: python-multipart's File keeps everything in a BytesIO.
        parser = FormParser(
            "multipart/form-data",
            on_field=None,
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
        if part is None:
            raise HTTPException(
                status_code=400, detail="no file in the form: send the image in the field 'file'"
            )
        ptype = (getattr(part, "content_type", None) or "").split(";")[0].strip().lower()
        name = (part.file_name or b"").decode("utf-8", "replace")
        if not (ptype.startswith("image/") or ptype in _GENERIC_TYPES):
            raise HTTPException(
                status_code=415,
                detail=f"{name or 'the upload'} has content type {ptype!r}, not an image; "
                "upload a PNG, JPEG, BMP, TIFF or WebP image",
            )
        part.file_object.seek(0)
        return part.file_object.read(), name


def save_upload(folder: Path, data: bytes, name: str) -> Path:
    """Keep an upload (``--save-uploads``): ``<time>-<sha256 prefix><suffix>``, written atomically.

    The client's file name only contributes a short alphanumeric suffix (no path tricks).
    """
    suffix = Path(name).suffix.lower()
    suffix = suffix if re.fullmatch(r"\.[a-z0-9]{1,5}", suffix) else ".bin"
    digest = hashlib.sha256(data).hexdigest()[:16]
    path = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{digest}{suffix}"
    atomic_write_bytes(path, data)
    return path


def decode_image(data: bytes, *, name: str, max_megapixels: float) -> np.ndarray:
    """Image bytes -> uint8 ``HxWx3`` RGB (EXIF orientation applied), size checked first."""
    label = name or "the upload"
    if not data:
        raise HTTPException(status_code=400, detail=f"{label} is empty; choose an image file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))  # reads the header only
            w, h = im.size
            if w * h > max_megapixels * 1e6:
                raise _too_large(
                    f"{label} ({w}x{h} = {w * h / 1e6:.1f} megapixels)",
                    f"{max_megapixels:g} megapixels",
                    "downscale it or restart the server with a larger --max-megapixels",
                )
            im = ImageOps.exif_transpose(im).convert("RGB")  # decodes
    except HTTPException:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise _too_large(label, "Pillow's decompression-bomb guard", str(err)) from err
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise HTTPException(
            status_code=400,
            detail=f"{label} is not a readable image ({err}); upload a PNG, JPEG, BMP, TIFF "
            "or WebP image",
        ) from err
    return np.array(im)  # writable: torch.from_numpy needs it


# ----------------------------------------------------------------------------- the app
def create_app(
    segmenter: Segments,
    *,
    refiner: Any | None = None,
    max_megapixels: float = DEFAULT_MAX_MEGAPIXELS,
    max_upload_bytes: int = int(DEFAULT_MAX_UPLOAD_MB * 2**20),
    save_uploads: str | Path | None = None,
    model_name: str = "",
) -> FastAPI:
    """The FastAPI app of ``dualseg serve`` (see the module docstring)."""
    meta = segmenter.meta
    class_names = [str(c) for c in meta.class_names]
    palette = [[int(v) for v in rgb] for rgb in meta.palette]
    ignore_index = int(getattr(meta, "ignore_index", 255))
    save_dir = Path(save_uploads) if save_uploads is not None else None
    reader = _UploadReader(int(max_upload_bytes))
    lock = threading.Lock()  # one inference at a time: a local page, bounded memory

    app = FastAPI(
        title="dualseg",
        version=_version(),
        description="Semantic segmentation of uploaded images (method A network, optional "
        "method B boundary refiner). Runs locally; uploads are kept in memory only.",
    )
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

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
            model=model_name,
        )

    def segment_array(image: np.ndarray, with_images: bool) -> dict[str, Any]:
        timings: dict[str, float] = {}
        t = time.perf_counter()
        with lock:
            probs = np.asarray(segmenter.predict_proba(image), dtype=np.float32)
        label = probs.argmax(0).astype(np.uint8)
        timings["inference"] = _ms(t)
        refined = None
        if refiner is not None:
            t = time.perf_counter()
            with lock:
                r_label, changed = refine_one(refiner, image, probs)
            r_label = np.asarray(r_label).astype(np.uint8)
            timings["refine"] = _ms(t)
        t = time.perf_counter()
        out: dict[str, Any] = {
            "label_png": png_base64(label),
            "class_pixels": np.bincount(label.ravel(), minlength=len(class_names))[
                : len(class_names)
            ].tolist(),
        }
        if with_images:
            out["color_png"] = png_base64(colorize(label, palette, ignore_index=ignore_index))
            out["overlay_png"] = png_base64(
                overlay(image, label, palette, ignore_index=ignore_index)
            )
        if refiner is not None:
            refined = {"label_png": png_base64(r_label), "changed_pixels": int(changed.sum())}
            if with_images:
                r_color = colorize(r_label, palette, ignore_index=ignore_index)
                refined["color_png"] = png_base64(r_color)
                refined["changed_png"] = png_base64(highlight_changes(r_color, changed))
        out["refined"] = refined
        timings["encode"] = _ms(t)
        out["timings_ms"] = timings
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
        if save_dir is not None:
            save_upload(save_dir, data, name)
        t = time.perf_counter()
        image = await run_in_threadpool(
            decode_image, data, name=name, max_megapixels=max_megapixels
        )
        decode_ms = _ms(t)
        result = await run_in_threadpool(segment_array, image, images)
        timings = {"decode": decode_ms, **result.pop("timings_ms"), "total": _ms(t0)}
        h, w = image.shape[:2]
        return SegmentResponse(
            width=w,
            height=h,
            num_classes=len(class_names),
            class_names=class_names,
            palette=palette,
            timings_ms=timings,
            **result,
        )

    return app


def _ms(t: float) -> float:
    return round((time.perf_counter() - t) * 1000.0, 2)


def _version() -> str:
    from dualseg._version import __version__

    return __version__
