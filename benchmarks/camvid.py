"""CamVid benchmark: method A against its peer and its ablations, with method B on top.

Trains, with the same data, augmentation, budget and evaluation (issue 6):

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
``--holdout-sequence 0016E5`` CamVid val (all 0016E5, other frames) is an unseen scene on which
nothing was chosen::

    python benchmarks/camvid.py --data ../shared/data/camvid --out runs/xscene_0016E5 \\
        --protocol plateau --holdout-sequence 0016E5 --models peer dualseg --crf \\
        --max-iters 3000 --output-stride 16 --amp bf16 --refine-backbone-source base-frozen \\
        --refine-input-scale 1.0 --refine-embed-dim 32 --refine-decoder-channels 48

Outputs in ``--out``: ``results.json``, ``results.md`` (markdown table), ``per_class_iou.png``,
``curves.png`` and ``panel_*.png`` (image | ground truth | peer | method A | method A + B).
A call evaluating other models into an ``--out`` whose ``results.json`` holds some (``--models
peer``, then ``--models single_branch``) adds its rows to theirs; under other flags it is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import platform
import signal
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dualseg.commands.common import nonnegative_int, positive_int
from dualseg.data import build_dataset
from dualseg.engine.checkpoint import build_model_from_checkpoint, load_checkpoint
from dualseg.engine.config import (
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    config_changes,
    config_to_dict,
    load_config,
)
from dualseg.engine.evaluation import evaluate
from dualseg.engine.train import fit
from dualseg.errors import ConfigError, DataError, DualsegError, Terminated
from dualseg.io import atomic_write_json, atomic_write_text, check_writable
from dualseg.models import build_model
from dualseg.refine import BoundaryRefiner
from dualseg.refine.base import model_fingerprint
from dualseg.refine.calibrate import DECISION_KEYS, METRICS
from dualseg.refine.crf import CRFSettings, choose_crf, import_pydensecrf
from dualseg.refine.decision import describe_decision
from dualseg.refine.refiner import RefinerConfig
from dualseg.viz import save_figure

# name -> (architecture, build_model options); the ablations switch one part of method A off.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "dualseg": ("dualseg_mobilenet_v2", {}),
    "peer": ("deeplabv3_mobilenet_v2", {}),
    "single_branch": ("dualseg_mobilenet_v2", {"gray_branch": False}),
    "no_coord": ("dualseg_mobilenet_v2", {"coord_channels": False}),
    "no_renet": ("dualseg_mobilenet_v2", {"renet_layers": 0}),
    "aspp_v3": ("dualseg_mobilenet_v2", {"aspp_style": "v3"}),
    "no_renet_v3": ("dualseg_mobilenet_v2", {"renet_layers": 0, "aspp_style": "v3"}),
    "logits_first": ("dualseg_mobilenet_v2", {"upsample_order": "logits_first"}),
    "renet_bn": ("dualseg_mobilenet_v2", {"renet_norm": "batch"}),
    "renet_bn_v3": ("dualseg_mobilenet_v2", {"renet_norm": "batch", "aspp_style": "v3"}),
    "renet_skip_v3": ("dualseg_mobilenet_v2", {"renet_skip": True, "aspp_style": "v3"}),
}
LABELS = {
    "dualseg": "method A (dualseg_mobilenet_v2)",
    "peer": "peer: DeepLabV3 (same backbone)",
    "single_branch": "A, single branch (RGB only)",
    "no_coord": "A, no coordinate channels",
    "no_renet": "A, no ReNet layers",
    "aspp_v3": "A, DeepLab-v3 ASPP (claim 3's other reading)",
    "no_renet_v3": "A, no ReNet layers, DeepLab-v3 ASPP",
    "logits_first": "A, logits upsampled before the softmax (S44's other order)",
    "renet_bn": "A, BatchNorm on the ReNet layers' input features",
    "renet_bn_v3": "A, BatchNorm on the ReNet layers' input, DeepLab-v3 ASPP",
    "renet_skip_v3": "A, backbone features beside the ReNet output, DeepLab-v3 ASPP",
}
STANDARD = ("dualseg", "peer", "single_branch", "no_coord", "no_renet")  # the default run
REFINED = ("dualseg", "peer")  # base models that method B is applied to
# the fields this script's flags set: a run reused with --reuse must have been trained with them
RECIPE = (
    "model.arch",
    "model.weights",
    "model.output_stride",
    "model.gray_branch",
    "model.coord_channels",
    "model.renet_layers",
    "model.renet_norm",
    "model.renet_skip",
    "model.aspp_style",
    "model.upsample_order",
    "optim.lr",
    "optim.head_lr_mult",
    "optim.warmup_iters",
    "optim.clip_grad_norm",
    "train.max_iters",
    "train.seed",
    "train.amp",
    "data.crop_size",
    "data.scale_range",
    "data.batch_size",
)
# and the stopping rule, for a finished run reused: it decided where the run stopped and which
# checkpoint is evaluated (an unfinished plateau run may go on under another rule, said)
STOPPING = ("train.patience", "train.min_delta", "train.val_every")


REFINER_RECIPE = (
    "steps",
    "input_scale",
    "output_stride",
    "embed_dim",
    "batch_size",
    "seed",
    "backbone_source",
    "mining",
    "decoder_channels",
)


def refiner_mismatch(saved: RefinerConfig, wanted: RefinerConfig, path: Path) -> str | None:
    """As :func:`reuse_mismatch`, for a refiner reused with ``--reuse``: the first
    :data:`REFINER_RECIPE` option in which the refiner in ``path`` differs from this call's."""
    return first_difference(
        {k: getattr(saved, k) for k in REFINER_RECIPE},
        {k: getattr(wanted, k) for k in REFINER_RECIPE},
        path,
        fix="rerun with that refiner's --refine-* flags, or use another --out",
    )


def inputs_mismatch(record: Path, inputs: dict[str, Any], path: Path) -> str | None:
    """As :func:`refiner_mismatch`, for what the refiner in ``path`` was fit on (its split,
    the list's hash, ``--prototype-limit``, the base model's weights for ``base-*``), kept in
    ``record`` beside it."""
    if not record.is_file():
        return (
            f"{path} does not record what it was fit on (no {record.name}): delete it to fit "
            "it again, or use another --out"
        )
    saved = json.loads(record.read_text())  # base, fit_list_sha256: hashes of weights / lists
    return first_difference(
        saved, inputs, path, fix="delete it to fit it again, or use another --out"
    )


def first_difference(
    saved: dict[str, Any], wanted: dict[str, Any], path: Path, *, fix: str
) -> str | None:
    """The first key of ``wanted`` whose value the refiner in ``path`` was fit with differs,
    in words ending in ``fix``; ``None`` when all agree."""
    for key, want in wanted.items():
        if saved.get(key) != want:
            return f"{path} was fit with {key} = {saved.get(key)!r}, this call asks {want!r}: {fix}"
    return None


def reuse_mismatch(
    cfg: Config, run_dir: Path, *, calibrated_iters: bool = False, finished: bool = False
) -> str | None:
    """The first :data:`RECIPE` field in which the run in ``run_dir`` (its ``config.yaml``)
    differs from ``cfg``, in words; ``None`` when they agree. Without this a run trained with
    other flags would be reported under this call's. ``finished``: the run is reused as it is,
    so its :data:`STOPPING` rule must be this call's too. ``calibrated_iters``: the equal-time
    protocol sets ``max_iters`` per model at run time, so it is not compared."""
    changed = config_changes(config_to_dict(load_config(run_dir / "config.yaml")), cfg)
    for field in RECIPE + (STOPPING if finished else ()):
        if field in changed and not (calibrated_iters and field == "train.max_iters"):
            have, want = changed[field]
            return (
                f"{run_dir} was trained with {field} = {have!r}, this call asks {want!r}: "
                "rerun with that run's flags, or use another --out"
            )
    return None


def stale_record(record: Path) -> str | None:
    """Why the ``train.json`` in ``record`` no longer describes its run, in words; ``None``
    when it does. It is written when a run ends; a later call that went on with the run (a
    resume under another stopping rule, a retrain with another budget) and was stopped short
    moved the run's ``last.pt`` past it, and ``--reuse`` would report the record's iterations
    and stopping reason beside another checkpoint's figures."""
    last = record.parent / "last.pt"
    if not last.is_file():
        return f"{record} has no {last.name} beside it"
    saved = json.loads(record.read_text()).get("iterations")
    at = int(load_checkpoint(last).get("iteration", -1))
    if saved != at:
        return f"{record} records iteration {saved}, but {last} is at iteration {at}"
    return None


def budget_mismatch(record: Path, args: argparse.Namespace) -> str | None:
    """How the budget of the finished run recorded in ``record`` differs from this call's
    ``--budget-iters`` / ``--budget-minutes``, in words; ``None`` when it is the same (a
    record written before the minutes were kept is taken at its word there)."""
    saved = json.loads(record.read_text())
    if args.budget_iters:
        if saved.get("calibrated_s_per_iter") is None and saved["iterations"] == args.budget_iters:
            return None
        want = f"--budget-iters {args.budget_iters}"
    else:
        minutes = saved.get("budget_minutes", args.budget_minutes)
        if saved.get("calibrated_s_per_iter") is not None and minutes == args.budget_minutes:
            return None
        want = f"--budget-minutes {args.budget_minutes:g}"
    had = (
        f"{saved['iterations']} iterations"
        if saved.get("calibrated_s_per_iter") is None
        else f"{saved['budget_minutes']:g} minutes"
        if "budget_minutes" in saved
        else f"a --budget-minutes calibration ({saved['iterations']} iterations)"
    )
    return (
        f"{record.parent} was trained for {had}, this call asks {want}: rerun with that "
        "run's budget, or use another --out"
    )


# flags that change no model's figures: results.json may hold models evaluated under others
# (--crf adds a row beside a base's own, which stay as they were)
MERGE_FREE = ("models", "reuse", "train_only", "panels", "out", "crf")


def args_record(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as results.json keeps them (tuples as lists, as JSON reads them back)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(args).items()}


def evaluated_models(results: dict[str, Any]) -> set[str]:
    """The models with rows in ``results`` (row keys: ``name`` and ``name+B...``)."""
    return {key.split("+")[0] for rows in results.get("splits", {}).values() for key in rows}


def earlier_results(out: Path, args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``results.json`` in ``out`` when it holds models this call does not evaluate: their
    rows are kept beside this call's (one model per call into one ``--out``, as the ablation
    commands run). Refused (:class:`ConfigError`, before any work) when those models were
    evaluated under other flags than this call's, which would put rows of two settings in one
    table; ``None`` when there is nothing to keep."""
    path = out / "results.json"
    if not path.is_file():
        return None
    old = json.loads(path.read_text())
    others = sorted(evaluated_models(old) - set(args.models))
    if not others:
        return None  # this call evaluates all of them again
    theirs, ours = old.get("args", {}), args_record(args)
    for key, want in ours.items():
        if key not in MERGE_FREE and theirs.get(key) != want:
            flag = "--" + key.replace("_", "-")
            raise ConfigError(
                f"{path} holds {', '.join(others)} evaluated with {flag} "
                f"{theirs.get(key)!r}, this call has {want!r}: rerun with that call's flags to "
                "add to its table, or use one --out per setting"
            )
    return old


def merge_results(results: dict[str, Any], old: dict[str, Any], models: list[str]) -> list[str]:
    """Into ``results``, the rows, training records and dev sweeps of the models in ``old``
    that this call did not evaluate (``models``), each model's own entries as they were; rows
    in the order of :data:`VARIANTS`. Returns the models kept from ``old``."""
    order = list(VARIANTS)
    kept = sorted(evaluated_models(old) - set(models), key=order.index)

    def model_of(key: str) -> str:
        return key.split("+")[0]

    for split, rows in results["splits"].items():
        earlier = {k: v for k, v in old["splits"].get(split, {}).items() if model_of(k) in kept}
        merged = {**earlier, **rows}
        results["splits"][split] = dict(
            sorted(merged.items(), key=lambda kv: order.index(model_of(kv[0])))
        )
    refined = {model_of(k) for rows in old["splits"].values() for k in rows if "+" in k}
    for key, record in old.get("train", {}).items():
        name = key.removeprefix("method_b_")
        shared = name == "all" and refined & set(kept)  # the one refiner of kept rows
        if name in kept or (shared and key not in results["train"]):
            results["train"][key] = record
    for sweeps in ("decision_sweep_dev", "crf_sweep_dev"):
        for name, sweep in old.get(sweeps, {}).items():
            if name in kept:
                results.setdefault(sweeps, {})[name] = sweep
    if kept:
        results["models_from_earlier_calls"] = kept
    return kept


def evaluated_checkpoint(run_dir: Path) -> str:
    """Which checkpoint of a trained run is evaluated, by the run's own stopping rule: with
    early stopping (plateau protocol, ``--patience N``) the best on dev; without (``--patience
    0``, and every budget run) the end of the schedule, which the schedule check compares."""
    patience = load_config(run_dir / "config.yaml").train.patience
    return "best.pt" if patience else "last.pt"


def positive_float(text: str) -> float:
    """argparse ``type=``: a finite number > 0 (minutes, LR, scales), refused at parsing."""
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def nonnegative_float(text: str) -> float:
    """argparse ``type=``: a finite number >= 0 (``--min-delta``), refused at parsing."""
    value = _number(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def open_fraction(text: str) -> float:
    """argparse ``type=``: a number strictly between 0 and 1 (``--dev-fraction``: some frames
    of each sequence held out, and some trained on), refused at parsing."""
    value = _number(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (both excluded), got {text}")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", required=True, help="CamVid folder with train.txt / val.txt")
    p.add_argument("--out", default="runs/bench_camvid", help="output folder")
    p.add_argument(
        "--eval-split",
        action="append",
        default=[],
        metavar="PATH",
        help="a further split to evaluate: a list file (e.g. camvid/test.txt) or a folder",
    )
    p.add_argument("--models", nargs="+", default=list(STANDARD), choices=list(VARIANTS))
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--budget-minutes", type=positive_float, default=15.0, help="per model")
    budget.add_argument("--budget-iters", type=positive_int, help="per model (overrides minutes)")
    p.add_argument("--crop", type=positive_int, nargs=2, default=(192, 256), metavar=("H", "W"))
    p.add_argument(
        "--scale", type=positive_float, nargs=2, default=(0.5, 1.0), metavar=("MIN", "MAX")
    )
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--lr", type=positive_float, default=0.01)
    p.add_argument("--workers", type=nonnegative_int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--weights", default="imagenet", help="'imagenet', a file, or 'none'")
    p.add_argument(
        "--refine-steps",
        type=nonnegative_int,
        default=3000,
        help="method B triplet steps (0: no method B)",
    )
    p.add_argument("--refine-input-scale", type=positive_float, default=RefinerConfig.input_scale)
    p.add_argument(
        "--refine-output-stride",
        type=int,
        choices=(8, 16),
        default=RefinerConfig.output_stride,
        help="method B step 3: the embedding's output stride (8: 4x the positions, and no "
        "reading of a stride-16 base's features)",
    )
    p.add_argument(
        "--refine-embed-dim",
        type=positive_int,
        default=RefinerConfig.embed_dim,
        help="method B step 3: the embedding's channels C (its ASPP head's cost grows with C)",
    )
    p.add_argument(
        "--refine-backbone-source",
        choices=("independent", "base-frozen", "base-finetune"),
        default=RefinerConfig.backbone_source,
        help="method B step 3: one independent refiner for all bases, or one per base on its "
        "own backbone",
    )
    p.add_argument(
        "--refine-decision-metric",
        choices=METRICS,
        default=METRICS[0],
        help="what the dev sweep of method B's decision maximizes (boundary_f1: for the edges)",
    )
    p.add_argument(
        "--refine-mining",
        choices=("random", "semi-hard"),
        default=RefinerConfig.mining,
        help="method B step 4: the false example of each triplet (random: the claim)",
    )
    p.add_argument(
        "--refine-decoder-channels",
        type=nonnegative_int,
        default=RefinerConfig.decoder_channels,
        help="method B step 3, beyond the claim: 0 (the claim's embedding) or a DeepLabV3+ "
        "decoder fusing the backbone's stride-4 features, projected to this many channels (48)",
    )
    p.add_argument(
        "--crf",
        action="store_true",
        help="also dense CRF on the bases method B refines (pydensecrf2: pip install "
        "'dualseg[crf]'), its kernel settings chosen on dev among four under --protocol plateau",
    )
    p.add_argument("--timing-images", type=positive_int, default=10, help="images timed per model")
    p.add_argument("--panels", type=nonnegative_int, default=3, help="qualitative panels to write")
    p.add_argument(
        "--eval-limit", type=positive_int, help="evaluate only the first N images (smoke runs)"
    )
    p.add_argument(
        "--prototype-limit", type=positive_int, help="method B prototypes from N train images"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=nonnegative_int,
        help="torch CPU threads (default or 0: torch's; 1 on a shared machine)",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="skip training a model whose run in --out finished (its train.json exists); a run "
        "trained with other flags (model, LR recipe, T, budget, seed, crops, batch) is refused",
    )
    p.add_argument(
        "--train-only", action="store_true", help="stop after training (method B and eval later)"
    )
    plateau = p.add_argument_group(
        "--protocol plateau: train every model until its mIoU on a dev split carved from train "
        "has plateaued (no gain over --min-delta in --patience validations), report on val"
    )
    plateau.add_argument("--protocol", choices=("budget", "plateau"), default="budget")
    plateau.add_argument(
        "--max-iters", type=positive_int, default=2000, help="T of the poly schedule"
    )
    plateau.add_argument(
        "--val-every",
        type=nonnegative_int,
        default=200,
        help="dev validation interval (0 only with --patience 0: no dev curve)",
    )
    plateau.add_argument(
        "--patience",
        type=nonnegative_int,
        default=3,
        help="validations without gain (0: no early stop, the whole poly schedule to T: the "
        "schedule check compares T with 2T run this way)",
    )
    plateau.add_argument("--min-delta", type=nonnegative_float, default=0.5, help="mIoU points")
    plateau.add_argument(
        "--dev-fraction",
        type=open_fraction,
        default=0.125,
        help="the last fraction of each training sequence (by file name) held out as dev",
    )
    plateau.add_argument(
        "--holdout-sequence",
        metavar="SEQ",
        help="leave one sequence out (e.g. 0001TP): bases and refiners train on the other "
        "sequences, this one is dev (stopping, method B's decision, --crf's settings) and is "
        "reported as the cross-scene split (in place of --dev-fraction's carve); 0016E5 leaves "
        "val an unseen scene nothing was chosen on",
    )
    recipe = p.add_argument_group(
        "either protocol: the training recipe beyond the flags above (the defaults: the "
        "published protocol's)"
    )
    recipe.add_argument("--output-stride", type=int, help="every model's (default: its own)")
    recipe.add_argument(
        "--head-lr-mult", type=positive_float, default=1.0, help="LR × for the head"
    )
    recipe.add_argument("--warmup-iters", type=nonnegative_int, default=0)
    recipe.add_argument(
        "--clip-grad-norm",
        type=positive_float,
        default=None,
        help="largest total L2 norm of the gradient (default: no clipping)",
    )
    recipe.add_argument(
        "--amp",
        choices=("auto", "none", "bf16"),
        default=None,
        help="training precision, also that of the budget protocol's calibration: none (fp32), "
        "bf16 autocast (the train.amp check: CPUs with AVX-512 BF16/AMX, or a GPU) or auto "
        "(train.amp auto: bf16 where the CPU computes it natively; on a GPU bf16, else fp16); "
        "default: none under --protocol plateau (the published protocol), auto under budget; "
        "evaluation stays fp32",
    )
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
    if args.holdout_sequence and args.protocol != "plateau":
        raise ConfigError(
            f"--holdout-sequence {args.holdout_sequence} holds a sequence out of the plateau "
            "protocol's training and dev: add --protocol plateau"
        )


def sequence_of(path: str) -> str:
    """The CamVid sequence of an image path (or a list line): its file name's prefix before
    the first ``_`` (``train/0001TP_006690.png`` -> ``0001TP``)."""
    return Path(path.split()[0]).name.split("_")[0]


def split_by_sequence(lines: list[str], holdout: str) -> tuple[list[str], list[str]]:
    """``(train_lines, holdout_lines)``: the list lines of every other sequence, and those of
    sequence ``holdout`` (a :class:`ConfigError` naming the sequences there are when it is
    absent or would leave nothing to train on)."""
    held = [ln for ln in lines if sequence_of(ln) == holdout]
    rest = [ln for ln in lines if sequence_of(ln) != holdout]
    if not held or not rest:
        names = ", ".join(sorted({sequence_of(ln) for ln in lines}))
        why = "is not among" if not held else "is the only one of"
        raise ConfigError(
            f"--holdout-sequence {holdout} {why} the training sequences ({names}): name another one"
        )
    return rest, held


def carve_dev_split(data: Path, out: Path, fraction: float, holdout: str | None = None) -> Path:
    """List files ``train_fit.txt`` / ``dev.txt`` / ``val.txt`` in ``out/data`` (absolute paths).

    Dev = the last ``fraction`` of each training sequence (CamVid names ``SEQ_frame.png``,
    sorted by name): a stretch of video at the end of each sequence, next to the frames trained
    on only where it starts. Every choice of the protocol (when to stop, which recipe, method B's
    decision) is made on dev and CamVid val is only reported. No image is shared with val, but
    in sequence 0016E5 val's frames lie among the training frames, so dev's frames there are
    the training frames nearest to val's in time.

    With ``holdout`` (a sequence name, leave-one-sequence-out) dev is that whole sequence and
    train_fit every other: the choices are made on a scene nothing was trained on, and
    ``cross_scene_<holdout>.txt`` (the same lines) is evaluated as the cross-scene split.

    A folder whose runs or refiners were trained on another carve (another ``--dev-fraction``,
    ``--holdout-sequence`` or ``train.txt``) is refused: reusing or resuming them would put
    trained-on images into dev.
    """

    def absolute(line: str) -> str:
        return " ".join(str((data / part).resolve()) for part in line.split())

    lines = sorted(ln for ln in (data / "train.txt").read_text().splitlines() if ln.strip())
    if holdout is not None:
        fit, dev = (list(map(absolute, part)) for part in split_by_sequence(lines, holdout))
    else:
        fit, dev = [], []
        for seq in dict.fromkeys(map(sequence_of, lines)):
            frames = [absolute(ln) for ln in lines if sequence_of(ln) == seq]
            k = max(1, round(len(frames) * fraction))
            fit += frames[:-k]
            dev += frames[-k:]
    root = out / "data"
    val = [absolute(ln) for ln in (data / "val.txt").read_text().splitlines() if ln.strip()]
    lists = {"train_fit": fit, "dev": dev, "val": val}
    if holdout is not None:
        lists[f"cross_scene_{holdout}"] = dev
    texts = {name: "\n".join(rows) + "\n" for name, rows in lists.items()}
    trained = [c.parent for c in out.glob("runs/*/config.yaml")] + [*out.glob("refiner_*.pt")]
    carve = f"--holdout-sequence {holdout}" if holdout else f"--dev-fraction {fraction:g}"
    for name in ("train_fit", "dev"):
        path = root / f"{name}.txt"
        if trained and path.is_file() and path.read_text() != texts[name]:
            raise ConfigError(
                f"{path} differs from the split this call carves ({carve} of "
                f"{data / 'train.txt'}), and {trained[0]} was trained on it: rerun with "
                "that run's --dev-fraction / --holdout-sequence and --data, or use another --out"
            )
    for name, text in texts.items():
        atomic_write_text(root / f"{name}.txt", text)
    return root


def device_of(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def base_config(args: argparse.Namespace, name: str, out: Path) -> Config:
    arch, options = VARIANTS[name]
    weights = None if args.weights == "none" else args.weights
    if args.output_stride:
        options = {**options, "output_stride": args.output_stride}
    optim = OptimConfig(
        lr=args.lr,
        head_lr_mult=args.head_lr_mult,
        warmup_iters=args.warmup_iters,
        clip_grad_norm=args.clip_grad_norm,
    )
    if args.protocol == "plateau":
        return Config(
            data=DataConfig(
                root=str(out / "data"),
                preset="camvid",
                train_split="train_fit",
                val_split="dev",
                crop_size=tuple(args.crop),
                scale_range=tuple(args.scale),
                blur_prob=0.1,  # the shipped CamVid configs' S1 augmentation, for every model
                jitter=0.2,
                batch_size=args.batch_size,
                val_batch_size=1,
                num_workers=args.workers,
                persistent_workers=False,  # no idle workers beside the model between validations
            ),
            model=ModelConfig(arch=arch, weights=weights, **options),
            optim=optim,
            train=TrainConfig(
                out_dir=str(out / "runs" / name),
                max_iters=args.max_iters,
                val_every=args.val_every,
                monitor="val_miou",
                patience=args.patience or None,  # 0: off
                min_delta=args.min_delta / 100.0,
                seed=args.seed,
                device=args.device,
                amp=args.amp or "none",
                progress=False,
                tensorboard=False,
            ),
        )
    return Config(
        data=DataConfig(
            root=str(args.data),
            preset="camvid",
            val_split=None,  # evaluated below, at full resolution, outside the budget
            crop_size=tuple(args.crop),
            scale_range=tuple(args.scale),
            blur_prob=0.1,  # the shipped CamVid configs' S1 augmentation, for every model
            jitter=0.2,
            batch_size=args.batch_size,
            num_workers=args.workers,
        ),
        model=ModelConfig(arch=arch, weights=weights, **options),
        optim=optim,
        train=TrainConfig(
            out_dir=str(out / "runs" / name),
            max_iters=1,
            val_every=0,
            monitor="train_loss",
            patience=None,  # the budget protocol runs its full calibrated schedule
            seed=args.seed,
            device=args.device,
            amp=args.amp or "auto",  # as this protocol always trained: bf16 where native
            progress=True,
            tensorboard=False,
        ),
    )


def calibrate_iters(cfg: Config, minutes: float, device: torch.device) -> tuple[int, float]:
    """Iterations that fit in ``minutes``, from timed forward+backward steps on a random batch,
    in the precision and memory format ``fit`` trains ``cfg`` in (``train.amp``, where an fp32
    calibration of a bf16 run once set T from a step of another cost).

    Data loading runs in worker processes alongside; it is measured separately by
    benchmarks/data_throughput.py and is not the bottleneck at these sizes.
    """
    from dualseg.engine.config import model_kwargs
    from dualseg.engine.cpu_bf16 import amp_dtype_for as training_dtype  # fit's own choice
    from dualseg.engine.cpu_bf16 import convs_in_fp32

    kwargs = {
        k: tuple(v) if isinstance(v, list) else v for k, v in model_kwargs(cfg.model, 11).items()
    }
    dtype = training_dtype(cfg.train.amp, device)  # fit's choice for train.amp
    model = build_model(cfg.model.arch, **kwargs).to(device).train()
    fmt = torch.channels_last if cfg.train.channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    if device.type == "cpu" and dtype == torch.bfloat16:
        convs_in_fp32(model)  # as fit does
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    x = torch.randn(cfg.data.batch_size, 3, *cfg.data.crop_size, device=device)
    x = x.contiguous(memory_format=fmt)
    y = torch.randint(0, 11, (cfg.data.batch_size, *cfg.data.crop_size), device=device)
    times = []
    for i in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:  # first steps warm up allocators / cuDNN autotuning
            times.append(time.perf_counter() - t0)
    per_iter = statistics.median(times)
    return max(1, int(minutes * 60 / per_iter)), per_iter


def eval_loader(
    root: str | Path, split_path: str | None, n: int | None, workers: int
) -> tuple[str, Any]:
    """(name, loader) of CamVid val, or of a further split given as a list file or a folder;
    ``workers`` loader processes (``--workers``: they decode beside the timed forward)."""
    if split_path is None:
        ds, name = build_dataset(root, split="val", preset="camvid"), "val"
    else:
        p = Path(split_path)
        if p.is_file():
            ds, name = build_dataset(p.parent, split=p.stem, preset="camvid"), p.stem
        else:
            ds, name = build_dataset(p, preset="camvid"), p.name
    return name, torch.utils.data.DataLoader(limit(ds, n), batch_size=1, num_workers=workers)


def limit(ds: Any, n: int | None) -> Any:
    """The first ``n`` samples of ``ds`` (all when ``n`` is None)."""
    return ds if n is None else torch.utils.data.Subset(ds, range(min(n, len(ds))))


def time_inference(
    model: torch.nn.Module,
    loader: Any,
    n: int,
    device: torch.device,
    refiner: BoundaryRefiner | CRFSettings | None = None,
) -> tuple[float, float, bool]:
    """Median seconds per image (batch 1, full resolution) of the base model, and of the
    ``refiner``'s refinement timed on the same images right after each forward (0.0 without):
    the two are measured under the same load, so their ratio holds on a busy machine (two
    separate passes minutes apart once gave a negative "extra time"). The first two images
    warm up (fewer when the split is tiny). Third: whether every timed refinement read the
    base's backbone output (``dualseg.refine.shared``) instead of running its own."""
    base, extra = [], []
    shared_n = 0
    warmup = min(2, len(loader) - 1)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    # a refiner on the base's own frozen backbone at scale 1 reads the base's features
    share = getattr(refiner, "shared_features", None)  # none: dense CRF, on probabilities
    shared = share(model) if share is not None else contextlib.nullcontext()
    with torch.inference_mode(), shared:
        for i, (x, _) in enumerate(loader):
            if i >= n + warmup:
                break
            x = x.to(device)
            sync()
            t0 = time.perf_counter()
            logits = model(x)
            logits.argmax(1)
            sync()
            t1 = time.perf_counter()
            if share is not None:
                # logits: softmax only at the near-boundary rows
                features = shared.take(x)  # None where they do not match x
                refiner.refine(x, logits, features=features)
                shared_n += i >= warmup and features is not None
            elif refiner is not None:
                refiner.refine(x, logits.softmax(1))
            sync()
            if i >= warmup:
                base.append(t1 - t0)
                extra.append(time.perf_counter() - t1)
    extra_s = statistics.median(extra) if refiner is not None else 0.0
    return statistics.median(base), extra_s, refiner is not None and shared_n == len(base)


def curve_stats(log: Path) -> dict[str, Any]:
    """Dev-mIoU learning curve of a run from its ``metrics.jsonl``, with training time.

    ``time`` in the log is the training process's wall-clock (steps and dev validations) and
    starts again at 0 when a run is resumed; the trainer marks each resume with a
    ``resumed_from`` record (older logs only by the clock going back), so the pieces are added.
    A validation record carries the time after that validation, so the total counts the last.
    Minutes in the curve are those at each validation.
    """
    recs = [json.loads(ln) for ln in log.read_text().splitlines() if ln.strip()]
    offset = last = 0.0
    curve = []
    for r in recs:
        if "resumed_from" in r:  # a new process: its clock starts again
            offset, last = offset + last, 0.0
        if "time" in r:
            if r["time"] < last:  # a resume in a log written before the marker existed
                offset += last
            last = r["time"]
        if "val_miou" in r:
            curve.append([r["iteration"], round((offset + last) / 60, 2), r["val_miou"]])
    return {"train_seconds": offset + last, "dev_curve": curve}


def summarize(m: dict[str, Any]) -> dict[str, Any]:
    keys = ("miou", "pixel_acc", "mean_acc", "boundary_f1", "trimap_miou", "iou")
    return {k: m[k] for k in keys if k in m}


def write_table(results: dict[str, Any], path: Path) -> str:
    lines = []
    for split, rows in results["splits"].items():
        lines += [
            f"**CamVid {split}** (full 360x480; {results['budget']})",
            "",
            "| model | mIoU | boundary F1 (3 px) | trimap mIoU (5 px) | pixel acc | ms / image "
            "| pixels fixed / broken |",
            "|---|---|---|---|---|---|---|",
        ]
        for _name, r in rows.items():
            ms = r.get("ms_per_image")
            c = r.get("refine")  # refined rows: changes from wrong to right / right to wrong
            moved = "" if c is None else f"{c['fixed']} / {c['broke']}"
            lines.append(
                f"| {r['label']} | {100 * r['miou']:.1f} | {100 * r['boundary_f1']:.1f} | "
                f"{100 * r['trimap_miou']:.1f} | {100 * r['pixel_acc']:.1f} | "
                f"{'' if ms is None else f'{ms:.0f}'} | "
                f"{moved} |"
            )
        lines.append("")
    text = "\n".join(lines)
    atomic_write_text(path, text + "\n")
    return text


def earlier_calls_seconds(train_record: dict[str, Any]) -> float:
    """The training seconds a resumed plateau run spent in earlier calls of the benchmark (its
    ``train_seconds`` adds every piece; this call's clock saw only the last): counted in
    ``total_seconds`` as a reused run's are."""
    return max(0.0, train_record["train_seconds"] - train_record["seconds_this_call"])


def save_bar_chart(results: dict[str, Any], class_names: list[str], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = results["splits"]["val"]
    fig = Figure(figsize=(12, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    width = 0.8 / len(rows)
    x = np.arange(len(class_names))
    for i, (_, r) in enumerate(rows.items()):
        iou = np.array([np.nan if v is None else v for v in r["iou"]], dtype=float)
        ax.bar(x + i * width, 100 * np.nan_to_num(iou), width, label=r["label"])
    ax.set_xticks(x + 0.4 - width / 2, class_names, rotation=30, ha="right")
    ax.set_ylabel("IoU (%)")
    ax.set_title("CamVid val: per-class IoU")
    ax.legend(fontsize=7, ncols=2)
    save_figure(fig, path)


def save_curves(out: Path, names: list[str], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for name in names:
        log = out / "runs" / name / "metrics.jsonl"
        if not log.exists():
            continue
        recs = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        pts = [(r["iteration"], r["loss"]) for r in recs if "loss" in r and "iteration" in r]
        if pts:
            it, loss = zip(*pts)
            ax.plot(it, loss, label=LABELS[name])
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss L = L1 + L2")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def save_learning_curves(
    train: dict[str, Any],
    path: Path,
    *,
    time_label: str = "training wall-clock minutes (2-core CPU)",
    title: str = "Learning curves (plateau protocol)",
) -> None:
    """Dev mIoU against iterations and against training minutes, every model in one figure.

    A record with ``"time_axis": False`` is drawn against iterations only (its minutes are not
    comparable, e.g. a run paused part of the time). ``time_label``: what the minutes of the
    records' dev curves are."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    curves = [(name, rec) for name, rec in train.items() if rec.get("dev_curve")]
    fig = Figure(figsize=(13, 4.6) if len(curves) > 8 else (11, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    by_iter, by_time = fig.subplots(1, 2, sharey=True)
    colours = colormaps["tab20"].colors if len(curves) > 10 else [f"C{i}" for i in range(10)]
    for i, (name, rec) in enumerate(curves):
        it, minutes, miou = zip(*rec["dev_curve"])
        # 10 or 20 colours, then dashed: no two runs drawn alike
        style = {
            "color": colours[i % len(colours)],
            "linestyle": "-" if i < len(colours) else "--",
            "marker": ".",
        }
        label = LABELS.get(name, name)
        by_iter.plot(it, [100 * v for v in miou], label=label, **style)
        if rec.get("time_axis", True):
            by_time.plot(minutes, [100 * v for v in miou], label=label, **style)
    by_iter.set_xlabel("iteration")
    by_time.set_xlabel(time_label)
    by_iter.set_ylabel("dev mIoU (%) — dev: held out of CamVid train")
    if len(curves) > 8:
        fig.legend(*by_iter.get_legend_handles_labels(), loc="outside right", fontsize=7)
    else:
        by_iter.legend(fontsize=7)
    by_iter.grid(alpha=0.3)
    by_time.grid(alpha=0.3)
    fig.suptitle(title)
    save_figure(fig, path, tight_layout=False)  # constrained layout


def fit_refiners(
    args: argparse.Namespace,
    out: Path,
    models: dict[str, torch.nn.Module],
    meta: Any,
    device: torch.device,
    results: dict[str, Any],
) -> tuple[dict[str, BoundaryRefiner], dict[str, dict[str, BoundaryRefiner]]]:
    """Method B for each base in ``REFINED``: ``(refiners, gated)``.

    ``--refine-backbone-source independent`` fits one refiner (ground truth only) for every
    base; ``base-frozen`` / ``base-finetune`` one per base on that base's backbone. Under the
    plateau protocol the fit reads train_fit (dev held out), and the decision options (gate τ,
    prior weight, probability floor) are chosen per base
    on dev (:mod:`dualseg.refine.calibrate`): ``gated[name]["B_gated"]`` holds that copy, and
    ``gated[name]["B_shared"]`` the best setting without P1 blur when the refiner reads the
    base's own backbone output (:mod:`dualseg.refine.shared`) and the first choice blurs
    (which would make it run its own backbone again). Fitted refiners are
    kept in ``--out`` and reused with ``--reuse``; a fit interrupted (SIGINT / SIGTERM) keeps its
    training state in ``refiner_*.train.pt`` there, and ``--reuse`` continues it.
    """
    import dataclasses

    from dualseg.data.transforms import build_train_transform
    from dualseg.refine.calibrate import choose_decision, sweep_decision

    bases = [n for n in REFINED if n in models]
    if args.refine_steps <= 0 or not bases:
        return {}, {}
    plateau = args.protocol == "plateau"
    root, split = (out / "data", "train_fit") if plateau else (Path(args.data), "train")
    train_ds = build_dataset(
        root,
        split=split,
        preset="camvid",
        transform=build_train_transform(crop_size=tuple(args.crop), scale_range=tuple(args.scale)),
    )
    protos = limit(build_dataset(root, split=split, preset="camvid"), args.prototype_limit)
    shared = args.refine_backbone_source == "independent"
    wanted = RefinerConfig(
        steps=args.refine_steps,
        input_scale=args.refine_input_scale,
        output_stride=args.refine_output_stride,
        embed_dim=args.refine_embed_dim,
        batch_size=args.batch_size,
        seed=args.seed,
        backbone_source=args.refine_backbone_source,
        mining=args.refine_mining,
        decoder_channels=args.refine_decoder_channels,
    )
    fitted: dict[str, BoundaryRefiner] = {}  # "all" (independent) or one per base
    listed = (root / f"{split}.txt").read_text()
    for name in bases:
        key = "all" if shared else name
        path = out / f"refiner_{key}.pt"
        if key in fitted:
            continue
        # what the fit read besides its options: a refiner reused must have read the same
        inputs = {
            "fit_split": split,
            "fit_list_sha256": hashlib.sha256(listed.encode()).hexdigest()[:16],
            "prototype_limit": args.prototype_limit,
            "base": None if shared else model_fingerprint(models[name]),
        }
        record = path.with_suffix(".inputs.json")
        if args.reuse and path.is_file():
            fitted[key] = BoundaryRefiner.load(path, device=device)
            mismatch = refiner_mismatch(fitted[key].config, wanted, path) or inputs_mismatch(
                record, inputs, path
            )
            if mismatch:
                raise ConfigError(mismatch)
            continue
        t0 = time.time()
        # its training state is saved every 200 steps and when interrupted: --reuse continues it
        fitted[key] = BoundaryRefiner.fit(
            train_ds,
            class_names=meta.class_names,
            config=wanted,
            prototype_dataset=protos,
            weights=None if args.weights == "none" or not shared else args.weights,
            init_from=None if shared else models[name],
            device=device,
            num_workers=args.workers,
            progress=False,
            log_every=250,
            checkpoint=path.with_suffix(".train.pt"),
            resume=args.reuse,
            fit_inputs=inputs,  # a resume on another split, list or base is refused
        )
        fitted[key].save(path)
        atomic_write_json(record, inputs)
        results["train"][f"method_b_{key}"] = {
            "steps": args.refine_steps,
            "backbone_source": args.refine_backbone_source,
            "mining": args.refine_mining,
            "seconds": time.time() - t0,
        }
    refiners = {name: fitted["all" if shared else name] for name in bases}
    gated: dict[str, dict[str, BoundaryRefiner]] = {}
    if plateau:
        _, dev = eval_loader(
            args.data, str(out / "data" / "dev.txt"), args.eval_limit, args.workers
        )
        for name in bases:
            model, refiner = models[name], refiners[name]
            with refiner.shared_features(model) as kept:  # as evaluate() will read them
                rows = sweep_decision(
                    refiner,
                    lambda x, m=model: m(x).softmax(1),
                    dev,
                    num_classes=meta.num_classes,
                    device=device,
                    shared=kept,
                )
            metric = args.refine_decision_metric
            chosen = choose_decision(rows, metric=metric)
            sweep = {"metric": metric, "chosen": chosen, "rows": rows}
            print(f"[{name}] decision chosen on dev: {chosen}", flush=True)

            def with_decision(options: dict[str, Any], r: BoundaryRefiner = refiner) -> Any:
                return BoundaryRefiner(
                    r.net,
                    r.prototypes,
                    r.present,
                    class_names=r.class_names,
                    config=dataclasses.replace(r.config, **options),
                )

            gated[name] = {"B_gated": with_decision(chosen)}
            # P1 blur makes the refiner run its own backbone; where it could read the base's
            # features instead, also keep the best setting that does (the cheap one)
            if kept.module is not None and chosen["p1_blur_sigma"]:
                unblurred = [r for r in rows if r.get("p1_blur_sigma", 0) == 0]
                fast = choose_decision(unblurred, metric=metric)
                sweep["chosen_reading_base_features"] = fast
                gated[name]["B_shared"] = with_decision(fast)
                print(f"[{name}] ... among those reading the base's features: {fast}", flush=True)
            results.setdefault("decision_sweep_dev", {})[name] = sweep
    return refiners, gated


def choose_crfs(
    args: argparse.Namespace,
    out: Path,
    models: dict[str, torch.nn.Module],
    meta: Any,
    device: torch.device,
    results: dict[str, Any],
) -> dict[str, CRFSettings]:
    """With ``--crf``, dense CRF's kernel settings for each base in ``REFINED``: under the
    plateau protocol chosen on dev (by ``--refine-decision-metric``, as method B's decision),
    else the defaults."""
    if not args.crf:
        return {}
    bases = [n for n in REFINED if n in models]
    if args.protocol != "plateau":
        return dict.fromkeys(bases, CRFSettings())
    _, dev = eval_loader(args.data, str(out / "data" / "dev.txt"), args.eval_limit, args.workers)
    chosen = {}
    for name in bases:
        metric = args.refine_decision_metric
        chosen[name], rows = choose_crf(
            models[name], dev, num_classes=meta.num_classes, device=device, metric=metric
        )
        results.setdefault("crf_sweep_dev", {})[name] = {"metric": metric, "rows": rows}
        print(f"[{name}] dense CRF chosen on dev: {chosen[name].describe()}", flush=True)
    return chosen


def save_panels(
    models: dict[str, Any],
    refiner: BoundaryRefiner | None,
    loader: Any,
    meta: Any,
    n: int,
    out: Path,
    device: torch.device,
) -> list[str]:
    from dualseg.viz import colorize, denormalize, save_panel

    written = []
    picks = set(np.linspace(0, len(loader.dataset) - 1, n).astype(int).tolist())
    with torch.inference_mode():
        for i, (x, y) in enumerate(loader):
            if i not in picks:
                continue
            x = x.to(device)
            images = [denormalize(x[0].cpu()), colorize(y[0].numpy(), meta.palette)]
            titles = ["image", "ground truth"]
            for name, title in (("peer", "peer (DeepLabV3)"), ("dualseg", "method A")):
                if name in models:
                    images.append(
                        colorize(models[name](x).argmax(1)[0].cpu().numpy(), meta.palette)
                    )
                    titles.append(title)
            if refiner is not None and "dualseg" in models:
                probs = models["dualseg"](x).softmax(1)
                images.append(colorize(refiner.refine(x, probs)[0].cpu().numpy(), meta.palette))
                titles.append("method A + B")
            path = out / f"panel_{len(written)}.png"
            save_panel(path, images, titles, class_names=meta.class_names, palette=meta.palette)
            written.append(path.name)
    return written


def decision_label(cfg: RefinerConfig, metric: str = METRICS[0]) -> str:
    """How a dev-chosen decision reads in a table: 'gate 0.1, prior 2 (chosen on dev)', with
    '... by boundary F1' where the sweep maximized that instead of mIoU."""
    by = "" if metric == METRICS[0] else " by " + {"boundary_f1": "boundary F1"}[metric]
    words = describe_decision(**{k: getattr(cfg, k) for k in DECISION_KEYS})
    return f"{words} (chosen on dev{by})"


def post_processors(
    name: str,
    args: argparse.Namespace,
    refiners: dict[str, BoundaryRefiner],
    gated: dict[str, dict[str, BoundaryRefiner]],
    crfs: dict[str, CRFSettings],
) -> list[tuple[str, str, Any]]:
    """``(row key, label, post-processor)`` of base ``name``'s rows: the base alone (``None``),
    method B, method B with its decision chosen on dev, dense CRF."""
    variants: list[tuple[str, str, Any]] = [(name, LABELS[name], None)]
    if name in refiners:
        variants.append((f"{name}+B", LABELS[name] + " + method B", refiners[name]))
    for kind, copy in gated.get(name, {}).items():
        label = LABELS[name] + (
            f" + method B, {decision_label(copy.config, args.refine_decision_metric)}"
        )
        if kind == "B_shared":
            label = label[: -len(")")] + " among the settings reading the base's features)"
        variants.append((f"{name}+{kind}", label, copy))
    if name in crfs:
        how = "chosen on dev" if args.protocol == "plateau" else "default settings"
        label = f"{LABELS[name]} + dense CRF ({crfs[name].describe()}; {how})"
        variants.append((f"{name}+CRF", label, crfs[name]))
    return variants


def score_variants(
    model: torch.nn.Module,
    variants: list[tuple[str, str, Any]],
    loader: Any,
    split: str,
    args: argparse.Namespace,
    meta: Any,
    device: torch.device,
) -> dict[str, Any]:
    """One results row per variant of :func:`post_processors` on ``loader``'s split."""
    rows: dict[str, Any] = {}
    for key, label, refiner in variants:
        m = evaluate(
            model,
            loader,
            num_classes=meta.num_classes,
            device=device,
            refiner=refiner,
            # fp32, as the dev sweep and the timing run: on CUDA bf16 would also turn off the
            # reading of the base's features, so the figures would come from another
            # computation than the one timed
            amp=False,
        )
        if refiner is None:
            ms = 1000 * time_inference(model, loader, args.timing_images, device)[0]
            rows[key] = {"label": label, **summarize(m), "ms_per_image": ms}
            print(f"[{split}] {label}: mIoU {100 * m['miou']:.1f}", flush=True)
            continue
        base_s, refine_s, timed_shared = time_inference(
            model, loader, args.timing_images, device, refiner
        )
        rows[key] = {
            "label": label,
            **summarize(m["refined"]),
            # base + refinement, both timed in this row's own paired pass: compare rows by
            # extra_time_ratio, not by ms_per_image against the base row's pass
            "ms_per_image": 1000 * (base_s + refine_s),
            "base_ms_per_image_paired": 1000 * base_s,
            "extra_time_ratio": refine_s / base_s,  # paired, under the same load
            # whether the refiner read the base's backbone output instead of running its own,
            # on every image evaluated and timed
            "shares_base_features": timed_shared
            and m["refine"]["shared_images"] == m["num_images"],
            "refine": m["refine"],
        }
        print(
            f"[{split}] {label}: mIoU {100 * m['refined']['miou']:.1f}, "
            f"{m['refine']['fixed']} pixels fixed, {m['refine']['broke']} broken",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_args(args)
    lists = [Path(args.data) / f"{split}.txt" for split in ("train", "val")]
    if not all(p.is_file() for p in lists):
        raise DataError(
            f"{args.data}: no {' / '.join(p.name for p in lists if not p.is_file())} there; "
            "pass the CamVid folder with train.txt and val.txt (--data ../shared/data/camvid)"
        )
    out = Path(args.out)
    if not args.train_only:  # other models' results it will be added to: under these flags
        earlier_results(out, args)
    out.mkdir(parents=True, exist_ok=True)
    if args.protocol == "plateau":
        carve_dev_split(Path(args.data), out, args.dev_fraction, args.holdout_sequence)
    device = device_of(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.time()
    reused_seconds = 0.0  # training time of reused runs and earlier calls, in the total
    results: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cpu_threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "args": args_record(args),
        "train": {},
        "splits": {},
    }

    # ---- 1. train every variant with the same budget ------------------------------------
    for name in args.models:
        record = out / "runs" / name / "train.json"
        cfg = base_config(args, name, out)
        reused = args.reuse and record.is_file()
        stale = stale_record(record) if reused else None
        if stale:  # not a finished run: trained (resumed under the plateau protocol) as one
            print(f"[{name}] {stale}: not a finished run, training it", flush=True)
            record.unlink()
            reused = False
        if reused and args.protocol != "plateau":
            mismatch = budget_mismatch(record, args)
            if mismatch:
                raise ConfigError(mismatch)
        # a finished run reused, or an interrupted one resumed (plateau), must be this recipe's
        if (reused or args.protocol == "plateau") and (record.parent / "config.yaml").is_file():
            mismatch = reuse_mismatch(
                cfg,
                record.parent,
                calibrated_iters=reused and args.protocol != "plateau",
                finished=reused,
            )
            if mismatch:
                raise ConfigError(mismatch)
        if reused:
            results["train"][name] = json.loads(record.read_text())
            reused_seconds += results["train"][name]["seconds"]
            print(f"[{name}] reusing the finished run in {record.parent}", flush=True)
            continue
        if args.protocol == "plateau":
            print(f"[{name}] training {cfg.model.arch} {VARIANTS[name][1]} to plateau", flush=True)
            t0 = time.time()
            # the run is about to go on: its record of an earlier end no longer holds
            record.unlink(missing_ok=True)
            summary = fit(cfg, resume="auto")  # an interrupted run continues where it stopped
            if summary["stop_reason"] == "interrupted":
                print(f"[{name}] interrupted; rerun the same command to continue", flush=True)
                return 128 + summary.get("signal", signal.SIGINT)
            results["train"][name] = {
                "iterations": summary["iteration"],
                "stop_reason": summary["stop_reason"],
                "best_dev_miou": summary["best_miou"],
                "best_iteration": summary["best_iteration"],
                "seconds_this_call": time.time() - t0,
                **curve_stats(out / "runs" / name / "metrics.jsonl"),
            }
            results["train"][name]["seconds"] = results["train"][name]["train_seconds"]
            reused_seconds += earlier_calls_seconds(results["train"][name])
            atomic_write_json(record, results["train"][name])
            continue
        if args.budget_iters:
            iters, per_iter = args.budget_iters, None
        else:
            iters, per_iter = calibrate_iters(cfg, args.budget_minutes, device)
        cfg = replace(cfg, train=replace(cfg.train, max_iters=iters, ckpt_every=iters))
        print(
            f"[{name}] training {cfg.model.arch} {VARIANTS[name][1]} for {iters} iterations",
            flush=True,
        )
        t0 = time.time()
        record.unlink(missing_ok=True)  # the run it recorded is replaced
        summary = fit(cfg, overwrite=True)  # not --reuse: this model is trained afresh
        if summary["stop_reason"] == "interrupted":  # short of its budget: not a finished run
            print(f"[{name}] interrupted; rerun the command to train it again", flush=True)
            return 128 + summary.get("signal", signal.SIGINT)
        results["train"][name] = {
            "iterations": summary["iteration"],
            "seconds": time.time() - t0,
            "calibrated_s_per_iter": per_iter,
            "budget_minutes": None if args.budget_iters else args.budget_minutes,
        }
        atomic_write_json(record, results["train"][name])
    results["budget"] = (
        f"trained to plateau on sequences other than {args.holdout_sequence}, which is dev "
        f"(T={args.max_iters})"
        if args.holdout_sequence
        else f"trained to plateau on a dev split of train (T={args.max_iters})"
        if args.protocol == "plateau"
        else f"{args.budget_iters} iterations per model"
        if args.budget_iters
        else f"{args.budget_minutes:g} min per model"
    ) + f", crops {args.crop[0]}x{args.crop[1]}, batch {args.batch_size}, {device.type}"
    if args.train_only:
        print(f"trained {', '.join(args.models)}; rerun with --reuse for method B and evaluation")
        return 0

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

    # ---- 2. method B: fitted on the training set (plateau: on train_fit, dev held out) ------
    try:
        refiners, gated = fit_refiners(args, out, models, meta, device, results)
    except (KeyboardInterrupt, Terminated) as stop:  # the fit saved its state before stopping
        print("[method B] interrupted; rerun with --reuse to continue its fit", flush=True)
        return 143 if isinstance(stop, Terminated) else 130

    crfs = choose_crfs(args, out, models, meta, device, results)

    # ---- 3. evaluate at full resolution ----------------------------------------------------
    cross_scene = (
        [str(out / "data" / f"cross_scene_{args.holdout_sequence}.txt")]
        if args.holdout_sequence
        else []
    )
    for split_path in [None, *cross_scene, *args.eval_split]:
        split, loader = eval_loader(args.data, split_path, args.eval_limit, args.workers)
        rows: dict[str, Any] = {}
        for name, model in models.items():
            variants = post_processors(name, args, refiners, gated, crfs)
            rows |= score_variants(model, variants, loader, split, args, meta, device)
        results["splits"][split] = rows

    # ---- 4. report ------------------------------------------------------------------------
    # wall-clock of this call plus the training it builds on: reused runs, earlier calls
    results["total_seconds"] = time.time() - started + reused_seconds  # (this call's models)
    old = earlier_results(out, args)  # the models of earlier calls into this --out: kept
    kept = merge_results(results, old, args.models) if old is not None else []
    atomic_write_json(out / "results.json", results)
    table = write_table(results, out / "results.md")
    save_bar_chart(results, list(meta.class_names), out / "per_class_iou.png")
    save_curves(out, [n for n in VARIANTS if n in models or n in kept], out / "curves.png")
    if args.protocol == "plateau":
        save_learning_curves(results["train"], out / "learning_curves.png")
    _, val_loader = eval_loader(args.data, None, args.eval_limit, args.workers)
    panel_refiner = refiners.get("dualseg")
    results["panels"] = save_panels(
        models, panel_refiner, val_loader, meta, args.panels, out, device
    )
    atomic_write_json(out / "results.json", results)
    print(table)
    print(f"total {results['total_seconds'] / 60:.1f} min; results in {out}")
    if kept:
        print(f"(rows of {', '.join(kept)}: kept from an earlier call into {out})")
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
