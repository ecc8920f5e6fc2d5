"""Speed of method A's network against the torchvision DeepLabV3 peer on the same backbone.

For each dualseg model and its peer (``deeplabv3_<backbone>``, same dilated backbone and output
stride), in the same run: forward and forward+backward time (median over repetitions), FLOPs
(``torch.utils.flop_counter``, counted on the meta device so they are exact and cost no compute),
achieved GFLOP/s, peak memory, and the ReNet layers' share of the forward time. Then the ratios
dualseg/peer. Targets (issue 3): dualseg's achieved GFLOP/s >= 0.9x the peer's, ReNet < 15% of
the forward time. Issue 14: the ReNet layers' achieved GFLOP/s (their counted forward FLOPs over
their own time) against a large SGEMM timed in the same run (>= 50%), and dualseg's training
step <= 1.5x the peer's.

    python benchmarks/model_speed.py --device cpu --batch 1 --reps 3 --models dualseg_mobilenet_v2
    python benchmarks/model_speed.py --device cuda --batch 1 8          # AMP (fp16) on by default
    python benchmarks/model_speed.py --device cpu --batch 4 --size 192 256 --output-stride 16 \
        --threads 1 --models dualseg_mobilenet_v2 --parts       # where each step's time goes

``--parts``: each part's training step alone (forward + backward on the input it gets in the
model: backbone, ReNet context, ASPP / DeepLab head), the rest of the step (input padding,
grey conversion, fusion, softmax, upsampling) as the difference, and two lower bounds on
dualseg's step over the peer's that hold without any change to the model: its two backbones
alone, and those plus its ReNet layers at the same-run SGEMM rate (3 x their forward FLOPs).

train*GF/s: 3 x forward FLOPs per training step / step time. Peak memory: CUDA
``max_memory_allocated`` during forward+backward; on CPU the bytes of the
tensors saved for backward (activation memory of a training step).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from dualseg.io import atomic_write_json
from dualseg.models import MODELS, ReNetLayer, build_model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(
    fns: list[Callable[[], object]], device: torch.device, reps: int, warmup: int
) -> list[float]:
    """Median time of each function, the functions taking turns (ABAB...) so that load from
    other processes on a shared machine hits the dualseg model and its peer alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    sync(device)
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            sync(device)
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


@functools.lru_cache
def count_flops(name: str, num_classes: int, size: tuple[int, int], output_stride: int = 8) -> int:
    """Forward FLOPs for one image, counted on the meta device (no arithmetic is done).

    Backward FLOPs are not counted: torch's flop counter overcounts ``convolution_backward`` of
    grouped (depthwise) convolutions by ~20x, so training throughput uses the usual
    3 x forward estimate instead.
    """
    with torch.device("meta"):
        model = build_model(name, num_classes=num_classes, output_stride=output_stride).eval()
        x = torch.empty(1, 3, *size)
    with FlopCounterMode(display=False) as fwd, torch.no_grad():
        model(x)
    return fwd.get_total_flops()


def saved_tensor_bytes(model: nn.Module, x: torch.Tensor, autocast) -> int:
    """Bytes kept for backward by one training forward (unique storages)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast():
        model(x)
    return sum(seen.values())


def renet_flops(inputs: list) -> int:
    """Forward FLOPs of the ReNet layers on their inputs, counted on the meta device."""
    total = 0
    for mod, inp in inputs:
        meta = ReNetLayer(mod.rows.input_size // mod.patch**2, mod.hidden, mod.patch).to("meta")
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            meta(torch.empty(inp.shape, device="meta"))
        total += counter.get_total_flops()
    return total


def gemm_gflops(device: torch.device, n: int = 1024, reps: int = 10) -> float:
    """Achieved GFLOP/s of an n x n x n float32 matmul: the machine's reference now."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    for _ in range(2):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return reps * 2 * n**3 / (time.perf_counter() - t0) / 1e9


def renet_inputs(model: nn.Module, x: torch.Tensor, autocast) -> list:
    """(ReNet layer, the input it gets in the model) for every ReNet layer of ``model``."""
    inputs: list[tuple[nn.Module, torch.Tensor]] = []
    hooks = [
        m.register_forward_pre_hook(lambda mod, args: inputs.append((mod, args[0])))
        for m in model.modules()
        if isinstance(m, ReNetLayer)
    ]
    with torch.inference_mode(), autocast():
        model(x)
    for h in hooks:
        h.remove()
    return inputs


def time_training(
    models: list[nn.Module],
    rows: list[dict],
    x: torch.Tensor,
    args: argparse.Namespace,
    device: torch.device,
    autocast: Callable,
) -> None:
    """Into ``rows``: each model's training step timed in turns, its FLOP rate and peak memory."""
    use_amp = rows[0]["amp"]
    scaler = torch.amp.GradScaler("cuda") if use_amp else None

    def train_step(model: nn.Module) -> Callable[[], None]:
        # BatchNorm with frozen statistics (eval mode), as usual when fine-tuning
        # segmentation at small batch: the peer's image-pooling BN cannot train on one image.
        model.train()
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()

        def run() -> None:
            model.zero_grad(set_to_none=True)
            with autocast():
                loss = model(x).float().square().mean()
            (scaler.scale(loss) if scaler else loss).backward()

        return run

    steps = [train_step(m) for m in models]
    train = interleaved_medians(steps, device, args.reps, args.warmup)
    for row, model, step, t in zip(rows, models, steps, train):
        if device.type == "cuda":
            model.zero_grad(set_to_none=True)
            torch.cuda.reset_peak_memory_stats(device)
            step()
            peak = torch.cuda.max_memory_allocated(device)
        else:
            peak = saved_tensor_bytes(model, x, autocast)
        row.update(
            train_ms=1e3 * t,
            gflops_train=3 * row["_flops"] / t / 1e9,  # 3 x forward FLOPs per step
            peak_mb=peak / 2**20,
        )


def measure_pair(names: list[str], args: argparse.Namespace, device: torch.device, batch: int):
    """Rows for a dualseg model and its peer, timed in turns."""
    size = tuple(args.size)
    use_amp = device.type == "cuda" and not args.no_amp

    def autocast():
        if use_amp:
            return torch.autocast("cuda", dtype=torch.float16)
        return nullcontext()

    torch.manual_seed(0)
    x = torch.randn(batch, 3, *size, device=device)
    models = [
        build_model(n, num_classes=args.num_classes, output_stride=args.output_stride)
        .to(device)
        .eval()
        for n in names
    ]
    rows = []
    for name in names:
        key = f"{name}@{size[0]}x{size[1]}/{args.num_classes}/os{args.output_stride}"
        if key not in args.flops_cache:
            args.flops_cache[key] = count_flops(name, args.num_classes, size, args.output_stride)
        flops = batch * args.flops_cache[key]
        row = {"model": name, "device": device.type, "batch": batch, "amp": use_amp}
        rows.append(row | {"gflop_fwd": flops / 1e9, "_flops": flops})

    def forward(model: nn.Module) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode(), autocast():
                model(x)

        return run

    def renet_only(model: nn.Module) -> Callable[[], None]:
        inputs = renet_inputs(model, x, autocast)

        def run() -> None:  # each ReNet layer alone, on the input it gets in the model
            with torch.inference_mode(), autocast():
                for mod, inp in inputs:
                    mod(inp)

        return run

    fwd = interleaved_medians([forward(m) for m in models], device, args.reps, args.warmup)
    with_renet = [m for m in models if any(isinstance(k, ReNetLayer) for k in m.modules())]
    renet = interleaved_medians([renet_only(m) for m in with_renet], device, args.reps, 1)
    renet_iter = iter(renet)
    gemm = statistics.median(gemm_gflops(device) for _ in range(3))  # same run, same load
    for row, model, t in zip(rows, models, fwd):
        t_renet = next(renet_iter) if model in with_renet else 0.0
        row.update(fwd_ms=1e3 * t, gflops_fwd=row["_flops"] / t / 1e9, renet_share=t_renet / t)
        row["gemm_gflops"] = gemm
        if t_renet:
            row["renet_gflops"] = renet_flops(renet_inputs(model, x, autocast)) / t_renet / 1e9

    if not args.no_backward:
        time_training(models, rows, x, args, device, autocast)
    del models
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]


PARTS = {  # submodules of a dualseg model / of the peer, in forward order
    "dualseg": (
        "rgb.backbone",
        "gray.backbone",
        "rgb.context",
        "gray.context",
        "rgb.aspp",
        "gray.aspp",
    ),
    "deeplabv3": ("backbone", "head"),
}


def part_inputs(model: nn.Module, x: torch.Tensor, names: tuple[str, ...]) -> dict:
    """The input each named submodule gets in ``model``'s forward on ``x``."""
    inputs: dict[str, torch.Tensor] = {}
    hooks = []
    for name in names:
        module = model.get_submodule(name)
        hook = functools.partial(lambda n, mod, args: inputs.setdefault(n, args[0]), name)
        hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return inputs


def measure_parts(names: list[str], args: argparse.Namespace, device: torch.device, batch: int):
    """Training-step time of each part of a dualseg model and of its peer, timed in turns with
    the whole steps, plus the lower bounds on the step ratio (see the module docstring)."""
    torch.manual_seed(0)
    x = torch.randn(batch, 3, *args.size, device=device)
    models = [
        build_model(n, num_classes=args.num_classes, output_stride=args.output_stride)
        .to(device)
        .train()
        for n in names
    ]
    for m in models:  # frozen BN statistics, as in measure_pair's training step
        for bn in m.modules():
            if isinstance(bn, nn.modules.batchnorm._BatchNorm):
                bn.eval()

    def step(fn: Callable[[torch.Tensor], torch.Tensor], inp: torch.Tensor, grad_in: bool):
        def run() -> None:
            i = inp.detach().requires_grad_(grad_in)  # a backbone's image needs no gradient
            fn(i).float().square().mean().backward()

        return run

    labels, fns = [], []
    for name, model in zip(names, models):
        parts = PARTS["dualseg" if name.startswith("dualseg_") else "deeplabv3"]
        inputs = part_inputs(model, x, parts)
        labels.append((name, "step"))
        fns.append(step(model, x, False))
        for part in parts:
            if part in inputs:  # gray.* is absent from the single-branch ablation
                labels.append((name, part))
                fns.append(step(model.get_submodule(part), inputs[part], "backbone" not in part))
    times = dict(zip(labels, interleaved_medians(fns, device, args.reps, args.warmup)))
    gemm = statistics.median(gemm_gflops(device) for _ in range(3))
    rows = []
    for name in names:
        ms = {part: 1e3 * t for (n, part), t in times.items() if n == name}
        ms["rest"] = ms["step"] - sum(v for k, v in ms.items() if k != "step")
        rows.append({"model": name, "device": device.type, "batch": batch, "parts_ms": ms})
    dual, peer = rows
    backbones = sum(v for k, v in dual["parts_ms"].items() if k.endswith("backbone"))
    renet = renet_flops(renet_inputs(models[0], x, nullcontext))
    renet_ideal_ms = 1e3 * 3 * renet / (gemm * 1e9)
    peer_step = peer["parts_ms"]["step"]
    dual.update(
        gemm_gflops=gemm,
        renet_train_ms_at_gemm_rate=renet_ideal_ms,
        step_ratio=dual["parts_ms"]["step"] / peer_step,
        bound_backbones=backbones / peer_step,
        bound_backbones_renet_at_gemm=(backbones + renet_ideal_ms) / peer_step,
    )
    return rows


def peer_of(name: str) -> str | None:
    if not name.startswith("dualseg_"):
        return None
    peer = "deeplabv3_" + name.removeprefix("dualseg_")
    return peer if peer in MODELS else None


def fmt(row: dict, key: str, spec: str) -> str:
    return format(row[key], spec) if key in row else "-"


def print_parts(rows: list[dict]) -> list[dict]:
    for r in rows:
        print(f"{r['device']:6} {r['batch']:>2} {r['model']:24} training step by part (ms):")
        for part, ms in r["parts_ms"].items():
            print(f"{'':10}{part:16} {ms:8.1f}", flush=True)
    d = rows[0]
    print(
        f"  dualseg/peer step {d['step_ratio']:.2f}x; lower bounds without changing the model: "
        f"its two backbones alone {d['bound_backbones']:.2f}x, plus its ReNet layers at the "
        f"same-run SGEMM rate ({d['gemm_gflops']:.0f} GFLOP/s: "
        f"{d['renet_train_ms_at_gemm_rate']:.0f} ms) {d['bound_backbones_renet_at_gemm']:.2f}x "
        "(target <= 1.5)",
        flush=True,
    )
    return rows


def print_pair(dev: str, batch: int, result: list[dict]) -> None:
    """The rows of a model and its peer, then their ratios against the targets."""
    for r in result:
        print(
            f"{dev + ('+amp' if r['amp'] else ''):6} {batch:>2} {r['model']:24} "
            f"{r['fwd_ms']:9.1f} {fmt(r, 'train_ms', '9.1f'):>9} "
            f"{r['gflop_fwd']:8.1f} {r['gflops_fwd']:8.1f} "
            f"{fmt(r, 'gflops_train', '10.1f'):>10} {fmt(r, 'peak_mb', '8.0f'):>8} "
            f"{100 * r['renet_share']:6.1f}",
            flush=True,
        )
    if len(result) == 2:
        a, b = result
        ratio = a["gflops_fwd"] / b["gflops_fwd"]
        if "renet_gflops" in a:
            share = a["renet_gflops"] / a["gemm_gflops"]
            print(
                f"  ReNet {a['renet_gflops']:.1f} GFLOP/s, same-run SGEMM "
                f"{a['gemm_gflops']:.1f}: {100 * share:.0f}% (target >= 50%: "
                f"{'ok' if share >= 0.5 else 'MISSED'})",
                flush=True,
            )
        if "train_ms" in a:
            step = a["train_ms"] / b["train_ms"]
            print(
                f"  training step dualseg/peer {step:.2f}x (target <= 1.5: "
                f"{'ok' if step <= 1.5 else 'MISSED'})",
                flush=True,
            )
        print(
            f"  ratio dualseg/peer: fwd time {a['fwd_ms'] / b['fwd_ms']:.2f}x, "
            f"FLOPs {a['gflop_fwd'] / b['gflop_fwd']:.2f}x, achieved GFLOP/s "
            f"{ratio:.2f}x (target >= 0.9: {'ok' if ratio >= 0.9 else 'MISSED'}), "
            f"ReNet {100 * a['renet_share']:.1f}% of forward (target < 15%: "
            f"{'ok' if a['renet_share'] < 0.15 else 'MISSED'})",
            flush=True,
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["dualseg_mobilenet_v2", "dualseg_resnet101"])
    p.add_argument("--device", nargs="+", default=["cpu", "cuda"], help="skipped when absent")
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    p.add_argument("--size", nargs=2, type=int, default=[360, 480], metavar=("H", "W"))
    p.add_argument("--num-classes", type=int, default=11)
    p.add_argument("--output-stride", type=int, default=8, choices=(8, 16))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch default)")
    p.add_argument("--no-amp", action="store_true", help="fp32 on CUDA")
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument("--parts", action="store_true", help="time each part's training step")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--flops-file", help="JSON cache of counted FLOPs (read, then updated)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.flops_cache = {}
    if args.flops_file and Path(args.flops_file).is_file():
        args.flops_cache = json.loads(Path(args.flops_file).read_text())
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cudnn.benchmark = True

    devices = [d for d in args.device if d != "cuda" or torch.cuda.is_available()]
    header = (
        f"{'device':6} {'b':>2} {'model':24} {'fwd ms':>9} {'train ms':>9} {'GFLOP':>8} "
        f"{'GFLOP/s':>8} {'train*GF/s':>10} {'peak MB':>8} {'ReNet%':>6}"
    )
    print(f"input {args.size[0]}x{args.size[1]}, {torch.get_num_threads()} CPU threads")
    if not args.parts:
        print(header)
    rows = []
    for dev in devices:
        device = torch.device(dev)
        for batch in args.batch:
            for name in args.models:
                pair = [name] + ([peer_of(name)] if peer_of(name) else [])
                if args.parts:
                    if len(pair) == 2:
                        rows += print_parts(measure_parts(pair, args, device, batch))
                    continue
                result = measure_pair(pair, args, device, batch)
                rows += result
                print_pair(dev, batch, result)
    if args.json:
        atomic_write_json(args.json, rows)
    if args.flops_file:
        atomic_write_json(args.flops_file, args.flops_cache)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
