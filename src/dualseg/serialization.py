"""The one safe loader: ``torch.load(weights_only=True)``, one line per failure, for every
torch file dualseg reads (no message suggests turning ``weights_only`` off). Torch is imported
only inside the functions that use it: the onnxruntime runtime imports this module."""

from __future__ import annotations

import json
import os
import pickle
import re
import struct
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dualseg.errors import CheckpointError

__all__ = ["TORCHSCRIPT_META", "read_torchscript_meta", "safe_torch_load", "torch_file_format"]

# the metadata file inside a dualseg TorchScript export (its ``_extra_files``); here, below
# dualseg.export, so that a checkpoint loader can tell such a file from a checkpoint
TORCHSCRIPT_META = "dualseg.json"

PLAIN_WEIGHTS_HINT = (
    "for plain weights save a state dict (torch.save(model.state_dict(), path)) and pass that "
    "file as weights"
)


def safe_torch_load(
    path: str | os.PathLike[str],
    *,
    what: str,
    fix: str,
    written_by: str = "",
    map_location: Any = "cpu",
) -> Any:
    """Load ``path`` with ``weights_only=True``; every failure is one :class:`CheckpointError`.

    ``what`` names the kind of file in messages ("checkpoint", "refiner", ...), ``fix`` says
    what to do with an unreadable one, ``written_by`` where a missing one comes from.
    """
    import torch

    path = Path(path)
    where = f"; {written_by}" if written_by else ""
    if not path.exists():
        raise CheckpointError(f"{what} not found: {path} (check the path{where})")
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder, not a {what} file{where}")
    if path.suffix.lower() == ".onnx":  # torch.load would call the protobuf corrupt
        raise CheckpointError(
            f"{path} is an ONNX export ('dualseg export'), not a dualseg {what}: pass the "
            f"{what} it was exported from (predict and serve run an exported model with "
            "--onnx; refine apply and serve take an exported refiner as --refiner)"
        )
    torchscript = read_torchscript_meta(path)
    if torchscript is not None:  # torch.load would warn, then fail on weights_only
        raise CheckpointError(_torchscript_message(path, torchscript, what, fix))
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        # torch's wording: "Unsupported global: GLOBAL x.y" or, for a blocked module (os,
        # subprocess ...), "unsupported GLOBAL posix.system whose module posix is blocked"
        found = re.search(r"[Uu]nsupported (?:global: )?GLOBAL (\S+)", str(err))
        if found is None or not zipfile.is_zipfile(path):
            raise CheckpointError(
                f"{path} is corrupt or not a PyTorch {what} file; {fix}"
            ) from None
        raise CheckpointError(
            f"{path} contains objects that cannot be loaded safely (weights_only=True; it holds "
            f"a {found.group(1)}), so it is not a dualseg {what}; {PLAIN_WEIGHTS_HINT}"
        ) from None
    except (KeyError, IndexError, TypeError, struct.error) as err:
        # the legacy (non-zip) unpickler reading a text or other non-PyTorch file: a text
        # file fails with KeyError of some byte value, a file of a few bytes with struct.error
        raise CheckpointError(
            f"{path} is corrupt or not a PyTorch {what} file ({_error_name(err)} while "
            f"unpickling); {fix}"
        ) from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(
            f"{path} is corrupt or truncated and cannot be read ({first}); {fix}"
        ) from None


def _error_name(err: Exception) -> str:
    return "struct.error" if isinstance(err, struct.error) else type(err).__name__


def torch_file_format(path: str | os.PathLike[str]) -> str | None:
    """What an existing file at ``path`` is, for a writer deciding whether it may replace it:
    the ``format`` of a dualseg torch file; ``""`` for an empty file or a torch zip that cannot
    be read (one cut short: the leftover of an interrupted write); None for anything else."""
    path = Path(path)
    try:
        state = safe_torch_load(path, what="file", fix="")
    except CheckpointError:
        with open(path, "rb") as f:
            return "" if f.read(4) in (b"", b"PK\x03\x04") else None
    found = state.get("format") if isinstance(state, dict) else None
    return None if found is None else str(found)


def read_torchscript_meta(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The metadata ``dualseg export`` stored in a TorchScript archive (:data:`TORCHSCRIPT_META`),
    ``{}`` for another TorchScript file, None for no readable TorchScript archive. Read from
    the zip (an archive has ``constants.pkl``, a ``torch.save`` file none), without torch."""
    try:
        if not zipfile.is_zipfile(path):
            return None
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            if not any(n.endswith("constants.pkl") for n in names):
                return None
            meta = [n for n in names if n.endswith(f"extra/{TORCHSCRIPT_META}")]
            if not meta:
                return {}
            text = z.read(meta[0])
    except (OSError, zipfile.BadZipFile, ValueError, KeyError):
        return None  # unreadable: the caller's loader reports it
    try:
        info = json.loads(text.decode("utf-8"))
    except ValueError:  # a TorchScript file whose dualseg metadata was damaged
        raise CheckpointError(
            f"{path}: its dualseg metadata (extra/{TORCHSCRIPT_META}) is not valid JSON; "
            "re-export it with 'dualseg export'"
        ) from None
    return info if isinstance(info, dict) else {}


def _torchscript_message(path: Path, info: dict[str, Any], what: str, fix: str) -> str:
    """The line for a TorchScript archive given as a ``what``: ``info`` is its metadata."""
    kind = str(info.get("kind") or "segmenter") if info else ""
    if kind == "embedding":
        return (
            f"{path} is a TorchScript export of a method-B refiner ('dualseg export "
            f"--refiner'), not a {what}; pass it to 'dualseg refine apply --refiner', or load "
            "it with dualseg.export.runtime.load_exported_refiner"
        )
    if kind:
        return (
            f"{path} is a TorchScript export ('dualseg export --format torchscript'), not a "
            f"{what}; load it with dualseg.export.runtime.ExportedSegmenter, export to ONNX "
            "for 'dualseg predict --onnx', or pass the .pt checkpoint it was exported from"
        )
    return f"{path} is a TorchScript module (torch.jit.save), not a {what}; {fix}"


def short_list(keys: list[str], n: int = 6) -> str:
    """``keys`` for a one-line message: the first ``n``, then how many more (``none`` for
    none)."""
    if not keys:
        return "none"
    more = f" (+{len(keys) - n} more)" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def nonfinite_keys(tensors: Mapping[str, Any]) -> list[str]:
    """The keys of ``tensors`` whose floating-point values hold NaN or inf (a diverged model,
    which would otherwise load and answer without an error); other values are skipped."""
    import torch

    return [
        k
        for k, v in tensors.items()
        if isinstance(v, torch.Tensor) and v.is_floating_point() and not v.isfinite().all()
    ]
