"""Training options: frozen dataclasses, one per section; each field's default, ``--help``
line and rule are written here once (YAML / CLI in :mod:`dualseg.engine.config`)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dualseg.augment_defaults import (
    BLUR_PROB,
    HFLIP_PROB,
    JITTER,
    SCALE_RANGE,
    check_augment_settings,
    seed_error,
)
from dualseg.errors import ConfigError

# dualseg.models.MODELS' names, written out so this module imports no torch (the ONNX runtime
# reads MAX_THREADS through it); tests/models/test_factory_defaults.py keeps the two equal
ARCH_NAMES = (
    "dualseg_resnet18",
    "dualseg_resnet34",
    "dualseg_resnet50",
    "dualseg_resnet101",
    "dualseg_mobilenet_v2",
    "dualseg_timm",
    "deeplabv3_resnet18",
    "deeplabv3_resnet50",
    "deeplabv3_resnet101",
    "deeplabv3_mobilenet_v2",
)
# larger thread counts crash inside OpenMP
MAX_THREADS = 1024
INF = math.inf
# rules of a field's value (null is always allowed where the type takes it)
POSITIVE = (lambda v: 0 < v < INF, "> 0 and finite")
NON_NEGATIVE = (lambda v: 0 <= v < INF, ">= 0 and finite")
FRACTION = (lambda v: 0 <= v < 1, "in [0, 1)")
SHARE = (lambda v: 0 < v <= 1, "in (0, 1]")
COUNT = (lambda v: v > 0, "> 0")


def opt(default: Any, help: str, rule: tuple[Any, str] | None = None) -> Any:
    """A config field: its default, its ``--help`` line and its rule, side by side."""
    return field(default=default, metadata={"help": help, "rule": rule})


def _check(section: Any) -> None:
    """Each field's rule (a null only where the field takes one)."""
    name = type(section).__name__.removesuffix("Config").lower()
    for f in dataclasses.fields(section):
        value, rule = getattr(section, f.name), f.metadata.get("rule")
        if value is None and "None" not in str(f.type):
            raise ConfigError(
                f"{name}.{f.name} has no value (null, or a YAML key left blank): give one "
                f"(default {f.default!r}), or leave the key out"
            )
        if value is not None and rule is not None and not rule[0](value):
            raise ConfigError(f"{name}.{f.name} must be {rule[1]}, got {value!r}")


@dataclass(frozen=True)
class DataConfig:
    """dataset, augmentation (spec S1) and loader"""

    root: tuple[str, ...] | str | None = opt(
        None, "dataset folder (auto layout or list files); a list [A, B] mixes datasets"
    )
    preset: str | None = opt(None, "camvid | voc | cityscapes | ade20k | synthetic (null: auto)")
    layout: str = opt("auto", "auto | list | folder | voc | cityscapes | ade20k")
    label_format: str = opt("index", "index: pixel values are classes; color: palette colours")
    train_split: str = opt("train", "split to train on (list file / folder name)")
    val_split: str | None = opt("val", "split to validate on (null: none)")
    val_fraction: float = opt(
        0.0, "hold out this fraction of the training images (by file name) as the val split",
        FRACTION,
    )  # fmt: skip
    crop_size: tuple[int, int] = opt((360, 480), "(H, W) of training crops")
    scale_range: tuple[float, float] = opt(SCALE_RANGE, "S1 random scale factors (min, max)")
    hflip_prob: float = opt(HFLIP_PROB, "S1 horizontal flip probability")
    blur_prob: float = opt(BLUR_PROB, "S1 'filtering': Gaussian blur probability")
    jitter: float = opt(JITTER[0], "S1 colour jitter strength (brightness, contrast, saturation)")
    samples_per_epoch: int | None = opt(None, "S1 on-the-fly augmentation (null: dataset size)")
    batch_size: int = opt(8, "training images per batch, per process", COUNT)
    val_batch_size: int = opt(2, "images per validation batch", COUNT)
    num_workers: int | Literal["auto"] = opt(
        "auto", "loader worker processes (auto: min(4, cores - 1); 0: the main process)",
        (lambda v: v == "auto" or v >= 0, ">= 0 or auto"),
    )  # fmt: skip
    pin_memory: bool = opt(True, "pinned host memory (CUDA only)")
    persistent_workers: bool = opt(True, "keep loader workers between epochs")
    label_map: str | None = opt(
        None, "raw label value -> class, 'RAW:CLASS[,RAW:CLASS...]', e.g. '255:1' (docs/data.md)"
    )
    ignore_index: int | Literal["auto"] | None = opt(
        "auto", "the raw label value meaning ignore, 0..255 (auto: the dataset's; null: none)",
        (lambda v: v == "auto" or 0 <= v <= 255, "a raw label value 0..255, null (none) or auto"),
    )  # fmt: skip
    bit_depth: int | None = opt(
        None, "bits per sample of 16-bit images, 8..16 (null: 12 when all values <= 4095, else 16)",
        (lambda v: 8 <= v <= 16, "8..16 (bits per sample of 16-bit images) or null"),
    )  # fmt: skip
    check: bool = opt(True, "scan every image/label pair before step 1 (as dualseg data check)")

    def __post_init__(self) -> None:
        _check(self)
        if not self.train_split.strip() or self.val_split == "":
            raise ConfigError(
                "data.train_split / data.val_split is an empty name: give a split, or null for "
                "no validation split"
            )
        augment = ("crop_size", "scale_range", "hflip_prob", "blur_prob", "jitter")
        check_augment_settings(
            **{k: getattr(self, k) for k in augment}, names={k: f"data.{k}" for k in augment}
        )
        if self.label_map is not None:
            from dualseg.data.presets import parse_label_map

            try:
                parse_label_map(self.label_map)
            except ValueError as err:
                raise ConfigError(f"data.label_map: {err}") from None

    @property
    def workers(self) -> int:
        """``num_workers`` with ``auto`` fitted to this machine (no more than its cores)."""
        if self.num_workers == "auto":
            return max(0, min(4, (os.cpu_count() or 1) - 1))
        return int(self.num_workers)


@dataclass(frozen=True)
class ModelConfig:
    """build_model arguments (spec S2); null: the architecture's default"""

    arch: str = opt(
        "dualseg_mobilenet_v2", "network name (docs/models.md)",
        (lambda v: v in ARCH_NAMES, "one of " + ", ".join(ARCH_NAMES)),
    )  # fmt: skip
    weights: str | None = opt(
        "imagenet", "'imagenet', a backbone file, or null (random init)",
        (lambda v: v.lower() not in ("none", "random") or Path(v).is_file(),
         "'imagenet', a file, or null (--model.weights null) for random initialization"),
    )  # fmt: skip
    allow_download: bool = opt(False, "'imagenet' may download from torchvision when online")
    output_stride: int | None = opt(None, "backbone output stride")
    gray_branch: bool | None = opt(None, "RGB + grayscale branches; false: RGB only")
    gray_conv_init: str | None = opt(None, "init of the 1-channel first conv")
    fusion: str | None = opt(None, "how the two branches are fused")
    coord_channels: bool | None = opt(None, "add i, j, r coordinate channels")
    coord_radius: str | None = opt(None, "how r is computed")
    renet_layers: int | None = opt(None, "ReNet (GRU sweep) modules per branch, 0-2")
    renet_hidden: int | None = opt(None, "GRU units per direction")
    renet_patch: int | None = opt(None, "ReNet patch size")
    renet_init: str | None = opt(None, "S31 GRU weight init: scaled | standard")
    renet_init_bound: float | None = opt(None, "the scaled init's bound")
    renet_norm: str | None = opt(None, "none | batch: a BatchNorm before the GRUs")
    renet_skip: bool | None = opt(None, "the ASPP reads the backbone's features beside ReNet's")
    aspp_rates: tuple[int, ...] | None = opt(None, "ASPP dilation rates")
    aspp_style: str | None = opt(None, "ASPP style (v2: per-rate class scores, summed)")
    aspp_init_std: float | None = opt(None, "std of the ASPP weight init")
    upsample_order: str | None = opt(None, "S44: softmax_first | logits_first")
    deeplab_rates: tuple[int, ...] | None = opt(None, "ASPP rates of the deeplabv3_* peers")
    timm_model: str | None = opt(None, "the timm backbone of dualseg_timm")

    def __post_init__(self) -> None:
        _check(self)


@dataclass(frozen=True)
class OptimConfig:
    """SGD + poly LR (claim 5) and the explicit L2 term of the objective (S32)"""

    lr: float = opt(0.01, "initial learning rate l_0", POSITIVE)
    momentum: float = opt(0.9, "SGD momentum", FRACTION)
    nesterov: bool = opt(False, "Nesterov momentum")
    weight_decay: float = opt(
        1e-4, "S32: L2 = λ/(2·B·N)·Σw² with λ = weight_decay·B·N", NON_NEGATIVE
    )
    l2_lambda: float | None = opt(
        None, "λ of the L2 term itself (null: weight_decay·B·N)", NON_NEGATIVE
    )
    poly_power: float = opt(0.9, "poly LR: l_t = l_0·(1 − t/T)^power", NON_NEGATIVE)
    warmup_iters: int = opt(
        0, "linear warm-up from warmup_factor·l_0 to l_0", (lambda v: v >= 0, ">= 0")
    )
    warmup_factor: float = opt(0.1, "LR factor at the start of the warm-up", SHARE)
    head_lr_mult: float = opt(1.0, "LR multiplier of the head (all but the backbones)", POSITIVE)
    clip_grad_norm: float | None = opt(
        None, "clip the gradient to this L2 norm (null: off)", (COUNT[0], "> 0, or null for off")
    )
    l1_reduction: Literal["batch_pixels", "valid_pixels"] = opt(
        "batch_pixels", "S32 L1 divisor: all B·N pixels, or the labelled ones"
    )
    l2_recurrent: bool = opt(True, "the L2 term covers the GRU weight matrices too")
    class_weights: tuple[float, ...] | Literal["median_frequency"] | None = opt(
        None,
        "Beyond S32, off by default: cross-entropy weights, one per class, or median_frequency",
        (lambda v: v == "median_frequency" or (all(0 <= w < INF for w in v) and sum(v) > 0),
         "median_frequency or one weight per class, >= 0 (not NaN or infinite), not all 0"),
    )  # fmt: skip
    ohem_thresh: float | None = opt(
        None, "OHEM: only pixels with true-class prob < this count", SHARE
    )
    ohem_min_kept: int = opt(
        100000, "OHEM: keep at least this many pixels per image", (lambda v: v >= 0, ">= 0")
    )

    def __post_init__(self) -> None:
        _check(self)
        if self.ohem_thresh is None and self.ohem_min_kept != 100000:
            raise ConfigError(
                f"optim.ohem_min_kept {self.ohem_min_kept} does nothing without "
                "optim.ohem_thresh (OHEM is off); set --optim.ohem_thresh (e.g. 0.7) too"
            )


@dataclass(frozen=True)
class TrainConfig:
    """the loop: length, validation, stopping (S33), checkpoints, speed, logging"""

    out_dir: str = opt(
        "runs/train", "run folder: config, checkpoints, metrics, curves",
        (lambda v: bool(v.strip()), "the run folder, not empty"),
    )  # fmt: skip
    max_iters: int = opt(40000, "training iterations (T of the poly schedule)", COUNT)
    val_every: int = opt(
        1000, "validate and checkpoint every K iterations (0: at the end)",
        (lambda v: v >= 0, ">= 0 (0: at the end only)"),
    )  # fmt: skip
    ckpt_every: int | None = opt(None, "save last.pt every N iterations (null: val_every)", COUNT)
    ckpt_minutes: float | None = opt(10.0, "also save last.pt this often, wall clock", NON_NEGATIVE)
    log_every: int = opt(20, "a metrics.jsonl record (and a log line) every N iterations", COUNT)
    monitor: Literal["auto", "val_loss", "val_miou", "train_loss"] = opt(
        "auto", "what patience watches (S33; auto: val_loss, else smoothed train_loss)"
    )
    patience: int | None = opt(5, "evaluations without improvement before stopping", COUNT)
    # NaN: no evaluation would ever improve
    min_delta: float = opt(0.0, "smallest change that counts as an improvement", NON_NEGATIVE)
    loss_smoothing: float = opt(0.9, "EMA factor of the smoothed training loss", FRACTION)
    seed: int = opt(
        0, "seed of every random stream (init, sampling, augmentation)",
        (lambda v: seed_error(v, "train.seed") is None, "in 0..4294967295"),
    )  # fmt: skip
    deterministic: bool = opt(False, "deterministic kernels (bit-identical resume on CPU)")
    device: str = opt("auto", "auto | cpu | cuda | cuda:N")
    amp: Literal["auto", "none", "bf16", "fp16"] = opt(
        "auto", "mixed precision (auto: bf16/fp16 on CUDA, bf16 on CPUs computing it natively)"
    )
    channels_last: bool = opt(True, "channels-last memory format")
    compile: bool = opt(False, "torch.compile the training model")
    sync_bn: bool = opt(False, "SyncBatchNorm under DDP (GPUs only)")
    progress: bool = opt(True, "tqdm bar on a terminal; in a log: a line every log_every")
    tensorboard: bool = opt(True, "event files when tensorboard is installed")
    threads: int = opt(
        0, "torch CPU threads (0: torch's default)",
        (lambda v: 0 <= v <= MAX_THREADS, f"0..{MAX_THREADS} (0: torch's default)"),
    )  # fmt: skip
    quiet: bool = opt(False, "no progress bar and no log lines (metrics.jsonl is still written)")

    def __post_init__(self) -> None:
        _check(self)


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        validate(self)


def validate(cfg: Config) -> None:
    """The rules that span sections (each section checks its own when built)."""
    d, t, arch = cfg.data, cfg.train, cfg.model.arch
    if d.batch_size == 1 and arch.startswith("deeplabv3_"):
        raise ConfigError(
            f"data.batch_size 1 cannot train {arch}: its image-pooling BatchNorm needs 2 or "
            "more images per batch; set --data.batch_size 2 or more"
        )
    has_val = d.val_split or d.val_fraction > 0
    if t.monitor not in ("auto", "train_loss") and t.patience is not None and not has_val:
        raise ConfigError(
            f"train.monitor={t.monitor} needs data.val_split; set --train.monitor train_loss"
        )


SECTIONS = {"data": DataConfig, "model": ModelConfig, "optim": OptimConfig, "train": TrainConfig}


def field_docs(cls: type) -> dict[str, str]:
    """Each field's ``--help`` line."""
    return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(cls)}


# --------------------------------------------------------------------------- values
def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain dict (lists instead of tuples): YAML, JSON and checkpoints take it as is."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def config_changes(old: dict[str, Any], new: Config) -> dict[str, tuple[Any, Any]]:
    """``{"section.field": (old, new)}`` for each field of ``new`` that differs from ``old``."""
    return {
        f"{section}.{key}": ((old.get(section) or {})[key], value)
        for section, fields in config_to_dict(new).items()
        for key, value in fields.items()
        if key in (old.get(section) or {}) and old[section][key] != value
    }


def model_kwargs(cfg: ModelConfig, num_classes: int) -> dict[str, Any]:
    """``build_model(cfg.arch, **kwargs)``'s options that are set (None: the model's default);
    ``weights`` / ``allow_download`` are left out (checkpoints carry their own weights)."""
    skip = ("arch", "weights", "allow_download")
    kwargs = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in skip and v is not None}
    return {"num_classes": int(num_classes), **kwargs}


def train_transform(d: DataConfig) -> Any:
    """The training augmentation (spec S1) that ``d`` describes."""
    from dualseg.data.transforms import build_train_transform

    return build_train_transform(
        crop_size=tuple(d.crop_size),
        scale_range=tuple(d.scale_range),
        hflip_prob=d.hflip_prob,
        blur_prob=d.blur_prob,
        jitter=(d.jitter, d.jitter, d.jitter, 0.0),  # brightness, contrast, saturation; no hue
    )
