"""Method B on any model's own features: two of its modules, read during its forward."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dualseg.errors import ConfigError, DataError
from dualseg.models.base import eval_mode, model_logits
from dualseg.refine.shared import BaseFeatures, matching

SAMPLE_SIZE = (256, 256)  # divisible by 32, as smp's encoders need
# where encoder layouts keep the backbone whose stages are the taps (smp, torchvision, dualseg)
ENCODERS = ("encoder", "backbone", "rgb.backbone")


class Tap(NamedTuple):
    name: str
    channels: int
    stride: int
    size: tuple[int, int]  # the output's (h, w) for the sample input


class TapRecord(NamedTuple):
    """What a tap refiner was fit on: ``(low, high)`` module names, channels and strides."""

    names: tuple[str, str]
    channels: tuple[int, int]
    strides: tuple[int, int]

    def describe(self, i: int) -> str:
        return f"{self.names[i]} ({self.channels[i]} channels, stride {self.strides[i]})"

    def to_dict(self) -> dict[str, list[Any]]:
        return {k: list(v) for k, v in self._asdict().items()}

    @classmethod
    def from_dict(cls, d: Any) -> TapRecord:
        return cls(*(tuple(d[k]) for k in cls._fields))


def base_logits(base: Callable[[Tensor], Any], images: Tensor) -> Tensor:
    """A base's class scores at the image size (bilinear): logits, a dict with ``"out"``, an
    object with ``.logits`` or a tuple led by the logits."""
    out = base(images)
    out = model_logits(out, "the base model")
    if out.shape[-2:] != images.shape[-2:]:
        out = F.interpolate(
            out.float(), size=images.shape[-2:], mode="bilinear", align_corners=False
        )
    return out.float()


def list_taps(model: nn.Module, sample: Tensor | None = None) -> list[Tap]:
    """Every module of ``model`` whose first output on ``sample`` (default ``1x3x256x256``
    zeros, on the model's device) is a feature map ``[1,C,h,w]`` at a whole stride, in call
    order."""
    if sample is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        sample = torch.zeros(1, 3, *SAMPLE_SIZE, device=device)
    kept: dict[str, Tensor] = {}

    def keep(name: str, out: Any) -> None:
        if isinstance(out, Tensor) and out.dim() == 4 and name not in kept:
            kept[name] = out.detach()

    handles = [m.register_forward_hook(lambda _m, _a, out, n=n: keep(n, out))
               for n, m in model.named_modules() if n]  # fmt: skip
    try:
        with torch.no_grad(), eval_mode(model):
            model(sample)
    finally:
        for h in handles:
            h.remove()
    H, W = sample.shape[-2:]
    return [
        Tap(name, int(out.shape[1]), H // out.shape[-2], tuple(out.shape[-2:]))
        for name, out in kept.items()
        if H % out.shape[-2] == 0 and W % out.shape[-1] == 0
        and H // out.shape[-2] == W // out.shape[-1]
    ]  # fmt: skip


def pick_taps(model: nn.Module, taps: Sequence[Tap], *, high_stride: int) -> tuple[str, str] | None:
    """``(low, high)`` for an encoder layout (:data:`ENCODERS`): of its stages (the shallowest
    level of modules of several strides), the last at stride 4 and the last at ``high_stride``
    or finer (the embedding's output stride: on an smp Unet's MobileNetV2 a stride-16 stage
    gave +8.0 mIoU on CamVid val where its stride-32 last stage gave +6.7); else ``None``."""
    for prefix in ENCODERS:
        try:
            model.get_submodule(prefix)
        except AttributeError:
            continue
        inside = [t for t in taps if t.name.startswith(prefix + ".")]
        for depth in range(prefix.count(".") + 2, prefix.count(".") + 5):
            stages = [t for t in inside if t.name.count(".") == depth - 1]
            if len({t.stride for t in stages}) > 1:
                low = [t for t in stages if t.stride == 4]
                high = [t for t in stages if 4 < t.stride <= high_stride]
                return (low[-1].name, high[-1].name) if low and high else None
    return None


def measure_taps(taps: Sequence[Tap], names: Sequence[str]) -> TapRecord:
    """The record of the ``(low, high)`` modules among a model's ``taps``, checked."""
    low, high = names
    found = {t.name: t for t in taps if t.name in (low, high)}
    for n in (low, high):
        if n not in found:
            raise ConfigError(
                f"module {n!r} of the base model is missing or gives no feature map at a whole "
                "stride; 'dualseg refine layers' lists the modules to tap"
            )
    if found[low].stride > found[high].stride:
        raise ConfigError(
            f"the low tap {low!r} (stride {found[low].stride}) is coarser than the high tap "
            f"{high!r} (stride {found[high].stride}): give them as LOW HIGH"
        )
    return TapRecord(
        (low, high), (found[low].channels, found[high].channels),
        (found[low].stride, found[high].stride),
    )  # fmt: skip


class _Stop(Exception):
    """Ends the base's forward once both taps are read (training needs nothing after them)."""


class TapReader:
    """``with TapReader(model, record) as r: model(x)``, then ``r.take(images)``."""

    def __init__(self, model: nn.Module, record: TapRecord, *, stop: bool = False) -> None:
        modules = dict(model.named_modules())
        if missing := [n for n in record.names if n not in modules]:
            raise DataError(
                f"this base model has no module {missing[0]!r}: the refiner was fit on "
                f"{record.describe(0)} and {record.describe(1)}; refine with that base"
            )
        self.record, self.stop = record, stop
        self._modules = [modules[n] for n in record.names]
        # every module's 3-channel input (the refiner's images are RGB): one of them shows
        # whether the base padded the images before the taps saw them (smp pads for its encoder)
        self._all = list(modules.values())
        self._inputs: list[Tensor] = []
        self._kept: list[list[Tensor]] = [[], []]
        self._handles: list[Any] = []

    def _hook(self, i: int) -> Callable[..., None]:
        def keep(_m: nn.Module, _a: Any, out: Any) -> None:
            if isinstance(out, Tensor):
                self._kept[i].append(out.detach())
            if self.stop and all(self._kept):
                raise _Stop

        return keep

    def __enter__(self) -> TapReader:
        self._handles = [
            m.register_forward_hook(self._hook(i)) for i, m in enumerate(self._modules)
        ]
        self._handles += [m.register_forward_pre_hook(self._keep_input) for m in self._all]
        return self

    def _keep_input(self, _m: nn.Module, args: Any) -> None:
        x = args[0] if args else None
        if isinstance(x, Tensor) and x.dim() == 4 and x.shape[1] == 3:
            self._inputs.append(x.detach())

    def _seen_size(self, images: Tensor) -> tuple[int, int]:
        """The size the taps saw: the images', or the base's padding of them when a module's
        input was ``images`` padded bottom and right (checked by value; centred padding or a
        resize is not read as padding)."""
        inputs, self._inputs = self._inputs, []
        H, W = images.shape[-2:]
        for seen in inputs:
            h, w = seen.shape[-2:]
            if seen.shape[:2] != images.shape[:2] or (h, w) == (H, W) or h < H or w < W:
                continue
            if seen.device == images.device and torch.equal(seen[..., :H, :W], images):
                return h, w
        return H, W

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> bool:
        for h in self._handles:
            h.remove()
        self._handles = []
        return kind is _Stop  # the forward was ended on purpose

    def take(self, images: Tensor) -> BaseFeatures | None:
        """The taps of the one forward since the last ``take()``, when they :func:`matching`
        ``images`` (else None: a tile or a resized copy)."""
        taps = self.taps(images, strict=False)
        if taps is None:
            return None
        (low_stride, s), (h, w) = self.record.strides, taps[1].shape[-2:]
        return matching(BaseFeatures(taps[1], (h * s, w * s), taps[0]), images, s,
                        low_stride=low_stride)  # fmt: skip

    def taps(self, images: Tensor, *, strict: bool = True) -> tuple[Tensor, Tensor] | None:
        """``(low, high)`` of the one forward since the last call (else None); other channels
        are refused, and so is another stride when ``strict`` (else None)."""
        kept, self._kept = self._kept, [[], []]
        H, W = self._seen_size(images)
        if any(len(k) != 1 for k in kept):
            return None
        for i, (t,) in enumerate(kept):
            s = self.record.strides[i]
            if t.dim() == 4 and t.shape[1] == self.record.channels[i]:
                if all(n in (size // s, -(-size // s)) for n, size in zip(t.shape[-2:], (H, W))):
                    continue
                if not strict:
                    return None
            got = f"{t.shape[1]} channels, stride {H / t.shape[-2]:g}" if t.dim() == 4 else "no map"
            raise DataError(
                f"the base's {self.record.names[i]} gives {got}, but this refiner was fit "
                f"on {self.record.describe(i)}: refine with the base it was fit on"
            )
        low, high = kept[0][0], kept[1][0]
        # the base padded further than the refiner's own padding (to the high tap's stride):
        # keep what that spans, so that the two maps and the image stay aligned
        if images.shape[-2:] != (H, W):
            s = self.record.strides[1]
            eh, ew = (-(-n // s) * s for n in images.shape[-2:])
            high = high[..., : eh // s, : ew // s]
            low = low[..., : eh // self.record.strides[0], : ew // self.record.strides[0]]
        return low, high


class BaseTaps(nn.Module):
    """The tap refiner's "backbone": the attached base model's taps ``(high, low)`` (frozen)."""

    def __init__(self, record: TapRecord) -> None:
        super().__init__()
        self.record = record
        self._base: list[nn.Module] = []

    def attach(self, model: nn.Module) -> None:
        TapReader(model, self.record)  # names checked now; shapes at the first read
        self._base = [model]

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if not self._base:
            raise ConfigError(
                "this refiner reads its base model's features: refine with the base itself "
                "(refiner.refine(images, base=model))"
            )
        (model,) = self._base
        with torch.no_grad(), eval_mode(model), TapReader(model, self.record, stop=True) as r:
            model(x)
        taps = r.taps(x)
        if taps is None:
            raise DataError(f"the base's forward did not run {self.record.names} once each")
        return taps[1], taps[0]


def is_py_spec(text: str) -> bool:
    """``path/to/file.py:NAME`` or ``package.module:NAME``."""
    return re.fullmatch(r"(.+\.py|[A-Za-z_][\w.]*):[A-Za-z_]\w*", text) is not None
