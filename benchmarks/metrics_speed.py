"""How long dualseg's metrics take per evaluation batch (a measurement, not a test).

CamVid-sized batch: 8 label maps of 360x480, 11 classes, ~5 % ignore. Reports the median over
repeats of ``ConfusionMatrix.update``, ``BoundaryMetrics.update`` and, as a peer in the same
run, torchmetrics' ``MulticlassJaccardIndex`` update on the same batch.

    python benchmarks/metrics_speed.py [--device cuda] [--repeats 5] [--batch 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from dualseg.metrics import BoundaryMetrics, ConfusionMatrix


def median_ms(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
    fn()  # warm-up (allocations, CUDA kernels)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--height", type=int, default=360)
    ap.add_argument("--width", type=int, default=480)
    ap.add_argument("--classes", type=int, default=11)
    args = ap.parse_args()
    dev = torch.device(args.device)
    c, shape = args.classes, (args.batch, args.height, args.width)

    gen = torch.Generator().manual_seed(0)
    coarse = torch.randint(0, c, (shape[0], 1, shape[1] // 24, shape[2] // 24), generator=gen)
    target = torch.nn.functional.interpolate(coarse.float(), size=shape[1:], mode="nearest")
    target = target[:, 0].long()
    target[torch.rand(shape, generator=gen) < 0.05] = 255
    pred = torch.roll(target.clamp(max=c - 1), shifts=(2, 3), dims=(1, 2))
    target, pred = target.to(dev), pred.to(dev)

    cm = ConfusionMatrix(c, device=dev)
    bm = BoundaryMetrics(c, device=dev)
    rows = [
        ("ConfusionMatrix.update", lambda: cm.update(pred, target)),
        ("BoundaryMetrics.update (t=3, w=5)", lambda: bm.update(pred, target)),
    ]
    try:
        from torchmetrics.classification import MulticlassJaccardIndex

        tm = MulticlassJaccardIndex(num_classes=c, average=None, ignore_index=255).to(dev)
        rows.append(("torchmetrics MulticlassJaccardIndex.update", lambda: tm.update(pred, target)))
    except ImportError:
        pass
    print(f"device={dev} batch={shape} classes={c} threads={torch.get_num_threads()}")
    for name, fn in rows:
        ms = median_ms(fn, args.repeats, dev)
        print(f"  {name:44s} {ms:9.2f} ms/batch  {1000 * shape[0] / ms:9.1f} images/s")


if __name__ == "__main__":
    main()
