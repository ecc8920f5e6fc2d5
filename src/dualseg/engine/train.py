"""Training loop (spec S3): ``fit(cfg)``, SGD steps until ``max_iters`` (T of the poly
schedule) or S33's patience; validation and ``best.pt`` / ``last.pt`` every ``val_every``
iterations. A checkpoint holds everything ``--resume`` needs to continue bit-identically."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader

from dualseg.console import progress_mode
from dualseg.data.contract import LabelContract, content_digests
from dualseg.engine import checkpoint as ckpt_io
from dualseg.engine.config import save_config
from dualseg.engine.cpu_bf16 import amp_dtype_for, convs_in_fp32
from dualseg.engine.distributed import (
    DistEnv,
    ResumableSampler,
    barrier,
    broadcast_buffers,
    cleanup_distributed,
    init_distributed,
)
from dualseg.engine.evaluation import evaluate
from dualseg.engine.losses import SegmentationLoss, class_weights_for
from dualseg.engine.optim import build_optimizer, build_scheduler
from dualseg.engine.options import Config, config_changes, config_to_dict, model_kwargs
from dualseg.engine.preflight import (
    baseline_note,
    build_datasets,
    build_loaders,
    build_train_model,
    check_training_data,
    refuse_rewind,
    scored_classes_note,
    seed_everything,
)
from dualseg.engine.rundir import (
    CheckpointClock,
    check_not_in_use,
    check_run_dir,
    clear_run_dir,
    hold_run_folder,
)
from dualseg.engine.runlog import Interrupt, Progress, RunLog, save_curves, train_data_record
from dualseg.engine.step import StepStats, TrainingDivergedError, train_one_epoch
from dualseg.errors import CheckpointError, ConfigError


@dataclass
class _Run:
    """Everything one ``fit`` holds; the loop's functions read and update it."""

    cfg: Config
    env: DistEnv
    resume: str | None
    resume_path: Path | None
    state: dict[str, Any] | None  # the checkpoint resumed from
    meta: Any  # DatasetMeta of the training set
    train_data: dict[str, Any]  # which pairs the training split holds
    train_images: Any  # content digests of the training images (rank 0; eval warns on them)
    train_loader: DataLoader
    sampler: ResumableSampler
    val_loader: DataLoader | None
    model: nn.Module  # un-wrapped: checkpoints, validation
    criterion: SegmentationLoss
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    scaler: torch.amp.GradScaler | None
    amp_dtype: torch.dtype | None
    progress: Progress = field(default_factory=Progress)
    train_model: nn.Module | None = None  # DDP-wrapped and/or compiled
    log: RunLog | None = None
    interrupt: Interrupt = field(default_factory=Interrupt)
    iteration: int = 0
    epoch: int = 0
    consumed: int = 0  # samples of this epoch already trained on (this rank)
    stop_reason: str = "max_iters"
    started: float = 0.0
    clock: CheckpointClock | None = None

    @property
    def out_dir(self) -> Path:
        return Path(self.cfg.train.out_dir)

    @property
    def paths(self) -> dict[str, Path]:
        return {"last": self.out_dir / ckpt_io.LAST_NAME, "best": self.out_dir / ckpt_io.BEST_NAME}

    @property
    def watched(self) -> str:
        """The quantity S33's patience watches (``auto``: val_loss with a val split)."""
        monitor, has_val = self.cfg.train.monitor, self.val_loader is not None
        return ("val_loss" if monitor == "auto" else monitor) if has_val else "train_loss"


def fit(cfg: Config, *, resume: str | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Train ``cfg`` (under ``torchrun``: one process per GPU); returns a summary dict
    (``iteration``, ``stop_reason``, ``best_miou``, ``last``, ``best``, ...). ``resume``: a
    checkpoint, or ``"auto"`` for ``<out_dir>/last.pt``; a folder holding another run is
    refused unless ``overwrite`` (its files go right before the first write)."""
    env = init_distributed(cfg.train.device)
    try:
        t = cfg.train
        if t.threads > 0:
            torch.set_num_threads(t.threads)
        check_run_dir(t.out_dir, resume=resume, overwrite=overwrite)
        check_not_in_use(t.out_dir)
        if not overwrite:
            refuse_rewind(Path(t.out_dir), resume)
        shown = env.is_main and t.progress and not t.quiet
        check_training_data(cfg.data, progress=progress_mode(quiet=not shown), warn=env.is_main)
        run = _build(cfg, env, resume)
        if run.state is not None:
            _resume(run)
        with hold_run_folder(run.out_dir) if env.is_main else contextlib.nullcontext():
            _start(run, overwrite)
            _loop(run)
            return _summary(run)
    finally:
        cleanup_distributed()


def _build(cfg: Config, env: DistEnv, resume: str | None) -> _Run:
    """Datasets, loaders, model, loss, optimizer, schedule, scaler (this order fixes the RNG)."""
    t, o, device = cfg.train, cfg.optim, env.device
    seed_everything(t.seed, t.deterministic, device)
    train_ds, val_ds = build_datasets(cfg)
    meta = train_ds.meta
    train_loader, sampler, val_loader = build_loaders(cfg, env, train_ds, val_ds)
    resume_path = None if resume in (None, "auto") else Path(resume)
    if resume == "auto" and (last := Path(t.out_dir, ckpt_io.LAST_NAME)).is_file():
        resume_path = last  # else a new run, said in _start
    state = None if resume_path is None else ckpt_io.load_checkpoint(resume_path)
    if state is not None:
        ckpt_io.check_compatible(
            state, arch=cfg.model.arch, num_classes=meta.num_classes, class_names=meta.class_names
        )
        if "optimizer" not in state or "rng" not in state:
            raise CheckpointError(
                f"{resume_path} holds model weights without the training state a resume needs; "
                "resume from the run's last.pt"
            )
        if isinstance(done := state.get("iteration"), int) and done > t.max_iters:
            raise ConfigError(
                f"{resume_path} is at iteration {done}, past train.max_iters {t.max_iters}: "
                f"pass --train.max_iters {done} or more to resume it"
            )
    model = build_train_model(cfg, meta.num_classes, pretrained=state is None)
    if env.distributed and t.sync_bn and device.type == "cuda":
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    amp_dtype = amp_dtype_for(t.amp, device)
    if t.channels_last:
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
        cfg, env, resume, resume_path, state, meta, train_data_record(train_ds.samples),
        content_digests(image for image, _ in train_ds.samples) if env.is_main else None,
        train_loader, sampler, val_loader, model, criterion, optimizer, scheduler, scaler,
        amp_dtype,
    )  # fmt: skip


def _resume(run: _Run) -> None:
    """Continue the checkpoint's run exactly, or one :class:`CheckpointError` naming what
    changed since it."""
    state, changed = run.state or {}, ""
    fix = "resume with its settings, or start a new run (another --train.out_dir, or --overwrite)"
    try:
        changes = config_changes(state.get("config") or {}, run.cfg).items()
        changed = "; ".join(
            f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes if k.startswith(("model.", "optim."))
        )
        _restore(run, state)
    except CheckpointError as err:
        if not changed:
            raise
        raise CheckpointError(f"{err} (changed since that checkpoint: {changed}); {fix}") from None
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        what = f"changed since that checkpoint: {changed}" if changed else f"{err!r}"
        raise CheckpointError(
            f"{run.resume_path} is a damaged training checkpoint, or of other settings "
            f"({' '.join(what.split())}); {fix}"
        ) from None


def _restore(run: _Run, state: dict) -> None:
    ckpt_io.load_model_state(run.model, state)
    base_lrs = list(run.scheduler.base_lrs)  # this run's schedule, at the resumed iteration
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.scheduler.base_lrs = base_lrs
    at, o = run.scheduler.last_epoch, run.cfg.optim
    for group, base, factor in zip(run.optimizer.param_groups, base_lrs, run.scheduler.lr_lambdas):
        group["initial_lr"], group["lr"] = base, base * factor(at)
        group["momentum"], group["nesterov"] = o.momentum, o.nesterov
    run.scheduler._last_lr = [g["lr"] for g in run.optimizer.param_groups]
    if run.scaler is not None and state["scaler"]:
        run.scaler.load_state_dict(state["scaler"])
    run.sampler.load_state_dict(state["sampler"])
    run.progress.load_state_dict(state["progress"])
    run.progress.last_val = dict(state["metrics"] or {})
    run.iteration, run.epoch = int(state["iteration"]), int(state["epoch"])
    ckpt_io.restore_rng_state(state["rng"])


def _start(run: _Run, overwrite: bool) -> None:
    """Wrap the model (DDP, compile), clear the run folder, write the config, open the log and
    say what a resume continues or changes."""
    t, env = run.cfg.train, run.env
    run.train_model = run.model
    if env.distributed:
        ids = [env.device.index] if env.device.type == "cuda" else None
        run.train_model = nn.parallel.DistributedDataParallel(run.model, device_ids=ids)
    if t.compile:
        run.train_model = torch.compile(run.train_model)
    if env.is_main:  # the first write: every check has passed
        clear_run_dir(run.out_dir, resume=run.resume, overwrite=overwrite)
        run.out_dir.mkdir(parents=True, exist_ok=True)
        save_config(run.cfg, run.out_dir / "config.yaml")
    run.log = RunLog(run.cfg, env, run.out_dir, run.iteration)
    auto = run.resume == "auto"  # said even when quiet
    if run.state is not None:
        run.log.message(f"resumed from {run.resume_path} at iteration {run.iteration}", always=auto)
        changes = config_changes(run.state.get("config") or {}, run.cfg)
        saved = run.state.get("train_data")
        if saved != run.train_data:  # said, not refused: adding data and training on is fine
            changes["training pairs"] = (
                f"{saved['pairs']} ({saved['digest'][:8]})",
                f"{run.train_data['pairs']} ({run.train_data['digest'][:8]})",
            )
        resumed: dict[str, Any] = {"iteration": run.iteration, "resumed_from": str(run.resume_path)}
        if changes:
            said = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())
            run.log.message(f"settings changed since that checkpoint: {said}", always=True)
            resumed["changed"] = {k: [a, b] for k, (a, b) in changes.items()}
        run.log.write(resumed)
    elif run.resume == "auto":
        run.log.message(f"no checkpoint in {run.out_dir}; starting a new run", always=True)
    if run.amp_dtype is not None:  # auto may pick it on a CPU: never silently
        kind = {torch.bfloat16: "bf16", torch.float16: "fp16"}[run.amp_dtype]
        run.log.message(
            f"training in {kind} autocast on {env.device.type} (train.amp {t.amp}; "
            "--train.amp none for fp32)"
        )


def _loop(run: _Run) -> None:
    """Epochs of :func:`train_one_epoch` until ``max_iters``, patience or a signal."""
    t, log = run.cfg.train, run.log
    assert log is not None and run.train_model is not None
    run.consumed, run.started = run.sampler.offset, time.perf_counter()
    run.clock = CheckpointClock(t.ckpt_every or t.val_every or 1000, t.ckpt_minutes)
    state = run.state or {}
    if (
        state.get("stop_reason") == "patience"
        and state.get("monitor") == run.watched
        and t.patience is not None
        and run.progress.bad_evals >= t.patience
    ):  # the same patience ends it again
        run.stop_reason = "patience"
        log.message(
            f"{run.resume_path} had stopped on patience; raise --train.patience", always=True
        )
    try:
        with run.interrupt:
            while run.iteration < t.max_iters and run.stop_reason == "max_iters":
                run.sampler.set_epoch(run.epoch)
                run.sampler.set_offset(run.consumed)
                try:
                    run.iteration = train_one_epoch(
                        run.train_model, run.train_loader, run.optimizer, run.scheduler,
                        run.criterion, device=run.env.device, start_iteration=run.iteration,
                        max_iters=t.max_iters, amp_dtype=run.amp_dtype, scaler=run.scaler,
                        channels_last=t.channels_last,
                        clip_grad_norm=run.cfg.optim.clip_grad_norm,
                        interrupted=run.interrupt, on_step=lambda s: _on_step(run, s),
                    )  # fmt: skip
                except RuntimeError:  # a signal killed a loader worker: save the last step
                    if not run.interrupt():
                        raise
                    run.stop_reason = "interrupted"
                    run.iteration = int(run.scheduler.last_epoch)
                    _save(run, "last", at=run.iteration)
                    break
                if run.iteration < t.max_iters and run.stop_reason == "max_iters":
                    run.epoch, run.consumed = run.epoch + 1, 0
    except TrainingDivergedError as err:
        last = run.paths["last"]
        kept = f"the last good checkpoint is {last}" if last.exists() else "no checkpoint yet"
        raise TrainingDivergedError(f"{err}; {kept}") from None
    finally:
        log.close()


def _on_step(run: _Run, s: StepStats) -> bool:
    """After each step: log, validate / monitor, checkpoint; True to stop the loop."""
    t, progress, log = run.cfg.train, run.progress, run.log
    assert log is not None and run.clock is not None
    run.consumed += run.cfg.data.batch_size
    a, ema = t.loss_smoothing, progress.loss_ema
    progress.loss_ema = s.loss if ema is None else a * ema + (1 - a) * s.loss
    log.step(loss=s.loss, lr=s.lr)
    if s.iteration % t.log_every == 0 or s.iteration == 1:
        record = {"iteration": s.iteration, "epoch": run.epoch, "l1": s.l1, "l2": s.l2}
        record |= {"loss": s.loss, "loss_ema": progress.loss_ema, "lr": s.lr}
        record["time"] = round(time.perf_counter() - run.started, 3)
        echo = f"[{s.iteration}/{t.max_iters}] loss {s.loss:.4f} (L1 {s.l1:.4f} L2 {s.l2:.4f}) "
        log.write(record, echo=None if log.bar is not None else f"{echo}lr {s.lr:.3g}")
    done = s.iteration >= t.max_iters
    evaluated = (t.val_every > 0 and s.iteration % t.val_every == 0) or done
    is_best = False
    if evaluated:
        if run.val_loader is not None:
            is_best = _validate(run, s.iteration)
        value = {"val_miou": "miou", "val_loss": "loss"}.get(run.watched)
        watched = progress.last_val[value] if value else progress.loss_ema
        progress.update_monitor(watched, higher_is_better=value == "miou", min_delta=t.min_delta)
    if s.interrupted:
        run.stop_reason = "interrupted"
    elif t.patience is not None and progress.bad_evals >= t.patience:
        run.stop_reason = "patience"
        log.message(
            f"[{s.iteration}] stopping: {run.watched} has not improved for {t.patience} "
            f"evaluations (best {progress.best_monitored:.4f})"
        )
    stopping = done or run.stop_reason != "max_iters"
    # best.pt first: a last.pt never vouches for a best.pt that was not written
    if is_best:
        _save(run, "best", at=s.iteration)
    if stopping or run.clock.due(s.iteration) or evaluated:
        _save(run, "last", at=s.iteration)
        run.clock.saved()
    return stopping


def _validate(run: _Run, at: int) -> bool:
    """Score the validation split; True on a new best mIoU."""
    broadcast_buffers(run.model)  # every rank scores rank 0's model (the checkpointed one)
    metrics = evaluate(
        run.model,
        run.val_loader,
        num_classes=run.meta.num_classes,
        ignore_index=run.meta.ignore_index,
        device=run.env.device,
        amp=run.amp_dtype == torch.bfloat16,  # fp16 runs validate in fp32
        distributed=run.env.distributed,
    )
    run.progress.last_val = {"iteration": at, **metrics}
    names = run.meta.class_names
    note = baseline_note(metrics, names)
    echo = f"[{at}] val mIoU {100 * metrics['miou']:.1f}%{scored_classes_note(metrics, names)}"
    keys = ("miou", "pixel_acc", "mean_acc", "fwiou", "boundary_f1", "trimap_miou", "loss", "iou")
    record = {"iteration": at, **{f"val_{k}": metrics[k] for k in keys}}
    record["val_baseline_miou"] = metrics["majority_baseline_miou"]
    record["time"] = round(time.perf_counter() - run.started, 3)
    assert run.log is not None
    run.log.write(record, echo=f"{echo}{note}")
    if metrics["miou"] > run.progress.best_miou:
        run.progress.best_miou, run.progress.best_iteration = float(metrics["miou"]), at
        return True
    return False


def _save(run: _Run, kind: str, *, at: int) -> None:
    """Write ``last.pt`` or ``best.pt`` (rank 0)."""
    if not run.env.is_main:
        return
    cfg, meta = run.cfg, run.meta
    contract = LabelContract(meta, cfg.data.label_format, cfg.data.bit_depth)
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
            "label_contract": contract.to_dict(),
            "train_data": run.train_data,
            "train_images": run.train_images,
            "metrics": run.progress.last_val,
            "progress": run.progress.state_dict(),
            "stop_reason": run.stop_reason,
            "monitor": run.watched,
        },
    )


def _summary(run: _Run) -> dict[str, Any]:
    """The summary ``fit`` returns; rank 0 also draws the curves and prints one line."""
    barrier()
    best_miou, paths = run.progress.best_miou, run.paths
    summary: dict[str, Any] = {
        "iteration": run.iteration,
        "epoch": run.epoch,
        "stop_reason": run.stop_reason,
        "best_miou": best_miou if best_miou >= 0 else None,
        "best_iteration": run.progress.best_iteration,
        "last": str(paths["last"]),
        "best": str(paths["best"]) if paths["best"].exists() else None,
        "out_dir": str(run.out_dir),
        "rank": run.env.rank,
    }
    if run.interrupt.signum is not None:
        summary["signal"] = int(run.interrupt.signum)
    if run.env.is_main:
        assert run.log is not None
        save_curves(run.out_dir / "curves.png", run.log.history())
        best = f"; best val mIoU {100 * best_miou:.1f}%" if best_miou >= 0 else ""
        run.log.message(
            f"stopped at iteration {run.iteration} ({run.stop_reason}); checkpoints in "
            f"{run.out_dir}{best}"
        )
    return summary
