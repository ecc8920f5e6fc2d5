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
                f"--out {out}: the refiner's sidecar is <out stem>.json, which would replace "
                "the exported model; name the model .onnx or .pt"
            )
        if sidecar.name == "refiner.json" and (sidecar.parent / "refiner.safetensors").exists():
            raise ConfigError(
                f"--out {out}: its sidecar {sidecar} would be the refiner.json of the "
                f"pretrained folder {sidecar.parent}; name the export otherwise (e.g. "
                f"{sidecar.parent / ('exported_' + out.name)})"
            )
        targets.append(sidecar)
    flag = "--refiner" if refiner else "--checkpoint"
    for target in targets if "://" not in source else []:
        inside = Path(source).is_dir() and target.exists() and _same(target.parent, Path(source))
        if _same(target, Path(source)) or inside:
            raise ConfigError(
                f"--out {out} would overwrite {flag} {source}"
                f"{f' ({target.name})' if inside else ''}, the model being exported; "
                "choose another --out"
            )
    if format != "pretrained":
        _check_files(targets, format, overwrite)
    return targets


def _check_files(targets: list[Path], format: str, overwrite: bool) -> None:
    out = targets[0]
    for target in targets:  # an earlier export may be replaced; a trained file never
        kind = torch_file_format(target) if target.is_file() else None
        if kind:
            raise ConfigError(
                f"--out {target} is a dualseg file ({kind}), not an earlier export; "
                "export never writes over it, not even with --overwrite: choose another --out"
            )
    check_writable(out, kind="file", what="--out")  # an existing folder, say
    is_onnx = out.suffix.lower() == ".onnx"
    renamed = out.with_suffix if out.suffix.lower() in (".pt", ".pth", ".onnx") else None
    if format == "onnx" and not is_onnx:  # readers take a .onnx file for ONNX by name
        name = renamed(".onnx") if renamed else out.with_name(out.name + ".onnx")
        raise ConfigError(
            f"--out {out}: --format onnx writes an ONNX file, which is read by its .onnx "
            f"suffix; name it {name} (or pass --format torchscript)"
        )
    if format == "torchscript" and is_onnx:
        raise ConfigError(
            f"--out {out}: --format torchscript writes a TorchScript file, which a .onnx name "
            f"would pass off as ONNX; name it {out.with_suffix('.pt')} (or pass --format onnx)"
        )
    present = [str(t) for t in targets if t.exists()]
    if present and not overwrite:
        raise ConfigError(
            f"{' and '.join(present)} already exist{'s' if len(present) == 1 else ''}; "
            "choose another --out, delete it, or pass --overwrite to replace it"
        )
