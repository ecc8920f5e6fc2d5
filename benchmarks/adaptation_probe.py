"""Benchmark (not a test): would per-image prototype adaptation help method B on new scenes?

Issue 40, item 2. Method B's P5 picks, among each near-boundary pixel's Top-N labels, the one
whose class prototype is nearest. On an image from a new scene the stored prototypes may sit
away from where that scene's embeddings fall. Without labels at inference, each prototype can
be blended with the mean embedding of the image's own pixels that the base labels with that
class confidently (max probability >= tau) and far from any boundary (> 8 px, every 4th pixel,
at least 20 of them): ``p' = (1 - alpha) p + alpha m``. This probe scores that on a labelled
split for a grid of ``alpha`` and ``tau``, beside the base and method B (floor 0.05, the
decision the cross-scene run chose on dev), from one base checkpoint and its refiner
(``base-frozen`` with a decoder: it reads the base's own features)::

    python benchmarks/adaptation_probe.py --base RUN/runs/peer/best.pt \
        --refiner RUN/refiner_peer.pt --split RUN/data/val.txt --out val.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from dualseg.data import build_dataset
from dualseg.engine.checkpoint import build_model_from_checkpoint, load_checkpoint
from dualseg.engine.inference import infer_logits
from dualseg.io import atomic_write_json
from dualseg.metrics import ConfusionMatrix
from dualseg.refine import BoundaryRefiner
from dualseg.refine.boundary import near_boundary_mask
from dualseg.refine.decision import Candidates, decide, prototype_row_scores, prototype_scale
from dualseg.refine.embedding import EmbeddingNet

FAR, MIN_PIXELS, FLOOR = 8, 20, 0.05


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", required=True, help="base model checkpoint")
    p.add_argument("--refiner", required=True, help="its refiner (base-frozen, with a decoder)")
    p.add_argument("--split", required=True, help="list file of a labelled split (CamVid)")
    p.add_argument("--alphas", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0])
    p.add_argument("--taus", type=float, nargs="+", default=[0.7, 0.9])
    p.add_argument("--limit", type=int, help="only the first N images")
    p.add_argument("--out", required=True, help="results JSON")
    return p.parse_args()


def distances(e: torch.Tensor, protos: torch.Tensor, c: Candidates, scale: float) -> torch.Tensor:
    """P5's distances of the near-boundary embeddings ``e [M,D]`` to ``protos`` (as stored)."""
    d = prototype_row_scores(e, protos).gather(1, c.labels) / scale
    return d.masked_fill(torch.isinf(c.distance), float("inf"))  # labels without a prototype


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    model = build_model_from_checkpoint(load_checkpoint(args.base))[0].eval()
    refiner = BoundaryRefiner.load(args.refiner)
    split = Path(args.split)
    ds = build_dataset(split.parent, split=split.stem, preset="camvid")
    k, protos = refiner.num_classes, refiner.prototypes.float()
    scale = prototype_scale(refiner.prototypes, refiner.present)
    names = ["base", "B"] + [f"alpha {a:g}, tau {t:g}" for t in args.taus for a in args.alphas]
    cms = {v: ConfusionMatrix(k) for v in names}
    moved = {v: [0, 0] for v in names}  # fixed, broken
    n = len(ds) if args.limit is None else min(args.limit, len(ds))
    t0 = time.time()
    with torch.no_grad():
        for i in range(n):
            x, y = (t[None] for t in ds[i][:2])
            with refiner.shared_features(model) as kept:
                probs = infer_logits(model, x).softmax(1)
                feats = kept.take(x)
            c = refiner.candidates(x, probs, features=feats)
            emb = refiner.net.head(feats.features, feats.low)  # [1,D,h,w], dense here
            e = EmbeddingNet.sample(emb, c.edge, feats.covered)  # [M,D], edge.nonzero() order
            # the probe's distances are method B's own (the sparse decoder's), checked
            same = distances(e, protos, c, scale)
            finite = torch.isfinite(c.distance)
            assert torch.allclose(same[finite], c.distance[finite], atol=1e-2)
            outs = {"base": c.pred, "B": decide(c, min_prob=FLOOR)[0]}
            conf = probs.max(1).values
            far = ~near_boundary_mask(c.pred, radius=FAR, ignore_index=None, method="neighbour")
            grid = torch.zeros_like(far)
            grid[:, ::4, ::4] = True
            for tau in args.taus:
                inner = far & grid & (conf >= tau)
                s = EmbeddingNet.sample(emb, inner, feats.covered)
                lab = c.pred[inner]
                count = torch.bincount(lab, minlength=k).float()
                means = (
                    torch.zeros(k, s.shape[1]).index_add_(0, lab, s) / count.clamp_min(1)[:, None]
                )
                seen = (count >= MIN_PIXELS)[:, None]
                for a in args.alphas:
                    adapted = torch.where(seen, (1 - a) * protos + a * means, protos)
                    d = distances(e, adapted, c, scale)
                    ca = Candidates(c.pred, c.edge, c.labels, d, c.log_prob, c.margin, c.index)
                    outs[f"alpha {a:g}, tau {tau:g}"] = decide(ca, min_prob=FLOOR)[0]
            valid = y != 255
            right0 = (c.pred == y) & valid
            for v, o in outs.items():
                cms[v].update(o, y)
                right = (o == y) & valid
                moved[v][0] += int((right & ~right0).sum())
                moved[v][1] += int((~right & right0).sum())
            if i % 20 == 0:
                print(f"{i}/{n} {time.time() - t0:.0f}s", flush=True)
    rows = {}
    for v in names:
        m = cms[v].compute()
        rows[v] = {"miou": round(100 * m["miou"], 2), "fixed": moved[v][0], "broken": moved[v][1]}
        print(v, rows[v], flush=True)
    atomic_write_json(args.out, {"args": vars(args), "images": n, "rows": rows})


if __name__ == "__main__":
    main()
