"""Benchmark (not a test): would several prototypes per class (k-means) help method B?

Issue 15, item 4. Method B's P5 decides by the nearest class prototype — the claim's one mean
per class. This probe measures the mechanism directly, without changing the refiner format:
on the near-boundary pixels of a base model's prediction on a labelled split, how often is the
label right when chosen by

- the base model (its argmax),
- the nearest of the Top-N candidates' prototypes, with k = 1 (the claim) or k-means
  prototypes per class (the distance to a class is the distance to its nearest centre).

The prototypes come from a fit split (the refiner's own training split: ground-truth
near-boundary pixels, up to ``--per-image`` random pixels per image, streamed). One refiner
file and one base checkpoint; the embedding and the base run once per image::

    python benchmarks/prototype_probe.py \
        --fit runs/plateau/data/train_fit.txt --eval runs/plateau/data/dev.txt \
        --base runs/plateau/runs/peer/best.pt --refiner runs/plateau/refiner_peer.pt \
        --out docs/results/plateau/prototype_probe_peer.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dualseg.commands.common import nonnegative_int, positive_int
from dualseg.data import build_dataset, build_eval_transform
from dualseg.engine.checkpoint import build_model_from_checkpoint, load_checkpoint
from dualseg.errors import DualsegError
from dualseg.io import atomic_write_json
from dualseg.refine import BoundaryRefiner
from dualseg.refine.boundary import near_boundary_mask
from dualseg.refine.embedding import embed_pixels, p1_filter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="camvid")
    p.add_argument("--fit", required=True, help="list file of the prototypes' split")
    p.add_argument("--eval", required=True, help="list file of the labelled split scored")
    p.add_argument("--base", required=True, help="base model checkpoint")
    p.add_argument("--refiner", required=True, help="fitted refiner file (its embedding)")
    p.add_argument(
        "--ks", type=positive_int, nargs="+", default=[1, 2, 4, 8], help="centres per class"
    )
    p.add_argument("--per-image", type=positive_int, default=300, help="pixels per image and class")
    p.add_argument("--iters", type=nonnegative_int, default=25, help="k-means iterations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--out", help="results JSON")
    return p.parse_args(argv)


def kmeans(x: Tensor, k: int, iters: int, gen: torch.Generator) -> Tensor:
    """Centres ``[k',C]`` of ``x [n,C]`` (k-means++ seeding, Lloyd steps; k' = min(k, n))."""
    k = min(k, x.shape[0])
    centres = x[torch.randint(x.shape[0], (1,), generator=gen)]
    for _ in range(1, k):  # k-means++: the next centre with probability ∝ squared distance
        d2 = torch.cdist(x, centres).pow(2).min(1).values
        nxt = torch.multinomial(d2 / d2.sum(), 1, generator=gen) if d2.sum() > 0 else d2[:1].long()
        centres = torch.cat([centres, x[nxt]])
    for _ in range(iters):
        assign = torch.cdist(x, centres).argmin(1)
        sums = torch.zeros_like(centres).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=k).unsqueeze(1)
        # an empty cluster keeps its centre (dividing by its zero count would move it to 0)
        centres = torch.where(counts > 0, sums / counts.clamp(min=1), centres)
    return centres


def list_split(path: str, preset: str) -> Any:
    """The dataset of a list file (``root/name.txt``: one image per line, as written by
    ``benchmarks/camvid.py --protocol plateau``), evaluation transform."""
    p = Path(path)
    return build_dataset(p.parent, split=p.stem, preset=preset, transform=build_eval_transform())


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.time()
    gen = torch.Generator().manual_seed(args.seed)
    refiner = BoundaryRefiner.load(args.refiner)
    cfg = refiner.config
    model, meta = build_model_from_checkpoint(load_checkpoint(args.base))
    model.eval()
    num_classes = meta.num_classes

    def embed(images: Tensor, edge: Tensor) -> Tensor:  # [M,C] at the edge pixels
        x = p1_filter(images, cfg.p1_blur_sigma)
        return embed_pixels(refiner.net, x, edge, cfg.input_scale, cfg.output_stride)

    # ---- prototypes from the fit split: a random sample of ground-truth boundary pixels -----
    fit = list_split(args.fit, args.preset)
    samples: list[list[Tensor]] = [[] for _ in range(num_classes)]
    for i in range(len(fit)):
        image, label = fit[i]
        edge = near_boundary_mask(
            label[None], radius=cfg.radius, ignore_index=meta.ignore_index, method=cfg.edge_method
        )
        if not edge.any():
            continue
        emb = embed(image[None], edge)  # [M,C]
        labels = label[None][edge]
        for c in labels.unique().tolist():
            rows = emb[labels == c]
            pick = torch.randperm(rows.shape[0], generator=gen)[: args.per_image]
            samples[c].append(rows[pick])
    pooled = [torch.cat(s) if s else None for s in samples]
    centres = {
        k: [None if x is None else kmeans(x, k, args.iters, gen) for x in pooled] for k in args.ks
    }

    # ---- decisions on the eval split's predicted boundary pixels ----------------------------
    ev = list_split(args.eval, args.preset)
    right = {"base": 0, **{f"k={k}": 0 for k in args.ks}}
    total = 0
    for i in range(len(ev)):
        image, label = ev[i]
        probs = model(image[None]).softmax(1)
        pred = probs.max(1).indices
        edge = near_boundary_mask(
            pred, radius=cfg.radius, ignore_index=None, method=cfg.edge_method
        )
        edge &= label[None] != meta.ignore_index
        if not edge.any():
            continue
        b, y, x = edge.nonzero().unbind(1)
        top = probs.topk(min(cfg.top_n, num_classes), dim=1).indices[b, :, y, x]  # [M,N]
        truth = label[None][edge]
        emb = embed(image[None], edge)  # [M,C]
        total += truth.numel()
        right["base"] += int((pred[edge] == truth).sum())
        for k in args.ks:
            dist = torch.full((emb.shape[0], num_classes), float("inf"))
            for c, cen in enumerate(centres[k]):
                if cen is not None:
                    dist[:, c] = torch.cdist(emb, cen).min(1).values
            choice = top.gather(1, dist.gather(1, top).argmin(1, keepdim=True)).squeeze(1)
            right[f"k={k}"] += int((choice == truth).sum())
    results: dict[str, Any] = {
        "args": vars(args),
        "pixels": total,
        "accuracy": {name: n / max(total, 1) for name, n in right.items()},
        "seconds": time.time() - started,
    }
    for name, acc in results["accuracy"].items():
        print(f"{name:>6}: {100 * acc:.1f}% of {total} near-boundary pixels right")
    if args.out:
        atomic_write_json(Path(args.out), results)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DualsegError as err:  # a user error (a checkpoint, a refiner, a split): one line
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
