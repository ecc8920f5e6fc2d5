"""SGD + poly LR (claim 5), warm-up, 10x head LR, and schedule state through a checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dualseg.engine.checkpoint import load_checkpoint, save_checkpoint
from dualseg.engine.optim import build_optimizer, build_scheduler, param_groups, poly_factor
from dualseg.models import build_model


def test_poly_factor_follows_claim_5() -> None:
    assert poly_factor(0, max_iters=100) == 1.0
    assert poly_factor(50, max_iters=100) == pytest.approx(0.5**0.9)
    assert poly_factor(90, max_iters=100, power=2.0) == pytest.approx(0.01)
    assert poly_factor(100, max_iters=100) == 0.0


def test_warmup_ramps_linearly_then_poly() -> None:
    kw = {"max_iters": 100, "warmup_iters": 10, "warmup_factor": 0.1}
    assert poly_factor(0, **kw) == pytest.approx(0.1)
    assert poly_factor(5, **kw) == pytest.approx(0.55 * (1 - 0.05) ** 0.9)
    assert poly_factor(10, **kw) == pytest.approx(poly_factor(10, max_iters=100))


def test_scheduler_sets_lr_per_iteration_for_every_group() -> None:
    model = nn.Sequential()
    model.add_module("backbone", nn.Conv2d(3, 3, 1))
    model.add_module("head", nn.Conv2d(3, 2, 1))
    opt = build_optimizer(model, lr=0.1, head_lr_mult=10.0)
    assert [g["name"] for g in opt.param_groups] == ["backbone", "head"]
    assert opt.defaults["momentum"] == 0.9 and opt.defaults["weight_decay"] == 0.0
    sched = build_scheduler(opt, max_iters=20)
    for t in range(5):
        expected = 0.1 * (1 - t / 20) ** 0.9
        assert opt.param_groups[0]["lr"] == pytest.approx(expected)
        assert opt.param_groups[1]["lr"] == pytest.approx(10 * expected)
        opt.step()
        sched.step()


def test_head_groups_split_a_real_model_by_backbone() -> None:
    model = build_model("dualseg_mobilenet_v2", num_classes=3, renet_hidden=4)
    backbone, head = param_groups(model, lr=1.0, head_lr_mult=10.0)
    names = {id(p): n for n, p in model.named_parameters()}
    assert backbone["lr"] == 1.0 and head["lr"] == 10.0
    assert all(".backbone." in names[id(p)] for p in backbone["params"])
    head_names = [names[id(p)] for p in head["params"]]
    assert any("aspp" in n for n in head_names) and any("renet" in n for n in head_names)
    assert len(backbone["params"]) + len(head["params"]) == len(names)
    assert len(param_groups(model, lr=1.0)) == 1


def test_schedule_survives_a_checkpoint(tmp_path: Path) -> None:
    def make() -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, nn.Module]:
        torch.manual_seed(0)
        m = nn.Linear(2, 2)
        o = build_optimizer(m, lr=0.1)
        return o, build_scheduler(o, max_iters=10, warmup_iters=3), m

    opt, sched, model = make()
    for _ in range(4):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        sched.step()
    state = {"arch": "x", "model_kwargs": {}, "model": model.state_dict()}
    state |= {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
    ckpt = load_checkpoint(save_checkpoint(tmp_path / "c.pt", state))
    opt2, sched2, _ = make()
    opt2.load_state_dict(ckpt["optimizer"])
    sched2.load_state_dict(ckpt["scheduler"])
    sched.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    momentum = opt.state[opt.param_groups[0]["params"][0]]["momentum_buffer"]
    momentum2 = opt2.state[opt2.param_groups[0]["params"][0]]["momentum_buffer"]
    assert torch.equal(momentum, momentum2)
