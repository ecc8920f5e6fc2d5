"""Benchmark (not a test): what method B's refinement gains over trained base models.

For each base checkpoint (method A's network, a peer such as DeepLabV3): mIoU, boundary F1
(t = 3 px) and trimap mIoU on an evaluation split, before and after refinement, and the
refinement's extra inference time per image relative to the base model's forward pass.
Targets (issue 5): boundary F1 +3 points and mIoU +1 point, at under 15% extra time.

    python benchmarks/refine_gain.py --data ../shared/data/camvid \\
        --eval ../shared/data/camvid/val.txt --base runs/camvid_mobilenet_v2/best.pt [more.pt] \\
        --refiner refiner.pt --out gain.json

Without ``--refiner`` it first fits one on ``--data``'s train split (``--steps`` etc.). The
evaluation split is a path: a list file (``image label`` per line) or a dataset folder with
``--eval-split``. Timing: medians over ``--time-images`` images, after a warm-up, on the device.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dualseg.data import build_dataset, build_eval_transform, build_train_transform
from dualseg.engine.checkpoint import build_model_from_checkpoint, load_checkpoint
from dualseg.engine.evaluate import evaluate
from dualseg.engine.predict import resolve_device
from dualseg.errors import DualsegError
from dualseg.io import atomic_write_json
from dualseg.refine import BoundaryRefiner, RefinerConfig

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_ratio(model, refiner, dataset, device: torch.device, n: int) -> dict[str, Any]:
    """Median seconds per image of the base forward (+ softmax) and of ``refiner.refine``,
    paired image by image. A refiner that can read the base's own backbone output
    (``dualseg.refine.shared``) is timed that way, and on its own backbone beside it."""
    base_t, refine_t, own_t = [], [], []
    shared_n = 0  # timed images refined on the base's features
    count = min(n + 1, len(dataset))
    warmup = 1 if count > 1 else 0  # the first image warms up, unless it is the only one
    with refiner.shared_features(model) as shared:
        for i in range(count):
            image = dataset[i][0][None].to(device)
            _sync(device)
            t0 = time.perf_counter()
            probs = model(image).softmax(1)
            _sync(device)
            t1 = time.perf_counter()
            features = shared.take(image)  # None where they do not match the image
            refiner.refine(image, probs, features=features)
            _sync(device)
            t2 = time.perf_counter()
            if features is not None:
                refiner.refine(image, probs)
                _sync(device)
            t3 = time.perf_counter()
            if i >= warmup:
                base_t.append(t1 - t0)
                refine_t.append(t2 - t1)
                own_t.append(t3 - t2)
                shared_n += features is not None
    b, r = statistics.median(base_t), statistics.median(refine_t)
    out: dict[str, Any] = {"base_s": b, "refine_s": r, "extra_time_ratio": r / b}
    out["shares_base_features"] = shared_n == len(base_t)  # every timed image
    if shared_n == len(base_t):
        own = statistics.median(own_t)
        out |= {"refine_own_backbone_s": own, "extra_time_ratio_own_backbone": own / b}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.time_images < 1:
        print(f"error: --time-images must be >= 1, got {args.time_images}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
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
    for ckpt_path in args.base:
        model, meta = build_model_from_checkpoint(load_checkpoint(ckpt_path), device=device)
        refiner.check_classes(meta.class_names, meta.num_classes, what=ckpt_path)
        m = evaluate(
            model,
            loader,
            num_classes=meta.num_classes,
            device=device,
            refiner=refiner,
            progress=sys.stderr.isatty(),
        )
        row = {k: {"base": m[k], "refined": m["refined"][k]} for k, _ in KEYS}
        row["refine"] = m["refine"]
        row["iou_gain"] = {  # per class, IoU points (None: class absent from the split)
            name: None if math.isnan(b) or math.isnan(r) else 100 * (r - b)
            for name, b, r in zip(meta.class_names, m["iou"], m["refined"]["iou"])
        }
        row.update(time_ratio(model, refiner, val, device, args.time_images))
        report["bases"][ckpt_path] = row
        print(f"\n{ckpt_path} ({len(val)} images, device {device})")
        for key, label in KEYS:
            b, r = 100 * row[key]["base"], 100 * row[key]["refined"]
            print(f"  {label:<12} {b:6.2f} -> {r:6.2f}  ({r - b:+.2f} points)")
        gains = ", ".join(
            f"{name} {g:+.1f}" for name, g in row["iou_gain"].items() if g is not None
        )
        print(f"  IoU gain per class: {gains}")
        c = row["refine"]
        print(
            f"  changed {100 * c['changed_fraction']:.3f}% of pixels: {c['fixed']} fixed, "
            f"{c['broke']} broke"
        )
        print(
            f"  time/image: base {1000 * row['base_s']:.1f} ms, refine "
            f"{1000 * row['refine_s']:.1f} ms -> +{100 * row['extra_time_ratio']:.1f}% "
            "(targets: BF1 +3, mIoU +1, < 15% extra time)"
        )
        if row["shares_base_features"]:
            print(
                "  (on the base's own backbone output; with its own backbone pass: "
                f"{1000 * row['refine_own_backbone_s']:.1f} ms -> "
                f"+{100 * row['extra_time_ratio_own_backbone']:.1f}%)"
            )
    atomic_write_json(args.out, report)
    print(f"\nreport -> {args.out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DualsegError as err:  # a user error (data, checkpoint, a resume on other inputs)
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
