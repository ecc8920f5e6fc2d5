"""Base models for method B (P2): anything that gives class scores for an image."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from dualseg.engine.checkpoint import contract_of
from dualseg.engine.distributed import resolve_device
from dualseg.engine.pretrained import is_hub_source, is_pretrained_folder, load_network
from dualseg.errors import ConfigError, DataError, DualsegError
from dualseg.imaging import read_image, rgb_digest
from dualseg.models.base import eval_mode
from dualseg.refine.config import RefinerConfig
from dualseg.refine.taps import base_logits, is_py_spec, list_taps, pick_taps


class BaseModel(Protocol):
    class_names: tuple[str, ...] | None
    palette: tuple[tuple[int, int, int], ...] | None

    def scores(
        self, images: Tensor, names: Sequence[str], sources: Sequence[str] | None = None
    ) -> Tensor: ...


class ModuleBase:
    """A segmentation ``nn.Module`` (or callable), run in eval mode without gradients and given
    back in its own mode."""

    def __init__(
        self, module: nn.Module | Any, *, class_names: Sequence[str] | None = None,
        palette: Sequence[tuple[int, int, int]] | None = None, device: str | torch.device = "cpu",
    ) -> None:  # fmt: skip
        self.device = resolve_device(device)
        self.module = module.to(self.device) if isinstance(module, nn.Module) else module
        self.class_names = tuple(class_names) if class_names is not None else None
        self.palette = tuple(tuple(c) for c in palette) if palette is not None else None

    @torch.no_grad()
    def scores(
        self, images: Tensor, names: Sequence[str] = (), sources: Sequence[str] | None = None
    ) -> Tensor:
        """Logits at the image size; ``names`` / ``sources`` are not needed by a model."""
        module = self.module if isinstance(self.module, nn.Module) else None
        with eval_mode(module) if module is not None else contextlib.nullcontext():
            return base_logits(self.module, images.to(self.device))


def model_fingerprint(module: nn.Module) -> str:
    """A short hash of a model's weights: the base a refiner's decision was calibrated on."""
    digest = hashlib.sha256()
    for key, tensor in module.state_dict().items():
        digest.update(f"{key}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


# what eval --refiner and refine apply say of a refiner calibrated on another base model
OTHER_BASE = (
    "{refiner}'s decision options (gate, prior, floor, switch cost) were chosen on another base "
    "model than this one; refit it with --base this model and --calibrate-split for options "
    "that fit it"
)


def other_calibration_base(refiner: Any, module: Any) -> bool:
    """Whether ``refiner``'s decision was calibrated on another base than ``module`` (False
    when unknown: no fingerprint stored, or no PyTorch module, e.g. an ONNX session)."""
    calibrated = (getattr(refiner, "calibration", None) or {}).get("base_fingerprint")
    known = isinstance(module, nn.Module)
    return bool(calibrated) and known and calibrated != model_fingerprint(module)


def pairing_notes(refiner: Any, module: Any, refiner_name: str) -> list[str]:
    """What to say before ``refiner`` runs on ``module`` (checked already): its decision chosen
    on another base, a held-out check at fit time that found it did not help."""
    notes: list[str] = []
    if other_calibration_base(refiner, module):
        notes.append(f"warning: {OTHER_BASE.format(refiner=refiner_name)}")
    if text := refiner.calibration_note():
        notes.append(f"note: {text}")
    return notes


def checkpoint_base(
    path: str | os.PathLike[str], *, device: str | torch.device = "cpu"
) -> ModuleBase:
    """A dualseg checkpoint, pretrained folder or ``hf://org/name`` as a base model."""
    model, meta, ckpt = load_network(path, device=device)  # fed ImageNet-normalized images
    base = ModuleBase(model, class_names=meta.class_names, palette=meta.palette, device=device)
    # how its training read the labels: refine fit reads the refiner's the same way
    base.trained_data = dict((ckpt.get("config") or {}).get("data") or {})  # type: ignore[attr-defined]
    base.contract = contract_of(ckpt)  # type: ignore[attr-defined]
    return base


class ProbsFolderBase:
    """Saved probability maps (``dualseg predict --probs``): ``<folder>/<name>.npz`` or
    ``<folder>/probs/<name>.npz``."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        folder = Path(folder)
        self.folder = folder / "probs" if (folder / "probs").is_dir() else folder
        files = sorted(self.folder.rglob("*.npz"))
        if not files:
            raise DataError(f"{folder}: no .npz probability maps ('dualseg predict --probs')")
        self.sources: dict[str, str | None] = {}  # output name -> stored source image path
        self.digests: dict[str, str] = {}  # output name -> its image's rgb_digest, if stored
        self.class_names: tuple[str, ...] | None = None
        for path in files:
            data = self._read(path, keys=("class_names", "source", "image_sha1"))
            name = path.relative_to(self.folder).with_suffix("").as_posix()
            self.sources[name] = str(data["source"]) if "source" in data else None
            if "image_sha1" in data:
                self.digests[name] = str(data["image_sha1"])
            classes = tuple(map(str, data["class_names"])) if "class_names" in data else None
            if path == files[0]:
                self.class_names = classes
            elif classes != self.class_names:
                raise DataError(
                    f"{path} holds classes {classes} but {files[0]} holds "
                    f"{self.class_names}: keep one model's probabilities per folder"
                )
        self.palette = None

    def _read(self, path: Path, keys: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        try:
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files if keys is None or k in keys}
        except Exception as err:  # numpy raises zipfile.BadZipFile, EOFError, TypeError, ...
            raise DataError(
                f"{path}: not a readable probability file ({type(err).__name__}: {err}); "
                "write it again with 'dualseg predict --probs'"
            ) from err

    def _find(self, name: str, source: str | None) -> Path:
        """The map of image ``name`` (at path ``source`` when known)."""
        if source is not None:
            here = Path(source)
            digest = functools.cache(lambda: rgb_digest(read_image(here)))

            def match(stored: str, stored_digest: str | None) -> bool:
                """The same file when both exist, else the same pixels when the map has a
                digest (a bare ``x.png`` must not match a gone ``A/x.png``), else by path."""
                if stored_digest is None or Path(stored).exists() or not here.is_file():
                    return same_file(stored, source)
                return digest() == stored_digest

            by_source = [n for n, s in self.sources.items() if s and match(s, self.digests.get(n))]
            if len(by_source) == 1:
                return self.folder / f"{by_source[0]}.npz"
            stored = self.sources.get(name)
            if stored and not match(stored, self.digests.get(name)):
                raise DataError(
                    f"{self.folder / name}.npz holds the probabilities of {stored}, not of "
                    f"{source}; pass the folder predicted for these images"
                )
        elif self.sources.get(name):
            # predict names a second x.png "x_1": such a pair is ambiguous by name alone
            file_name = Path(self.sources[name] or "").name
            sharing = sorted(
                n
                for n, s in self.sources.items()
                if n == name
                or (s and Path(s).name == file_name and (_numbered(n, name) or _numbered(name, n)))
            )
            if len(sharing) > 1:
                raise DataError(
                    f"{self.folder}: {', '.join(f'{n}.npz' for n in sharing)} all hold "
                    f"probabilities of images named {file_name}: give the images' paths (sources)"
                )
        path = self.folder / f"{name}.npz"
        if not path.is_file():
            raise DataError(f"no probabilities for image {source or name!r}: {path} is missing")
        return path

    def require(self, names: Sequence[str], sources: Sequence[str]) -> None:
        """Refuse, before any work, the first of these images without a map here."""
        for name, source in zip(names, sources):
            self._find(name, str(source))

    def scores(
        self, images: Tensor, names: Sequence[str], sources: Sequence[str] | None = None
    ) -> Tensor:
        out = []
        for i, name in enumerate(names):
            path = self._find(name, None if sources is None else str(sources[i]))
            data = self._read(path)
            if "probs" not in data or data["probs"].ndim != 3:
                raise DataError(f"{path}: expected key 'probs' holding [C,H,W] probabilities")
            probs = torch.from_numpy(data["probs"].astype(np.float32))
            if probs.shape[-2:] != images.shape[-2:]:
                raise DataError(
                    f"{path}: probabilities are {probs.shape[2]}x{probs.shape[1]} but the image "
                    f"is {images.shape[-1]}x{images.shape[-2]} (WxH)"
                )
            out.append(probs)
        return torch.stack(out).to(images.device)


def _numbered(name: str, stem: str) -> bool:
    """``name`` is ``stem`` with predict's ``_<k>`` de-duplication suffix."""
    return name.startswith(f"{stem}_") and name[len(stem) + 1 :].isdigit()


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """The same file on disk when both exist, else one path a trailing part of the other."""
    pa, pb = Path(a), Path(b)
    if pa.exists() and pb.exists():
        return os.path.samefile(pa, pb)
    short, long = sorted((pa.parts, pb.parts), key=len)
    short = tuple(p for p in short if p not in (".", ""))
    return bool(short) and long[len(long) - len(short) :] == short


def python_model(spec: str, *, flag: str = "--base") -> nn.Module:
    """The ``nn.Module`` (or a function of no arguments returning it) ``file.py:NAME`` or
    ``package.module:NAME`` names; errors name it as ``flag``."""
    where, name = spec.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            if not Path(where).is_file():
                raise ConfigError(f"{flag} {spec}: no file {where}")
            loader = importlib.util.spec_from_file_location(Path(where).stem, where)
            module = importlib.util.module_from_spec(loader)  # type: ignore[arg-type]
            loader.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(where)
        obj = getattr(module, name)
        model = obj if isinstance(obj, nn.Module) or not callable(obj) else obj()
    except ConfigError:
        raise
    except Exception as err:  # the user's code: any error, said in one line
        raise ConfigError(f"{flag} {spec}: {type(err).__name__}: {err}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{flag} {spec} gives a {type(model).__name__}, not a torch nn.Module")
    return model


def load_base(
    base: str | os.PathLike[str] | nn.Module | BaseModel,
    *,
    device: str | torch.device = "cpu",
    class_names: Sequence[str] | None = None,
) -> BaseModel:
    """Any accepted base (module or callable, checkpoint, pretrained folder or ``hf://``,
    probability folder, ``file.py:NAME``) as a :class:`BaseModel`."""
    if isinstance(base, nn.Module) or (callable(base) and not hasattr(base, "scores")):
        return ModuleBase(base, class_names=class_names, device=device)
    if hasattr(base, "scores"):
        return base  # type: ignore[return-value]

    if isinstance(base, str) and is_py_spec(base) and not is_hub_source(base):
        return ModuleBase(python_model(base), class_names=class_names, device=device)
    if is_hub_source(base) or is_pretrained_folder(base):  # type: ignore[arg-type]
        return checkpoint_base(base, device=device)  # type: ignore[arg-type]
    path = Path(base)  # type: ignore[arg-type]
    if path.is_dir():
        return ProbsFolderBase(path)
    return checkpoint_base(path, device=device)


def describe_layers(spec: str, size: Sequence[int]) -> str:
    """``refine layers``: the feature-map modules of base ``spec`` on a blank sample, a table."""
    model = getattr(load_base(spec), "module", None)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--base {spec} holds saved probabilities, not a model")
    try:
        taps = list_taps(model, torch.zeros(1, 3, *size))
    except DualsegError:
        raise
    except Exception as err:  # the user's model on a blank image
        raise ConfigError(
            f"the base model failed on a 1x3x{size[0]}x{size[1]} sample "
            f"({type(err).__name__}: {err}); try another --size"
        ) from None
    lines = [f"{'module':<44} {'channels':>8} {'stride':>6}  size"]
    lines += [f"{t.name:<44} {t.channels:>8} {t.stride:>6}  {t.size[0]}x{t.size[1]}" for t in taps]
    picked = pick_taps(model, taps, high_stride=RefinerConfig.output_stride)  # fit's default
    lines.append(
        f"suggested: --base-features {picked[0]} {picked[1]} (or --base-features auto)"
        if picked
        else "no taps picked for this layout: choose LOW (stride 4) and HIGH (stride 16)"
    )
    return "\n".join(lines)
