"""Benchmark: method B's extra time again, on a finished ``benchmarks/camvid.py`` run folder.

The paired timing of ``camvid_refine.time_inference`` (the base's forward and labels, then
method B on the same image, batch 1, less the labels it takes itself) for each refined model
of the run, with the decision chosen there (``results.json``'s ``decision_sweep_dev``) and the
same decision without its blocked switches, the two alternating for ``--repeats`` rounds, so
that both read the same load. The scores are not touched; the ratios land in ``RUN/retime.json``
(``--out``; an existing file is kept unless ``--overwrite``)::

    python benchmarks/retime_refine.py runs/xscene_0016E5_recipe_T3000 \\
        --data ../shared/data/camvid --images 30 --repeats 4 --threads 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch
from camvid_refine import eval_loader, time_inference

from dualseg.engine.checkpoint import build_model_from_checkpoint, load_checkpoint
from dualseg.errors import DualsegError
from dualseg.io import atomic_write_json, check_writable
from dualseg.refine import BoundaryRefiner


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("run", type=Path, help="a finished benchmarks/camvid.py --out folder")
    p.add_argument("--data", required=True, help="CamVid root (its val split is timed)")
    p.add_argument("--images", type=int, default=30, help="images timed per round")
    p.add_argument("--repeats", type=int, default=4, help="rounds of each decision")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, help="where the record goes (default: RUN/retime.json)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return p.parse_args(argv)


def decisions(chosen: dict) -> dict[str, dict]:
    """The chosen decision and, where it blocks switches, the same without: name -> overrides."""
    return {"chosen": chosen} | ({"unblocked": chosen | {"blocked_switches": ()}}
                                if chosen.get("blocked_switches") else {})  # fmt: skip


def retime_model(
    run: Path, results: dict, name: str, loader: object, images: int, repeats: int
) -> dict:
    """``{decision: {"ratios": [...], "median": m, "base_ms": [...], "extra_ms": [...]}}``."""
    kept = results["train"][name]["evaluated"]["checkpoint"]
    ckpt = load_checkpoint(run / "runs" / name / kept)
    model, _ = build_model_from_checkpoint(ckpt, device="cpu")
    model.eval()
    refiner = BoundaryRefiner.load(run / f"refiner_{name}.pt")
    config = refiner.config
    variants = decisions(results["decision_sweep_dev"][name]["chosen"])
    out: dict = {k: {"ratios": [], "base_ms": [], "extra_ms": []} for k in variants}
    for _ in range(repeats):
        for key, overrides in variants.items():
            refiner.config = dataclasses.replace(config, **overrides)
            base_s, extra_s, _ = time_inference(model, loader, images, torch.device("cpu"), refiner)
            out[key]["ratios"].append(extra_s / base_s)
            out[key]["base_ms"].append(1000 * base_s)
            out[key]["extra_ms"].append(1000 * extra_s)
            print(f"{name} {key}: base {1000 * base_s:.0f} ms, method B {1000 * extra_s:.1f} ms, "
                  f"{100 * extra_s / base_s:.1f}%", flush=True)  # fmt: skip
    for v in out.values():
        v["median"] = statistics.median(v["ratios"])
    return out


def out_problem(out: Path, results_path: Path, overwrite: bool) -> str | None:
    """Why ``out`` may not be written, or None: the run's scores never are, and an earlier
    timing only with ``--overwrite`` (it took minutes under a load that may not recur)."""
    if out.resolve() == results_path.resolve():
        return "holds the run's scores; pass --out another file"
    if out.exists() and not overwrite:
        return "exists; pass --overwrite to replace it, or --out another file"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    results_path = args.run / "results.json"
    if not results_path.is_file():
        print(f"error: {results_path} not found; pass a finished benchmarks/camvid.py --out folder",
              file=sys.stderr)  # fmt: skip
        return 2
    results = json.loads(results_path.read_text())
    sweeps = results.get("decision_sweep_dev") or {}
    if not sweeps:
        print(f"error: {results_path} holds no chosen decision; run camvid.py with --refine-steps",
              file=sys.stderr)  # fmt: skip
        return 2
    out = args.out or args.run / "retime.json"
    if problem := out_problem(out, results_path, args.overwrite):  # before the long part
        print(f"error: {out} {problem}", file=sys.stderr)
        return 2
    check_writable(out, what="--out")
    _, loader = eval_loader(args.data, None, args.images + 2, 0)  # + time_inference's warm-up
    timed = {name: retime_model(args.run, results, name, loader, args.images, args.repeats)
             for name in sweeps}  # fmt: skip
    record = {"images": args.images, "repeats": args.repeats, "threads": args.threads,
              "models": timed}  # fmt: skip
    atomic_write_json(out, record)
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DualsegError as err:  # an output that cannot be written, a checkpoint refused
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
