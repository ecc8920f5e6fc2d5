"""Benchmark (not a test): what method B's refinement gains over trained base models, beside
dense CRF on the same base probabilities.

For each base checkpoint (method A's network, a peer such as DeepLabV3): mIoU, boundary F1
(t = 3 px) and trimap mIoU on an evaluation split, before and after refinement, the pixels
each post-processor fixed (wrong -> right) and broke (right -> wrong), and its extra inference
time per image relative to the base model's forward pass. Targets (issue 5): boundary F1 +3
points and mIoU +1 point, at under 15% extra time.

Dense CRF (``--crf on``, the default; ``pip install 'dualseg[crf]'``) has its kernel settings
chosen among four on ``--crf-dev``, the dev data that chose method B's decision (``refine fit
--calibrate-split``), per base; ``--crf off`` skips it.

    python benchmarks/refine_gain.py --data ../shared/data/camvid \\
        --eval ../shared/data/camvid/val.txt --base runs/camvid_mobilenet_v2/best.pt [more.pt] \\
        --refiner refiner.pt --crf-dev runs/bench/data/dev.txt --out gain.json

Without ``--refiner`` it first fits one on ``--data``'s train split (``--steps`` etc.). The
evaluation split is a path: a list file (``image label`` per line) or a dataset folder with
``--eval-split``. Timing: medians over ``--time-images`` images, after a warm-up, on the
device; what method B and dense CRF add is paired with the base's forward and labels on each
image, as in ``benchmarks/camvid.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import types
from pathlib import Path
from typing import Any

import torch
from camvid_refine import time_inference

from dualseg.data import build_dataset, build_eval_transform, build_train_transform
from dualseg.engine.checkpoint import build_model_from_checkpoint, load_checkpoint
from dualseg.engine.evaluation import evaluate
from dualseg.engine.predict import resolve_device
from dualseg.errors import ConfigError, DualsegError
from dualseg.io import atomic_write_json
from dualseg.refine import BoundaryRefiner, RefinerConfig
from dualseg.refine.calibrate import METRICS
from dualseg.refine.crf import CRFSettings, choose_crf, import_pydensecrf
from dualseg.refine.shared import SharedFeatures

KEYS = (("miou", "mIoU"), ("boundary_f1", "boundary F1"), ("trimap_miou", "trimap mIoU"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="training dataset root (fits the refiner)")
    p.add_argument("--preset", default="camvid")
    p.add_argument("--eval", required=True, help="evaluation split: list file or dataset folder")
    p.add_argument("--eval-split", default="val", help="split name when --eval is a folder")
    p.add_argument("--base", nargs="+", required=True, help="trained base checkpoint(s)")
    p.add_argument("--refiner", help="a fitted refiner file (else one is fitted and saved)")
    p.add_argument("--refiner-out", default="refiner_bench.pt")
    p.add_argument("--init-from", help="fit: copy the backbone of this base checkpoint")
    p.add_argument("--weights", default="imagenet", help="fit: imagenet | none | a weight file")
    p.add_argument("--backbone", default=RefinerConfig.backbone)
    p.add_argument("--steps", type=int, default=RefinerConfig.steps)
    p.add_argument("--batch-size", type=int, default=RefinerConfig.batch_size)
    p.add_argument("--crop-size", type=int, nargs=2, default=(256, 256))
    p.add_argument("--input-scale", type=float, default=RefinerConfig.input_scale)
    p.add_argument("--radius", type=int, default=RefinerConfig.radius)
    p.add_argument("--top-n", type=int, default=RefinerConfig.top_n)
    p.add_argument("--lr", type=float, default=RefinerConfig.lr)
    p.add_argument(
        "--decoder-channels",
        type=int,
        default=RefinerConfig.decoder_channels,
        help="fit: a DeepLabV3+ decoder on the stride-4 features (0: none, the claim)",
    )
    p.add_argument("--max-eval-images", type=int, default=0, help="0: the whole split")
    p.add_argument("--time-images", type=int, default=10)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default="refine_gain.json")
    p.add_argument(
        "--crf",
        choices=("on", "off"),
        default="on",
        help="dense CRF on the same base probabilities beside method B (pydensecrf2: "
        "pip install 'dualseg[crf]')",
    )
    p.add_argument(
        "--crf-dev",
        help="the dev data that chose method B's decision (a list file, or a split of --data): "
        "dense CRF's kernel settings are chosen there among four (default: DeepLab's settings)",
    )
    p.add_argument(
        "--crf-metric",
        choices=METRICS,
        default=METRICS[0],
        help="what the choice of CRF settings on --crf-dev maximizes (method B's metrics)",
    )
    return p.parse_args(argv)


def fit_refiner(args: argparse.Namespace, device: torch.device) -> BoundaryRefiner:
    cfg = RefinerConfig(
        backbone=args.backbone,
        steps=args.steps,
        batch_size=args.batch_size,
        input_scale=args.input_scale,
        radius=args.radius,
        top_n=args.top_n,
        lr=args.lr,
        decoder_channels=args.decoder_channels,
    )
    tf = build_train_transform(crop_size=tuple(args.crop_size))
    train = build_dataset(args.data, split="train", preset=args.preset, transform=tf)
    protos = build_dataset(args.data, split="train", preset=args.preset)
    init_from = None
    if args.init_from:
        init_from, _ = build_model_from_checkpoint(load_checkpoint(args.init_from))
    refiner = BoundaryRefiner.fit(
        train,
        class_names=train.meta.class_names,
        config=cfg,
        prototype_dataset=protos,
        weights=None if init_from is not None or args.weights == "none" else args.weights,
        init_from=init_from,
        device=device,
        checkpoint=Path(args.refiner_out).with_suffix(".train.pt"),
        resume=True,
        # a resume on other data, crops or base is refused, not continued silently
        fit_inputs={
            "data": str(Path(args.data).resolve()),
            "preset": args.preset,
            "crop_size": list(args.crop_size),
            "init_from": str(Path(args.init_from).resolve()) if args.init_from else None,
            "weights": None if init_from is not None else args.weights,
        },
    )
    refiner.save(args.refiner_out)
    return refiner


def time_ratio(
    model: torch.nn.Module, refiner: BoundaryRefiner, loader: Any, device: torch.device, n: int
) -> dict[str, Any]:
    """What method B adds to the base's forward and labels, paired image by image: the measure
    of every benchmark (``camvid_refine.time_inference``). A refiner that reads the base's own
    backbone output (``dualseg.refine.shared``) is timed on its own backbone too, in a second
    pass paired with its own base times."""
    base_s, extra_s, shared = time_inference(model, loader, n, device, refiner)
    out: dict[str, Any] = {"base_s": base_s, "refine_s": extra_s}
    out |= {"extra_time_ratio": extra_s / base_s, "shares_base_features": shared}
    if shared:  # a context that shares nothing: the refiner runs its own backbone
        own = types.SimpleNamespace(
            refine=refiner.refine, shared_features=lambda m: SharedFeatures(m, active=False)
        )
        own_base_s, own_s, _ = time_inference(model, loader, n, device, own)
        out |= {"refine_own_backbone_s": own_s, "extra_time_ratio_own_backbone": own_s / own_base_s}
    return out


def crf_dev_dataset(args: argparse.Namespace) -> Any:
    """The images that choose dense CRF's settings: ``--crf-dev`` as a list file, or as a split
    of ``--data`` (as ``refine fit --calibrate-split`` names one); ``None`` without it. The
    evaluation split itself is refused: settings chosen there would be reported there."""
    if args.crf == "off" and args.crf_dev:
        raise ConfigError(f"--crf-dev {args.crf_dev} chooses dense CRF's settings: drop --crf off")
    if not args.crf_dev:
        return None
    path = Path(args.crf_dev)
    root, split = (path, "val") if path.is_file() else (Path(args.data), args.crf_dev)
    listed = root if root.is_file() else root / f"{split}.txt"
    if listed.resolve() == Path(args.eval).resolve() or (
        Path(args.eval).resolve() == root.resolve() and split == args.eval_split
    ):
        raise ConfigError(
            f"--crf-dev {args.crf_dev} is the evaluation split: CRF settings chosen on it would "
            "be reported on the images they were tuned on; pass the dev data that chose method "
            "B's decision (e.g. dev.txt)"
        )
    return build_dataset(root, split=split, preset=args.preset, transform=build_eval_transform())


def score_crf(
    model: torch.nn.Module,
    loader: Any,
    dev: Any,
    num_classes: int,
    device: torch.device,
    metric: str,
    time_images: int,
) -> dict[str, Any]:
    """Dense CRF on the base's probabilities, its settings chosen on ``dev`` (the defaults
    without it): the same figures as method B's, with the pixels it fixed and broke."""
    chosen, sweep = CRFSettings(), None
    if dev is not None:
        dev_loader = torch.utils.data.DataLoader(dev, batch_size=1)
        chosen, sweep = choose_crf(
            model, dev_loader, num_classes=num_classes, device=device, metric=metric
        )
    m = evaluate(model, loader, num_classes=num_classes, device=device, refiner=chosen)
    base_s, crf_s, _ = time_inference(model, loader, time_images, device, chosen)
    return {
        **{k: m["refined"][k] for k, _ in KEYS},
        "settings": dataclasses.asdict(chosen),
        "chosen_on_dev": sweep is not None,
        "dev_sweep": sweep,
        "fixed": m["refine"]["fixed"],
        "broke": m["refine"]["broke"],
        "ms_per_image": 1000 * crf_s,  # paired with the base's forward, as method B's
        "extra_time_ratio": crf_s / base_s,
    }


def score_method_b(
    model: torch.nn.Module, refiner: BoundaryRefiner, loader: Any, meta: Any, device: Any
) -> dict[str, Any]:
    m = evaluate(
        model,
        loader,
        num_classes=meta.num_classes,
        device=device,
        refiner=refiner,
        progress=sys.stderr.isatty(),
    )
    row: dict[str, Any] = {k: {"base": m[k], "refined": m["refined"][k]} for k, _ in KEYS}
    row["refine"] = m["refine"]
    row["iou_gain"] = {  # per class, IoU points (None: class absent from the split)
        name: None if math.isnan(b) or math.isnan(r) else 100 * (r - b)
        for name, b, r in zip(meta.class_names, m["iou"], m["refined"]["iou"])
    }
    return row


def print_row(name: str, row: dict[str, Any], images: int, device: torch.device) -> None:
    print(f"\n{name} ({images} images, device {device})")
    crf = row.get("crf")
    head = f"  {'':<14}{'base':>7}{'method B':>17}" + (f"{'dense CRF':>17}" if crf else "")
    print(head)
    for key, label in KEYS:
        b, r = 100 * row[key]["base"], 100 * row[key]["refined"]
        line = f"  {label:<14}{b:7.2f}{r:9.2f} ({r - b:+5.2f})"
        if crf:
            line += f"{100 * crf[key]:9.2f} ({100 * crf[key] - b:+5.2f})"
        print(line)
    c = row["refine"]
    line = f"  {'fixed/broken':<14}{'':>7}{c['fixed']:>9}/{c['broke']:<7}"
    print(line + (f"{crf['fixed']:>9}/{crf['broke']:<7}" if crf else ""))
    line = (
        f"  {'ms/image':<14}{1000 * row['base_s']:7.1f}{1000 * row['refine_s']:9.1f} "
        f"(+{100 * row['extra_time_ratio']:.0f}%)"
    )
    print(
        line
        + (f"{crf['ms_per_image']:9.1f} (+{100 * crf['extra_time_ratio']:.0f}%)" if crf else "")
    )
    gains = ", ".join(f"{name} {g:+.1f}" for name, g in row["iou_gain"].items() if g is not None)
    print(f"  method B's IoU gain per class: {gains}")
    print(
        f"  method B changed {100 * c['changed_fraction']:.3f}% of pixels "
        "(targets: BF1 +3, mIoU +1, < 15% extra time)"
    )
    if row["shares_base_features"]:
        print(
            "  (method B on the base's own backbone output; with its own backbone pass: "
            f"{1000 * row['refine_own_backbone_s']:.1f} ms -> "
            f"+{100 * row['extra_time_ratio_own_backbone']:.1f}%)"
        )
    if crf:
        how = "chosen on --crf-dev" if crf["chosen_on_dev"] else "the defaults (no --crf-dev)"
        print(f"  dense CRF settings, {how}: {CRFSettings(**crf['settings']).describe()}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.time_images < 1:
        print(f"error: --time-images must be >= 1, got {args.time_images}", file=sys.stderr)
        return 2
    if args.crf == "on":
        try:
            import_pydensecrf()  # before any work
        except DualsegError as err:
            raise DualsegError(f"{err}, or --crf off to leave dense CRF out") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dev = crf_dev_dataset(args)
    refiner = (
        BoundaryRefiner.load(args.refiner, device=device)
        if args.refiner
        else fit_refiner(args, device)
    )
    refiner.to(device)
    eval_path = Path(args.eval)
    val = build_dataset(
        eval_path, split=args.eval_split, preset=args.preset, transform=build_eval_transform()
    )
    if args.max_eval_images:
        val = torch.utils.data.Subset(val, range(min(args.max_eval_images, len(val))))
    loader = torch.utils.data.DataLoader(val, batch_size=1)
    report: dict[str, Any] = {"refiner": repr(refiner), "eval": str(eval_path), "bases": {}}
    if dev is not None:
        report["crf_dev"] = args.crf_dev
    for ckpt_path in args.base:
        model, meta = build_model_from_checkpoint(load_checkpoint(ckpt_path), device=device)
        refiner.check_classes(meta.class_names, meta.num_classes, what=ckpt_path)
        row = score_method_b(model, refiner, loader, meta, device)
        row.update(time_ratio(model, refiner, loader, device, args.time_images))
        if args.crf == "on":
            row["crf"] = score_crf(model, loader, dev, meta.num_classes, device, args.crf_metric,
                                   args.time_images)  # fmt: skip
        report["bases"][ckpt_path] = row
        print_row(ckpt_path, row, len(val), device)
    atomic_write_json(args.out, report)
    print(f"\nreport -> {args.out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DualsegError as err:  # a user error (data, checkpoint, a resume on other inputs)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
