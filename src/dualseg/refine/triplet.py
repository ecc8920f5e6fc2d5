"""Triplet metric learning on near-boundary embeddings (method B, training step 4)."""

from __future__ import annotations

from typing import TypedDict

import torch
from torch import Tensor

from dualseg.refine.boundary import near_boundary_mask
from dualseg.refine.embedding import EmbeddingNet, embed_pixels


class TripletStats(TypedDict):
    num_triplets: int  # triplets sampled (0: no class had two samples next to another class)
    violating: float  # fraction with d(T1,F0) - d(T1,T2) < Δ (positive loss)
    margin: float  # mean of d(T1,F0) - d(T1,T2)
    loss: float


def sample_triplets(
    labels: Tensor, num_triplets: int, *, negatives: int = 1,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor] | None:  # fmt: skip
    """Indices ``(t1, t2, f0)`` into ``labels`` ``[N]``: ``t1``, ``t2`` ``[num_triplets]``, ``f0``
    ``[num_triplets]`` (``negatives=1``) or ``[num_triplets, negatives]`` (a pool of false
    examples per anchor, for mining)."""
    n = labels.numel()
    if n < 3 or num_triplets <= 0:
        return None
    dev = labels.device
    order = torch.argsort(labels, stable=True)  # sorted position -> original index
    sorted_labels = labels[order]
    _, inverse, counts = torch.unique_consecutive(
        sorted_labels, return_inverse=True, return_counts=True
    )
    if counts.numel() < 2:
        return None
    starts = torch.cumsum(counts, 0) - counts
    per_pos_count = counts[inverse]  # [N] size of each sample's class
    eligible = (per_pos_count >= 2).nonzero().squeeze(1)  # sorted positions usable as T1
    if eligible.numel() == 0:
        return None

    def randint(high: Tensor) -> Tensor:  # uniform integer in [0, high) per element
        u = torch.rand(high.shape, generator=generator, device="cpu").to(dev)
        return torch.minimum((u * high).long(), high - 1)

    size = torch.full((num_triplets,), eligible.numel(), device=dev)
    anchor = eligible[randint(size)]  # sorted positions
    cls = inverse[anchor]
    start, count = starts[cls], counts[cls]
    # positive: one of the other count-1 members of the run
    k = randint(count - 1)
    own = anchor - start
    positive = start + k + (k >= own).long()
    # negative(s): one of the n - count samples outside the run, `negatives` times
    outside = (n - count)[:, None].expand(-1, negatives)
    start = start[:, None]
    r = randint(outside)
    negative = torch.where(r < start, r, r + count[:, None])  # [T, negatives]
    f0 = order[negative]
    return order[anchor], order[positive], (f0[:, 0] if negatives == 1 else f0)


def mine_negatives(emb: Tensor, t1: Tensor, t2: Tensor, pool: Tensor, mining: str) -> Tensor:
    """F0 ``[T]`` from a pool of false examples ``pool [T,K]``: the first (random), or
    semi-hard: the nearest farther from T1 than T2, else the farthest."""
    if mining == "random" or pool.shape[1] == 1:
        return pool[:, 0]
    with torch.no_grad():
        a = emb[t1]  # [T,C]
        d_pos = _euclidean(a, emb[t2])  # [T]
        d_neg = _euclidean(a[:, None], emb[pool])  # [T,K]
        farther = d_neg > d_pos[:, None]
        semi_hard = d_neg.masked_fill(~farther, float("inf")).argmin(1)
        pick = torch.where(farther.any(1), semi_hard, d_neg.argmax(1))
    return pool.gather(1, pick[:, None]).squeeze(1)


def triplet_hinge(
    emb: Tensor, t1: Tensor, t2: Tensor, f0: Tensor, margin: float
) -> tuple[Tensor, Tensor]:
    """Per-triplet hinge ``max(0, Δ + d(T1,T2) - d(T1,F0))`` and ``d(T1,F0) - d(T1,T2)``."""
    a = emb[t1]
    d_pos = _euclidean(a, emb[t2])
    d_neg = _euclidean(a, emb[f0])
    gap = d_neg - d_pos
    return torch.relu(margin - gap), gap


def _euclidean(a: Tensor, b: Tensor) -> Tensor:
    # sqrt with a tiny floor: the gradient of sqrt at 0 is infinite (T1 == T2 happens early on)
    return ((a - b).pow(2).sum(-1) + 1e-12).sqrt()


def triplet_loss(
    emb: Tensor, labels: Tensor, *, margin: float = 1.0, num_triplets: int = 4096,
    reduction: str = "all", mining: str = "random", pool: int = 8,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, TripletStats]:  # fmt: skip
    """Sampled triplet hinge loss over near-boundary embeddings ``emb [N,C]``, ``labels [N]``
    (``reduction``: ``all`` or ``violating``, the mean over the violating triplets only)."""
    negatives = pool if mining == "semi-hard" else 1
    triplets = sample_triplets(labels, num_triplets, negatives=negatives, generator=generator)
    if triplets is None:
        return emb.sum() * 0.0, TripletStats(num_triplets=0, violating=0.0, margin=0.0, loss=0.0)
    t1, t2, f0 = triplets
    return _loss(emb, t1, t2, f0.view(t1.numel(), -1), margin, reduction, mining)


def _loss(
    emb: Tensor, t1: Tensor, t2: Tensor, pool: Tensor, margin: float, reduction: str, mining: str
) -> tuple[Tensor, TripletStats]:
    hinge, gap = triplet_hinge(emb, t1, t2, mine_negatives(emb, t1, t2, pool, mining), margin)
    violating = hinge > 0
    loss = hinge.mean() if reduction == "all" else hinge.sum() / violating.sum().clamp(min=1)
    stats = TripletStats(
        num_triplets=int(hinge.numel()),
        violating=float(violating.float().mean()),
        margin=float(gap.detach().mean()),
        loss=float(loss.detach()),
    )
    return loss, stats


def triplet_step(
    net: EmbeddingNet, opt: torch.optim.Optimizer, images: Tensor, labels: Tensor, *,
    generator: torch.Generator, radius: int, edge_method: str, num_triplets: int, margin: float,
    reduction: str = "all", mining: str = "random", mining_pool: int = 8, input_scale: float = 1.0,
    output_stride: int = 16, ignore_index: int = 255,
) -> dict[str, float]:  # fmt: skip
    """One step 2-4 iteration on a batch; only the pixels the triplets draw are embedded."""
    edge = near_boundary_mask(labels, radius=radius, ignore_index=ignore_index, method=edge_method)
    negatives = mining_pool if mining == "semi-hard" else 1
    triplets = sample_triplets(labels[edge], num_triplets, negatives=negatives, generator=generator)
    if triplets is None:
        stats = TripletStats(num_triplets=0, violating=0.0, margin=0.0, loss=0.0)
        return {**stats, "pixels": int(edge.sum())}
    t = triplets[0].numel()
    used, inverse = torch.unique(torch.cat([x.flatten() for x in triplets]), return_inverse=True)
    where = edge.nonzero()[used]  # [U,3]
    sub = torch.zeros_like(edge)
    sub[where[:, 0], where[:, 1], where[:, 2]] = True  # nonzero() order == sorted `used` order
    emb = embed_pixels(net, images, sub, input_scale, output_stride)  # [U,C]
    pool = inverse[2 * t :].view(t, -1)
    loss, stats = _loss(emb, inverse[:t], inverse[t : 2 * t], pool, margin, reduction, mining)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return {**stats, "pixels": int(edge.sum())}
