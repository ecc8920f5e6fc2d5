"""One pass of SGD steps over a loader (spec S3): forward, the S32 loss, backward, update,
with the losses averaged over ranks and checked for NaN before the update."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dualseg.engine.distributed import all_reduce_sum
from dualseg.errors import DualsegError


class TrainingDivergedError(DualsegError):
    """The loss became NaN or infinite; the run stopped before applying that update."""


@dataclass
class StepStats:
    """What one training step reports (averaged over ranks)."""

    iteration: int  # iterations completed, after this step
    l1: float
    l2: float
    loss: float
    lr: float
    interrupted: bool  # some rank received SIGINT / SIGTERM


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
    """Train over ``loader`` once (or until ``max_iters`` / ``on_step`` returns True); returns
    the iteration reached. On CPU bf16, pass a model prepared by ``convs_in_fp32``."""
    model.train()
    iteration = start_iteration
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    autocast = torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)
    for images, labels in loader:
        if max_iters is not None and iteration >= max_iters:
            break
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with autocast:
            logits = model(images)
        loss, parts = criterion(logits, labels)  # float32, outside autocast
        optimizer.zero_grad(set_to_none=True)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        # [l1, l2, loss, stop], averaged so every rank takes the same decisions
        stop = torch.tensor([1.0 if interrupted() else 0.0], device=device)
        vec = torch.stack([parts["l1"], parts["l2"].to(device), parts["loss"]]).float()
        values = (all_reduce_sum(torch.cat([vec, stop])) / world).tolist()
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
