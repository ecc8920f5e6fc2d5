"""``dualseg demo``: synthetic scenes (or ``--data``) -> train -> scores beside two image-blind
baselines -> method B before/after; figures and ``metrics.json`` in ``--out``."""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, Subset

import dualseg.engine as engine
from dualseg.augment_defaults import seed_error
from dualseg.commands.common import add_quiet_arg, apply_runtime, command_parser, cuda_amp, threads
from dualseg.data import build_dataset, build_eval_transform
from dualseg.engine import options, showcase
from dualseg.engine.baselines import baseline_models
from dualseg.engine.predict import load_model
from dualseg.errors import ConfigError, Terminated
from dualseg.io import atomic_write_json
from dualseg.metrics import to_jsonable
from dualseg.models import backbone_of
from dualseg.refine import BoundaryRefiner, RefinerConfig

# flag, type, default, lowest value (None: the config checks it), help
FLAGS: tuple[tuple[str, Any, Any, int | None, str], ...] = (
    ("--out", str, "runs/demo", None, "output folder; a re-run replaces the demo's own output"),
    ("--data", str, None, None, "a real dataset root instead of synthetic data"),
    ("--preset", str, None, None, "classes of --data (camvid, voc, cityscapes, ade20k)"),
    ("--val-split", str, "val", None, "held-out split to score (the model trains on train)"),
    ("--n-train", int, 400, 1, "synthetic training images"),
    ("--n-val", int, 20, 1, "synthetic held-out images"),
    ("--iters", int, 250, 1, "training iterations"),
    ("--batch-size", int, 4, 1, "training batch size"),
    ("--lr", float, 0.02, None, "initial learning rate"),
    ("--arch", str, "dualseg_mobilenet_v2", None, "model name"),
    ("--weights", str, "imagenet", None, "imagenet (offline, when installed), none, or a file"),
    ("--renet-hidden", int, 64, None, "GRU units per direction"),
    ("--renet-layers", int, 2, None, "recurrent modules per branch, 0-2"),
    ("--val-every", int, 0, None, "validate every K iterations for the curves (0: only after)"),
    ("--workers", int, 0, 0, "DataLoader workers"),
    ("--device", str, "auto", None, "auto | cpu | cuda"),
    ("--threads", threads, 1, None, "torch CPU threads (0: torch's default, one per core)"),
    ("--seed", int, 0, None, "seed of data, init and training"),
    ("--n-show", int, 4, 0, "held-out images in the panel (0: no panel)"),
    ("--refine-steps", int, 100, 1, "method B triplet steps"),
    ("--refine-prototypes", int, 100, 1, "training images whose boundary pixels give prototypes"),
)


def build_parser() -> argparse.ArgumentParser:
    p = command_parser(
        "demo",
        "Train, score and show a small dual-branch network on synthetic scenes.",
        "dualseg demo",
        "dualseg demo --data data/camvid --preset camvid",
    )
    for flag, kind, default, _, text in FLAGS:
        p.add_argument(flag, type=kind, default=default, help=f"{text} ({default})")
    p.add_argument("--size", type=int, nargs=2, default=(96, 128), metavar=("H", "W"),
                   help="synthetic image size and training crop size (96 128)")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="replace what --out holds, any run")
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, help="bf16 (--no-amp: fp32)")
    p.add_argument("--no-refine", action="store_true", help="skip method B")
    add_quiet_arg(p)
    return p


def check_args(args: argparse.Namespace) -> None:
    """The checks that need no data, before anything is written; the rest is the config's."""
    value = {flag: vars(args)[flag[2:].replace("-", "_")] for flag, *_ in FLAGS}
    for flag, _, _, low, _ in FLAGS:
        if low is not None and value[flag] < low and not (args.no_refine and "refine" in flag):
            raise ConfigError(f"{flag} must be >= {low} (got {value[flag]})")
    if (problem := seed_error(args.seed, "--seed")) is not None:
        raise ConfigError(problem)
    source = "--data (its own images)" if args.data else "the synthetic data"
    drop = ("--n-train", "--n-val") if args.data else ("--preset", "--val-split")
    unused = dict.fromkeys(drop, f"does not apply to {source}")
    if not args.arch.startswith("dualseg_"):  # a peer has no ReNet
        peer = f"applies to method A (dualseg_*), not to --arch {args.arch}"
        unused |= dict.fromkeys(("--renet-hidden", "--renet-layers"), peer)
    for flag, _, default, *_ in FLAGS:
        if flag in unused and value[flag] != default:
            raise ConfigError(f"{flag} {unused[flag]}: drop it")
    if args.data is None and args.n_train < args.batch_size:
        raise ConfigError(f"--batch-size {args.batch_size} needs as many training images, but "
                          f"--n-train {args.n_train} draws fewer: lower one")  # fmt: skip
    named = argparse.Namespace(name=args.preset or "synthetic")
    options.validate(_train_config(args, Path(args.out) / "data", named, None))


def _train_config(args, root: Path, meta: Any, weights: str | None) -> options.Config:
    synthetic, dual = args.data is None, args.arch.startswith("dualseg_")
    return options.Config(
        data=options.DataConfig(
            root=str(root), preset=meta.name if synthetic or args.preset else None,
            val_split=args.val_split if args.val_every else None,  # the demo scores after
            crop_size=tuple(args.size), batch_size=args.batch_size, num_workers=args.workers,
            # the generator varies layout, colour and texture at the working size: flips only
            **(dict(scale_range=(1.0, 1.0), blur_prob=0.0, jitter=0.0, val_batch_size=4)
               if synthetic else {"val_batch_size": 1}),
        ),
        model=options.ModelConfig(
            arch=args.arch, weights=weights, output_stride=8,
            renet_hidden=args.renet_hidden if dual else None,
            renet_layers=args.renet_layers if dual else None,
        ),
        optim=options.OptimConfig(
            lr=args.lr, warmup_iters=min(20, args.iters // 10), head_lr_mult=10.0
        ),
        train=options.TrainConfig(
            out_dir=str(args.out), max_iters=args.iters, val_every=args.val_every,
            log_every=max(1, min(20, args.iters // 10)), seed=args.seed, device=args.device,
            amp="none" if args.amp is False else "auto", progress=not args.quiet,
            quiet=args.quiet, tensorboard=False,
        ),
    )  # fmt: skip


def _score(args, cfg, root: Path, meta: Any, ckpt: Path, device, seconds: dict) -> dict:
    """Method B fitted, then it, the model and the baselines scored; the figures drawn."""
    read = dict(layout=cfg.data.layout, preset=meta, label_format=cfg.data.label_format)
    train_set = build_dataset(root, split="train", **read)
    val_set = build_dataset(root, split=args.val_split, transform=build_eval_transform(), **read)
    loader = DataLoader(val_set, batch_size=cfg.data.val_batch_size, num_workers=args.workers)
    common = dict(num_classes=meta.num_classes, device=device, amp=cuda_amp(args, device))
    model = load_model(ckpt, device=device).model
    refiner, refinement = None, None
    if not args.no_refine:
        start = time.perf_counter()
        config = RefinerConfig(
            backbone=backbone_of(args.arch), output_stride=8,
            input_scale=1.0,  # the demo's scenes are small: embedded at full size
            steps=args.refine_steps, batch_size=args.batch_size, seed=args.seed,
        )  # fmt: skip
        augmented = build_dataset(root, split="train", **read, seed=args.seed,
                                  transform=options.train_transform(cfg.data))  # fmt: skip
        refiner = BoundaryRefiner.fit(
            augmented, class_names=meta.class_names, config=config, weights=None,
            prototype_dataset=Subset(train_set, range(min(args.refine_prototypes, len(train_set)))),
            init_from=model, device=device, progress=False,
        )  # fmt: skip
        refiner.save(path := Path(args.out) / "refiner.pt")
        refinement = {"refiner": str(path), "fit_seconds": time.perf_counter() - start,
                      "steps": args.refine_steps}  # fmt: skip
    start = time.perf_counter()
    visuals = showcase.VisualWriter(val_set, Path(args.out), args.n_show, loader.batch_size)
    result = engine.evaluate(model, loader, refiner=refiner, on_batch=visuals, **common)
    seconds["eval"] = time.perf_counter() - start
    metrics = {k: v for k, v in result.items() if k not in ("refined", "refine")}
    if refinement is not None:
        refinement |= {"base": metrics, "refined": result["refined"], "refine": result["refine"]}
    labels = [label for _, label in train_set.samples]
    priors = baseline_models(labels, meta, label_format=cfg.data.label_format)
    baselines = {n: engine.evaluate(m.to(device), loader, **common) for n, m in priors.items()}
    dataset = {"root": str(root), "name": meta.name, "class_names": list(meta.class_names),
               "train_images": len(train_set), "val_images": len(val_set)}  # fmt: skip
    weights = cfg.model.weights or "random init"
    return {
        "out": str(Path(args.out)), "dataset": dataset,
        "model": {"arch": args.arch, "weights": weights, "checkpoint": ckpt},
        "train": {"iters": args.iters, "batch_size": args.batch_size, "lr": args.lr},
        "metrics": metrics, "baselines": baselines, "refinement": refinement,
        "figures": visuals.finish(), "seconds": seconds,
    }  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the demo as the command line describes; returns what ``metrics.json`` holds."""
    start, out = time.perf_counter(), Path(args.out)
    check_args(args)  # before the folder is looked at or touched
    weights = showcase.demo_weights(args.arch, args.weights)
    device = apply_runtime(args)  # --threads, --device
    with showcase.demo_folder(  # checked, then held and marked as the demo's
        out, args.data, overwrite=args.overwrite, preset=args.preset, layout="auto",
        train_split="train", val_split=args.val_split, n_train=args.n_train,
        n_val=args.n_val, size=tuple(args.size), seed=args.seed,
    ) as (root, meta):  # fmt: skip
        seconds = {"data": time.perf_counter() - start}
        cfg = _train_config(args, root, meta, weights)
        result = engine.fit(cfg, overwrite=True)
        if result["stop_reason"] == "interrupted":  # fit saved and returned: the demo stops
            raise Terminated if result.get("signal") == signal.SIGTERM else KeyboardInterrupt
        seconds["train"] = time.perf_counter() - start - seconds["data"]
        ckpt = Path(result["best"] or result["last"])
        record = _score(args, cfg, root, meta, ckpt, device, seconds)
        seconds["total"] = time.perf_counter() - start
        atomic_write_json(out / "metrics.json", to_jsonable(record))
        print(showcase.demo_summary(record))
        return record


def main(argv: list[str] | None = None) -> int:
    run(build_parser().parse_args(argv))
    return 0
