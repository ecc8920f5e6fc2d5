"""Method B's decision at near-boundary pixels (P3-P5), and the readings beyond the claim."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dualseg.errors import DataError
from dualseg.refine.boundary import near_boundary_mask
from dualseg.refine.embedding import EmbeddingNet


def are_probabilities(scores: Tensor) -> bool:
    """Whether class scores (classes on dim 1) are probabilities, else logits."""
    if scores.numel() == 0:
        return True
    if bool(scores.min() < 0):
        return False
    return bool((scores.sum(1) - 1).abs().max() <= 1e-3)  # allclose would make copies


def prototype_scores(feats: Tensor, prototypes: Tensor) -> Tensor:
    """``s_k = |p_k|^2 - 2 e.p_k`` of embeddings ``feats [b,C,h,w]``: ``[b,K,h,w]``."""
    return prototype_row_scores(feats.movedim(1, -1), prototypes).movedim(-1, 1)


def prototype_row_scores(rows: Tensor, prototypes: Tensor) -> Tensor:
    """:func:`prototype_scores` of embeddings on the last dim (``[...,C]``): ``[...,K]``."""
    return rows.float() @ (-2 * prototypes).T + prototypes.pow(2).sum(1)


def kept_rows(x: Tensor, keep: Tensor) -> Tensor:
    """``x[keep]`` (``keep`` bool ``[B]``), without a copy when every image is kept."""
    return x if bool(keep.all()) else x[keep]


def prototype_scale(prototypes: Tensor, present: Tensor) -> float:
    """The mean squared distance between two present prototypes (1.0 with fewer than two): the
    unit of ``prior_weight``."""
    p = prototypes[present.to(prototypes.device)].double()
    if p.shape[0] < 2:
        return 1.0
    d2 = torch.cdist(p, p).pow(2)
    k = p.shape[0]
    scale = float(d2.sum() / (k * (k - 1)))
    return scale if scale > 0 else 1.0


@dataclass(frozen=True)
class Candidates:
    """What every decision needs at the M near-boundary pixels (``edge.nonzero()`` order)."""

    pred: Tensor  # [B,H,W] int64, the base's argmax (P2)
    edge: Tensor  # [B,H,W] bool, near-boundary pixels of Pred (P4), not gated
    labels: Tensor  # [M,N] int64, the Top-N labels (P3), most probable first
    distance: Tensor  # [M,N] squared distance to the label's prototype, less |e|^2, in units
    #                   of the prototype scale; +inf where the label has no prototype
    log_prob: Tensor  # [M,N] the base's log-probability of each candidate
    margin: Tensor  # [M] the base's top-1 minus top-2 probability
    index: Tensor | None = None  # [M] edge's flat indices into [B·H·W] (None: from edge)


def gather_candidates(
    probs: Tensor, scores: Callable[[Tensor, Tensor], Tensor], present: Tensor, *, top_n: int,
    radius: int, edge_method: str, scale: float = 1.0, covered: tuple[float, float] | None = None,
) -> Candidates:  # fmt: skip
    """P2-P4 and P5's distances on class scores ``probs [B,C,H,W]`` (probabilities or logits)."""
    p = probs.float()
    # P2's Pred: the first index on ties, as argmax (several times slower on the CPU; topk
    # picks others)
    top, pred = p.max(1)  # [B,H,W]
    # max propagates NaN and a float64 sum cannot overflow: ~6x faster than isfinite().all()
    if not bool(top.sum(dtype=torch.float64).isfinite()):
        raise DataError(
            "the base model's class probabilities hold NaN or infinite values: a broken model "
            "or input, or log-probabilities of an exact 0"
        )
    edge = near_boundary_mask(pred, radius=radius, ignore_index=None, method=edge_method)  # P4
    # P3 only at the M near-boundary pixels (a top-k over the whole map costs more)
    index = edge.reshape(-1).nonzero().squeeze(1)  # [M] flat, edge.nonzero() order
    # classes first: a softmax over C runs ~15x faster along M than row by row on the CPU
    if p.shape[0] > 1:
        cols = p.movedim(1, 0)[:, edge]  # [C,M]
    elif (one := p[0].flatten(1)).is_contiguous():  # [C,H·W] (gather: ~1.4x the time here)
        cols = one.index_select(1, index)
    else:  # a cropped map: index_select would copy it first, gather reads it in place
        cols = one.gather(1, index.expand(len(one), -1))
    n = min(top_n, p.shape[1])
    cand = cols.T.topk(n, dim=1).indices  # [M,N] P3, most probable first (softmax keeps order)
    prob = cols if are_probabilities(cols[None]) else cols.softmax(0)  # [C,M]
    cand_p = prob.T.gather(1, cand)  # [M,N]
    second = cand_p[:, 1] if n > 1 else torch.zeros_like(cand_p[:, 0])
    if len(index):
        keep = edge.flatten(1).any(1) if p.shape[0] > 1 else index.new_ones(1, dtype=torch.bool)
        band = kept_rows(edge, keep)
        s = EmbeddingNet.sample(scores(keep, band), band, covered)  # [M,K], edge.nonzero() order
        dist = s.gather(1, cand) / scale  # [M,N]
        if not bool(present.all()):
            absent = ~present.to(dist.device)
            # a label without a prototype is never the nearest, and a pixel whose base label
            # has none keeps it (no candidate is known nearer)
            dist = dist.masked_fill(absent[cand], float("inf"))
            base_absent = absent[pred.reshape(-1)[index]]  # [M]
            dist = dist.masked_fill(base_absent[:, None], float("inf"))
    else:
        dist = torch.zeros(cand.shape, dtype=torch.float32, device=cand.device)
    log_prob = cand_p.clamp_min(1e-12).log()
    return Candidates(pred, edge, cand, dist, log_prob, cand_p[:, 0] - second, index)


def decide(
    c: Candidates, *, gate_margin: float | None = None, prior_weight: float = 0.0,
    min_prob: float = 0.0, switch_cost: float = 0.0,
    blocked_switches: Sequence[tuple[int, int]] = (),
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """P5 with the readings above: ``(labels [B,H,W] int64, changed bool [B,H,W])``."""
    where = c.edge.reshape(-1).nonzero().squeeze(1) if c.index is None else c.index  # [M]
    base = c.pred.reshape(-1).index_select(0, where)  # [M], Pred (argmax: maybe not labels[:, 0])
    other = c.labels != base[:, None]  # [M,N]; on tied probabilities Top-N may omit the base
    score = c.distance
    if prior_weight > 0:
        score = score - prior_weight * c.log_prob
    if min_prob > 0:  # the base's own label is always a candidate
        score = score.masked_fill(other & (c.log_prob < math.log(min_prob)), math.inf)
    if switch_cost > 0:  # another label must beat the base's by more than the cost
        score = score + switch_cost * other
    low, at = score.min(1)  # min's index: the first minimum, as argmin's
    best = c.labels.gather(1, at[:, None]).squeeze(1)
    held = score.masked_fill(other, math.inf).amin(1)  # the base's score (inf: none)
    new = torch.where(torch.isfinite(low) & (low < held), best, base)  # a tie keeps the base
    if gate_margin is not None:  # beyond the claim: only where the base is unsure
        new = torch.where(c.margin < gate_margin, new, base)
    if blocked_switches and len(new):  # a relabel from a to b that held-out images showed breaks
        pairs = torch.tensor(blocked_switches, device=new.device)  # [P,2]
        k = 1 + max(int(pairs.max()), int(base.max()), int(new.max()))
        table = torch.zeros(k, k, dtype=torch.bool, device=new.device)  # [a,b]: blocked
        table[pairs[:, 0], pairs[:, 1]] = True
        new = torch.where(table[base, new], base, new)
    out = c.pred.clone(memory_format=torch.contiguous_format)
    out.view(-1)[where] = new
    return out, out != c.pred


def describe_decision(
    *, gate_margin: float | None = None, prior_weight: float = 0.0, min_prob: float = 0.0,
    switch_cost: float = 0.0, blocked_switches: Sequence[Sequence[int]] = (),
    p1_blur_sigma: float = 0.0,
) -> str:  # fmt: skip
    """A decision setting in words: its readings beyond the claim, or "the claim's rule"."""
    if gate_margin == 0:
        return "gate 0: never relabel"
    named = (("gate", gate_margin if gate_margin is not None else 0), ("prior", prior_weight),
             ("floor", min_prob), ("switch cost", switch_cost),
             ("P1 blur", p1_blur_sigma))  # fmt: skip
    words = [f"{k} {v:g}" for k, v in named if v]
    if blocked_switches:
        words.append(f"{len(blocked_switches)} switch{'es' if len(blocked_switches) > 1 else ''}"
                     " blocked")  # fmt: skip
    return ", ".join(words) or "the claim's rule"


def switch_names(pairs: Sequence[tuple[int, int]], names: Sequence[str]) -> str:
    """Blocked switches by their classes too: ``1:4 (sidewalk -> road)``."""
    return " ".join(f"{a}:{b} ({names[a]} -> {names[b]})" for a, b in pairs) or "none"
