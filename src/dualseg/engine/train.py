"""Training loop (spec S3): ``fit(cfg)`` and its inner ``train_one_epoch``.

One iteration = one SGD step on one batch (per process). The loop runs until ``max_iters``
(the T of the poly schedule), or earlier when the monitored quantity — validation mIoU or the
smoothed training loss — has not improved for ``patience`` evaluations (S33 Reading).

Every ``val_every`` iterations: validation (mIoU, per-class IoU, boundary scores via
:func:`dualseg.engine.evaluation.evaluate`), then ``last.pt`` and, on a new best mIoU, ``best.pt``.
A checkpoint holds everything needed to continue exactly: weights, optimizer, scheduler, AMP
scaler, iteration, epoch, sampler position and RNG states, so ``--resume`` continues the same
run (bit-identical on CPU in deterministic mode). SIGINT / SIGTERM finish the current step,
save ``last.pt`` and return. A NaN/inf loss stops the run before the bad update is applied and
keeps the last good checkpoint.

Run folder (``train.out_dir``)::

    config.yaml      the resolved config (``dualseg train --config`` reads it back)
    last.pt best.pt  checkpoints (atomic writes)
    metrics.jsonl    one JSON record per logged step / validation
    events.out.*     TensorBoard (when installed)
    curves.png       loss and mIoU curves, at the end
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

from dualseg.console import progress_mode
from dualseg.data.collate import SameSizeCollate
from dualseg.engine import checkpoint as ckpt_io
from dualseg.engine.config import (
    Config,
    config_changes,
    config_to_dict,
    model_kwargs,
    save_config,
    train_transform,
)
from dualseg.engine.config import validate as validate_config
from dualseg.engine.cpu_bf16 import convs_in_fp32
from dualseg.engine.distributed import (
    DistEnv,
    ResumableSampler,
    SeededSamples,
    ShardSampler,
    all_reduce_sum,
    barrier,
    broadcast_buffers,
    cleanup_distributed,
    init_distributed,
)
from dualseg.engine.losses import SegmentationLoss, class_weights_for
from dualseg.engine.optim import build_optimizer, build_scheduler
from dualseg.engine.preflight import (
    check_training_data,
    label_mapping,
    scored_classes_note,
    warn_missing_tensorboard,
)
from dualseg.engine.rundir import (
    CheckpointClock,
    check_not_in_use,
    check_run_dir,
    checkpoint_interval,
    discard_replaced,
    hold_run_folder,
    prepare_run_dir,
    restore_replaced,
)
from dualseg.engine.runlog import Interrupt, Progress, RunLog
from dualseg.errors import CheckpointError, ConfigError, DataError, DualsegError, RunExistsError

__all__ = ["TrainingDivergedError", "fit", "train_one_epoch", "train_transform"]

log = logging.getLogger(__name__)


class TrainingDivergedError(DualsegError):
    """The loss became NaN or infinite; the run stopped before applying that update."""


# --------------------------------------------------------------------------- one epoch
@dataclass
class StepStats:
    """What one training step reports (averaged over ranks)."""

    iteration: int  # iterations completed, after this step
    l1: float
    l2: float
    loss: float
    lr: float
    interrupted: bool  # some rank received SIGINT / SIGTERM


def _amp_context(device: torch.device, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def train_one_epoch(
    model: nn.Module,
    loader: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    criterion: Callable[[Tensor, Tensor], tuple[Tensor, dict[str, Tensor]]],
    *,
    device: torch.device,
    start_iteration: int = 0,
    max_iters: int | None = None,
    amp_dtype: torch.dtype | None = None,
    scaler: torch.amp.GradScaler | None = None,
    channels_last: bool = False,
    clip_grad_norm: float | None = None,
    interrupted: Callable[[], bool] = lambda: False,
    on_step: Callable[[StepStats], bool] | None = None,
) -> int:
    """Train over ``loader`` once (or until ``max_iters`` / ``on_step`` returns True).

    ``model`` may be DDP-wrapped or compiled. After each step the losses are averaged over
    ranks (one small ``all_reduce``), checked for NaN/inf *before* the optimizer applies the
    update, and passed to ``on_step`` — which does logging, validation and checkpoints and
    returns True to stop. Returns the iteration count reached. ``clip_grad_norm``: the largest
    total L2 norm of the gradient (of the unscaled gradient under fp16), None for no clipping.

    On CPU with ``amp_dtype=torch.bfloat16``, pass a model prepared with
    :func:`dualseg.engine.cpu_bf16.convs_in_fp32` (as :func:`fit` does): oneDNN's bf16
    weight gradient of dilated depthwise convolutions, and on some CPUs of dilated ones with
    input channels that are not a multiple of 16, is wrong.
    """
    model.train()
    iteration = start_iteration
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    for images, labels in loader:
        if max_iters is not None and iteration >= max_iters:
            break
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)

        with _amp_context(device, amp_dtype):
            logits = model(images)  # [B,C,H,W]
        loss, parts = criterion(logits, labels)  # float32, outside autocast

        optimizer.zero_grad(set_to_none=True)
        (scaler.scale(loss) if scaler is not None else loss).backward()

        # [l1, l2, loss, stop]: averaged over ranks so every rank takes the same decisions.
        stop = 1.0 if interrupted() else 0.0
        vec = torch.stack([parts["l1"], parts["l2"].to(device), parts["loss"]]).float()
        vec = torch.cat([vec, torch.tensor([stop], device=device)])
        values = (all_reduce_sum(vec) / world).tolist()
        if not all(math.isfinite(v) for v in values[:3]):
            raise TrainingDivergedError(
                f"loss became non-finite at iteration {iteration + 1} (L1={values[0]:.4g}, "
                f"L2={values[1]:.4g}); stopped before applying the update. Lower --optim.lr, "
                "add --optim.warmup_iters, or use --train.amp none"
            )
        if clip_grad_norm is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)  # clip the true gradient, not the scaled one
            params = [p for group in optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        lr = optimizer.param_groups[0]["lr"]
        scheduler.step()
        iteration += 1

        stats = StepStats(iteration, values[0], values[1], values[2], lr, values[3] > 0)
        if on_step is not None and on_step(stats):
            break
    return iteration


# --------------------------------------------------------------------------- pieces of fit
def _seed_everything(seed: int, deterministic: bool, device: torch.device) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = not deterministic
        if deterministic:  # CPU kernels are deterministic already (and this import is slow)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 or AMX); Linux flags, else False."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))


def _amp_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    if device.type != "cuda":
        if mode == "fp16":
            raise ConfigError("train.amp=fp16 needs a GPU; use --train.amp bf16 or none on CPU")
        if mode == "none":
            return None
        if mode == "auto":  # bf16 where the CPU computes it (val mIoU measured: docs/training.md)
            return torch.bfloat16 if cpu_has_native_bf16() else None
        if not cpu_has_native_bf16():
            log.warning(
                "train.amp=bf16 on a CPU without AVX-512 BF16/AMX: bf16 is emulated here and "
                "runs far slower than fp32 (measured ~40x on an AVX2 EPYC); use --train.amp none"
            )
        return torch.bfloat16
    if mode == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]


def _build_datasets(cfg: Config) -> tuple[Any, Any | None]:
    from dualseg.data import build_dataset

    d = cfg.data
    if not d.root:
        raise ConfigError("no dataset: set data.root in the config or pass --data.root PATH")
    transform = train_transform(d)
    common = {"layout": d.layout, "preset": d.preset, "label_format": d.label_format}
    common.update(label_mapping(d))
    train_ds = build_dataset(
        d.root,
        split=d.train_split,
        transform=transform,
        samples_per_epoch=d.samples_per_epoch,
        seed=cfg.train.seed,
        **common,
    )
    val_ds = build_dataset(d.root, split=d.val_split, **common) if d.val_split else None
    if val_ds is not None and sorted(val_ds.samples) == sorted(train_ds.samples):
        raise ConfigError(
            f"data.val_split {d.val_split!r} resolves to the training images (split "
            f"{d.train_split!r} of {d.root}): validating on them would say nothing; add a "
            "val split or set data.val_split to null (--data.val_split null)"
        )
    return train_ds, val_ds


def _build_loaders(
    cfg: Config, env: DistEnv, train_ds: Any, val_ds: Any | None
) -> tuple[DataLoader, ResumableSampler, DataLoader | None]:
    d = cfg.data
    sampler = ResumableSampler(
        train_ds,
        num_replicas=env.world_size,
        rank=env.rank,
        shuffle=True,
        seed=cfg.train.seed,
    )
    if sampler.num_samples < d.batch_size:
        raise DataError(
            f"the training split has {sampler.num_samples} images per process, fewer than "
            f"data.batch_size={d.batch_size}; lower the batch size or set data.samples_per_epoch"
        )
    workers = d.num_workers
    pin = d.pin_memory and env.device.type == "cuda"
    train_loader = DataLoader(
        SeededSamples(train_ds, seed=cfg.train.seed),
        batch_size=d.batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=pin,
        drop_last=True,
        persistent_workers=workers > 0 and d.persistent_workers,
        # The loader's own seeds come from this generator, not from the global RNG, so creating
        # a loader iterator (new epoch, resume) never shifts the training RNG stream.
        generator=torch.Generator().manual_seed(cfg.train.seed),
    )
    val_loader = None
    if val_ds is not None:
        val_loader = DataLoader(
            val_ds,
            batch_size=d.val_batch_size,
            sampler=ShardSampler(len(val_ds), num_replicas=env.world_size, rank=env.rank),
            num_workers=workers,
            pin_memory=pin,
            persistent_workers=workers > 0 and d.persistent_workers,
            generator=torch.Generator().manual_seed(cfg.train.seed),
            # validation images keep their own size: a batch of two sizes is one line
            collate_fn=SameSizeCollate("set --data.val_batch_size 1"),
        )
    return train_loader, sampler, val_loader


def _build_model(cfg: Config, num_classes: int, *, pretrained: bool) -> nn.Module:
    from dualseg.models import build_model

    kwargs = model_kwargs(cfg.model, num_classes)
    weights = cfg.model.weights if pretrained else None
    return build_model(
        cfg.model.arch, weights=weights, allow_download=cfg.model.allow_download, **kwargs
    )


def _apply_schedule(
    optimizer: torch.optim.Optimizer, scheduler: LambdaLR, base_lrs: list[float]
) -> None:
    """After loading a checkpoint: the LR of this run's schedule at the resumed iteration.

    The checkpoint holds the LR its own schedule reached; a resume with another
    ``--optim.lr`` or ``--train.max_iters`` continues on the new schedule instead (with the
    same config this recomputes the very same values, so exact resumption is unaffected).
    """
    scheduler.base_lrs = list(base_lrs)
    t = scheduler.last_epoch
    for group, base, factor in zip(optimizer.param_groups, base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * factor(t)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


def _resolve_resume(resume: str | None, out_dir: Path) -> Path | None:
    if resume is None:
        return None
    if resume == "auto":
        return ckpt_io.find_resume_checkpoint(out_dir)
    return Path(resume)


def _val_record(iteration: int, metrics: dict[str, Any]) -> dict[str, Any]:
    record: dict[str, Any] = {"iteration": iteration}
    for key in ("miou", "pixel_acc", "mean_acc", "fwiou", "boundary_f1", "trimap_miou", "loss"):
        if key in metrics:
            record[f"val_{key}"] = metrics[key]
    record["val_iou"] = metrics.get("iou")
    return record


# --------------------------------------------------------------------------- fit
def fit(cfg: Config, *, resume: str | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Train ``cfg`` (under ``torchrun``: one process per GPU); returns a summary dict.

    ``resume``: a checkpoint path, or ``"auto"`` for ``<out_dir>/last.pt`` when it exists.
    Summary: ``{"iteration", "stop_reason", "best_miou", "best_iteration", "last", "best",
    "out_dir"}`` where ``stop_reason`` is ``"max_iters"``, ``"patience"`` or ``"interrupted"``
    (with ``"signal"``).

    A ``train.out_dir`` that already holds a run is refused unless ``resume`` continues that
    run (``"auto"`` finding its ``last.pt``, or the path of its own ``last.pt`` / ``best.pt``)
    or ``overwrite=True``, which sets the old run's files aside right before the first write
    (after the data scan, the datasets, the model and the optimizer were built; also when
    resuming another folder's checkpoint) and deletes them at the new run's first checkpoint;
    a run that fails before that puts them back.

    Reads like torchvision's reference ``main()``: pre-flight -> build -> resume -> loop ->
    summary.
    """
    validate_config(cfg)  # also for a Config built in Python rather than parsed
    env = init_distributed(cfg.train.device)
    try:
        _preflight(cfg, env, resume, overwrite)  # run folder check, dataset scan, tensorboard
        run = _build(cfg, env, resume)  # data, model, loss, optimizer, schedule
        _resume(run)  # weights, optimizer, schedule, sampler, progress, RNG states
        # one process writes the folder: a second run into it is refused (the main process
        # holds it for all ranks)
        with hold_run_folder(run.out_dir) if env.is_main else contextlib.nullcontext():
            try:
                _start(run, overwrite)  # DDP / compile, run folder (old run set aside), log
                _loop(run)  # epochs until max_iters, patience or a signal
            except BaseException:
                if run.replaced is not None:  # failed before its first checkpoint: old run back
                    restore_replaced(run.out_dir, run.replaced)
                raise
            return _summary(run)
    finally:
        cleanup_distributed()


@dataclass
class _Run:
    """Everything one ``fit`` holds; the loop's functions read and update it."""

    cfg: Config
    env: DistEnv
    resume: str | None
    resume_path: Path | None
    state: dict[str, Any] | None  # the checkpoint resumed from
    meta: Any  # DatasetMeta of the training set
    train_data: dict[str, Any]  # which pairs the training split holds (train_data_record)
    train_loader: DataLoader
    sampler: ResumableSampler
    val_loader: DataLoader | None
    model: nn.Module  # un-wrapped: checkpoints, validation
    criterion: SegmentationLoss
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    scaler: torch.amp.GradScaler | None
    amp_dtype: torch.dtype | None
    channels_last: bool
    progress: Progress = field(default_factory=Progress)
    train_model: nn.Module | None = None  # DDP-wrapped and/or compiled
    log: RunLog | None = None
    interrupt: Interrupt = field(default_factory=Interrupt)
    iteration: int = 0
    epoch: int = 0
    consumed: int = 0  # samples of this epoch already trained on (this rank)
    stop_reason: str = "max_iters"
    started: float = 0.0
    clock: CheckpointClock | None = None  # when last.pt is due (iterations, minutes)
    replaced: Path | None = None  # the run an --overwrite set aside, until the first checkpoint

    @property
    def out_dir(self) -> Path:
        return Path(self.cfg.train.out_dir)

    @property
    def paths(self) -> dict[str, Path]:
        return {"last": self.out_dir / ckpt_io.LAST_NAME, "best": self.out_dir / ckpt_io.BEST_NAME}


def _preflight(cfg: Config, env: DistEnv, resume: str | None, overwrite: bool) -> None:
    """Before any work, changing nothing: refuse a folder holding a run that ``resume`` does
    not continue (unless ``overwrite``); scan the dataset (``data.check``); warn about
    TensorBoard."""
    t = cfg.train
    if t.threads > 0:
        torch.set_num_threads(t.threads)
    check_run_dir(t.out_dir, resume=resume, overwrite=overwrite)
    check_not_in_use(t.out_dir)  # again when the folder is taken (hold_run_folder)
    if not overwrite:
        _refuse_rewind(Path(t.out_dir), resume)
    shown = env.is_main and t.progress and not t.quiet
    check_training_data(cfg.data, progress=progress_mode(quiet=not shown), warn=env.is_main)
    warn_missing_tensorboard(t.tensorboard and env.is_main)


def _refuse_rewind(out_dir: Path, resume: str | None) -> None:
    """Resuming a folder from its own ``best.pt`` rewinds the run: its later ``last.pt`` and
    ``metrics.jsonl`` records would be replaced. Only with ``--overwrite``."""
    best, last = out_dir / ckpt_io.BEST_NAME, out_dir / ckpt_io.LAST_NAME
    if resume in (None, "auto") or not last.is_file():
        return
    if Path(resume).resolve() != best.resolve():
        return
    at_best = int(ckpt_io.load_checkpoint(best).get("iteration", 0))
    try:
        at_last = int(ckpt_io.load_checkpoint(last).get("iteration", 0))
    except CheckpointError:  # a broken last.pt: best.pt is the way back, nothing to rewind
        return
    if at_last > at_best:
        raise RunExistsError(
            f"--resume {resume} (iteration {at_best}) would rewind the run in {out_dir}: its "
            f"{ckpt_io.LAST_NAME} (iteration {at_last}) and later log records would be "
            f"replaced; resume from {last}, pass --overwrite to go back to iteration {at_best}, "
            "or choose another --train.out_dir"
        )


def _build(cfg: Config, env: DistEnv, resume: str | None) -> _Run:
    """Datasets and loaders, the model (ImageNet weights unless resuming), loss, optimizer,
    LR schedule and AMP scaler — in this order, which fixes the RNG stream."""
    t, o = cfg.train, cfg.optim
    device = env.device
    _seed_everything(t.seed, t.deterministic, device)

    train_ds, val_ds = _build_datasets(cfg)
    meta = train_ds.meta
    train_loader, sampler, val_loader = _build_loaders(cfg, env, train_ds, val_ds)

    resume_path = _resolve_resume(resume, Path(t.out_dir))
    state = ckpt_io.load_checkpoint(resume_path) if resume_path is not None else None
    if state is not None:
        ckpt_io.check_compatible(
            state,
            arch=cfg.model.arch,
            num_classes=meta.num_classes,
            class_names=meta.class_names,
        )
        _check_resumable(state, resume_path, t.max_iters)

    model = _build_model(cfg, meta.num_classes, pretrained=state is None)
    if env.distributed and t.sync_bn and device.type == "cuda":  # SyncBatchNorm is GPU-only
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    amp_dtype = _amp_dtype(t.amp, device)
    channels_last = t.channels_last
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if device.type == "cpu" and amp_dtype == torch.bfloat16:
        convs_in_fp32(model)  # oneDNN's bf16 weight gradient of some is wrong (cpu_bf16)
    criterion = SegmentationLoss(
        model,
        weight_decay=o.weight_decay,
        l2_lambda=o.l2_lambda,
        ignore_index=meta.ignore_index,
        l1_reduction=o.l1_reduction,
        l2_recurrent=o.l2_recurrent,
        class_weights=class_weights_for(o.class_weights, meta.num_classes, train_ds),
        ohem_thresh=o.ohem_thresh,
        ohem_min_kept=o.ohem_min_kept,
    )
    optimizer = build_optimizer(
        model, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, head_lr_mult=o.head_lr_mult
    )
    scheduler = build_scheduler(
        optimizer,
        max_iters=t.max_iters,
        power=o.poly_power,
        warmup_iters=o.warmup_iters,
        warmup_factor=o.warmup_factor,
    )
    scaler = torch.amp.GradScaler("cuda") if amp_dtype == torch.float16 else None
    return _Run(
        cfg=cfg,
        env=env,
        resume=resume,
        resume_path=resume_path,
        state=state,
        meta=meta,
        train_data=train_data_record(train_ds.samples),
        train_loader=train_loader,
        sampler=sampler,
        val_loader=val_loader,
        model=model,
        criterion=criterion,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        amp_dtype=amp_dtype,
        channels_last=channels_last,
    )


RESUME_KEYS = ("optimizer", "scheduler", "sampler", "iteration", "epoch", "rng")


def _check_resumable(state: dict, path: Path | None, max_iters: int) -> None:
    """A resume needs a training checkpoint (not weights alone) that has iterations left."""
    missing = [k for k in RESUME_KEYS if k not in state]
    if missing:
        raise CheckpointError(
            f"{path} holds model weights without the training state a resume needs "
            f"(no {', '.join(missing)}): resume from a checkpoint that dualseg train wrote "
            "(the run's last.pt)"
        )
    try:
        done = int(state["iteration"])
    except (TypeError, ValueError):
        raise CheckpointError(
            f"{path} is a damaged training checkpoint (iteration {state['iteration']!r}); resume "
            "from another checkpoint of the run (best.pt, or an earlier one)"
        ) from None
    if max_iters < done:  # the run would end at once, its config.yaml saying max_iters
        raise ConfigError(
            f"{path} is at iteration {done}, past train.max_iters {max_iters}: pass "
            f"--train.max_iters {done} or more to resume it, or evaluate it with dualseg eval"
        )


def _resume(run: _Run) -> None:
    """Continue the checkpoint's run exactly: weights, optimizer, this run's LR schedule at the
    resumed iteration, AMP scaler, sampler position, loop progress and RNG states. A state that
    passed the checks yet does not restore (edited, or written by other code) is one
    :class:`CheckpointError`; nothing is written before this point."""
    if run.state is None:
        return
    try:
        _restore(run, run.state)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        if isinstance(err, CheckpointError | ConfigError):
            raise
        detail = " ".join(f"{type(err).__name__}: {err}".split())
        raise CheckpointError(
            f"{run.resume_path} is a damaged training checkpoint ({detail}); resume from another "
            "checkpoint of the run (best.pt, or an earlier one), or start a new run"
        ) from None


def _restore(run: _Run, state: dict) -> None:
    # the model and optimizer settings changed since the checkpoint: what a mismatch names
    changed = {
        k: v
        for k, v in config_changes(state.get("config") or {}, run.cfg).items()
        if k.startswith(("model.", "optim."))
    }
    said = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items())
    try:
        ckpt_io.load_model_state(run.model, state)
    except CheckpointError as err:
        if not said:
            raise
        raise CheckpointError(
            f"{err} (changed since that checkpoint: {said}; resume with the checkpoint's "
            "values, or start a new run: another --train.out_dir, or --overwrite)"
        ) from None
    base_lrs = list(run.scheduler.base_lrs)  # from this run's config
    saved = [len(g["params"]) for g in state["optimizer"].get("param_groups", [])]
    here = [len(g["params"]) for g in run.optimizer.param_groups]
    if saved != here:  # torch would raise a bare ValueError
        why = said or (
            f"optim.head_lr_mult={run.cfg.optim.head_lr_mult:g}: other than 1 splits backbone "
            "and head"
        )
        raise CheckpointError(
            f"{run.resume_path}: its optimizer's parameter groups hold {saved} parameters, this "
            f"run's {here} ({why}); resume with the checkpoint's settings, or start a new run "
            "(another --train.out_dir, or --overwrite)"
        )
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    _apply_schedule(run.optimizer, run.scheduler, base_lrs)
    for group in run.optimizer.param_groups:  # this run's config, as for the LR
        group["momentum"], group["nesterov"] = run.cfg.optim.momentum, run.cfg.optim.nesterov
    if run.scaler is not None and state.get("scaler"):
        run.scaler.load_state_dict(state["scaler"])
    run.sampler.load_state_dict(state["sampler"])
    run.progress.load_state_dict(state.get("progress") or {})
    run.progress.last_val = dict(state.get("metrics") or {})
    run.iteration, run.epoch = int(state["iteration"]), int(state["epoch"])
    ckpt_io.restore_rng_state(state["rng"])


def train_data_record(samples: list[tuple[Path, Path]]) -> dict[str, Any]:
    """Which pairs a training split holds, kept in each checkpoint: their count and a digest of
    their file names in order (names, not paths: a dataset moved elsewhere is the same data),
    so a resume on a split that gained, lost or reordered pairs says so."""
    names = "\n".join(f"{img.name}\t{label.name}" for img, label in samples)
    return {"pairs": len(samples), "digest": hashlib.sha1(names.encode("utf-8")).hexdigest()}


def _start(run: _Run, overwrite: bool = False) -> None:
    """Wrap the model for training (DDP, compile); clear the run folder (``overwrite``: the
    old run's files set aside; stale temporaries), create it, write the config, open the log."""
    t, env = run.cfg.train, run.env
    train_model: nn.Module = run.model
    if env.distributed:
        ids = [env.device.index] if env.device.type == "cuda" else None
        train_model = nn.parallel.DistributedDataParallel(run.model, device_ids=ids)
    if t.compile:
        train_model = torch.compile(train_model)
    run.train_model = train_model

    # The first write: only now, with everything that can fail on user input done, does an
    # --overwrite set the old run's files aside. The main process only: the others checked the
    # folder in _preflight, and checking again here would race with its first write below.
    if env.is_main:
        run.replaced = prepare_run_dir(run.out_dir, resume=run.resume, overwrite=overwrite)
    if env.is_main:
        run.out_dir.mkdir(parents=True, exist_ok=True)
        save_config(run.cfg, run.out_dir / "config.yaml")
    run.log = RunLog(run.cfg, env, run.out_dir, run.iteration)
    # --resume auto may do either: said even with train.quiet (on stderr), as a new run is
    # not what a resume asked for
    say = run.log.notice if run.resume == "auto" else run.log.message
    if run.state is not None:
        say(f"resumed from {run.resume_path} at iteration {run.iteration} (epoch {run.epoch})")
        changes = config_changes(run.state.get("config") or {}, run.cfg)
        saved = run.state.get("train_data")  # None in checkpoints written before it was kept
        if saved is not None and saved != run.train_data:
            # said, not refused: adding data and training on is a choice, but never a silent one
            changes["training pairs"] = (
                f"{saved.get('pairs')} ({saved.get('digest', '')[:8]})",
                f"{run.train_data['pairs']} ({run.train_data['digest'][:8]})",
            )
        # every resume is a record: its "time" clock starts again at 0 (readers of the log add
        # the pieces), and a changed setting is allowed (e.g. a longer schedule) but kept
        resumed: dict[str, Any] = {"iteration": run.iteration, "resumed_from": str(run.resume_path)}
        if changes:
            said = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())
            run.log.notice(f"settings changed since that checkpoint: {said}")
            resumed["changed"] = {k: [a, b] for k, (a, b) in changes.items()}
        run.log.write(resumed)
    elif run.resume == "auto":
        say(f"no checkpoint in {run.out_dir}; starting a new run")
    if run.amp_dtype is not None:  # auto may pick it on a CPU: never silently
        kind = {torch.bfloat16: "bf16", torch.float16: "fp16"}[run.amp_dtype]
        run.log.message(
            f"training in {kind} autocast on {run.env.device.type} (train.amp {t.amp}; "
            "--train.amp none for fp32)"
        )


def _loop(run: _Run) -> None:
    """Epochs of :func:`train_one_epoch` until ``max_iters``, patience or a signal; a NaN loss
    keeps the last good checkpoint."""
    t = run.cfg.train
    run.consumed = run.sampler.offset
    run.started = time.perf_counter()
    run.clock = CheckpointClock(checkpoint_interval(t.ckpt_every, t.val_every), t.ckpt_minutes)
    assert run.log is not None and run.train_model is not None
    watched = monitored(t.monitor, has_val=run.val_loader is not None)
    stopped = run.state is not None and run.state.get("stop_reason") == "patience"
    same_watch = stopped and run.state.get("monitor") == watched  # type: ignore[union-attr]
    if same_watch and t.patience is not None and run.progress.bad_evals >= t.patience:
        # the checkpoint's run had stopped on patience: resuming it with the same patience
        # ends it again, rather than training on until one lucky validation resets the count
        run.stop_reason = "patience"
        run.log.notice(
            f"{run.resume_path} had stopped: {watched} had not improved for "
            f"{run.progress.bad_evals} evaluations (train.patience {t.patience}); raise "
            "--train.patience (or set it to null) to train on"
        )
    try:
        with run.interrupt:
            while run.iteration < t.max_iters and run.stop_reason == "max_iters":
                run.sampler.set_epoch(run.epoch)
                run.sampler.set_offset(run.consumed)
                try:
                    run.iteration = train_one_epoch(
                        run.train_model,
                        run.train_loader,
                        run.optimizer,
                        run.scheduler,
                        run.criterion,
                        device=run.env.device,
                        start_iteration=run.iteration,
                        max_iters=t.max_iters,
                        amp_dtype=run.amp_dtype,
                        scaler=run.scaler,
                        channels_last=run.channels_last,
                        clip_grad_norm=run.cfg.optim.clip_grad_norm,
                        interrupted=run.interrupt,
                        on_step=lambda s: _on_step(run, s),
                    )
                except RuntimeError:
                    # A signal can kill loader workers while the next batch is fetched: the
                    # model is intact at the last completed step, which we save below.
                    if not run.interrupt():
                        raise
                    run.stop_reason = "interrupted"
                    run.iteration = int(run.scheduler.last_epoch)
                    _save(run, "last", at=run.iteration)
                    break
                if run.iteration < t.max_iters and run.stop_reason == "max_iters":
                    run.epoch, run.consumed = run.epoch + 1, 0  # the epoch's batches are done
    except TrainingDivergedError as err:
        last = run.paths["last"]
        if run.replaced is not None:  # fit puts the --overwrite'd run back as this unwinds
            kept = f"no checkpoint yet: the run it was replacing is put back in {run.out_dir}"
        else:
            kept = f"the last good checkpoint is {last}" if last.exists() else "no checkpoint yet"
        raise TrainingDivergedError(f"{err}; {kept}") from None
    finally:
        run.log.close()


def _on_step(run: _Run, s: StepStats) -> bool:
    """After each step: log, validate / monitor, checkpoint; True to stop the loop."""
    t, progress, log = run.cfg.train, run.progress, run.log
    assert log is not None
    run.consumed += run.cfg.data.batch_size
    a, ema = t.loss_smoothing, progress.loss_ema
    progress.loss_ema = s.loss if ema is None else a * ema + (1 - a) * s.loss
    log.step(loss=s.loss, lr=s.lr)
    if s.iteration % t.log_every == 0 or s.iteration == 1:
        record = {"iteration": s.iteration, "epoch": run.epoch, "l1": s.l1, "l2": s.l2}
        record.update({"loss": s.loss, "loss_ema": progress.loss_ema, "lr": s.lr})
        record["time"] = round(time.perf_counter() - run.started, 3)
        echo = (
            None
            if log.bar is not None
            else (
                f"[{s.iteration}/{t.max_iters}] loss {s.loss:.4f} (L1 {s.l1:.4f} "
                f"L2 {s.l2:.4f}) lr {s.lr:.3g}"
            )
        )
        log.write(record, echo=echo)
    done = s.iteration >= t.max_iters
    is_best = False
    evaluated = (t.val_every > 0 and s.iteration % t.val_every == 0) or done
    watched = monitored(t.monitor, has_val=run.val_loader is not None)
    if evaluated:
        if run.val_loader is not None:
            is_best = _validate(run, s.iteration)
        if watched == "val_miou":
            progress.update_monitor(
                progress.last_val["miou"], higher_is_better=True, min_delta=t.min_delta
            )
        elif watched == "val_loss":
            progress.update_monitor(
                progress.last_val["loss"], higher_is_better=False, min_delta=t.min_delta
            )
        else:
            progress.update_monitor(
                progress.loss_ema, higher_is_better=False, min_delta=t.min_delta
            )
    if s.interrupted:
        run.stop_reason = "interrupted"
    elif t.patience is not None and progress.bad_evals >= t.patience:
        run.stop_reason = "patience"
        log.message(
            f"[{s.iteration}] stopping: {watched} has not improved for {t.patience} "
            f"evaluations (best {progress.best_monitored:.4f})"
        )
    stopping = done or run.stop_reason != "max_iters"
    assert run.clock is not None
    # best.pt before last.pt: last.pt records this model as the best, so a crash between the
    # two writes must leave the previous last.pt (whose resume redoes this validation), never
    # a last.pt vouching for a best.pt that was not written
    if is_best:
        _save(run, "best", at=s.iteration)
    if stopping or run.clock.due(s.iteration) or evaluated:
        _save(run, "last", at=s.iteration)
        run.clock.saved()
    return stopping


def monitored(monitor: str, *, has_val: bool) -> str:
    """The quantity S33's patience watches: ``monitor``, with ``"auto"`` resolved to
    ``val_loss`` when there is a validation split and ``train_loss`` otherwise."""
    if monitor == "auto":
        return "val_loss" if has_val else "train_loss"
    return monitor if has_val else "train_loss"


def _validate(run: _Run, at: int) -> bool:
    """Score the validation split; True on a new best mIoU."""
    from dualseg.engine.evaluation import evaluate

    broadcast_buffers(run.model)  # every rank scores rank 0's model (the checkpointed one)
    metrics = evaluate(
        run.model,
        run.val_loader,
        num_classes=run.meta.num_classes,
        ignore_index=run.meta.ignore_index,
        device=run.env.device,
        # bf16 autocast when training runs in bf16; an fp16 run validates in fp32 (a GPU
        # without bf16 is why auto picked fp16)
        amp=run.amp_dtype == torch.bfloat16,
        distributed=run.env.distributed,
    )
    progress = run.progress
    progress.last_val = {"iteration": at, **metrics}
    assert run.log is not None
    note = scored_classes_note(metrics, run.meta.class_names)
    echo = f"[{at}] val mIoU {100 * metrics['miou']:.1f}%{note}"
    record = _val_record(at, metrics)
    record["time"] = round(time.perf_counter() - run.started, 3)  # after the validation
    run.log.write(record, echo=echo)
    if metrics["miou"] > progress.best_miou:
        progress.best_miou, progress.best_iteration = float(metrics["miou"]), at
        return True
    return False


def _save(run: _Run, kind: str, *, at: int) -> None:
    """Write ``last.pt`` or ``best.pt`` (rank 0): everything a bit-exact resume needs."""
    if not run.env.is_main:
        return
    cfg, meta = run.cfg, run.meta
    ckpt_io.save_checkpoint(
        run.paths[kind],
        {
            "arch": cfg.model.arch,
            "model_kwargs": model_kwargs(cfg.model, meta.num_classes),
            "model": run.model.state_dict(),
            "optimizer": run.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(),
            "scaler": run.scaler.state_dict() if run.scaler is not None else {},
            "iteration": at,
            "epoch": run.epoch,
            "sampler": run.sampler.state_dict(epoch=run.epoch, offset=run.consumed),
            "rng": ckpt_io.capture_rng_state(),
            "config": config_to_dict(cfg),
            "class_names": list(meta.class_names),
            "palette": [list(c) for c in meta.palette],
            "ignore_index": meta.ignore_index,
            "train_data": run.train_data,
            "metrics": run.progress.last_val,
            "progress": run.progress.state_dict(),
            # why it stopped, and what patience watched: a resume stops again only after a
            # patience stop on the same monitor
            "stop_reason": run.stop_reason,
            "monitor": monitored(cfg.train.monitor, has_val=run.val_loader is not None),
        },
    )
    if run.replaced is not None:  # the new run can now be resumed: the old one goes
        discard_replaced(run.replaced)
        run.replaced = None


def _summary(run: _Run) -> dict[str, Any]:
    """The summary dict ``fit`` returns; rank 0 also draws the curves and prints one line."""
    barrier()
    progress, paths, out_dir = run.progress, run.paths, run.out_dir
    summary: dict[str, Any] = {
        "iteration": run.iteration,
        "epoch": run.epoch,
        "stop_reason": run.stop_reason,
        "best_miou": progress.best_miou if progress.best_miou >= 0 else None,
        "best_iteration": progress.best_iteration,
        "last": str(paths["last"]),
        "best": str(paths["best"]) if paths["best"].exists() else None,
        "out_dir": str(out_dir),
        "rank": run.env.rank,
    }
    if run.interrupt.signum is not None:
        summary["signal"] = int(run.interrupt.signum)
    if run.env.is_main:
        assert run.log is not None
        _save_curves(out_dir / "curves.png", run.log.history())
        run.log.message(
            f"stopped at iteration {run.iteration} ({run.stop_reason}); checkpoints in {out_dir}"
            + (
                f"; best val mIoU {100 * progress.best_miou:.1f}%"
                if progress.best_miou >= 0
                else ""
            )
        )
    return summary


def _save_curves(path: Path, history: list[dict[str, Any]]) -> None:
    """PNG of loss terms and validation mIoU (dualseg.viz); skipped when nothing was logged."""
    if not history:
        return
    from dualseg.viz import save_curves

    keys: list[Any] = [("loss", "l1", "loss_ema"), "l2"]
    ylabels = ["loss", "L2 weight penalty"]  # L2 on its own axis: it is orders smaller
    val = ("val_miou", "val_trimap_miou", "val_boundary_f1")
    if any("val_miou" in r for r in history):
        keys.append(val)
        ylabels.append("validation score (%)")
    names = {"l1": "L1 (cross-entropy)", "loss_ema": "loss (smoothed)", "l2": "L2"}
    names |= {"val_miou": "mIoU", "val_trimap_miou": "trimap mIoU", "val_boundary_f1": "bF1"}
    save_curves(path, history, keys, x_key="iteration", title="training", ylabels=ylabels,
                scale=dict.fromkeys(val, 100.0), names=names)  # fmt: skip
