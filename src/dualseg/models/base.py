"""What every dualseg model shares: padding, upsampling back, predict (spec S4)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dualseg.errors import ConfigError


def pad_to_multiple(x: Tensor, multiple: int) -> Tensor:
    """Zero-pad (the mean colour) bottom and right to multiples of ``multiple``."""
    h, w = x.shape[-2:]
    pad_h, pad_w = (-h) % multiple, (-w) % multiple
    if pad_h or pad_w:
        x = F.pad(x, (0, pad_w, 0, pad_h))
    return x


def upsample_crop(scores: Tensor, padded: tuple[int, int], size: tuple[int, int]) -> Tensor:
    """Bilinearly upsample scores to the padded size, then crop to ``size``."""
    scores = F.interpolate(scores, size=padded, mode="bilinear", align_corners=False)
    return scores[..., : size[0], : size[1]]


def class_labels(scores: Tensor) -> Tensor:
    """The class of each pixel, ``int64 [B, H, W]``, of class scores ``[B, C, H, W]``: argmax's
    first maximum, through ``max``, which runs 4-10x faster than ``argmax`` on the CPU."""
    return scores.max(1).indices


class SegmentationModel(nn.Module):
    """Base of every model: ``forward`` returns logits ``[B, C, H, W]`` at input size."""

    num_classes: int
    in_channels: int = 3  # build_model sets it from its own argument

    def check_input(self, x: Tensor) -> None:
        """Refuse, with the fix, an input a convolution would fail on deep inside (skipped on
        symbolic shapes: tracing, scripting, exporting, compiling)."""
        if (
            torch.jit.is_tracing()
            or torch.jit.is_scripting()
            or torch.compiler.is_compiling()
            or torch.onnx.is_in_onnx_export()
        ):
            return
        name, predict = type(self).__name__, "dualseg.load_model(checkpoint).predict(image)"
        if not isinstance(x, Tensor) or x.dim() != 4:
            got = f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
            raise TypeError(f"{name} takes a normalized image batch [B, {self.in_channels}, H, "
                            f"W] tensor, got {got}; for images use {predict}")  # fmt: skip
        if not x.is_floating_point():
            raise TypeError(f"{name} takes normalized float pixels, got {x.dtype}; use {predict}")
        if x.shape[1] != self.in_channels:
            raise ValueError(f"{name} was built for {self.in_channels}-channel input, got "
                             f"{x.shape[1]} channels")  # fmt: skip
        if x.shape[-2] == 0 or x.shape[-1] == 0:
            raise ValueError(f"empty image batch: shape {tuple(x.shape)}")
        weight = next(self.parameters(), None)
        if (
            weight is not None
            and x.dtype != weight.dtype
            and not torch.is_autocast_enabled(x.device.type)
        ):
            raise TypeError(f"input dtype {x.dtype} differs from the weights' {weight.dtype}: "
                            f"cast one (x.to({weight.dtype})) or use torch.autocast")  # fmt: skip

    @torch.no_grad()
    def predict_proba(self, x: Tensor) -> Tensor:
        """Class probabilities ``[B, C, H, W]`` in eval mode (train-mode BatchNorm would mix
        the batch's images), the mode restored."""
        with eval_mode(self):
            return torch.softmax(self(x), dim=1)

    @torch.no_grad()
    def predict(self, x: Tensor) -> Tensor:
        """Class index per pixel, ``int64 [B, H, W]``, in eval mode."""
        with eval_mode(self):
            return class_labels(self(x))


def require_rgb_input(model: nn.Module, what: str) -> None:
    """Refuse a model built for other than 3 input channels where ``what`` feeds it RGB."""
    channels = getattr(model, "in_channels", 3)
    if channels != 3:
        raise ConfigError(f"{what} feeds RGB images; this model was built for {channels}-channel "
                          "input: call it on your own tensors")  # fmt: skip


def model_logits(output: object, what: str = "the model") -> Tensor:
    """Logits ``[B,C,h,w]`` from a tensor, torchvision's ``{"out": ...}``, an object with
    ``.logits`` (Hugging Face's outputs) or a tuple led by them."""
    output = getattr(output, "logits", output)
    if isinstance(output, dict):
        if "out" not in output:
            raise ConfigError(f"{what} returned a dict with keys {sorted(output)}; expected its "
                              "logits under 'out', as torchvision's")  # fmt: skip
        output = output["out"]
    elif isinstance(output, tuple | list) and output:
        output = output[0]
    if not isinstance(output, Tensor) or output.dim() != 4:
        got = tuple(output.shape) if isinstance(output, Tensor) else type(output).__name__
        raise ConfigError(f"{what} must return logits [B, C, H, W], got {got}")
    return output


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model`` in eval mode, each submodule's mode restored after (frozen BatchNorm stays)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
