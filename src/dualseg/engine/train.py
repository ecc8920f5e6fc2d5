"""Training loop (spec S3): ``fit(cfg)`` and its inner ``train_one_epoch``.

One iteration = one SGD step on one batch (per process). The loop runs until ``max_iters``
(the T of the poly schedule), or earlier when the monitored quantity — validation mIoU or the
smoothed training loss — has not improved for ``patience`` evaluations (S33 Reading).

Every ``val_every`` iterations: validation (mIoU, per-class IoU, boundary scores via
:func:`dualseg.engine.evaluate.evaluate`), then ``last.pt`` and, on a new best mIoU, ``best.pt``.
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
import json
import math
import os
import random
import signal
import sys
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
from dualseg.engine import checkpoint as ckpt_io
from dualseg.engine.config import Config, DataConfig, config_to_dict, model_kwargs, save_config
from dualseg.engine.config import validate as validate_config
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
from dualseg.engine.rundir import CheckpointClock, checkpoint_interval, prepare_run_dir
from dualseg.errors import ConfigError, DataError, DualsegError
from dualseg.io import atomic_write_text

__all__ = ["TrainingDivergedError", "fit", "train_one_epoch"]


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
    interrupted: Callable[[], bool] = lambda: False,
    on_step: Callable[[StepStats], bool] | None = None,
) -> int:
    """Train over ``loader`` once (or until ``max_iters`` / ``on_step`` returns True).

    ``model`` may be DDP-wrapped or compiled. After each step the losses are averaged over
    ranks (one small ``all_reduce``), checked for NaN/inf *before* the optimizer applies the
    update, and passed to ``on_step`` — which does logging, validation and checkpoints and
    returns True to stop. Returns the iteration count reached.
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
class _Interrupt:
    """Turns SIGINT / SIGTERM into a flag checked after each step (then save and return)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __call__(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:  # second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> _Interrupt:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: leave handlers alone
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


@dataclass
class _Progress:
    """Loop state beyond weights: best score, patience counter, smoothed loss."""

    best_miou: float = -1.0
    best_iteration: int = 0
    best_monitored: float | None = None
    bad_evals: int = 0
    loss_ema: float | None = None
    last_val: dict[str, Any] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {
            "best_miou": self.best_miou,
            "best_iteration": self.best_iteration,
            "best_monitored": self.best_monitored,
            "bad_evals": self.bad_evals,
            "loss_ema": self.loss_ema,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        for key, value in d.items():
            setattr(self, key, value)

    def update_monitor(self, value: float, *, higher_is_better: bool, min_delta: float) -> bool:
        """Record one evaluation of the monitored quantity; True when it improved."""
        best = self.best_monitored
        improved = (
            best is None
            or (higher_is_better and value > best + min_delta)
            or (not higher_is_better and value < best - min_delta)
        )
        if improved:
            self.best_monitored, self.bad_evals = value, 0
        else:
            self.bad_evals += 1
        return improved


class _RunLog:
    """Rank-0 outputs: JSONL records, TensorBoard scalars, a tqdm bar or plain lines."""

    def __init__(self, cfg: Config, env: DistEnv, out_dir: Path, start: int) -> None:
        self.enabled = env.is_main
        self.quiet = cfg.train.quiet  # metrics.jsonl and TensorBoard only
        self.path = out_dir / "metrics.jsonl"
        self.tb = None
        self.bar = None
        if not self.enabled:
            return
        self._truncate(start)
        if cfg.train.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out_dir), purge_step=start or None)
            except ImportError:  # tensorboard not installed: JSONL and PNG only
                self.tb = None
        if cfg.train.progress and not self.quiet and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=cfg.train.max_iters, initial=start, desc="train", unit="it")

    def _truncate(self, start: int) -> None:
        """Drop records past the resumed iteration (written after the checkpoint, then lost)."""
        if not self.path.exists():
            return
        keep = [r for r in self.history() if r.get("iteration", 0) <= start]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in keep))

    def history(self) -> list[dict[str, Any]]:
        records = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    records.append(json.loads(line))
        return records

    def write(self, record: dict[str, Any], *, echo: str | None = None) -> None:
        if not self.enabled:
            return
        # Append-only log: a line cut by a crash is skipped when read back.
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for key, value in record.items():
                if key != "iteration" and isinstance(value, int | float):
                    self.tb.add_scalar(key.replace("_", "/", 1), value, record["iteration"])
        if echo:
            self.message(echo)

    def step(self, n: int = 1, **postfix: float) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix({k: f"{v:.4f}" for k, v in postfix.items()}, refresh=False)

    def message(self, text: str) -> None:
        if not self.enabled or self.quiet:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


def _seed_everything(seed: int, deterministic: bool, device: torch.device) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = not deterministic
        if deterministic:  # CPU kernels are deterministic already (and this import is slow)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)


def _amp_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    if device.type != "cuda":
        if mode in ("bf16", "fp16"):
            raise ConfigError(f"train.amp={mode} needs a GPU; use --train.amp none on CPU")
        return None
    if mode == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]


def train_transform(d: DataConfig) -> Any:
    """The training augmentation (spec S1) that ``d`` describes."""
    from dualseg.data.transforms import build_train_transform

    return build_train_transform(
        crop_size=tuple(d.crop_size),
        scale_range=tuple(d.scale_range),
        hflip_prob=d.hflip_prob,
        blur_prob=d.blur_prob,
        jitter=(d.jitter, d.jitter, d.jitter, 0.0),  # brightness, contrast, saturation; no hue
    )


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
        )
    return train_loader, sampler, val_loader


def _build_model(cfg: Config, num_classes: int, *, pretrained: bool) -> nn.Module:
    from dualseg.models import build_model

    kwargs = model_kwargs(cfg.model, num_classes)
    for key, value in kwargs.items():
        if isinstance(value, list):
            kwargs[key] = tuple(value)
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
    for key in ("miou", "pixel_acc", "mean_acc", "fwiou", "boundary_f1", "trimap_miou"):
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

    A ``train.out_dir`` that already holds a run is refused unless ``resume`` is given or
    ``overwrite=True`` (which removes the old run's files first).
    """
    validate_config(cfg)  # also for a Config built in Python rather than parsed
    env = init_distributed(cfg.train.device)
    try:
        return _fit(cfg, env, resume, overwrite)
    finally:
        cleanup_distributed()


def _fit(cfg: Config, env: DistEnv, resume: str | None, overwrite: bool) -> dict[str, Any]:
    t = cfg.train
    out_dir = Path(t.out_dir)
    device = env.device
    if t.threads > 0:
        torch.set_num_threads(t.threads)
    prepare_run_dir(out_dir, resuming=resume is not None, overwrite=overwrite, is_main=env.is_main)
    shown = env.is_main and t.progress and not t.quiet
    check_training_data(cfg.data, progress=progress_mode(quiet=not shown), warn=env.is_main)
    warn_missing_tensorboard(t.tensorboard and env.is_main)
    _seed_everything(t.seed, t.deterministic, device)

    train_ds, val_ds = _build_datasets(cfg)
    meta = train_ds.meta
    num_classes = meta.num_classes
    train_loader, sampler, val_loader = _build_loaders(cfg, env, train_ds, val_ds)

    resume_path = _resolve_resume(resume, out_dir)
    state = ckpt_io.load_checkpoint(resume_path) if resume_path is not None else None
    if state is not None:
        ckpt_io.check_compatible(state, arch=cfg.model.arch, num_classes=num_classes)

    model = _build_model(cfg, num_classes, pretrained=state is None)
    if env.distributed and t.sync_bn and device.type == "cuda":  # SyncBatchNorm is GPU-only
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    amp_dtype = _amp_dtype(t.amp, device)
    channels_last = t.channels_last and device.type == "cuda"
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    criterion = SegmentationLoss(
        model,
        weight_decay=cfg.optim.weight_decay,
        l2_lambda=cfg.optim.l2_lambda,
        ignore_index=meta.ignore_index,
        class_weights=class_weights_for(cfg.optim.class_weights, num_classes, train_ds),
        ohem_thresh=cfg.optim.ohem_thresh,
        ohem_min_kept=cfg.optim.ohem_min_kept,
    )
    o = cfg.optim
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
    progress = _Progress()

    iteration, epoch = 0, 0
    if state is not None:
        ckpt_io.load_model_state(model, state)
        base_lrs = list(scheduler.base_lrs)  # from this run's config
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        _apply_schedule(optimizer, scheduler, base_lrs)
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        sampler.load_state_dict(state["sampler"])
        progress.load_state_dict(state.get("progress") or {})
        progress.last_val = dict(state.get("metrics") or {})
        iteration, epoch = int(state["iteration"]), int(state["epoch"])
        ckpt_io.restore_rng_state(state["rng"])

    train_model: nn.Module = model
    if env.distributed:
        ids = [device.index] if device.type == "cuda" else None
        train_model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if t.compile:
        train_model = torch.compile(train_model)
    raw_model = model  # un-wrapped: checkpoints, validation

    if env.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out_dir / "config.yaml")
    log = _RunLog(cfg, env, out_dir, iteration)
    if state is not None:
        log.message(f"resumed from {resume_path} at iteration {iteration} (epoch {epoch})")
    elif resume == "auto":
        log.message(f"no checkpoint in {out_dir}; starting a new run")

    paths = {"last": out_dir / ckpt_io.LAST_NAME, "best": out_dir / ckpt_io.BEST_NAME}
    clock = CheckpointClock(checkpoint_interval(t.ckpt_every, t.val_every), t.ckpt_minutes)

    def save(kind: str, *, at: int, ep: int, offset: int) -> None:
        if not env.is_main:
            return
        ckpt_io.save_checkpoint(
            paths[kind],
            {
                "arch": cfg.model.arch,
                "model_kwargs": model_kwargs(cfg.model, num_classes),
                "model": raw_model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else {},
                "iteration": at,
                "epoch": ep,
                "sampler": {"epoch": ep, "offset": offset},
                "rng": ckpt_io.capture_rng_state(),
                "config": config_to_dict(cfg),
                "class_names": list(meta.class_names),
                "palette": [list(c) for c in meta.palette],
                "ignore_index": meta.ignore_index,
                "metrics": progress.last_val,
                "progress": progress.state_dict(),
            },
        )

    def validate(at: int) -> bool:
        """Score the validation split; True on a new best mIoU."""
        from dualseg.engine.evaluate import evaluate

        broadcast_buffers(raw_model)  # every rank scores rank 0's model (the checkpointed one)
        metrics = evaluate(
            raw_model,
            val_loader,
            num_classes=num_classes,
            ignore_index=meta.ignore_index,
            device=device,
            amp=amp_dtype is not None,
            distributed=env.distributed,
        )
        progress.last_val = {"iteration": at, **metrics}
        record = _val_record(at, metrics)
        note = scored_classes_note(metrics, meta.class_names)
        log.write(record, echo=f"[{at}] val mIoU {metrics['miou']:.4f}{note}")
        if metrics["miou"] > progress.best_miou:
            progress.best_miou, progress.best_iteration = float(metrics["miou"]), at
            return True
        return False

    stop_reason = "max_iters"
    consumed = sampler.offset  # samples of this epoch already trained on (this rank)
    started = time.perf_counter()

    def on_step(s: StepStats) -> bool:
        nonlocal consumed, stop_reason
        consumed += cfg.data.batch_size
        a, ema = t.loss_smoothing, progress.loss_ema
        progress.loss_ema = s.loss if ema is None else a * ema + (1 - a) * s.loss
        log.step(loss=s.loss, lr=s.lr)
        if s.iteration % t.log_every == 0 or s.iteration == 1:
            record = {"iteration": s.iteration, "epoch": epoch, "l1": s.l1, "l2": s.l2}
            record.update({"loss": s.loss, "loss_ema": progress.loss_ema, "lr": s.lr})
            record["time"] = round(time.perf_counter() - started, 3)
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
        if evaluated:
            if val_loader is not None:
                is_best = validate(s.iteration)
            if t.monitor == "val_miou" and val_loader is not None:
                progress.update_monitor(
                    progress.last_val["miou"], higher_is_better=True, min_delta=t.min_delta
                )
            else:
                progress.update_monitor(
                    progress.loss_ema, higher_is_better=False, min_delta=t.min_delta
                )
        if s.interrupted:
            stop_reason = "interrupted"
        elif t.patience is not None and progress.bad_evals >= t.patience:
            stop_reason = "patience"
            log.message(
                f"[{s.iteration}] stopping: {t.monitor} has not improved for {t.patience} "
                f"evaluations (best {progress.best_monitored:.4f})"
            )
        stopping = done or stop_reason != "max_iters"
        if stopping or clock.due(s.iteration) or evaluated:
            save("last", at=s.iteration, ep=epoch, offset=consumed)
            clock.saved()
        if is_best:
            save("best", at=s.iteration, ep=epoch, offset=consumed)
        return stopping

    interrupt = _Interrupt()
    try:
        with interrupt:
            while iteration < t.max_iters and stop_reason == "max_iters":
                sampler.set_epoch(epoch)
                sampler.set_offset(consumed)
                try:
                    iteration = train_one_epoch(
                        train_model,
                        train_loader,
                        optimizer,
                        scheduler,
                        criterion,
                        device=device,
                        start_iteration=iteration,
                        max_iters=t.max_iters,
                        amp_dtype=amp_dtype,
                        scaler=scaler,
                        channels_last=channels_last,
                        interrupted=interrupt,
                        on_step=on_step,
                    )
                except RuntimeError:
                    # A signal can kill loader workers while the next batch is fetched: the
                    # model is intact at the last completed step, which we save below.
                    if not interrupt():
                        raise
                    stop_reason = "interrupted"
                    iteration = int(scheduler.last_epoch)
                    save("last", at=iteration, ep=epoch, offset=consumed)
                    break
                if iteration < t.max_iters and stop_reason == "max_iters":
                    epoch, consumed = epoch + 1, 0  # the epoch's batches are exhausted
    except TrainingDivergedError as err:
        last = paths["last"]
        kept = f"the last good checkpoint is {last}" if last.exists() else "no checkpoint yet"
        raise TrainingDivergedError(f"{err}; {kept}") from None
    finally:
        log.close()

    barrier()
    summary: dict[str, Any] = {
        "iteration": iteration,
        "epoch": epoch,
        "stop_reason": stop_reason,
        "best_miou": progress.best_miou if progress.best_miou >= 0 else None,
        "best_iteration": progress.best_iteration,
        "last": str(paths["last"]),
        "best": str(paths["best"]) if paths["best"].exists() else None,
        "out_dir": str(out_dir),
        "rank": env.rank,
    }
    if interrupt.signum is not None:
        summary["signal"] = int(interrupt.signum)
    if env.is_main:
        _save_curves(out_dir / "curves.png", log.history())
        log.message(
            f"stopped at iteration {iteration} ({stop_reason}); checkpoints in {out_dir}"
            + (f"; best val mIoU {progress.best_miou:.4f}" if progress.best_miou >= 0 else "")
        )
    return summary


def _save_curves(path: Path, history: list[dict[str, Any]]) -> None:
    """PNG of loss terms and validation mIoU (dualseg.viz); skipped when nothing was logged."""
    if not history:
        return
    from dualseg.viz import save_curves

    keys: list[Any] = [("loss", "l1", "loss_ema"), "l2"]
    if any("val_miou" in r for r in history):
        keys.append(("val_miou", "val_trimap_miou", "val_boundary_f1"))
    save_curves(path, history, keys, x_key="iteration", title="training")
