"""Checkpoints: one plain dict, written atomically, loaded with ``weights_only=True``.

A checkpoint names its network by ``arch`` (a ``dualseg.models.MODELS`` key) and
``model_kwargs`` (``build_model``'s options), so any checkpoint rebuilds its own model; the
training state beside it (optimizer, scheduler, sampler, RNG states, config, class names,
palette) lets ``--resume`` continue exactly. Every value is a plain container, tensor, number
or string (:func:`to_plain`), so the safe loader accepts it.
"""

from __future__ import annotations

import inspect
import numbers
import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from dualseg._version import __version__
from dualseg.data import PRESETS, DatasetMeta, parse_label_map, with_label_mapping
from dualseg.data.contract import LabelContract
from dualseg.errors import CheckpointError, DataError
from dualseg.imaging import IMAGENET_MEAN, IMAGENET_STD
from dualseg.io import atomic_torch_save
from dualseg.models import MODELS, build_model
from dualseg.serialization import nonfinite_keys, safe_torch_load, short_list
from dualseg.viz import default_palette

if TYPE_CHECKING:  # pragma: no cover
    from dualseg.data import DatasetMeta
    from dualseg.data.contract import LabelContract

FORMAT = "dualseg-checkpoint/1"
REQUIRED_KEYS = ("format", "arch", "model_kwargs", "model")
LAST_NAME = "last.pt"
BEST_NAME = "best.pt"


# --------------------------------------------------------------------------- plain containers
def to_plain(obj: Any) -> Any:
    """``obj`` in types ``torch.load(weights_only=True)`` accepts (numpy -> tensors and
    numbers, paths -> str; ``OrderedDict`` state dicts are kept)."""
    if isinstance(obj, torch.Tensor | str | bytes | bool | int | float | type(None)):
        return obj
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, Mapping):
        plain = {k: to_plain(v) for k, v in obj.items()}
        return type(obj)(plain) if type(obj).__name__ == "OrderedDict" else plain
    if isinstance(obj, tuple):
        return tuple(to_plain(v) for v in obj)
    if isinstance(obj, list | set | frozenset):
        return [to_plain(v) for v in obj]
    if isinstance(obj, torch.device | torch.dtype):
        return str(obj)
    raise TypeError(
        f"cannot store a {type(obj).__name__} in a checkpoint: only plain containers, tensors, "
        "numbers and strings load with weights_only=True"
    )


# --------------------------------------------------------------------------- RNG states
def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch (CPU) and CUDA RNG states as plain values."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),  # (version, tuple[int, ...], gauss) — plain tuples
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state` (CUDA states are restored when the counts match)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": n["bit_generator"],
            "state": {"key": n["key"].numpy().astype(np.uint32), "pos": int(n["pos"])},
            "has_gauss": int(n["has_gauss"]),
            "gauss": float(n["gauss"]),
        }
    )
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda])


# --------------------------------------------------------------------------- save / load
def save_checkpoint(path: str | os.PathLike[str], state: Mapping[str, Any]) -> Path:
    """Write ``state`` (with ``format`` and ``version``) to ``path`` atomically."""
    missing = [k for k in ("arch", "model_kwargs", "model") if k not in state]
    if missing:
        raise ValueError(f"checkpoint state lacks required keys {missing}")
    plain = to_plain({k: v for k, v in state.items() if k != "_path"})
    plain.setdefault("format", FORMAT)
    plain.setdefault("version", __version__)
    path = Path(path)
    atomic_torch_save(plain, path)
    return path


def load_checkpoint(
    path: str | os.PathLike[str], *, map_location: str | torch.device = "cpu"
) -> dict[str, Any]:
    """Load a dualseg checkpoint safely; every failure is a one-line :class:`CheckpointError`."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"checkpoint not found: {path} (check the path; training writes "
            f"<run_dir>/{LAST_NAME} and <run_dir>/{BEST_NAME})"
        )
    if path.is_dir():
        raise CheckpointError(
            f"{path} is a folder, not a checkpoint file (pass {path / LAST_NAME} or "
            f"{path / BEST_NAME})"
        )
    ckpt = safe_torch_load(
        path,
        what="checkpoint",
        fix=f"use another checkpoint (e.g. {BEST_NAME} or {LAST_NAME} of the run) or retrain",
        map_location=map_location,
    )
    if not isinstance(ckpt, dict) or "format" not in ckpt:
        hint = ""
        if (
            isinstance(ckpt, dict)
            and ckpt
            and all(isinstance(v, torch.Tensor) for v in ckpt.values())
        ):
            hint = (
                " — it looks like a bare state dict: backbone weights go to training "
                "(--model.weights FILE); a whole network's, to build_model(...) in Python"
            )
        raise CheckpointError(f"{path} is not a dualseg checkpoint (no 'format' key){hint}")
    if str(ckpt["format"]).startswith("dualseg-refiner-train"):
        raise CheckpointError(
            f"{path} is the training state of 'dualseg refine fit', not a model checkpoint: "
            "continue that fit with 'refine fit --resume', or use the refiner it wrote "
            "(its --out) as --refiner"
        )
    if str(ckpt["format"]).startswith("dualseg-refiner"):
        raise CheckpointError(
            f"{path} is a method-B refiner, not a model checkpoint: pass it as --refiner "
            "(and the model checkpoint as --checkpoint, or --base for 'dualseg refine')"
        )
    if ckpt["format"] != FORMAT:
        raise CheckpointError(
            f"{path} has checkpoint format {ckpt['format']!r}, this dualseg reads {FORMAT!r}; "
            "use the dualseg version that wrote it"
        )
    missing = [k for k in REQUIRED_KEYS if k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} is an incomplete dualseg checkpoint: missing {missing}")
    ckpt["_path"] = str(path)
    return ckpt


# --------------------------------------------------------------------------- model and meta
def checkpoint_num_classes(ckpt: Mapping[str, Any]) -> int:
    """The checkpoint's class count (from ``model_kwargs``, else from its class names)."""
    kwargs = ckpt.get("model_kwargs")
    if isinstance(kwargs, Mapping) and "num_classes" in kwargs:
        return int(kwargs["num_classes"])
    return len(ckpt.get("class_names") or ())


def _name(ckpt: Mapping[str, Any]) -> str:
    return str(ckpt.get("_path", "checkpoint"))


def _meta_name(ckpt: Mapping[str, Any]) -> str:
    """The file holding the description (a pretrained folder's ``config.json``, else the .pt)."""
    return str(ckpt.get("_meta_path") or _name(ckpt))


def check_compatible(
    ckpt: Mapping[str, Any],
    *,
    arch: str | None = None,
    num_classes: int | None = None,
    class_names: Sequence[str] | None = None,
) -> None:
    """Raise :class:`CheckpointError` when ``ckpt`` is not of ``arch`` / ``num_classes`` /
    ``class_names`` (the names in order: the same count under other names, or in another
    order, would go on training each output channel as another class)."""
    problems = []
    if arch is not None and ckpt.get("arch") != arch:
        problems.append(f"architecture {ckpt.get('arch')!r} (expected {arch!r})")
    have = checkpoint_num_classes(ckpt)
    if num_classes is not None and have != num_classes:
        problems.append(f"{have} classes (expected {num_classes})")
    saved = ckpt.get("class_names")
    renamed = class_names is not None and saved and list(saved) != list(class_names)
    if renamed and (num_classes is None or have == num_classes):  # a count mismatch says more
        problems.append(f"the classes {list(saved)} (the dataset's: {list(class_names)})")
    if problems:
        raise CheckpointError(
            f"{_name(ckpt)} does not fit this run: it holds {' and '.join(problems)}; "
            "resume from a checkpoint of the same model and dataset, or start a new run"
        )


def _state_dict_problems(model: nn.Module, state: Mapping[str, torch.Tensor]) -> list[str]:
    """Human-readable differences between a model's state dict and ``state`` (no exception)."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in state and tuple(state[k].shape) != tuple(own[k].shape)
    ]
    out = []
    for label, keys in (("missing", missing), ("unexpected", unexpected), ("shape", shapes)):
        if keys:
            out.append(f"{len(keys)} {label}: {short_list(keys, 3)}")
    return out


def load_model_state(model: nn.Module, ckpt: Mapping[str, Any]) -> None:
    """``model.load_state_dict(ckpt["model"])`` with a clear error instead of a stack trace."""
    problems = _state_dict_problems(model, ckpt["model"])
    if problems:
        raise CheckpointError(
            f"{_name(ckpt)} does not match the model: checkpoint arch {ckpt.get('arch')!r} with "
            f"{checkpoint_num_classes(ckpt)} classes, model {type(model).__name__} "
            f"({'; '.join(problems)}); use a checkpoint of this architecture and class count"
        )
    # such a model answers class 0 everywhere, without an error anywhere after
    if bad := nonfinite_keys(ckpt["model"]):
        raise CheckpointError(
            f"{_name(ckpt)} holds NaN or infinite weights ({short_list(bad, 3)}): the "
            "training diverged before it was saved; use an earlier checkpoint, or retrain with "
            "a lower optim.lr"
        )
    model.load_state_dict(ckpt["model"])


def _is_colour(rgb: Any) -> bool:
    return (
        isinstance(rgb, list | tuple)
        and len(rgb) == 3
        and all(isinstance(c, numbers.Integral) and not isinstance(c, bool) for c in rgb)
        and all(0 <= c <= 255 for c in rgb)
    )


def placeholder_class_names(n: int) -> tuple[str, ...]:
    """The names a checkpoint that stores none is given on loading: ``class_0`` ..."""
    return tuple(f"class_{i}" for i in range(n))


def meta_from_checkpoint(ckpt: Mapping[str, Any]) -> DatasetMeta:
    """The dataset description stored in a checkpoint (class names, palette, ignore index)."""
    n = checkpoint_num_classes(ckpt)
    names, palette = ckpt.get("class_names"), ckpt.get("palette")
    for key, value in (("class_names", names), ("palette", palette)):
        if value is not None and not isinstance(value, list | tuple):  # "road" is no list
            raise CheckpointError(
                f"{_meta_name(ckpt)}: {key} must be a list, got {type(value).__name__} "
                f"{value!r:.40}; save the model again"
            )
    if names and not all(isinstance(c, str) for c in names):
        raise CheckpointError(
            f"{_meta_name(ckpt)}: class_names must be strings, got {list(names)!r:.60}; save "
            "the model again"
        )
    names = tuple(names or placeholder_class_names(n))
    palette = palette or default_palette(n)
    counts = {"class names": len(names), "palette colours": len(palette)}
    wrong = [f"{count} {what}" for what, count in counts.items() if count != n]
    if wrong:
        raise CheckpointError(
            f"{_meta_name(ckpt)} describes {' and '.join(wrong)} for a model of {n} classes; "
            "save the model again with one class name and one colour per class"
        )
    bad_colours = [rgb for rgb in palette if not _is_colour(rgb)]
    if bad_colours:
        raise CheckpointError(
            f"{_meta_name(ckpt)}: palette colours must be [r, g, b] in 0..255, got "
            f"{bad_colours[0]!r}; save the model again"
        )
    ignore = ckpt.get("ignore_index", 255)
    if not isinstance(ignore, numbers.Integral) or isinstance(ignore, bool):
        raise CheckpointError(
            f"{_meta_name(ckpt)}: ignore_index must be an integer, got {ignore!r}; save the "
            "model again"
        )
    if ignore != 255:  # labels are mapped to 255 when read; DatasetMeta would blame the data
        raise CheckpointError(
            f"{_meta_name(ckpt)}: ignore_index must be 255 (the ignore value dualseg maps every "
            f"dataset's to), got {ignore}; save the model again"
        )
    config = ckpt.get("config") or {}
    data_cfg = config.get("data") if isinstance(config, Mapping) else None
    name = (data_cfg or {}).get("preset") or "checkpoint"
    meta = DatasetMeta(
        name=str(name),
        class_names=names,
        palette=tuple(tuple(int(c) for c in rgb) for rgb in palette),
        ignore_index=int(ignore),
    )
    if "label_contract" not in ckpt:
        return meta
    contract = contract_of(ckpt)
    if contract.meta.class_names != meta.class_names:
        raise CheckpointError(
            f"{_meta_name(ckpt)}: its label contract names the classes "
            f"{list(contract.meta.class_names)}, the model {list(meta.class_names)}; save the "
            "model again"
        )
    return contract.meta


def contract_of(ckpt: Mapping[str, Any]) -> LabelContract:
    """The label contract stored with the model (``label_contract``). A checkpoint made
    without one gets the contract its description implies: its class names and palette (a
    preset's own mapping when it names one with these classes), read as its training config's
    ``data.label_format`` / ``label_map`` / ``ignore_index`` / ``bit_depth`` say."""
    stored = ckpt.get("label_contract")
    try:
        if stored is not None:
            return LabelContract.from_dict(dict(stored) if isinstance(stored, Mapping) else stored)
        meta = meta_from_checkpoint(ckpt)
        if meta.name in PRESETS and PRESETS[meta.name].class_names == meta.class_names:
            meta = PRESETS[meta.name]  # the preset also knows the raw ignore values (CamVid: 11)
        data = (ckpt.get("config") or {}).get("data") or {}
        mapping = parse_label_map(data["label_map"]) if data.get("label_map") else None
        meta = with_label_mapping(
            meta, label_map=mapping, ignore_value=data.get("ignore_index", "auto")
        )
        return LabelContract(meta, data.get("label_format") or "index", data.get("bit_depth"))
    except (DataError, ValueError, TypeError) as err:
        raise CheckpointError(
            f"{_meta_name(ckpt)}: its label contract is invalid ({err}); save the model again"
        ) from None


def model_kwargs_of(ckpt: Mapping[str, Any]) -> dict[str, Any]:
    """``ckpt["model_kwargs"]`` as a dict of :func:`dualseg.models.build_model` options; a
    non-dict or an option this dualseg does not know (a newer version's) is a
    :class:`CheckpointError` naming the file and the keys."""
    kwargs = ckpt.get("model_kwargs")
    if not isinstance(kwargs, Mapping):
        raise CheckpointError(
            f"{_meta_name(ckpt)}: model_kwargs must be a dict of model options, got "
            f"{type(kwargs).__name__}; save the model again"
        )
    known = set(inspect.signature(build_model).parameters) - {"name"}
    unknown = sorted(str(k) for k in kwargs if k not in known)
    if unknown:
        raise CheckpointError(
            f"{_meta_name(ckpt)}: model_kwargs holds option(s) {', '.join(unknown)} that this "
            "dualseg does not know (written by a newer version?); upgrade dualseg or save the "
            "model with this version"
        )
    return dict(kwargs)


def build_model_from_checkpoint(
    ckpt: Mapping[str, Any],
    *,
    device: str | torch.device = "cpu",
    arch: str | None = None,
    num_classes: int | None = None,
) -> tuple[nn.Module, DatasetMeta]:
    """Rebuild the checkpoint's model (eval mode, on ``device``) and its dataset description;
    ``arch`` / ``num_classes``: what the caller expects (another is a CheckpointError)."""
    kwargs = model_kwargs_of(ckpt)
    check_compatible(ckpt, arch=arch, num_classes=num_classes)
    meta = meta_from_checkpoint(ckpt)  # before the build: a bad description fails fast
    name = ckpt["arch"]
    if not isinstance(name, str) or name not in MODELS:
        raise CheckpointError(
            f"{_meta_name(ckpt)} names architecture {name!r}, which this dualseg does not know "
            f"(known: {', '.join(sorted(MODELS))})"
        )
    kwargs["weights"] = None  # the checkpoint carries the weights; never resolve files here
    kwargs.setdefault("num_classes", meta.num_classes)  # a checkpoint naming only its classes
    try:
        model = build_model(name, **kwargs)
    except (TypeError, ValueError) as err:  # a stored option of the wrong type or value
        detail = " ".join(str(err).split())
        raise CheckpointError(
            f"{_name(ckpt)}: its model_kwargs do not build {name!r} ({detail}); it was written "
            "by other code, or edited: save the model again with dualseg"
        ) from None
    load_model_state(model, ckpt)
    return model.to(device).eval(), meta


def check_normalization(state: Mapping[str, Any]) -> None:
    """Refuse a model whose stored input normalization differs from ImageNet's, what every
    dualseg path that runs a loaded model applies."""
    norm = state.get("normalization") or {}
    want = {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)}
    where = state.get("_meta_path") or state.get("_path")
    for key, value in want.items():
        have = norm.get(key)
        if have is None:
            continue
        try:
            stored = [round(float(v), 6) for v in have]
        except (TypeError, ValueError):
            raise CheckpointError(
                f"{where}: normalization {key} must be a list of numbers, got {have!r}; save "
                "the model again"
            ) from None
        if stored != [round(float(v), 6) for v in value]:
            raise CheckpointError(
                f"{where}: the model expects input "
                f"normalization {key}={have}, dualseg applies {value}; convert the model, or "
                "normalize the input yourself and call the network (Segmenter.model) directly"
            )


def find_resume_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """``<run_dir>/last.pt`` when present (what ``--resume auto`` picks), else ``None``."""
    path = Path(run_dir) / LAST_NAME
    return path if path.is_file() else None
