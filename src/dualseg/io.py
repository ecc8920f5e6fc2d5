"""Atomic file writes: a reader never sees a half-written file.

Everything dualseg writes (checkpoints, PNGs, JSON, npz, list files) goes through these helpers:
write to a temporary file in the same folder, flush + fsync, then ``os.replace`` — which is
atomic on POSIX and Windows.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary sibling of ``path`` for writing; move it over ``path`` on success.

    On an exception the temporary file is removed and ``path`` is left untouched.
    """
    if mode not in {"w", "wb"}:
        raise ValueError(f"atomic_open supports modes 'w' and 'wb', got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates the file 0600; give it the permissions a plain open() would.
        os.chmod(tmp, 0o666 & ~_UMASK)
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Read once at import: os.umask can only be read by setting it, which is not thread-safe.
_UMASK = _read_umask()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    text = json.dumps(obj, indent=2, default=_json_default)
    atomic_write_text(path, text + "\n")


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` through a temporary file (checkpoints are never half-written)."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


def atomic_save_image(path: str | os.PathLike[str], array: Any) -> None:
    """Save a uint8 HxW or HxWx3 array as PNG (or the format the suffix names), atomically."""
    from PIL import Image

    path = Path(path)
    buf = io.BytesIO()
    fmt = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".bmp": "BMP", ".tif": "TIFF"}.get(
        path.suffix.lower(), "PNG"
    )
    Image.fromarray(array).save(buf, format=fmt)
    atomic_write_bytes(path, buf.getvalue())


def _json_default(obj: Any) -> Any:
    # numpy / torch scalars and arrays, Paths, tuples-as-lists: JSON without surprises.
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")
