"""GPU path (issue 6): train ``dualseg_resnet101`` on CamVid at full resolution with AMP for a
fixed short wall-clock budget, evaluate, and print training / inference images per second and
the validation mIoU reached.

Run through ``benchmarks/gpu_run.sh CAMVID_DIR`` (which installs dualseg first), or directly::

    python benchmarks/gpu_run.py --data /path/to/camvid --minutes 6

The iteration count T of the poly schedule is set from a timed calibration so that training
ends inside ``--minutes``; ImageNet weights for ResNet-101 come from torchvision's download
(``--weights imagenet``, the default; needs internet once, then the torch hub cache), a local
file (``--weights FILE``) or nothing (``--weights none``, random init: far lower mIoU).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from dualseg.data import build_dataset
from dualseg.engine.checkpoint import build_model_from_checkpoint, load_checkpoint
from dualseg.engine.evaluation import evaluate
from dualseg.engine.options import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig
from dualseg.engine.train import fit
from dualseg.errors import DataError, DualsegError, Terminated
from dualseg.io import atomic_write_json

sys.path.insert(0, str(Path(__file__).resolve().parent))
from camvid_protocols import calibrate_iters  # shared with the CamVid suite
from camvid_refine import limit


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", required=True, help="CamVid folder with train.txt / val.txt")
    p.add_argument("--out", default="runs/gpu_run")
    p.add_argument("--arch", default="dualseg_resnet101")
    p.add_argument("--minutes", type=float, default=6.0, help="training budget (at most 8)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--crop", type=int, nargs=2, default=(360, 480), metavar=("H", "W"))
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--weights", default="imagenet", help="'imagenet', a file, or 'none'")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument("--device", default="cuda")
    p.add_argument("--amp", default="bf16", choices=["bf16", "fp16", "none"])
    p.add_argument("--eval-limit", type=int, help="evaluate only the first N val images (smoke)")
    return p.parse_args(argv)


def run_config(args: argparse.Namespace) -> Config:
    """The training config of the run, with T set later by the calibration."""
    return Config(
        data=DataConfig(
            root=args.data,
            preset="camvid",
            val_split=None,
            crop_size=tuple(args.crop),
            blur_prob=0.1,  # the shipped CamVid configs' S1 augmentation
            jitter=0.2,
            batch_size=args.batch_size,
            num_workers=args.workers,
        ),
        model=ModelConfig(
            arch=args.arch,
            weights=None if args.weights == "none" else args.weights,
            allow_download=args.weights == "imagenet",
        ),
        optim=OptimConfig(lr=args.lr),
        train=TrainConfig(
            out_dir=str(Path(args.out)),
            max_iters=1,
            val_every=0,
            monitor="train_loss",
            patience=None,  # a fixed budget: the calibrated schedule runs to its end
            device=args.device,
            amp=args.amp,
            progress=False,
            tensorboard=False,
        ),
    )


def images_per_second(model: torch.nn.Module, batch: int, device: torch.device, amp: str) -> float:
    """Inference throughput of the model alone at full 360x480, median of 10 timed runs."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    x = torch.randn(batch, 3, 360, 480, device=device)
    times = []
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
    with torch.inference_mode(), autocast:
        for i in range(13):
            torch.cuda.synchronize() if device.type == "cuda" else None
            t = time.perf_counter()
            model(x).argmax(1)
            torch.cuda.synchronize() if device.type == "cuda" else None
            if i >= 3:  # the first runs warm up cuDNN
                times.append(time.perf_counter() - t)
    return batch / statistics.median(times)


def check_args(args: argparse.Namespace) -> None:
    if not 0 < args.minutes <= 8:
        raise SystemExit(
            f"--minutes {args.minutes:g}: give more than 0 and at most 8 (the GPU path is a "
            "short fixed budget)"
        )
    lists = [Path(args.data) / f"{split}.txt" for split in ("train", "val")]
    if not all(p.is_file() for p in lists):  # before the calibration's minute on the GPU
        raise DataError(
            f"{args.data}: no {' / '.join(p.name for p in lists if not p.is_file())} there; "
            "pass the CamVid folder with train.txt and val.txt"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_args(args)
    device = torch.device(args.device)
    out = Path(args.out)
    cfg = run_config(args)
    iters, per_iter = calibrate_iters(cfg, args.minutes, device)
    cfg = replace(cfg, train=replace(cfg.train, max_iters=iters, ckpt_every=iters))
    print(f"calibrated {per_iter * 1000:.0f} ms/iteration -> {iters} iterations", flush=True)
    t0 = time.time()
    result = fit(cfg, overwrite=True)  # the benchmark owns --out
    train_s = time.time() - t0
    done = int(result["iteration"])  # short of iters when interrupted
    summary = {
        "arch": args.arch,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "amp": args.amp,
        "iterations": done,
        "planned_iterations": iters,
        "stop_reason": result["stop_reason"],
        "train_seconds": round(train_s, 1),
        "train_images_per_s": round(done * args.batch_size / train_s, 2),
        "weights": args.weights,
    }
    if result["stop_reason"] == "interrupted":  # no evaluation of a partial run
        atomic_write_json(out / "gpu_run.json", summary)
        print(
            f"interrupted at iteration {done} of {iters}; its training figures are in "
            f"{out / 'gpu_run.json'}, rerun to train again",
            flush=True,
        )
        return 128 + int(result.get("signal", signal.SIGINT))
    model, meta = build_model_from_checkpoint(load_checkpoint(out / "last.pt"), device=device)
    model.eval()
    val = limit(build_dataset(args.data, split="val", preset="camvid"), args.eval_limit)
    loader = torch.utils.data.DataLoader(val, batch_size=args.batch_size, num_workers=args.workers)
    amp = args.amp != "none"
    metrics = evaluate(model, loader, num_classes=meta.num_classes, device=device, amp=amp)
    summary["infer_images_per_s"] = {
        f"batch_{b}": round(images_per_second(model, b, device, args.amp), 2)
        for b in (1, args.batch_size)
    }
    summary["val_miou"] = metrics["miou"]
    summary["val_boundary_f1"] = metrics["boundary_f1"]
    atomic_write_json(out / "gpu_run.json", summary)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    from dualseg.cli import terminated_as_exception

    try:
        with terminated_as_exception():
            sys.exit(main())
    except DualsegError as err:  # a user error (data, weights, a flag): one line
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except (KeyboardInterrupt, Terminated) as stop:  # outside training: nothing to keep
        print("interrupted", file=sys.stderr)
        sys.exit(143 if isinstance(stop, Terminated) else 130)
