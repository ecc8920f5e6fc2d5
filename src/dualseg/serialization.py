"""The one safe loader, ``torch.load(weights_only=True)``, one line per failure. Torch is
imported inside the functions: the onnxruntime runtime imports this module."""

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

# the metadata file in a dualseg TorchScript export: here, so loaders can tell one apart
TORCHSCRIPT_META = "dualseg.json"


def safe_torch_load(
    path: str | os.PathLike[str],
    *,
    what: str,
    fix: str,
    written_by: str = "",
    map_location: Any = "cpu",
) -> Any:
    """Load ``path`` with ``weights_only=True``; every failure is one :class:`CheckpointError`
    naming the kind of file (``what``), the ``fix`` and where such a file comes from."""
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
            "--onnx; eval, refine apply and serve take an exported refiner as --refiner)"
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
            f"a {found.group(1)}), so it is not a dualseg {what}; for plain weights save a state "
            "dict (torch.save(model.state_dict(), path)) and pass that file as weights"
        ) from None
    except (KeyError, IndexError, TypeError, struct.error) as err:
        # the legacy unpickler on a text file (KeyError) or one of a few bytes (struct.error)
        name = "struct.error" if isinstance(err, struct.error) else type(err).__name__
        raise CheckpointError(
            f"{path} is corrupt or not a PyTorch {what} file ({name} while unpickling); {fix}"
        ) from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(
            f"{path} is corrupt or truncated and cannot be read ({first}); {fix}"
        ) from None


def torch_file_format(path: str | os.PathLike[str]) -> str | None:
    """For a writer deciding whether it may replace ``path``: a dualseg torch file's ``format``,
    ``""`` for an empty or unreadable torch zip (an interrupted write), else None."""
    path = Path(path)
    try:
        state = safe_torch_load(path, what="file", fix="")
    except CheckpointError:
        with open(path, "rb") as f:
            return "" if f.read(4) in (b"", b"PK\x03\x04") else None
    found = state.get("format") if isinstance(state, dict) else None
    return None if found is None else str(found)


def read_torchscript_meta(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A TorchScript archive's dualseg metadata, ``{}`` for another archive, None for no
    archive; read from the zip (only archives hold ``constants.pkl``), without torch."""
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
    """The first ``n`` keys, then how many more, for a one-line message."""
    if not keys:
        return "none"
    more = f" (+{len(keys) - n} more)" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


def nonfinite_keys(tensors: Mapping[str, Any]) -> list[str]:
    """The keys of the float tensors holding NaN or inf (a diverged model would load)."""
    import torch

    return [
        k
        for k, v in tensors.items()
        if isinstance(v, torch.Tensor) and v.is_floating_point() and not v.isfinite().all()
    ]
