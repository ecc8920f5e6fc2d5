"""Uploads of ``dualseg serve``: read into memory (never onto disk unless asked), checked for
an image type and a size limit while they stream in, and kept under ``--save-uploads``."""

from __future__ import annotations

import hashlib
import io
import re
import time
from pathlib import Path
from typing import Any

from fastapi import HTTPException, Request
from PIL import Image
from python_multipart.multipart import FormParser, parse_options_header

from dualseg.io import atomic_write_bytes, check_writable

GENERIC_TYPE = "application/octet-stream"  # what browsers send for an unknown extension
VECTOR_TYPES = {"image/svg+xml"}  # image/* types that are drawings, not pictures


def _check_image_type(ctype: str, what: str) -> None:
    """415 unless ``ctype`` is a raster ``image/*`` type or ``application/octet-stream``."""
    if ctype == GENERIC_TYPE or (ctype.startswith("image/") and ctype not in VECTOR_TYPES):
        return
    if not ctype:
        why = "has no content type"
    elif ctype in VECTOR_TYPES:
        why = f"is {ctype!r}, a vector drawing (export it as PNG first)"
    else:
        why = f"has content type {ctype!r}, not an image"
    raise HTTPException(
        status_code=415,
        detail=f"{what} {why}; send multipart/form-data with the image in the field 'file', or "
        "the raw image as the body with its image/* content type (e.g. image/png)",
    )


async def read_upload(request: Request, max_bytes: int) -> tuple[bytes, str]:
    """``(image bytes, file name)`` of a multipart form's ``file`` or a raw ``image/*`` body,
    counted while it streams in."""
    too_large = HTTPException(
        status_code=413,
        detail=f"the upload is over the limit of {max_bytes / 2**20:g} MB; send a smaller file "
        "or restart the server with a larger --max-upload-mb",
    )
    ctype, params = parse_options_header(request.headers.get("content-type", ""))
    ctype = ctype.decode("latin-1").lower()
    multipart = ctype == "multipart/form-data"
    if not multipart:
        _check_image_type(ctype, "the request body")
    if int(request.headers.get("content-length") or 0) > max_bytes:
        raise too_large
    total, chunks = 0, []
    files: dict[str, Any] = {}
    texts: set[str] = set()  # parts without a filename
    try:  # MAX_MEMORY_FILE_SIZE=inf: every part stays in a BytesIO, never on disk
        parser = FormParser(
            "multipart/form-data",
            on_field=lambda f: texts.add((f.field_name or b"").decode("latin-1")),
            on_file=lambda f: files.setdefault((f.field_name or b"").decode("latin-1"), f),
            boundary=params.get(b"boundary") or b"",
            config={"MAX_MEMORY_FILE_SIZE": float("inf")},
        )
        async for chunk in request.stream():
            total += len(chunk)
            if total > max_bytes:
                raise too_large
            if multipart:
                parser.write(chunk)
            else:
                chunks.append(chunk)
        if not multipart:
            return b"".join(chunks), ""
        parser.finalize()
    except HTTPException:
        raise
    except Exception as err:  # python-multipart raises its own parse errors
        raise HTTPException(status_code=400, detail=f"malformed multipart body: {err}") from err
    part = files.get("file")
    if part is None:
        raise HTTPException(
            status_code=400,
            detail="the field 'file' holds text, not a file (its part has no filename): send "
            "the image as a file upload (curl -F file=@image.png)"
            if "file" in texts
            else "no file in the form: send the image in the field 'file'",
        )
    name = (part.file_name or b"").decode("utf-8", "replace")
    # a part without a type (what Python's requests sends) is read by its content
    ptype = str(part.content_type or "").split(";")[0].strip().lower()
    _check_image_type(ptype or GENERIC_TYPE, name or "the uploaded file")
    part.file_object.seek(0)
    return part.file_object.read(), name


def save_upload(folder: Path, data: bytes, name: str) -> Path:
    """Keep an upload as ``<time>-<sha256 prefix><suffix>``, written atomically; the client's
    file name gives only a short alphanumeric suffix (else the image header's format)."""
    suffix = Path(name).suffix.lower()
    if not re.fullmatch(r"\.[a-z0-9]{1,5}", suffix):
        try:
            with Image.open(io.BytesIO(data)) as im:  # the header only
                fmt = (im.format or "bin").lower()
        except Exception:  # not an image (decode_image tells the client)
            fmt = "bin"
        suffix = {"jpeg": ".jpg", "tiff": ".tif"}.get(fmt, f".{fmt}")
    digest = hashlib.sha256(data).hexdigest()[:16]
    path = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{digest}{suffix}"
    atomic_write_bytes(path, data)
    return path


def prepare_upload_folder(folder: str | Path) -> Path:
    """Create ``folder`` (``--save-uploads``) once it proves writable, not at the first upload."""
    folder = check_writable(folder, kind="dir", what="--save-uploads")
    folder.mkdir(parents=True, exist_ok=True)
    return folder
