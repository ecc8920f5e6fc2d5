"""Peak memory (and time) of sliding-window inference against whole-image inference.

For each image size, one forward pass of a randomly initialized network in ``whole`` mode and in
``slide`` mode (``dualseg.engine.inference.infer_logits``), each in a fresh process so that one
measurement cannot inherit the other's allocator pools:

- CUDA: ``torch.cuda.max_memory_allocated`` during the call, minus what was allocated before it
  (model and input);
- CPU: the growth of the process's peak resident set size (``ru_maxrss``) during the call.

Whole-image memory grows with the image; slide's stays bounded by the window (and
``--tile-batch``) plus the logits of the whole image (``C x H x W`` float32, listed apart).

    python benchmarks/slide_memory.py --device cuda --sizes 512 1024 2048 4096
    python benchmarks/slide_memory.py --device cpu --threads 4 --sizes 512 1024 2048

This is a benchmark, not a test: it is slow on a CPU and never runs in the test suite.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import sys
import time
from typing import Any


def _measure(
    arch: str, size: int, mode: str, window: int, stride: int, tile_batch: int, device: str
) -> dict[str, Any]:
    """One measurement (run in a child process)."""
    import torch

    from dualseg.engine.inference import infer_logits
    from dualseg.models import build_model

    dev = torch.device(device)
    model = build_model(arch, num_classes=19, output_stride=16).to(dev).eval()
    x = torch.randn(1, 3, size, size, device=dev)
    with torch.no_grad():  # warm-up on a small input: lazy inits are not the call's memory
        infer_logits(model, x[..., :64, :64])
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    with torch.no_grad():
        logits = infer_logits(
            model,
            x,
            mode=mode,
            window=(window, window),
            stride=(stride, stride),
            tile_batch=tile_batch,
        )
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {
        "size": size,
        "mode": mode,
        "peak_mib": peak / 2**20,
        "logits_mib": logits.numel() * 4 / 2**20,
        "seconds": time.perf_counter() - start,
    }


def _child(queue: Any, threads: int, *args: Any) -> None:
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    queue.put(_measure(*args))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="dualseg_mobilenet_v2", help="(dualseg_mobilenet_v2)")
    p.add_argument("--device", default="cuda", help="cuda | cpu (cuda)")
    p.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048], help="square px")
    p.add_argument("--window", type=int, default=512, help="slide window, square (512)")
    p.add_argument("--stride", type=int, default=342, help="slide stride (342: 2/3 window)")
    p.add_argument("--tile-batch", type=int, default=4, help="tiles per forward pass (4)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)

    ctx = mp.get_context("spawn")
    rows = []
    for size in args.sizes:
        for mode in ("whole", "slide"):
            queue = ctx.Queue()
            job = (args.arch, size, mode, args.window, args.stride, args.tile_batch, args.device)
            proc = ctx.Process(target=_child, args=(queue, args.threads, *job))
            proc.start()
            proc.join()
            if proc.exitcode != 0:
                print(f"{mode} at {size}x{size}: failed (exit {proc.exitcode})", file=sys.stderr)
                continue
            rows.append(queue.get())
    print(
        f"{args.arch} on {args.device}; slide window {args.window}, stride {args.stride}, "
        f"{args.tile_batch} tiles per pass; peak memory of one call beyond model and input"
    )
    print("| image | whole (MiB) | slide (MiB) | logits (MiB) | whole (s) | slide (s) |")
    print("|---|---|---|---|---|---|")
    by = {(r["size"], r["mode"]): r for r in rows}
    for size in args.sizes:
        w, s = by.get((size, "whole")), by.get((size, "slide"))
        if w is None or s is None:
            continue
        print(
            f"| {size}x{size} | {w['peak_mib']:.0f} | {s['peak_mib']:.0f} | "
            f"{w['logits_mib']:.0f} | {w['seconds']:.2f} | {s['seconds']:.2f} |"
        )
    if args.json:
        from pathlib import Path

        from dualseg.io import atomic_write_json

        atomic_write_json(Path(args.json), {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
