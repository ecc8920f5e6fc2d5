"""What ``fit`` prepares and checks before its first step: the data scan, datasets, loaders,
resume checks and ``--resume``'s config; and the notes of a validation line."""

from __future__ import annotations

import math
import os
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader

from dualseg.console import ProgressMode
from dualseg.data import build_dataset
from dualseg.data.check import check_dataset, require_trainable
from dualseg.data.collate import SameSizeCollate
from dualseg.data.presets import parse_label_map
from dualseg.engine import checkpoint as ckpt_io
from dualseg.engine.config import parse_command
from dualseg.engine.distributed import DistEnv, ResumableSampler, SeededSamples
from dualseg.engine.evaluation import sanity_warnings
from dualseg.engine.options import Config, DataConfig, model_kwargs, train_transform
from dualseg.errors import CheckpointError, ConfigError, DataError, RunExistsError
from dualseg.models import build_model


def dataset_options(d: DataConfig) -> dict[str, Any]:
    """How ``build_dataset`` / ``check_dataset`` read ``d``'s folders."""
    return {
        "layout": d.layout,
        "preset": d.preset,
        "label_format": d.label_format,
        "bit_depth": d.bit_depth,
        "label_map": parse_label_map(d.label_map) if d.label_map else None,
        "ignore_value": d.ignore_index,
    }


def check_training_data(
    d: DataConfig, *, progress: ProgressMode = "off", warn: bool = True
) -> None:
    """Scan every pair of ``d``'s training and validation splits: one ``DataError`` if bad;
    absent classes, overlapping splits and padded crops are warnings."""
    if not d.check or not d.root:
        return
    # a held-out fraction is part of the training split's files
    named = (d.train_split,) if d.val_fraction > 0 else (d.train_split, d.val_split)
    splits = tuple(dict.fromkeys(s for s in named if s))
    report = check_dataset(d.root, splits=splits, progress=progress, **dataset_options(d))
    require_trainable(report, d.train_split)
    padded = padded_crop(d, report.largest.get(d.train_split))
    for warning in (report.absent_classes, report.split_overlap, padded):
        if warning and warn:
            print(f"dualseg train: warning: {warning}", file=sys.stderr)


def padded_crop(d: DataConfig, largest: tuple[int, int] | None) -> str | None:
    """A line when over half of every crop would be ignore padding."""
    if not largest or min(largest) == 0:
        return None
    hi = max(d.scale_range)
    h, w = (round(v * hi) for v in largest)
    ch, cw = d.crop_size
    if min(ch, h) * min(cw, w) >= 0.5 * ch * cw:
        return None
    return (
        f"data.crop_size [{ch}, {cw}] is larger than every training image ({h}x{w} at the "
        f"largest scale {hi:g}): over half of every crop is ignore padding; use a crop of at "
        f"most [{min(ch, h)}, {min(cw, w)}]"
    )


def scored_classes_note(metrics: Mapping[str, Any], class_names: Sequence[str]) -> str:
    """``" (1 class scored: 'a'; ...)"`` when the mIoU averages a single class, else ``""``."""
    scored = [i for i, v in enumerate(metrics.get("iou", ())) if not math.isnan(float(v))]
    if len(scored) != 1:
        return ""
    return f" (1 class scored: {class_names[scored[0]]!r}; the labels hold no other class)"


def baseline_note(metrics: Mapping[str, Any], class_names: Sequence[str]) -> str:
    """The validation line's note: the majority-class baseline, and :func:`sanity_warnings`."""
    base = metrics["majority_baseline_miou"]
    if math.isnan(base):
        return ""
    warnings = [f"; {w}" for w in sanity_warnings(dict(metrics), class_names)]
    return "".join([f" (majority-class baseline {100 * base:.1f}%)", *warnings])


def refuse_rewind(out_dir: Path, resume: str | None) -> None:
    """Refuse resuming a folder from its own older ``best.pt`` (unless ``--overwrite``)."""
    best, last = out_dir / ckpt_io.BEST_NAME, out_dir / ckpt_io.LAST_NAME
    if resume in (None, "auto") or not last.is_file() or Path(resume).resolve() != best.resolve():
        return
    at_best = int(ckpt_io.load_checkpoint(best).get("iteration", 0))
    try:
        at_last = int(ckpt_io.load_checkpoint(last).get("iteration", 0))
    except CheckpointError:  # a broken last.pt: best.pt is the way back
        return
    if at_last > at_best:
        raise RunExistsError(
            f"--resume {resume} (iteration {at_best}) would rewind the run in {out_dir}: its "
            f"{ckpt_io.LAST_NAME} (iteration {at_last}) and later log records would be "
            f"replaced; resume from {last}, pass --overwrite to go back to iteration {at_best}, "
            "or choose another --train.out_dir"
        )


def build_datasets(cfg: Config) -> tuple[Any, Any | None]:

    d = cfg.data
    if not d.root:
        raise ConfigError("no dataset: set data.root in the config or pass --data.root PATH")
    common = dataset_options(d)
    if d.val_fraction > 0:  # a held-out part of the training split, by file name
        common["val_fraction"] = d.val_fraction
    train_ds = build_dataset(
        d.root,
        split=d.train_split,
        transform=train_transform(d),
        samples_per_epoch=d.samples_per_epoch,
        seed=cfg.train.seed,
        **common,
    )
    val_split = "val" if d.val_fraction > 0 else d.val_split
    val_ds = build_dataset(d.root, split=val_split, **common) if val_split else None
    if val_ds is not None and sorted(val_ds.samples) == sorted(train_ds.samples):
        raise ConfigError(
            f"data.val_split {d.val_split!r} resolves to the training images (split "
            f"{d.train_split!r} of {d.root}): validating on them would say nothing; add a "
            "val split, set --data.val_fraction 0.2, or --data.val_split null"
        )
    return train_ds, val_ds


def build_loaders(
    cfg: Config, env: DistEnv, train_ds: Any, val_ds: Any | None
) -> tuple[DataLoader, ResumableSampler, DataLoader | None]:
    d, seed = cfg.data, cfg.train.seed
    sampler = ResumableSampler(train_ds, num_replicas=env.world_size, rank=env.rank, seed=seed)
    if sampler.num_samples < d.batch_size:
        raise DataError(
            f"the training split has {sampler.num_samples} images per process, fewer than "
            f"data.batch_size={d.batch_size}; lower the batch size or set data.samples_per_epoch"
        )
    # the loaders' own generator: a new iterator never shifts the training RNG stream
    common = {
        "num_workers": d.workers,
        "pin_memory": d.pin_memory and env.device.type == "cuda",
        "persistent_workers": d.workers > 0 and d.persistent_workers,
        "generator": torch.Generator().manual_seed(seed),
    }
    train_loader = DataLoader(
        SeededSamples(train_ds, seed=seed),
        batch_size=d.batch_size,
        sampler=sampler,
        drop_last=True,
        **common,
    )
    val_loader = None
    if val_ds is not None:
        val_loader = DataLoader(
            val_ds,
            batch_size=d.val_batch_size,
            sampler=range(env.rank, len(val_ds), env.world_size),  # each rank's share, unpadded
            collate_fn=SameSizeCollate("set --data.val_batch_size 1"),
            **common,
        )
    return train_loader, sampler, val_loader


def seed_everything(seed: int, deterministic: bool, device: torch.device) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = not deterministic
        if deterministic:  # CPU kernels are deterministic already
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)


def build_train_model(cfg: Config, num_classes: int, *, pretrained: bool) -> nn.Module:
    m = cfg.model
    weights = m.weights if pretrained else None
    kwargs = model_kwargs(m, num_classes)
    try:
        return build_model(m.arch, weights=weights, allow_download=m.allow_download, **kwargs)
    except ConfigError as err:  # name the option as the config spells it
        named = str(err).split(" ", 1)[0] in kwargs
        raise ConfigError(f"{'model.' if named else ''}{err} ({m.arch})") from None


def train_command(argv: list[str]) -> tuple[Config, str | None, dict[str, bool]]:
    """:func:`parse_command`, where ``--resume`` without ``--config`` reads the run's own config
    (``config.yaml`` beside the checkpoint, else the one stored in it); flags apply on top."""
    cfg, resume, flags = parse_command(argv)
    quiet = cfg.train.quiet
    if resume not in (None, "auto") and not any(a.startswith("--config") for a in argv):
        base = resume_base_config(Path(resume))
        cfg, resume, flags = parse_command(["--config", base, *argv])
        folder = Path(resume).parent
        # a moved run folder's config.yaml names the old place: the run goes on here
        stored_out = None
        if Path(base) == folder / "config.yaml":
            stored_out = parse_command(["--config", base])[0].train.out_dir
        if stored_out == cfg.train.out_dir and Path(stored_out).resolve() != folder.resolve():
            print(
                f"dualseg train: note: {base} names train.out_dir {stored_out}; the run "
                f"goes on in {folder}, the checkpoint's folder (--train.out_dir chooses another)",
                file=sys.stderr,
            )
            argv = [*argv, "--train.out_dir", str(folder)]
            cfg, resume, flags = parse_command(["--config", base, *argv])
    elif resume == "auto" and not any(a.startswith("--config") for a in argv):
        run_config = Path(cfg.train.out_dir) / "config.yaml"
        if run_config.is_file():
            cfg, resume, flags = parse_command(["--config", str(run_config), *argv])
    if cfg.train.quiet != quiet:
        cfg = replace(cfg, train=replace(cfg.train, quiet=quiet))
    return cfg, resume, flags


def resume_base_config(checkpoint: Path) -> str:
    """``config.yaml`` beside ``checkpoint``, else the config stored in it (as YAML text)."""
    run_config = checkpoint.parent / "config.yaml"
    if run_config.is_file():
        return str(run_config)
    stored = ckpt_io.load_checkpoint(checkpoint).get("config")
    if not isinstance(stored, dict) or not stored:
        raise ConfigError(
            f"{checkpoint} stores no config and has no config.yaml beside it: pass the run's "
            "config with --config FILE"
        )
    sections = {k: v for k, v in stored.items() if k in ("data", "model", "optim", "train")}
    return yaml.safe_dump(sections, sort_keys=False)
