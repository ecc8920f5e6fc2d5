"""The method-B refiner as a shareable folder: ``refiner.json`` + ``refiner.safetensors``."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dualseg._version import __version__
from dualseg.engine.pretrained import (
    CONFIG_NAME,
    REFINER_CONFIG,
    REFINER_WEIGHTS,
    folder_path,
    read_json,
    read_safetensors,
    refuse_existing,
    resolve_source,
    write_folder_files,
)
from dualseg.errors import CheckpointError
from dualseg.refine.formats import StoredRefiner
from dualseg.refine.inputs import check_finite_refiner, name_differences

REFINER_FORMAT = "dualseg-refiner-pretrained/1"


def save_folder(
    folder: str | os.PathLike[str], description: Mapping[str, Any],
    net_state: Mapping[str, Tensor], prototypes: Tensor, present: Tensor,
    *, overwrite: bool = False,
) -> Path:  # fmt: skip
    """Write a refiner into ``folder`` (weights first, ``refiner.json`` last)."""
    folder = folder_path(folder)
    refuse_existing(folder, (REFINER_CONFIG, REFINER_WEIGHTS), overwrite)
    names = description["class_names"]
    check_folder_model(folder, names, fix="save the refiner to another folder")
    tensors = {f"net.{k}": v for k, v in net_state.items()}
    tensors["prototypes"] = prototypes.float()
    tensors["present"] = present.to(torch.uint8)
    meta = {"format": REFINER_FORMAT, "dualseg_version": __version__, **description}
    write_folder_files(folder, REFINER_WEIGHTS, tensors, REFINER_CONFIG, meta)
    return folder


def check_folder_model(folder: Path, names: Sequence[str] | None, *, fix: str) -> None:
    """A refiner beside a model (``config.json``) must be fit for that model's classes."""
    if names is None or not (folder / CONFIG_NAME).is_file():
        return
    try:
        model_names = json.loads((folder / CONFIG_NAME).read_text("utf-8")).get("class_names")
    except (OSError, ValueError, AttributeError):
        return  # the model's own loading says what is wrong with it
    if isinstance(model_names, list) and list(model_names) != list(names):
        raise CheckpointError(
            f"{folder / CONFIG_NAME} describes a model of other classes than the refiner "
            f"({name_differences(model_names, names)}); {fix}"
        )


def read_folder(source: str | os.PathLike[str]) -> StoredRefiner:
    """A refiner folder (or ``hf://org/name``)'s parts."""
    folder = resolve_source(source, files=(REFINER_CONFIG, REFINER_WEIGHTS))
    meta = read_json(folder / REFINER_CONFIG, fmt=REFINER_FORMAT, what="refiner")
    tensors = read_safetensors(folder / REFINER_WEIGHTS, what="refiner")
    check_finite_refiner(folder / REFINER_WEIGHTS, tensors)
    if {"prototypes", "present"} - tensors.keys() or {"config", "class_names"} - meta.keys():
        raise CheckpointError(f"{folder}: incomplete refiner folder; save it again")
    names = meta["class_names"] if isinstance(meta["class_names"], list) else None
    check_folder_model(folder, names, fix="fit a refiner for that model")
    net_state = {k.removeprefix("net."): v for k, v in tensors.items() if k.startswith("net.")}
    protos, present = tensors["prototypes"], tensors["present"].bool()
    return StoredRefiner(meta, net_state, protos, present, folder / REFINER_CONFIG)
