"""Benchmark: method B on a model dualseg did not build (segmentation_models_pytorch).

smp's Unet with a MobileNetV2 encoder initialized from the ImageNet weights dualseg ships
offline, trained on CamVid with the peer's data, augmentation and schedule (SGD, momentum 0.9,
L2 1e-4, poly LR, crops and batch of ``benchmarks/camvid.py``), validated on dev and kept at
its best dev mIoU; then method B fitted on the Unet's own encoder features (``taps``: the base
runs once, the refiner reads two of its modules) and, beside it, on an ``independent``
ImageNet backbone. The decision of each is chosen on dev; everything is scored on val and on
dev. With ``--holdout-sequence 0016E5`` dev is that whole sequence (leave-one-sequence-out):
neither the Unet nor the refiners saw it, and CamVid val (all 0016E5) is cross-scene too::

    python benchmarks/smp_camvid.py --data ../shared/data/camvid --out runs/smp_xscene_0016E5 \\
        --holdout-sequence 0016E5 --max-iters 1500 --refine-steps 2000 --threads 1 --workers 1

Interrupted runs continue with ``--reuse`` (the Unet's state is saved at each validation).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import segmentation_models_pytorch as smp
import torch
import torch.nn.functional as F
from camvid_protocols import carve_dev_split
from camvid_refine import eval_loader, summarize, time_inference, with_decision

from dualseg.data import build_dataset
from dualseg.engine.evaluation import evaluate
from dualseg.engine.options import DataConfig, train_transform
from dualseg.io import atomic_write_json
from dualseg.refine import BoundaryRefiner, RefinerConfig
from dualseg.refine.calibrate import calibrate_decision
from dualseg.refine.decision import describe_decision
from dualseg.weights import load_state_dict_file, resolve_weights


class PaddedUnet(smp.Unet):
    """smp's Unet on any image size: padded to a multiple of 32 (its encoder's need), the
    logits cropped back (the encoder's taps cover the padded input, as the refiner expects)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        return super().forward(F.pad(x, (0, -w % 32, 0, -h % 32)))[..., :h, :w]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", required=True, help="CamVid root")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--holdout-sequence", help="leave this training sequence out (dev)")
    p.add_argument("--dev-fraction", type=float, default=0.125)
    p.add_argument("--max-iters", type=int, default=1500)
    p.add_argument("--val-every", type=int, default=200)
    p.add_argument("--crop", type=int, nargs=2, default=[192, 256])
    p.add_argument("--scale", type=float, nargs=2, default=[0.5, 1.0])
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--refine-steps", type=int, default=2000)
    p.add_argument("--paths", nargs="+", choices=("taps", "independent"),
                   default=["taps", "independent"], help="which refiners to fit")  # fmt: skip
    p.add_argument("--base-features", nargs=2, metavar=("LOW", "HIGH"),
                   help="the taps refiner's modules (default: auto, the encoder's)")  # fmt: skip
    p.add_argument("--eval-limit", type=int, help="score only the first N images of a split")
    p.add_argument("--timing-images", type=int, default=10)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reuse", action="store_true", help="continue / reuse what --out holds")
    p.add_argument("--retime", action="store_true", help="with a finished --out: measure the "
                   "refiners' extra time again and re-score val with the taps refiner")  # fmt: skip
    return p.parse_args(argv)


def train_unet(args: argparse.Namespace, data: Path, num_classes: int) -> tuple[Any, dict]:
    """The Unet at its best dev mIoU, and its training record (dev curve, seconds)."""
    torch.manual_seed(args.seed)
    model = PaddedUnet("mobilenet_v2", encoder_weights=None, classes=num_classes)
    model.encoder.load_state_dict(load_state_dict_file(resolve_weights("mobilenet_v2")))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    poly = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: (1 - t / args.max_iters) ** 0.9)
    state, best_path = Path(args.out) / "unet_state.pt", Path(args.out) / "unet_best.pt"
    rec: dict[str, Any] = {"iteration": 0, "best": -1.0, "curve": [], "seconds": 0.0}
    if args.reuse and state.is_file():
        s = torch.load(state, weights_only=True)
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["opt"])
        poly.load_state_dict(s["poly"])
        rec = json.loads(s["record"])
    transform = train_transform(DataConfig(crop_size=tuple(args.crop), blur_prob=0.1,
                                           scale_range=tuple(args.scale), jitter=0.2))  # fmt: skip
    train = build_dataset(data, split="train_fit", preset="camvid", transform=transform)
    _, dev = eval_loader(data, str(data / "dev.txt"), args.eval_limit, args.workers)
    g = torch.Generator().manual_seed(args.seed + rec["iteration"])
    loader = torch.utils.data.DataLoader(
        train,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.workers,
        generator=g,
    )
    t0, it = time.time() - rec["seconds"], rec["iteration"]
    while it < args.max_iters:
        for images, labels in loader:
            model.train()
            loss = F.cross_entropy(model(images), labels, ignore_index=255)
            opt.zero_grad()
            loss.backward()
            opt.step()
            poly.step()
            it += 1
            if it % 50 == 0:
                print(f"[unet {it}/{args.max_iters}] loss {loss.item():.4f}", flush=True)
            if it % args.val_every and it != args.max_iters:
                continue
            miou = evaluate(model, dev, num_classes=num_classes)["miou"]
            rec["curve"].append([it, round(time.time() - t0, 1), miou])
            print(f"[unet {it}] dev mIoU {100 * miou:.1f}", flush=True)
            if miou > rec["best"]:
                rec["best"], rec["best_iteration"] = miou, it
                torch.save(model.state_dict(), best_path)
            rec |= {"iteration": it, "seconds": time.time() - t0}
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "poly": poly.state_dict(), "record": json.dumps(rec)}, state)  # fmt: skip
            if it >= args.max_iters:
                break
    model.load_state_dict(torch.load(best_path, weights_only=True))
    return model.eval(), rec


def fit_refiner(args: argparse.Namespace, data: Path, base: Any, taps: bool, names: list) -> Any:
    """Method B on the Unet's own features (``taps``) or on an independent ImageNet backbone."""
    path = Path(args.out) / f"refiner_{'taps' if taps else 'independent'}.pt"
    if args.reuse and path.is_file():
        return BoundaryRefiner.load(path), None
    config = RefinerConfig(steps=args.refine_steps, embed_dim=32, decoder_channels=48,
                           batch_size=args.batch_size, seed=args.seed, input_scale=1.0,
                           backbone_source="base-frozen" if taps else "independent")  # fmt: skip
    crop, scale = tuple(args.crop), tuple(args.scale)
    transform = train_transform(DataConfig(crop_size=crop, scale_range=scale))
    train = build_dataset(data, split="train_fit", preset="camvid", transform=transform)
    protos = build_dataset(data, split="train_fit", preset="camvid")
    t0 = time.time()
    refiner = BoundaryRefiner.fit(
        train, class_names=names, config=config, prototype_dataset=protos,
        base=base if taps else None, base_features=(args.base_features or "auto") if taps else None,
        weights=None if taps else "imagenet", num_workers=args.workers, progress=False,
        log_every=250, checkpoint=path.with_suffix(".train.pt"), resume=args.reuse,
    )  # fmt: skip
    refiner.save(path)
    return refiner, time.time() - t0


def with_chosen(refiner: Any, base: Any, dev: Any, num_classes: int) -> tuple[Any, dict]:
    """A copy of ``refiner`` with its decision chosen on dev (as ``benchmarks/camvid.py``)."""
    with refiner.shared_features(base) as kept:
        chosen, _ = calibrate_decision(refiner, lambda x: base(x).softmax(1), lambda: dev,
                                       num_classes=num_classes, shared=kept)  # fmt: skip
    return with_decision(refiner, chosen), chosen


def retime(args: argparse.Namespace, data: Path, names: list) -> int:
    """Measure the extra time of a finished run's refiners again (results.json's decisions),
    keeping its scores; val is scored again with the chosen taps refiner as a check. Each
    refiner is timed once, with its chosen decision, and that time is written to its claim
    row too (the embedding, not the decision, is what costs)."""
    out, k = Path(args.out), len(names)
    results = json.loads((out / "results.json").read_text())
    base = PaddedUnet("mobilenet_v2", encoder_weights=None, classes=k)
    base.load_state_dict(torch.load(out / "unet_best.pt", weights_only=True))
    base.eval()
    for key, decision in results["decisions"].items():
        path = out / f"refiner_{key.removeprefix('B_')}.pt"
        chosen = with_decision(BoundaryRefiner.load(path), decision["chosen"])
        for split in ("val", "dev"):
            _, loader = eval_loader(data, str(data / f"{split}.txt"), args.eval_limit,
                                    args.workers)  # fmt: skip
            base_s, extra_s, shared = time_inference(base, loader, args.timing_images,
                                                     torch.device("cpu"), chosen)  # fmt: skip
            for variant in ("claim", "chosen"):
                row = results["rows"][f"{split}/{key}_{variant}"]
                results.setdefault("first_timing", {}).setdefault(
                    f"{split}/{key}_{variant}",
                    {t: row[t] for t in ("extra_time_ratio", "read_base_features")},
                )
                row |= {"extra_time_ratio": extra_s / base_s, "read_base_features": shared}
            print(f"[{split}] {key}: extra time {100 * extra_s / base_s:.1f}%, taps read: "
                  f"{shared}", flush=True)  # fmt: skip
            if split == "val" and key == "B_taps":
                m = evaluate(base, loader, num_classes=k, refiner=chosen)["refined"]
                was = results["rows"][f"val/{key}_chosen"]["miou"]
                print(f"[val] {key}_chosen mIoU {100 * m['miou']:.2f} (was {100 * was:.2f})")
                results["retimed_val_miou"] = m["miou"]
    atomic_write_json(out / "results.json", results)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = carve_dev_split(Path(args.data), out, args.dev_fraction, args.holdout_sequence)
    names = build_dataset(data, split="dev", preset="camvid").meta.class_names
    k = len(names)
    if args.retime:
        return retime(args, data, names)
    t0 = time.time()
    base, record = train_unet(args, data, k)
    results: dict[str, Any] = {"args": vars(args), "unet": record, "rows": {}, "decisions": {}}
    _, dev = eval_loader(data, str(data / "dev.txt"), args.eval_limit, args.workers)
    variants: list[tuple[str, Any]] = [("base", None)]
    for taps in (path == "taps" for path in args.paths):
        refiner, seconds = fit_refiner(args, data, base, taps, names)
        key = "B_taps" if taps else "B_independent"
        results["decisions"][key] = {"fit_seconds": seconds}
        chosen_refiner, chosen = with_chosen(refiner, base, dev, k)
        results["decisions"][key]["chosen"] = chosen
        variants += [(key + "_claim", refiner), (key + "_chosen", chosen_refiner)]
        print(f"[{key}] decision chosen on dev: {describe_decision(**chosen)}", flush=True)
    for split in ("val", "dev"):
        _, loader = eval_loader(data, str(data / f"{split}.txt"), args.eval_limit, args.workers)
        for key, refiner in variants:
            m = evaluate(base, loader, num_classes=k, refiner=refiner)
            row = summarize(m if refiner is None else m["refined"])
            if refiner is not None:
                base_s, extra_s, shared = time_inference(base, loader, args.timing_images,
                                                         torch.device("cpu"), refiner)  # fmt: skip
                row |= {"extra_time_ratio": extra_s / base_s, "read_base_features": shared,
                        "fixed": m["refine"]["fixed"], "broken": m["refine"]["broke"]}  # fmt: skip
            results["rows"][f"{split}/{key}"] = row
            print(f"[{split}] {key}: mIoU {100 * row['miou']:.1f} boundary F1 "
                  f"{100 * row['boundary_f1']:.1f}", flush=True)  # fmt: skip
    results["total_seconds"] = time.time() - t0
    atomic_write_json(out / "results.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
