"""The CamVid benchmark's training protocols: the models compared, the config each trains
with (budget or plateau), the dev carve (a fraction of each sequence, or one sequence held
out), the budget calibration, and the checks that a run reused was trained as this call asks."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

import dualseg
from dualseg.commands.common import number_in
from dualseg.engine.checkpoint import load_checkpoint
from dualseg.engine.config import load_config
from dualseg.engine.options import (
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    config_changes,
    config_to_dict,
)
from dualseg.errors import ConfigError
from dualseg.io import atomic_write_text
from dualseg.models import build_model


def positive_float(text: str) -> float:
    """A finite number > 0 (minutes, LR, scales)."""
    return number_in(text, lambda v: v > 0, "> 0")


def open_fraction(text: str) -> float:
    """A number strictly between 0 and 1 (``--dev-fraction``: some frames of each sequence
    held out, and some trained on)."""
    return number_in(text, lambda v: 0 < v < 1, "between 0 and 1 (both excluded)")


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


def evaluated_checkpoint(run_dir: Path) -> str:
    """Which checkpoint of a trained run is evaluated, by the run's own stopping rule: with
    early stopping (plateau protocol, ``--patience N``) the best on dev; without (``--patience
    0``, and every budget run) the end of the schedule, which the schedule check compares."""
    patience = load_config(run_dir / "config.yaml").train.patience
    return "best.pt" if patience else "last.pt"


def sequence_of(path: str) -> str:
    """The CamVid sequence of an image path (or a list line): its file name's prefix before
    the first ``_`` (``train/0001TP_006690.png`` -> ``0001TP``)."""
    return Path(path.split()[0]).name.split("_")[0]


def split_by_sequence(
    lines: list[str], holdout: str, flag: str = "--holdout-sequence"
) -> tuple[list[str], list[str]]:
    """``(train_lines, holdout_lines)``: the list lines of every other sequence, and those of
    sequence ``holdout`` (a :class:`ConfigError` naming ``flag`` and the sequences there are
    when it is absent or would leave nothing to train on)."""
    held = [ln for ln in lines if sequence_of(ln) == holdout]
    rest = [ln for ln in lines if sequence_of(ln) != holdout]
    if not held or not rest:
        names = ", ".join(sorted({sequence_of(ln) for ln in lines}))
        why = "is not among" if not held else "is the only one of"
        raise ConfigError(
            f"{flag} {holdout} {why} the training sequences ({names}): name another one"
        )
    return rest, held


def carve_dev_split(
    data: Path, out: Path, fraction: float, holdout: str | None = None, unseen: str | None = None
) -> Path:
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
    ``unseen`` (another sequence) is left out of both: ``unseen_<unseen>.txt`` is a scene that
    no model trained on and no choice was made on.

    A folder whose runs or refiners were trained on another carve (another ``--dev-fraction``,
    ``--holdout-sequence`` or ``train.txt``) is refused: reusing or resuming them would put
    trained-on images into dev.
    """

    def absolute(line: str) -> str:
        return " ".join(str((data / part).resolve()) for part in line.split())

    lines = sorted(ln for ln in (data / "train.txt").read_text().splitlines() if ln.strip())
    if unseen is not None:
        lines, left_out = split_by_sequence(lines, unseen, "--unseen-sequence")
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
    if unseen is not None:
        lists[f"unseen_{unseen}"] = list(map(absolute, left_out))
    texts = {name: "\n".join(rows) + "\n" for name, rows in lists.items()}
    trained = [c.parent for c in out.glob("runs/*/config.yaml")] + [*out.glob("refiner_*.pt")]
    carve = f"--holdout-sequence {holdout}" if holdout else f"--dev-fraction {fraction:g}"
    carve += f" --unseen-sequence {unseen}" if unseen else ""
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


def base_config(args: argparse.Namespace, name: str, out: Path) -> Config:
    """Model ``name``'s training config under ``--protocol``: the same data, augmentation and
    recipe for every model."""
    arch, options = VARIANTS[name]
    if args.output_stride:
        options = {**options, "output_stride": args.output_stride}
    data: dict[str, Any] = {
        "preset": "camvid",
        "crop_size": tuple(args.crop),
        "scale_range": tuple(args.scale),
        "blur_prob": 0.1,  # the shipped CamVid configs' S1 augmentation, for every model
        "jitter": 0.2,
        "batch_size": args.batch_size,
        "num_workers": args.workers,
    }
    train: dict[str, Any] = {
        "out_dir": str(out / "runs" / name),
        "seed": args.seed,
        "device": args.device,
        "tensorboard": False,
    }
    if args.protocol == "plateau":  # no idle loader workers beside the model between validations
        data |= {"root": str(out / "data"), "train_split": "train_fit", "val_split": "dev",
                 "val_batch_size": 1, "persistent_workers": False}  # fmt: skip
        train |= {"max_iters": args.max_iters, "val_every": args.val_every,
                  "monitor": "val_miou", "patience": args.patience or None,  # 0: off
                  "min_delta": args.min_delta / 100.0, "amp": args.amp or "none",
                  "progress": False}  # fmt: skip
    else:  # evaluated at full resolution outside the budget; the calibrated schedule runs out
        data |= {"root": str(args.data), "val_split": None}
        train |= {"max_iters": 1, "val_every": 0, "monitor": "train_loss", "patience": None,
                  "amp": args.amp or "auto", "progress": True}  # fmt: skip
    return Config(
        data=DataConfig(**data),
        model=ModelConfig(arch=arch, weights=None if args.weights == "none" else args.weights,
                          **options),
        optim=OptimConfig(lr=args.lr, head_lr_mult=args.head_lr_mult,
                          warmup_iters=args.warmup_iters, clip_grad_norm=args.clip_grad_norm),
        train=TrainConfig(**train),
    )  # fmt: skip


def calibrate_iters(cfg: Config, minutes: float, device: torch.device) -> tuple[int, float]:
    """Iterations that fit in ``minutes``, from timed forward+backward steps on a random batch,
    in the precision and memory format ``fit`` trains ``cfg`` in (``train.amp``: a step of
    another cost would set another T).

    Data loading runs in worker processes alongside; it is measured separately by
    benchmarks/data_throughput.py and is not the bottleneck at these sizes.
    """
    from dualseg.engine.cpu_bf16 import amp_dtype_for as training_dtype  # fit's own choice
    from dualseg.engine.cpu_bf16 import convs_in_fp32
    from dualseg.engine.options import model_kwargs

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


def earlier_calls_seconds(train_record: dict[str, Any]) -> float:
    """The training seconds a resumed plateau run spent in earlier calls of the benchmark (its
    ``train_seconds`` adds every piece; this call's clock saw only the last): counted in
    ``total_seconds`` as a reused run's are."""
    return max(0.0, train_record["train_seconds"] - train_record["seconds_this_call"])


def source_commit() -> str | None:
    """The git commit of the checkout whose dualseg source this run imports, ``+dirty`` when
    the checkout's tracked files differ from it; None outside one (an installed copy, even
    inside another repository). A result read sessions later is then tied to its code."""
    where = Path(dualseg.__file__).resolve().parent
    env = {k: v for k, v in os.environ.items() if k not in ("GIT_DIR", "GIT_WORK_TREE")}

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "--no-optional-locks", "-C", str(where), *args],
                              capture_output=True, text=True, timeout=30, env=env)  # fmt: skip

    try:  # the source must be tracked by the repository found, not merely lie inside it
        if git("ls-files", "--error-unmatch", "__init__.py").returncode != 0:
            return None
        head, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "-uno")
    except (OSError, subprocess.SubprocessError):  # no git on the machine
        return None
    if head.returncode != 0:
        return None
    dirty = status.returncode != 0 or bool(status.stdout.strip())  # unknown: not called clean
    return head.stdout.strip() + ("+dirty" if dirty else "")


def budget_words(args: argparse.Namespace, device: torch.device) -> str:
    """How the models were trained, as the table's caption says it."""
    if args.holdout_sequence:
        unseen = f", and {args.unseen_sequence}, unseen" if args.unseen_sequence else ""
        how = (
            f"trained to plateau on sequences other than {args.holdout_sequence}, which is dev"
            f"{unseen} (T={args.max_iters})"
        )
    elif args.protocol == "plateau":
        how = f"trained to plateau on a dev split of train (T={args.max_iters})"
    elif args.budget_iters:
        how = f"{args.budget_iters} iterations per model"
    else:
        how = f"{args.budget_minutes:g} min per model"
    return f"{how}, crops {args.crop[0]}x{args.crop[1]}, batch {args.batch_size}, {device.type}"
