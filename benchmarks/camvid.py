"""CamVid benchmark: method A against its peer and its ablations, with method B on top.

Trains, with the same data, augmentation, budget and evaluation:

1. ``dualseg``        method A, ``dualseg_mobilenet_v2`` (offline ImageNet weights)
2. ``peer``           torchvision's DeepLabV3 head on the same dilated MobileNetV2 (same engine)
3. ``single_branch``  method A without the grayscale branch        (ablation)
4. ``no_coord``       method A without coordinate channels          (ablation)
5. ``no_renet``       method A without ReNet layers                 (ablation)

and, on request (``--models aspp_v3 no_renet_v3 logits_first``), method A with claim 3's other
reading of its ASPP (torchvision's DeepLab-v3 ASPP in place of the DeepLab-v2 sum of atrous
class scores), the same without ReNet layers, and method A with its logits upsampled before the
softmax (S44's other order); and two probes of why the ReNet layers cost method A accuracy
(``--models renet_bn renet_bn_v3 renet_skip_v3``, model options beyond the claims): a BatchNorm on
each ReNet layer's input features (``renet_norm``), with the v2 or the v3 ASPP, and the
backbone's features handed to the v3 ASPP beside the ReNet output (``renet_skip``).

then fits method B once and applies it on top of (1) and (2). Method B's embedding model learns
from ground-truth labels only (triplets on near-boundary pixels of the training set); the base
model enters at inference alone (P2-P5), so one fitted refiner serves every base model.

Every model is evaluated on CamVid val and on each ``--eval-split`` at full 360x480: mIoU,
per-class IoU, boundary F1 (3 px), trimap mIoU and inference time per image (median, batch 1).

Budget: ``--budget-iters N`` (the same iteration count for every model) or
``--budget-minutes M`` (the same wall-clock for every model: each model's iteration count is
set from a short timed calibration, so the poly schedule still ends at T).

The standard CPU setting (2 cores, under 2 hours in all) is the defaults, run on one core for
the models and one for data loading (2 torch threads beside a loader can crawl on a busy machine)::

    python benchmarks/camvid.py --data ../shared/data/camvid --out runs/bench_camvid \
        --threads 1 --workers 1

which trains on 192x256 crops (scale 0.5-1.0: the full 360x480 frame is seen at about half
resolution, as evaluation reads it at full resolution), batch 4, 15 minutes per model
(5 models: 75 min), fits method B for 3,000 steps (~13 min), then evaluates (~7 min): 94 min
in all when measured (README).
On a GPU: ``--device cuda --budget-minutes 8 --crop 360 480 --scale 0.5 2.0 --batch-size 8``.

Cross-scene (leave one sequence out): ``--protocol plateau --holdout-sequence SEQ`` trains
every base and method B on the other training sequences (list files derived into
``--out/data``; images are not copied), makes every choice (stopping, method B's decision,
``--crf``'s dense CRF settings) on SEQ, and reports SEQ as the ``cross_scene_SEQ`` split beside
val. The choices are made on that split, so read it as optimistic by the selection; with
``--holdout-sequence 0016E5`` CamVid val (other frames of 0016E5) is a scene no model trained
on, and images no choice was made on (the choices saw that sequence's training frames)::

    python benchmarks/camvid.py --data ../shared/data/camvid --out runs/xscene_0016E5 \\
        --protocol plateau --holdout-sequence 0016E5 --models peer dualseg --crf \\
        --output-stride 16 --head-lr-mult 10 --warmup-iters 100 --max-iters 3000 \\
        --val-every 150 --patience 0 --refine-steps 2000 --refine-backbone-source base-frozen \\
        --refine-input-scale 1.0 --refine-embed-dim 32 --refine-decoder-channels 48

(the leave-one-out runs of docs/results; the README's recipe holds out 0001TP instead, the
smallest sequence, and adds ``--amp bf16``: use it only on a CPU with AVX-512 BF16 or AMX,
where it is native: elsewhere it is emulated and many times slower). ``--unseen-sequence
SEQ2`` leaves a second sequence out of training and of every choice and reports it as
``unseen_SEQ2``: a new scene scored with choices made on another (``--holdout-sequence 0001TP
--unseen-sequence 0006R0``: trained on 0016E5, val in-distribution beside it).

Outputs in ``--out``: ``results.json``, ``results.md`` (markdown table), ``per_class_iou.png``,
``curves.png`` and ``panel_*.png`` (image | ground truth | peer | method A | method A + B);
method B's refiners as fitted (``refiner_NAME.pt``) and with the decision chosen on dev
(``refiner_NAME_chosen.pt``, plateau protocol: what ``dualseg eval --refiner`` scores as that
row on other images). A call evaluating other models into an ``--out`` whose ``results.json``
holds some (``--models peer``, then ``--models single_branch``) adds its rows to theirs; under
other flags it is refused.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from camvid_protocols import (
    STANDARD,
    VARIANTS,
    base_config,
    budget_mismatch,
    budget_words,
    calibrate_iters,
    carve_dev_split,
    curve_stats,
    earlier_calls_seconds,
    evaluated_checkpoint,
    open_fraction,
    positive_float,
    reuse_mismatch,
    source_commit,
    stale_record,
)
from camvid_refine import (
    choose_crfs,
    eval_loader,
    fit_refiners,
    post_processors,
    score_variants,
)
from camvid_report import (
    args_record,
    earlier_results,
    merge_results,
    save_bar_chart,
    save_curves,
    save_learning_curves,
    save_panels,
    write_table,
)

from dualseg.commands.common import nonnegative_float, nonnegative_int, positive_int
from dualseg.engine.checkpoint import build_model_from_checkpoint, load_checkpoint
from dualseg.engine.distributed import resolve_device
from dualseg.engine.train import fit
from dualseg.errors import ConfigError, DataError, DualsegError, Terminated
from dualseg.io import atomic_write_json, check_writable
from dualseg.refine.calibrate import METRICS
from dualseg.refine.config import MINING
from dualseg.refine.crf import import_pydensecrf
from dualseg.refine.refiner import RefinerConfig

# (flags, add_argument options) of each group of parse_args, in --help's order
GENERAL: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--data",), {"required": True, "help": "CamVid folder with train.txt / val.txt"}),
    (("--out",), {"default": "runs/bench_camvid", "help": "output folder"}),
    (("--eval-split",), {"action": "append", "default": [], "metavar": "PATH",
        "help": "a further split to evaluate: a list file (e.g. camvid/test.txt) or a folder"}),
    (("--models",), {"nargs": "+", "default": list(STANDARD), "choices": list(VARIANTS)}),
]  # fmt: skip
BUDGET: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--budget-minutes",), {"type": positive_float, "default": 15.0, "help": "per model"}),
    (("--budget-iters",), {"type": positive_int, "help": "per model (overrides minutes)"}),
]
TRAINING: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--crop",), {"type": positive_int, "nargs": 2, "default": (192, 256),
        "metavar": ("H", "W")}),
    (("--scale",), {"type": positive_float, "nargs": 2, "default": (0.5, 1.0),
        "metavar": ("MIN", "MAX")}),
    (("--batch-size",), {"type": positive_int, "default": 4}),
    (("--lr",), {"type": positive_float, "default": 0.01}),
    (("--workers",), {"type": nonnegative_int, "default": 2}),
    (("--device",), {"default": "auto"}),
    (("--weights",), {"default": "imagenet", "help": "'imagenet', a file, or 'none'"}),
]  # fmt: skip
METHOD_B: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--refine-steps",), {"type": nonnegative_int, "default": 3000,
        "help": "method B triplet steps (0: no method B)"}),
    (("--refine-input-scale",), {"type": positive_float, "default": RefinerConfig.input_scale}),
    (("--refine-output-stride",), {"type": int, "choices": (8, 16),
        "default": RefinerConfig.output_stride,
        "help": "method B step 3: the embedding's output stride (8: 4x the positions, and no "
        "reading of a stride-16 base's features)"}),
    (("--refine-embed-dim",), {"type": positive_int, "default": RefinerConfig.embed_dim,
        "help": "method B step 3: the embedding's channels C (its ASPP head's cost grows with C)"}),
    (("--refine-backbone-source",), {"choices": ("independent", "base-frozen", "base-finetune"),
        "default": RefinerConfig.backbone_source,
        "help": "method B step 3: one independent refiner for all bases, or one per base on its "
        "own backbone"}),
    (("--refine-decision-metric",), {"choices": METRICS, "default": METRICS[0],
        "help": "what the dev sweep of method B's decision maximizes (boundary_f1: for the "
        "edges; net_fixed: pixels fixed less twice those broken, for fewer broken pixels)"}),
    (("--refine-decision-max-broken-ratio",), {"type": nonnegative_float, "metavar": "R",
        "help": "choose method B's decision on dev only among settings breaking at most R "
        "pixels per pixel fixed (default: any)"}),
    (("--refine-mining",), {"choices": MINING, "default": RefinerConfig.mining,
        "help": "method B step 4: the false example of each triplet (random: the claim)"}),
    (("--refine-decoder-channels",), {"type": nonnegative_int,
        "default": RefinerConfig.decoder_channels,
        "help": "method B step 3, beyond the claim: 0 (the claim's embedding) or a DeepLabV3+ "
        "decoder fusing the backbone's stride-4 features, projected to this many channels (48)"}),
    (("--crf",), {"action": "store_true",
        "help": "also dense CRF on the bases method B refines (pydensecrf2: pip install "
        "'dualseg[crf]'), its kernel settings chosen on dev among four under --protocol "
        "plateau"}),
]  # fmt: skip
RUNNING: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--timing-images",), {"type": positive_int, "default": 10,
        "help": "images timed per model"}),
    (("--panels",), {"type": nonnegative_int, "default": 3, "help": "qualitative panels to write"}),
    (("--eval-limit",), {"type": positive_int,
        "help": "evaluate only the first N images (smoke runs)"}),
    (("--prototype-limit",), {"type": positive_int,
        "help": "method B prototypes from N train images"}),
    (("--seed",), {"type": int, "default": 0}),
    (("--threads",), {"type": nonnegative_int,
        "help": "torch CPU threads (default or 0: torch's; 1 on a shared machine)"}),
    (("--reuse",), {"action": "store_true",
        "help": "skip training a model whose run in --out finished (its train.json exists); a "
        "run trained with other flags (model, LR recipe, T, budget, seed, crops, batch) is "
        "refused"}),
    (("--train-only",), {"action": "store_true",
        "help": "stop after training (method B and eval later)"}),
]  # fmt: skip
PLATEAU_TITLE = (
    "--protocol plateau: train every model until its mIoU on a dev split carved from train "
    "has plateaued (no gain over --min-delta in --patience validations), report on val"
)
PLATEAU: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--protocol",), {"choices": ("budget", "plateau"), "default": "budget"}),
    (("--max-iters",), {"type": positive_int, "default": 2000, "help": "T of the poly schedule"}),
    (("--val-every",), {"type": nonnegative_int, "default": 200,
        "help": "dev validation interval (0 only with --patience 0: no dev curve)"}),
    (("--patience",), {"type": nonnegative_int, "default": 3,
        "help": "validations without gain (0: no early stop, the whole poly schedule to T: the "
        "schedule check compares T with 2T run this way)"}),
    (("--min-delta",), {"type": nonnegative_float, "default": 0.5, "help": "mIoU points"}),
    (("--dev-fraction",), {"type": open_fraction, "default": 0.125,
        "help": "the last fraction of each training sequence (by file name) held out as dev"}),
    (("--holdout-sequence",), {"metavar": "SEQ",
        "help": "leave one sequence out (e.g. 0001TP): bases and refiners train on the other "
        "sequences, this one is dev (stopping, method B's decision, --crf's settings) and is "
        "reported as the cross-scene split (in place of --dev-fraction's carve); 0016E5 leaves "
        "val a scene no model trained on"}),
    (("--unseen-sequence",), {"metavar": "SEQ",
        "help": "with --holdout-sequence, a second sequence left out of training and of every "
        "choice, reported as the unseen_SEQ split: what a new scene gets from choices made on "
        "another new scene"}),
]  # fmt: skip
RECIPE_TITLE = (
    "either protocol: the training recipe beyond the flags above (the defaults: the method "
    "specification's; the README's CamVid results add --head-lr-mult 10 --warmup-iters 100)"
)
RECIPE_FLAGS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("--output-stride",), {"type": int, "help": "every model's (default: its own)"}),
    (("--head-lr-mult",), {"type": positive_float, "default": 1.0, "help": "LR × for the head"}),
    (("--warmup-iters",), {"type": nonnegative_int, "default": 0}),
    (("--clip-grad-norm",), {"type": positive_float, "default": None,
        "help": "largest total L2 norm of the gradient (default: no clipping)"}),
    (("--amp",), {"choices": ("auto", "none", "bf16"), "default": None,
        "help": "training precision, also that of the budget protocol's calibration: none "
        "(fp32), bf16 autocast (the train.amp check: CPUs with AVX-512 BF16/AMX, or a GPU) or "
        "auto (train.amp auto: bf16 where the CPU computes it natively; on a GPU bf16, else "
        "fp16); default: none under --protocol plateau (the published protocol), auto under "
        "budget; evaluation stays fp32"}),
]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    budget = p.add_mutually_exclusive_group()
    plateau = p.add_argument_group(PLATEAU_TITLE)
    recipe = p.add_argument_group(RECIPE_TITLE)
    for group, table in ((p, GENERAL), (budget, BUDGET), (p, TRAINING + METHOD_B + RUNNING),
                         (plateau, PLATEAU), (recipe, RECIPE_FLAGS)):  # fmt: skip
        for flags, options in table:
            group.add_argument(*flags, **options)
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """What one flag's type cannot refuse: a :class:`ConfigError` (one line) before anything
    is written or trained."""
    check_writable(args.out, kind="dir", what="--out")  # e.g. an existing file
    if args.protocol == "plateau" and args.patience and not args.val_every:
        raise ConfigError(
            f"--val-every 0 never validates on dev, so --patience {args.patience} could never "
            "stop a run: give --val-every N (e.g. 200), or --patience 0 to train to --max-iters"
        )
    if args.crf:
        import_pydensecrf()  # missing: one line naming the extra
    if args.unseen_sequence and args.holdout_sequence in (args.unseen_sequence, None):
        raise ConfigError(
            f"--unseen-sequence {args.unseen_sequence} leaves a sequence out beside the one "
            "that chooses: add --holdout-sequence with another sequence"
        )
    if args.holdout_sequence and args.protocol != "plateau":
        raise ConfigError(
            f"--holdout-sequence {args.holdout_sequence} holds a sequence out of the plateau "
            "protocol's training and dev: add --protocol plateau"
        )
    lists = [Path(args.data) / f"{split}.txt" for split in ("train", "val")]
    if not all(p.is_file() for p in lists):
        raise DataError(
            f"{args.data}: no {' / '.join(p.name for p in lists if not p.is_file())} there; "
            "pass the CamVid folder with train.txt and val.txt (--data ../shared/data/camvid)"
        )


def reused_run(args: argparse.Namespace, name: str, cfg: Any, record: Path) -> bool:
    """Whether model ``name``'s finished run is reused (``--reuse``), refusing one trained
    under another budget or recipe; a record its run went past is removed (trained again)."""
    reused = args.reuse and record.is_file()
    stale = stale_record(record) if reused else None
    if stale:  # not a finished run: trained (resumed under the plateau protocol) as one
        print(f"[{name}] {stale}: not a finished run, training it", flush=True)
        record.unlink()
        reused = False
    budget = reused and args.protocol != "plateau"
    mismatch = budget_mismatch(record, args) if budget else None
    # a finished run reused, or an interrupted one resumed (plateau), must be this recipe's
    recipe = (reused or args.protocol == "plateau") and (record.parent / "config.yaml").is_file()
    if not mismatch and recipe:
        mismatch = reuse_mismatch(cfg, record.parent, calibrated_iters=budget, finished=reused)
    if mismatch:
        raise ConfigError(mismatch)
    return reused


def train_to_plateau(name: str, cfg: Any, record: Path) -> dict[str, Any] | int:
    """Model ``name`` trained (or resumed) until dev mIoU plateaus: its record, or the exit
    status of an interrupted run."""
    print(f"[{name}] training {cfg.model.arch} {VARIANTS[name][1]} to plateau", flush=True)
    t0 = time.time()
    record.unlink(missing_ok=True)  # the run is about to go on: its record no longer holds
    summary = fit(cfg, resume="auto")  # an interrupted run continues where it stopped
    if summary["stop_reason"] == "interrupted":
        print(f"[{name}] interrupted; rerun the same command to continue", flush=True)
        return 128 + summary.get("signal", signal.SIGINT)
    trained = {
        "iterations": summary["iteration"],
        "stop_reason": summary["stop_reason"],
        "best_dev_miou": summary["best_miou"],
        "best_iteration": summary["best_iteration"],
        "seconds_this_call": time.time() - t0,
        **curve_stats(record.parent / "metrics.jsonl"),
    }
    trained["seconds"] = trained["train_seconds"]
    return trained


def train_on_budget(
    args: argparse.Namespace, name: str, cfg: Any, record: Path, device: torch.device
) -> dict[str, Any] | int:
    """Model ``name`` trained afresh for the budget's iterations (calibrated from
    ``--budget-minutes``): its record, or the exit status of an interrupted run."""
    if args.budget_iters:
        iters, per_iter = args.budget_iters, None
    else:
        iters, per_iter = calibrate_iters(cfg, args.budget_minutes, device)
    cfg = replace(cfg, train=replace(cfg.train, max_iters=iters, ckpt_every=iters))
    arch = f"{cfg.model.arch} {VARIANTS[name][1]}"
    print(f"[{name}] training {arch} for {iters} iterations", flush=True)
    t0 = time.time()
    record.unlink(missing_ok=True)  # the run it recorded is replaced
    summary = fit(cfg, overwrite=True)  # not --reuse: this model is trained afresh
    if summary["stop_reason"] == "interrupted":  # short of its budget: not a finished run
        print(f"[{name}] interrupted; rerun the command to train it again", flush=True)
        return 128 + summary.get("signal", signal.SIGINT)
    return {
        "iterations": summary["iteration"],
        "seconds": time.time() - t0,
        "calibrated_s_per_iter": per_iter,
        "budget_minutes": None if args.budget_iters else args.budget_minutes,
    }


def train_models(
    args: argparse.Namespace, out: Path, device: torch.device, results: dict[str, Any]
) -> tuple[float, int | None]:
    """Step 1: every model trained (or reused) with the same budget, into ``results["train"]``.
    ``(seconds of training done before this call, exit status if interrupted)``."""
    earlier = 0.0
    for name in args.models:
        record = out / "runs" / name / "train.json"
        cfg = base_config(args, name, out)
        if reused_run(args, name, cfg, record):
            results["train"][name] = json.loads(record.read_text())
            earlier += results["train"][name]["seconds"]
            print(f"[{name}] reusing the finished run in {record.parent}", flush=True)
            continue
        if args.protocol == "plateau":
            trained = train_to_plateau(name, cfg, record)
        else:
            trained = train_on_budget(args, name, cfg, record, device)
        if isinstance(trained, int):
            return earlier, trained
        if args.protocol == "plateau":
            earlier += earlier_calls_seconds(trained)
        results["train"][name] = trained
        atomic_write_json(record, trained)
    return earlier, None


def load_models(
    args: argparse.Namespace, out: Path, device: torch.device, results: dict[str, Any]
) -> tuple[dict[str, torch.nn.Module], Any]:
    """Each trained model at the checkpoint its stopping rule evaluates, and the data meta."""
    models: dict[str, torch.nn.Module] = {}
    meta = None
    for name in args.models:
        kept = evaluated_checkpoint(out / "runs" / name)
        ckpt = load_checkpoint(out / "runs" / name / kept)
        results["train"][name]["evaluated"] = {
            "checkpoint": kept,
            "iteration": int(ckpt.get("iteration", 0)),
        }
        model, meta = build_model_from_checkpoint(ckpt, device=device)
        models[name] = model.eval()
    return models, meta


def report(
    args: argparse.Namespace,
    out: Path,
    results: dict[str, Any],
    models: dict[str, torch.nn.Module],
    refiner: Any,
    meta: Any,
    device: torch.device,
) -> None:
    """Step 4: results.json (with earlier calls' rows), results.md and the figures."""
    old = earlier_results(out, args)  # the models of earlier calls into this --out: kept
    kept = merge_results(results, old, args.models) if old is not None else []
    atomic_write_json(out / "results.json", results)
    table = write_table(results, out / "results.md")
    save_bar_chart(results, list(meta.class_names), out / "per_class_iou.png")
    save_curves(out, [n for n in VARIANTS if n in models or n in kept], out / "curves.png")
    if args.protocol == "plateau":
        save_learning_curves(results["train"], out / "learning_curves.png")
    _, val_loader = eval_loader(args.data, None, args.eval_limit, args.workers)
    results["panels"] = save_panels(models, refiner, val_loader, meta, args.panels, out, device)
    atomic_write_json(out / "results.json", results)
    print(table)
    print(f"total {results['total_seconds'] / 60:.1f} min; results in {out}")
    if kept:
        print(f"(rows of {', '.join(kept)}: kept from an earlier call into {out})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_args(args)
    out = Path(args.out)
    if not args.train_only:  # other models' results it will be added to: under these flags
        earlier_results(out, args)
    out.mkdir(parents=True, exist_ok=True)
    if args.protocol == "plateau":
        carve_dev_split(
            Path(args.data), out, args.dev_fraction, args.holdout_sequence, args.unseen_sequence
        )
    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()
    results: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cpu_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "dualseg_commit": source_commit(),
        },
        "args": args_record(args),
        "train": {},
        "splits": {},
    }
    # training time of reused runs and earlier calls, counted in the total
    reused_seconds, stopped = train_models(args, out, device, results)
    if stopped is not None:
        return stopped
    results["budget"] = budget_words(args, device)
    if args.train_only:
        print(f"trained {', '.join(args.models)}; rerun with --reuse for method B and evaluation")
        return 0
    models, meta = load_models(args, out, device, results)
    # step 2, method B: fitted on the training set (plateau: on train_fit, dev held out)
    try:
        refiners, gated = fit_refiners(args, out, models, meta, device, results)
    except (KeyboardInterrupt, Terminated) as stop:  # the fit saved its state before stopping
        print("[method B] interrupted; rerun with --reuse to continue its fit", flush=True)
        return 143 if isinstance(stop, Terminated) else 130
    crfs = choose_crfs(args, out, models, meta, device, results)
    # step 3: evaluate at full resolution
    held, unseen = args.holdout_sequence, args.unseen_sequence
    cross_scene = [str(out / "data" / f"cross_scene_{held}.txt")] if held else []
    cross_scene += [str(out / "data" / f"unseen_{unseen}.txt")] if unseen else []
    for split_path in [None, *cross_scene, *args.eval_split]:
        split, loader = eval_loader(args.data, split_path, args.eval_limit, args.workers)
        rows: dict[str, Any] = {}
        for name, model in models.items():
            variants = post_processors(name, args, refiners, gated, crfs)
            rows |= score_variants(model, variants, loader, split, args, meta, device)
        results["splits"][split] = rows
    # wall-clock of this call plus the training it builds on: reused runs, earlier calls
    results["total_seconds"] = time.time() - started + reused_seconds
    report(args, out, results, models, refiners.get("dualseg"), meta, device)
    return 0


if __name__ == "__main__":
    from dualseg.cli import terminated_as_exception

    try:
        with terminated_as_exception():
            sys.exit(main())
    except DualsegError as err:  # a user error (data, flags, a reused run): one line
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except (KeyboardInterrupt, Terminated) as stop:  # outside training and method B's fit
        print("interrupted; rerun with --reuse to keep what is done", file=sys.stderr)
        sys.exit(143 if isinstance(stop, Terminated) else 130)
