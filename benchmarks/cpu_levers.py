"""Training-step time of method A and its peer under the CPU levers, timed in turns.

Settings: fp32 (contiguous memory), fp32 + channels-last, bf16 autocast + channels-last with
every convolution in bf16 (the trainer before ``dualseg.engine.cpu_bf16``), the same with the
depthwise convolutions in fp32 (commit 5bb0235's trainer), and the trainer's
(``cpu_bf16.convs_in_fp32``: depthwise ones and dilated ones whose input channels are not a
multiple of 16 in fp32). Also the weight-gradient error of each bf16 setting against fp32,
median and worst over the dilated depthwise convolutions, the dilated dense ones off a multiple
of 16 (the kernels ``cpu_bf16`` avoids) and all other convolutions, on the same batch; a
non-finite error (inf or NaN) is written as null.

    python benchmarks/cpu_levers.py --output-stride 16 8 --threads 1 --json levers.json

A training step: forward in train mode, cross-entropy against random labels at the input size,
backward (no optimizer step). Median of ``--reps``, the settings taking turns.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
from model_speed import interleaved_medians
from torch import nn

from dualseg.engine.cpu_bf16 import Fp32Conv2d, convs_in_fp32, is_depthwise, needs_fp32
from dualseg.io import atomic_write_text
from dualseg.metrics import to_jsonable
from dualseg.models import build_model

SETTINGS = {  # name: (channels_last, bf16, which convolutions run in fp32)
    "fp32": (False, False, None),
    "fp32+cl": (True, False, None),
    "bf16+cl, all bf16": (True, True, None),
    "bf16+cl, depthwise fp32": (True, True, "depthwise"),
    "bf16+cl, cpu_bf16 fp32 convs (trainer)": (True, True, "trainer"),
}


def prepared(name: str, output_stride: int, setting: tuple[bool, bool, str | None]) -> nn.Module:
    torch.manual_seed(0)  # the same weights in every setting
    model = build_model(name, num_classes=11, weights="imagenet", output_stride=output_stride)
    channels_last, _, fp32 = setting
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if fp32 == "trainer":
        convs_in_fp32(model)  # what fit does: depthwise + dilated with channels off 16
    elif fp32 == "depthwise":  # the trainer of commit 5bb0235 (depthwise only)
        for m in model.modules():
            if is_depthwise(m) and type(m) is nn.Conv2d:
                m.__class__ = Fp32Conv2d
    return model.train()


def step_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor, bf16: bool) -> Callable[[], None]:
    def run() -> None:
        model.zero_grad(set_to_none=True)
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
        with amp:
            logits = model(x)
        nn.functional.cross_entropy(logits.float(), y).backward()

    return run


def grad_errors(model: nn.Module, reference: nn.Module) -> dict[str, dict[str, float]]:
    """Relative error (norm) of each conv weight gradient against ``reference``'s: median and
    worst over the dilated depthwise convolutions and over the other convolutions (NaN: inf)."""
    errors: dict[str, list[float]] = {
        "dilated_depthwise": [],
        "dilated_dense_off16": [],  # dilated, input channels not a multiple of 16
        "other_convs": [],
    }
    ref = dict(reference.named_modules())
    for name, m in model.named_modules():
        if not isinstance(m, nn.Conv2d) or m.weight.grad is None:
            continue
        e = ref[name].weight.grad
        err = float((m.weight.grad - e).norm() / e.norm().clamp_min(1e-12))
        dilated = max(m.dilation) > 1 and max(m.kernel_size) > 1
        if is_depthwise(m):
            kind = "dilated_depthwise" if dilated else "other_convs"
        else:
            kind = "dilated_dense_off16" if needs_fp32(m) else "other_convs"
        errors[kind].append(err if math.isfinite(err) else math.inf)  # NaN as inf
    return {
        k: {"median": statistics.median(v), "max": max(v)} if v else {} for k, v in errors.items()
    }


def cpu_name() -> str:
    """The processor's model name (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models", nargs="+", default=["dualseg_mobilenet_v2", "deeplabv3_mobilenet_v2"]
    )
    p.add_argument("--output-stride", nargs="+", type=int, default=[16, 8], choices=(8, 16))
    p.add_argument("--size", nargs=2, type=int, default=[192, 256], metavar=("H", "W"))
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="also write the rows to this JSON file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, *args.size)
    y = torch.randint(0, 11, (args.batch, *args.size))
    rows = []
    print(f"{args.batch}x{args.size[0]}x{args.size[1]}, {args.threads} thread(s)")
    for os_ in args.output_stride:
        for name in args.models:
            models = {s: prepared(name, os_, v) for s, v in SETTINGS.items()}
            fns = []
            for s, m in models.items():
                cl, bf16, _ = SETTINGS[s]
                xs = x.contiguous(memory_format=torch.channels_last) if cl else x
                fns.append(step_fn(m, xs, y, bf16))
            times = interleaved_medians(fns, torch.device("cpu"), args.reps, args.warmup)
            base = times[0]
            for m, fn in zip(models.values(), fns):  # one more step on the same batch, each
                for d in m.modules():  # setting, without dropout (its masks differ by dtype)
                    if isinstance(d, nn.Dropout):
                        d.eval()
                fn()
            for (s, m), t in zip(models.items(), times):
                row = {"model": name, "output_stride": os_, "setting": s, "train_ms": 1e3 * t}
                row["vs_fp32"] = t / base
                if SETTINGS[s][1]:
                    row["grad_error"] = grad_errors(m, models["fp32"])
                rows.append(row)
                errs = ", ".join(
                    f"{kind} {e['median']:.2g} / {e['max']:.2g}"
                    for kind, e in row.get("grad_error", {}).items()
                    if e
                )
                print(
                    f"os{os_} {name:24} {s:40} {1e3 * t:7.0f} ms  {t / base:.2f}x"
                    + (f"  grad err (median / max): {errs}" if errs else ""),
                    flush=True,
                )
    if args.json:
        meta = {"torch": torch.__version__, "cpu": cpu_name(), "args": vars(args)}
        text = json.dumps(to_jsonable({"meta": meta, "rows": rows}), indent=1, allow_nan=False)
        atomic_write_text(Path(args.json), text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
