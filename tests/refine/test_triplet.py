"""Triplet sampling and hinge loss (method B step 4)."""

from __future__ import annotations

import math

import torch
from torch import nn

from dualseg.refine import EmbeddingNet, RefinerConfig, sample_triplets, triplet_loss, triplet_step


def test_triplet_loss_equals_slow_reference() -> None:
    emb = torch.randn(40, 6)
    labels = torch.randint(0, 4, (40,))
    labels[0] = 9  # a class with one sample: never an anchor, can be a negative
    margin = 0.7
    t1, t2, f0 = sample_triplets(labels, 200, generator=torch.Generator().manual_seed(1))
    loss, stats = triplet_loss(
        emb, labels, margin=margin, num_triplets=200, generator=torch.Generator().manual_seed(1)
    )
    ref, violating = 0.0, 0
    for a, p, n in zip(t1.tolist(), t2.tolist(), f0.tolist()):
        assert a != p and labels[a] == labels[p] != labels[n] and labels[a] != 9
        d_ap = math.dist(emb[a].tolist(), emb[p].tolist())
        d_an = math.dist(emb[a].tolist(), emb[n].tolist())
        ref += max(0.0, margin + d_ap - d_an)
        violating += margin + d_ap - d_an > 0
    assert math.isclose(float(loss), ref / 200, rel_tol=1e-5)
    assert stats["num_triplets"] == 200
    assert math.isclose(stats["violating"], violating / 200, rel_tol=1e-6)
    assert sample_triplets(torch.tensor([2, 2, 2, 2]), 10) is None  # one class: no triplet


def test_steps_on_separable_toy_problem_drive_violations_to_zero() -> None:
    # 4 vertical stripes of 4 classes; each class has its own colour plus noise
    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(4).repeat_interleave(8).expand(4, 32, 32).clone()  # [B,H,W]
    colours = torch.randn(4, 3, generator=gen)
    images = colours[labels].permute(0, 3, 1, 2) + 0.3 * torch.randn(4, 3, 32, 32, generator=gen)
    net = EmbeddingNet(nn.Sequential(nn.Conv2d(3, 16, 1), nn.ReLU()), nn.Conv2d(16, 8, 1), 8)
    cfg = RefinerConfig(radius=2, margin=1.0, num_triplets=512, lr=0.02)
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    history = [
        triplet_step(net, opt, images, labels, cfg, torch.Generator().manual_seed(s))
        for s in range(40)
    ]
    assert history[0]["violating"] > 0.3
    assert history[-1]["violating"] < 0.05
    assert history[-1]["margin"] > history[0]["margin"]
