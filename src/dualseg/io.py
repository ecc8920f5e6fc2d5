"""Atomic file writes (a temporary sibling, fsync, ``os.replace``) for everything dualseg
writes, and :func:`check_writable`, which every command runs on its outputs before any work."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
from PIL import Image

from dualseg.errors import OutputError


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO[Any]]:
    """A temporary sibling of ``path``, moved over it on success and removed on failure."""
    path = Path(path)
    if path.is_dir():  # os.replace's error named the hidden temporary file
        raise OutputError(f"{path} is a folder; give a file path inside it, e.g. {path / 'x'}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # a part of the path is a file
        blocker = next((p for p in reversed(path.parents) if p.is_file()), path.parent)
        raise OutputError(
            f"cannot write {path}: {blocker} is a file, not a folder; choose another path"
        ) from None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates the file 0600: the permissions a plain open() would give
        os.chmod(tmp, 0o666 & ~_UMASK)
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(err, OSError) and err.filename is None and err.errno is not None:
            # write / fsync failures (disk full) name no file: name the one being written
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise


# read once at import: os.umask is read by setting it, which is not thread-safe
_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    text = json.dumps(obj, indent=2, default=_json_default)
    atomic_write_text(path, text + "\n")


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


def encode_image(array: Any, fmt: str = "PNG") -> bytes:
    """An image array as file bytes: the one encoder of every PNG dualseg writes (zlib level 1:
    several times faster than the default, a few percent larger)."""
    buf = io.BytesIO()
    options = {"PNG": {"compress_level": 1}, "JPEG": {"quality": 95}}.get(fmt, {})
    Image.fromarray(np.asarray(array)).save(buf, format=fmt, **options)
    return buf.getvalue()


def atomic_save_image(path: str | os.PathLike[str], array: Any) -> None:
    """Save a uint8 image array in the format its suffix names (else PNG), atomically."""
    fmts = {".jpg": "JPEG", ".jpeg": "JPEG", ".bmp": "BMP", ".tif": "TIFF"}
    atomic_write_bytes(path, encode_image(array, fmts.get(Path(path).suffix.lower(), "PNG")))


def label_png(label: Any, num_classes: int) -> Any:
    """A label map as its PNG's array: 16-bit above 256 classes (8 bits would wrap them)."""
    return np.asarray(label).astype(np.uint8 if num_classes <= 256 else np.uint16)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):  # numpy and torch arrays and scalars
        return obj.tolist()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def file_digest(path: str | os.PathLike[str], n: int = 16) -> str:
    """``n`` hex digits of a file's SHA-256."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:n]


def check_writable(
    path: str | os.PathLike[str], *, kind: Literal["file", "dir"] = "file", what: str = "output"
) -> Path:
    """``path`` (a file, or a folder with ``kind="dir"``) if it can be written, else one
    :class:`OutputError`; a probe file comes and goes in the deepest existing folder."""
    if not os.fspath(path).strip():
        raise OutputError(f"{what} is empty; name a {'folder' if kind == 'dir' else 'file'}")
    path = Path(path)
    if kind == "dir" and path.exists() and not path.is_dir():
        raise OutputError(f"{what} {path} is an existing file, not a folder; pass a folder path")
    if kind == "file" and path.is_dir():
        raise OutputError(f"{what} {path} is an existing folder; pass a file path")
    folder = path if kind == "dir" else path.parent
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(
            f"{what} {path}: cannot create it, {existing} is a file; choose another location"
        )
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".dualseg-probe.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise OutputError(
            f"{what} {path}: {existing} is not writable ({reason}); choose a writable location"
        ) from None
    return path
