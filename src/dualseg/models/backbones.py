"""Dilated backbones: the "fully convolutional module" of spec S2 (ResNet-101 with atrous
convolution in the spec; ResNet-18/34/50, MobileNetV2 and any timm model as lighter choices).

Every backbone maps ``[B, in_channels, H, W]`` to ``[B, out_channels, H/os, W/os]`` for an input
whose sides are multiples of the output stride ``os`` (8, as in the spec, or 16). The later
stages keep their resolution by dilation instead of striding (DeepLab's atrous backbone).

Weights: modules are built with random initialization and never touch the file system;
``build_backbone(weights=...)`` resolves a file through :mod:`dualseg.weights` and copies it in
with the one loud loader (``load_pretrained``), which also sums the RGB kernels of the first
convolution for a 1-channel (grayscale) backbone (spec S2 Reading).
"""

from __future__ import annotations

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
    """Turn striding into dilation once the running stride reaches ``output_stride``.

    ``blocks`` are the backbone's blocks in order (``stride`` = the stride before the first).
    A block that would push the stride past ``output_stride`` gets stride 1 in all of its
    convolutions and multiplies the dilation; from then on every k×k convolution (k > 1) uses
    that dilation with ``padding = dilation·(k-1)/2``. The block that loses its stride takes the
    new dilation, as torchvision's dilated MobileNetV3 (the backbone of its LR-ASPP and
    DeepLabV3 MobileNet models) does. Modifies the blocks in place: weights stay compatible.
    """
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


def _check_stride(output_stride: int) -> None:
    if output_stride not in (8, 16, 32):
        raise ConfigError(f"output_stride must be 8, 16 or 32, got {output_stride}")


def _resnet(arch: str, in_channels: int, output_stride: int) -> tuple[nn.Module, int]:
    """Dilated torchvision ResNet without pooling/fc. Keys are torchvision's (``conv1.weight``,
    ``layer4.2.conv3.weight``, ...), so ImageNet files load as they are (their ``fc.*`` left out).
    ResNet-50/101 use torchvision's ``replace_stride_with_dilation``; ResNet-18/34 (BasicBlock,
    which torchvision cannot dilate) go through :func:`dilate_blocks`."""
    _check_stride(output_stride)
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
    """Dilated torchvision MobileNetV2 ``features[:18]``: 320 channels. The final 1×1 conv to
    1280 channels is left out, as in the MobileNetV2 paper's DeepLabV3 (§6.3: building the head
    on the 320-channel map is cheaper at equal accuracy). Keys: ``features.N...``."""
    _check_stride(output_stride)
    net = torchvision.models.mobilenet_v2(weights=None)
    features = net.features[:-1]
    dilate_blocks(list(features), output_stride)
    if in_channels != 3:
        stem = features[0][0]
        features[0][0] = nn.Conv2d(in_channels, stem.out_channels, 3, 2, 1, bias=False)
    return nn.Sequential(OrderedDict(features=features)), 320


class TimmBackbone(nn.Module):
    """Any timm model as a backbone: ``features_only=True, out_indices=(-1,)`` and timm's own
    ``output_stride`` (dilation). Keys: ``model.<timm key>``."""

    def __init__(self, model_name: str, in_channels: int = 3, output_stride: int = 8) -> None:
        super().__init__()
        try:
            import timm
        except ImportError as exc:  # optional extra
            raise ConfigError(
                "timm backbones need the timm package: pip install 'dualseg[timm]'"
            ) from exc
        _check_stride(output_stride)
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
    """Map a file in another key naming onto timm's names for ``model_name``.

    The offline EfficientNet-Lite0 file uses lukemelas/EfficientNet-PyTorch names
    (``_conv_stem``, ``_blocks.0._depthwise_conv``, ...). Both nets list the same tensors in the
    same order, so keys are matched by position, and every pair must agree in shape.
    """
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


# name -> (constructor(in_channels, output_stride), ImageNet weights name in dualseg.weights,
#          key prefixes of the ImageNet file that the backbone does not use)
BACKBONES: dict[str, tuple[Callable[[int, int], tuple[nn.Module, int]], str, tuple[str, ...]]] = {
    "resnet18": (lambda c, s: _resnet("resnet18", c, s), "resnet18", ("fc.",)),
    "resnet34": (lambda c, s: _resnet("resnet34", c, s), "resnet34", ("fc.",)),
    "resnet50": (lambda c, s: _resnet("resnet50", c, s), "resnet50", ("fc.",)),
    "resnet101": (lambda c, s: _resnet("resnet101", c, s), "resnet101", ("fc.",)),
    "mobilenet_v2": (_mobilenet_v2, "mobilenet_v2", ("features.18.", "classifier.")),
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
    """Build a dilated backbone; returns ``(module, out_channels)``.

    ``name``: a key of :data:`BACKBONES` (``resnet18/34/50/101``, ``mobilenet_v2``) or
    ``timm:<timm model name>`` (e.g. ``timm:efficientnet_lite0``). ``weights``: None (random
    initialization), ``"imagenet"`` (resolved by :func:`dualseg.weights.resolve_weights`), the
    path of a state-dict file, or an already loaded state dict. With ``in_channels=1`` the
    pretrained first convolution's RGB kernels are summed (``first_conv_reduce="sum"``, spec S2
    Reading) or averaged (``"mean"``).
    """
    if name.startswith("timm:"):
        timm_name = name.removeprefix("timm:")
        module: nn.Module = TimmBackbone(timm_name, in_channels, output_stride)
        out_channels, weights_name, ignore = module.out_channels, timm_name, ()
    elif name in BACKBONES:
        make, weights_name, ignore = BACKBONES[name]
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
    """Turn a ``weights`` argument (``"imagenet"``, a path, or a state dict) into tensors."""
    if isinstance(weights, Mapping):
        return dict(weights)
    if weights == "imagenet":
        path = resolve_weights(weights_name, download=allow_download)
    else:
        path = resolve_weights(weights_name, path=Path(weights))
    return load_state_dict_file(path)


def backbone_weights_name(name: str) -> str:
    """The :mod:`dualseg.weights` name of backbone ``name`` (for resolving a file once)."""
    if name.startswith("timm:"):
        return name.removeprefix("timm:")
    if name not in BACKBONES:
        raise ConfigError(f"unknown backbone {name!r}")
    return BACKBONES[name][1]
