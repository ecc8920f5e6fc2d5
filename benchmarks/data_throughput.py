"""Augmented training samples per second through a DataLoader (issue 2 benchmark).

    python benchmarks/data_throughput.py ../shared/data/camvid --split train --workers 2

Reads the split with the default training transform (scale 0.5-2, 360x480 crop, flip, blur,
jitter, normalization), batches of 8, and reports the median samples/s over several timed
rounds after one warm-up round (worker start-up excluded), then the CPU time one sample costs
(which does not depend on what else runs on the machine). Target: >= 40 samples/s with
2 workers on 2 cores, so data loading never limits training. Not a test: the machine is shared,
so read the median and the spread, not one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dualseg.data import build_dataset, build_train_transform


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("root", help="dataset folder, e.g. ../shared/data/camvid")
    p.add_argument("--split", default="train")
    p.add_argument("--preset", default="camvid")
    p.add_argument("--crop-size", type=int, nargs=2, default=(360, 480), metavar=("H", "W"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--batches", type=int, default=6, help="batches per timed round")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (median reported)")
    a = p.parse_args(argv)

    torch.set_num_threads(1)
    transform = build_train_transform(crop_size=tuple(a.crop_size))
    total = a.batch_size * a.batches * (a.rounds + 1)
    ds = build_dataset(
        a.root, split=a.split, preset=a.preset, transform=transform, samples_per_epoch=total
    )
    loader = torch.utils.data.DataLoader(
        ds, batch_size=a.batch_size, shuffle=True, num_workers=a.workers, persistent_workers=False
    )
    it = iter(loader)
    rates = []
    for r in range(a.rounds + 1):
        t0 = time.perf_counter()
        for _ in range(a.batches):
            images, labels = next(it)
        dt = time.perf_counter() - t0
        if r > 0:  # round 0 warms up (worker start, first decode)
            rates.append(a.batches * a.batch_size / dt)
    assert images.shape[-2:] == tuple(a.crop_size) and labels.dtype == torch.int64
    # CPU cost per sample in this process (no workers): what the loader needs from a free core,
    # unaffected by other jobs competing for the cores (unlike the wall-clock rate above).
    n = a.batch_size * 2
    t0 = time.process_time()
    for i in range(n):
        ds[i]
    cpu_ms = 1000 * (time.process_time() - t0) / n
    print(
        f"{a.split} of {a.root}: {statistics.median(rates):.1f} samples/s median "
        f"(rounds: {', '.join(f'{r:.1f}' for r in rates)}) at {a.crop_size[0]}x{a.crop_size[1]}, "
        f"{a.workers} workers, batch {a.batch_size}; target >= 40 samples/s"
    )
    print(
        f"CPU cost {cpu_ms:.1f} ms/sample -> {1000 / cpu_ms:.0f} samples/s per free core, "
        f"{a.workers * 1000 / cpu_ms:.0f} with {a.workers} workers on idle cores"
    )


if __name__ == "__main__":
    main()
