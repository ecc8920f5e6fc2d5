"""Issue 14's plateau table: every model at its plateau, beside what it costs to run and to train.

Accuracy comes from committed results of ``benchmarks/camvid.py --protocol plateau`` (``ROWS``:
each model run to the end of T = 3,000 at output stride 16, bf16 + channels-last, one thread,
but ``renet_skip_v3``, whose run went on at two threads after iteration 617; T = 3,000 is the
val-mIoU plateau by the schedule check: T = 6,000 moved the peer's val mIoU by +0.1).
Cost is timed here, every model in one run taking turns (interleaved medians), so that the
columns compare on one machine under one load, whatever load each training ran beside:

- ms / image: the forward and argmax at CamVid's full 360×480, batch 1, fp32, eval mode (as
  the benchmark's evaluation), one thread;
- training step: the engine's own step (:func:`dualseg.engine.train.train_one_epoch` on one
  batch: bf16 autocast where the CPU has native bf16, channels-last, the S32 loss, SGD with the
  protocol's head LR) on 4 random 192×256 crops, one thread;
- training CPU-minutes: T × that step. The wall minutes each run logged are kept beside it.

Plateau: the issue's test on each dev curve, the best of the last three validations within 0.5
mIoU of the best so far.

Retraining: the peer, method A and two ablations trained again by the same command with
``--seed 1`` (``RETRAINED``; the table's runs are ``--seed 0``), so that the A − peer and
ablation − A differences, each seed against the same seed, are read beside how far retraining
alone moves each figure (another weight init, crop and batch order).

    python benchmarks/plateau_table.py --time     # time, write docs/results/plateau/summary.json
    python benchmarks/plateau_table.py            # the README table from summary.json
    python benchmarks/plateau_table.py --figure   # and docs/results/plateau/plateau_curves.png
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from camvid import VARIANTS, save_learning_curves
from cpu_levers import cpu_name
from model_speed import interleaved_medians

from dualseg.commands.common import nonnegative_int, positive_int
from dualseg.engine.cpu_bf16 import convs_in_fp32, cpu_has_native_bf16
from dualseg.engine.losses import SegmentationLoss
from dualseg.engine.optim import build_optimizer, build_scheduler
from dualseg.engine.options import OptimConfig
from dualseg.engine.train import train_one_epoch
from dualseg.io import atomic_write_json
from dualseg.models import build_model

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results" / "plateau"
SUMMARY = RESULTS / "summary.json"
FIGURE = RESULTS / "plateau_curves.png"
ROWS = {  # variant of camvid.py: (label, results file in docs/results/plateau/)
    "peer": ("peer: DeepLabV3, same backbone", "probe_peer_os16_T3000.json"),
    "dualseg": (
        "**method A** (`dualseg_mobilenet_v2`)",
        "method_b_decoder48_dualseg_os16_T3000.json",
    ),
    "single_branch": ("A without the grayscale branch", "plateau_single_branch_T3000.json"),
    "no_coord": ("A without coordinate channels", "plateau_no_coord_T3000.json"),
    "no_renet": ("A without ReNet layers", "plateau_no_renet_T3000.json"),
    "aspp_v3": (
        "A with the DeepLab-v3 ASPP (claim 3's other reading)",
        "plateau_aspp_v3_T3000.json",
    ),
    "renet_skip_v3": (
        "A, backbone features beside the ReNet output, v3 ASPP (beyond the claims)",
        "probe_renet_skip_v3_T3000.json",
    ),
}
# Rows trained again, the same command with --seed 1 (the runs above: --seed 0): how far
# retraining alone moves each figure, and so the A - peer and ablation - A differences.
RETRAINED = {
    "peer": "seed1_peer_os16_T3000.json",
    "dualseg": "seed1_dualseg_os16_T3000.json",
    "single_branch": "seed1_single_branch_os16_T3000.json",
    "no_renet": "seed1_no_renet_os16_T3000.json",
    "no_coord": "seed1_no_coord_os16_T3000.json",
}
PAIRED = ("peer", "dualseg")  # the retrained ablations are each read against method A
NUM_CLASSES = 11  # CamVid
IMAGE = (360, 480)  # CamVid's frames: the evaluation's input
CROP, BATCH = (192, 256), 4  # the protocol's training batch
OUTPUT_STRIDE, HEAD_LR_MULT, T = 16, 10.0, 3000


def plateaued(curve: list[list[float]], window: int = 3, delta: float = 0.005) -> bool:
    """The issue's test: the best of the last ``window`` dev validations within ``delta`` of
    the best so far (mIoU as a fraction)."""
    miou = [point[2] for point in curve]
    return len(miou) >= window and max(miou[-window:]) >= max(miou) - delta


def accuracy(name: str, file: str) -> dict[str, Any]:
    """A model's figures at the end of its schedule, read from a camvid.py results file."""
    result = json.loads((RESULTS / file).read_text())
    train, val = result["train"][name], result["splits"]["val"][name]
    curve = train["dev_curve"]
    return {
        "file": file,
        "iterations": train["iterations"],
        "evaluated": train["evaluated"],
        "dev_miou_last": curve[-1][2],
        "dev_miou_best": train["best_dev_miou"],
        "plateaued": plateaued(curve),
        "val": {k: val[k] for k in ("miou", "boundary_f1", "trimap_miou", "pixel_acc")},
        "wall_minutes_logged": train["train_seconds"] / 60,
        "seed": result["args"]["seed"],
        "amp": result["args"]["amp"],
        "threads": result["args"]["threads"],
        "output_stride": result["args"]["output_stride"],
    }


def retraining(accuracies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each ``RETRAINED`` model's figures at both seeds, and the differences seed by seed
    (each seed's run against the same seed's): method A − peer, and each retrained ablation −
    method A (``differences``, keyed by its table label; ``a_minus_peer`` is the first)."""
    keys = ("miou", "boundary_f1", "trimap_miou")
    runs = {n: [accuracies[n], accuracy(n, f)] for n, f in RETRAINED.items()}
    out: dict[str, Any] = {"models": {}, "differences": {}}
    for name, (first, again) in runs.items():
        out["models"][name] = {
            "seeds": [first["seed"], again["seed"]],
            "files": [first["file"], again["file"]],
            "dev_miou_last": [first["dev_miou_last"], again["dev_miou_last"]],
            **{k: [first["val"][k], again["val"][k]] for k in keys},
        }
    pairs = [("method A − peer", "dualseg", "peer")] + [
        (f"{ROWS[n][0]} − method A", n, "dualseg") for n in RETRAINED if n not in PAIRED
    ]
    for label, name, against in pairs:
        a, b = out["models"][name], out["models"][against]
        out["differences"][label] = {
            k: [x - y for x, y in zip(a[k], b[k], strict=True)] for k in (*keys, "dev_miou_last")
        }
    out["a_minus_peer"] = out["differences"]["method A − peer"]
    return out


def retraining_table(spread: dict[str, Any]) -> str:
    """Markdown: val mIoU / boundary F1 / trimap mIoU / dev mIoU per seed, and the differences
    seed by seed."""
    cols = ("miou", "boundary_f1", "trimap_miou", "dev_miou_last")

    def cells(values: dict[str, list[float]], fmt: str) -> str:
        return " | ".join(" / ".join(format(100 * v, fmt) for v in values[c]) for c in cols)

    rows = [
        "| T = 3,000, seed 0 / seed 1 | val mIoU | boundary F1 | trimap mIoU | dev mIoU (end) |",
        "|---|---|---|---|---|",
    ]
    for name, m in spread["models"].items():
        rows.append(f"| {ROWS[name][0]} | {cells(m, '.1f')} |")
    differences = spread.get("differences") or {"method A − peer": spread["a_minus_peer"]}
    for label, values in differences.items():
        rows.append(f"| {label} | {cells(values, '+.1f')} |")
    return "\n".join(rows)


def variant(name: str) -> torch.nn.Module:
    arch, options = VARIANTS[name]
    torch.manual_seed(0)  # the cost does not depend on the weights: no file is read
    return build_model(arch, num_classes=NUM_CLASSES, output_stride=OUTPUT_STRIDE, **options)


def inference(name: str) -> Callable[[], None]:
    model = variant(name).eval()
    x = torch.randn(1, 3, *IMAGE)

    def run() -> None:
        with torch.inference_mode():
            model(x).argmax(1)

    return run


def training_step(name: str, amp_dtype: torch.dtype | None) -> Callable[[], None]:
    """One step of the engine's training loop, with the protocol's recipe."""
    o = OptimConfig()
    model = variant(name).to(memory_format=torch.channels_last)
    if amp_dtype == torch.bfloat16:
        convs_in_fp32(model)  # as fit() does: oneDNN's bf16 weight gradient of some is wrong
    criterion = SegmentationLoss(model, weight_decay=o.weight_decay, l2_lambda=o.l2_lambda)
    optimizer = build_optimizer(
        model, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, head_lr_mult=HEAD_LR_MULT
    )
    scheduler = build_scheduler(optimizer, max_iters=T, power=o.poly_power, warmup_iters=100)
    batch = [(torch.randn(BATCH, 3, *CROP), torch.randint(0, NUM_CLASSES, (BATCH, *CROP)))]
    cpu = torch.device("cpu")

    def run() -> None:
        train_one_epoch(
            model, batch, optimizer, scheduler, criterion, device=cpu, amp_dtype=amp_dtype,
            channels_last=True,
        )  # fmt: skip

    return run


def time_all(names: list[str], reps: int, warmup: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # the protocol's: one thread per model
    amp_dtype = torch.bfloat16 if cpu_has_native_bf16() else None
    cpu = torch.device("cpu")
    infer = interleaved_medians([inference(n) for n in names], cpu, reps, warmup)
    steps = interleaved_medians([training_step(n, amp_dtype) for n in names], cpu, reps, warmup)
    return {
        "machine": cpu_name(),
        "torch": torch.__version__,
        "threads": 1,
        "reps": reps,
        "train_amp": "bf16" if amp_dtype else "none",
        "models": {
            n: {"ms_per_image": 1e3 * i, "train_step_ms": 1e3 * s}
            for n, i, s in zip(names, infer, steps)
        },
    }


def table(summary: dict[str, Any]) -> str:
    rows = [
        "| model | val mIoU | boundary F1 | trimap mIoU | dev mIoU (end) | plateau | ms / image "
        "| training step | training CPU-min (T × step) | logged wall min |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    peer = summary["timing"]["models"]["peer"]
    for name, (label, _) in ROWS.items():
        a, t = summary["accuracy"][name], summary["timing"]["models"][name]
        v = a["val"]
        rows.append(
            f"| {label} | {100 * v['miou']:.1f} | {100 * v['boundary_f1']:.1f} "
            f"| {100 * v['trimap_miou']:.1f} | {100 * a['dev_miou_last']:.1f} "
            f"| {'yes' if a['plateaued'] else 'no'} "
            f"| {t['ms_per_image']:.0f} ({t['ms_per_image'] / peer['ms_per_image']:.2f}×) "
            f"| {t['train_step_ms']:.0f} ms ({t['train_step_ms'] / peer['train_step_ms']:.2f}×) "
            f"| {a['iterations'] * t['train_step_ms'] / 6e4:.0f} "
            f"| {a['wall_minutes_logged']:.0f} |"
        )
    return "\n".join(rows)


def save_figure(summary: dict[str, Any], path: Path) -> None:
    """The ROWS' dev curves against iterations and against CPU-minutes (iteration × the step
    timed here), so that the time axis compares models under one load."""
    curves = {}
    for name, (label, file) in ROWS.items():
        record = json.loads((RESULTS / file).read_text())["train"][name]
        step_min = summary["timing"]["models"][name]["train_step_ms"] / 6e4
        curve = [[it, it * step_min, miou] for it, _, miou in record["dev_curve"]]
        curves[label.replace("*", "").replace("`", "")] = {"dev_curve": curve}
    save_learning_curves(
        curves,
        path,
        time_label="training CPU-minutes (iterations × the step timed by plateau_table.py)",
        title="CamVid dev mIoU, every model run to the end of T = 3,000 (stride 16, bf16)",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--time", action="store_true", help="time every model; else read --summary")
    p.add_argument("--summary", type=Path, default=SUMMARY, help="the JSON written / read")
    p.add_argument(
        "--figure", type=Path, nargs="?", const=FIGURE, help=f"draw the curves (default {FIGURE})"
    )
    p.add_argument("--reps", type=positive_int, default=15, help="timed runs of each model")
    p.add_argument("--warmup", type=nonnegative_int, default=2)
    args = p.parse_args(argv)
    files = [f for _, f in ROWS.values()] + list(RETRAINED.values())
    missing = [f for f in files if not (RESULTS / f).is_file()]
    if missing:
        raise SystemExit(
            f"plateau_table: no {', '.join(missing)} in {RESULTS}; run benchmarks/camvid.py first"
        )
    accuracies = {n: accuracy(n, f) for n, (_, f) in ROWS.items()}
    spread = retraining(accuracies)
    if args.time:
        summary = {
            "accuracy": accuracies,
            "timing": time_all(list(ROWS), args.reps, args.warmup),
            "retraining": spread,
        }
        atomic_write_json(args.summary, summary)
        print(f"wrote {args.summary}")
    elif not args.summary.is_file():
        raise SystemExit(f"plateau_table: no {args.summary}; run with --time first")
    else:
        summary = {
            **json.loads(args.summary.read_text()),
            "accuracy": accuracies,
            "retraining": spread,
        }
    print(table(summary))
    print()
    print(retraining_table(summary["retraining"]))
    if args.figure is not None:
        save_figure(summary, args.figure)
        print(f"wrote {args.figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
