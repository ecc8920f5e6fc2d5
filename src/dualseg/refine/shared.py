"""Method B on the features the base model has already computed (the same labels, faster)."""

from __future__ import annotations

from types import TracebackType
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle


class BaseFeatures(NamedTuple):
    """What the base's forward computed that a refiner can read: the backbone output ``features
    [B,L,h,w]``, the size ``covered`` of the (padded) input it covers, and ``low`` the backbone's
    stride-4 features ``[B,L',h',w']`` for a refiner with a decoder (else ``None``)."""

    features: Tensor
    covered: tuple[int, int]
    low: Tensor | None = None


def base_backbone(model: nn.Module) -> nn.Module | None:
    """The module of ``model`` whose output a ``base-frozen`` refiner's embedding starts from:
    ``model.backbone`` (the DeepLabV3 peer) or the RGB branch's (method A); ``None`` for a
    model of another layout."""
    rgb = getattr(model, "rgb", None)
    module = getattr(rgb, "backbone", None) if rgb is not None else getattr(model, "backbone", None)
    return module if isinstance(module, nn.Module) else None


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys():
        return False
    return all(sa[k].shape == sb[k].shape and torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


def can_share(refiner_config: object, refiner_backbone: nn.Module, model: nn.Module) -> bool:
    """Whether the refiner (its configuration and backbone) may read ``model``'s backbone output
    in place of running its own backbone: ``base-frozen``, input scale 1, no P1 blur, the
    base's output stride (the same weights at another stride dilate differently) and the same
    backbone weights (so a decoder's stride-4 tap is there too)."""
    if (
        getattr(refiner_config, "backbone_source", None) != "base-frozen"
        or getattr(refiner_config, "input_scale", None) != 1.0
        or getattr(refiner_config, "p1_blur_sigma", None) != 0
        or getattr(refiner_config, "output_stride", None) != getattr(model, "output_stride", None)
    ):
        return False
    backbone = base_backbone(model)
    return backbone is not None and _same_weights(backbone, refiner_backbone)


def matching(
    kept: BaseFeatures | tuple[Tensor, tuple[int, int]] | None, images: Tensor, output_stride: int,
    *, needs_low: bool = False, low_stride: int = 4,
) -> BaseFeatures | None:  # fmt: skip
    """``kept`` when it can be the base's backbone output for exactly ``images``: one map per
    image, in float32 (autocast's half precision is not what the refiner's own pass computes),
    covering the images padded at the bottom and right by less than one stride (a resized or
    tiled input covers something else), and with ``needs_low`` (a refiner with a decoder) the
    features at ``low_stride`` of that same padded input; else ``None``."""
    if kept is None:
        return None
    kept = BaseFeatures(*kept)
    feats, (h, w), low = kept
    H, W = images.shape[-2:]
    if not _one_float_map_each(feats, images.shape[0]):
        return None
    if not (0 <= h - H < output_stride and 0 <= w - W < output_stride):
        return None
    if needs_low and (
        low is None
        or not _one_float_map_each(low, images.shape[0])
        or tuple(low.shape[-2:]) != (-(-h // low_stride), -(-w // low_stride))
    ):
        return None
    return kept


def _one_float_map_each(t: Tensor, batch: int) -> bool:
    return t.dim() == 4 and t.shape[0] == batch and t.dtype == torch.float32


class SharedFeatures:
    """``with SharedFeatures(model, active) as shared: logits = model(x); f = shared.take()``."""

    def __init__(
        self, model: nn.Module, active: bool = True, output_stride: int | None = None,
        low_level: str | None = None,
    ) -> None:  # fmt: skip
        self.module = base_backbone(model) if active else None
        self.tap = (
            self.module.get_submodule(low_level)
            if self.module is not None and low_level is not None
            else None
        )
        # with it, take(images) keeps only features that :func:`matching` accepts for them
        self.output_stride = output_stride
        # one entry per backbone call since the last take(); None: not a plain feature map
        self._kept: list[BaseFeatures | None] = []
        self._low: list[Tensor] = []  # the tap's output within the backbone call running
        self._handles: list[RemovableHandle] = []

    def _tap_hook(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        if isinstance(output, Tensor):
            self._low.append(output.detach())

    def _hook(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        x = args[0] if args else None
        # the tap is a block inside the backbone: its hook ran during this very call
        low = self._low[-1] if len(self._low) == 1 else None
        self._low = []
        if isinstance(output, Tensor) and isinstance(x, Tensor):
            self._kept.append(BaseFeatures(output.detach(), (x.shape[-2], x.shape[-1]), low))
        else:
            self._kept.append(None)  # not a plain feature map: this call cannot be shared

    def __enter__(self) -> SharedFeatures:
        if self.module is not None:
            self._handles.append(self.module.register_forward_hook(self._hook))
        if self.tap is not None:
            self._handles.append(self.tap.register_forward_hook(self._tap_hook))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._kept.clear()
        self._low = []

    def take(self, images: Tensor | None = None) -> BaseFeatures | None:
        """What the backbone's one call since the last ``take()`` gave (else ``None``); with
        ``images`` and an ``output_stride``, only if it can stand for exactly those images
        (:func:`matching`), so that a caller counting shared images counts the used ones."""
        kept, self._kept = self._kept, []
        one = kept[0] if len(kept) == 1 else None
        if images is not None and self.output_stride is not None:
            return matching(one, images, self.output_stride, needs_low=self.tap is not None)
        return one
