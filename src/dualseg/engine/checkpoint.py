"""Checkpoints: one plain dict, written atomically, loaded with ``weights_only=True``."""

from __future__ import annotations

import os
import random
from collections.abc import Mapping, Sequence
from inspect import signature
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dualseg._version import __version__
from dualseg.data import DatasetMeta
from dualseg.data.contract import LabelContract
from dualseg.errors import CheckpointError, DataError
from dualseg.imaging import IMAGENET_MEAN, IMAGENET_STD
from dualseg.io import atomic_torch_save
from dualseg.models import MODELS, build_model
from dualseg.serialization import nonfinite_keys, safe_torch_load, short_list

FORMAT = "dualseg-checkpoint/1"
LAST_NAME = "last.pt"
BEST_NAME = "best.pt"


# --------------------------------------------------------------------------- plain values
def to_plain(obj: Any) -> Any:
    """``obj`` in types ``torch.load(weights_only=True)`` accepts (numpy -> tensors, numbers)."""
    if isinstance(obj, torch.Tensor | str | bytes | bool | int | float | type(None)):
        return obj
    if isinstance(obj, np.ndarray | np.generic):
        return torch.from_numpy(np.ascontiguousarray(obj)) if obj.ndim else obj.item()
    if isinstance(obj, Mapping):
        plain = {k: to_plain(v) for k, v in obj.items()}
        return type(obj)(plain) if type(obj).__name__ == "OrderedDict" else plain
    if isinstance(obj, list | tuple):
        return type(obj)(to_plain(v) for v in obj)
    raise TypeError(f"cannot store a {type(obj).__name__} in a checkpoint (weights_only=True)")


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch (CPU) and CUDA RNG states as plain values."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),  # (version, tuple[int, ...], gauss): plain tuples
        "numpy": (name, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state` (CUDA states are restored when the counts match)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, key, *rest = state["numpy"]
    np.random.set_state((name, key.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda])


# --------------------------------------------------------------------------- save / load
def save_checkpoint(path: str | os.PathLike[str], state: Mapping[str, Any]) -> Path:
    """Write ``state`` (with ``format`` and ``version``) to ``path`` atomically."""
    plain = to_plain({k: v for k, v in state.items() if k != "_path"})
    plain.setdefault("format", FORMAT)
    plain.setdefault("version", __version__)
    atomic_torch_save(plain, Path(path))
    return Path(path)


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a dualseg checkpoint safely; every failure is a one-line :class:`CheckpointError`."""
    path = Path(path)
    if not path.is_file():
        what = "is a folder, not a checkpoint file" if path.is_dir() else "not found"
        raise CheckpointError(f"checkpoint {path} {what}; training writes <run_dir>/{LAST_NAME}")
    fix = "use another checkpoint of the run, or retrain"
    ckpt = safe_torch_load(path, what="checkpoint", fix=fix, map_location="cpu")
    fmt = str(ckpt.get("format") or "") if isinstance(ckpt, dict) else ""
    if not fmt:
        raise CheckpointError(f"{path} is not a dualseg checkpoint; {fix}")
    if fmt.startswith("dualseg-refiner-train"):
        raise CheckpointError(
            f"{path} is the training state of 'dualseg refine fit', not a model; continue it "
            "with refine fit --resume"
        )
    if fmt.startswith("dualseg-refiner"):
        raise CheckpointError(f"{path} is a method-B refiner, not a model: pass it as --refiner")
    if fmt != FORMAT or any(k not in ckpt for k in ("arch", "model_kwargs", "model")):
        raise CheckpointError(f"{path} has format {fmt!r} or lacks keys; dualseg reads {FORMAT!r}")
    ckpt["_path"] = str(path)
    return ckpt


# --------------------------------------------------------------------------- model and meta
def checkpoint_num_classes(ckpt: Mapping[str, Any]) -> int:
    """The checkpoint's class count (from ``model_kwargs``, else from its class names)."""
    kwargs = ckpt.get("model_kwargs")
    if isinstance(kwargs, Mapping) and "num_classes" in kwargs:
        return int(kwargs["num_classes"])
    return len(ckpt.get("class_names") or ())


def _where(ckpt: Mapping[str, Any]) -> str:
    """The file holding the description (a pretrained folder's ``config.json``, else the .pt)."""
    return str(ckpt.get("_meta_path") or ckpt.get("_path", "checkpoint"))


def check_compatible(
    ckpt: Mapping[str, Any],
    *,
    arch: str | None = None,
    num_classes: int | None = None,
    class_names: Sequence[str] | None = None,
) -> None:
    """Refuse ``ckpt`` when it is not of ``arch`` / ``num_classes`` / ``class_names`` (in order)."""
    problems = []
    if arch is not None and ckpt.get("arch") != arch:
        problems.append(f"architecture {ckpt.get('arch')!r} (expected {arch!r})")
    have = checkpoint_num_classes(ckpt)
    if num_classes is not None and have != num_classes:
        problems.append(f"{have} classes (expected {num_classes})")
    elif class_names and (saved := ckpt.get("class_names")) and list(saved) != list(class_names):
        problems.append(f"the classes {list(saved)} (the dataset's: {list(class_names)})")
    if problems:
        raise CheckpointError(
            f"{_where(ckpt)} does not fit this run: it holds {' and '.join(problems)}; "
            "resume from a checkpoint of the same model and dataset, or start a new run"
        )


def _state_dict_problems(model: nn.Module, state: Mapping[str, torch.Tensor]) -> list[str]:
    """Human-readable differences between a model's state dict and ``state``."""
    own = model.state_dict()
    found = {
        "missing": [k for k in own if k not in state],
        "unexpected": [k for k in state if k not in own],
        "shape": [
            f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
            for k in own
            if k in state and state[k].shape != own[k].shape
        ],
    }
    return [f"{len(keys)} {label}: {short_list(keys, 3)}" for label, keys in found.items() if keys]


def load_model_state(model: nn.Module, ckpt: Mapping[str, Any]) -> None:
    """``model.load_state_dict(ckpt["model"])`` with a one-line error instead of a traceback."""
    if problems := _state_dict_problems(model, ckpt["model"]):
        raise CheckpointError(
            f"{_where(ckpt)} ({ckpt.get('arch')!r} with {checkpoint_num_classes(ckpt)} classes) "
            f"does not match the model ({'; '.join(problems)}); use a checkpoint of this model"
        )
    if bad := nonfinite_keys(ckpt["model"]):  # such a model answers class 0 everywhere
        raise CheckpointError(
            f"{_where(ckpt)} holds NaN or infinite weights ({short_list(bad, 3)}): the "
            "training diverged; use an earlier checkpoint, or retrain with a lower optim.lr"
        )
    model.load_state_dict(ckpt["model"])


def placeholder_class_names(n: int) -> tuple[str, ...]:
    """``class_0`` ...: the names of a model that stores none (an exported one)."""
    return tuple(f"class_{i}" for i in range(n))


def _is_colour(rgb: Any) -> bool:
    return (
        isinstance(rgb, list | tuple)
        and len(rgb) == 3
        and all(type(c) is int and 0 <= c <= 255 for c in rgb)
    )


def meta_from_checkpoint(ckpt: Mapping[str, Any]) -> DatasetMeta:
    """The dataset description stored with a model (its label contract's), checked against the
    class names and palette beside it; a damaged entry is one error naming the file."""
    where, n, meta = _where(ckpt), checkpoint_num_classes(ckpt), contract_of(ckpt).meta
    names, palette = ckpt.get("class_names", meta.class_names), ckpt.get("palette", meta.palette)
    ignore = ckpt.get("ignore_index", 255)
    rules = {
        "class_names": (names, isinstance(names, list | tuple)
                        and all(isinstance(c, str) for c in names), "a list of one name per class"),
        "palette": (palette, isinstance(palette, list | tuple) and all(map(_is_colour, palette)),
                    "a list of one [r, g, b] in 0..255 per class"),
        "ignore_index": (ignore, type(ignore) is int and ignore == 255,
                         "255 (dualseg's ignore value)"),
    }  # fmt: skip
    for key, (value, ok, what) in rules.items():
        if not ok:
            raise CheckpointError(
                f"{where}: {key} must be {what}, got {value!r:.60}; save it again"
            )
    counts = {"class names": len(names), "palette colours": len(palette)}
    if wrong := [f"{count} {what}" for what, count in counts.items() if count != n]:
        raise CheckpointError(
            f"{where} describes {' and '.join(wrong)} for a model of {n} classes; save the "
            "model again with one class name and one colour per class"
        )
    if tuple(names) != meta.class_names:
        raise CheckpointError(f"{where}: its label contract names other classes; save it again")
    return meta


def contract_of(ckpt: Mapping[str, Any]) -> LabelContract:
    """The label contract (how the training data's labels were read) stored with the model."""
    if (stored := ckpt.get("label_contract")) is None:
        raise CheckpointError(
            f"{_where(ckpt)} stores no label contract; train the model again or save it again "
            "with save_pretrained"
        )
    try:
        return LabelContract.from_dict(dict(stored) if isinstance(stored, Mapping) else stored)
    except (DataError, ValueError, TypeError) as err:
        raise CheckpointError(
            f"{_where(ckpt)}: its label contract is invalid ({err}); save the model again"
        ) from None


def build_model_from_checkpoint(
    ckpt: Mapping[str, Any], *, device: str | torch.device = "cpu"
) -> tuple[nn.Module, DatasetMeta]:
    """Rebuild the checkpoint's model (eval mode, on ``device``) and its dataset description."""
    where, name, kwargs = _where(ckpt), ckpt["arch"], ckpt.get("model_kwargs")
    if not isinstance(kwargs, Mapping):
        raise CheckpointError(f"{where}: model_kwargs must be a dict, got {kwargs!r:.40}")
    if unknown := sorted(str(k) for k in kwargs if k not in signature(build_model).parameters):
        raise CheckpointError(
            f"{where}: model_kwargs holds option(s) {', '.join(unknown)} that this dualseg does "
            "not know; upgrade dualseg or save the model with this version"
        )
    meta = meta_from_checkpoint(ckpt)  # before the build: a bad description fails fast
    if not isinstance(name, str) or name not in MODELS:
        raise CheckpointError(f"{where} names architecture {name!r}, which dualseg does not know")
    try:  # the checkpoint carries the weights: never resolve files here
        model = build_model(name, **{"num_classes": meta.num_classes, **kwargs, "weights": None})
    except (TypeError, ValueError) as err:
        raise CheckpointError(
            f"{where}: its model_kwargs do not build {name!r} ({' '.join(str(err).split())})"
        ) from None
    load_model_state(model, ckpt)
    return model.to(device).eval(), meta


def check_normalization(state: Mapping[str, Any]) -> None:
    """Refuse a model whose stored input normalization is not ImageNet's (what dualseg applies)."""
    norm = state.get("normalization") or {}
    for key, value in (("mean", IMAGENET_MEAN), ("std", IMAGENET_STD)):
        if (have := norm.get(key)) is None:
            continue
        try:
            same = [round(float(v), 6) for v in have] == [round(v, 6) for v in value]
        except (TypeError, ValueError):
            same = False
        if not same:
            raise CheckpointError(
                f"{_where(state)}: the model expects input normalization {key}={have}, dualseg "
                f"applies {list(value)}; normalize the input yourself and call Segmenter.model"
            )
