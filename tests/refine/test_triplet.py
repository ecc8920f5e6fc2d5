"""Triplet sampling and hinge loss (method B step 4)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dualseg.errors import ConfigError
from dualseg.refine import EmbeddingNet, RefinerConfig, sample_triplets, triplet_loss, triplet_step
from dualseg.refine.triplet import mine_negatives


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


@pytest.mark.parametrize("mining", ["random", "semi-hard"])
def test_steps_on_separable_toy_problem_drive_violations_to_zero(mining: str) -> None:
    # 4 vertical stripes of 4 classes; each class has its own colour plus noise
    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(4).repeat_interleave(8).expand(4, 32, 32).clone()  # [B,H,W]
    colours = torch.randn(4, 3, generator=gen)
    images = colours[labels].permute(0, 3, 1, 2) + 0.3 * torch.randn(4, 3, 32, 32, generator=gen)
    net = EmbeddingNet(nn.Sequential(nn.Conv2d(3, 16, 1), nn.ReLU()), nn.Conv2d(16, 8, 1), 8)
    opt = torch.optim.Adam(net.parameters(), lr=0.02)
    history = [
        triplet_step(
            net,
            opt,
            images,
            labels,
            generator=torch.Generator().manual_seed(s),
            radius=2,
            edge_method="canny",
            num_triplets=512,
            margin=1.0,
            mining=mining,
            input_scale=0.5,
        )
        for s in range(40)
    ]
    assert history[0]["violating"] > 0.3
    assert history[-1]["violating"] < 0.05
    assert history[-1]["margin"] > history[0]["margin"]


def test_a_pool_of_negatives_are_all_false_examples_and_one_negative_is_the_plain_draw() -> None:
    labels = torch.randint(0, 3, (50,), generator=torch.Generator().manual_seed(0))
    t1, t2, pool = sample_triplets(
        labels, 100, negatives=6, generator=torch.Generator().manual_seed(3)
    )
    assert pool.shape == (100, 6)
    assert (labels[pool] != labels[t1][:, None]).all() and (labels[t1] == labels[t2]).all()
    assert len(set(pool.flatten().tolist())) > 10  # the pool is drawn, not one index repeated
    # one negative per anchor reads the random stream as before: the same triplets
    plain = sample_triplets(labels, 100, generator=torch.Generator().manual_seed(3))
    single = sample_triplets(labels, 100, negatives=1, generator=torch.Generator().manual_seed(3))
    assert all(torch.equal(a, b) for a, b in zip(plain, single))


def test_semi_hard_takes_the_nearest_negative_beyond_the_positive_else_the_farthest() -> None:
    # 1-D embeddings: anchor at 0, positive at 1 (d_pos = 1)
    emb = torch.tensor([[0.0], [1.0], [0.5], [1.5], [3.0], [0.2], [0.8]])
    t1, t2 = torch.tensor([0, 0]), torch.tensor([1, 1])
    pool = torch.tensor([[2, 4, 3], [5, 6, 2]])  # row 1: every negative nearer than the positive
    assert mine_negatives(emb, t1, t2, pool, "semi-hard").tolist() == [3, 6]
    assert mine_negatives(emb, t1, t2, pool, "random").tolist() == [2, 5]
    with pytest.raises(ConfigError, match="mining"):
        RefinerConfig(mining="hard")


def test_semi_hard_triplets_violate_more_than_random_ones_on_the_same_embedding() -> None:
    # a half-trained embedding: most random negatives are already easy, semi-hard ones are not
    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(5).repeat_interleave(60)
    emb = torch.randn(5, 4, generator=gen)[labels] * 1.5 + 0.6 * torch.randn(300, 4, generator=gen)
    kw = {"margin": 1.0, "num_triplets": 2000}
    _, rand = triplet_loss(emb, labels, mining="random", generator=gen.manual_seed(1), **kw)
    _, semi = triplet_loss(emb, labels, mining="semi-hard", generator=gen.manual_seed(1), **kw)
    assert semi["violating"] > rand["violating"] + 0.1 and semi["margin"] < rand["margin"]
