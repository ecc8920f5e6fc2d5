"""RefinerConfig: every method-B option, its default, its help line and its rule, once."""

# no ``from __future__ import annotations``: __post_init__ and the flag loop read field types
import argparse
import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dualseg.augment_defaults import SEED_LIMIT
from dualseg.errors import ConfigError
from dualseg.refine.boundary import EDGE_METHODS, MAX_RADIUS

BACKBONE_SOURCES = ("independent", "base-frozen", "base-finetune")
REDUCTIONS = ("all", "violating")
MINING = ("random", "semi-hard")
OPTIMIZERS = ("adamw", "sgd")
MAX_EMBED_DIM = 4096  # C and the decoder's projection: 100000 ran out of memory


class OptionError(ConfigError):
    """A RefinerConfig value breaks its rule; ``named(flag)`` says it with the flag's name."""

    def __init__(self, option: str, rule: str, value: Any) -> None:
        self.option, self.rule, self.value = option, rule, value
        super().__init__(self.named(option))

    def named(self, name: str) -> str:
        return f"{name} must be {self.rule}, got {self.value!r}"


def _opt(default: Any, help: str, ok: Callable[[Any], bool] | None = None, rule: str = "") -> Any:
    return field(default=default, metadata={"help": help, "ok": ok, "rule": rule})


def _choice(default: str, choices: tuple[str, ...], help: str) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


def _at_least(low: float) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v >= low), f">= {low:g}"


FINITE = (lambda v: 0 <= v < math.inf, ">= 0 and finite")


@dataclass(frozen=True)
class RefinerConfig:
    """Method B's options: model (step 3), mask (step 2 / P4), triplets (step 4), inference
    (P1, P3) and the decision beyond the claim (:mod:`dualseg.refine.decision`)."""

    backbone: str = _opt("mobilenet_v2", "embedding backbone, a dualseg.models backbone name")
    embed_dim: int = _opt(
        256, "C, the embedding's channels", lambda v: 1 <= v <= MAX_EMBED_DIM,
        f"in 1..{MAX_EMBED_DIM}",
    )  # fmt: skip
    output_stride: int = _opt(16, "the embedding backbone's output stride")
    aspp_rates: tuple[int, ...] = _opt((4, 6, 8, 12), "the ASPP head's dilation rates")
    input_scale: float = _opt(
        0.5, "the embedding model sees the image resized by this factor",
        lambda v: 0 < v <= 4, "in (0, 4]",
    )  # fmt: skip
    radius: int = _opt(
        5, "near-boundary radius (px)", lambda v: 0 <= v <= MAX_RADIUS, f"in 0..{MAX_RADIUS}"
    )
    edge_method: str = _choice("canny", EDGE_METHODS, "how boundaries are found")
    top_n: int = _opt(5, "Top-N candidate labels at inference (P3)", *_at_least(1))
    margin: float = _opt(1.0, "triplet margin Δ", *_at_least(0))
    num_triplets: int = _opt(4096, "triplets per step", *_at_least(1))
    reduction: str = _choice("all", REDUCTIONS, "which triplets the loss averages")
    mining: str = _choice(
        "random", MINING, "false example F0: random (the claim) or semi-hard, among mining_pool"
    )
    mining_pool: int = _opt(8, "false examples per anchor for semi-hard mining", *_at_least(1))
    steps: int = _opt(2000, "training steps", *_at_least(1))
    # training BatchNorm needs more than one value per channel (one crop at 1x1)
    batch_size: int = _opt(
        8, "crops per step", lambda v: v >= 2, ">= 2 (BatchNorm needs 2 or more crops)"
    )
    optimizer: str = _choice("adamw", OPTIMIZERS, "optimizer")
    lr: float = _opt(1e-3, "learning rate", lambda v: 0 < v < math.inf, "> 0 and finite")
    weight_decay: float = _opt(1e-4, "weight decay", *_at_least(0))
    momentum: float = _opt(0.9, "SGD momentum", lambda v: 0 <= v < 1, "in [0, 1)")
    seed: int = _opt(
        0, "random seed of the whole fit", lambda v: 0 <= v < SEED_LIMIT, f"in 0..{SEED_LIMIT - 1}"
    )
    backbone_source: str = _choice(
        "independent", BACKBONE_SOURCES,
        "step 3: the embedding's own backbone, or the --base's backbone frozen or fine-tuned",
    )  # fmt: skip
    gate_margin: float | None = _opt(
        None, "relabel only where the base's top-1 minus top-2 probability is below this",
        lambda v: v is None or 0 <= v <= 1, "in [0, 1] or None",
    )  # fmt: skip
    prior_weight: float = _opt(
        0.0, "add this times the base's -log p to each candidate's distance", *_at_least(0)
    )
    min_prob: float = _opt(
        0.0, "a Top-N candidate other than the base's top-1 needs this base probability",
        lambda v: 0 <= v < 1, "in [0, 1)",
    )  # fmt: skip
    switch_cost: float = _opt(
        0.0, "relabel only where a candidate's score is below the base label's by more than "
        "this (in units of the prototype scale)", *FINITE,
    )  # fmt: skip
    blocked_switches: tuple[tuple[int, int], ...] = _opt(
        (), "relabel no pixel from the base's class A to class B for these A:B pairs (comma "
        "separated; none: every switch), as the calibration blocks the switches that broke "
        "more correct pixels than it allows per pixel fixed",
        lambda v: all(a != b and min(a, b) >= 0 for a, b in v), "pairs of two class indices",
    )  # fmt: skip
    p1_blur_sigma: float = _opt(0.0, "P1: Gaussian blur (px) of the embedding's input", *FINITE)
    decoder_channels: int = _opt(
        0, "a DeepLabV3+ decoder on the stride-4 features, projected to this many channels",
        lambda v: 0 <= v <= MAX_EMBED_DIM, f"in 0..{MAX_EMBED_DIM} (0: no decoder)",
    )  # fmt: skip
    base_features: tuple[str, ...] | None = _opt(
        None, "read the base model's features at modules LOW (stride 4) and HIGH, or auto "
        "('dualseg refine layers' lists them)",
        lambda v: v is None or len(v) == 2 or v == ("auto",), "LOW HIGH module names, or auto",
    )  # fmt: skip

    def __post_init__(self) -> None:
        for name in ("aspp_rates", "base_features"):  # JSON and argparse give lists
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        pairs = self.blocked_switches  # JSON gives a list of lists
        if isinstance(pairs, list | tuple) and all(isinstance(q, list | tuple) for q in pairs):
            object.__setattr__(self, "blocked_switches", tuple(tuple(q) for q in pairs))
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if not _has_type(f.type, value):
                name = f.type.__name__ if isinstance(f.type, type) else str(f.type)
                raise ConfigError(f"option {f.name} must be {name}, got {value!r:.40}")
            if "choices" in meta and value not in meta["choices"]:
                raise OptionError(f.name, f"one of {', '.join(meta['choices'])}", value)
            if meta.get("ok") is not None and not meta["ok"](value):
                raise OptionError(f.name, meta["rule"], value)
        if self.base_features is not None and self.decoder_channels == 0:
            raise OptionError("decoder_channels", "> 0 with base_features (e.g. 48)", 0)

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> "RefinerConfig":
        """The options ``refine fit`` parsed; a broken rule is named by its flag."""
        try:
            return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
        except OptionError as err:
            raise ConfigError(err.named(f"--{err.option.replace('_', '-')}")) from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def check_switches(self, num_classes: int, fix: str) -> None:
        """Refuse a blocked switch naming a class outside ``0..num_classes - 1``, saying ``fix``."""
        if bad := [q for q in self.blocked_switches if max(q) >= num_classes]:
            a, b = bad[0]
            raise ConfigError(
                f"blocked switch {a}:{b} names a class outside 0..{num_classes - 1}: {fix}"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RefinerConfig":
        """The options of a stored refiner (``to_dict``'s output), checked."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"config must be a dict of refiner options, got {d!r:.40}")
        if unknown := sorted(
            str(k) for k in d if k not in {f.name for f in dataclasses.fields(cls)}
        ):
            raise ConfigError(
                f"config holds option(s) {', '.join(unknown)} that this dualseg does not know"
            )
        return cls(**d)


def _has_type(kind: Any, value: Any) -> bool:
    """JSON has no tuples, and "5" or true is no count."""
    if isinstance(value, bool):
        return False
    if value is None:
        return kind in (float | None, tuple[str, ...] | None)
    if kind == tuple[int, ...]:
        return isinstance(value, tuple) and all(_has_type(int, v) for v in value)
    if kind == tuple[tuple[int, int], ...]:
        pairs = isinstance(value, tuple) and all(isinstance(q, tuple) for q in value)
        return pairs and all(len(q) == 2 and _has_type(tuple[int, ...], q) for q in value)
    if kind == tuple[str, ...] | None:
        return isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    if kind in (float, float | None):
        return isinstance(value, int | float)
    return isinstance(value, kind)


def optional_float(text: str) -> float | None:
    """argparse ``type=`` of an option that may be off: a number, or ``none``."""
    if text.lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or none, got {text!r}") from None


def switch_pairs(text: str) -> tuple[tuple[int, int], ...]:
    """argparse ``type=`` of ``--blocked-switches``: ``A:B,C:D`` (class indices), or ``none``."""
    if text.lower() == "none":
        return ()
    try:
        pairs = tuple(tuple(int(i) for i in q.split(":")) for q in text.split(","))
    except ValueError:
        pairs = ()
    if not pairs or any(len(q) != 2 or q[0] == q[1] or min(q) < 0 for q in pairs):
        raise argparse.ArgumentTypeError(
            f"expected A:B pairs of two class indices, comma separated (1:4,1:6), or none, "
            f"got {text!r}"
        )
    return pairs  # type: ignore[return-value]


def add_flags(p: argparse.ArgumentParser, parsers: Mapping[str, Callable[[str], Any]]) -> None:
    """One flag per field (``--embed-dim`` for ``embed_dim``); ``parsers``: their own ``type=``."""
    for f in dataclasses.fields(RefinerConfig):
        kind = optional_float if f.type == float | None else f.type
        kw: dict[str, Any] = {"type": parsers.get(f.name, kind), "default": f.default}
        if f.type == tuple[int, ...]:
            kw.update(type=int, nargs="+", default=list(f.default))
        if f.type == tuple[str, ...] | None:
            kw.update(type=str, nargs="+", metavar="MODULE")
        if f.type == tuple[tuple[int, int], ...]:
            kw.update(metavar="A:B,...")
        shown = " ".join(map(str, f.default)) if f.type == tuple[int, ...] else f.default
        shown = "none" if shown == () else shown
        help = f.metadata["help"] + (f" ({shown})" if f.default is not None else "")
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        p.add_argument(f"--{f.name.replace('_', '-')}", help=help, **kw)
