"""``build_model(name, *, num_classes, ...)``: every architecture by name, from plain values.

Checkpoints store ``arch`` and ``model_kwargs``, so ``build_model(arch, **model_kwargs)``
rebuilds the network; its signature is the one place each option's default is written.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from dualseg.errors import ConfigError
from dualseg.models.backbones import (
    WeightsArg,
    backbone_state_dict,
    backbone_weights_name,
    build_backbone,
)
from dualseg.models.deeplab import DeepLabV3
from dualseg.models.dualbranch import Branch, DualBranchNet

__all__ = ["MODELS", "backbone_of", "build_model"]


def build_dualseg(
    backbone: str,
    *,
    num_classes: int,
    weights: WeightsArg,
    allow_download: bool,
    output_stride: int,
    in_channels: int,
    gray_branch: bool,
    gray_conv_init: str,
    fusion: str,
    coord_channels: bool,
    coord_radius: str,
    renet_layers: int,
    renet_hidden: int,
    renet_patch: int,
    renet_init: str,
    renet_init_bound: float | None,
    renet_norm: str,
    renet_skip: bool,
    aspp_rates: tuple[int, ...],
    aspp_style: str,
    aspp_init_std: float,
    upsample_order: str,
    timm_model: str,
) -> DualBranchNet:
    """Method A (spec S2): an RGB branch and, unless ``gray_branch=False``, a 1-channel one."""
    if backbone == "timm":
        backbone = f"timm:{timm_model}"
    if gray_branch and in_channels != 3:
        raise ConfigError(
            f"the grayscale branch needs RGB input (in_channels=3, got {in_channels}); "
            "set gray_branch=False for other inputs"
        )
    state = None
    if weights is not None:  # read the file once, copy it into both branches
        state = backbone_state_dict(
            backbone_weights_name(backbone), weights, allow_download=allow_download
        )

    def branch(channels: int) -> Branch:
        body, body_channels = build_backbone(
            backbone,
            in_channels=channels,
            output_stride=output_stride,
            weights=state,
            first_conv_reduce=gray_conv_init,
        )
        return Branch(
            body,
            body_channels,
            num_classes,
            coord_channels=coord_channels,
            coord_radius=coord_radius,
            renet_layers=renet_layers,
            renet_hidden=renet_hidden,
            renet_patch=renet_patch,
            renet_init=renet_init,
            renet_init_bound=renet_init_bound,
            renet_norm=renet_norm,
            renet_skip=renet_skip,
            aspp_rates=aspp_rates,
            aspp_style=aspp_style,
            aspp_init_std=aspp_init_std,
        )

    return DualBranchNet(
        branch(in_channels),
        branch(1) if gray_branch else None,
        num_classes,
        output_stride=output_stride,
        fusion=fusion,
        upsample_order=upsample_order,
        in_channels=in_channels,
    )


def build_deeplabv3(
    backbone: str,
    *,
    num_classes: int,
    weights: WeightsArg,
    allow_download: bool,
    output_stride: int,
    in_channels: int,
    deeplab_rates: tuple[int, ...] | None,
) -> DeepLabV3:
    """The peer: torchvision's DeepLabV3 head on the same dilated backbone."""
    body, channels = build_backbone(
        backbone,
        in_channels=in_channels,
        output_stride=output_stride,
        weights=weights,
        allow_download=allow_download,
    )
    return DeepLabV3(
        body,
        channels,
        num_classes,
        output_stride=output_stride,
        rates=deeplab_rates,
        in_channels=in_channels,
    )


MODELS: dict[str, Callable[..., nn.Module]] = {
    "dualseg_resnet18": functools.partial(build_dualseg, "resnet18"),
    "dualseg_resnet34": functools.partial(build_dualseg, "resnet34"),
    "dualseg_resnet50": functools.partial(build_dualseg, "resnet50"),
    "dualseg_resnet101": functools.partial(build_dualseg, "resnet101"),
    "dualseg_mobilenet_v2": functools.partial(build_dualseg, "mobilenet_v2"),
    "dualseg_timm": functools.partial(build_dualseg, "timm"),
    "deeplabv3_resnet18": functools.partial(build_deeplabv3, "resnet18"),
    "deeplabv3_resnet50": functools.partial(build_deeplabv3, "resnet50"),
    "deeplabv3_resnet101": functools.partial(build_deeplabv3, "resnet101"),
    "deeplabv3_mobilenet_v2": functools.partial(build_deeplabv3, "mobilenet_v2"),
}


def build_model(
    name: str,
    *,
    num_classes: int,
    weights: str | os.PathLike[str] | None = None,
    output_stride: int = 8,
    gray_branch: bool = True,
    coord_channels: bool = True,
    renet_layers: int = 2,
    renet_hidden: int = 150,
    aspp_rates: Sequence[int] = (4, 6, 8, 12),
    in_channels: int = 3,
    fusion: str = "scalar",
    coord_radius: str = "scaled",
    renet_patch: int = 1,
    renet_init: str = "scaled",
    renet_init_bound: float | None = None,
    renet_norm: str = "none",
    renet_skip: bool = False,
    aspp_style: str = "v2",
    aspp_init_std: float = 0.01,
    upsample_order: str = "softmax_first",
    gray_conv_init: str = "sum",
    deeplab_rates: Sequence[int] | None = None,
    timm_model: str = "efficientnet_lite0",
    allow_download: bool = False,
) -> nn.Module:
    """Build the model ``name`` (a key of :data:`MODELS`); defaults: docs/models.md.

    ``weights``: None, ``"imagenet"`` (downloaded only with ``allow_download=True``) or a
    backbone state-dict file. An option that does not apply to ``name`` must keep its default;
    one another option switches off (``renet_*`` with ``renet_layers=0``) gives a warning.
    """
    options = {k: v for k, v in locals().items() if k in _DEFAULTS}
    _check(name, num_classes, weights, options)
    # JSON (checkpoints, YAML) turns tuples into lists: tuples from here on
    options["aspp_rates"] = tuple(aspp_rates)
    options["deeplab_rates"] = None if deeplab_rates is None else tuple(deeplab_rates)
    builder = MODELS[name]
    wanted = inspect.signature(builder.func).parameters
    return builder(
        num_classes=num_classes,
        weights=os.fspath(weights) if isinstance(weights, os.PathLike) else weights,
        **{k: v for k, v in options.items() if k in wanted},
    )


# every model option's default, read from build_model's signature (written only there)
_DEFAULTS: dict[str, Any] = {
    k: p.default
    for k, p in inspect.signature(build_model).parameters.items()
    if p.default is not inspect.Parameter.empty and k != "weights"
}
# option -> (the option, and its value, that switches it off): accepted, and said
_SWITCHED_OFF = {
    "fusion": ("gray_branch", False),
    "gray_conv_init": ("gray_branch", False),
    "coord_radius": ("coord_channels", False),
    **{k: ("renet_layers", 0) for k in _DEFAULTS if k.startswith("renet_") and k != "renet_layers"},
    "aspp_init_std": ("aspp_style", "v3"),
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _wrong_type(option: str, value: Any) -> str | None:
    """What ``value`` should be when it is not of ``option``'s default's type, else None."""
    default = _DEFAULTS[option]
    if value is None and default is None:
        return None
    if option.endswith("_rates"):
        ok = isinstance(value, list | tuple) and all(map(_is_int, value))
        return None if ok else "a list of ints"
    if option == "renet_init_bound" or isinstance(default, float):
        return None if _is_int(value) or isinstance(value, float) else "a number"
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "true or false"
    if isinstance(default, int):
        return None if _is_int(value) else "an int"
    return None if isinstance(value, str) else "a string"


def _check_name(name: str) -> None:
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")


def _check(name: str, num_classes: Any, weights: Any, options: dict[str, Any]) -> None:
    _check_name(name)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ConfigError(f"num_classes must be an int >= 1, got {num_classes!r}")
    if weights is not None and not isinstance(weights, str | os.PathLike | Mapping):
        raise ConfigError(
            f"weights must be None, 'imagenet', a file path or a state dict, got {weights!r}"
        )
    for option, value in options.items():
        if kind := _wrong_type(option, value):
            raise ConfigError(f"model option {option} must be {kind}, got {value!r}")
    if options["in_channels"] < 1 or not 0 <= options["aspp_init_std"] < math.inf:
        raise ConfigError(
            f"in_channels must be >= 1 and aspp_init_std >= 0 and finite, got "
            f"{options['in_channels']!r} and {options['aspp_init_std']!r}"
        )
    for option in ("aspp_rates", "deeplab_rates"):
        rates = options[option]
        if rates is not None and (not rates or min(rates) < 1):
            raise ConfigError(f"{option} must be one or more dilations >= 1, got {list(rates)}")
    if options["gray_conv_init"] not in ("sum", "mean"):
        raise ConfigError(
            f"gray_conv_init must be 'sum' or 'mean', got {options['gray_conv_init']!r}"
        )
    takes = set(inspect.signature(MODELS[name].func).parameters) - {"timm_model"}
    if name == "dualseg_timm":
        takes.add("timm_model")
    for option in (k for k in _DEFAULTS if k not in takes):
        value, default = options[option], _DEFAULTS[option]
        if (tuple(value) if isinstance(value, list) else value) != default:
            raise ConfigError(
                f"option {option}={value!r} does not apply to model {name!r}; leave it at its "
                f"default ({default!r})"
            )
    off = [
        f"{k}={options[k]!r} (with {switch}={value!r})"
        for k, (switch, value) in _SWITCHED_OFF.items()
        if options[switch] == value and options[k] != _DEFAULTS[k]
    ]
    if off:  # the peer refused them all above
        warnings.warn(f"model {name!r}: {', '.join(off)} has no effect", UserWarning, stacklevel=3)


def backbone_of(name: str) -> str:
    """The backbone (and ImageNet weights name) of model ``name`` with its default options."""
    _check_name(name)
    if name == "dualseg_timm":
        return _DEFAULTS["timm_model"]
    return MODELS[name].args[0]
