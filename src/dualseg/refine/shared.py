"""Method B on the features the base model has already computed (the same labels, faster)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn


class BaseFeatures(NamedTuple):
    """The base's backbone output ``features [B,L,h,w]``, the size ``covered`` of the (padded)
    input it covers, and ``low`` its stride-4 features for a refiner with a decoder."""

    features: Tensor
    covered: tuple[int, int]
    low: Tensor | None = None


def base_backbone(model: nn.Module) -> nn.Module | None:
    """``model.backbone`` (the DeepLabV3 peer) or the RGB branch's (method A), else ``None``."""
    module = getattr(getattr(model, "rgb", model), "backbone", None)
    return module if isinstance(module, nn.Module) else None


def can_share(config: Any, backbone: nn.Module, model: nn.Module) -> bool:
    """Whether the refiner may read ``model``'s backbone output instead of running its own:
    ``base-frozen``, input scale 1, no P1 blur, the base's stride and the same weights."""
    theirs = base_backbone(model)
    if theirs is None or (config.backbone_source, config.input_scale, config.p1_blur_sigma) != (
        "base-frozen", 1.0, 0
    ) or config.output_stride != getattr(model, "output_stride", None):  # fmt: skip
        return False
    a, b = theirs.state_dict(), backbone.state_dict()
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and torch.equal(a[k].cpu(), b[k].cpu()) for k in a
    )


def weights_key(*modules: nn.Module) -> tuple[Any, ...]:
    """What changes when any weight of ``modules`` is replaced or written in place (an
    optimizer step, ``load_state_dict``): the modules, and each tensor's storage and version."""
    return tuple(
        (id(m), *((t.data_ptr(), t._version) for t in (*m.parameters(), *m.buffers())))
        for m in modules
    )


def matching(
    kept: BaseFeatures | tuple[Tensor, tuple[int, int]] | None, images: Tensor, output_stride: int,
    *, needs_low: bool = False, low_stride: int = 4,
) -> BaseFeatures | None:  # fmt: skip
    """``kept`` when it is the base's float32 backbone output for exactly ``images`` (padded by
    less than a stride; with ``needs_low`` its stride-4 map too), else ``None``."""
    if kept is None:
        return None
    kept = BaseFeatures(*kept)
    (h, w), (H, W) = kept.covered, images.shape[-2:]

    def one_each(t: Tensor | None) -> bool:
        return t is not None and t.dim() == 4 and t.shape[0] == images.shape[0] and (
            t.dtype == torch.float32
        )  # fmt: skip

    low_size = (-(-h // low_stride), -(-w // low_stride))
    fits = one_each(kept.features) and 0 <= h - H < output_stride and 0 <= w - W < output_stride
    if not fits or (needs_low and not (one_each(kept.low) and kept.low.shape[-2:] == low_size)):
        return None
    return kept


class SharedFeatures:
    """``with SharedFeatures(model, active) as shared: logits = model(x); f = shared.take()``."""

    def __init__(
        self, model: nn.Module, active: bool = True, output_stride: int | None = None,
        low_level: str | None = None,
    ) -> None:  # fmt: skip
        self.module = base_backbone(model) if active else None
        on = self.module is not None and low_level is not None
        self.tap = self.module.get_submodule(low_level) if on else None
        self.output_stride = output_stride  # with it, take(images) keeps only matching ones
        self._kept: list[BaseFeatures | None] = []  # one per backbone call since take()
        self._low: list[Tensor] = []  # the tap's output within the backbone call running
        self._handles: list[Any] = []

    def _tap_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, Tensor):
            self._low.append(output.detach())

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        x = args[0] if args else None
        low = self._low[-1] if len(self._low) == 1 else None  # the tap ran inside this call
        self._low = []
        plain = isinstance(output, Tensor) and isinstance(x, Tensor)
        self._kept.append(BaseFeatures(output.detach(), x.shape[-2:], low) if plain else None)

    def __enter__(self) -> SharedFeatures:
        if self.module is not None:
            self._handles.append(self.module.register_forward_hook(self._hook))
        if self.tap is not None:
            self._handles.append(self.tap.register_forward_hook(self._tap_hook))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._kept, self._low = [], [], []

    def take(self, images: Tensor | None = None) -> BaseFeatures | None:
        """What the backbone's one call since the last ``take()`` gave (else ``None``); with
        ``images`` and an ``output_stride``, only if it :func:`matching` them."""
        kept, self._kept = self._kept, []
        one = kept[0] if len(kept) == 1 else None
        if images is not None and self.output_stride is not None:
            return matching(one, images, self.output_stride, needs_low=self.tap is not None)
        return one
