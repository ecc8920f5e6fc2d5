"""Dilated backbones, the "fully convolutional module" of spec S2: ``[B, C, H, W]`` ->
``[B, out_channels, H/os, W/os]``, the later stages dilated instead of strided (DeepLab)."""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torchvision
from torch import Tensor, nn

from dualseg.errors import CheckpointError, ConfigError
from dualseg.weights import load_pretrained, load_state_dict_file, resolve_weights

__all__ = ["BACKBONES", "TimmBackbone", "build_backbone", "dilate_blocks"]

WeightsArg = str | os.PathLike[str] | Mapping[str, Tensor] | None


def dilate_blocks(blocks: Sequence[nn.Module], output_stride: int, stride: int = 1) -> None:
    """Turn striding into dilation, in place, once the running stride (``stride`` before the
    first block) would pass ``output_stride``; the block that loses its stride takes the new
    dilation, as torchvision's dilated MobileNetV3 does."""
    dilation = 1
    for block in blocks:
        convs = [m for m in block.modules() if isinstance(m, nn.Conv2d)]
        block_stride = max((m.stride[0] for m in convs), default=1)
        if stride * block_stride > output_stride:
            dilation *= block_stride
            for m in convs:
                m.stride = (1, 1)
        else:
            stride *= block_stride
        if dilation > 1:
            for m in convs:
                k = m.kernel_size[0]
                if k > 1:
                    m.dilation = (dilation, dilation)
                    m.padding = (dilation * (k - 1) // 2,) * 2


def _resnet(arch: str, in_channels: int, output_stride: int) -> tuple[nn.Module, int]:
    """Dilated torchvision ResNet without pooling/fc, torchvision's keys; torchvision cannot
    dilate BasicBlock (ResNet-18/34), so :func:`dilate_blocks` does."""
    bottleneck = arch in ("resnet50", "resnet101")
    replace = {8: [False, True, True], 16: [False, False, True], 32: [False, False, False]}
    kwargs = {"replace_stride_with_dilation": replace[output_stride]} if bottleneck else {}
    net = getattr(torchvision.models, arch)(weights=None, **kwargs)
    if not bottleneck:
        dilate_blocks([*net.layer1, *net.layer2, *net.layer3, *net.layer4], output_stride, 4)
    if in_channels != 3:
        net.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    layers = ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4")
    body = nn.Sequential(OrderedDict((name, getattr(net, name)) for name in layers))
    return body, (2048 if bottleneck else 512)


def _mobilenet_v2(in_channels: int, output_stride: int) -> tuple[nn.Module, int]:
    """Dilated torchvision MobileNetV2 ``features[:18]`` (320 channels, as the MobileNetV2
    paper's DeepLabV3, §6.3)."""
    net = torchvision.models.mobilenet_v2(weights=None)
    features = net.features[:-1]
    dilate_blocks(list(features), output_stride)
    if in_channels != 3:
        stem = features[0][0]
        features[0][0] = nn.Conv2d(in_channels, stem.out_channels, 3, 2, 1, bias=False)
    return nn.Sequential(OrderedDict(features=features)), 320


class TimmBackbone(nn.Module):
    """A timm model's last feature map, dilated by timm's own ``output_stride``."""

    def __init__(self, model_name: str, in_channels: int = 3, output_stride: int = 8) -> None:
        super().__init__()
        try:
            import timm
        except ImportError as exc:  # optional extra
            raise ConfigError(
                "timm backbones need the timm package: pip install 'dualseg[timm]'"
            ) from exc
        self.model_name = model_name
        try:
            self.model = timm.create_model(
                model_name,
                pretrained=False,
                features_only=True,
                out_indices=(-1,),
                output_stride=output_stride,
                in_chans=in_channels,
            )
        except (RuntimeError, TypeError, AssertionError) as err:  # timm's own refusals
            raise ConfigError(
                f"model.timm_model {model_name!r}: timm cannot build it as a dilated feature "
                f"extractor ({' '.join(str(err).split())}); choose a CNN that takes "
                "output_stride, e.g. efficientnet_lite0"
            ) from None
        self.out_channels = int(self.model.feature_info.channels()[-1])

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)[-1]


def _timm_state_dict(model_name: str, state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state_dict`` in timm's key names; a file in other names (the offline EfficientNet-Lite0
    file uses lukemelas/EfficientNet-PyTorch's) is matched by position, shapes agreeing."""
    import timm

    reference = timm.create_model(model_name, pretrained=False).state_dict()
    if set(state_dict) <= set(reference):
        return dict(state_dict)
    ref_items, items = list(reference.items()), list(state_dict.items())
    shapes_agree = len(ref_items) == len(items) and all(
        rv.shape == v.shape for (_, rv), (_, v) in zip(ref_items, items)
    )
    if not shapes_agree:
        raise CheckpointError(
            f"weights do not match timm model {model_name!r} by name or by position; pass a "
            f"file saved from timm.create_model({model_name!r}).state_dict()"
        )
    return {rk: v for (rk, _), (_, v) in zip(ref_items, items)}


# name -> (constructor(in_channels, output_stride), ImageNet file keys the backbone leaves out)
BACKBONES: dict[str, tuple[Callable[[int, int], tuple[nn.Module, int]], tuple[str, ...]]] = {
    **{
        a: (functools.partial(_resnet, a), ("fc.",))
        for a in ("resnet18", "resnet34", "resnet50", "resnet101")
    },
    "mobilenet_v2": (_mobilenet_v2, ("features.18.", "classifier.")),
}


def build_backbone(
    name: str,
    *,
    in_channels: int = 3,
    output_stride: int = 8,
    weights: WeightsArg = None,
    allow_download: bool = False,
    first_conv_reduce: str = "sum",
) -> tuple[nn.Module, int]:
    """``(module, out_channels)`` of backbone ``name`` (a :data:`BACKBONES` key or
    ``timm:<model>``). ``weights``: None, ``"imagenet"``, a state-dict file or a state dict;
    a 1-channel stem gets the RGB kernels' sum (spec S2 Reading) or ``"mean"``."""
    if output_stride not in (8, 16, 32):
        raise ConfigError(f"output_stride must be 8, 16 or 32, got {output_stride}")
    if name.startswith("timm:"):
        timm_name = name.removeprefix("timm:")
        module: nn.Module = TimmBackbone(timm_name, in_channels, output_stride)
        out_channels, weights_name, ignore = module.out_channels, timm_name, ()
    elif name in BACKBONES:
        (make, ignore), weights_name = BACKBONES[name], name
        module, out_channels = make(in_channels, output_stride)
    else:
        raise ConfigError(
            f"unknown backbone {name!r}; choose one of {', '.join(BACKBONES)} or 'timm:<name>'"
        )
    if weights is not None:
        state = backbone_state_dict(weights_name, weights, allow_download=allow_download)
        target = module
        if isinstance(module, TimmBackbone):
            state = _timm_state_dict(module.model_name, state)
            target = module.model
            ignore = tuple(k for k in state if k not in target.state_dict())
        load_pretrained(
            target, state, reduce=first_conv_reduce, ignore_unexpected=ignore, name=name
        )
    return module, out_channels


def backbone_state_dict(
    weights_name: str, weights: WeightsArg, *, allow_download: bool = False
) -> dict[str, Tensor]:
    if isinstance(weights, Mapping):
        return dict(weights)
    if weights == "imagenet":
        path = resolve_weights(weights_name, download=allow_download)
    else:
        path = resolve_weights(weights_name, path=Path(weights))
    return load_state_dict_file(path)


def backbone_weights_name(name: str) -> str:
    """The :mod:`dualseg.weights` name of backbone ``name`` (``timm:<model>`` or a key of
    :data:`BACKBONES`)."""
    return name.removeprefix("timm:")
