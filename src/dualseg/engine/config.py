"""Training configuration: frozen dataclasses, read from YAML + command-line overrides.

Config flows one way: YAML / CLI  ->  :class:`Config` (frozen)  ->  plain values into
``build_model``, ``build_dataset``, the optimizer and the loop. `jsonargparse
<https://jsonargparse.readthedocs.io>`_ maps every field to a flag, so any value of a YAML file
can be overridden on the command line::

    dualseg train --config configs/camvid_mobilenet_v2.yaml --optim.lr 0.01 --train.max_iters 100

Each spec "Reading" is a named field with the spec's default (S32 ``optim.weight_decay``,
S33 ``train.patience`` / ``train.monitor``, claim 5 ``optim.poly_power``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from dualseg.augment_defaults import (
    BLUR_PROB,
    HFLIP_PROB,
    JITTER,
    SCALE_RANGE,
    check_augment_settings,
    seed_error,
)
from dualseg.errors import ConfigError
from dualseg.io import atomic_write_text

__all__ = [
    "ARCH_NAMES",
    "Config",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
    "build_parser",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "model_kwargs",
    "parse_command",
    "save_config",
    "train_transform",
]


# The names of dualseg.models.MODELS, for the config checks: that package imports torch, which
# this module must not (``dualseg train --help`` stays light). A test keeps the two equal.
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


@dataclass(frozen=True)
class DataConfig:
    """Dataset, augmentation (spec S1) and loader settings."""

    # dataset folder (list files train.txt / val.txt or auto layout); a list [A, B] mixes
    # several datasets of one class set
    root: tuple[str, ...] | str | None = None
    preset: str | None = None  # "camvid", "voc", "cityscapes", "ade20k", "synthetic" (None: auto)
    layout: str = "auto"  # auto | list | folder | voc | cityscapes | ade20k
    label_format: str = "index"  # index: pixel values are classes; color: palette colours
    train_split: str = "train"  # split to train on (list file / folder name)
    val_split: str | None = "val"  # split to validate on (null: none; then monitor train_loss)
    crop_size: tuple[int, int] = (360, 480)  # (H, W) of training crops
    scale_range: tuple[float, float] = SCALE_RANGE  # S1 random scale factors (min, max)
    hflip_prob: float = HFLIP_PROB  # S1 horizontal flip probability
    blur_prob: float = BLUR_PROB  # S1 "filtering": Gaussian blur probability
    # S1 colour jitter strength (brightness, contrast, saturation)
    jitter: float = JITTER[0]
    samples_per_epoch: int | None = None  # S1 on-the-fly augmentation (null: dataset size)
    batch_size: int = 8  # training images per batch, per process (per GPU under torchrun)
    val_batch_size: int = 2  # images per validation batch
    num_workers: int = 4  # DataLoader worker processes (0: load in the main process)
    pin_memory: bool = True  # pinned host memory for faster copies (CUDA only)
    persistent_workers: bool = True  # keep loader workers between epochs (num_workers > 0)
    # raw label value -> class, "RAW:CLASS[,RAW:CLASS...]", e.g. "255:1" for 0/255 masks
    # (null: the dataset's own mapping, from ROOT/meta.json or the preset; docs/data.md)
    label_map: str | None = None
    # the raw label value meaning ignore, 0..255 (auto: the dataset's own; null: none)
    ignore_index: int | Literal["auto"] | None = "auto"
    check: bool = True  # scan every image/label pair before step 1 (as `dualseg data check`)


@dataclass(frozen=True)
class ModelConfig:
    """``build_model`` arguments (spec S2 readings). ``None``: the architecture's default.

    Options left at ``None`` are not passed, so an option that does not apply to ``arch``
    (``renet_layers`` for ``deeplabv3_*``) never gets in the way.
    """

    arch: str = "dualseg_resnet101"  # network name (dualseg.models.MODELS; docs/models.md)
    weights: str | None = "imagenet"  # "imagenet", a backbone file path, or None (random init)
    allow_download: bool = False  # "imagenet" may download from torchvision when online
    output_stride: int | None = None  # backbone output stride (null: 8)
    gray_branch: bool | None = None  # RGB + grayscale branches (null: true); false: RGB only
    gray_conv_init: str | None = None  # null: "sum", 1-channel first conv = summed RGB kernels
    fusion: str | None = None  # null: "scalar", two learnable branch weights
    coord_channels: bool | None = None  # add i, j, r coordinate channels (null: true)
    coord_radius: str | None = None  # how r is computed (null: "scaled", from scaled i, j)
    renet_layers: int | None = None  # ReNet (GRU sweep) modules per branch, 0-2 (null: 2)
    renet_hidden: int | None = None  # GRU units per direction (null: 150)
    renet_patch: int | None = None  # ReNet patch size (null: 1)
    # S31 GRU weight init (null: "scaled", U(±bound)); "standard": U(0, 1)
    renet_init: str | None = None
    renet_init_bound: float | None = None  # the "scaled" init's bound (null: 1/√hidden)
    # null: "none", the GRUs read the features as they are; "batch": a BatchNorm first (beyond
    # the claims)
    renet_norm: str | None = None
    # null: false, the ASPP reads the ReNet output alone (the claims); true: the backbone's
    # features beside it (beyond the claims)
    renet_skip: bool | None = None
    aspp_rates: tuple[int, ...] | None = None  # ASPP dilation rates (null: [4, 6, 8, 12])
    aspp_style: str | None = None  # null: "v2", per-rate class scores, summed
    aspp_init_std: float | None = None  # std of the ASPP weight init (null: 0.01)
    # S44 order of upsampling and softmax (null: "softmax_first", the claim; or "logits_first")
    upsample_order: str | None = None
    deeplab_rates: tuple[int, ...] | None = None  # ASPP rates of the deeplabv3_* peers only
    timm_model: str | None = None  # the timm backbone of dualseg_timm only


@dataclass(frozen=True)
class OptimConfig:
    """SGD + poly LR (claim 5) and the explicit L2 term of the objective (S32)."""

    lr: float = 0.01  # initial learning rate l_0
    momentum: float = 0.9  # SGD momentum
    nesterov: bool = False  # Nesterov momentum
    # S32 Reading: L2 = λ/(2·B·N)·Σw² over conv/linear/GRU weights, λ = weight_decay·B·N by default,
    # so the penalty's gradient equals weight decay `weight_decay`. `l2_lambda` sets λ itself.
    weight_decay: float = 1e-4
    l2_lambda: float | None = None  # λ of the L2 term itself (null: weight_decay·B·N)
    poly_power: float = 0.9  # poly LR schedule: l_t = l_0·(1 − t/T)^power
    warmup_iters: int = 0  # linear warm-up from warmup_factor·l_0 to l_0
    warmup_factor: float = 0.1  # LR factor at the start of the warm-up
    head_lr_mult: float = 1.0  # LR multiplier of the head (everything but the backbones)
    # beyond S33's plain SGD, off by default (null): rescale the gradient to this total L2 norm
    # when it is larger (torch.nn.utils.clip_grad_norm_; mmsegmentation's grad_clip max_norm)
    clip_grad_norm: float | None = None
    # S32 L1 divisor: batch_pixels, all B·N pixels of the batch (the claim); valid_pixels: the
    # labelled ones only
    l1_reduction: Literal["batch_pixels", "valid_pixels"] = "batch_pixels"
    l2_recurrent: bool = True  # the L2 term covers the recurrent (GRU) weight matrices too
    # Beyond S32, off by default (null: the S32 loss). Class weights of the cross-entropy: one per
    # class, or "median_frequency" (SegNet: median(f)/f_c from the training labels).
    class_weights: tuple[float, ...] | Literal["median_frequency"] | None = None
    # OHEM (mmseg OHEMPixelSampler): only pixels whose true-class probability < ohem_thresh count
    ohem_thresh: float | None = None
    ohem_min_kept: int = 100000  # OHEM: keep at least this many pixels per image (mmseg default)


@dataclass(frozen=True)
class TrainConfig:
    """The loop: length, validation, stopping (S33), checkpoints, speed, logging."""

    out_dir: str = "runs/train"  # run folder: config, checkpoints, metrics, curves
    max_iters: int = 40000  # training iterations (T of the poly schedule)
    val_every: int = 1000  # K: validate (and checkpoint) every K iterations; 0: at the end only
    # save last.pt every N iterations (null: = val_every; 1000 when val_every is 0)
    ckpt_every: int | None = None
    ckpt_minutes: float | None = 10.0  # also save last.pt this often, wall clock (null: off)
    log_every: int = 20  # write a metrics.jsonl record (and a log line) every N iterations
    # what patience watches (S33, "until the objective stops decreasing"); auto: val_loss with
    # a validation split, else the smoothed train_loss
    monitor: Literal["auto", "val_loss", "val_miou", "train_loss"] = "auto"
    patience: int | None = 5  # evaluations without improvement before stopping (null: off)
    min_delta: float = 0.0  # smallest change that counts as an improvement
    loss_smoothing: float = 0.9  # EMA factor of the smoothed training loss
    seed: int = 0  # seed of every random stream (init, sampling, augmentation)
    deterministic: bool = False  # deterministic kernels (bit-identical resume on CPU)
    device: str = "auto"  # auto | cpu | cuda | cuda:N (auto: CUDA when available)
    # mixed precision: auto (bf16, else fp16, on CUDA; on CPU bf16 where it is native: AVX-512
    # BF16 / AMX, else none) | none | bf16 | fp16 (bf16 on other CPUs is emulated, far slower)
    amp: Literal["auto", "none", "bf16", "fp16"] = "auto"
    channels_last: bool = True  # channels-last memory format (GPU and CPU: oneDNN convolutions)
    compile: bool = False  # torch.compile the training model
    sync_bn: bool = False  # SyncBatchNorm under DDP (GPUs only; ignored on CPU)
    progress: bool = True  # tqdm bar on a terminal (rank 0); in a log: a line every log_every
    tensorboard: bool = True  # event files when tensorboard is installed
    threads: int = 0  # torch CPU threads (0: torch's default, one per core)
    quiet: bool = False  # no progress bar and no log lines (metrics.jsonl is still written)


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# CPU threads beyond any machine's cores: larger counts crash inside OpenMP (thread creation
# fails, or its stacks exhaust memory and the error blames whatever runs next)
MAX_THREADS = 1024

SECTIONS = {"data": DataConfig, "model": ModelConfig, "optim": OptimConfig, "train": TrainConfig}

TRAIN_EXAMPLES = (
    "dualseg train --config configs/camvid_mobilenet_v2.yaml --optim.lr 0.01 --train.max_iters 100",
    "dualseg train --config configs/tiny_synthetic.yaml --data.root '[data/a, data/b]' "
    "--optim.class_weights median_frequency",
    "dualseg train --config configs/camvid_mobilenet_v2.yaml --resume auto",
)


def field_docs(cls: type) -> dict[str, str]:
    """One line per field of a config dataclass: the comment lines right above it, then the
    comment beside it — the config's own documentation, which ``dualseg train --help`` shows."""
    import ast
    import inspect
    import io
    import textwrap
    import tokenize

    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source files (a frozen install): help without descriptions
        return {}
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    docs: dict[str, str] = {}
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    previous_end = body[0].lineno - 1
    for node in body:
        end = node.end_lineno or node.lineno
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            lines = range(previous_end + 1, end + 1)
            docs[node.target.id] = " ".join(comments[n] for n in lines if n in comments)
        previous_end = end
    return docs


def build_parser(prog: str = "dualseg train", *, exit_on_error: bool = True) -> Any:
    """The ``dualseg train`` parser: ``--config FILE`` plus one flag per field, each with its
    one-line description (:func:`field_docs`), and examples at the end."""
    from jsonargparse import (
        ActionConfigFile,
        ActionYesNo,
        ArgumentParser,
        DefaultHelpFormatter,
        set_loader,
    )

    from dualseg.console import ExamplesHelpFormatter, examples

    class Formatter(ExamplesHelpFormatter, DefaultHelpFormatter):
        pass

    parser = ArgumentParser(
        prog=prog,
        description="Train a segmentation model (spec S3). Values come from --config YAML "
        "files, then from flags (--section.field value), later ones winning; a flag that a "
        "later --config sets again is refused (put --config first). Each section is a block "
        "of the YAML file (docs/training.md).",
        epilog=examples(*TRAIN_EXAMPLES),
        formatter_class=Formatter,
        exit_on_error=exit_on_error,
        # --conf / --train.out_d would pass by the checks of _config_files, which know the
        # full names only (a run trained into another folder than the one asked for)
        allow_abbrev=False,
        parser_mode=_parser_mode(set_loader),
    )
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config file")
    parser.add_class_arguments(Config, None)
    parser.add_argument(
        "--resume",
        type=str | None,
        default=None,
        help="checkpoint to resume from, or 'auto' for <train.out_dir>/last.pt when present",
    )
    parser.add_argument(
        "--overwrite",
        action=ActionYesNo,
        default=False,
        help="replace the run already in train.out_dir (without it, such a run is refused)",
    )
    parser.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        help="no progress output (the same as --train.quiet true)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the final summary as one JSON line instead of sentences (OUT/summary.json "
        "is written either way)",
    )
    docs = {f"{s}.{k}": v for s, cls in SECTIONS.items() for k, v in field_docs(cls).items()}
    for action in parser._actions:  # jsonargparse has no public setter for a field's help
        if action.dest in docs:
            action.help = docs[action.dest]
    for key, cls in SECTIONS.items():
        group = parser.groups.get(key)
        if group is not None:
            group.title = f"{key} ({(cls.__doc__ or '').strip().splitlines()[0]})"
    return parser


def _parser_mode(set_loader: Any) -> str:
    """The jsonargparse parser mode reading YAML with :func:`_yaml_load` (no base-60)."""
    set_loader("dualseg_yaml", _yaml_load, (yaml.YAMLError,))
    return "dualseg_yaml"


def _instantiate(parser: Any, ns: Any) -> Config:
    try:
        init = parser.instantiate(ns) if hasattr(parser, "instantiate") else None
        if init is None:  # jsonargparse < 4.49
            init = parser.instantiate_classes(ns)
    except (TypeError, ValueError) as err:  # e.g. a YAML section that is a number or a list
        for key in SECTIONS:
            value = getattr(ns, key, None)
            if value is not None and not hasattr(value, "items") and not hasattr(value, "__dict__"):
                raise ConfigError(
                    f"config section {key!r} must be a mapping of keys to values, got "
                    f"{value!r}; see dualseg train --help"
                ) from None
        raise ConfigError(f"invalid config: {' '.join(str(err).split())}") from None
    train = init.train
    if getattr(ns, "quiet", False):
        train = dataclasses.replace(train, quiet=True)
    cfg = Config(data=init.data, model=init.model, optim=init.optim, train=train)
    validate(cfg)
    return cfg


def parse_args(argv: list[str] | None) -> tuple[Config, str | None]:
    """Parse ``dualseg train`` arguments into a validated :class:`Config` and ``--resume``."""
    cfg, resume, _ = parse_command(argv)
    return cfg, resume


def parse_command(argv: list[str] | None) -> tuple[Config, str | None, dict[str, bool]]:
    """:func:`parse_args` plus the command's own flags: ``{"overwrite": bool, "json": bool}``.

    A bad flag or config key raises one :class:`ConfigError` naming it and the closest valid
    key (no usage dump); ``--help`` prints the help and exits as usual.
    """
    import sys

    parser = build_parser(exit_on_error=False)
    argv = list(sys.argv[1:] if argv is None else argv)
    configs = _config_files(argv)  # before jsonargparse, which lets a repeated key win
    if (overridden := _flag_overridden_by_a_later_config(argv, configs)) is not None:
        raise ConfigError(overridden)
    if (colons := _colon_number(argv, configs)) is not None:
        raise ConfigError(colons)
    try:
        ns = parser.parse_args(argv)
    except Exception as err:  # jsonargparse's ArgumentError (or a YAML / type error)
        raise ConfigError(_explain_parse_error(str(err), parser)) from None
    flags = {"overwrite": bool(ns.overwrite), "json": bool(ns.json)}
    return _instantiate(parser, ns), ns.resume, flags


def _config_files(argv: list[str]) -> list[tuple[int, str, dict[str, Any]]]:
    """Each ``--config`` of ``argv``, read once: ``(its position, its value, its mapping)``.
    A file that is unreadable, not YAML, empty, not a mapping or with an unknown section is one
    :class:`ConfigError` naming it (jsonargparse's own message names no file, which matters
    with several; and it lets a repeated key win)."""
    found = []
    options = ("config", *SECTIONS)  # --train FILE: one section's file, as jsonargparse reads it
    for j, arg in enumerate(argv):
        name, _, attached = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name not in options:
            continue
        if attached:
            value = attached
        elif j + 1 < len(argv):
            value = argv[j + 1]
        else:
            continue
        # jsonargparse also takes the YAML itself (train --resume passes a checkpoint's so)
        inline = "\n" in value or value.lstrip().startswith("{")
        if name != "config":  # its keys are the section's fields: read as {section: ...}
            section = _read_config_file(value, empty_ok=False, inline=inline, section=name)
            found.append((j, value, {name: section}))
            continue
        data = _read_config_file(value, empty_ok=False, inline=inline)
        if unknown := [k for k in data if k not in SECTIONS]:  # named here with its file
            import difflib

            key = str(unknown[0])
            close = difflib.get_close_matches(key, list(SECTIONS), n=1, cutoff=0.5)
            hint = f"did you mean {close[0]}?" if close else f"sections: {', '.join(SECTIONS)}"
            where = "the --config text" if inline else value
            if not inline:
                lines = Path(value).read_text(encoding="utf-8").splitlines()
                row = next((i for i, s in enumerate(lines, 1) if s.startswith(f"{key}:")), None)
                where += f" (line {row})" if row else ""
            raise ConfigError(f"{where}: unknown config section {key}; {hint}")
        found.append((j, value, data))
    return found


# YAML 1.1's base-60 numbers: digits joined by colons (255:1 is 15301, 1:30.5 is 90.5)
_BASE_60 = r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?"
_COLONS = re.compile(rf"(?<![\w.:]){_BASE_60}(?![\w.:])")  # one inside a flag's value


@functools.cache
def _number_fields() -> frozenset[str]:
    """``section.field`` of every field that takes numbers and no text."""
    import typing

    found = set()
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = str(hints[f.name])
            if ("int" in kind or "float" in kind) and "str" not in kind and "Literal" not in kind:
                found.add(f"{section}.{f.name}")
    return frozenset(found)


def _colon_number(argv: list[str], configs: list[tuple[int, str, dict[str, Any]]]) -> str | None:
    """A number field given digits joined by colons, in one line. jsonargparse reads them as
    YAML 1.1's base-60 numbers: ``--train.max_iters 1:30`` trained 90 iterations without a
    word (the config loader keeps them as text, for ``label_map: 255:1``)."""
    numbers = _number_fields()
    given: list[tuple[str, str, Any]] = []
    for j, arg in enumerate(argv):
        key, eq, attached = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if key in numbers and (eq or j + 1 < len(argv)):
            given.append((f"--{key}", key, attached if eq else argv[j + 1]))
    for _, value, data in configs:
        for section, fields in data.items():
            for name, v in (fields or {}).items() if isinstance(fields, dict) else ():
                if f"{section}.{name}" in numbers:
                    given.append(
                        (value if len(value) < 200 else "the --config text", f"{section}.{name}", v)
                    )
    for where, key, value in given:
        items = value if isinstance(value, list | tuple) else [value]
        if any(isinstance(v, str) and _COLONS.search(v) for v in items):
            return (
                f"{key}: {value!r} is not a number ({where}); digits joined by colons would "
                "be read as a base-60 number (1:30 as 90): write the number itself"
            )
    return None


def _flag_overridden_by_a_later_config(
    argv: list[str], configs: list[tuple[int, str, dict[str, Any]]]
) -> str | None:
    """A ``--section.field`` flag that a later ``--config`` (``configs``, from
    :func:`_config_files`) sets again, in one line. The later one wins (jsonargparse reads the
    arguments in order), so the flag was dropped without a word: ``--train.out_dir runs/new
    --overwrite --config keep.yaml`` wrote over keep.yaml's run folder, not runs/new."""
    for j, value, data in configs:
        option = argv[j].partition("=")[0]  # --config, or a section's file: --train FILE
        for flag in argv[:j]:
            if not flag.startswith("--") or "." not in flag:
                continue
            key = flag[2:].split("=", 1)[0]
            node: Any = data
            for part in key.split("."):
                if not isinstance(node, dict) or part not in node:
                    break
                node = node[part]
            else:
                return (
                    f"--{key} comes before {option} {value}, which sets {key} again and would "
                    f"win; put {option} first, then the flags that change it"
                )
    return None


def _no_base_60(loader: type, float_pattern: str) -> None:
    """Make ``loader`` read ``255:1`` as the text it is. PyYAML follows YAML 1.1, where digits
    joined by colons are a base-60 number (``255:1`` is 15301, ``1:30.5`` is 90.5), so
    ``label_map: 255:1`` (the fix the 0/255-mask message gives) was refused as an integer. The
    int resolver drops that form (YAML 1.2 has none); the float one is ``float_pattern``."""
    resolvers: dict[Any, list[tuple[str, Any]]] = {}
    for first, mappings in loader.yaml_implicit_resolvers.items():
        kept = []
        for tag, regexp in mappings:
            if tag == "tag:yaml.org,2002:timestamp":  # a date stays text (as jsonargparse's)
                continue
            if tag == "tag:yaml.org,2002:int":
                regexp = re.compile(f"(?!{_BASE_60}$){regexp.pattern}", regexp.flags)
            if tag != "tag:yaml.org,2002:float":
                kept.append((tag, regexp))
        resolvers[first] = kept
    loader.yaml_implicit_resolvers = resolvers
    loader.add_implicit_resolver(
        "tag:yaml.org,2002:float", re.compile(float_pattern, re.X), list("-+0123456789.")
    )


class _ConfigLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """The YAML reader of configs and flag values: jsonargparse's own (a safe loader; ``1e4``
    is a float, a date is text) with no base-60 numbers, so ``255:1`` is text."""


# jsonargparse's float pattern (it takes 1e4, which YAML 1.1 does not), less base-60 floats
_no_base_60(
    _ConfigLoader,
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
)


def _yaml_load(stream: str) -> Any:
    """jsonargparse's ``yaml`` loader with :class:`_ConfigLoader` (the parser mode
    ``dualseg_yaml``): a config file, ``--config`` text and each flag's value. As jsonargparse
    does, a value that reads as a mapping of bare keys (``--data.root a:``) stays text."""
    value = yaml.load(stream, Loader=_ConfigLoader)
    if isinstance(value, dict) and value and all(v is None for v in value.values()):
        if len(value) == 1 and stream.strip() == f"{next(iter(value))}:":
            return stream
        if set(stream.strip(" {}").replace(" ", "").split(",")) == set(value):
            return stream
    return value


class _UniqueKeyLoader(_ConfigLoader):
    """:class:`_ConfigLoader`, refusing a key written twice in one mapping: PyYAML (and so
    jsonargparse) keeps the last silently, so ``lr: 0.1`` ten lines above ``lr: 0.01`` trained
    with 0.01 whatever the reader of the file believed."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                where = (
                    f"on line {line}" if seen[key] == line else f"(lines {seen[key]} and {line})"
                )
                raise yaml.MarkedYAMLError(
                    problem=f"key {key!r} is written twice {where}",
                    problem_mark=key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _read_config_file(
    path: str | Path, *, empty_ok: bool = True, inline: bool = False, section: str | None = None
) -> dict[str, Any]:
    """A YAML config file's top-level mapping (``{}`` for an empty one when ``empty_ok``), or
    one :class:`ConfigError` naming the file: unreadable, not YAML (line and column), a key
    written twice in one mapping, empty, or not a mapping of sections. ``inline``: ``path``
    is the YAML text itself. ``section``: a file of that one section's fields (``--train
    FILE``)."""
    try:
        text = str(path) if inline else Path(path).read_text(encoding="utf-8")  # YAML's own
        if inline:
            path = "the --config text"
        d = yaml.load(text, Loader=_UniqueKeyLoader)  # a safe loader
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err}") from None
    except UnicodeDecodeError as err:  # an image, a checkpoint ... given as --config
        raise ConfigError(
            f"{path} is not a YAML text file (no UTF-8 at byte {err.start}); pass a config "
            "file (.yaml)"
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{path} is not valid YAML{where}: {problem}; fix the file") from None
    if empty_ok and not d:  # an empty file (or a bare 0, [], ''): no keys, as before
        return {}
    if section is not None and not isinstance(d, dict):
        raise ConfigError(
            f"{path} (--{section}) is not a {section} section: it must map {section}'s fields "
            "to their values"
        )
    if d is None:
        raise ConfigError(f"{path} is empty: give at least one section (data, model, optim, train)")
    if not isinstance(d, dict):
        raise ConfigError(
            f"{path} is not a dualseg config: its top level must map sections (data, model, "
            f"optim, train) to their keys, got {type(d).__name__}"
        )
    return d


def _valid_keys(parser: Any) -> list[str]:
    keys = []
    for action in parser._actions:
        keys += [o for o in action.option_strings if o.startswith("--")]
    return keys


def _explain_parse_error(message: str, parser: Any) -> str:
    """One line for a jsonargparse error, with the closest valid key for an unknown one."""
    import difflib
    import re

    message = " ".join(message.split())
    keys = _valid_keys(parser)
    unknown = re.search(r"unrecognized arguments: (--[\w.\-]+)", message)
    group = re.search(r"Group '(\w+)' does not accept option '([\w\-]+)'", message)
    key = None
    if unknown:
        key = unknown.group(1)
    elif group:
        key = f"--{group.group(1)}.{group.group(2)}"
    section = re.search(r"Option '(\w+)\.[\w\-]+' is not accepted", message)
    if key is None and section and section.group(1) not in SECTIONS:
        close = difflib.get_close_matches(section.group(1), list(SECTIONS), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]}?" if close else f"sections: {', '.join(SECTIONS)}"
        return f"unknown config section {section.group(1)}; {hint}"
    if key is None and (typed := _type_error(message)):
        return typed
    if key is None:
        return f"invalid arguments: {message}; see dualseg train --help"
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    top = [k for k in keys if "." not in k]
    if unknown and "." not in key and not difflib.get_close_matches(key, top, n=1, cutoff=0.8):
        # --out, --lr: a field's name without its section (not a command flag misspelled)
        name = key[2:].replace("-", "_")
        fields = {k.rsplit(".", 1)[1]: k for k in keys if "." in k}
        near = sorted((f for f in fields if f.startswith(name)), key=len)
        near = near or difflib.get_close_matches(name, list(fields), n=1, cutoff=0.6)
        close = [fields[near[0]]] if near else close
    if group:  # a YAML key: name keys as YAML writes them
        key, close = key[2:], [c[2:] for c in close]
    hint = f"; did you mean {close[0]}?" if close else "; see dualseg train --help"
    return f"unknown {'flag' if unknown else 'config key'} {key}{hint}"


def _type_error(message: str) -> str | None:
    """jsonargparse's type errors (``Parser key "train.patience": Does not validate against any
    of the Union subtypes ...``) as one plain line: the key, the value, what it takes."""
    import re

    found = re.search(r'Parser key "([\w.]+)":', message)
    # the value as given: a union's last line ("Given value: [1, 'x']"), else "Got value: x"
    given = re.findall(r"Given value: (.*)", message) or re.findall(r"Got value: (.*)", message)
    if found is None or not given:
        return None
    key, body, value = found.group(1), message[found.end() :], given[-1]

    def plain(kind: str) -> str:
        kind = kind.strip()
        if kind.startswith("typing.Literal["):
            return " | ".join(re.findall(r"'([^']*)'", kind))
        if sized := re.fullmatch(r"tuple with (\d+) elements?", kind):
            n = int(sized.group(1))
            return f"a list of {n}, e.g. {list(range(1, n + 1))}"
        if kind.startswith(("tuple[", "<class 'tuple'>", "list[")):
            return "a list, e.g. [1, 2]"
        names = {"NoneType": "null", "int": "an integer", "float": "a number", "str": "text",
                 "bool": "true | false"}  # fmt: skip
        cls = re.fullmatch(r"<class '(\w+)'>", kind)
        return names.get(cls.group(1), cls.group(1)) if cls else kind

    union = re.search(r"Subtypes: \[(.*?)\] Errors:", body)
    if union:
        kinds = re.split(r", (?=<class|typing|tuple|list)", union.group(1))
    else:
        kinds = re.findall(r"Expected a (.*?)(?:\. |$)", body)[:1]
    takes = " or ".join(dict.fromkeys(plain(k) for k in kinds)) or "another value"
    return f"{key}: {value.strip()!r} is not valid; it takes {takes} (see dualseg train --help)"


def config_from_dict(d: dict[str, Any]) -> Config:
    """A :class:`Config` from a plain dict (a checkpoint's ``config``, a test), validated."""
    parser = build_parser(exit_on_error=False)
    sections = {k: v for k, v in d.items() if k in ("data", "model", "optim", "train")}
    try:
        ns = parser.parse_object(sections)
    except Exception as err:  # jsonargparse's ArgumentError: name the bad key, no traceback
        raise ConfigError(f"invalid config: {str(err).strip()}") from err
    return _instantiate(parser, ns)


def load_config(path: str | Path, **overrides: dict[str, Any]) -> Config:
    """Read a YAML config; ``overrides`` are per-section dicts, e.g. ``train={"max_iters": 5}``."""
    d = _read_config_file(path)
    for section, values in overrides.items():
        if not isinstance(d.setdefault(section, {}), dict):
            raise ConfigError(f"{path}: section {section!r} must be a mapping of keys to values")
        d[section].update(values)
    return config_from_dict(d)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain dict (lists instead of tuples): YAML, JSON and checkpoints take it as is."""

    def plain(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [plain(x) for x in v]
        return v

    return plain(dataclasses.asdict(cfg))


def config_changes(old: dict[str, Any], new: Config) -> dict[str, tuple[Any, Any]]:
    """``{"section.field": (old value, new value)}`` for each field of ``new`` that differs from
    the plain dict ``old`` (a checkpoint's ``config``, a run's ``config.yaml``), in field order:
    what a resume changes, said rather than silent. A field ``old`` lacks (a run written before
    it existed) is not reported."""
    changes = {}
    for section, fields in config_to_dict(new).items():
        before = old.get(section) or {}
        for key, value in fields.items():
            if key in before and before[key] != value:
                changes[f"{section}.{key}"] = (before[key], value)
    return changes


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (atomic); ``dualseg train --config`` reads it back."""
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    atomic_write_text(path, text)


def model_kwargs(cfg: ModelConfig, num_classes: int) -> dict[str, Any]:
    """The keyword arguments for ``build_model(cfg.arch, **kwargs)``: the options that are set
    (``None`` means ``build_model``'s default, so it is left out), tuples kept as tuples.

    ``weights`` / ``allow_download`` are not included: checkpoints carry their own weights.
    """
    kwargs: dict[str, Any] = {"num_classes": int(num_classes)}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name not in ("arch", "weights", "allow_download") and value is not None:
            kwargs[f.name] = value
    return kwargs


def train_transform(d: DataConfig) -> Any:
    """The training augmentation (spec S1) that ``d`` describes: its fields as named values
    into ``build_train_transform`` (one jitter strength for brightness, contrast, saturation)."""
    from dualseg.data.transforms import build_train_transform

    return build_train_transform(
        crop_size=tuple(d.crop_size),
        scale_range=tuple(d.scale_range),
        hflip_prob=d.hflip_prob,
        blur_prob=d.blur_prob,
        jitter=(d.jitter, d.jitter, d.jitter, 0.0),  # brightness, contrast, saturation; no hue
    )


def _check_no_missing_values(cfg: Config) -> None:
    """A YAML key left blank reads as null: refuse it where the field takes no null (else a
    TypeError surfaces deep inside, or null is written back into config.yaml)."""
    import types
    import typing

    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            nullable = hint is Any or (
                typing.get_origin(hint) in (typing.Union, types.UnionType)
                and type(None) in typing.get_args(hint)
            )
            if getattr(getattr(cfg, section), f.name) is None and not nullable:
                missing = f.default is dataclasses.MISSING
                default = f.default_factory() if missing else f.default  # type: ignore[misc]
                raise ConfigError(
                    f"{section}.{f.name} has no value (null, or a YAML key left blank): give "
                    f"one (default {default!r}), or leave the key out"
                )


def validate(cfg: Config) -> None:
    """Reject values that would fail late or silently (one clear ConfigError each)."""
    _check_no_missing_values(cfg)
    t, o, d = cfg.train, cfg.optim, cfg.data
    inf = float("inf")
    checks = [
        (bool(t.out_dir.strip()), "train.out_dir is empty: give the run folder"),
        (
            bool(d.train_split.strip()) and (d.val_split is None or bool(d.val_split.strip())),
            "data.train_split / data.val_split is an empty name: give a split (train, val, "
            "a list file's stem), or null for no validation split",
        ),
        (
            cfg.model.arch in ARCH_NAMES,
            f"model.arch: unknown model {cfg.model.arch!r}; choose one of: "
            + ", ".join(ARCH_NAMES),
        ),
        (
            cfg.model.weights is None
            or cfg.model.weights.lower() not in ("none", "random")
            or Path(cfg.model.weights).is_file(),
            f"model.weights {cfg.model.weights!r} is no file; for random initialization give "
            "null (--model.weights null), for ImageNet weights 'imagenet'",
        ),
        (t.max_iters > 0, "train.max_iters must be > 0"),
        (t.val_every >= 0, "train.val_every must be >= 0 (0: validate at the end only)"),
        (t.ckpt_every is None or t.ckpt_every > 0, "train.ckpt_every must be > 0 or null"),
        (t.log_every > 0, "train.log_every must be > 0"),
        (
            0 <= t.threads <= MAX_THREADS,
            f"train.threads must be 0..{MAX_THREADS} (0: torch's default)",
        ),
        (t.patience is None or t.patience > 0, "train.patience must be > 0 or null"),
        (0.0 <= t.loss_smoothing < 1.0, "train.loss_smoothing must be in [0, 1)"),
        # NaN: no evaluation ever improves (an early stop while improving); < 0: every one does
        (0 <= t.min_delta < inf, "train.min_delta must be >= 0 and finite"),
        # inf passed a plain > 0: one step made every weight NaN, and the run still ended "done"
        (0 < o.lr < float("inf"), "optim.lr must be > 0 and finite"),
        (0.0 <= o.momentum < 1.0, "optim.momentum must be in [0, 1)"),
        # YAML's .inf / .nan pass a plain >= 0 (an infinite L2 or poly power stops training)
        (0 <= o.weight_decay < inf, "optim.weight_decay must be >= 0 and finite"),
        (o.l2_lambda is None or 0 <= o.l2_lambda < inf, "optim.l2_lambda must be >= 0 and finite"),
        (0 <= o.poly_power < inf, "optim.poly_power must be >= 0 and finite"),
        (o.warmup_iters >= 0, "optim.warmup_iters must be >= 0"),
        (0.0 < o.warmup_factor <= 1.0, "optim.warmup_factor must be in (0, 1]"),
        (0 < o.head_lr_mult < float("inf"), "optim.head_lr_mult must be > 0 and finite"),
        (
            o.clip_grad_norm is None or o.clip_grad_norm > 0,
            f"optim.clip_grad_norm must be > 0, or null for no clipping; got {o.clip_grad_norm}",
        ),
        (o.ohem_thresh is None or 0 < o.ohem_thresh <= 1, "optim.ohem_thresh must be in (0, 1]"),
        (o.ohem_min_kept >= 0, "optim.ohem_min_kept must be >= 0"),
        (
            o.ohem_thresh is not None or o.ohem_min_kept == OptimConfig.ohem_min_kept,
            f"optim.ohem_min_kept {o.ohem_min_kept} does nothing without optim.ohem_thresh "
            "(OHEM is off); set --optim.ohem_thresh (e.g. 0.7) too, or drop ohem_min_kept",
        ),
        (d.batch_size > 0, "data.batch_size must be > 0"),
        (d.val_batch_size > 0, "data.val_batch_size must be > 0"),
        (
            d.batch_size != 1 or not cfg.model.arch.startswith("deeplabv3_"),
            f"data.batch_size 1 cannot train {cfg.model.arch}: its image-pooling BatchNorm "
            "needs 2 or more images per batch; set --data.batch_size 2 or more",
        ),
        (d.num_workers >= 0, "data.num_workers must be >= 0"),
        (min(d.crop_size) > 0, "data.crop_size must be positive (H, W)"),
        (
            d.ignore_index in (None, "auto") or 0 <= int(d.ignore_index) <= 255,
            "data.ignore_index must be a raw label value 0..255, null (none) or auto",
        ),
        (t.ckpt_minutes is None or t.ckpt_minutes >= 0, "train.ckpt_minutes must be >= 0"),
        (
            t.monitor in ("auto", "train_loss") or t.patience is None or bool(d.val_split),
            f"train.monitor={t.monitor} needs data.val_split; set --train.monitor train_loss",
        ),
    ]
    if (problem := seed_error(t.seed, "train.seed")) is not None:
        checks.insert(0, (False, problem))
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    augment = ("crop_size", "scale_range", "hflip_prob", "blur_prob", "jitter")
    check_augment_settings(
        crop_size=tuple(d.crop_size),
        scale_range=tuple(d.scale_range),
        hflip_prob=d.hflip_prob,
        blur_prob=d.blur_prob,
        jitter=d.jitter,
        names={k: f"data.{k}" for k in augment},
    )
    if d.label_map is not None:
        from dualseg.data.presets import parse_label_map

        try:
            parse_label_map(d.label_map)
        except ValueError as err:
            raise ConfigError(f"data.label_map: {err}") from None
    _check_model_builds(cfg.model)


def _check_model_builds(m: ModelConfig) -> None:
    """Build the model once on the meta device (no memory, no weights, no random numbers
    drawn), so that a bad ``model.*`` value fails here, in one line naming it, before any
    output is written."""
    import torch

    from dualseg.models import build_model

    if m.arch not in ARCH_NAMES:
        return  # already refused above
    try:
        with torch.device("meta"):
            build_model(m.arch, weights=None, **model_kwargs(m, num_classes=2))
    except ConfigError as err:
        text = str(err)
        named = text.split(" ", 1)[0] in {f.name for f in dataclasses.fields(ModelConfig)}
        raise ConfigError(f"{'model.' if named else ''}{text} ({m.arch})") from None
