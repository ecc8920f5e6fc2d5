"""Benchmark (not a test): how many pixels does each method-B decision fix, and break?

Method B relabels near-boundary pixels; a target asks that it break at most half as many
correct pixels as it fixes. This probe runs the base and the refiner once per image, keeps what
every decision reads at the near-boundary pixels (P2-P4's candidates, P5's distances, the
ground truth), and then scores the whole decision grid of ``refine fit`` (gate, prior, floor,
switch cost; P1's blur aside) from that cache: mIoU, pixels fixed and pixels broken, per split.
``--deltas`` gives the switch costs to score (a finer set than the fit's grid). It also makes
``refine fit``'s choice on the first split by each of its rules (by mIoU, by mIoU within a
broken ratio of 0.5, by ``net_fixed``; the fit's switch costs, no blocks) and reads that
setting on every split: a choice made on one scene, scored on others::

    python benchmarks/decision_probe.py --base RUN/runs/peer/last.pt \
        --refiner RUN/refiner_peer.pt --split RUN/data/dev.txt RUN/data/val.txt --out probe.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dualseg.commands.common import nonnegative_float
from dualseg.data import build_dataset
from dualseg.engine.checkpoint import build_model_from_checkpoint, load_checkpoint
from dualseg.engine.inference import infer_logits
from dualseg.errors import ConfigError, DualsegError
from dualseg.io import atomic_write_json
from dualseg.metrics import ConfusionMatrix, change_counts, scores_from_confusion
from dualseg.refine import BoundaryRefiner
from dualseg.refine.calibrate import SWITCH_COSTS, choose_decision, decision_grid, net_fixed
from dualseg.refine.decision import Candidates, decide


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", required=True, help="base model checkpoint")
    p.add_argument("--refiner", required=True, help="its refiner")
    p.add_argument("--split", required=True, nargs="+", help="list files of labelled splits")
    p.add_argument("--deltas", type=nonnegative_float, nargs="+",
                   default=[0.0, 0.05, 0.1, 0.2, 0.4], help="switch costs to score")  # fmt: skip
    p.add_argument("--out", required=True, help="results JSON")
    return p.parse_args()


def band_cache(model: Any, refiner: BoundaryRefiner, split: Path) -> dict[str, Any]:
    """The base's confusion matrix over whole images, and the candidates of every
    near-boundary pixel of the split as one flat :class:`Candidates` with its ground truth."""
    ds = build_dataset(split.parent, split=split.stem, preset="camvid")
    cm = ConfusionMatrix(refiner.num_classes)
    parts: dict[str, list[Tensor]] = {k: [] for k in ("gt", "pred", "labels", "distance",
                                                      "log_prob", "margin")}  # fmt: skip
    t0 = time.time()
    with torch.no_grad(), refiner.shared_features(model) as kept:  # hooks set once
        for i in range(len(ds)):
            x, y = (t[None] for t in ds[i][:2])
            probs = infer_logits(model, x).softmax(1)
            c = refiner.candidates(x, probs, features=kept.take(x))
            cm.update(c.pred, y)
            parts["gt"].append(y[c.edge])  # edge.nonzero() order, as the candidates' rows
            parts["pred"].append(c.pred[c.edge])
            for key in ("labels", "distance", "log_prob", "margin"):
                parts[key].append(getattr(c, key))
            if i % 50 == 0:
                print(f"{split.stem} {i}/{len(ds)} {time.time() - t0:.0f}s", flush=True)
    band = {k: torch.cat(v) for k, v in parts.items()}
    m = len(band["pred"])
    flat = Candidates(band["pred"][None, None], torch.ones(1, 1, m, dtype=torch.bool),
                      band["labels"], band["distance"], band["log_prob"], band["margin"],
                      torch.arange(m))  # fmt: skip
    return {"images": len(ds), "cm": cm.mat, "gt": band["gt"].long(), "cands": flat}


def score(cache: dict[str, Any], new: Tensor, k: int) -> dict[str, float]:
    """mIoU with the band relabelled to ``new``, and the pixels it fixed and broke."""
    gt, pred = cache["gt"], cache["cands"].pred.reshape(-1)

    def counts(p: Tensor) -> Tensor:  # the band's confusion, as the whole images' was counted
        band = ConfusionMatrix(k)
        band.update(p, gt)
        return band.mat

    cm = cache["cm"] - counts(pred) + counts(new)
    changed, fixed, broken = change_counts(new, pred, gt)[1:].tolist()
    miou = 100 * scores_from_confusion(cm)["miou"]  # unrounded: the choice reads it as the fit's
    return {"miou": miou, "changed": changed, "fixed": fixed, "broken": broken,
            "net_fixed": net_fixed(fixed, broken)}  # as the fit's sweep rows  # fmt: skip


def sweep(cache: dict[str, Any], switch_costs: list[float], k: int) -> list[dict[str, Any]]:
    """One row per decision setting of the grid (P1's blur left out) at these switch costs."""
    c = cache["cands"]
    rows = [{"setting": "base", **score(cache, c.pred.reshape(-1), k)}]
    for s in decision_grid(switch_costs=switch_costs, blur_sigmas=(0.0,)):
        setting = {k_: v for k_, v in s.items() if k_ != "p1_blur_sigma"}
        rows.append({"setting": setting, **score(cache, decide(c, **setting)[0].reshape(-1), k)})
    return rows


# refine fit's rules: (--calibrate-metric, --calibrate-max-broken-ratio)
RULES: tuple[tuple[str, float | None], ...] = (("miou", None), ("miou", 0.5), ("net_fixed", None))


def fit_choices(splits: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each of :data:`RULES`' choice among the first split's rows at the fit's switch costs,
    and that setting's mIoU gain, pixels fixed and broken on every split (rows in one order)."""
    first = next(iter(splits.values()))

    def fits(setting: Any) -> bool:  # never relabelling is in the grid once, at --deltas' first
        return setting != "base" and (
            setting["gate_margin"] == 0 or setting["switch_cost"] in SWITCH_COSTS
        )

    offered = [i for i, r in enumerate(first) if fits(r["setting"])]
    flat = [{**first[i]["setting"], **first[i]} for i in offered]
    out = []
    for metric, ratio in RULES:
        chosen = choose_decision(flat, metric=metric, max_broken_ratio=ratio)
        i = next(i for i in offered if all(chosen[k] == v for k, v in first[i]["setting"].items()))
        reads = {name: {"miou_gain": round(rows[i]["miou"] - rows[0]["miou"], 2),
                        "fixed": rows[i]["fixed"], "broken": rows[i]["broken"]}
                 for name, rows in splits.items()}  # fmt: skip
        out.append({"metric": metric, "max_broken_ratio": ratio,
                    "setting": first[i]["setting"], "splits": reads})  # fmt: skip
    return out


def main() -> None:
    args = parse_args()
    if missing := sorted(set(SWITCH_COSTS) - set(args.deltas)):  # before the long part
        raise ConfigError(f"--deltas lacks refine fit's switch costs {missing}: add them, for "
                          "the fit's choice (fit_choices)")  # fmt: skip
    torch.set_num_threads(1)
    model = build_model_from_checkpoint(load_checkpoint(args.base))[0].eval()
    refiner = BoundaryRefiner.load(args.refiner)
    out: dict[str, Any] = {"args": vars(args), "splits": {}}
    for split in map(Path, args.split):
        cache = band_cache(model, refiner, split)
        rows = sweep(cache, args.deltas, refiner.num_classes)
        out["splits"][split.stem] = {"images": cache["images"], "rows": rows}
        print(split.stem, rows[0], flush=True)
    out["fit_choices"] = fit_choices({k: v["rows"] for k, v in out["splits"].items()})
    for c in out["fit_choices"]:
        print(c["metric"], c["max_broken_ratio"], c["setting"], c["splits"], flush=True)
    atomic_write_json(args.out, out)


if __name__ == "__main__":
    try:
        main()
    except DualsegError as err:  # a user error (a checkpoint, a refiner, a split): one line
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
