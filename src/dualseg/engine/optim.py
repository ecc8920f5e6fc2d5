"""SGD without weight decay of its own (S32's L2 is in the objective) and the poly LR
l_t = l_0·(1 − t/T)^power (spec S33, claim 5), with an optional warm-up and head LR."""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.optim import SGD, Optimizer
from torch.optim.lr_scheduler import LambdaLR


def param_groups(model: nn.Module, *, lr: float, head_lr_mult: float = 1.0) -> list[dict]:
    """One group, or backbone (lr) + head (everything else: lr·head_lr_mult)."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if head_lr_mult == 1.0:
        return [{"params": [p for _, p in params], "lr": lr, "name": "all"}]
    backbone = [p for n, p in params if "backbone" in n.split(".")]
    head = [p for n, p in params if "backbone" not in n.split(".")]
    groups = [
        {"params": backbone, "lr": lr, "name": "backbone"},
        {"params": head, "lr": lr * head_lr_mult, "name": "head"},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    momentum: float = 0.9,
    nesterov: bool = False,
    head_lr_mult: float = 1.0,
) -> Optimizer:
    """SGD, weight_decay 0 (S32's L2 is an explicit loss term)."""
    groups = param_groups(model, lr=lr, head_lr_mult=head_lr_mult)
    return SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=0.0)


def poly_factor(
    t: int,
    *,
    max_iters: int,
    power: float = 0.9,
    warmup_iters: int = 0,
    warmup_factor: float = 0.1,
) -> float:
    """l_t / l_0 at iteration ``t`` (0-based): (1 − t/T)^power, times a linear warm-up ramp."""
    factor = max(0.0, 1.0 - t / max_iters) ** power
    if t < warmup_iters:
        factor *= warmup_factor + (1.0 - warmup_factor) * t / warmup_iters
    return factor


def build_scheduler(
    optimizer: Optimizer,
    *,
    max_iters: int,
    power: float = 0.9,
    warmup_iters: int = 0,
    warmup_factor: float = 0.1,
) -> LambdaLR:
    """Poly LR (claim 5) as a per-iteration ``LambdaLR``; its state dict is plain numbers."""
    schedule = {"power": power, "warmup_iters": warmup_iters, "warmup_factor": warmup_factor}
    return LambdaLR(optimizer, partial(poly_factor, max_iters=max_iters, **schedule))
