"""Shareable model folders: ``config.json`` + ``model.safetensors`` (the Hugging Face layout),
nothing that runs code when loaded; ``hf://org/name[@revision]`` fetches the same layout."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load, save
from torch import Tensor, nn

from dualseg._version import __version__
from dualseg.data import DatasetMeta
from dualseg.data.contract import LabelContract, digests_from_hex, digests_to_hex
from dualseg.engine.checkpoint import (
    BEST_NAME,
    LAST_NAME,
    _state_dict_problems,
    build_model_from_checkpoint,
    check_normalization,
    contract_of,
    load_checkpoint,
    to_plain,
)
from dualseg.errors import CheckpointError, ConfigError
from dualseg.imaging import IMAGENET_MEAN, IMAGENET_STD
from dualseg.io import atomic_write_bytes, atomic_write_json
from dualseg.models import build_model
from dualseg.serialization import nonfinite_keys, short_list
from dualseg.weights import hub_folder

FORMAT = "dualseg-pretrained/1"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
REFINER_CONFIG = "refiner.json"
REFINER_WEIGHTS = "refiner.safetensors"


# --------------------------------------------------------------------------- files
def write_safetensors(path: Path, tensors: Mapping[str, Tensor]) -> None:
    """Tensors -> one safetensors file, atomically (contiguous CPU copies, no shared storage)."""
    plain = {k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()}
    atomic_write_bytes(path, save(plain, metadata={"format": "pt"}))


def read_safetensors(path: Path, *, what: str) -> dict[str, Tensor]:
    """A safetensors file as a dict of CPU tensors; one :class:`CheckpointError` per failure."""
    if not path.is_file():
        raise CheckpointError(f"{path}: {what} weights not found; the folder is incomplete")
    try:
        return load(path.read_bytes())
    except Exception as err:  # safetensors' own SafetensorError (not exported stably)
        raise CheckpointError(
            f"{path} is corrupt or not a safetensors file ({str(err).partition(chr(10))[0]}); "
            "save or download it again"
        ) from None


def read_json(path: Path, *, fmt: str, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: {what} description not found; the folder is incomplete")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is corrupt ({err}); save or download it again") from None
    found = d.get("format") if isinstance(d, dict) else type(d).__name__
    if found != fmt:
        raise CheckpointError(f"{path} is not a dualseg {what} (format {found!r}, not {fmt!r})")
    return d


# --------------------------------------------------------------------------- sources
def is_hub_source(source: str | os.PathLike[str]) -> bool:
    """``hf://org/name`` (``Path`` turns ``//`` into ``/``, so ``hf:/org/name`` counts too)."""
    return str(source).startswith("hf:/")


def is_pretrained_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a ``config.json``."""
    return (Path(path) / CONFIG_NAME).is_file()


def resolve_source(source: str | os.PathLike[str], *, files: Sequence[str]) -> Path:
    """A local folder for ``source``: the folder itself, or ``hf://`` fetched."""
    return hub_folder(str(source), files=files) if is_hub_source(source) else Path(source)


# --------------------------------------------------------------------------- save
# the training config's data keys that say how its labels were read
TRAINING_LABEL_KEYS = ("label_format", "label_map", "ignore_index")


def save_pretrained(
    model: nn.Module,
    folder: str | os.PathLike[str],
    *,
    arch: str,
    model_kwargs: Mapping[str, Any],
    meta: DatasetMeta,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    metrics: Mapping[str, Any] | None = None,
    training_labels: Mapping[str, Any] | None = None,
    label_contract: Mapping[str, Any] | None = None,
    train_images: Any = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` as a pretrained folder; ``mean`` / ``std`` default to ImageNet's,
    ``label_contract`` to ``meta``'s; an existing folder's files are kept unless ``overwrite``."""
    folder = folder_path(folder)
    refuse_existing(folder, (CONFIG_NAME, WEIGHTS_NAME), overwrite)
    kwargs = {"num_classes": meta.num_classes, **model_kwargs}
    check_rebuilds(model, arch, kwargs)
    try:  # a refiner beside it: of these classes, and fit for the model written before
        stored = json.loads((folder / REFINER_CONFIG).read_text("utf-8"))["class_names"]
    except (OSError, ValueError, KeyError, TypeError):
        stored = None
    if stored is not None and stored != list(meta.class_names):
        raise CheckpointError(
            f"{folder / REFINER_CONFIG} is a refiner of other classes ({short_list(stored, 4)}) "
            f"than this model ({short_list(list(meta.class_names), 4)}); save to another folder"
        )
    if (folder / REFINER_CONFIG).exists() and (folder / WEIGHTS_NAME).exists():
        warnings.warn(
            f"{folder} keeps {REFINER_CONFIG} + {REFINER_WEIGHTS}, the method-B refiner fit "
            "for the model written there before; refit it (dualseg refine fit) or delete it",
            UserWarning,
            stacklevel=2,
        )
    contract = (
        LabelContract.from_dict(dict(label_contract)) if label_contract else LabelContract(meta)
    )
    labels = {k: v for k, v in (training_labels or {}).items() if k in TRAINING_LABEL_KEYS}
    config = {
        "format": FORMAT,
        "dualseg_version": __version__,
        "arch": arch,
        "model_kwargs": to_plain(kwargs),
        "num_classes": meta.num_classes,
        "class_names": list(meta.class_names),
        "palette": [list(c) for c in meta.palette],
        "ignore_index": meta.ignore_index,
        "dataset": meta.name,
        "normalization": {
            "input": "RGB scaled to [0, 1], then (x - mean) / std per channel",
            "mean": list(mean or IMAGENET_MEAN),
            "std": list(std or IMAGENET_STD),
        },
        "label_contract": contract.to_dict(),
        "training_labels": to_plain(labels),
        "metrics": {k: v for k, v in (metrics or {}).items() if isinstance(v, int | float | str)},
    }
    if train_images is not None:
        config["train_images"] = digests_to_hex(train_images)
    write_folder_files(folder, WEIGHTS_NAME, model.state_dict(), CONFIG_NAME, config)
    return folder


def write_folder_files(
    folder: Path,
    weights_name: str,
    tensors: Mapping[str, Tensor],
    config_name: str,
    config: Mapping[str, Any],
) -> None:
    """Write weights and description as a pair (both staged, then moved into place)."""
    staged = {name: folder / f".{name}.staged" for name in (weights_name, config_name)}
    try:
        write_safetensors(staged[weights_name], tensors)
        atomic_write_json(staged[config_name], config)
        os.replace(staged[weights_name], folder / weights_name)
        os.replace(staged[config_name], folder / config_name)
    finally:
        for path in staged.values():
            path.unlink(missing_ok=True)


def check_rebuilds(model: nn.Module, arch: str, kwargs: Mapping[str, Any]) -> None:
    """Refuse to save ``model`` under an ``arch`` / ``model_kwargs`` that build another network
    (other shapes or convolution / pooling geometry), or with non-finite weights."""
    state = model.state_dict()
    for prefix, what in (("_orig_mod.", "torch.compile's wrapper"), ("module.", "a DDP wrapper")):
        if state and all(k.startswith(prefix) for k in state):
            raise ConfigError(
                f"this model is {what}; save the model inside it (model.{prefix[:-1]})"
            )
    try:
        with torch.device("meta"):  # the layers only: no memory, no initialization
            built = build_model(arch, **{**kwargs, "weights": None})
    except (TypeError, ValueError, KeyError, ConfigError) as err:
        raise ConfigError(f"model_kwargs {dict(kwargs)!r} do not build {arch!r} ({err})") from None
    problems = _state_dict_problems(built, state)
    if not problems:
        ours, theirs = _geometry(built), _geometry(model)
        problems = [
            f"{name}: {ours.get(name)} built, {theirs.get(name)} given"
            for name in sorted(set(ours) | set(theirs))
            if ours.get(name) != theirs.get(name)
        ][:3]
    if problems:
        raise ConfigError(
            f"this model is not what arch={arch!r} with model_kwargs {dict(kwargs)!r} builds "
            f"({'; '.join(problems)}); pass the arch and model_kwargs the model was built with"
        )
    if bad := nonfinite_keys(state):
        raise ConfigError(f"the model holds NaN or infinite weights ({short_list(bad, 3)})")


def _geometry(model: nn.Module) -> dict[str, str]:
    """Each convolution's and pooling layer's sampling geometry."""
    keys = ("kernel_size", "stride", "padding", "dilation", "groups", "output_size")
    out = {
        name: {k: getattr(m, k) for k in keys if hasattr(m, k)} for name, m in model.named_modules()
    }
    return {name: repr(found) for name, found in out.items() if found}


def folder_path(folder: str | os.PathLike[str]) -> Path:
    """``folder`` as a Path; an empty one is refused, not read as ``.``."""
    if not os.fspath(folder).strip():
        raise ConfigError("save_pretrained needs a folder path, got an empty one; name a folder")
    return Path(folder)


def refuse_existing(folder: Path, names: Sequence[str], overwrite: bool) -> None:
    """Refuse a Hub address, a file in the way, or ``names`` there (unless ``overwrite``)."""
    if str(folder).startswith("hf:"):
        raise ConfigError(
            f"save_pretrained writes a local folder, not the Hub ({folder}); save to a folder, "
            "then upload it with huggingface_hub.upload_folder"
        )
    blocker = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise ConfigError(f"{blocker} is a file; save_pretrained needs a folder path")
    if (present := [n for n in names if (folder / n).exists()]) and not overwrite:
        raise ConfigError(
            f"{folder} already holds {', '.join(present)}; choose another folder, delete them, "
            "or pass overwrite=True (CLI: --overwrite)"
        )


def save_pretrained_from_checkpoint(
    checkpoint: str | os.PathLike[str], folder: str | os.PathLike[str], *, overwrite: bool = False
) -> Path:
    """Any :func:`load_state` source (``last.pt`` / ``best.pt``, ...) -> a pretrained folder."""
    ckpt = load_state(checkpoint)
    model, meta = build_model_from_checkpoint(ckpt, device="cpu")
    metrics = ckpt.get("metrics") or {}
    norm = ckpt.get("normalization") or {}  # a pretrained folder's own; a .pt: the default
    return save_pretrained(
        model,
        folder,
        arch=str(ckpt["arch"]),
        model_kwargs=ckpt["model_kwargs"],
        meta=meta,
        mean=norm.get("mean"),
        std=norm.get("std"),
        metrics={k: metrics[k] for k in ("iteration", "miou") if k in metrics},
        training_labels=(ckpt.get("config") or {}).get("data"),
        label_contract=contract_of(ckpt).to_dict(),
        train_images=ckpt.get("train_images"),
        overwrite=overwrite,
    )


# --------------------------------------------------------------------------- load
def read_pretrained(source: str | os.PathLike[str]) -> dict[str, Any]:
    """A pretrained folder (or ``hf://``) as a checkpoint-like dict (for
    :func:`~dualseg.engine.checkpoint.build_model_from_checkpoint`)."""
    folder = resolve_source(source, files=(CONFIG_NAME, WEIGHTS_NAME))
    where = folder / CONFIG_NAME
    config = read_json(where, fmt=FORMAT, what="pretrained model")
    if missing := [
        k for k in ("arch", "model_kwargs", "class_names", "palette") if k not in config
    ]:
        raise CheckpointError(f"{where} lacks {missing}; save the folder again")
    norm, labels = config.get("normalization") or {}, config.get("training_labels") or {}
    if (
        not isinstance(norm, dict)
        or not isinstance(labels, dict)
        or set(labels) - set(TRAINING_LABEL_KEYS)
    ):
        raise CheckpointError(
            f"{where}: normalization must be a dict of mean and std, training_labels must map "
            f"some of {', '.join(TRAINING_LABEL_KEYS)}; save the folder again"
        )
    try:
        seen = {k: digests_from_hex(config[k]) for k in ("train_images",) if k in config}
    except ValueError as err:
        raise CheckpointError(f"{where}: train_images: {err}; save it again") from None
    return {
        **{k: config[k] for k in ("label_contract",) if k in config},
        **seen,
        "format": FORMAT,
        "arch": config["arch"],
        "model_kwargs": config["model_kwargs"],
        "model": read_safetensors(folder / WEIGHTS_NAME, what="model"),
        "class_names": config["class_names"],
        "palette": config["palette"],
        "ignore_index": config.get("ignore_index", 255),
        "config": {"data": {"preset": config.get("dataset"), **labels}},
        "normalization": norm,
        "metrics": dict(config.get("metrics") or {}),
        "_path": str(folder / WEIGHTS_NAME),
        "_meta_path": str(where),  # what errors about the description name
    }


def load_state(source: str | os.PathLike[str]) -> dict[str, Any]:
    """Any model source (a ``.pt`` file, a pretrained folder, ``hf://org/name``) as a
    checkpoint-like dict."""
    if not os.fspath(source).strip():
        raise ConfigError("the model path is empty; pass a checkpoint, a folder or hf://org/name")
    path = Path(source)
    if is_hub_source(source) or is_pretrained_folder(path):
        return read_pretrained(source)
    if path.is_dir():
        has = [n for n in (BEST_NAME, LAST_NAME) if (path / n).is_file()]
        hint = f"pass {path / has[0]}" if has else f"it has no {CONFIG_NAME}"
        raise CheckpointError(f"{path} is a folder but not a pretrained folder ({hint})")
    if path.name in (CONFIG_NAME, WEIGHTS_NAME) and is_pretrained_folder(path.parent):
        raise CheckpointError(
            f"{path} is one file of the pretrained folder {path.parent}; pass the folder"
        )
    return load_checkpoint(path)


def load_network(
    source: str | os.PathLike[str], *, device: Any = "cpu"
) -> tuple[nn.Module, DatasetMeta, dict[str, Any]]:
    """``(model, meta, state)`` of any model source, its normalization checked."""
    state = load_state(source)
    check_normalization(state)
    model, meta = build_model_from_checkpoint(state, device=device)
    return model, meta, state
