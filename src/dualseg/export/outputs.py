"""Where ``dualseg export`` may write: never over the model it exports (or a file of its
pretrained folder), never over a training file, an existing export only when asked, and
under a name whose suffix says the format (readers take a ``.onnx`` file for ONNX)."""

from __future__ import annotations

import os
from pathlib import Path

from dualseg.errors import ConfigError
from dualseg.export.runners import refiner_sidecar_path
from dualseg.io import check_writable
from dualseg.serialization import torch_file_format


def _same(a: Path, b: Path) -> bool:
    """``a`` and ``b`` name the same file or folder (symlinks, ``..`` and hard links too)."""
    if a.exists() and b.exists():
        return os.path.samefile(a, b)
    return a.resolve() == b.resolve()


def check_outputs(
    out: Path, *, source: str, refiner: bool, format: str, overwrite: bool
) -> list[Path]:
    """The files an export of ``source`` to ``out`` writes (a refiner's sidecar too); one
    line for each refusal, before anything is loaded or written."""
    targets = [out]
    if refiner and format != "pretrained":
        sidecar = refiner_sidecar_path(out)
        if _same(out, sidecar):
            raise ConfigError(
                f"--out {out}: the refiner's sidecar <out stem>.json would replace the model; "
                "name the model .onnx or .pt"
            )
        if sidecar.name == "refiner.json" and (sidecar.parent / "refiner.safetensors").exists():
            raise ConfigError(
                f"--out {out}: its sidecar would be the refiner.json of the pretrained folder "
                f"{sidecar.parent}; name the export otherwise"
            )
        targets.append(sidecar)
    for target in targets if "://" not in source else []:
        inside = Path(source).is_dir() and target.exists() and _same(target.parent, Path(source))
        if _same(target, Path(source)) or inside:
            flag = "--refiner" if refiner else "--checkpoint"
            what = f" ({target.name})" if inside else ""
            raise ConfigError(
                f"--out {out} would overwrite {flag} {source}{what}; choose another --out"
            )
    if format == "pretrained":
        return targets
    for target in targets:  # an earlier export may be replaced; a trained file never
        if target.is_file() and (kind := torch_file_format(target)):
            raise ConfigError(
                f"--out {target} is a dualseg file ({kind}), not an earlier export; choose "
                "another --out"
            )
    check_writable(out, kind="file", what="--out")  # an existing folder, say
    is_onnx = out.suffix.lower() == ".onnx"
    if format == "onnx" and not is_onnx:  # readers take a .onnx file for ONNX by name
        name = out.with_suffix(".onnx") if out.suffix in (".pt", ".pth") else f"{out}.onnx"
        raise ConfigError(f"--out {out}: --format onnx writes a .onnx file; name it {name}")
    if format == "torchscript" and is_onnx:
        raise ConfigError(
            f"--out {out}: --format torchscript writes no ONNX; name it {out.with_suffix('.pt')}"
        )
    present = [str(t) for t in targets if t.exists()]
    if present and not overwrite:
        raise ConfigError(f"{' and '.join(present)} exist(s); pass --overwrite to replace")
    return targets
